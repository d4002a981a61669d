"""The hybrid executor's one-token step as it runs inside the decode token's CUDA graph.

HybridExperts splits along three lines here:
  decide   on the GPU: the residency map turns router ids into slot ids (mailbox.route)
  execute  on the GPU: the expert kernels over the resident pairs (in three launches, or where
           asked in one: step_form.py), and where measured costs say so the first misses read
           straight from the experts' pinned host rows (the mapped route, tune.mapped_misses); on
           the CPU: the other misses, answered through the mailbox while the graph runs
           (Mailbox.serve)
  learn    on the host, off the critical path: the GPU's per-layer expert counts are read back
           asynchronously after each token, fed to the residency policy, whose refills copy on
           the copier's stream; a map entry flips only once its copy has landed, between tokens

The host's order per token (engine/runtime/decode_runner.DecodeRunner.step):
  before_token   publish landed copies (and unpublished slots) in the GPU map
  replay         the graph (its prologue bumps the token number on the GPU)
  after_launch   serve the mailbox; in its waits for the GPU, learn from the previous token's
                 counters (their read-back has landed); enqueue this token's read-back
  check          after the logits were read: a timed-out wait (the mailbox's, or one inside a
                 one-launch step) becomes an engine error
The telemetry's counters therefore trail the GPU by one token.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import torch

from engine.errors import EngineError
from engine.moe import step_form
from engine.moe.mailbox import Mailbox
from engine.moe.tune import mapped_misses
from engine.quant import triton_kernels as tk
from engine.runtime.telemetry import Telemetry


class TokenExperts:
    """Drop-in for DecoderModel.experts inside the token graph (one row, float32)."""

    def __init__(self, hybrid, k: int, n_embd: int):
        self.hybrid = hybrid
        layers = hybrid.layer_ids
        n_expert = max(hybrid.layers[layer].w.n_expert for layer in layers)
        # Every expert landed and a slot for each: no policy ever evicts one (refills only
        # answer misses), so no layer can miss and the graph needs no mailbox.
        all_resident = all(L.slots.n_slots >= L.w.n_expert and L.slots.resident.min() >= 0
                           for L in hybrid.layers.values())
        self.mailbox = Mailbox(layers, n_expert, k, n_embd, hybrid.device, with_mailbox=not all_resident)
        # The mapped route where the costs measured at load give it work and the experts are in
        # pinned RAM: the kernels then read those rows (GGUF layout) as if they were slots.
        self.host_rows: dict[int, list[tk.HostTensor]] = {}
        of_misses = mapped_misses(k, hybrid.options.route_costs)
        if self.mailbox.with_mailbox and of_misses.any():
            for layer in layers:
                w = hybrid.layers[layer].w
                tensors = [t.raw for t in (w.gate, w.up, w.down)]
                if all(t.is_pinned() for t in tensors):
                    self.host_rows[layer] = [tk.HostTensor(t) for t in tensors]
                    self.mailbox.route_mapped(layer, of_misses)
        # the mapped launches' stream: a branch of the token's graph (__call__)
        self._branch = torch.cuda.Stream(hybrid.device) if self.host_rows else None
        if hybrid.counters.miss_routes is not None:
            hybrid.counters.miss_routes["mapped_of_misses"] = of_misses.tolist() if self.host_rows else []
        self.one_launch = self._choose_forms(k)  # the layers whose step runs as one launch
        # a wait inside a one-launch step that timed out, copied out after each replay
        self._late = tk.step_error_word(hybrid.device) if self.one_launch else None
        self._late_host = torch.zeros(1, dtype=torch.int32, pin_memory=True) if self.one_launch else None
        self._pushed_version: int | None = None  # the layers' residency versions summed, as the GPU map holds them
        self._seen = np.zeros((len(layers), n_expert + 2), np.int64)  # counters learnt from so far
        self._refills: list = []  # (layer index, layer, refills) learnt, not yet started
        self._sync_copies: list = []  # occurrence-sync's refills, waited for before the next token

    # --- inside the graph ------------------------------------------------------------------------
    def prologue(self) -> None:
        self.mailbox.prologue()

    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        mb, i = self.mailbox, self.mailbox.index[layer]
        L = self.hybrid.layers[layer]
        mapped = layer in self.host_rows
        mb.route(layer, x, ids, weights, mapped_route=mapped)
        if not mapped:
            tk.experts_forward(x, L.slots.buffers, L.w, mb.pair_tok, mb.pair_pos, mb.pair_slot[i], mb.pair_exp[i],
                               weights, mb.per_slot[i], one_launch=layer in self.one_launch)
            return mb.collect(layer)
        rounded = tk.round_inputs(x, L.w)  # x rounded once for both routes
        # The mapped misses, into the same per-pair rows, on a branch of their own beside the
        # resident pairs: most layers have none, and their launches (whose programs end at once)
        # then cost nothing on the token's path; a mapped read overlaps the resident step.
        main = torch.cuda.current_stream(x.device)
        self._branch.wait_stream(main)
        with torch.cuda.stream(self._branch):
            tk.experts_forward(x, self.host_rows[layer], L.w, mb.pair_tok, mb.pair_pos, mb.pair_mapped[i],
                               mb.pair_mapped[i], weights, mb.per_slot[i], rounded=rounded)
        tk.experts_forward(x, L.slots.buffers, L.w, mb.pair_tok, mb.pair_pos, mb.pair_slot[i], mb.pair_exp[i],
                           weights, mb.per_slot[i], rounded=rounded, one_launch=layer in self.one_launch,
                           rounded_just_before=True)
        main.wait_stream(self._branch)
        return mb.collect(layer)

    # --- on the host -----------------------------------------------------------------------------
    def arm(self, armed: bool) -> None:
        """Unarmed, the graph's layers neither publish nor wait (and missed pairs read stale
        rows): for the warm-up that compiles and loads every kernel before any wait can spin."""
        self.mailbox.arm(armed)

    def before_token(self) -> None:
        self.hybrid.end_prompt()
        self._push_map()
        self.mailbox.token_no += 1

    def after_launch(self) -> None:
        """While the replay runs: answer the layers that missed, and between them (while the GPU
        has not reached the next layer) learn from the previous token's counters, whose
        read-back has landed; then enqueue this token's read-back and start the refills. Nothing
        here may wait for the GPU before the last layer is answered: the GPU may be waiting
        for the host."""
        h = self.hybrid
        learning = self._learning()
        if self.mailbox.with_mailbox:
            self.mailbox.serve(self._compute_misses, lambda: next(learning, None) is not None)
            h.counters.cpu_busy_s = h.pool.busy_seconds
        for _ in learning:
            pass
        self.mailbox.snapshot_stats()
        if self._late is not None:
            self._late_host.copy_(self._late, non_blocking=True)
        self._start_refills()

    @torch.inference_mode()  # the mailbox's tensors were made in it (the capture's forward)
    def forget_counts(self) -> None:
        """The tokens the GPU has counted so far teach nothing: the capture's unarmed warm-up (one
        token that is not one), the engine's warm-up at load (the read-back holds them too, so the
        next token's learning sees no change until its own read-back). The GPU must be idle."""
        self.mailbox.stats_host.copy_(self.mailbox.stats)
        self._seen = self.mailbox.stats_host.numpy().astype(np.int64)

    @torch.inference_mode()
    def settle(self) -> None:
        """The last token's counters into the telemetry and the policy now (end of a request)."""
        torch.cuda.current_stream(self.hybrid.device).synchronize()
        for _ in self._learning():
            pass
        self._start_refills()
        self._push_map()

    def check(self) -> None:
        """After the token's results were read (the stream is idle): raises if a wait timed out."""
        self.mailbox.check()
        if self._late_host is not None and self._late_host[0]:
            self._late_host.zero_()
            self._late.zero_()
            raise EngineError("an expert step in one launch waited in vain on the GPU for its own earlier "
                              "programs; that token's output is wrong (MOESTUDIO_ONE_LAUNCH_STEP=0 decodes in "
                              "three launches)")

    def _choose_forms(self, k: int) -> set[int]:
        """Each kind of layer's step form (step_form.choose), reported as the telemetry's
        decode_expert_step; the layers that take one launch."""
        h = self.hybrid
        kinds: dict[tuple, list[int]] = {}
        for layer in self.mailbox.layers:
            h.layers[layer].slots.refresh()  # the step is timed on landed experts: every one there
            kinds.setdefault(step_form.kind(h.layers[layer].w), []).append(layer)
        one_launch, report = set(), {}
        for layers in kinds.values():
            slot_layers = [step_form.SlotLayer(h.layers[layer].w, h.layers[layer].slots.buffers,
                                               h.layers[layer].slots.resident) for layer in layers]
            form = step_form.choose(slot_layers, k, h.device)
            if form.one_launch:
                one_launch.update(layers)
            report[step_form.label(slot_layers[0].w)] = dataclasses.asdict(form)
        h.counters.decode_expert_step = report
        return one_launch

    def _compute_misses(self, layer: int, x: np.ndarray, experts: np.ndarray) -> np.ndarray:
        return self.hybrid.pool.compute(layer, x, np.zeros(len(experts), np.int32), experts)

    def _learning(self) -> Iterator[None]:
        """The counters of the tokens since the last call: the telemetry at once, then each
        layer's policy, one layer per step (so the host can do it in the gaps of serving)."""
        mb = self.mailbox
        if not mb.stats_ready():
            return
        now = mb.stats_host.numpy().astype(np.int64)
        delta, self._seen = now - self._seen, now
        n_expert = mb.n_expert
        chosen, hits, mapped = delta[:, :n_expert], delta[:, n_expert], delta[:, n_expert + 1]
        if not chosen.any():
            return
        h = self.hybrid
        if not h.learning:  # the engine's warm-up (HybridExperts.learning_paused)
            return
        c = h.counters
        c.gpu_hit += hits
        c.gpu_mapped += mapped
        c.cpu_computed += chosen.sum(axis=1) - hits - mapped
        c.heat *= Telemetry.HEAT_DECAY
        c.heat[:, :n_expert] += chosen
        for i, layer in enumerate(mb.layers):
            experts = chosen[i].nonzero()[0]
            if not experts.size:
                continue
            L = h.layers[layer]
            refills = L.policy.refills(experts, chosen[i, experts], L.slots.slot_expert, L.slots.resident,
                                       L.slots.in_flight())
            if refills:
                self._refills.append((i, L, refills))
            yield

    def _start_refills(self) -> None:
        """The refills learnt, copied now that no layer of the token waits for the host: a copy
        from pageable memory (the memory map) blocks the host until the copy stream, which
        follows the compute stream, has run it."""
        h = self.hybrid
        c = h.counters
        for i, L, refills in self._refills:
            handle = L.slots.load(refills)
            c.swaps[i] += len(refills)
            if L.policy.synchronous:  # waited for before the next token
                self._sync_copies.append(handle)
        if self._refills:
            c.bytes_uploaded = h.copier.bytes_copied
        self._refills.clear()

    def _push_map(self) -> None:
        """Landed copies join the GPU map, unpublished slots leave it (before the next replay,
        in stream order, so no replay reads a slot whose copy is in flight)."""
        h = self.hybrid
        if self._sync_copies:  # occurrence-sync: the next token sees every refill landed
            for handle in self._sync_copies:
                h.copier.wait(handle)
            torch.cuda.current_stream(h.device).synchronize()
            self._sync_copies.clear()
        version = 0
        for L in h.layers.values():
            if L.slots.pending:
                L.slots.refresh()
            version += L.slots.version
        if version == self._pushed_version:  # versions only grow: an equal sum is an unchanged map
            return
        table = np.stack([h.layers[layer].slots.resident for layer in self.mailbox.layers])
        self.mailbox.map[:, :table.shape[1]].copy_(torch.from_numpy(table))
        self._pushed_version = version
        h.counters.residency[:, :table.shape[1]] = table
