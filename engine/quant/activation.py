"""The rounding ggml's CPU matmul applies to activations before a dot product.

ggml multiplies a quantized weight row by an activation row only after converting the
activation to the weight type's `vec_dot_type` (type_traits_cpu in ggml-cpu/ggml-cpu.c).
A reference that skips this step differs from llama.cpp by ~1e-2 on quantized models;
applying `round_activation` to x and then multiplying by the dequantized weight brings that
to float-summation noise. The returned values are dequant(quant(x)) as float32.

The Q8_0/Q8_1 recipe is the one ggml's x86 SIMD path runs (ggml-cpu/arch/x86/quants.c,
quantize_row_q8_0/q8_1): scale by 127/amax and round half to even. It differs from
quantize_row_q8_0_ref (used by gguf-py and by builds without AVX), which scales by 1/d and
rounds half away from zero: ties (x = 0.5 units) and about one value in 10^5 round apart.
"""
from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as QT

from engine.quant.dequant import check_supported

QK8_0 = 32
QK_K = 256

_VEC_DOT_TYPE: dict[QT, QT] = {
    QT.F32: QT.F32, QT.F16: QT.F16, QT.BF16: QT.BF16,
    QT.Q4_0: QT.Q8_0, QT.Q5_0: QT.Q8_0, QT.Q8_0: QT.Q8_0, QT.MXFP4: QT.Q8_0,
    QT.Q4_1: QT.Q8_1, QT.Q5_1: QT.Q8_1,
    QT.Q2_K: QT.Q8_K, QT.Q3_K: QT.Q8_K, QT.Q4_K: QT.Q8_K, QT.Q5_K: QT.Q8_K, QT.Q6_K: QT.Q8_K,
}


def activation_type(weight_qtype: QT) -> QT:
    """The type ggml's CPU backend converts activations to for weights of `weight_qtype`."""
    check_supported(weight_qtype)
    return _VEC_DOT_TYPE[weight_qtype]


def _blocks(x: torch.Tensor, size: int, qtype: QT) -> torch.Tensor:
    if x.shape[-1] % size:
        raise ValueError(f"{qtype.name} activations need a row length that is a multiple of {size}, "
                         f"got shape {tuple(x.shape)}")
    return x.reshape(-1, size)


def _div(a: torch.Tensor | float, b: torch.Tensor | float) -> torch.Tensor:
    # One correctly rounded division, as in C. torch computes `scalar / tensor` as
    # reciprocal() times the scalar, and on CUDA `tensor / scalar` as a multiply by 1/scalar.
    like = a if isinstance(a, torch.Tensor) else b
    a = a if isinstance(a, torch.Tensor) else torch.full_like(like, a)
    b = b if isinstance(b, torch.Tensor) else torch.full_like(like, b)
    return a / b


def _q8_0(x: torch.Tensor) -> torch.Tensor:
    """Q8_0 and the quants of Q8_1 (which only adds a block sum, see round_activation)."""
    b = _blocks(x, QK8_0, QT.Q8_0)
    amax = b.abs().amax(dim=1, keepdim=True)
    d = _div(amax, 127.0)
    inv = torch.where(amax != 0, _div(127.0, amax), torch.zeros_like(amax))
    # Half to even, as _mm256_round_ps(_MM_ROUND_NEAREST); int8 as ggml stores it (and +0 for -0).
    q = torch.round(b * inv).to(torch.int8)
    return (d.half().float() * q).reshape(x.shape)


def _q8_k(x: torch.Tensor) -> torch.Tensor:
    """quantize_row_q8_K_ref (ggml-quants.c), which every CPU backend uses for Q8_K."""
    b = _blocks(x, QK_K, QT.Q8_K)
    # The signed value of largest magnitude, first one on ties (the ref loop uses `>`).
    idx = b.abs().argmax(dim=1, keepdim=True)
    vmax = b.gather(1, idx)
    zero = vmax == 0
    iscale = _div(-127.0, torch.where(zero, torch.ones_like(vmax), vmax))
    d = _div(1.0, iscale)
    # nearest_int() adds 1.5 * 2^23, i.e. rounds half to even for these magnitudes.
    q = torch.round(iscale * b).clamp_max(127.0).to(torch.int8)
    out = torch.where(zero, torch.zeros_like(b), d * q)
    return out.reshape(x.shape)


def round_activation(x: torch.Tensor, weight_qtype: QT) -> torch.Tensor:
    """x (float32, last axis = row) rounded as ggml rounds it before a dot with `weight_qtype`.

    For Q4_1/Q5_1 weights ggml uses Q8_1, whose dot product takes the weight minimum times a
    block sum stored separately as fp16(d * sum(q)); no elementwise rounding can express
    that fp16 rounding, so the result here matches ggml to about 2^-11 of that term.
    """
    x = x.float()
    target = activation_type(weight_qtype)
    if target == QT.F32:
        return x
    if target == QT.F16:
        return x.half().float()
    if target == QT.BF16:
        return x.bfloat16().float()
    if target in (QT.Q8_0, QT.Q8_1):
        return _q8_0(x)
    return _q8_k(x)

