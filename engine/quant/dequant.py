"""Dequantization of GGUF tensor bytes in torch: the reference every fast kernel is held to.

Each decoder mirrors gguf-py's numpy implementation (gguf/quants.py) operation by operation:
fp16 scales are widened to float32 first, and products and sums happen in the same order,
so the result is bit-identical to `gguf.quants.dequantize` on CPU and CUDA alike. Fused
forms (addcmul, FMA) are avoided on purpose: they round once where numpy rounds twice.
"""
from __future__ import annotations

import functools
from math import prod
from typing import Callable

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

QK_K = 256


class UnsupportedQuantType(ValueError):
    pass


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 field at byte `start` of every block, widened to float32, shape (n, 1)."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


@functools.lru_cache(maxsize=64)
def _constant(values: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small constant table on `device`, made once: a copy from host memory cannot run inside
    a CUDA graph's capture (the decode runner decodes its token's table row there)."""
    return torch.tensor(values, dtype=dtype, device=device)


def _shifts(blocks: torch.Tensor, *amounts: int) -> torch.Tensor:
    return _constant(amounts, torch.uint8, blocks.device)


def _bits(packed: torch.Tensor, width: int, group: int) -> torch.Tensor:
    """Unpacks `width`-bit fields, flat per block: for each run of `group` bytes, the lowest
    field of every byte, then the next field up, and so on (ggml's packing order)."""
    n = packed.shape[0]
    shift = _shifts(packed, *range(0, 8, width)).reshape(1, 1, -1, 1)
    q = packed.reshape(n, -1, 1, group) >> shift
    return (q & ((1 << width) - 1)).reshape(n, -1)


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    return _bits(qs, 4, group)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    q = _nibbles(b[:, 2:], 16).to(torch.int16) - 8
    return d * q.float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b, 0), _f16(b, 2)
    q = _nibbles(b[:, 4:], 16).float()
    return d * q + m


def _high_bits_32(qh: torch.Tensor) -> torch.Tensor:
    """Bit j of the little-endian u32 `qh` at column j, without an unaligned u32 view."""
    return (qh.reshape(-1, 4, 1) >> _shifts(qh, *range(8)).reshape(1, 1, 8)).reshape(-1, 32) & 1


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    qh = _high_bits_32(b[:, 2:6])
    ql = _nibbles(b[:, 6:], 16)
    q = (ql | (qh << 4)).to(torch.int16) - 16
    return d * q.float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b, 0), _f16(b, 2)
    qh = _high_bits_32(b[:, 4:8])
    ql = _nibbles(b[:, 8:], 16)
    return d * (ql | (qh << 4)).float() + m


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b, 0)


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales = b[:, :16]
    d, dmin = _f16(b, 80), _f16(b, 82)
    dl = (d * (scales & 0x0F).float()).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).float()).reshape(n, 16, 1)
    q = _bits(b[:, 16:80], 2, 32).reshape(n, 16, 16).float()
    return (dl * q - ml).reshape(n, QK_K)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    hmask, qs, packed = b[:, :32], b[:, 32:96], b[:, 96:108]
    d = _f16(b, 108)
    low = (packed[:, :8].reshape(n, 1, 8) >> _shifts(b, 0, 4).reshape(1, 2, 1)).reshape(n, 16)
    high = (packed[:, 8:].reshape(n, 1, 4) >> _shifts(b, 0, 2, 4, 6).reshape(1, 4, 1)).reshape(n, 16)
    scales = ((low & 0x0F) | ((high & 0x03) << 4)).to(torch.int16) - 32
    dl = (d * scales.float()).reshape(n, 16, 1)
    ql = _bits(qs, 2, 32).reshape(n, 16, 16).to(torch.int16)
    # A set hmask bit means "no offset"; a clear one subtracts 4.
    qh = (_bits(hmask, 1, 32).reshape(n, 16, 16) ^ 1).to(torch.int16)
    return (dl * (ql - (qh << 2)).float()).reshape(n, QK_K)


def _k_scale_min(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins of a Q4_K/Q5_K block (get_scale_min_k4 in ggml)."""
    p = packed.reshape(-1, 3, 4)
    d, m, md = p[:, 0], p[:, 1], p[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k_scaled(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scale_min(b[:, 4:16])
    dl = (d * sc.float()).reshape(n, 8, 1)
    ml = (dmin * mn.float()).reshape(n, 8, 1)
    return (dl * q.reshape(n, 8, 32).float() - ml).reshape(n, QK_K)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    return _k_scaled(b, _nibbles(b[:, 16:], 32))


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    return _k_scaled(b, _nibbles(b[:, 48:], 32) | (_bits(b[:, 16:48], 1, 32) << 4))


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql = _nibbles(b[:, :128], 64)
    qh = _bits(b[:, 128:192], 2, 32)
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(b, 208) * scales).reshape(n, 16, 1)
    q = ((ql | (qh << 4)).to(torch.int16) - 32).reshape(n, 16, 16).float()
    return (d * q).reshape(n, QK_K)


# e2m1 values, doubled; the halved e8m0 scale below undoes the doubling.
_MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    e = b[:, :1].to(torch.int32)
    # ggml_e8m0_to_fp32_half: 2^(e - 128) as float bits, subnormal for e < 2.
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    d = bits.view(torch.float32)
    values = _constant(_MXFP4_VALUES, torch.float32, b.device)
    return d * values[_nibbles(b[:, 1:], 16).long()]


_BLOCK_DECODERS: dict[QT, Callable[[torch.Tensor], torch.Tensor]] = {
    QT.Q4_0: _q4_0, QT.Q4_1: _q4_1, QT.Q5_0: _q5_0, QT.Q5_1: _q5_1, QT.Q8_0: _q8_0,
    QT.Q2_K: _q2_k, QT.Q3_K: _q3_k, QT.Q4_K: _q4_k, QT.Q5_K: _q5_k, QT.Q6_K: _q6_k,
    QT.MXFP4: _mxfp4,
}

SUPPORTED_TYPES: frozenset[QT] = frozenset({QT.F32, QT.F16, QT.BF16, *_BLOCK_DECODERS})


def check_supported(qtype: QT, tensor_name: str | None = None) -> None:
    """Raises UnsupportedQuantType (naming the tensor, if given) unless this engine runs `qtype`."""
    if qtype in SUPPORTED_TYPES:
        return
    where = f"tensor {tensor_name!r}: " if tensor_name else ""
    supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
    raise UnsupportedQuantType(
        f"{where}quantization type {qtype.name} is not supported by the MoE Studio engine "
        f"(supported: {supported}); the llama.cpp engine (--engine llamacpp) can run such models")


def dequantize(raw: torch.Tensor, qtype: QT, shape: tuple[int, ...]) -> torch.Tensor:
    """Float32 values of a GGUF tensor's bytes, on the device of `raw`.

    `shape` is the numpy-order logical shape; its last axis is the row length. The result
    never aliases `raw` (which may be a read-only memory map).
    """
    check_supported(qtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if not shape or shape[-1] % block_size:
        raise ValueError(f"{qtype.name}: row length of shape {shape} is not a multiple of {block_size}")
    n_blocks = prod(shape) // block_size
    if raw.dtype != torch.uint8 or raw.numel() != n_blocks * type_size:
        raise ValueError(f"{qtype.name} {shape}: expected {n_blocks * type_size} uint8 bytes, "
                         f"got {raw.numel()} of {raw.dtype}")
    flat = raw.reshape(-1)
    if flat.storage_offset() % 4:
        flat = flat.clone()  # dtype views need an element-aligned start
    if qtype == QT.F32:
        return flat.view(torch.float32).clone().reshape(shape)
    if qtype == QT.F16:
        return flat.view(torch.float16).float().reshape(shape)
    if qtype == QT.BF16:
        return (flat.view(torch.int16).to(torch.int32) << 16).view(torch.float32).reshape(shape)
    return dequantize_blocks(flat.reshape(n_blocks, type_size), qtype, shape)


def dequantize_blocks(blocks: torch.Tensor, qtype: QT, shape: tuple[int, ...]) -> torch.Tensor:
    """Float32 values of a block-quantized tensor given as its blocks, uint8 [n_blocks,
    type_size] with any stride between blocks (engine/quant/layout.py passes a view of padded
    blocks); `shape` as for dequantize. The same arithmetic as dequantize, bit for bit."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = prod(shape) // block_size
    if qtype not in _BLOCK_DECODERS or blocks.dtype != torch.uint8 or tuple(blocks.shape) != (n_blocks, type_size) \
            or blocks.stride(1) != 1:
        raise ValueError(f"{qtype.name} {shape}: expected uint8 blocks [{n_blocks}, {type_size}] with contiguous "
                         f"bytes, got {blocks.dtype} {list(blocks.shape)} strides {blocks.stride()}")
    return _BLOCK_DECODERS[qtype](blocks).reshape(shape)
