"""How the decode token's expert step launches its kernels: three launches, or one chosen by timing.

The step of a layer (round x; gate/up + activation + round h; down x routing weight) runs as
three launches or as one (triton_kernels.experts_forward(one_launch=True): the same programs in
one grid, the later ones waiting on flags the earlier publish). Both give the same bits, so the
choice changes the speed, never a token. Asked to (`auto`), the engine times them once per
process for each kind of layer, as the decode graph runs them: a CUDA graph of the step over
several layers' resident experts (so the weights come from memory, not L2), and keeps one launch
where it takes at most ONE_LAUNCH_SHARE of the three launches' time. The one launch is first
checked against the three launches bit for bit and for waits that timed out; where it cannot run
here or differs, a warning says so and the three launches stay.

MOESTUDIO_ONE_LAUNCH_STEP: `0` (the default: three launches, nothing tried), `auto` (timed at
load), `1` (one launch wherever it runs and agrees, untimed: the decode benchmarks' A/B). Three
launches by default because the H200 measured the one launch as built 1.3-2.6x slower at one
token (docs/BENCHMARKS.md, session 30): timing it at every load would cost its compile and a few
graph captures for a form that loses; `auto` is for a one launch that may win.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from engine.errors import UserError
from engine.layers.moe import ExpertWeights
from engine.moe.slots import layout_key
from engine.runtime.device_time import graph_us

MODES = ("0", "auto", "1")
ONE_LAUNCH_SHARE = 0.97  # a tie keeps the three launches, the path longer in use
TIMED_LAYERS = 8  # layers of one kind in a timing graph (Qwen3-30B-A3B Q4_K: 8 x 21 MB, past any L2)
REPLAYS = 5  # of the timing graph; the best counts


@dataclass(frozen=True)
class StepForm:
    """How one kind of layer's decode step runs, and the times it was chosen by (µs per step;
    None where not timed)."""
    one_launch: bool
    one_launch_us: float | None = None
    three_launches_us: float | None = None


@dataclass(frozen=True)
class SlotLayer:
    """One layer's experts as the token step reads them: `buffers` (LayerSlots.buffers) and
    `resident` (expert -> slot of landed copies, -1 elsewhere)."""
    w: ExpertWeights
    buffers: list[torch.Tensor]
    resident: np.ndarray


def mode() -> str:
    value = os.environ.get("MOESTUDIO_ONE_LAUNCH_STEP", "0")
    if value not in MODES:
        raise UserError(f"MOESTUDIO_ONE_LAUNCH_STEP={value!r}: use 0 (three launches), auto (timed at load) or 1 "
                        "(one launch)")
    return value


def kind(w: ExpertWeights) -> tuple:
    """Layers of one kind run the same kernels on the same shapes: one choice serves them all."""
    return layout_key(w), w.activation, w.gate.bias is not None, w.down.bias is not None


def label(w: ExpertWeights) -> str:
    """The kind's name in the telemetry: the gate/up/down types and the experts' shape."""
    return f"{'/'.join(t.qtype.name for t in (w.gate, w.up, w.down))} {w.gate.shape[2]}x{w.gate.shape[1]}"


_chosen: dict[tuple, StepForm] = {}


def choose(layers: list[SlotLayer], k: int, device: torch.device) -> StepForm:
    """The form of the decode step for `layers` (one kind) at top-k `k` on `device`, chosen once
    per process for each kind, device, k and mode. The GPU must be idle of captures: the first
    one-launch step on a device makes its state."""
    how = mode()
    if how == "0":
        return StepForm(False)
    key = (str(device), k, how, kind(layers[0].w))
    form = _chosen.get(key)
    if form is None:
        form = _chosen[key] = _choose(layers, k, device, timed=how == "auto")
    return form


class _Step:
    """One token's step over a layer's resident experts: k pairs on distinct landed slots where
    there are k (else repeating them), in both forms into one output."""

    def __init__(self, layer: SlotLayer, k: int, device: torch.device, g: torch.Generator):
        experts = np.flatnonzero(layer.resident >= 0)[:k]
        experts = experts[np.arange(k) % len(experts)]
        slots = layer.resident[experts]
        self.layer = layer
        self.x = torch.randn(1, layer.w.gate.shape[2], generator=g).to(device)
        self.weights = torch.rand(1, k, generator=g).to(device)
        self.tok = torch.zeros(k, dtype=torch.int32, device=device)
        self.pos = torch.arange(k, dtype=torch.int32, device=device)
        self.slot = torch.from_numpy(slots.astype(np.int32)).to(device)
        self.exp = torch.from_numpy(experts.astype(np.int32)).to(device)
        self.out = torch.zeros(k, 1, layer.w.down.shape[1], device=device)

    def __call__(self, one_launch: bool) -> None:
        from engine.quant import triton_kernels as tk

        tk.experts_forward(self.x, self.layer.buffers, self.layer.w, self.tok, self.pos, self.slot, self.exp,
                           self.weights, self.out, one_launch=one_launch)


def _choose(layers: list[SlotLayer], k: int, device: torch.device, timed: bool) -> StepForm:
    from engine.quant import triton_kernels as tk

    layers = [layer for layer in layers if (layer.resident >= 0).any()][:TIMED_LAYERS]
    if not layers:  # nothing landed to run on: the proven form
        return StepForm(False)
    g = torch.Generator().manual_seed(0)
    steps = [_Step(layer, k, device, g) for layer in layers]
    name = label(layers[0].w)
    try:
        steps[0](one_launch=False)
        want = steps[0].out.clone()
        steps[0](one_launch=True)
        late = tk.step_timed_out(device)
    except Exception as e:  # a GPU or Triton that cannot build or run it
        warnings.warn(f"the one-launch expert step cannot run here ({type(e).__name__}: {e}); {name} experts decode "
                      "in three launches", RuntimeWarning, stacklevel=3)
        return StepForm(False)
    # bit for bit, NaN and all: the two forms do the same arithmetic
    if late or not torch.equal(want.view(torch.int32), steps[0].out.view(torch.int32)):
        why = "a wait on the GPU timed out" if late else "its result differs from the three launches'"
        warnings.warn(f"the one-launch expert step failed its check here ({why}); {name} experts decode in three "
                      "launches", RuntimeWarning, stacklevel=3)
        return StepForm(False)
    if not timed:
        return StepForm(True)
    us = {one: graph_us([lambda s=s, one=one: s(one) for s in steps], REPLAYS, device) for one in (False, True)}
    if tk.step_timed_out(device):
        warnings.warn(f"a one-launch expert step timed out while it was timed; {name} experts decode in three "
                      "launches", RuntimeWarning, stacklevel=3)
        return StepForm(False, us[True], us[False])
    return StepForm(us[True] <= ONE_LAUNCH_SHARE * us[False], us[True], us[False])
