import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT
from gguf import quants as gq

from engine.quant.dequant import SUPPORTED_TYPES, UnsupportedQuantType, check_supported, dequantize

N_BLOCKS = 384

# Byte offsets of the fp16 scale fields in each block layout (ggml-common.h).
F16_FIELDS = {
    QT.Q4_0: (0,), QT.Q4_1: (0, 2), QT.Q5_0: (0,), QT.Q5_1: (0, 2), QT.Q8_0: (0,),
    QT.Q2_K: (80, 82), QT.Q3_K: (108,), QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,),
}


def random_blocks(qtype: QT, n_blocks: int, seed: int) -> np.ndarray:
    """Random bytes of `n_blocks` blocks whose float fields are finite and sane."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n = n_blocks * block_size
    if qtype == QT.F32:
        return rng.standard_normal(n).astype(np.float32).view(np.uint8)
    if qtype == QT.F16:
        return rng.standard_normal(n).astype(np.float16).view(np.uint8)
    if qtype == QT.BF16:
        bits = rng.standard_normal(n).astype(np.float32).view(np.uint32) >> 16
        return bits.astype(np.uint16).view(np.uint8)
    blocks = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    for start in F16_FIELDS.get(qtype, ()):
        scale = rng.uniform(0, 0.1, (n_blocks, 1)).astype(np.float16)
        blocks[:, start:start + 2] = scale.view(np.uint8)
    if qtype == QT.MXFP4:
        # e8m0 exponents 2^-27 .. 2^12 (and the subnormal corner 0, 1) keep values finite.
        blocks[:, 0] = rng.choice(np.r_[0, 1, 100:140], n_blocks)
    return blocks.reshape(-1)


def reference(raw: np.ndarray, qtype: QT, shape: tuple[int, ...]) -> torch.Tensor:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    byte_shape = (*shape[:-1], shape[-1] // block_size * type_size)
    return torch.from_numpy(np.ascontiguousarray(gq.dequantize(raw.reshape(byte_shape), qtype)))


def logical_shape(qtype: QT, n_blocks: int) -> tuple[int, ...]:
    block_size = GGML_QUANT_SIZES[qtype][0]
    return (4, 3, n_blocks // 12 * block_size)


@pytest.mark.parametrize("qtype", sorted(SUPPORTED_TYPES, key=lambda t: t.name), ids=lambda t: t.name)
@pytest.mark.parametrize("seed", [0, 1])
def test_bit_exact_with_gguf_numpy(qtype: QT, seed: int) -> None:
    raw = random_blocks(qtype, N_BLOCKS, seed)
    shape = logical_shape(qtype, N_BLOCKS)
    want = reference(raw, qtype, shape)
    assert torch.isfinite(want).all()
    got = dequantize(torch.from_numpy(raw), qtype, shape)
    assert got.dtype == torch.float32 and got.shape == shape
    assert torch.equal(got, want)
    # Bitwise too: torch.equal would let -0.0 stand for +0.0.
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("qtype", [QT.F32, QT.Q4_K])
def test_accepts_byte_shaped_and_offset_views(qtype: QT) -> None:
    raw = random_blocks(qtype, 48, seed=3)
    shape = logical_shape(qtype, 48)
    want = reference(raw, qtype, shape)
    padded = torch.cat([torch.zeros(1, dtype=torch.uint8), torch.from_numpy(raw)])
    assert torch.equal(dequantize(padded[1:], qtype, shape), want)
    assert torch.equal(dequantize(torch.from_numpy(raw).reshape(12, -1), qtype, shape), want)


def test_f32_result_does_not_alias_input() -> None:
    raw = torch.from_numpy(random_blocks(QT.F32, 8, seed=4))
    out = dequantize(raw, QT.F32, (8,))
    out.zero_()
    assert raw.any()


def test_wrong_byte_count_or_row_length() -> None:
    raw = torch.zeros(34 * 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match="expected 34 uint8 bytes"):
        dequantize(raw, QT.Q8_0, (32,))
    with pytest.raises(ValueError, match="multiple of 32"):
        dequantize(raw, QT.Q8_0, (2, 48))


@pytest.mark.parametrize("qtype", [QT.IQ2_XXS, QT.IQ4_NL, QT.TQ1_0, QT.Q8_1])
def test_unsupported_type_names_type_and_llamacpp_engine(qtype: QT) -> None:
    with pytest.raises(UnsupportedQuantType) as info:
        dequantize(torch.zeros(1024, dtype=torch.uint8), qtype, (256,))
    assert qtype.name in str(info.value) and "--engine llamacpp" in str(info.value)
    assert isinstance(info.value, ValueError)
    with pytest.raises(UnsupportedQuantType, match=rf"blk\.3\.ffn_up_exps\.weight.*{qtype.name}"):
        check_supported(qtype, "blk.3.ffn_up_exps.weight")


def test_check_supported_accepts_supported() -> None:
    for qtype in SUPPORTED_TYPES:
        check_supported(qtype, "x")


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", sorted(SUPPORTED_TYPES, key=lambda t: t.name), ids=lambda t: t.name)
def test_cuda_matches_cpu(qtype: QT) -> None:
    raw = random_blocks(qtype, N_BLOCKS, seed=5)
    shape = logical_shape(qtype, N_BLOCKS)
    got = dequantize(torch.from_numpy(raw).cuda(), qtype, shape)
    assert got.device.type == "cuda"
    assert torch.equal(got.cpu(), reference(raw, qtype, shape))
