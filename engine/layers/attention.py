"""Causal multi-head attention over a float32 KV cache, as llama.cpp's non-flash path does it.

scores = softmax(scale * q·k + mask [, sink]) per head; sinks (gpt-oss) are one extra logit
per head that joins the softmax's normalisation but has no value; a sliding window hides
keys more than `window - 1` positions back (llama.cpp's LLAMA_SWA_TYPE_STANDARD).

The torch code here is the reference and the CPU path; where the Triton kernels run
(engine.kernels.triton_applies) a decode-sized query (up to 8 tokens) goes through the fused
kernel of engine/kernels/decode_attention.py, which reads only the positions it can see.
"""
from __future__ import annotations

import torch

from engine.kernels import triton_applies
from engine.layers import precision


class KVCache:
    """Per-layer K and V of one sequence, float32, [n_ctx, n_kv_heads, head_dim]."""

    def __init__(self, n_layer: int, n_ctx: int, n_head_kv: int, head_dim_k: int, head_dim_v: int,
                 device: torch.device | str = "cpu"):
        self.n_ctx = n_ctx
        self.k = [torch.zeros(n_ctx, n_head_kv, head_dim_k, device=device) for _ in range(n_layer)]
        self.v = [torch.zeros(n_ctx, n_head_kv, head_dim_v, device=device) for _ in range(n_layer)]
        self.length = 0  # positions filled; set by the model after each forward

    def store(self, layer: int, start: int | None, k: torch.Tensor, v: torch.Tensor,
              positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes k, v [T, ...] at `positions` (start..start+T) and returns the filled prefix of
        the layer. With start None (a CUDA graph, where the host does not know the position)
        returns the whole cache: `attend` masks what lies past the positions."""
        if start is None:
            self.k[layer].index_copy_(0, positions, k)
            self.v[layer].index_copy_(0, positions, v)
        else:
            end = start + k.shape[0]  # DecoderModel.forward checked it against n_ctx
            self.k[layer][start:end] = k
            self.v[layer][start:end] = v
        return self.filled(layer, start, k.shape[0])

    def filled(self, layer: int, start: int | None, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values attention reads once a step's `n` rows from `start` are stored:
        the filled prefix, or with start None the whole cache (see store)."""
        if start is None:
            return self.k[layer], self.v[layer]
        return self.k[layer][:start + n], self.v[layer][:start + n]

    def truncate(self, length: int) -> None:
        """Forgets positions from `length` on (the cache rows are simply overwritten later)."""
        self.length = min(self.length, length)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float,
           window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, dk] at `positions` [T]; k [S, Hkv, dk], v [S, Hkv, dv] for positions 0..S-1.

    Returns [T, H * dv].
    """
    # The fused kernel is float32 (a float64-accumulated noise-floor run stays in torch).
    if triton_applies(q.device) and precision.accumulation() == torch.float32:
        from engine.kernels import decode_attention as da  # imported late: TRITON_INTERPRET is read then

        if da.supports(q, k, v):  # decode-sized queries (da.MAX_TOKENS)
            return da.decode_attention(q, k, v, positions, scale, window, sinks)
    n_tok, n_head, _ = q.shape
    group = n_head // k.shape[1]
    k = k.repeat_interleave(group, dim=1) if group > 1 else k
    v = v.repeat_interleave(group, dim=1) if group > 1 else v
    scores = precision.einsum("thd,shd->hts", q, k) * scale
    q_pos = positions[:, None]
    k_pos = torch.arange(k.shape[0], device=q.device)[None, :]
    hidden = k_pos > q_pos
    if window:
        hidden |= q_pos - k_pos >= window
    scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is not None:
        sink_col = sinks.to(scores.dtype)[:, None, None].expand(n_head, n_tok, 1)
        probs = precision.softmax(torch.cat([scores, sink_col], dim=-1), dim=-1)[..., :-1]
    else:
        probs = precision.softmax(scores, dim=-1)
    return precision.einsum("hts,shd->thd", probs, v).reshape(n_tok, -1)
