"""The byte layout of a weight's copy for the GPU kernels, and its dequantization.

The kernels read GGUF blocks as the file stores them, except Q6_K: its blocks are 210 bytes,
so only one block in eight starts on a 16-byte boundary and the kernels can load them only 2
bytes at a time. Padded to 224 bytes each (`pad_q6_k`: zeros after the block's scale d; the
values are unchanged) every block is 16-aligned, and the dense product loads them 16 bytes at
a time: 1.6-1.9x faster on the H200 (docs/BENCHMARKS.md) for 6.7% more bytes. The CPU (ggml's
kernels, the CPU pool) keeps the GGUF bytes; `dequantize_layout` decodes either layout
bit-identically, so a padded copy is the only copy a layer or an expert slot needs.

No torch import at the top: the planner sizes slots with `layout_bytes` without torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

if TYPE_CHECKING:
    import torch

Q6_K_BLOCK = GGML_QUANT_SIZES[QT.Q6_K][1]  # 210 bytes per 256 values
Q6_K_PADDED_BLOCK = 224  # the next multiple of 16


def layout_bytes(qtype: QT, n_bytes: int) -> int:
    """Bytes of a tensor of `n_bytes` GGUF bytes in kernel_layout's layout."""
    return n_bytes // Q6_K_BLOCK * Q6_K_PADDED_BLOCK if qtype == QT.Q6_K else n_bytes


def pad_q6_k(raw: torch.Tensor) -> torch.Tensor:
    """Q6_K rows [..., n, 210 * blocks] with every block padded to 224 bytes (zeros after its
    scale d), on raw's device."""
    import torch

    blocks = raw.shape[-1] // Q6_K_BLOCK
    if raw.dtype != torch.uint8 or raw.shape[-1] != Q6_K_BLOCK * blocks:
        raise ValueError(f"pad_q6_k takes uint8 Q6_K rows (a multiple of {Q6_K_BLOCK} bytes), got {raw.dtype} "
                         f"rows of {raw.shape[-1]} bytes")
    out = raw.new_zeros((*raw.shape[:-1], blocks, Q6_K_PADDED_BLOCK))
    out[..., :Q6_K_BLOCK] = raw.reshape(*raw.shape[:-1], blocks, Q6_K_BLOCK)
    return out.reshape(*raw.shape[:-1], blocks * Q6_K_PADDED_BLOCK)


def is_padded_q6_k(raw: torch.Tensor, qtype: QT, K: int) -> bool:
    """Whether rows `raw` [..., row_bytes] of a weight with K values per row are Q6_K in
    pad_q6_k's layout (the two layouts' row sizes differ whenever K > 0)."""
    return qtype == QT.Q6_K and raw.shape[-1] == Q6_K_PADDED_BLOCK * (K // 256)


def kernel_layout(raw: torch.Tensor, qtype: QT) -> torch.Tensor:
    """A weight's GGUF rows [..., row_bytes] in the layout the kernels read fastest: Q6_K
    padded (on raw's device: pad on the host before uploading, so the GPU never holds both
    layouts at once), every other type as it is."""
    return pad_q6_k(raw) if qtype == QT.Q6_K else raw


def dequantize_layout(raw: torch.Tensor, qtype: QT, shape: tuple[int, ...]) -> torch.Tensor:
    """dequantize() of rows in either layout (kernel_layout's or the GGUF one); bit-identical
    to dequantizing the GGUF bytes. Padded blocks are decoded in place through a strided view
    of their first 210 bytes: no unpadded copy is made."""
    from engine.quant.dequant import dequantize, dequantize_blocks

    if not is_padded_q6_k(raw, qtype, shape[-1]):
        return dequantize(raw, qtype, shape)
    blocks = raw.reshape(-1, Q6_K_PADDED_BLOCK)[:, :Q6_K_BLOCK]
    return dequantize_blocks(blocks, qtype, shape)


def copy_views(src: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(source, destination) views such that destination.copy_(source) puts the GGUF rows
    `src` [..., row_bytes] into `dst`, the same rows in either layout (padded Q6_K: each block
    into the first 210 bytes of its 224; the padding is not written). dst's rows must be
    contiguous. On CUDA torch copies into the strided view through a contiguous temporary
    (the upload, then one device-to-device copy, on the current stream)."""
    if src.shape[-1] == dst.shape[-1]:
        return src, dst
    blocks = src.shape[-1] // Q6_K_BLOCK
    if src.shape[-1] != blocks * Q6_K_BLOCK or dst.shape[-1] != blocks * Q6_K_PADDED_BLOCK:
        raise ValueError(f"rows of {src.shape[-1]} bytes do not go into rows of {dst.shape[-1]}: neither the same "
                         f"layout nor Q6_K blocks padded to {Q6_K_PADDED_BLOCK} bytes")
    return (src.reshape(*src.shape[:-1], blocks, Q6_K_BLOCK),
            dst.view(*dst.shape[:-1], blocks, Q6_K_PADDED_BLOCK)[..., :Q6_K_BLOCK])
