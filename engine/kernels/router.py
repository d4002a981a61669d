"""The MoE router's float work in one Triton launch: router logits [T, n_expert] -> expert ids
[T, k] (int64) and routing weights [T, k] (float32), as `engine.layers.moe.Router` computes them.

One program per token (grid (T,), any T), the token's logits in registers (n_expert up to
MAX_EXPERTS), one warp for up to 256 experts:
1. gating: softmax (max, sum of exp, division, as torch's softmax), sigmoid (1 / (1 + exp(-x)),
   as torch.sigmoid) or none (SOFTMAX_WEIGHT: the logits are the scores);
2. the selection score: the gated score plus the optional selection bias (DeepSeek-V3, GLM);
3. top-k by k reductions, each picking the largest remaining selection score and carrying its
   index and gated score along (so the gather is part of the pick). Order: descending score,
   equal scores by lowest expert index first (the order taken for torch.topk's ties on CUDA;
   torch.topk on the CPU orders ties arbitrarily, and so do the torch path's ids there: the
   tests hold ties to a stable descending sort, on the GPU too). NaN logits are not
   ordered (torch.topk treats NaN as the largest; llama.cpp's argsort does not define it);
4. SOFTMAX_WEIGHT: softmax over the k selected (gpt-oss); norm_weights: division by the weight
   sum clamped to WEIGHT_SUM_MIN; weights_scale when it is not 0 or 1; the same formulas, in the
   same order, as Router.route_torch (llama.cpp's build_moe_ffn).

Replaces (on CUDA, at decode inside the token's graph) the ~10-14 torch launches of the torch
path (softmax or sigmoid, add, topk, gather, softmax, sum, clamp, div, mul; group-limited
routing adds ~7: topk, sum, topk, zeros, scatter, masked_fill, topk) by one. The gate
product (`Router.gate`, a Linear) stays a separate launch. Exactness: every exp is libdevice's
expf, the float32 function torch's CUDA kernels call, every division correctly rounded (div_rn;
Triton's `/` is an approximate one), so gated scores differ from torch only by the order of
the softmax sum; ids are the same unless two scores are within that rounding.

deepseek2's group-limited routing (DeepSeek-V3: GroupLimitedRouter) runs in the same launch
where its groups are a power of two in count and size (V3: 8 x 32): before the top-k, each
group scores the sum of its two best selection scores, the G_USED best groups are picked as the
experts are (ties: lowest group first) and the other groups' experts leave the race (-inf, as
the torch path's masked_fill). Other group shapes keep the torch path.

Graph-safe: no host sync, outputs of fixed size allocated per call, no data-dependent host
control flow.
"""
from __future__ import annotations

import os

import torch

from engine.layers.moe import SIGMOID, SOFTMAX, SOFTMAX_WEIGHT, WEIGHT_SUM_MIN, RouterConfig

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

MAX_EXPERTS = 1024  # experts of one token held in registers: 4 warps x 8 values per lane
MAX_K = 32  # top-k reductions unrolled in the kernel
GATING_CODE = {SOFTMAX: 0, SIGMOID: 1, SOFTMAX_WEIGHT: 2}
PLAIN = (1, 1)  # (n_group, n_group_used) of the plain top-k over every expert


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


if triton is not None:

    @triton.jit
    def _exp(v, INTERP: tl.constexpr):
        """expf: libdevice's (as torch's CUDA kernels) on the GPU; numpy's in the interpreter."""
        if INTERP:
            r = tl.exp(v)
        else:
            r = libdevice.exp(v)
        return r

    @triton.jit
    def _pick(a_key, a_idx, a_p, b_key, b_idx, b_p):
        """The larger key with its index and score; equal keys: the lower index."""
        take_a = (a_key > b_key) | ((a_key == b_key) & (a_idx < b_idx))
        return tl.where(take_a, a_key, b_key), tl.where(take_a, a_idx, b_idx), tl.where(take_a, a_p, b_p)

    @triton.jit
    def _router_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, logits_stride, scale, sum_min,
                       N: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
                       GATING: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
                       HAS_SCALE: tl.constexpr, G: tl.constexpr, G_USED: tl.constexpr, INTERP: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, BLOCK)
        live = e < N
        x = tl.load(logits_ptr + t * logits_stride + e, mask=live, other=float("-inf"))
        if GATING == 0:  # softmax; padding lanes: exp(-inf) = 0
            ex = _exp(x - tl.max(x, 0), INTERP)
            probs = tl.math.div_rn(ex, tl.sum(ex, 0))
        elif GATING == 1:  # sigmoid
            probs = tl.math.div_rn(tl.full([BLOCK], 1.0, tl.float32), 1.0 + _exp(-x, INTERP))
        else:  # SOFTMAX_WEIGHT: the logits select, the softmax runs over the selected below
            probs = x
        sel = probs
        if HAS_BIAS:
            sel = probs + tl.load(bias_ptr + e, mask=live, other=0.0)
        sel = tl.where(live, sel, float("-inf"))
        if G > 1:  # group-limited: only the experts of the G_USED best groups stay in the race
            SG: tl.constexpr = BLOCK // G  # G and SG powers of two, G * SG == N == BLOCK
            s2 = tl.reshape(sel, [G, SG])
            col = tl.arange(0, SG)[None, :]
            top1 = tl.max(s2, 1)
            first = tl.min(tl.where(s2 == top1[:, None], col, SG), 1)
            top2 = tl.max(tl.where(col == first[:, None], float("-inf"), s2), 1)
            gscore = top1 + top2  # a group scores the sum of its two best (torch: topk(2).values.sum())
            g = tl.arange(0, G)
            gidx = g
            kept = g < 0
            for i in tl.static_range(G_USED):
                _, bg, _ = tl.reduce((gscore, gidx, gidx), 0, _pick)
                kept = kept | (g == bg)
                gscore = tl.where(g == bg, float("-inf"), gscore)
                gidx = tl.where(g == bg, G, gidx)
            sel = tl.reshape(tl.where(kept[:, None], s2, float("-inf")), [BLOCK])
        # A picked lane leaves the race with the lowest key and an index past every lane, so a
        # live lane of score -inf still wins over it; padding lanes (index >= N) lose ties to
        # live ones, and k <= N keeps them from ever being picked.
        idx = e
        j = tl.arange(0, BLOCK_K)
        ids = tl.zeros([BLOCK_K], dtype=tl.int32)
        w = tl.zeros([BLOCK_K], dtype=tl.float32)
        for i in tl.static_range(K):
            _, best, p = tl.reduce((sel, idx, probs), 0, _pick)
            ids = tl.where(j == i, best, ids)
            w = tl.where(j == i, p, w)
            taken = e == best
            sel = tl.where(taken, float("-inf"), sel)
            idx = tl.where(taken, BLOCK, idx)
        kl = j < K
        if GATING == 2:  # softmax over the selected k
            ew = _exp(w - tl.max(tl.where(kl, w, float("-inf")), 0), INTERP)
            ew = tl.where(kl, ew, 0.0)
            w = tl.math.div_rn(ew, tl.sum(ew, 0))
        if NORM:
            w = tl.math.div_rn(w, tl.maximum(tl.sum(tl.where(kl, w, 0.0), 0), sum_min))
        if HAS_SCALE:
            w = w * scale
        tl.store(ids_ptr + t * K + j, ids.to(tl.int64), mask=kl)
        tl.store(w_ptr + t * K + j, w, mask=kl)


def supports(logits: torch.Tensor, cfg: RouterConfig, selection_bias: torch.Tensor | None,
             groups: tuple[int, int] = PLAIN) -> bool:
    """Whether the kernel takes these logits (float32 [T, n_expert], rows contiguous), this
    configuration and these `groups` (n_group, n_group_used: group-limited routing where
    n_group > 1, for groups of a power-of-two count and size, at least 2); otherwise the torch
    path runs."""
    n, k = cfg.n_expert, cfg.n_expert_used
    if groups != PLAIN:
        n_group, n_used = groups
        if not (_pow2(n_group) and n % n_group == 0 and _pow2(n // n_group) and n // n_group >= 2
                and 1 <= n_used <= n_group):
            return False
    if triton is None or logits.dim() != 2 or logits.dtype != torch.float32 or logits.shape[1] != n:
        return False
    if logits.stride(1) != 1 or cfg.gating not in GATING_CODE or not (1 <= k <= min(n, MAX_K)) or n > MAX_EXPERTS:
        return False
    if selection_bias is not None:
        return (selection_bias.dtype == torch.float32 and selection_bias.shape == (n,)
                and selection_bias.is_contiguous() and selection_bias.device == logits.device)
    return True


def _num_warps(block: int) -> int:
    # one warp holds 256 scores in 8 registers a lane; the k reductions are then shuffles only
    return max(1, min(4, block // 256))


def launch_constants(cfg: RouterConfig, has_bias: bool, groups: tuple[int, int] = PLAIN,
                     interp: bool = INTERPRETED) -> dict:
    """The kernel's constexprs for this configuration (the launcher's and the AOT check's)."""
    block = triton.next_power_of_2(cfg.n_expert)
    return {"N": cfg.n_expert, "K": cfg.n_expert_used, "BLOCK": block,
            "BLOCK_K": triton.next_power_of_2(cfg.n_expert_used), "GATING": GATING_CODE[cfg.gating],
            "HAS_BIAS": has_bias, "NORM": cfg.norm_weights, "HAS_SCALE": cfg.weights_scale not in (0.0, 1.0),
            "G": groups[0], "G_USED": groups[1], "INTERP": interp}


def route(logits: torch.Tensor, cfg: RouterConfig, selection_bias: torch.Tensor | None,
          groups: tuple[int, int] = PLAIN) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] (int64) and weights [T, k] (float32) for router logits [T, n_expert]; the
    caller checked `supports`."""
    T, k = logits.shape[0], cfg.n_expert_used
    ids = torch.empty((T, k), dtype=torch.int64, device=logits.device)
    weights = torch.empty((T, k), dtype=torch.float32, device=logits.device)
    if T == 0:
        return ids, weights
    const = launch_constants(cfg, selection_bias is not None, groups)
    bias = selection_bias if selection_bias is not None else logits  # never read without HAS_BIAS
    _router_kernel[(T,)](logits, bias, ids, weights, logits.stride(0), float(cfg.weights_scale), WEIGHT_SUM_MIN,
                         **const, num_warps=_num_warps(const["BLOCK"]))
    return ids, weights


def compile_for(cfg: RouterConfig, has_bias: bool, groups: tuple[int, int] = PLAIN, arch: int = 90):
    """The kernel compiled for CUDA sm_`arch` without a GPU (Triton ships ptxas): the AOT check.
    Not with TRITON_INTERPRET=1 (interpreted kernels cannot be compiled)."""
    from engine.quant import triton_aot

    const = launch_constants(cfg, has_bias, groups, interp=False)
    types = {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "ids_ptr": "*i64", "w_ptr": "*fp32",
             "scale": "fp32", "sum_min": "fp32"}
    return triton_aot.compile_for(_router_kernel, types, const, num_warps=_num_warps(const["BLOCK"]), arch=arch)
