"""Grouped-query attention with the options of the GQA families: q/k/v biases, a q/k RMS norm
per head (qwen3moe) or over the whole projection (olmoe), RoPE, sliding window and sinks."""
from __future__ import annotations

import torch

from engine.gguf.reader import ModelFile
from engine.layers.attention import KVCache, attend
from engine.layers.linear import Linear, load_vector, optional_vector
from engine.layers.norm import rms_norm
from engine.layers.rope import RopeConfig, rope_qk_store

QK_NORM_NONE, QK_NORM_HEAD, QK_NORM_FULL = "none", "head", "full"


class GQAttention:
    def __init__(self, mf: ModelFile, layer: int, device: torch.device | str, *, n_head: int, n_head_kv: int,
                 head_dim: int, rope: RopeConfig, eps: float, qk_norm: str = QK_NORM_NONE, window: int = 0,
                 scale: float | None = None):
        p = f"blk.{layer}"
        qkv = [Linear.load(mf, f"{p}.attn_{name}", device) for name in ("q", "k", "v")]
        self.qkv_sizes = [part.shape[0] for part in qkv]
        self.qkv = Linear.concat(qkv)  # one product on the kernels' path
        self.q, self.k, self.v = qkv if self.qkv is None else (None, None, None)
        self.o = Linear.load(mf, f"{p}.attn_output", device)
        self.q_norm = load_vector(mf, f"{p}.attn_q_norm.weight", device) if qk_norm != QK_NORM_NONE else None
        self.k_norm = load_vector(mf, f"{p}.attn_k_norm.weight", device) if qk_norm != QK_NORM_NONE else None
        self.sinks = optional_vector(mf, f"{p}.attn_sinks.weight", device)
        self.qk_norm, self.eps = qk_norm, eps
        self.n_head, self.n_head_kv, self.head_dim = n_head, n_head_kv, head_dim
        self.rope, self.window = rope, window
        self.scale = scale if scale is not None else head_dim ** -0.5

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache, layer: int,
                 start: int | None) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = (self.qkv(x).split(self.qkv_sizes, dim=-1) if self.qkv is not None
                   else (self.q(x), self.k(x), self.v(x)))
        if self.qk_norm == QK_NORM_FULL:
            q, k = rms_norm(q, self.q_norm, self.eps), rms_norm(k, self.k_norm, self.eps)
        q = q.view(n, self.n_head, self.head_dim)
        k = k.view(n, self.n_head_kv, self.head_dim)
        v = v.view(n, self.n_head_kv, self.head_dim)
        # per-head q/k norms: normalised in the RoPE launch where the kernel applies
        norms = (self.q_norm, self.k_norm) if self.qk_norm == QK_NORM_HEAD else None
        q, keys, values = rope_qk_store(q, k, v, positions, self.rope, cache, layer, start, norms, self.eps)
        return self.o(attend(q, keys, values, positions, self.scale, self.window, self.sinks))
