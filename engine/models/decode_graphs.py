"""One-token decode steps as CUDA graphs, with the expert step left eager between them.

A decode step launches a few hundred small kernels outside the experts (norms, the rounded
matmuls, RoPE, attention, the router); launched one by one from Python they cost more host
time than the GPU spends on them. Here the dense work between two MoE expert steps is captured
once as one graph ("segment") and replayed every step:

  segment 0      blocks up to the first MoE block: attention, dense FFNs, then that block's
                 ffn norm, router (ids, weights) and shared expert
  segment j      h += experts + shared of the previous MoE block, then the same up to the next
  last segment   ... then the output norm and head

The expert step itself (DecoderModel.experts, e.g. engine/moe/hybrid.HybridExperts) runs eagerly
between two replays, because its host decides every step what runs where. The graphs read
the token's embedding and position from static device buffers and write K/V at that position
(KVCache.store with start None), so one capture serves every position of the cache.

Numerics equal the eager forward except attention, which sums over the whole cache (masked)
instead of its filled prefix: float32 reduction order, ~1e-7 relative. Hybrid and all-resident
runs both take this path, so where an expert lived still cannot change a token.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from engine.layers.attention import KVCache
from engine.layers.norm import rms_norm


@dataclass
class _Segment:
    blocks: range  # blocks run whole (dense FFN), then `moe` up to its router
    moe: int | None  # the MoE block this segment ends at; None: ends with the logits
    graph: torch.cuda.CUDAGraph | None = None
    moe_out: torch.Tensor | None = None  # static: the expert step's result, copied in after it runs
    outputs: dict = field(default_factory=dict)  # static results of the replay: h, x, ids, weights, shared / logits


class DecodeGraphs:
    def __init__(self, model, cache: KVCache):
        self.model, self.cache = model, cache
        self.device = torch.device(model.device)
        self.position = torch.zeros(1, dtype=torch.long, device=self.device)
        self.h0 = torch.zeros(1, model.config.n_embd, device=self.device)
        self.segments = self._plan()
        self.captured = False
        self.broken = False  # capture failed: eager from then on

    def _plan(self) -> list[_Segment]:
        segments, first = [], 0
        for i, block in enumerate(self.model.blocks):
            if block.is_moe:
                segments.append(_Segment(range(first, i), i))
                first = i + 1
        segments.append(_Segment(range(first, len(self.model.blocks)), None))
        return segments

    def _run(self, seg: _Segment, prev: _Segment | None) -> dict:
        """The segment's work on the static inputs (eagerly, or being captured)."""
        m, eps = self.model, self.model.config.rms_eps
        if prev is None:
            h = self.h0
        else:
            moe = prev.moe_out
            shared = prev.outputs.get("shared")
            h = prev.outputs["h"] + (moe + shared if shared is not None else moe)
        for i in seg.blocks:
            block = m.blocks[i]
            h = h + block.attention(rms_norm(h, block.attn_norm, eps), self.position, self.cache, i, None)
            h = h + block.ffn(rms_norm(h, block.ffn_norm, eps))
        if seg.moe is None:
            return {"logits": m.output(rms_norm(h, m.output_norm, eps))}
        block = m.blocks[seg.moe]
        h = h + block.attention(rms_norm(h, block.attn_norm, eps), self.position, self.cache, seg.moe, None)
        x = rms_norm(h, block.ffn_norm, eps)
        ids, weights = block.ffn.router(x)
        out = {"h": h, "x": x, "ids": ids, "weights": weights}
        if block.ffn.shared is not None:
            out["shared"] = block.ffn.shared(x)
        return out

    def _experts(self, seg: _Segment) -> None:
        o = seg.outputs
        out = self.model.experts(seg.moe, o["x"], o["ids"], o["weights"])
        if seg.moe_out is None:
            seg.moe_out = torch.empty_like(out)
        seg.moe_out.copy_(out)

    def _eager_step(self) -> torch.Tensor:
        prev = None
        for seg in self.segments:
            seg.outputs = self._run(seg, prev)
            if seg.moe is not None:
                self._experts(seg)
            prev = seg
        return self.segments[-1].outputs["logits"]

    def _capture(self) -> None:
        """Records every segment (nothing runs); their outputs live in one shared pool, which
        is safe because the segments are always replayed in the order they were captured."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            prev = None
            for seg in self.segments:
                seg.graph = torch.cuda.CUDAGraph()
                seg.graph.capture_begin(pool=pool)
                try:
                    seg.outputs = self._run(seg, prev)
                finally:
                    seg.graph.capture_end()
                prev = seg
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self.captured = True

    def step(self, token: torch.Tensor, start: int) -> torch.Tensor:
        """Logits [1, n_vocab] of `token` at position `start` (the KV cache is written there)."""
        self.position.fill_(start)
        self.h0.copy_(self.model.embed(token))
        if not self.captured and not self.broken:
            # The first step runs eagerly: it compiles kernels and fills lazily built tables
            # (RoPE) outside any capture; the graphs are recorded after it.
            logits = self._eager_step()
            try:
                self._capture()
            except RuntimeError as e:
                warnings.warn(f"CUDA graph capture failed ({e}); decoding without graphs", RuntimeWarning,
                              stacklevel=2)
                self.broken = True
                for seg in self.segments:
                    seg.graph = None
            self.cache.length = start + 1
            return logits.clone()
        if self.broken:
            logits = self._eager_step()
        else:
            for seg in self.segments:
                seg.graph.replay()
                if seg.moe is not None:
                    self._experts(seg)
            logits = self.segments[-1].outputs["logits"]
        self.cache.length = start + 1
        return logits.clone()
