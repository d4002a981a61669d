"""RMS normalisation as ggml_rms_norm: x / sqrt(mean(x^2) + eps), then times the weight."""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    out = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return out * weight if weight is not None else out
