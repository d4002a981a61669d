"""A one-token MoE layer step on the GPU as two CUDA graph replays.

Launching the three Triton expert kernels from Python costs ~150 µs of host time per layer,
six times their GPU time (`moestudio bench kernels` on the H200). For a one-token step the
work has a fixed shape, top-k pairs, so it is captured once per layer:

  compute   copy this step's pair table from pinned host memory, then the expert kernels for
            all k pairs into per_slot[j] (pairs whose expert runs on the CPU point at slot 0:
            their rows are computed and then overwritten, which costs one expert's read
            instead of a second graph shape)
  combine   total = per_slot[0] + per_slot[1] + ... in top-k order, as the eager path sums

Between the two the host writes the CPU pool's rows into per_slot. The graphs read the
caller's x and weights in place, so they are valid while the caller passes the same static
tensors (engine/models/decode_graphs.py does); `matches` tells when they are not.
"""
from __future__ import annotations

import numpy as np
import torch

from engine.layers.moe import ExpertWeights


class ExpertStepGraph:
    def __init__(self, buffers: list[torch.Tensor], w: ExpertWeights, x: torch.Tensor, weights: torch.Tensor):
        from engine.quant import triton_kernels as tk

        k = weights.shape[1]
        dev = x.device
        self.x, self.weights = x, weights
        self.table_host = torch.zeros(4, k, dtype=torch.int32).pin_memory()  # tok, pos, slot, expert
        self.table_host[1] = torch.arange(k, dtype=torch.int32)
        self.table = torch.zeros(4, k, dtype=torch.int32, device=dev)
        self.per_slot = torch.zeros(k, 1, x.shape[1], dtype=torch.float32, device=dev)

        def compute() -> None:
            self.table.copy_(self.table_host, non_blocking=True)
            tk.experts_forward(x, buffers, w, self.table[0], self.table[1], self.table[2], self.table[3], weights,
                               self.per_slot)

        def combine() -> torch.Tensor:
            total = self.per_slot[0]
            for j in range(1, k):
                total = total + self.per_slot[j]
            return total

        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            compute()  # warm-up on the capture stream: kernels built, this stream's semaphores allocated
            combine()
            # capture_begin/end rather than torch.cuda.graph(): that one also collects garbage
            # and empties the allocator's cache at every capture, seconds over 48 layers.
            self.compute_graph, self.combine_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            self.compute_graph.capture_begin()
            try:
                compute()
            finally:
                self.compute_graph.capture_end()
            self.combine_graph.capture_begin()
            try:
                self.total = combine()
            finally:
                self.combine_graph.capture_end()
        torch.cuda.current_stream(dev).wait_stream(stream)

    def matches(self, x: torch.Tensor, weights: torch.Tensor) -> bool:
        return x.data_ptr() == self.x.data_ptr() and weights.data_ptr() == self.weights.data_ptr()

    def compute(self, experts: np.ndarray, slots: np.ndarray) -> None:
        """Enqueues the k pairs: experts [k] (the token's top-k ids), slots [k] where each lives."""
        self.table_host[2].numpy()[:] = slots
        self.table_host[3].numpy()[:] = experts
        self.compute_graph.replay()

    def put(self, positions: np.ndarray, rows: torch.Tensor) -> None:
        """per_slot[j] = rows[i] * weights[0, j] for top-k positions j (the CPU pool's results)."""
        pos = torch.from_numpy(positions).to(self.per_slot.device, non_blocking=True)
        self.per_slot[pos, 0] = rows * self.weights[0, pos, None]

    def combine(self) -> torch.Tensor:
        self.combine_graph.replay()
        return self.total
