"""Fused Triton kernels of the decode step's float work (norms, RoPE, attention, routing), beside
the quantized products of engine/quant. Each op has a torch reference in engine/layers; the
kernel runs where `triton_applies` says so, and tests hold it to the reference.

One switch for every Triton kernel of the engine: MOESTUDIO_TRITON=0 runs the torch path
everywhere, `force` runs the kernels off CUDA too (Triton's interpreter, with TRITON_INTERPRET=1
set before triton is imported: the CPU tests).
"""
from __future__ import annotations

import os

import torch


def triton_applies(device: torch.device | str) -> bool:
    """Whether the Triton kernels run for tensors on `device`: on CUDA unless MOESTUDIO_TRITON=0,
    elsewhere only with MOESTUDIO_TRITON=force, and only where triton is installed."""
    mode = os.environ.get("MOESTUDIO_TRITON", "1")
    if mode == "0" or (torch.device(device).type != "cuda" and mode != "force"):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:  # pragma: no cover - depends on the environment
        return False
    return True
