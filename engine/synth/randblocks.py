"""Random quantized blocks with sane scales, written directly instead of quantizing floats.

Geometry presets hold tens of GB of experts; quantizing that many floats would take hours
on a desktop, while filling blocks with random bytes and fixing their scale fields runs at
memory speed. Values come out roughly zero-mean with the requested standard deviation.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGML_QUANT_SIZES
from gguf.quants import dequantize

# Byte offsets of each block's f16 scale fields, and the ratio min-scale / scale that
# centres the unsigned quants (Q4_K: 4-bit quants, so dmin = 7.5 d; Q5_K: 15.5 d).
_F16_SCALES = {
    QT.Q8_0: ((0,), 0.0),
    QT.Q4_K: ((0, 2), 7.5),
    QT.Q5_K: ((0, 2), 15.5),
    QT.Q6_K: ((208,), 0.0),
}


def _set_scales(blocks: np.ndarray, qtype: QT, d: float) -> None:
    if qtype == QT.MXFP4:
        # One E8M0 exponent byte per block: value = fp4 * 2^(e - 128), see ggml's e8m0 helpers.
        blocks[:, 0] = np.uint8(np.clip(np.round(np.log2(d)) + 128, 1, 254))
        return
    offsets, min_ratio = _F16_SCALES[qtype]
    blocks[:, offsets[0]:offsets[0] + 2] = np.frombuffer(np.float16(d).tobytes(), np.uint8)
    if len(offsets) == 2:
        blocks[:, offsets[1]:offsets[1] + 2] = np.frombuffer(np.float16(d * min_ratio).tobytes(), np.uint8)


@lru_cache(maxsize=None)
def _unit_std(qtype: QT) -> float:
    """Standard deviation of the values of random blocks whose scale is 1."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = np.random.default_rng(0).integers(0, 256, (512, type_size), dtype=np.uint8)
    _set_scales(blocks, qtype, 1.0)
    return float(dequantize(blocks, qtype).std())


def random_blocks(rng: np.random.Generator, qtype: QT, shape: tuple[int, ...], std: float) -> np.ndarray:
    """uint8 blocks for a tensor of logical `shape` (numpy order) with values of about `std`."""
    if qtype not in _F16_SCALES and qtype != QT.MXFP4:
        raise ValueError(f"random blocks are not made for {qtype.name}")
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if shape[-1] % block_size:
        raise ValueError(f"rows of {shape[-1]} values are not whole {qtype.name} blocks of {block_size}")
    n_blocks = int(np.prod(shape)) // block_size
    blocks = np.frombuffer(rng.bytes(n_blocks * type_size), np.uint8).reshape(n_blocks, type_size).copy()
    _set_scales(blocks, qtype, std / _unit_std(qtype))
    return blocks.reshape(*shape[:-1], shape[-1] // block_size * type_size)
