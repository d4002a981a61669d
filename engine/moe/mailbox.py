"""The GPU side of a one-token MoE layer step inside the decode graph, and the doorbell to the CPU.

A decode token is one CUDA graph replay (engine/runtime/decode_runner.py); nothing in it waits
for the host unless a layer routed the token to an expert that is not resident. Per MoE layer
the graph runs:

  route     one program: the router's ids become slot ids through the residency map (a GPU
            int32 table, expert -> slot or -1), the expert counts and hits are counted; where
            the layer has the mapped route, the first of the token's misses (as many as the
            layer's table gives for their count, tune.mapped_misses) are marked MAPPED (-2) and
            listed for the mapped launch; the layer's mailbox is published: where a pair is left
            to the CPU (-1), the slots, the layer input, ids, weights and the token's number
            (box_cpu[layer]), then the token's number release-stored at system scope in
            seq[layer]; otherwise that number alone, a relaxed store (no fence: the host reads it
            alone)
  experts   the expert kernels over the k pairs (engine/quant/triton_kernels.experts_forward);
            a pair without a slot does nothing there. With the mapped route, the same kernels
            again over the experts' pinned host rows for the MAPPED pairs (read over PCIe)
  collect   per slice of the hidden size: when a pair is the CPU's, spin (acquire loads,
            bounded by the GPU's clock) until the host's flag says its rows are written, then
            sum the k weighted rows in top-k order, the CPU's read from the mailbox: the same
            order and maths as the all-resident path

The host (`Mailbox.serve`) walks the layers after launching the replay: it waits for each
layer's sequence number, and where the layer left pairs to the CPU (box_cpu holds this token),
computes them with the CPU pool's ggml kernels over the GGUF blocks, writes the weighted rows,
then the flag. Pinned host memory is mapped into the GPU's address space (UVA), so both sides
read and write it directly; x86 keeps the host's stores (and loads) in order, and the GPU's
release/acquire at system scope orders its own. Sequence numbers come from a device counter
bumped at the start of each token, never from a literal captured into the graph.

A timed-out wait records the layer in an error word and lets the graph finish (a hang would take
the desktop with it); the host turns it into an engine error. Measured on the H200 (DESIGN.md,
"One decode token"): ~11 µs per layer for a round trip, against 45-65 µs for the sync and
host-side split it replaces.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from engine.errors import EngineError
from engine.quant.triton_kernels import HostTensor

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

WAIT_TIMEOUT_S = 30.0  # the GPU gives up on the host after this; far beyond any layer's CPU work
CPU, MAPPED = -1, -2  # a pair's slot when the CPU pool computes it / the GPU reads its expert from host memory


if triton is not None:
    from engine.quant.triton_kernels import acquire_load, clock_ns

    _CPU = tl.constexpr(CPU)
    _MAPPED = tl.constexpr(MAPPED)

    @triton.jit
    def _release_store(ptr, value):
        """ptr <- value, ordered after every earlier store of the program (system scope)."""
        tl.debug_barrier()
        tl.inline_asm_elementwise("fence.sc.sys; st.release.sys.global.b32 [$1], $2; mov.u32 $0, 0;",
                                  "=r,l,r", [ptr, value], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _relaxed_store(ptr, value):
        """ptr <- value at system scope, ordered after nothing: for a word the host reads alone."""
        tl.inline_asm_elementwise("st.relaxed.sys.global.b32 [$1], $2; mov.u32 $0, 0;",
                                  "=r,l,r", [ptr, value], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _route_kernel(ids_ptr, map_ptr, slots_ptr, exp_ptr, stats_ptr, token_ptr, armed_ptr, mapped_ptr,
                      mapped_exp_ptr, x_ptr, w_ptr, box_x_ptr, box_ids_ptr, box_w_ptr, box_slots_ptr, box_cpu_ptr,
                      seq_ptr, n_expert, D: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr,
                      MAILBOX: tl.constexpr, MAPPED_ROUTE: tl.constexpr):
        j = tl.arange(0, BK)
        live = j < K
        e = tl.load(ids_ptr + j, mask=live, other=0).to(tl.int32)
        s = tl.load(map_ptr + e, mask=live, other=0)
        # stats row: selections per expert, then the hits, then the pairs read from host memory
        hit = tl.sum(((s >= 0) & live).to(tl.int32), axis=0)
        if MAPPED_ROUTE:
            missed = ((s < 0) & live).to(tl.int32)
            n_mapped = tl.load(mapped_ptr + tl.sum(missed, axis=0))  # of this many misses (the layer's table)
            mapped = (missed != 0) & (tl.cumsum(missed, axis=0) <= n_mapped)  # the first, in top-k order
            s = tl.where(mapped, _MAPPED, s)
            tl.store(mapped_exp_ptr + j, tl.where(mapped, e, -1), mask=live)
            tl.atomic_add(stats_ptr + n_expert + 1, tl.sum(mapped.to(tl.int32), axis=0))
        tl.store(slots_ptr + j, s, mask=live)
        tl.store(exp_ptr + j, e, mask=live)
        tl.atomic_add(stats_ptr + e, 1, mask=live)
        tl.atomic_add(stats_ptr + n_expert, hit)
        if MAILBOX:
            if tl.load(armed_ptr) != 0:
                token = tl.load(token_ptr)
                if tl.sum(((s == _CPU) & live).to(tl.int32), axis=0) > 0:
                    tl.store(box_slots_ptr + j, s, mask=live)
                    tl.store(box_ids_ptr + j, e, mask=live)
                    tl.store(box_w_ptr + j, tl.load(w_ptr + j, mask=live, other=0.0), mask=live)
                    d = tl.arange(0, BD)
                    for a in range(0, D, BD):
                        m = a + d < D
                        tl.store(box_x_ptr + a + d, tl.load(x_ptr + a + d, mask=m, other=0.0), mask=m)
                    tl.store(box_cpu_ptr, token)
                    _release_store(seq_ptr, token)
                else:  # the host reads seq alone: no fence (a fence at system scope cost ~3 us a layer)
                    _relaxed_store(seq_ptr, token)

    @triton.jit
    def _collect_kernel(slots_ptr, per_slot_ptr, box_out_ptr, flag_ptr, error_ptr, token_ptr, armed_ptr,
                        out_ptr, layer_tag, timeout_ns, D: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                        BD: tl.constexpr, MAILBOX: tl.constexpr):
        """out[slice] = sum over j in top-k order of the pair's weighted row: per_slot[j] for a
        resident expert or a mapped one, the host's box_out[j] for one the CPU computed."""
        d = tl.program_id(0) * BD + tl.arange(0, BD)
        m = d < D
        if MAILBOX:
            j = tl.arange(0, BK)
            slots = tl.load(slots_ptr + j, mask=j < K, other=0)
            on_cpu = tl.sum(((slots == _CPU) & (j < K)).to(tl.int32), axis=0)
            if (on_cpu > 0) & (tl.load(armed_ptr) != 0):
                want = tl.load(token_ptr)
                got = acquire_load(flag_ptr, True, False)
                now = clock_ns(want)
                deadline = now + timeout_ns
                while (got < want) & (now < deadline):
                    got = acquire_load(flag_ptr, True, False)
                    now = clock_ns(want)
                if got < want:
                    tl.store(error_ptr, layer_tag)
        total = tl.zeros((BD,), tl.float32)
        for jj in tl.static_range(0, K):
            v = tl.load(per_slot_ptr + jj * D + d, mask=m, other=0.0)
            if MAILBOX:
                if tl.load(slots_ptr + jj) == _CPU:
                    v = tl.load(box_out_ptr + jj * D + d, mask=m, other=0.0, volatile=True)
            if jj == 0:
                total = v
            else:
                total = total + v
        tl.store(out_ptr + d, total, mask=m)


class Mailbox:
    """Pinned host memory shared by the decode graph and the host, one row per MoE layer, plus
    the device-side tables the graph reads (the residency map) and counts in (stats)."""

    COLLECT_BLOCK = 256

    def __init__(self, layers: list[int], n_expert: int, k: int, n_embd: int, device: torch.device,
                 with_mailbox: bool):
        n = len(layers)
        self.layers, self.index = layers, {layer: i for i, layer in enumerate(layers)}
        self.k, self.n_embd, self.n_expert, self.device = k, n_embd, n_expert, device
        self.with_mailbox = with_mailbox
        self.map = torch.full((n, n_expert), -1, dtype=torch.int32, device=device)
        # per layer: selections per expert, then the hits, then the pairs read from host memory
        self.stats = torch.zeros((n, n_expert + 2), dtype=torch.int32, device=device)
        # the mapped route, per layer: of m misses how many take it (read where route() is told the
        # layer has the route)
        self.mapped = torch.zeros((n, k + 1), dtype=torch.int32, device=device)
        self.pair_mapped = torch.full((n, k), -1, dtype=torch.int32, device=device)  # expert, or -1
        self.token = torch.zeros(1, dtype=torch.int32, device=device)  # bumped at each token's start
        self.armed = torch.zeros(1, dtype=torch.int32, device=device)  # 0: publish nothing, wait for nothing
        self.token_no = 0  # the host's count of executed tokens, equal to `token` after each one
        # per layer: the pair table the expert kernels read (tok, pos constant; slot, expert routed)
        self.pair_tok = torch.zeros(k, dtype=torch.int32, device=device)
        self.pair_pos = torch.arange(k, dtype=torch.int32, device=device)
        self.pair_slot = torch.zeros((n, k), dtype=torch.int32, device=device)
        self.pair_exp = torch.zeros((n, k), dtype=torch.int32, device=device)
        self.per_slot = torch.zeros((n, k, 1, n_embd), dtype=torch.float32, device=device)
        self.out = torch.zeros((n, 1, n_embd), dtype=torch.float32, device=device)
        pin = device.type == "cuda"
        # host side: written by the GPU (x, ids, weights, slots, seq) and by the host (out, flag)
        self.box_x = torch.zeros((n, 1, n_embd), dtype=torch.float32, pin_memory=pin)
        self.box_ids = torch.zeros((n, k), dtype=torch.int32, pin_memory=pin)
        self.box_w = torch.zeros((n, k), dtype=torch.float32, pin_memory=pin)
        self.box_slots = torch.zeros((n, k), dtype=torch.int32, pin_memory=pin)
        self.box_cpu = torch.zeros(n, dtype=torch.int32, pin_memory=pin)  # the last token a layer left pairs to the CPU
        self.seq = torch.zeros(n, dtype=torch.int32, pin_memory=pin)
        self.box_out = torch.zeros((n, k, n_embd), dtype=torch.float32, pin_memory=pin)
        self.flag = torch.zeros(n, dtype=torch.int32, pin_memory=pin)
        self.error = torch.zeros(1, dtype=torch.int32, pin_memory=pin)
        self._np = {name: getattr(self, name).numpy() for name in
                    ("box_x", "box_ids", "box_w", "box_slots", "box_cpu", "seq", "box_out", "flag", "error")}
        self.stats_host = torch.zeros((n, n_expert + 2), dtype=torch.int32, pin_memory=pin)
        self._stats_event: torch.cuda.Event | None = None

    def route_mapped(self, layer: int, of_misses: np.ndarray) -> None:
        """The mapped route's split for `layer`: of m misses of a token, of_misses[m] (the first
        in top-k order; tune.mapped_misses) are read by the GPU from host memory. Before capture."""
        self.mapped[self.index[layer]].copy_(torch.from_numpy(np.asarray(of_misses, dtype=np.int32)))

    # --- inside the graph ------------------------------------------------------------------------
    def prologue(self) -> None:
        self.token.add_(1)

    def route(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              mapped_route: bool = False) -> None:
        i = self.index[layer]
        bk = triton.next_power_of_2(self.k)
        _route_kernel[(1,)](ids, self.map[i], self.pair_slot[i], self.pair_exp[i], self.stats[i], self.token,
                            self.armed, self.mapped[i], self.pair_mapped[i], x, weights, HostTensor(self.box_x[i]),
                            HostTensor(self.box_ids[i]), HostTensor(self.box_w[i]), HostTensor(self.box_slots[i]),
                            HostTensor(self.box_cpu[i:i + 1]), HostTensor(self.seq[i:i + 1]),
                            self.n_expert, D=self.n_embd, K=self.k, BK=bk, BD=1024, MAILBOX=self.with_mailbox,
                            MAPPED_ROUTE=mapped_route, num_warps=4)

    def collect(self, layer: int) -> torch.Tensor:
        i = self.index[layer]
        bd = self.COLLECT_BLOCK
        _collect_kernel[(triton.cdiv(self.n_embd, bd),)](
            self.pair_slot[i], self.per_slot[i], HostTensor(self.box_out[i]), HostTensor(self.flag[i:i + 1]),
            HostTensor(self.error), self.token, self.armed, self.out[i], i + 1, int(WAIT_TIMEOUT_S * 1e9),
            D=self.n_embd, K=self.k, BK=triton.next_power_of_2(self.k), BD=bd, MAILBOX=self.with_mailbox,
            num_warps=4)
        return self.out[i]

    # --- on the host -----------------------------------------------------------------------------
    def arm(self, armed: bool) -> None:
        self.armed.fill_(1 if armed else 0)

    def serve(self, compute: Callable[[int, np.ndarray, np.ndarray], np.ndarray], idle: Callable[[], bool],
              timeout_s: float = WAIT_TIMEOUT_S) -> None:
        """Answers this token's layers in order, after its replay was launched: `compute(layer,
        x [1, D], experts [m])` gives the missed experts' unweighted rows [m, D]. While the GPU
        has not reached the next layer, `idle()` runs (a unit of other host work; False once
        there is none left)."""
        t = self.token_no
        seq, flag, slots, cpu = self._np["seq"], self._np["flag"], self._np["box_slots"], self._np["box_cpu"]
        failure: Exception | None = None
        busy = True
        for i, layer in enumerate(self.layers):
            deadline = time.monotonic() + timeout_s
            while seq[i] < t:
                if busy:
                    busy = idle()
                elif time.monotonic() > deadline:
                    failure = failure or EngineError(f"the GPU did not reach MoE layer {layer} within {timeout_s:.0f} s")
                    break
            if seq[i] < t or cpu[i] != t:  # not reached (a failure), or no pair left to the CPU
                continue
            pos = np.flatnonzero(slots[i] == CPU)
            if failure is None:
                try:
                    rows = compute(layer, self._np["box_x"][i], self._np["box_ids"][i, pos])
                    self._np["box_out"][i, pos] = rows * self._np["box_w"][i, pos, None]
                except Exception as e:  # the GPU is still released below; the error surfaces after the token
                    failure = EngineError(f"the CPU expert pool failed on layer {layer}: {type(e).__name__}: {e}")
            flag[i] = t
        if failure is not None:
            raise failure

    def check(self) -> None:
        """After the token's results were read: raises if a wait on the host timed out."""
        err = int(self._np["error"][0])
        if err:
            self._np["error"][0] = 0
            raise EngineError(f"the CPU expert pool did not answer MoE layer {self.layers[err - 1]} within "
                              f"{WAIT_TIMEOUT_S:.0f} s; that token's output is wrong")

    def snapshot_stats(self) -> None:
        """Enqueues a copy of the counters (after the work enqueued so far) to read later."""
        self.stats_host.copy_(self.stats, non_blocking=True)
        if self.device.type == "cuda":
            self._stats_event = torch.cuda.Event()
            self._stats_event.record()

    def stats_ready(self) -> bool:
        return self._stats_event is None or self._stats_event.query()
