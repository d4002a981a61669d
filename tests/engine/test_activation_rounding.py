import ctypes as C
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import quants as gq

from engine.quant.activation import activation_type, round_activation
from engine.quant.dequant import SUPPORTED_TYPES, UnsupportedQuantType

K_TYPES = [QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K]
F32 = np.float32


def activations(n_blocks: int, block: int, seed: int) -> np.ndarray:
    """Random rows with per-element magnitudes spread over decades, plus edge-case blocks:
    all zeros, one huge value, a negative extreme, tiny values, and two blocks whose scale is
    exactly 1 so that half-units are exact ties."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n_blocks, block)) * 10.0 ** rng.uniform(-3, 1, (n_blocks, block))).astype(F32)
    x[0] = 0
    x[1, 5] = 1e4
    x[2, 7] = -50
    x[3] *= F32(1e-6)
    x[4] = (np.arange(block) % 200) * F32(0.5) - 50
    x[4, -1] = 127
    x[5] = -x[4]
    return x.reshape(-1)


def q8_k_ref(x: np.ndarray) -> np.ndarray:
    """quantize_row_q8_K_ref + dequantize_row_q8_K (ggml-quants.c), transcribed per block."""
    out = np.zeros_like(x)
    for i, blk in enumerate(x.reshape(-1, 256)):
        amax, vmax = F32(0), F32(0)
        for v in blk:
            if abs(v) > amax:
                amax, vmax = abs(v), v
        if not amax:
            continue
        iscale = F32(-127) / vmax
        fval = (iscale * blk).astype(F32)
        # nearest_int: add 1.5 * 2^23 in float32, read the low mantissa bits back.
        bits = (fval + F32(12582912)).view(np.int32)
        q = np.minimum(127, (bits & 0x007FFFFF) - 0x00400000)
        out[i * 256:(i + 1) * 256] = (F32(1) / iscale) * q.astype(F32)
    return out


def q8_0_x86(x: np.ndarray) -> np.ndarray:
    """quantize_row_q8_0 of ggml-cpu/arch/x86/quants.c (the AVX path) + dequantize."""
    b = x.reshape(-1, 32)
    amax = np.abs(b).max(axis=1, keepdims=True)
    d = (amax / F32(127)).astype(np.float16).astype(F32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, F32(127) / amax, F32(0)).astype(F32)
    q = np.rint(b * inv).astype(np.int8)
    return (d * q.astype(F32)).reshape(-1)


def test_activation_type_follows_type_traits_cpu() -> None:
    assert {activation_type(t) for t in K_TYPES} == {QT.Q8_K}
    for t in (QT.Q4_0, QT.Q5_0, QT.Q8_0, QT.MXFP4):
        assert activation_type(t) == QT.Q8_0
    assert activation_type(QT.Q4_1) == activation_type(QT.Q5_1) == QT.Q8_1
    for t in (QT.F32, QT.F16, QT.BF16):
        assert activation_type(t) == t
    for t in SUPPORTED_TYPES:
        activation_type(t)
    with pytest.raises(UnsupportedQuantType, match="IQ3_S"):
        activation_type(QT.IQ3_S)


@pytest.mark.parametrize("weight", K_TYPES, ids=lambda t: t.name)
def test_q8_k_matches_ref_transcription(weight: QT) -> None:
    x = activations(24, 256, seed=0)
    got = round_activation(torch.from_numpy(x).reshape(4, -1), weight)
    assert got.shape == (4, 6 * 256)
    assert torch.equal(got.reshape(-1), torch.from_numpy(q8_k_ref(x)))


def test_q8_k_edge_cases() -> None:
    x = activations(24, 256, seed=1).reshape(-1, 256)
    got = round_activation(torch.from_numpy(x), QT.Q4_K).numpy()
    assert (got[0] == 0).all()
    assert np.isclose(got[1, 5], 1e4, rtol=1e-6) and np.isclose(got[2, 7], -50, rtol=1e-6)
    assert (np.abs(got[1]) < 1e4 / 127).sum() > 200  # everything else rounds to 0 or +-79
    # A positive and a negative extreme give the same result (the sign of d cancels).
    assert np.array_equal(round_activation(torch.from_numpy(-x), QT.Q4_K).numpy(), -got)


@pytest.mark.parametrize("weight", [QT.Q8_0, QT.Q4_0, QT.Q5_0, QT.MXFP4, QT.Q4_1, QT.Q5_1],
                         ids=lambda t: t.name)
def test_q8_0_matches_x86_transcription(weight: QT) -> None:
    x = activations(200, 32, seed=2)
    assert torch.equal(round_activation(torch.from_numpy(x), weight), torch.from_numpy(q8_0_x86(x)))


def test_q8_0_agrees_with_gguf_ref_quantizer_except_near_ties() -> None:
    # gguf-py mirrors quantize_row_q8_0_ref: scale 1/d and round half away from zero. ggml's
    # SIMD path (what the CPU backend runs) scales 127/amax and rounds half to even.
    x = activations(2000, 32, seed=3)
    ref = gq.dequantize(gq.quantize(x.reshape(-1, 32), QT.Q8_0), QT.Q8_0).reshape(-1)
    got = round_activation(torch.from_numpy(x), QT.Q8_0).numpy()
    differ = got != ref
    ties = np.zeros_like(differ)
    ties[4 * 32:6 * 32] = True
    assert differ[ties].any()
    assert (differ & ~ties).sum() <= 3  # 127/amax and 1/(amax/127) differ by an ulp at times
    d = np.repeat(np.abs(x.reshape(-1, 32)).max(axis=1) / F32(127), 32).astype(np.float16).astype(F32)
    assert np.array_equal(np.abs(got - ref)[differ], d[differ])  # one quantum apart at most


def test_q8_0_rounds_half_to_even() -> None:
    x = torch.zeros(32)
    x[:6] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5])
    got = round_activation(x, QT.Q8_0)
    assert got[:6].tolist() == [127.0, 0.0, 2.0, 2.0, 0.0, -2.0]
    assert not torch.signbit(got[got == 0]).any()  # an int8 zero, never -0.0


@pytest.mark.parametrize("weight, dtype", [(QT.F16, torch.float16), (QT.BF16, torch.bfloat16)])
def test_float_weights_round_to_their_own_type(weight: QT, dtype: torch.dtype) -> None:
    x = torch.from_numpy(activations(8, 64, seed=4))
    assert torch.equal(round_activation(x, weight), x.to(dtype).float())


def test_f32_weights_leave_activations_alone() -> None:
    x = torch.from_numpy(activations(8, 64, seed=5))
    assert torch.equal(round_activation(x, QT.F32), x)


def test_row_length_must_fit_blocks() -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        round_activation(torch.zeros(2, 128), QT.Q4_K)
    with pytest.raises(ValueError, match="multiple of 32"):
        round_activation(torch.zeros(2, 48), QT.Q8_0)


def _ggml_cpu() -> C.CDLL:
    llama_cpp = pytest.importorskip("llama_cpp")
    lib = Path(llama_cpp.__file__).parent / "lib"
    C.CDLL(str(lib / "libggml-base.so"), mode=C.RTLD_GLOBAL)
    cpu = C.CDLL(str(lib / "libggml-cpu.so"), mode=C.RTLD_GLOBAL)
    cpu.ggml_cpu_init()

    class TypeTraitsCpu(C.Structure):
        _fields_ = [("from_float", C.c_void_p), ("vec_dot", C.c_void_p),
                    ("vec_dot_type", C.c_int), ("nrows", C.c_int64)]

    cpu.ggml_get_type_traits_cpu.restype = C.POINTER(TypeTraitsCpu)
    return cpu


@pytest.mark.parametrize("weight", [QT.Q8_0, QT.Q4_1, QT.Q4_K, QT.F16, QT.BF16], ids=lambda t: t.name)
def test_matches_the_ggml_library(weight: QT) -> None:
    """What the libggml that llama-cpp-python ships does on this machine, bit for bit."""
    cpu = _ggml_cpu()
    traits = cpu.ggml_get_type_traits_cpu(int(weight)).contents
    target = QT(traits.vec_dot_type)
    assert target == activation_type(weight)
    x = activations(16, 256, seed=6)
    # Q8_0: f16 d + 32 int8; Q8_1: f16 d, f16 s + 32 int8; Q8_K: f32 d + 256 int8 + 16 int16 sums.
    layout = {QT.Q8_0: (32, 34, 2, 2), QT.Q8_1: (32, 36, 2, 4), QT.Q8_K: (256, 292, 4, 4),
              QT.F16: (1, 2, 2, 2), QT.BF16: (1, 2, 2, 2)}[target]
    block, size, d_bytes, qs_at = layout
    out = np.zeros((x.size // block, size), np.uint8)
    from_float = C.CFUNCTYPE(None, C.c_void_p, C.c_void_p, C.c_int64)(
        cpu.ggml_get_type_traits_cpu(int(target)).contents.from_float)
    from_float(x.ctypes.data, out.ctypes.data, x.size)
    if target == QT.F16:
        want = out.view(np.float16).astype(F32).reshape(-1)
    elif target == QT.BF16:
        want = (out.view(np.uint16).astype(np.uint32) << 16).view(F32).reshape(-1)
    else:
        d = out[:, :d_bytes].copy().view(np.float16 if d_bytes == 2 else F32).astype(F32)
        want = (d * out[:, qs_at:qs_at + block].view(np.int8).astype(F32)).reshape(-1)
    got = round_activation(torch.from_numpy(x), weight)
    assert torch.equal(got.view(torch.int32), torch.from_numpy(want).view(torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("weight", [QT.Q8_0, QT.Q4_1, QT.Q4_K, QT.F16, QT.BF16], ids=lambda t: t.name)
def test_cuda_matches_cpu(weight: QT) -> None:
    x = torch.from_numpy(activations(64, 256, seed=7))
    got = round_activation(x.cuda(), weight)
    assert got.device.type == "cuda"
    assert torch.equal(got.cpu().view(torch.int32), round_activation(x, weight).view(torch.int32))
