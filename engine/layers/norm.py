"""RMS normalisation as ggml_rms_norm: x / sqrt(mean(x^2) + eps), then times the weight.

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
