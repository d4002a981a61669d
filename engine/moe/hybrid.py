"""The hybrid expert executor: resident experts on the accelerator, the rest on the CPU.

A decode token on CUDA runs inside the token's CUDA graph instead (`token_experts`,
engine/moe/token_step.py); prompts, and one-token steps without the graph, take this path.
One MoE layer step here:
1. the selected ids (and the layer input, for the CPU pool) come to the host once: the only
   wait on the accelerator per layer;
2. distinct experts split into hits (landed in a slot), uploads (a `miss_fraction` share of
   the misses, copied into staging slots; in a step of many rows, the misses whose CPU cost
   is highest, as many as balance the two sides by measured cost, streamed through the
   staging slots, which the layers share, in turns) and CPU misses (the rest);
3. the CPU pool computes its misses from the memory-mapped GGUF bytes on this thread, once the
   accelerator's work is launched (on CUDA it runs meanwhile);
4. the weighted outputs are summed slot by slot in top-k order, the same order and maths as
   the all-resident path, so where an expert ran does not change the result;
5. counters are bumped and the policy's refills start copying; a slot joins the residency
   map only once its copy has landed.
A step of many rows reads nothing back where it can: with every expert of its layer resident
it is laid out on the GPU through the residency map; where some lack a slot and the step is
large enough that every expert is all but certain to be chosen, those are streamed whatever
the routing, in turns of half the staging slots, each turn's copy one ahead of the compute
(the next layer's first turn while this layer's last computes), and run through maps of the
staging slots. Its counts come back asynchronously and are learnt at the forward's last MoE
layer. A prompt chunk whose every layer is all on the GPU can be one CUDA graph replay
(engine/runtime/prompt_runner.py): its steps are captured here (`capturing_prompt`), each
copying its counts into a pinned buffer of the graph's own, learnt after the replay.
"""
from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from engine.config import Config
from engine.kernels import triton_applies
from engine.layers.moe import ExpertWeights, expert_ffn
from engine.moe.copier import Copier, Copy, upload, upload_tables
from engine.moe.cpu_pool import CpuExpertPool
from engine.moe.policy import AdaptParams, Policy
from engine.moe.slots import LayerSlots, StagingSlots, layout_key, resident_copies, resolve_load_mode
from engine.moe.tune import (RouteCosts, balanced_uploads, many_pairs, measure_costs, route_costs, streaming_pays,
                              streams_all)
from engine.plan.sizing import FRACTION_STEPS, STAGING_TURN_BYTES, staging_slots
from engine.quant.layout import layout_bytes
from engine.runtime.progress import ByteProgress, Progress
from engine.runtime.telemetry import CacheCounters, Telemetry


@dataclass(frozen=True)
class HybridOptions:
    slots_per_layer: int  # the expert cache (moe_expert_cache_size) as allocated in each layer
    miss_fraction: float  # resolved: the setting, or measured for auto (tune.py)
    policy: str = Config.moe_profile_adapt
    adapt: AdaptParams = AdaptParams()
    threads: int = 2
    top_k: int = 0  # experts per token; sizes the staging slots (0: as many as the fraction of all experts)
    copy_delay_s: float = 0.0  # tests: slow every copy down
    route_costs: RouteCosts | None = None  # misses are routed by these (tune.py): many-row steps, the mapped route
    staging_turn_bytes: int = STAGING_TURN_BYTES  # tests: a prompt's upload turns of fewer experts

    def __post_init__(self) -> None:
        if not 0.0 <= self.miss_fraction <= 1.0:
            raise ValueError("the GPU miss fraction must lie in [0, 1]")
        if self.slots_per_layer < 0:
            raise ValueError("the expert cache size must not be negative")


class _Layer:
    def __init__(self, w: ExpertWeights, slots: LayerSlots, policy: Policy):
        self.w, self.slots, self.policy = w, slots, policy
        self.upload_credit = 0.0
        self.device_map: tuple[int, torch.Tensor, torch.Tensor] | None = None  # (slots' version, slot_of, exp_of_slot)
        self.counts_host: torch.Tensor | None = None  # a step's expert counts, read back without waiting
        self.capture_counts: torch.Tensor | None = None  # the same inside a prompt graph being captured
        # The last step's rows per expert, its rows and its prompt (HybridExperts.prompt_id) when it
        # had many rows: what the next chunk of the same prompt will route like.
        self.last_many: tuple[np.ndarray, int, int] | None = None


@dataclass(frozen=True)
class PromptCounts:
    """A step captured in a prompt graph: each replay copies its rows per expert into `host`."""
    layer: int
    tokens: int
    host: torch.Tensor


@dataclass
class _Staged:
    """A turn of a layer's missing experts, copied into one half of the staging slots."""
    layer: int
    experts: np.ndarray
    slots: list[int]  # their staging slots
    copy: Copy


class HybridExperts:
    """Drop-in for DecoderModel.experts (see engine/layers/moe.Experts)."""

    kind = "hybrid"  # the engine's name in the telemetry

    def __init__(self, expert_weights: dict[int, ExpertWeights], device: torch.device | str,
                 options: HybridOptions, pool: CpuExpertPool | None = None):
        self.device = torch.device(device)
        self.options = options
        self.step_fraction = round(options.miss_fraction * FRACTION_STEPS)
        self._triton_broken = False  # set when a kernel fails to build: torch from then on
        self._grouped_broken = False  # the same for the grouped GEMM of many-row steps
        self._pinned: dict[torch.dtype, torch.Tensor] = {}  # read-back buffers (CUDA), grown as needed
        # (layer, tokens, counts landed, the experts it streamed, the host buffer they land in)
        self._unlearnt: list[tuple[int, int, torch.cuda.Event | None, np.ndarray, torch.Tensor]] = []
        self._captured: list[PromptCounts] | None = None  # a prompt graph's steps, while it is captured
        self._prefetched: _Staged | None = None  # the next MoE layer's first turn, copied ahead
        self._next_half = 0  # the staging half the next turn copies into
        # The GPU's idle while a many-row step reads its routing back (CUDA events around it,
        # timed once landed): what streaming a layer's missing experts saves, against their copies.
        self.read_back_s = 0.0
        self._read_back_marks: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.prompt_id = 0  # bumped by every decode token (end_prompt): a many-row step after it is a new prompt's
        self.learning = True  # False inside learning_paused: steps run, nothing is counted or learnt
        self._token_step = None  # the decode graph's TokenExperts, once made
        self.copier = Copier(self.device, options.copy_delay_s)
        self.pool = pool if pool is not None else CpuExpertPool(expert_weights, options.threads)
        self.layer_ids = sorted(expert_weights)
        self.index = {layer: i for i, layer in enumerate(self.layer_ids)}
        k_max = max(w.n_expert for w in expert_weights.values())
        self.layers: dict[int, _Layer] = {}
        staging: dict[tuple, StagingSlots | None] = {}  # one set per slot layout, shared by its layers
        for layer, w in expert_weights.items():
            n_slots = min(options.slots_per_layer, w.n_expert)
            shared = None
            if n_slots < w.n_expert:
                key = layout_key(w)
                if key not in staging:
                    expert_bytes = sum(layout_bytes(t.qtype, t.raw[0].numel(), t.shape[-1])
                                       for t in (w.gate, w.up, w.down))
                    n = staging_slots(options.miss_fraction, w.n_expert, options.top_k, expert_bytes,
                                      options.staging_turn_bytes)
                    staging[key] = StagingSlots(w, n, self.device) if n else None
                shared = staging[key]
            slots = LayerSlots(w, n_slots, shared, self.device, self.copier)
            self.layers[layer] = _Layer(w, slots, Policy(options.policy, w.n_expert, n_slots, options.adapt))
        self.counters = CacheCounters(self.layer_ids, k_max, min(options.slots_per_layer, k_max))

    # --- the decode token's graph ----------------------------------------------------------------
    def token_experts(self, k: int, n_embd: int):
        """The one-token step for the decode graph (engine/moe/token_step.py), where it applies:
        CUDA, the Triton kernels for every layer's expert types, a slot in every layer."""
        if self.device.type != "cuda" or self._triton_broken:
            return None
        x = torch.empty(1, n_embd, device=self.device)
        if not all(_use_triton(L.w, x, k) and L.slots.n_slots > 0 for L in self.layers.values()):
            return None
        from engine.moe.token_step import TokenExperts

        self._token_step = TokenExperts(self, k, n_embd)
        return self._token_step

    def end_prompt(self) -> None:
        """A decode token ran (in the token graph, which reports no step here): the next many-row
        step is another prompt's, whose experts its layers know nothing of. The prompt's graph
        replays are learnt by now (its logits were read: their counts have landed)."""
        self._learn_unlearnt(wait=True)
        self.prompt_id += 1

    # --- a prompt chunk's CUDA graph (engine/runtime/prompt_runner.py) ---------------------------
    def prompt_graph_version(self, rows: int, k: int, n_embd: int) -> tuple[int, ...] | None:
        """The residency version a chunk of `rows` rows (`k` experts each) may be captured or
        replayed under: every layer's step lies on the GPU (every expert landed in a slot, the
        grouped GEMM takes it, nothing read back) and reads the device maps of this version. None
        where a step needs the host."""
        if self.device.type != "cuda" or self._grouped_broken:
            return None
        x = torch.empty(rows, n_embd, device=self.device)
        ids = torch.empty(rows, k, dtype=torch.long, device=self.device)
        for L in self.layers.values():
            L.slots.refresh()
            if not self._all_on_gpu(L, x, ids):
                return None
        return tuple(L.slots.version for L in self.layers.values())

    @contextmanager
    def capturing_prompt(self) -> Iterator[list[PromptCounts]]:
        """The steps inside are being captured into a prompt graph: each copies its counts into a
        pinned buffer of this graph's (listed in what this yields, for `prompt_graph_ran`), nothing
        waits, nothing is counted. Earlier steps are learnt first."""
        self._learn_unlearnt(wait=True)
        pinned = self.device.type == "cuda"
        for L in self.layers.values():
            L.capture_counts = torch.empty(L.w.n_expert, dtype=torch.int32, pin_memory=pinned)
        self._captured = []
        try:
            yield self._captured
        finally:
            self._captured = None
            for L in self.layers.values():
                L.capture_counts = None

    def before_prompt_graph(self, counts: list[PromptCounts]) -> None:
        """A replay is about to rewrite `counts`' buffers: their last replay's are learnt first."""
        buffers = {id(c.host) for c in counts}
        if any(id(entry[4]) in buffers for entry in self._unlearnt):
            self._learn_unlearnt(wait=True)

    def prompt_graph_ran(self, counts: list[PromptCounts]) -> None:
        """A prompt graph was replayed: its steps' counts are learnt once landed, as an eager
        chunk's are."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        for c in counts:
            self._unlearnt.append((c.layer, c.tokens, event, np.zeros(0, np.int64), c.host))
        if self.learning:
            self.counters.prompt_steps["resident"] += len(counts)
            self.counters.prompt_graph_chunks += 1

    def settle_prompt(self) -> None:
        """A request ends: its prompt's counts reach the telemetry and the policies."""
        self._learn_unlearnt(wait=True)

    @contextmanager
    def learning_paused(self) -> Iterator[None]:
        """Steps inside compute as usual but teach nothing: no policy hears of them, so no refill
        starts, and the counters, the copier's and the CPU pool's totals and what the steps
        measured (read-back idle, a prompt's routing for its next chunk) are put back after. For
        the load's warm-up (Engine.warm_up), whose made-up tokens must neither evict the experts
        a profile or the placeholders put in the cache nor show in the dashboard's figures."""
        c = self.counters
        saved = ({name: copy.deepcopy(getattr(c, name)) for name in _LEARNT}, self.prompt_id, self.read_back_s,
                 self.pool.busy_seconds, self.copier.bytes_copied,
                 {layer: (L.upload_credit, L.last_many) for layer, L in self.layers.items()})
        self.learning = False
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._learn_unlearnt(wait=True)
            self._read_back_marks.clear()
            self._prefetched = None
            if self._token_step is not None:
                self._token_step.forget_counts()
            counters, self.prompt_id, self.read_back_s, self.pool.busy_seconds, self.copier.bytes_copied, layers = saved
            for name, value in counters.items():  # in place: the telemetry holds this object
                setattr(c, name, value)
            for layer, (credit, last_many) in layers.items():
                self.layers[layer].upload_credit, self.layers[layer].last_many = credit, last_many
            self.learning = True

    # --- residency -----------------------------------------------------------------------------
    def prefill_residency(self, ranking: list[tuple[int, int]],
                          progress: Callable[[int], None] | None = None) -> None:
        """Fills slots in `ranking` order ((layer, expert), hottest first) and waits for the copies;
        `progress` hears the bytes of each expert copied."""
        for layer, expert in ranking:
            L = self.layers.get(layer)
            if L is None or L.slots.resident[expert] >= 0 or expert in L.slots.in_flight():
                continue
            slot = L.slots.free_slot()
            if slot is not None:
                self.copier.wait(L.slots.load([(slot, expert)]))
                if progress is not None:
                    progress(L.slots.expert_bytes)
        for L in self.layers.values():
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            while L.slots.pending:
                L.slots.refresh()
        self._publish_residency()

    def _publish_residency(self) -> None:
        for layer, L in self.layers.items():
            self.counters.residency[self.index[layer]] = L.slots.resident

    # --- one layer step ------------------------------------------------------------------------
    def _split(self, L: _Layer, ids_host: np.ndarray):
        """Rows per expert of a step (all experts), its distinct experts, and which of them are
        hits, uploads and CPU misses."""
        rows_of = np.bincount(ids_host.ravel(), minlength=L.w.n_expert)
        experts = rows_of.nonzero()[0]  # sorted; np.flatnonzero costs 5x more
        where = L.slots.resident[experts]
        hits = experts[where >= 0]
        misses = experts[where < 0]
        costs = self.options.route_costs
        if ids_host.shape[0] > 1 and costs is not None and L.slots.n_staging:
            misses = misses[np.argsort(-rows_of[misses], kind="stable")]
            n_up = balanced_uploads(rows_of[misses], len(hits), costs)
            return rows_of, experts, hits, misses[:n_up], misses[n_up:]
        misses = misses[np.argsort(-L.policy.counts[misses], kind="stable")]  # upload the hottest
        L.upload_credit += len(misses) * self.step_fraction / FRACTION_STEPS
        n_up = min(int(L.upload_credit + 1e-9), len(misses), L.slots.n_staging)
        # What staging could not take is dropped, not owed: a long prefill step must not make the
        # following decode steps upload every miss. The remainder below one carries (resolution).
        L.upload_credit = min(L.upload_credit - n_up, 1.0)
        return rows_of, experts, hits, misses[:n_up], misses[n_up:]

    def replay(self, layer: int, ids_host: np.ndarray) -> None:
        """Takes a layer step's residency decisions and counters without computing experts:
        hit rates of a policy over a recorded routing trace (engine/bench/hitrate.py)."""
        L = self.layers[layer]
        L.slots.refresh()
        rows_of, experts, hits, uploads, cpu = self._split(L, ids_host)
        self._run_uploads(L, uploads.tolist(), compute=None)
        self._account(layer, L, rows_of, experts, hits, uploads, cpu, len(ids_host))

    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        L = self.layers[layer]
        L.slots.refresh()  # refills that landed serve this step (and leave the streamed turns)
        prefetched, self._prefetched = self._prefetched, None  # good for this step only
        streamed = self._streamed(L, x, ids)
        prompt_step = ids.shape[0] > 1
        if streamed or self._all_on_gpu(L, x, ids):
            out = self._resident_step(layer, L, x, ids, weights, self._turns(L) if streamed else [], prefetched)
            if out is not None:
                if self._captured is None:  # a replay counts its steps (prompt_graph_ran)
                    self.counters.prompt_steps["streamed" if streamed else "resident"] += prompt_step
                return out
        self.counters.prompt_steps["read back"] += prompt_step
        slots = L.slots
        timed = self.device.type == "cuda" and many_pairs(ids.numel(), L.w.n_expert)
        waits = self._mark() if timed else None
        # With every expert resident (landed) no CPU miss can need the input.
        ids_host, x_host, grown = self._read_back(ids, x.float() if L.slots.resident.min() < 0 else None)
        self._learn_unlearnt()  # the read-back waited for the GPU: the earlier steps' counts have landed
        self._time_read_backs()  # and the earlier read-backs' marks
        rows_of, experts, hits, uploads, cpu = self._split(L, ids_host)
        if waits is not None and not grown:  # a pinned buffer's first allocation (ms, once) is no route's idle
            self._read_back_marks.append((waits, self._mark()))
        k = ids_host.shape[1]
        per_slot = torch.zeros(k, *x.shape, dtype=x.dtype, device=x.device)
        # Hits first (they need no copy), then the uploads once staged: one batch each, launched
        # asynchronously on CUDA, so the CPU pool's misses below run while the GPU computes them.
        self._run_batch_on_accelerator(L, hits.tolist(), slots.resident[hits].tolist(), False, x, ids, ids_host,
                                       weights, per_slot)
        self._run_uploads(L, uploads.tolist(), lambda turn, turn_slots: self._run_batch_on_accelerator(
            L, turn, turn_slots, True, x, ids, ids_host, weights, per_slot))

        if cpu.size:
            tok, pos = np.nonzero(_member(L.w.n_expert, cpu)[ids_host])
            pair_experts = ids_host[tok, pos].astype(np.int32)
            pair_rows = tok.astype(np.int32)
            step = self.pool.max_rows  # prefill: many pairs, bounded jobs
            out = np.concatenate([self.pool.compute(layer, x_host, pair_rows[a:a + step], pair_experts[a:a + step])
                                  for a in range(0, len(pair_rows), step)])
            out = upload(out, x.device).to(x.dtype)
            self.counters.cpu_busy_s = self.pool.busy_seconds
            tok_t, pos_t = upload(tok, x.device), upload(pos, x.device)
            per_slot[pos_t, tok_t] = out * weights[tok_t, pos_t, None]
        self._account(layer, L, rows_of, experts, hits, uploads, cpu, len(ids_host))
        return _combine(per_slot)

    # --- a many-row step that reads nothing back: every expert resident, or the missing streamed ---
    def _grouped_applies(self, L: _Layer, x: torch.Tensor, ids: torch.Tensor) -> bool:
        """The grouped GEMM takes this step and the policy does not wait for its refills."""
        return not self._grouped_broken and not L.policy.synchronous and _use_grouped(L.w, x, ids.numel())

    def _all_on_gpu(self, L: _Layer, x: torch.Tensor, ids: torch.Tensor) -> bool:
        """Whether this step runs without reading its routing back: every expert of the layer
        landed in a slot (no pair can miss) and the grouped GEMM takes the step."""
        return not L.slots.pending and L.slots.resident.min() >= 0 and self._grouped_applies(L, x, ids)

    def _streamed(self, L: _Layer, x: torch.Tensor, ids: torch.Tensor) -> bool:
        """Whether this step streams every expert its layer lacks instead of reading its routing
        back (tune.streams_all: so many rows that every expert is all but certain to be chosen)
        through the grouped GEMM: a prompt's first chunk does; a later one while the chunk before
        used enough of them to pay for their copies (tune.streaming_pays)."""
        costs = self.options.route_costs
        if not (costs is not None and L.slots.n_staging >= 2 and L.slots.resident.min() < 0
                and streams_all(ids.shape[0], ids.shape[1], L.w.n_expert, costs) and self._grouped_applies(L, x, ids)):
            return False
        if L.last_many is None or L.last_many[2] != self.prompt_id:
            return True  # a new prompt: nothing known of its experts
        rows, tokens, _ = L.last_many
        missing = L.slots.resident < 0
        n_hits = int(np.count_nonzero(rows[~missing]))
        return streaming_pays(int(missing.sum()), rows[missing] * (ids.shape[0] / tokens), n_hits, costs,
                              self.read_back_s)

    @staticmethod
    def _turns(L: _Layer) -> list[np.ndarray]:
        """The layer's missing experts in turns of half the staging slots."""
        missing, half = np.flatnonzero(L.slots.resident < 0), L.slots.n_staging // 2
        return [missing[i:i + half] for i in range(0, len(missing), half)]

    def _stage(self, layer: int, L: _Layer, experts: np.ndarray) -> _Staged:
        """Starts copying `experts` into the next staging half (the halves alternate, so a copy
        never overwrites what the turn just enqueued reads: it waits for the compute enqueued
        before it, which read that half)."""
        half = L.slots.n_staging // 2
        slots, copy = L.slots.stage_async(experts.tolist(), first=self._next_half * half)
        self._next_half ^= 1
        return _Staged(layer, experts, slots, copy)

    def _copy_ahead(self, layer: int, L: _Layer, turns: list[np.ndarray], staged: list[_Staged],
                    x: torch.Tensor, ids: torch.Tensor) -> None:
        """One copy ahead of the compute: the step's next turn, else the next MoE layer's first
        turn (once), which then runs while this layer's last turn computes."""
        if len(staged) < len(turns):
            staged.append(self._stage(layer, L, turns[len(staged)]))
            return
        i = self.index[layer] + 1
        if self._prefetched is not None or i == len(self.layer_ids):
            return
        N = self.layers[self.layer_ids[i]]
        if N.slots.staging is L.slots.staging and self._streamed(N, x, ids):
            self._prefetched = self._stage(self.layer_ids[i], N, self._turns(N)[0])

    def _resident_step(self, layer: int, L: _Layer, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                       turns: list[np.ndarray], prefetched: _Staged | None) -> torch.Tensor | None:
        """The step laid out on the GPU (grouped_gemm.Groups.on_device) through the residency map,
        and the layer's missing experts (`turns`, none when all are resident) through maps of the
        staging slots they are streamed into, so the host goes on launching the next layers
        while the GPU computes; the step's expert counts come back without a wait and are learnt
        from later (_learn_unlearnt). `prefetched`: the first turn, if the step before copied it
        ahead. None where the kernels do not build here (the ordinary path then runs the step)."""
        from engine.quant import grouped_gemm as gg

        if L.device_map is None or L.device_map[0] != L.slots.version:
            L.device_map = (L.slots.version, upload(L.slots.resident.astype(np.int32), self.device),
                            upload(L.slots.slot_expert.astype(np.int32), self.device))
        staged: list[_Staged] = []
        if turns:
            ahead = prefetched is not None and prefetched.layer == layer
            staged.append(prefetched if ahead and np.array_equal(prefetched.experts, turns[0])
                          else self._stage(layer, L, turns[0]))
        self._copy_ahead(layer, L, turns, staged, x, ids)
        # every expert resident or staged: the down kernels write every (top-k position, token) row
        per_slot = torch.empty(ids.shape[1], *x.shape, dtype=x.dtype, device=x.device)
        block_m = gg.GATE_UP_CONFIG[L.w.gate.qtype].block_m
        xf, wf = x.float().contiguous(), weights.float().contiguous()
        n_expert = L.w.n_expert
        try:
            groups, expert_rows = gg.Groups.on_device(ids, L.device_map[1], L.device_map[2], block_m)
            gg.groups_forward(xf, L.slots.buffers, L.w, groups, wf, per_slot)
            for i in range(len(turns)):
                turn = staged[i]
                slot_of = np.full(n_expert, -1, np.int32)
                slot_of[turn.experts] = turn.slots
                exp_of_slot = np.full(L.slots.n_staging, -1, np.int32)
                exp_of_slot[turn.slots] = turn.experts
                maps = upload_tables([slot_of, exp_of_slot], self.device)
                self.copier.wait(turn.copy)
                groups, turn_rows = gg.Groups.on_device(ids, *maps, block_m)
                gg.groups_forward(xf, L.slots.staging.buffers, L.w, groups, wf, per_slot)
                expert_rows = expert_rows + turn_rows
                self._copy_ahead(layer, L, turns, staged, x, ids)
        except Exception as e:  # a kernel that does not build here: say so once, keep running on torch
            self._grouped_unavailable(e)
            return None
        streamed = np.concatenate(turns) if turns else np.zeros(0, np.int64)
        self._read_counts_back(layer, L, expert_rows, ids.shape[0], streamed)
        if layer == self.layer_ids[-1] and self._captured is None:  # the last MoE layer: learn the forward's steps
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            self._learn_unlearnt()
        return _combine(per_slot)

    def _read_counts_back(self, layer: int, L: _Layer, counts: torch.Tensor, tokens: int,
                          streamed: np.ndarray) -> None:
        """A step's rows per expert (`counts`, on the device) into the layer's host buffer without
        waiting (CUDA: an asynchronous copy to pinned memory and an event); `streamed`: the experts
        it ran from the staging slots (uploads, to the telemetry). A step's counts of this layer
        not yet learnt are learnt first, as the buffer is reused. Inside a prompt graph's capture
        the copy goes to the graph's own buffer, learnt after each replay (prompt_graph_ran)."""
        if self._captured is not None:
            L.capture_counts.copy_(counts, non_blocking=True)
            self._captured.append(PromptCounts(layer, tokens, L.capture_counts))
            return
        if any(entry[0] == layer for entry in self._unlearnt):
            self._learn_unlearnt(wait=True)
        if L.counts_host is None:
            L.counts_host = torch.empty(L.w.n_expert, dtype=counts.dtype, pin_memory=self.device.type == "cuda")
        L.counts_host.copy_(counts, non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        self._unlearnt.append((layer, tokens, event, streamed, L.counts_host))

    def _learn_unlearnt(self, wait: bool = False) -> None:
        """The deferred steps' counts into the telemetry and the policies, in step order: all of
        them once their copies have landed (waiting for them with `wait`), else none."""
        if not self._unlearnt:
            return
        last = self._unlearnt[-1][2]
        if last is not None and not wait and not last.query():
            return
        if last is not None:
            last.synchronize()
        for layer, tokens, _, streamed, host in self._unlearnt:
            L = self.layers[layer]
            rows_of = host.numpy().astype(np.int64)
            experts = rows_of.nonzero()[0]
            uploaded = _member(L.w.n_expert, streamed)[experts]
            self._account(layer, L, rows_of, experts, experts[~uploaded], experts[uploaded], experts[:0], tokens)
        self._unlearnt.clear()

    def _mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _time_read_backs(self) -> None:
        """Folds the landed read-backs' idle (from the GPU's last work before the read-back to the
        first launch after it) into `read_back_s`, a moving average: the host's speed sets it."""
        for before, after in self._read_back_marks:
            seconds = before.elapsed_time(after) / 1e3
            self.read_back_s = seconds if not self.read_back_s else 0.75 * self.read_back_s + 0.25 * seconds
        self._read_back_marks.clear()

    def _read_back(self, ids: torch.Tensor, x: torch.Tensor | None) -> tuple[np.ndarray, np.ndarray | None, bool]:
        """The router's ids and the layer input (when given) on the host, behind the layer step's
        one wait on the accelerator, and whether a buffer had to grow. On CUDA both land in
        pinned buffers through asynchronous copies and one stream sync; the buffers are reused
        (a step is done with them before the next step reads back)."""
        tensors = [ids] if x is None else [ids, x]
        grown = False
        if self.device.type != "cuda":
            host = [t.numpy() for t in tensors]
        else:
            host = []
            for t in tensors:
                flat = self._pinned.get(t.dtype)
                if flat is None or flat.numel() < t.numel():
                    flat = self._pinned[t.dtype] = torch.empty(t.numel(), dtype=t.dtype, pin_memory=True)
                    grown = True
                view = flat[:t.numel()].view(t.shape)
                view.copy_(t, non_blocking=True)
                host.append(view)
            torch.cuda.current_stream(self.device).synchronize()
            host = [h.numpy() for h in host]
        return host[0], (host[1] if x is not None else None), grown

    def _run_uploads(self, L: _Layer, uploads: list[int],
                     compute: Callable[[list[int], list[int]], None] | None) -> None:
        """The uploads through the staging slots, `compute(experts, slots)` on each turn (None:
        copies only, for replay): at once when they fit, else in turns over the two halves of the
        staging slots, each turn's copy enqueued before the previous turn's compute so that the
        two overlap (a copy waits for the compute already enqueued, the turn before last, which
        read its half)."""
        if not uploads:
            return
        self._prefetched = None  # these copies overwrite the staging slots it would have read
        n = L.slots.n_staging
        halves = 2 if len(uploads) > n >= 2 else 1
        size = n // halves
        turns = [uploads[i:i + size] for i in range(0, len(uploads), size)]
        staged = [L.slots.stage_async(turns[0], first=0)]
        for i, turn in enumerate(turns):
            if halves == 2 and i + 1 < len(turns):
                staged.append(L.slots.stage_async(turns[i + 1], first=(i + 1) % 2 * size))
            slots, copy = staged[i]
            self.copier.wait(copy)
            if compute is not None:
                compute(turn, slots)
            if halves == 1 and i + 1 < len(turns):
                staged.append(L.slots.stage_async(turns[i + 1], first=0))

    def _run_on_accelerator(self, L: _Layer, slot: int, staged: bool, e: int, x: torch.Tensor, ids: torch.Tensor,
                            weights: torch.Tensor, per_slot: torch.Tensor) -> None:
        """The torch path for one expert (the fallback, and the oracle the kernels are tested against)."""
        tok, pos = torch.nonzero(ids == e, as_tuple=True)
        out = expert_ffn(x[tok], *L.slots.weights(slot, staged), L.w, e)
        per_slot[pos, tok] = out * weights[tok, pos, None]

    # --- Triton dispatch hook (kernels: engine/quant/triton_kernels.py) -------------------------
    def _run_batch_on_accelerator(self, L: _Layer, experts: list[int], slots: list[int], staged: bool,
                                  x: torch.Tensor, ids: torch.Tensor, ids_host: np.ndarray, weights: torch.Tensor,
                                  per_slot: torch.Tensor) -> None:
        """Every (token, top-k) pair routed to `experts` (living in `slots`, staging slots when
        `staged`): one Triton launch sequence over all of them when the kernels apply (the decode
        kernels up to TRITON_MAX_PAIRS pairs, the grouped GEMM beyond), else the torch path
        expert by expert."""
        if not experts:
            return
        buffers = L.slots.buffers_of(staged)
        n_pairs = int(_member(L.w.n_expert, experts)[ids_host].sum())
        if not self._grouped_broken and _use_grouped(L.w, x, n_pairs):
            from engine.quant import grouped_gemm as gg

            slot_of = np.full(L.w.n_expert, -1, np.int32)
            slot_of[experts] = slots
            try:
                gg.experts_forward(x.float().contiguous(), buffers, L.w, ids_host, slot_of,
                                   weights.float().contiguous(), per_slot)
                return
            except Exception as e:  # a kernel that does not build here: say so once, keep running on torch
                self._grouped_unavailable(e)
        if not self._triton_broken and _use_triton(L.w, x, n_pairs):
            from engine.quant import triton_kernels as tk

            slot_of = np.full(L.w.n_expert, -1, np.int32)
            slot_of[experts] = slots
            pair_slot = slot_of[ids_host]
            tok, pos = np.nonzero(pair_slot >= 0)
            order = np.argsort(pair_slot[tok, pos], kind="stable")  # pairs of one expert adjacent: L2 reuse
            tok, pos = tok[order], pos[order]
            pair_tables = upload_tables([tok, pos, pair_slot[tok, pos], ids_host[tok, pos]], x.device)
            try:
                tk.experts_forward(x.float().contiguous(), buffers, L.w, *pair_tables, weights.float().contiguous(),
                                   per_slot)
                return
            except Exception as e:  # a kernel that does not build here: say so once, keep running on torch
                warnings.warn(f"Triton expert kernels unavailable ({type(e).__name__}: {e}); using the torch "
                              f"path (MOESTUDIO_TRITON=0 silences this)", RuntimeWarning, stacklevel=2)
                self._triton_broken = True
        for e, slot in zip(experts, slots):
            self._run_on_accelerator(L, slot, staged, e, x, ids, weights, per_slot)

    def _grouped_unavailable(self, e: Exception) -> None:
        warnings.warn(f"Triton grouped expert GEMM unavailable ({type(e).__name__}: {e}); using the torch path "
                      f"for steps of many rows (MOESTUDIO_TRITON=0 silences this)", RuntimeWarning, stacklevel=3)
        self._grouped_broken = True

    def _account(self, layer: int, L: _Layer, rows_of: np.ndarray, experts: np.ndarray, hits: np.ndarray,
                 uploads: np.ndarray, cpu: np.ndarray, tokens: int) -> None:
        if not self.learning:
            return
        c, i = self.counters, self.index[layer]
        c.gpu_hit[i] += rows_of[hits].sum()
        c.uploaded[i] += rows_of[uploads].sum()
        c.cpu_computed[i] += rows_of[cpu].sum()
        c.heat[i] *= Telemetry.HEAT_DECAY
        c.heat[i, experts] += rows_of[experts]
        refills = L.policy.refills(experts, rows_of[experts], L.slots.slot_expert, L.slots.resident,
                                   L.slots.in_flight(), tokens)
        L.last_many = (rows_of, tokens, self.prompt_id) if many_pairs(int(rows_of.sum()), L.w.n_expert) else None
        if refills:
            handle = L.slots.load(refills)
            if L.policy.synchronous:
                self.copier.wait(handle)
        if L.policy.synchronous:
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            while L.slots.pending:
                L.slots.refresh()
        c.swaps[i] += len(refills)
        c.bytes_uploaded = self.copier.bytes_copied
        c.residency[i] = L.slots.resident

    def close(self) -> None:
        self.copier.close()
        self.pool.close()


# CacheCounters' fields that steps move (learning_paused puts them back); residency moves with
# refills only, decode_path once per capture.
_LEARNT = ("gpu_hit", "gpu_mapped", "uploaded", "cpu_computed", "swaps", "heat", "bytes_uploaded", "cpu_busy_s",
           "prompt_steps", "prompt_graph_chunks")


def _combine(per_slot: torch.Tensor) -> torch.Tensor:
    """The weighted experts of each token summed slot by slot, as llama.cpp adds them (one
    launch, bit-identical, where the Triton kernels run: engine/kernels/combine.py)."""
    if triton_applies(per_slot.device):
        from engine.kernels import combine as kernel

        if kernel.supports(per_slot):
            return kernel.combine(per_slot)
    total = per_slot[0]
    for j in range(1, per_slot.shape[0]):
        total = total + per_slot[j]
    return total


def _member(n_expert: int, experts: np.ndarray) -> np.ndarray:
    """A lookup table: True at `experts` (np.isin costs ~10x more on a handful of ids)."""
    table = np.zeros(n_expert, bool)
    table[experts] = True
    return table


TRITON_MAX_PAIRS = 64  # decode (1-8 tokens x top-k): one program per pair; larger batches: the grouped GEMM


def _triton_applies(x: torch.Tensor) -> bool:
    return triton_applies(x.device) and x.dtype == torch.float32 and x.dim() == 2


def _use_triton(w: ExpertWeights, x: torch.Tensor, n_pairs: int) -> bool:
    """The decode kernels (triton_kernels.py): up to TRITON_MAX_PAIRS pairs of supported types."""
    if n_pairs > TRITON_MAX_PAIRS or not _triton_applies(x):
        return False
    from engine.quant import triton_kernels as tk

    return tk.supports(w)


def _use_grouped(w: ExpertWeights, x: torch.Tensor, n_pairs: int) -> bool:
    """The grouped GEMM (grouped_gemm.py): more than TRITON_MAX_PAIRS pairs of supported types."""
    if n_pairs <= TRITON_MAX_PAIRS or not _triton_applies(x):
        return False
    from engine.quant import grouped_gemm as gg

    return gg.supports(w)


def attach_hybrid(model, config, progress: Progress | None = None) -> HybridExperts:
    """Replaces `model.experts` with a HybridExperts sized from `config` (an EngineConfig) by
    engine/plan/sizing.place, the rule `moestudio plan` prints. `progress` hears the bytes copied:
    experts into RAM (load mode none), then into the GPU slots filled at load.

    If the slots do not fit after all, or an auto-sized cache leaves less than half its headroom
    free once allocated (another program took GPU memory, the allocator's rounding), the cache
    shrinks by a quarter until it fits, and a warning says so."""
    from engine.moe import budget
    from engine.plan.geometry import geometry_of
    from engine.plan.sizing import place

    device = torch.device(config.device)
    ws = model.expert_weights
    load_mode = resolve_load_mode(config.load_mode, ws, device)
    report = progress or (lambda stage, fraction: None)
    if load_mode == "none":
        total = sum(t.raw.numel() for w in ws.values() for t in (w.gate, w.up, w.down))
        copying = ByteProgress(report, "copying the experts into RAM", total, 0.5, 0.7)
        ws = model.expert_weights = resident_copies(ws, pin=device.type == "cuda", progress=copying.add)
    any_w = next(iter(ws.values()))
    gpu_free = budget.gpu_free_bytes(device)
    pool = CpuExpertPool(ws, config.threads or 2)
    # Without a GPU an "upload" would only copy RAM to RAM: every miss goes to the CPU pool.
    fraction, tuning, costs = 0.0, None, None
    if gpu_free is not None:
        layer = min(ws)
        measured = measure_costs(layer, ws[layer], device, pool)
        costs = route_costs(measured)
        if config.moe_gpu_miss_fraction == "auto":
            tuning, fraction = measured, measured["fraction"]
        else:
            fraction = float(config.moe_gpu_miss_fraction)
    placement = place(geometry_of(model.source), gpu_free, ctx=config.n_ctx, prefill_chunk=config.prefill_chunk,
                      moe_expert_cache_size=config.moe_expert_cache_size,
                      moe_expert_cache_mib=config.moe_expert_cache_mib, vram_budget_mib=config.vram_budget_mib,
                      miss_fraction=fraction)
    n_slots = placement.slots_per_layer
    auto_sized = config.moe_expert_cache_size == "auto" and config.moe_expert_cache_mib is None
    while True:
        options = HybridOptions(slots_per_layer=n_slots, miss_fraction=fraction, policy=config.moe_profile_adapt,
                                threads=config.threads or 2, top_k=model.config.n_expert_used, route_costs=costs)
        try:
            hybrid = HybridExperts(ws, device, options, pool)
        except torch.OutOfMemoryError:
            if n_slots == 0:
                pool.close()
                raise
            reason = "out of GPU memory"
        else:
            # The sizing saw the free memory before allocating; another program, or the
            # allocator's rounding, may have taken some since. The KV cache and the workspace
            # are still to come.
            left = budget.free_after_allocation(device, placement.budget_bytes,
                                                placement.kv_bytes + placement.workspace_bytes) \
                if auto_sized and n_slots else None
            if left is None or left >= placement.headroom_bytes // 2:
                break
            reason = f"only {max(0, left) / 2**20:.0f} MiB of GPU memory left"
            del hybrid
        smaller = n_slots * 3 // 4
        warnings.warn(f"{reason} with {n_slots} expert slots per layer; shrinking the expert cache to {smaller} "
                      f"(set --moe-expert-cache-size or --vram-budget-mib lower to silence this)",
                      RuntimeWarning, stacklevel=2)
        n_slots = smaller
        if device.type == "cuda":
            torch.cuda.empty_cache()
    hybrid.counters.load_mode = load_mode
    hybrid.counters.miss_fraction = fraction
    hybrid.counters.miss_fraction_tuning = tuning
    if costs is not None:  # the token graph's TokenExperts fills in the split it takes
        hybrid.counters.miss_routes = {"cpu_s": costs.cpu_s, "cpu_expert_s": costs.cpu_expert_s,
                                       "mapped_s": costs.mapped_s, "mapped_of_misses": []}
    ranking = None
    if config.moe_expert_profile:
        from engine.moe.profile import load_profile

        ranking = load_profile(config.moe_expert_profile, model.source).ranking()
    elif n_slots >= any_w.n_expert:  # every expert fits: load them all now, not on first use
        ranking = [(layer, e) for layer in sorted(ws) for e in range(ws[layer].n_expert)]
    elif n_slots:
        # No evidence yet: placeholders, so the first prompt finds the slots full rather than
        # empty; the policy gives them way like empty slots until their experts are used.
        ranking = [(layer, e) for layer in sorted(ws) for e in range(n_slots)]
        for L in hybrid.layers.values():
            L.policy.hold_placeholders(np.arange(L.slots.n_slots))
    if ranking and n_slots:
        # At most the slots' worth of experts is copied: that is the total to report against.
        total = sum(L.slots.expert_bytes * min(L.slots.n_slots, len({e for layer, e in ranking if layer == i}))
                    for i, L in hybrid.layers.items())
        filling = ByteProgress(report, "filling the expert cache on the GPU", total, 0.7, 0.9)
        hybrid.prefill_residency(ranking, progress=filling.add)
    model.experts = hybrid
    return hybrid
