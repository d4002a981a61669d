"""The many-row MoE step's combine in one launch (engine/kernels/combine.py) against its
reference, engine/moe/hybrid._combine's loop of adds: bit-identical (the same float32 adds in the
same order). Here through Triton's interpreter; on the GPU (`-m gpu`) at a prompt chunk's shape."""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from engine.kernels import combine as kc  # noqa: E402
from engine.moe.hybrid import _combine  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
interp = pytest.mark.skipif(not INTERPRETED, reason="interpreter tests run where there is no GPU "
                            "(TRITON_INTERPRET=1 before the kernels are imported)")


def reference(per_slot: torch.Tensor, monkeypatch) -> torch.Tensor:
    monkeypatch.setenv("MOESTUDIO_TRITON", "0")
    try:
        return _combine(per_slot)
    finally:
        monkeypatch.delenv("MOESTUDIO_TRITON")


def slots(k: int, rows: int, width: int, device: str = "cpu") -> torch.Tensor:
    # magnitudes far apart, so that another order of the adds would round differently
    g = torch.Generator().manual_seed(k * rows + width)
    per_slot = torch.randn(k, rows, width, generator=g) * torch.logspace(-6, 6, k)[:, None, None]
    return per_slot.to(device)


@interp
@pytest.mark.parametrize("k, rows, width", [(8, 37, 100), (1, 3, 5), (4, 2, 1536)])
def test_the_kernel_adds_as_the_reference_does(monkeypatch, k, rows, width):
    per_slot = slots(k, rows, width)
    want = reference(per_slot, monkeypatch)
    if k > 2:
        assert not torch.equal(per_slot.flip(0).sum(0), want)  # the order shows in these values
    monkeypatch.setenv("MOESTUDIO_TRITON", "force")
    assert torch.equal(_combine(per_slot), want)
    assert torch.equal(kc.combine(per_slot), want)


@interp
def test_a_step_without_rows_gives_an_empty_sum():
    assert kc.combine(torch.zeros(8, 0, 64)).shape == (0, 64)


@pytest.mark.gpu
def test_a_prompt_chunk_on_the_gpu(monkeypatch):
    per_slot = slots(8, 512, 2048, "cuda")
    assert torch.equal(_combine(per_slot), reference(per_slot, monkeypatch))
