"""The float type the engine's torch products accumulate in: float32, or float64 to measure noise.

Two correct implementations of the same maths differ by float32 summation order (~1e-7
relative). On a quantized model that is not the end of it: every matmul first rounds its
activation to 8 bits (engine/quant/activation.py), so a value lying that close to a half
step rounds the other way in one of them, and the difference grows to one quant step and
travels on through attention. `moestudio validate` measures how far this goes on a given
model and CPU by running the engine a second time with products accumulated in float64 (a
different, more exact summation order of the same code): that run's distance to the
float32 run is the noise floor a correct engine's distance to llama.cpp is judged against.

A context variable, so a validation in one thread does not change another thread's run.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import torch

_ACCUMULATE: contextvars.ContextVar[torch.dtype] = contextvars.ContextVar("accumulate", default=torch.float32)


@contextlib.contextmanager
def accumulate_in(dtype: torch.dtype) -> Iterator[None]:
    """Products computed by `matmul` and `einsum` inside the block accumulate in `dtype`."""
    token = _ACCUMULATE.set(dtype)
    try:
        yield
    finally:
        _ACCUMULATE.reset(token)


def accumulation() -> torch.dtype:
    """The type products accumulate in now (the fused float32 kernels run only under float32)."""
    return _ACCUMULATE.get()


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b, float32 out, accumulated in the current type."""
    acc = _ACCUMULATE.get()
    if acc == torch.float32:
        return a @ b
    return (a.to(acc) @ b.to(acc)).float()


def einsum(spec: str, *operands: torch.Tensor) -> torch.Tensor:
    """torch.einsum, float32 out, accumulated in the current type."""
    acc = _ACCUMULATE.get()
    if acc == torch.float32:
        return torch.einsum(spec, *operands)
    return torch.einsum(spec, *(t.to(acc) for t in operands)).float()


def softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """torch.softmax in the current type (its sum is an accumulation too), float32 out."""
    acc = _ACCUMULATE.get()
    if acc == torch.float32:
        return torch.softmax(x, dim=dim)
    return torch.softmax(x.to(acc), dim=dim).float()
