"""Causal multi-head attention over a float32 KV cache, as llama.cpp's non-flash path does it.

scores = softmax(scale * q·k + mask [, sink]) per head; sinks (gpt-oss) are one extra logit
per head that joins the softmax's normalisation but has no value; a sliding window hides
keys more than `window - 1` positions back (llama.cpp's LLAMA_SWA_TYPE_STANDARD).

The torch code here is the reference and the CPU path. On CUDA a decode-sized query (up to 8
tokens) goes through the fused kernel of engine/kernels/decode_attention.py where the Triton
kernels run (engine.kernels.triton_applies), which reads only the positions it can see; a
prompt's query through torch's fused attention (`prompt_attention`: no score matrix in memory).
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from engine.kernels import triton_applies
from engine.layers import precision
from engine.plan.sizing import ATTENTION_MASK_BYTES as MASK_BYTES  # the planner reserves it


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
    if q.is_cuda and precision.accumulation() == torch.float32:
        return prompt_attention(q, k, v, positions, scale, window, sinks)
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


class _LastMask:
    """The mask of a prompt's last one-slice attention, for the next layers of the same forward:
    one mask a forward instead of one a layer (four launches a layer, five with a window). Valid
    while `positions` is the very tensor it was made for (held weakly) and the key (keys' width,
    group, window, sink, dtype) is the same; gpt-oss's alternating windows replace it each layer,
    as before. It holds at most one mask of MASK_BYTES, which the planner reserves, and lets it
    go with the positions tensor, or at the next forward's start (`forget_masks`): the decode
    runner's positions buffer is one tensor, changed in place from token to token."""

    def __init__(self) -> None:
        self._entry: tuple[weakref.ref, tuple, torch.Tensor] | None = None

    def get(self, positions: torch.Tensor, key: tuple) -> torch.Tensor | None:
        entry = self._entry  # one read: a put from another engine's thread swaps the whole tuple
        if entry is not None and entry[0]() is positions and entry[1] == key:
            return entry[2]
        return None

    def put(self, positions: torch.Tensor, key: tuple, mask: torch.Tensor) -> None:
        self._entry = (weakref.ref(positions, self._drop), key, mask)

    def _drop(self, ref: weakref.ref) -> None:
        """The forward's positions are gone: so is its mask (unless a newer one replaced it)."""
        entry = self._entry
        if entry is not None and entry[0] is ref:
            self._entry = None

    def clear(self) -> None:
        self._entry = None


_MASKS = _LastMask()


def forget_masks() -> None:
    """A new forward begins (DecoderModel.run): the kept mask was made for the positions of the
    last one, which may be the very tensor this one is given with other values in it."""
    _MASKS.clear()


def prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float,
                     window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`attend` through torch's scaled_dot_product_attention: on CUDA in float32 its
    memory-efficient kernel, which never holds the [heads, T, S] scores (268 MB a layer for a
    512-token chunk at position 4096 of a 32-head model) and runs in one launch instead of ~10;
    equal to `attend` up to float32 summation order.

    A prompt's query (more tokens than a decode step's, decode_attention.MAX_TOKENS) goes in
    float16, as llama.cpp's default F16 KV cache does: the fused kernel then runs on tensor
    cores (its softmax and sums stay float32 inside): a 512-token prompt's attention, 48 layers, took
    0.96 ms on an H200 against 5.5 in float32 (docs/BENCHMARKS.md, session 24).
    Decode-sized queries stay float32, the same numbers whichever kernel serves them.

    GQA without repeating the keys (float32 SDPA takes enable_gqa only on its math backend):
    the q heads of one key head are stacked along the query axis, [Hkv, group * T, dk], each
    stacked row masked by its token's position; the queries go in slices so that the mask stays
    under MASK_BYTES. A sink is one more key that every query sees: its logit scale * q.k = sink
    comes from two extra dimensions, where q holds sink / scale split into a high and a low part
    (exact to ~22 bits in float16 too) and the sink key 1 (its value 0).
    """
    from engine.kernels.decode_attention import MAX_TOKENS  # imported late, as in `attend`

    n_tok, n_head, dk = q.shape
    n_kv, dv = k.shape[1], v.shape[2]
    group = n_head // n_kv
    n_keys = k.shape[0]
    out_dtype = q.dtype
    if q.is_cuda and n_tok > MAX_TOKENS:
        q, k, v = q.half(), k.half(), v.half()
    if sinks is not None:
        width = dk + 8  # the sink's dimensions, and 16-byte rows for the kernel
        q = F.pad(q, (0, width - dk))
        logit = sinks.float() / scale
        high = logit.to(q.dtype)
        q[:, :, dk] = high
        q[:, :, dk + 1] = (logit - high.float()).to(q.dtype)
        sink_key = torch.zeros(1, n_kv, width, dtype=k.dtype, device=k.device)
        sink_key[..., dk:dk + 2] = 1.0
        k = torch.cat([F.pad(k, (0, width - dk)), sink_key])
        v = torch.cat([v, v.new_zeros(1, n_kv, dv)])
    keys, values = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, Hkv, S, d]: views
    width = keys.shape[2]
    padded = -(-width // 16) * 16  # mask rows 16-aligned, as the fused kernel reads them
    rows = max(1, MASK_BYTES // (group * padded * q.element_size()))
    key = (width, group, window, sinks is not None, q.dtype)  # with `positions`, what the mask depends on
    out = []
    for a in range(0, n_tok, rows):
        n = min(rows, n_tok - a)
        one_slice = n == n_tok
        mask = _MASKS.get(positions, key) if one_slice else None
        if mask is None:
            q_pos = positions[a:a + rows, None]
            k_pos = torch.arange(n_keys, device=q.device)[None, :]
            hidden = k_pos > q_pos
            if window:
                hidden |= q_pos - k_pos >= window
            if sinks is not None:
                hidden = F.pad(hidden, (0, 1), value=False)
            mask = torch.zeros(group, n, padded, dtype=q.dtype, device=q.device)[..., :width]
            mask = mask.masked_fill_(hidden, float("-inf")).reshape(group * n, width)  # a view: rows stay aligned
            if one_slice:
                _MASKS.put(positions, key, mask)
        stacked = q[a:a + rows].reshape(n, n_kv, group, -1).permute(1, 2, 0, 3).reshape(1, n_kv, group * n, -1)
        o = F.scaled_dot_product_attention(stacked, keys, values, attn_mask=mask, scale=scale)
        out.append(o.reshape(n_kv, group, n, dv).permute(2, 0, 1, 3).reshape(n, n_head * dv))
    out = out[0] if len(out) == 1 else torch.cat(out)
    return out.to(out_dtype)
