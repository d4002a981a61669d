"""Per-layer expert slots on the accelerator and the residency map that says who lives where.

A slot holds one whole expert (gate, up, down) in its GGUF-quantized bytes, in the layout the
kernels read fastest (engine/quant/layout.py: Q6_K blocks padded from 210 to 224 bytes, MXFP4 and
Q8_0 rows made planar, as they are copied in; the host keeps the GGUF bytes, which the CPU pool
reads). The residency
map only ever names experts whose copy has LANDED: a slot being refilled is first taken out
of the map (so no hit can read it), then copied, and only after the copy has landed does the
map point at it again. A step's uploads go to staging slots, which the layers whose experts
share a layout share (`StagingSlots`): the layers run one after another, and a copy into the
staging slots waits for the kernels already enqueued, which read the previous layer's.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch

from engine.config import LOAD_MODES
from engine.layers.moe import ExpertTensor, ExpertWeights
from engine.moe.copier import Copier, Copy
from engine.quant.layout import copy_views, dequantize_layout, layout_bytes

PIN_SHARE_OF_FREE_RAM = 0.5  # auto pins the experts only when they take at most this share


def resolve_load_mode(load_mode: str, expert_weights: dict[int, ExpertWeights], device: torch.device) -> str:
    """auto: `none` on a GPU when the experts fit in half the free RAM (pinned memory cannot be
    swapped out, so it must leave the rest of the machine room), else `mmap`."""
    if load_mode not in LOAD_MODES:
        raise ValueError(f"load mode must be one of {', '.join(LOAD_MODES)}, not {load_mode!r}")
    if load_mode != "auto":
        return load_mode
    if device.type != "cuda":
        return "mmap"  # no uploads to speed up
    import psutil

    size = sum(t.raw.numel() for w in expert_weights.values() for t in (w.gate, w.up, w.down))
    return "none" if size <= PIN_SHARE_OF_FREE_RAM * psutil.virtual_memory().available else "mmap"


def resident_copies(expert_weights: dict[int, ExpertWeights], pin: bool,
                    progress: Callable[[int], None] | None = None) -> dict[int, ExpertWeights]:
    """`--load-mode none`: the experts copied out of the memory map into RAM (pinned when `pin`,
    so uploads are asynchronous DMA). The CPU pool and the uploads then read the copies, so the
    mapped pages go cold and the OS can drop them: the experts take RAM once. `progress` hears
    the bytes copied, one expert at a time (a layer's tensor is gigabytes on large models)."""
    def copy(t: ExpertTensor) -> ExpertTensor:
        ram = torch.empty(t.raw.shape, dtype=t.raw.dtype, pin_memory=pin)  # no second transient copy
        for e in range(t.raw.shape[0]):
            ram[e].copy_(t.raw[e])
            if progress is not None:
                progress(ram[e].numel())
        return dataclasses.replace(t, raw=ram)

    return {layer: dataclasses.replace(w, gate=copy(w.gate), up=copy(w.up), down=copy(w.down))
            for layer, w in expert_weights.items()}


def layout_key(w: ExpertWeights) -> tuple:
    """Layers with equal keys hold their experts in slots of one shape and layout."""
    return tuple((t.qtype, tuple(t.raw.shape[1:])) for t in (w.gate, w.up, w.down))


class StagingSlots:
    """`n` slots for a step's uploads, shared by the layers of one layout_key."""

    def __init__(self, w: ExpertWeights, n: int, device: torch.device):
        self.n = n
        self.buffers = [_slot_buffer(t, n, device) for t in (w.gate, w.up, w.down)]


class LayerSlots:
    def __init__(self, w: ExpertWeights, n_slots: int, staging: StagingSlots | None, device: torch.device,
                 copier: Copier):
        self.w, self.n_slots, self.device = w, n_slots, device
        self.staging = staging
        self.n_staging = staging.n if staging is not None else 0
        self.copier = copier
        self.buffers = [_slot_buffer(t, n_slots, device) for t in (w.gate, w.up, w.down)]
        self.resident = np.full(w.n_expert, -1, np.int32)  # expert -> slot, landed copies only
        self.slot_expert = np.full(n_slots, -1, np.int32)  # slot -> expert, landed or in flight
        self.pending: list[tuple[int, int, Copy]] = []  # (slot, expert, copy)
        self.version = 0  # bumped whenever `resident` changes: readers skip comparing unchanged maps
        # Per-expert and per-slot views made once: indexing a tensor costs microseconds of host
        # time, and every decode step copies experts. Padded Q6_K: the GGUF blocks, and the
        # first 210 bytes of each padded block; planar MXFP4 and Q8_0: layout.PlanarRows (copy_views).
        tensors = (w.gate, w.up, w.down)
        views = [copy_views(t.raw, b, t.qtype) for t, b in zip(tensors, self.buffers)]
        self._host_views = [h.unbind(0) for h, _ in views]
        self._slot_views = [d.unbind(0) for _, d in views]
        self._staging_views = [] if staging is None else \
            [copy_views(t.raw, b, t.qtype)[1].unbind(0) for t, b in zip(tensors, staging.buffers)]

    @property
    def expert_bytes(self) -> int:
        return sum(b[0].numel() for b in self.buffers)

    def refresh(self) -> int:
        """Publishes every landed copy in the residency map; returns how many landed."""
        still, landed = [], 0
        for slot, expert, handle in self.pending:
            if handle.landed():
                self.resident[expert] = slot
                landed += 1
            else:
                still.append((slot, expert, handle))
        self.pending = still
        self.version += landed > 0
        return landed

    def in_flight(self) -> set[int]:
        return {expert for _, expert, _ in self.pending}

    def load(self, refills: list[tuple[int, int]]) -> Copy:
        """Refills each (slot, expert) in one copy: unpublishes the old experts now, publishes the
        new ones when the copy lands."""
        pairs = []
        for slot, expert in refills:
            old = self.slot_expert[slot]
            if old >= 0 and self.resident[old] == slot:
                self.resident[old] = -1
                self.version += 1
            self.slot_expert[slot] = expert
            pairs += self._copy_pairs(expert, slot)
        handle = self.copier.copy(pairs)
        self.pending += [(slot, expert, handle) for slot, expert in refills]
        return handle

    def stage(self, experts: list[int]) -> list[int]:
        """Copies `experts` into the staging slots for this step, later compute ordered after the
        copy; returns their staging slot indices."""
        if not experts:
            return []
        slots, copy = self.stage_async(experts)
        self.copier.wait(copy)
        return slots

    def stage_async(self, experts: list[int], first: int = 0) -> tuple[list[int], Copy]:
        """Starts copying `experts` into the staging slots from staging slot `first` on."""
        if first + len(experts) > self.n_staging:
            raise ValueError(f"{len(experts)} experts from staging slot {first} exceed {self.n_staging} slots")
        slots = list(range(first, first + len(experts)))
        return slots, self.copier.copy([(h[e], d[s]) for e, s in zip(experts, slots)
                                        for h, d in zip(self._host_views, self._staging_views)])

    def _copy_pairs(self, expert: int, slot: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(host, slot) for the expert's gate, up and down bytes; host is the map or the RAM copies."""
        return [(h[expert], d[slot]) for h, d in zip(self._host_views, self._slot_views)]

    def free_slot(self) -> int | None:
        free = np.nonzero(self.slot_expert < 0)[0]
        return int(free[0]) if free.size else None

    def buffers_of(self, staged: bool) -> list[torch.Tensor]:
        """The gate, up and down slot buffers: the resident slots', or the staging slots'."""
        return self.staging.buffers if staged else self.buffers

    def weights(self, slot: int, staged: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Float32 gate, up, down of the expert in `slot` (a staging slot when `staged`), decoded
        on the accelerator."""
        w = self.w
        return tuple(dequantize_layout(buf[slot], t.qtype, t.shape[1:])
                     for buf, t in zip(self.buffers_of(staged), (w.gate, w.up, w.down)))


def _slot_buffer(t: ExpertTensor, n: int, device: torch.device) -> torch.Tensor:
    """Slots for `n` experts of tensor `t` in the kernels' layout; padded rows start zeroed
    (copies never write the padding: its bytes stay defined)."""
    rows, row_bytes = t.raw.shape[1], t.raw.shape[2]
    padded_row = layout_bytes(t.qtype, row_bytes, t.shape[-1])
    alloc = torch.zeros if padded_row != row_bytes else torch.empty
    return alloc((n, rows, padded_row), dtype=torch.uint8, device=device)
