"""The prompt runner: a full prompt chunk is one CUDA graph replay, where nothing in it needs the host.

A resident prompt chunk launches ~1,000 kernels (Qwen3-30B-A3B geometry, 512 tokens); from
Python that takes as long as the GPU's work on a good stretch of the host and twice as long on
a slow one (docs/BENCHMARKS.md, session 22): the chunk runs at the host's pace. Replayed, it
runs at the GPU's. It applies where every MoE layer's step lies on the GPU (every expert in a
slot: HybridExperts.prompt_graph_version), to full chunks (Engine.prefill marks them; they
start on multiples of the chunk length).

The graph is DecoderModel.run (the forward written once) captured on static buffers, like the
decode runner's: the chunk's raw embedding-table rows go in through pinned memory and are
decoded inside; the logits come out. Attention reads the cache up to the chunk's end, so a
graph holds for one start: one graph per chunk start, all in one memory pool (they never run at
once). A start's first chunk runs eagerly through the same code and is captured after it (a
capture runs nothing), so the first prompt compiles the kernels and later ones replay. A graph
replays only under the residency it was captured with (the device maps it reads); else the
chunk runs eagerly and the graph is captured anew. The expert counts of its steps come back
into pinned buffers of the graph's own and are learnt after the replay, as an eager chunk's.

Numerics equal the eager chunk's bit for bit: the same kernels on the same shapes.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from engine.layers.attention import KVCache


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor
    version: tuple[int, ...]
    counts: list  # the steps' count buffers (engine/moe/hybrid.PromptCounts)


class PromptRunner:
    def __init__(self, model, cache: KVCache, rows: int):
        self.model, self.cache, self.n_rows = model, cache, rows
        self.device = torch.device(model.device)
        table = model.embed.raw
        self.rows = torch.zeros(rows, table.shape[1], dtype=table.dtype, device=self.device)
        self.rows_host = torch.zeros(self.rows.shape, dtype=table.dtype, pin_memory=True)
        self.rows_copied = torch.cuda.Event()  # the last staging copy: waited for before rows_host is rewritten
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, bool], _Graph] = {}
        self.replays = 0
        self.broken = False  # a capture failed: eager from then on

    def _version(self) -> tuple[int, ...] | None:
        c = self.model.config
        version = getattr(self.model.experts, "prompt_graph_version", None)
        return version(self.n_rows, c.n_expert_used, c.n_embd) if version and not self.broken else None

    def step(self, tokens: torch.Tensor, start: int, last_only: bool) -> torch.Tensor | None:
        """Logits of the chunk `tokens` at positions start.. (the KV cache is written there); None
        where a step of it needs the host (the caller runs it eagerly)."""
        experts, version, key = self.model.experts, self._version(), (start, last_only)
        if version is None:
            return None
        self._stage(tokens)
        g = self.graphs.get(key)
        if g is not None and g.version == version:
            experts.before_prompt_graph(g.counts)
            g.graph.replay()
            experts.prompt_graph_ran(g.counts)
            self.replays += 1
            logits = g.logits.clone()
        else:
            self.graphs.pop(key, None)
            logits = self._forward(start, last_only)
            self._capture(key, version)
        self.cache.length = start + self.n_rows
        return logits

    def _forward(self, start: int, last_only: bool) -> torch.Tensor:
        positions = torch.arange(start, start + self.n_rows, device=self.device)
        h = self.model.embed.decode(self.rows)
        return self.model.run(h, positions, self.cache, start, self.model.experts, last_only)

    def _capture(self, key: tuple[int, bool], version: tuple[int, ...]) -> None:
        experts = self.model.experts
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(stream), experts.capturing_prompt() as counts:
                graph.capture_begin(pool=self.pool)
                try:
                    logits = self._forward(*key)
                finally:
                    graph.capture_end()
        except RuntimeError as e:
            warnings.warn(f"CUDA graph capture of a prompt chunk failed ({e}); prompts run without graphs",
                          RuntimeWarning, stacklevel=3)
            self.broken = True
            self.graphs.clear()
            return
        finally:
            torch.cuda.current_stream(self.device).wait_stream(stream)
        self.graphs[key] = _Graph(graph, logits, version, counts)

    def _stage(self, tokens: torch.Tensor) -> None:
        """The chunk's table rows into the static rows through pinned memory (one asynchronous copy
        in stream order; the previous copy has read the pinned rows before they are rewritten)."""
        self.rows_copied.synchronize()
        self.model.embed.rows(tokens, out=self.rows_host)
        self.rows.copy_(self.rows_host, non_blocking=True)
        self.rows_copied.record(torch.cuda.current_stream(self.device))

    def close(self) -> None:
        self.graphs.clear()
