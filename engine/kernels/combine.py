"""The weighted experts of each token summed in one launch (Triton): a many-row MoE step's
combine (engine/moe/hybrid._combine, whose loop of k - 1 adds is the reference).

`combine(per_slot)`: per_slot [k, T, D] float32, the step's weighted expert outputs by top-k
position; returns [T, D] = ((per_slot[0] + per_slot[1]) + per_slot[2]) + ..., each add rounded
to float32 in that order, as llama.cpp adds them: bit-identical to the reference. One launch
instead of k - 1 (7 a layer for a top-8 model).

`TRITON_INTERPRET=1` (set before this module is imported) runs it on CPU tensors.
"""
from __future__ import annotations

import torch

try:  # Triton is optional: without it the torch path runs.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

BLOCK = 1024  # values of the output per program

if triton is not None:

    @triton.jit
    def _combine_kernel(src_ptr, out_ptr, n, stride_slot, K: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = i < n
        total = tl.load(src_ptr + i, mask=live)
        for j in tl.static_range(1, K):
            total += tl.load(src_ptr + j * stride_slot + i, mask=live)
        tl.store(out_ptr + i, total, mask=live)


def supports(per_slot: torch.Tensor) -> bool:
    """float32, each top-k position's [T, D] contiguous."""
    return (triton is not None and per_slot.dtype == torch.float32 and per_slot.dim() == 3
            and per_slot[0].is_contiguous())


def combine(per_slot: torch.Tensor) -> torch.Tensor:
    k, rows, width = per_slot.shape
    out = torch.empty((rows, width), dtype=per_slot.dtype, device=per_slot.device)
    n = rows * width
    if n:
        _combine_kernel[(triton.cdiv(n, BLOCK),)](per_slot, out, n, per_slot.stride(0), K=k, BLOCK=BLOCK)
    return out
