"""RMS normalisation as ggml_rms_norm: x / sqrt(mean(x^2) + eps), then times the weight, and
the residual add fused with the norm that follows it (`add_rms_norm`).

The torch code is the reference and the CPU path; where `engine.kernels.triton_applies` says
so (CUDA) and the shapes fit, one fused Triton launch computes the same formula
(engine/kernels/norm_rope.py)."""
from __future__ import annotations

import torch

from engine.kernels import triton_applies


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    if triton_applies(x.device):
        from engine.kernels import norm_rope

        if norm_rope.norm_supported(x, weight):
            return norm_rope.rms_norm(x, weight, eps)
    out = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return out * weight if weight is not None else out


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor | None,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, rms_norm(h + delta, weight, eps)): a block's residual add and the norm of the
    sum that the next step reads, in one launch where the kernel applies."""
    if triton_applies(h.device):
        from engine.kernels import norm_rope

        if norm_rope.add_norm_supported(h, delta, weight):
            return norm_rope.add_rms_norm(h, delta, weight, eps)
    h = h + delta
    return h, rms_norm(h, weight, eps)
