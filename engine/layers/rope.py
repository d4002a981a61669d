"""Rotary position embedding exactly as ggml_rope_ext computes it (ggml-cpu/ops.cpp).

Two pairings: NORMAL rotates adjacent values (2i, 2i+1), NEOX rotates (i, i + n_rot/2).
YaRN blends interpolated and extrapolated angles per dimension and scales cos/sin by
`attn_factor` (and 1 + 0.1 ln(1/freq_scale) when ext_factor is not 0). Angles are built
by repeated float32 multiplication, like ggml's cache, so they agree to the last bits.
cos/sin are tabulated once per context length on the device and looked up by a position
tensor there, so a decode step needs no host work (and can be replayed as a CUDA graph).
The torch code is the reference and the CPU path; where `engine.kernels.triton_applies` says
so (CUDA) and the shapes fit, one fused Triton launch computes the same products
(engine/kernels/norm_rope.py) for q and k together (`rope_qk`), with qwen3moe's per-head q/k
RMS norms in that launch, and with the step's k and v stores into the KV cache
(`rope_qk_store`, the GQA families).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from engine.kernels import triton_applies
from engine.layers.attention import KVCache
from engine.layers.norm import rms_norm


@dataclass(frozen=True)
class RopeConfig:
    n_rot: int  # rotated dimensions at the start of each head
    neox: bool
    freq_base: float = 10000.0
    freq_scale: float = 1.0
    ext_factor: float = 0.0
    attn_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    n_ctx_orig: int = 0


def _corr_dim(n_dims: int, n_ctx_orig: int, n_rot: float, base: float) -> float:
    return n_dims * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))


@functools.lru_cache(maxsize=16)
def rope_table(cfg: RopeConfig, n_positions: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for positions 0..n_positions-1, [n_positions, n_rot/2] float32 on `device`."""
    half = cfg.n_rot // 2
    theta_scale = np.float32(cfg.freq_base) ** np.float32(-2.0 / cfg.n_rot)
    steps = np.empty((n_positions, half), np.float32)
    steps[:, 0] = np.arange(n_positions, dtype=np.float32)
    steps[:, 1:] = theta_scale
    theta_extrap = np.cumprod(steps, axis=1, dtype=np.float32)
    theta = np.float32(cfg.freq_scale) * theta_extrap
    mscale = np.float32(cfg.attn_factor)
    if cfg.ext_factor != 0.0:
        low = max(0.0, math.floor(_corr_dim(cfg.n_rot, cfg.n_ctx_orig, cfg.beta_fast, cfg.freq_base)))
        high = min(cfg.n_rot - 1.0, math.ceil(_corr_dim(cfg.n_rot, cfg.n_ctx_orig, cfg.beta_slow, cfg.freq_base)))
        i0 = np.arange(half, dtype=np.float32) * 2
        y = (np.floor(i0 / 2) - np.float32(low)) / np.float32(max(0.001, high - low))
        ramp_mix = (1 - np.clip(y, 0, 1)).astype(np.float32) * np.float32(cfg.ext_factor)
        theta = theta * (1 - ramp_mix) + theta_extrap * ramp_mix
        mscale = np.float32(mscale * (1.0 + 0.1 * math.log(1.0 / cfg.freq_scale)))
    return (torch.from_numpy(np.cos(theta) * mscale).to(device), torch.from_numpy(np.sin(theta) * mscale).to(device))


def _kernel_applies(x: torch.Tensor, positions: torch.Tensor, cfg: RopeConfig) -> bool:
    if not triton_applies(x.device):
        return False
    from engine.kernels import norm_rope

    return norm_rope.rope_supported(x, positions, cfg.n_rot)


def rope_qk(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cfg: RopeConfig, n_ctx: int,
            norms: tuple[torch.Tensor, torch.Tensor] | None = None,
            eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k [T, heads, head_dim] (head counts may differ) rotated at `positions` [T] (on
    their device, each < n_ctx), dims past n_rot passing through: one launch where the kernel
    applies. `norms` (q's and k's weights [head_dim]): each head row is first
    rms_norm'ed with its weight and `eps` (qwen3moe), in that same launch."""
    return _rope_qk(q, k, positions, cfg, n_ctx, norms, eps, None)


def rope_qk_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cfg: RopeConfig,
                  cache: KVCache, layer: int, start: int | None,
                  norms: tuple[torch.Tensor, torch.Tensor] | None = None,
                  eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rope_qk, then cache.store of the rotated k and of v: q rotated, and the keys and values
    attention reads (as KVCache.store returns them). Where the kernel applies and the cache
    takes v's head dim, the RoPE launch writes k's and v's rows into the cache itself (a decode
    step's two stores fewer)."""
    q, k = _rope_qk(q, k, positions, cfg, cache.n_ctx, norms, eps, (cache.k[layer], v, cache.v[layer]))
    if k is None:
        return (q, *cache.filled(layer, start, q.shape[0]))
    return (q, *cache.store(layer, start, k, v, positions))


def _rope_qk(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cfg: RopeConfig, n_ctx: int,
             norms: tuple[torch.Tensor, torch.Tensor] | None, eps: float,
             store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """rope_qk; with `store` (k_cache, v, v_cache) k comes back None where the launch wrote k's
    and v's rows into the caches at `positions`."""
    fused = (_kernel_applies(q, positions, cfg) and _kernel_applies(k, positions, cfg)
             and k.shape[-1] == q.shape[-1] and k.device == q.device)
    if norms is not None and not (fused and _norms_fit(q, k, norms)):
        q, k = rms_norm(q, norms[0], eps), rms_norm(k, norms[1], eps)  # the two steps in sequence
        norms = None
    if fused:
        from engine.kernels import norm_rope

        if store is not None and not norm_rope.store_supported(k, store):
            store = None
        q, k = norm_rope.rope(q, k, positions, *rope_table(cfg, n_ctx, str(q.device)), cfg.n_rot, cfg.neox,
                              norms, eps, store)
        return q, (None if store is not None else k)
    return _apply_rope_torch(q, positions, cfg, n_ctx), _apply_rope_torch(k, positions, cfg, n_ctx)


def _norms_fit(q: torch.Tensor, k: torch.Tensor, norms: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Whether the RoPE launch can take both per-head norm weights."""
    from engine.kernels import norm_rope

    return all(norm_rope.rope_norm_supported(x, w) for x, w in zip((q, k), norms))


def _apply_rope_torch(x: torch.Tensor, positions: torch.Tensor, cfg: RopeConfig, n_ctx: int) -> torch.Tensor:
    """The reference (and CPU path) of rope_qk, for one tensor."""
    cos, sin = (t[positions][:, None, :] for t in rope_table(cfg, n_ctx, str(x.device)))
    rot, rest = x[..., :cfg.n_rot], x[..., cfg.n_rot:]
    if cfg.neox:
        a, b = rot[..., :cfg.n_rot // 2], rot[..., cfg.n_rot // 2:]
        out = torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)
    else:
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
    return torch.cat([out, rest], dim=-1) if rest.numel() else out
