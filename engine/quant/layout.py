"""The byte layout of a weight's copy for the GPU kernels, and its dequantization.

The kernels read GGUF blocks as the file stores them, except where the blocks are not 16-byte
aligned and a kernel could only load them a few bytes at a time:
- Q6_K: 210-byte blocks (one in eight starts on a 16-byte boundary, the kernels loaded them 2
  bytes at a time). Padded to 224 bytes each (`pad_q6_k`: zeros after the block's scale d;
  the values are unchanged) every block is 16-aligned and the dense product loads it 16 bytes
  at a time: 1.6-1.9x faster on the H200 (docs/BENCHMARKS.md) for 6.7% more bytes.
- MXFP4: 17-byte blocks (a scale byte e8m0, then 16 bytes of nibbles), loaded a byte at a time.
  Planar (`planar_mxfp4`), a row holds its blocks' 16 nibble bytes back to back, then their
  scale bytes, zero-padded to a multiple of 16 bytes and at least one byte longer than the
  blocks' count, so that a planar row never has the GGUF row's size (gpt-oss, K = 2,880: 1,536
  bytes against 1,530, +0.4%). Every block's nibbles are 16-aligned, and the scales of two K
  steps (8 blocks each) fill one 16-aligned run of 16 bytes, inside the row even at its end.
The CPU (ggml's kernels, the CPU pool) keeps the GGUF bytes; `dequantize_layout` decodes any
layout bit-identically, so the kernel-layout copy is the only copy a layer or an expert slot
needs. The two layouts of a type have different row sizes, which is how the kernels and these
functions tell them apart.

No torch import at the top: the planner sizes slots with `layout_bytes` without torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

if TYPE_CHECKING:
    import torch

Q6_K_BLOCK = GGML_QUANT_SIZES[QT.Q6_K][1]  # 210 bytes per 256 values
Q6_K_PADDED_BLOCK = 224  # the next multiple of 16
MXFP4_BLOCK = GGML_QUANT_SIZES[QT.MXFP4][1]  # 17 bytes per 32 values: e8m0 scale, 16 nibble bytes
# The types kernel_layout lays out otherwise than the file, and what their layout is called.
CHANGED_LAYOUTS: dict[QT, str] = {QT.Q6_K: f"padded to {Q6_K_PADDED_BLOCK} B blocks", QT.MXFP4: "planar"}


def mxfp4_planar_row(K: int) -> int:
    """Bytes of one planar MXFP4 row of K values: 16 nibble bytes per block, then the blocks'
    scales padded to the multiple of 16 past their count."""
    blocks = K // 32
    return 16 * blocks + (blocks + 16) // 16 * 16


def layout_bytes(qtype: QT, n_bytes: int, K: int) -> int:
    """Bytes in kernel_layout's layout of a tensor of `n_bytes` GGUF bytes, K values per row."""
    if qtype == QT.Q6_K:
        return n_bytes // Q6_K_BLOCK * Q6_K_PADDED_BLOCK
    if qtype == QT.MXFP4:
        return n_bytes // (K // 32 * MXFP4_BLOCK) * mxfp4_planar_row(K)
    return n_bytes


def _check_rows(raw: torch.Tensor, block: int, what: str) -> int:
    import torch

    blocks = raw.shape[-1] // block
    if raw.dtype != torch.uint8 or raw.shape[-1] != block * blocks:
        raise ValueError(f"{what} takes uint8 rows of whole {block}-byte blocks, got {raw.dtype} rows of "
                         f"{raw.shape[-1]} bytes")
    return blocks


def pad_q6_k(raw: torch.Tensor) -> torch.Tensor:
    """Q6_K rows [..., n, 210 * blocks] with every block padded to 224 bytes (zeros after its
    scale d), on raw's device."""
    blocks = _check_rows(raw, Q6_K_BLOCK, "pad_q6_k")
    out = raw.new_zeros((*raw.shape[:-1], blocks, Q6_K_PADDED_BLOCK))
    out[..., :Q6_K_BLOCK] = raw.reshape(*raw.shape[:-1], blocks, Q6_K_BLOCK)
    return out.reshape(*raw.shape[:-1], blocks * Q6_K_PADDED_BLOCK)


def planar_mxfp4(raw: torch.Tensor) -> torch.Tensor:
    """MXFP4 rows [..., n, 17 * blocks] made planar (nibbles, then zero-padded scales), on
    raw's device."""
    blocks = _check_rows(raw, MXFP4_BLOCK, "planar_mxfp4")
    out = raw.new_zeros((*raw.shape[:-1], mxfp4_planar_row(32 * blocks)))
    PlanarRows.of(out, blocks).copy_(raw)
    return out


def is_padded_q6_k(raw: torch.Tensor, qtype: QT, K: int) -> bool:
    """Whether rows `raw` [..., row_bytes] of a weight with K values per row are Q6_K in
    pad_q6_k's layout."""
    return qtype == QT.Q6_K and raw.shape[-1] == Q6_K_PADDED_BLOCK * (K // 256)


def is_planar_mxfp4(raw: torch.Tensor, qtype: QT, K: int) -> bool:
    """Whether rows `raw` [..., row_bytes] of a weight with K values per row are MXFP4 in
    planar_mxfp4's layout."""
    return qtype == QT.MXFP4 and raw.shape[-1] == mxfp4_planar_row(K)


def kernel_layout(raw: torch.Tensor, qtype: QT) -> torch.Tensor:
    """A weight's GGUF rows [..., row_bytes] in the layout the kernels read fastest: Q6_K
    padded, MXFP4 planar (on raw's device: lay out on the host before uploading, so the GPU
    never holds both layouts at once), every other type as it is."""
    if qtype == QT.Q6_K:
        return pad_q6_k(raw)
    if qtype == QT.MXFP4:
        return planar_mxfp4(raw)
    return raw


def dequantize_layout(raw: torch.Tensor, qtype: QT, shape: tuple[int, ...]) -> torch.Tensor:
    """dequantize() of rows in either layout (kernel_layout's or the GGUF one); bit-identical
    to dequantizing the GGUF bytes. Padded Q6_K blocks are decoded in place through a strided
    view of their first 210 bytes; planar MXFP4 rows are gathered back into blocks first (17
    bytes a block, small beside the float32 values)."""
    import torch

    from engine.quant.dequant import dequantize, dequantize_blocks

    K = shape[-1]
    if is_padded_q6_k(raw, qtype, K):
        return dequantize_blocks(raw.reshape(-1, Q6_K_PADDED_BLOCK)[:, :Q6_K_BLOCK], qtype, shape)
    if is_planar_mxfp4(raw, qtype, K):
        rows = raw.reshape(-1, raw.shape[-1])
        blocks = K // 32
        nibbles = rows[:, :16 * blocks].reshape(-1, blocks, 16)
        scales = rows[:, 16 * blocks:17 * blocks].reshape(-1, blocks, 1)
        return dequantize_blocks(torch.cat((scales, nibbles), dim=2).reshape(-1, MXFP4_BLOCK), qtype, shape)
    return dequantize(raw, qtype, shape)


class PlanarRows:
    """Destination rows in planar_mxfp4's layout, as their nibble and scale views; `copy_`
    puts GGUF rows into them (the slots' copier calls it as it calls a tensor's)."""

    def __init__(self, nibbles: torch.Tensor, scales: torch.Tensor):
        self.nibbles, self.scales = nibbles, scales  # [..., blocks, 16], [..., blocks]
        self.blocks = scales.shape[-1]

    @classmethod
    def of(cls, rows: torch.Tensor, blocks: int) -> PlanarRows:
        """The views of planar rows [..., row_bytes] of `blocks` blocks each."""
        return cls(rows[..., :16 * blocks].unflatten(-1, (blocks, 16)), rows[..., 16 * blocks:17 * blocks])

    def unbind(self, dim: int = 0) -> list[PlanarRows]:
        """One PlanarRows per index of a leading axis (an expert or a slot)."""
        return [PlanarRows(n, s) for n, s in zip(self.nibbles.unbind(dim), self.scales.unbind(dim))]

    def copy_(self, src: torch.Tensor, non_blocking: bool = False) -> PlanarRows:
        import torch

        if src.shape[-1] != self.blocks * MXFP4_BLOCK:
            raise ValueError(f"rows of {src.shape[-1]} bytes are not the {self.blocks} MXFP4 blocks of these "
                             "planar rows")
        device = self.nibbles.device
        if device.type == "cuda" and src.device != device:
            # One contiguous upload, de-interleaved on the GPU after: from a strided host view torch
            # would gather the bytes on the host first, one by one. The staging tensor is allocated
            # on the current (copy) stream, so the allocator reuses it only after these copies.
            staged = torch.empty(src.shape, dtype=torch.uint8, device=device)
            staged.copy_(src, non_blocking=non_blocking)
            src = staged
        blocks = src.unflatten(-1, (self.blocks, MXFP4_BLOCK))
        self.nibbles.copy_(blocks[..., 1:], non_blocking=non_blocking)
        self.scales.copy_(blocks[..., 0], non_blocking=non_blocking)
        return self


def copy_views(src: torch.Tensor, dst: torch.Tensor, qtype: QT) -> tuple[torch.Tensor, torch.Tensor | PlanarRows]:
    """(source, destination) such that destination.copy_(source) puts the GGUF rows `src`
    [..., row_bytes] of type `qtype` into `dst`, the same rows in either layout: padded Q6_K,
    each block into the first 210 bytes of its 224 (the padding is not written); planar MXFP4,
    a PlanarRows. dst's rows must be contiguous; both results unbind(0) into experts or slots.
    On CUDA torch copies into a strided view through a contiguous temporary (the upload, then
    one device-to-device copy, on the current stream)."""
    if src.shape[-1] == dst.shape[-1]:
        return src, dst
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks, partial = divmod(src.shape[-1], type_size)
    if not partial and is_planar_mxfp4(dst, qtype, blocks * block_size):
        return src, PlanarRows.of(dst, blocks)
    if not partial and is_padded_q6_k(dst, qtype, blocks * block_size):
        return (src.reshape(*src.shape[:-1], blocks, Q6_K_BLOCK),
                dst.view(*dst.shape[:-1], blocks, Q6_K_PADDED_BLOCK)[..., :Q6_K_BLOCK])
    raise ValueError(f"{qtype.name} rows of {src.shape[-1]} bytes do not go into rows of {dst.shape[-1]}: neither "
                     "the same layout nor kernel_layout's")
