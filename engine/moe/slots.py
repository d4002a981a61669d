"""Per-layer expert slots on the accelerator and the residency map that says who lives where.

A slot holds one whole expert (gate, up, down) in its GGUF-quantized bytes. The residency
map only ever names experts whose copy has LANDED: a slot being refilled is first taken out
of the map (so no hit can read it), then copied, and only after the copy has landed does the
map point at it again. Staging slots after the resident ones receive this step's uploads.
"""
from __future__ import annotations

import numpy as np
import torch

from engine.layers.moe import ExpertWeights
from engine.moe.copier import Copier, Copy
from engine.quant.dequant import dequantize


class HostExperts:
    """Where uploads read expert bytes from: the memory-mapped file, or a resident RAM copy.

    `load_mode="mmap"` reads the mapped GGUF pages (the OS may evict them under memory
    pressure); `"none"` copies every expert into RAM at start (pinned when CUDA is used) so
    uploads are true asynchronous DMA and nothing is read from disk while generating.
    """

    def __init__(self, w: ExpertWeights, load_mode: str, pin: bool):
        if load_mode not in ("mmap", "none"):
            raise ValueError(f"load mode must be mmap or none, not {load_mode!r}")
        self.tensors = [t.raw for t in (w.gate, w.up, w.down)]
        if load_mode == "none":
            self.tensors = [t.clone().pin_memory() if pin else t.clone() for t in self.tensors]

    def expert(self, e: int) -> list[torch.Tensor]:
        return [t[e] for t in self.tensors]


class LayerSlots:
    def __init__(self, w: ExpertWeights, n_slots: int, n_staging: int, device: torch.device,
                 host: HostExperts, copier: Copier):
        self.w, self.n_slots, self.n_staging, self.device = w, n_slots, n_staging, device
        self.host, self.copier = host, copier
        n = n_slots + n_staging
        self.buffers = [torch.empty((n, *t.raw.shape[1:]), dtype=torch.uint8, device=device)
                        for t in (w.gate, w.up, w.down)]
        self.resident = np.full(w.n_expert, -1, np.int32)  # expert -> slot, landed copies only
        self.slot_expert = np.full(n_slots, -1, np.int32)  # slot -> expert, landed or in flight
        self.pending: list[tuple[int, int, Copy]] = []  # (slot, expert, copy)

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
        return landed

    def in_flight(self) -> set[int]:
        return {expert for _, expert, _ in self.pending}

    def load(self, slot: int, expert: int) -> Copy:
        """Refills `slot` with `expert`: unpublishes the old expert now, publishes the new on landing."""
        old = self.slot_expert[slot]
        if old >= 0 and self.resident[old] == slot:
            self.resident[old] = -1
        self.slot_expert[slot] = expert
        handle = self.copier.copy(list(zip(self.host.expert(expert), (b[slot] for b in self.buffers))))
        self.pending.append((slot, expert, handle))
        return handle

    def stage(self, experts: list[int]) -> list[int]:
        """Copies `experts` into the staging slots for this step; returns their slot indices."""
        slots = list(range(self.n_slots, self.n_slots + len(experts)))
        pairs = [pair for e, s in zip(experts, slots) for pair in zip(self.host.expert(e), (b[s] for b in self.buffers))]
        self.copier.wait(self.copier.copy(pairs))
        return slots

    def free_slot(self) -> int | None:
        free = np.nonzero(self.slot_expert < 0)[0]
        return int(free[0]) if free.size else None

    def weights(self, slot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Float32 gate, up, down of the expert in `slot`, decoded on the accelerator."""
        w = self.w
        return tuple(dequantize(buf[slot], t.qtype, t.shape[1:]) for buf, t in zip(self.buffers, (w.gate, w.up, w.down)))
