"""The decode runner: a one-token step is one CUDA graph replay.

The graph is DecoderModel.run (the forward written once) captured on static buffers: the
token's raw embedding-table row and its position go in, the logits come out. The row is decoded
inside the graph: decoding a K-quant row eagerly is ~45 small torch launches (~0.3 ms of host
time a token, the GPU idle meanwhile); staged, the host only copies the row's bytes. Attention
is given the whole cache (start None) and reads the positions up to the device-side one (the
fused kernel, engine/kernels/decode_attention.py; the torch path masks the rest), so one
capture serves every position of the cache.
The experts inside are the executor's token step (engine/moe/token_step.TokenExperts): the
residency map, the expert kernels and the mailbox to the CPU pool all run in the graph, and
the host only answers the layers that missed while the replay runs. The sampled token comes
back once per token.

An executor without a token step (the reference executor, a type the expert kernels lack)
runs the same forward eagerly on the same static buffers, so its numerics equal the graph's:
where an expert lived still cannot change a token. A capture that fails is said once, and the
eager path takes over.

Numerics equal an eager forward of the token: the fused attention kernel splits the keys the
same way for the whole cache and for its filled prefix. On the torch path (MOESTUDIO_TRITON=0)
attention sums over the whole cache, masked: float32 reduction order, ~1e-7 relative.
"""
from __future__ import annotations

import warnings

import torch

from engine.layers.attention import KVCache


class DecodeRunner:
    def __init__(self, model, cache: KVCache):
        self.model, self.cache = model, cache
        self.device = torch.device(model.device)
        self.position = torch.zeros(1, dtype=torch.long, device=self.device)
        table = model.embed.raw
        self.row = torch.zeros(1, table.shape[1], dtype=table.dtype, device=self.device)
        self.row_host = torch.zeros(self.row.shape, dtype=table.dtype, pin_memory=self.device.type == "cuda")
        # the last staging copy, waited for before row_host is rewritten (one event, recorded again each token)
        self.row_copied = torch.cuda.Event() if self.device.type == "cuda" else None
        make = getattr(model.experts, "token_experts", None)
        self.token_experts = make(model.config.n_expert_used, model.config.n_embd) if make else None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.broken = False  # capture failed: eager from then on

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def _forward(self, experts) -> torch.Tensor:
        """The staged token through the forward: its row decoded on the device, then the layers."""
        h = self.model.embed.decode(self.row)
        return self.model.run(h, self.position, self.cache, None, experts)

    def _token_forward(self) -> torch.Tensor:
        """The forward through the token step (eagerly, or being captured)."""
        self.token_experts.prologue()
        return self._forward(self.token_experts)

    def _capture(self) -> None:
        """The first step compiles and loads every kernel eagerly, unarmed (no layer publishes
        or waits, so no kernel can spin while another is still being loaded), then records."""
        tx = self.token_experts
        tx.arm(False)
        tx.before_token()
        self._token_forward()
        torch.cuda.synchronize(self.device)
        tx.forget_counts()
        tx.arm(True)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            # capture_begin/end rather than torch.cuda.graph(): that one also collects garbage
            # and empties the allocator's cache at every capture.
            graph.capture_begin()
            try:
                self.logits = self._token_forward()
            finally:
                graph.capture_end()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self.graph = graph
        self.model.experts.counters.decode_path = "graph"

    def step(self, token: torch.Tensor, start: int) -> torch.Tensor:
        """Logits [1, n_vocab] of `token` at position `start` (the KV cache is written there)."""
        self.position.fill_(start)
        self._stage(token)
        tx = self.token_experts
        if tx is None or self.broken:
            logits = self._eager_step()
        else:
            if self.graph is None:
                try:
                    self._capture()
                except RuntimeError as e:
                    warnings.warn(f"CUDA graph capture failed ({e}); decoding without graphs", RuntimeWarning,
                                  stacklevel=2)
                    self.broken, self.graph = True, None
                    self.model.experts.counters.decode_path = "per layer"
                    return self.step(token, start)
            tx.before_token()
            self.graph.replay()
            tx.after_launch()
            logits = self.logits.clone()
            torch.cuda.current_stream(self.device).synchronize()
            tx.check()
        self.cache.length = start + 1
        return logits

    def _stage(self, token: torch.Tensor) -> None:
        """The token's table row into the static row: through pinned memory, one asynchronous
        copy in stream order (the previous copy has read the pinned row before it is rewritten)."""
        if self.row_copied is not None:
            self.row_copied.synchronize()  # returns at once before the first record
        self.model.embed.rows(token.reshape(1), out=self.row_host)
        self.row.copy_(self.row_host, non_blocking=True)
        if self.row_copied is not None:
            self.row_copied.record(torch.cuda.current_stream(self.device))

    def _eager_step(self) -> torch.Tensor:
        """Without a token graph: the forward on the static buffers with the executor's own
        per-layer step (it may wait for the host at every layer)."""
        return self._forward(self.model.experts)

    def settle(self) -> None:
        """The counters of the last token reach the telemetry (they trail the GPU by one)."""
        if self.token_experts is not None and self.graph is not None:
            self.token_experts.settle()

    def close(self) -> None:
        self.graph = None
