"""The byte layout of a weight's copy for the GPU kernels, and its dequantization.

The kernels read GGUF blocks as the file stores them, except where the blocks are not 16-byte
aligned and a kernel could only load them a few bytes at a time:
- Q6_K: 210-byte blocks (one in eight starts on a 16-byte boundary, the kernels loaded them 2
  bytes at a time). Padded to 224 bytes each (`pad_q6_k`: zeros after the block's scale d;
  the values are unchanged) every block is 16-aligned and the dense product loads it 16 bytes
  at a time: 1.6-1.9x faster on the H200 (docs/BENCHMARKS.md) for 6.7% more bytes.
- MXFP4 and Q8_0: 17- and 34-byte blocks (a scale, e8m0 or f16, then the quants: 16 bytes of
  nibbles, or 32 int8), loaded a byte or two bytes at a time. Planar (`planar`), a row holds its
  blocks' quants back to back, then their scales, zero-padded to a multiple of 16 bytes and at
  least one byte longer than the scales, so that a planar row never has the GGUF row's size
  (gpt-oss MXFP4, K = 2,880: 1,536 bytes against 1,530, +0.4%; Q8_0 at K = 4,096: 4,368 against
  4,352, +0.4%; K = 768: 832 against 816, +2%). Every block's quants are 16-aligned, and a K
  step's scales (8 blocks) lie in 16-aligned runs of 16 bytes, inside the row even at its end.
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
# The planar types' blocks: (bytes of the scale, which GGUF stores first; bytes of the quants).
PLANAR_BLOCKS: dict[QT, tuple[int, int]] = {QT.MXFP4: (1, 16), QT.Q8_0: (2, 32)}
# The types kernel_layout lays out otherwise than the file, and what their layout is called.
CHANGED_LAYOUTS: dict[QT, str] = {QT.Q6_K: f"padded to {Q6_K_PADDED_BLOCK} B blocks",
                                  **{t: "planar" for t in PLANAR_BLOCKS}}


def planar_row(qtype: QT, K: int) -> int:
    """Bytes of one planar row of K values: the blocks' quants, then their scales padded to the
    multiple of 16 past their bytes."""
    scale, quants = PLANAR_BLOCKS[qtype]
    blocks = K // 32
    return quants * blocks + (scale * blocks + 16) // 16 * 16


def layout_bytes(qtype: QT, n_bytes: int, K: int) -> int:
    """Bytes in kernel_layout's layout of a tensor of `n_bytes` GGUF bytes, K values per row."""
    if qtype == QT.Q6_K:
        return n_bytes // Q6_K_BLOCK * Q6_K_PADDED_BLOCK
    if qtype in PLANAR_BLOCKS:
        return n_bytes // (K // 32 * GGML_QUANT_SIZES[qtype][1]) * planar_row(qtype, K)
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


def planar(raw: torch.Tensor, qtype: QT) -> torch.Tensor:
    """MXFP4 or Q8_0 rows [..., n, block * blocks] made planar (quants, then zero-padded
    scales), on raw's device."""
    blocks = _check_rows(raw, GGML_QUANT_SIZES[qtype][1], f"planar {qtype.name}")
    out = raw.new_zeros((*raw.shape[:-1], planar_row(qtype, 32 * blocks)))
    PlanarRows.of(out, qtype, blocks).copy_(raw)
    return out


def is_padded_q6_k(raw: torch.Tensor, qtype: QT, K: int) -> bool:
    """Whether rows `raw` [..., row_bytes] of a weight with K values per row are Q6_K in
    pad_q6_k's layout."""
    return qtype == QT.Q6_K and raw.shape[-1] == Q6_K_PADDED_BLOCK * (K // 256)


def is_planar(raw: torch.Tensor, qtype: QT, K: int) -> bool:
    """Whether rows `raw` [..., row_bytes] of a weight with K values per row are in planar's
    layout (MXFP4 or Q8_0)."""
    return qtype in PLANAR_BLOCKS and raw.shape[-1] == planar_row(qtype, K)


def kernel_layout(raw: torch.Tensor, qtype: QT) -> torch.Tensor:
    """A weight's GGUF rows [..., row_bytes] in the layout the kernels read fastest: Q6_K
    padded, MXFP4 and Q8_0 planar (on raw's device: lay out on the host before uploading, so the GPU
    never holds both layouts at once), every other type as it is."""
    if qtype == QT.Q6_K:
        return pad_q6_k(raw)
    if qtype in PLANAR_BLOCKS:
        return planar(raw, qtype)
    return raw


def dequantize_layout(raw: torch.Tensor, qtype: QT, shape: tuple[int, ...]) -> torch.Tensor:
    """dequantize() of rows in either layout (kernel_layout's or the GGUF one); bit-identical
    to dequantizing the GGUF bytes. Padded Q6_K blocks are decoded in place through a strided
    view of their first 210 bytes; planar rows are gathered back into blocks first (GGUF bytes,
    small beside the float32 values)."""
    from engine.quant.dequant import dequantize, dequantize_blocks

    K = shape[-1]
    if is_padded_q6_k(raw, qtype, K):
        return dequantize_blocks(raw.reshape(-1, Q6_K_PADDED_BLOCK)[:, :Q6_K_BLOCK], qtype, shape)
    if is_planar(raw, qtype, K):
        rows = raw.reshape(-1, raw.shape[-1])
        blocks = K // 32
        gguf = rows.new_empty((rows.shape[0], blocks * GGML_QUANT_SIZES[qtype][1]))
        PlanarRows.of(rows, qtype, blocks).copy_to(gguf)
        return dequantize_blocks(gguf.reshape(-1, GGML_QUANT_SIZES[qtype][1]), qtype, shape)
    return dequantize(raw, qtype, shape)


class PlanarRows:
    """Destination rows in planar's layout, as their quant and scale views; `copy_` puts GGUF
    rows into them (the slots' copier calls it as it calls a tensor's)."""

    def __init__(self, quants: torch.Tensor, scales: torch.Tensor):
        self.quants, self.scales = quants, scales  # [..., blocks, quant bytes], [..., blocks, scale bytes]
        self.blocks = scales.shape[-2]

    @classmethod
    def of(cls, rows: torch.Tensor, qtype: QT, blocks: int) -> PlanarRows:
        """The views of planar rows [..., row_bytes] of `blocks` blocks each."""
        scale, quants = PLANAR_BLOCKS[qtype]
        return cls(rows[..., :quants * blocks].unflatten(-1, (blocks, quants)),
                   rows[..., quants * blocks:(quants + scale) * blocks].unflatten(-1, (blocks, scale)))

    @property
    def block_bytes(self) -> int:
        return self.quants.shape[-1] + self.scales.shape[-1]

    def unbind(self, dim: int = 0) -> list[PlanarRows]:
        """One PlanarRows per index of a leading axis (an expert or a slot)."""
        return [PlanarRows(q, s) for q, s in zip(self.quants.unbind(dim), self.scales.unbind(dim))]

    def _gguf_blocks(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if rows.shape[-1] != self.blocks * self.block_bytes:
            raise ValueError(f"rows of {rows.shape[-1]} bytes are not the {self.blocks} blocks of these planar rows")
        blocks = rows.unflatten(-1, (self.blocks, self.block_bytes))
        scale = self.scales.shape[-1]
        return blocks[..., scale:], blocks[..., :scale]

    def copy_(self, src: torch.Tensor, non_blocking: bool = False) -> PlanarRows:
        import torch

        device = self.quants.device
        if device.type == "cuda" and src.device != device:
            # One contiguous upload, de-interleaved on the GPU after: from a strided host view torch
            # would gather the bytes on the host first, one by one. The staging tensor is allocated
            # on the current (copy) stream, so the allocator reuses it only after these copies.
            staged = torch.empty(src.shape, dtype=torch.uint8, device=device)
            staged.copy_(src, non_blocking=non_blocking)
            src = staged
        quants, scales = self._gguf_blocks(src)
        self.quants.copy_(quants, non_blocking=non_blocking)
        self.scales.copy_(scales, non_blocking=non_blocking)
        return self

    def copy_to(self, dst: torch.Tensor) -> torch.Tensor:
        """These rows' blocks in the GGUF layout, into `dst` [..., blocks * block bytes]."""
        quants, scales = self._gguf_blocks(dst)
        quants.copy_(self.quants)
        scales.copy_(self.scales)
        return dst


def copy_views(src: torch.Tensor, dst: torch.Tensor, qtype: QT) -> tuple[torch.Tensor, torch.Tensor | PlanarRows]:
    """(source, destination) such that destination.copy_(source) puts the GGUF rows `src`
    [..., row_bytes] of type `qtype` into `dst`, the same rows in either layout: padded Q6_K,
    each block into the first 210 bytes of its 224 (the padding is not written); planar MXFP4
    and Q8_0, a PlanarRows. dst's rows must be contiguous; both results unbind(0) into experts or slots.
    On CUDA torch copies into a strided view through a contiguous temporary (the upload, then
    one device-to-device copy, on the current stream)."""
    if src.shape[-1] == dst.shape[-1]:
        return src, dst
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks, partial = divmod(src.shape[-1], type_size)
    if not partial and is_planar(dst, qtype, blocks * block_size):
        return src, PlanarRows.of(dst, qtype, blocks)
    if not partial and is_padded_q6_k(dst, qtype, blocks * block_size):
        return (src.reshape(*src.shape[:-1], blocks, Q6_K_BLOCK),
                dst.view(*dst.shape[:-1], blocks, Q6_K_PADDED_BLOCK)[..., :Q6_K_BLOCK])
    raise ValueError(f"{qtype.name} rows of {src.shape[-1]} bytes do not go into rows of {dst.shape[-1]}: neither "
                     "the same layout nor kernel_layout's")
