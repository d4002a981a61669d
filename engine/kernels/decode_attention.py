"""Fused decode attention (Triton): one query token (up to MAX_TOKENS) per sequence over the
float32 KV cache, reading only the positions the queries can see.

The torch reference is engine/layers/attention.attend: inside the decode graph it repeats K/V
per q head (repeat_interleave), takes scores over the WHOLE cache (n_ctx positions, the host
does not know the position there), masks them by position, softmaxes and multiplies by V —
10-15 launches that read and write a few hundred MB per layer at a 4096 context. Here it is two
launches (flash-decoding), whose work grows with the position, not with n_ctx:

1. `_split_kernel`, grid (Hkv x q-row blocks, n_splits): the q heads of one kv group (x the
   query tokens) are the rows of one program, so K and V are read once per group. The visible
   key range [lo, hi) — hi past the largest position, lo where the sliding window starts — is
   cut into n_splits contiguous chunks of whole BLOCK_N key blocks; a program runs an online
   softmax over its chunk and writes its partials (row max, sum of exponentials, the weighted
   sum of V). Splits past the range write an empty partial (max -inf) and read nothing.
2. `_combine_kernel`, grid (tokens x q heads,): rescales the partials to the common max and
   adds them; the sink (gpt-oss) joins the normalisation here as one more logit with no value.

Positions are a device tensor, the chunking is computed on the device and n_splits depends
only on the GPU and the head geometry (never on the cache view's length), so a CUDA graph over
the whole cache and an eager call over its prefix run the same programs over the same keys in
the same order: bit-identical results.

Numerics: float32 throughout (scores = (q . k) * scale, masked, exp(s - max), as the reference
softmax computes them; dot products in IEEE float32, never TF32). Results equal `attend` up to
float32 summation order (online softmax rescaling, split partials): ~1e-6 relative.

Shapes: any group size (rows padded to a power of two; from 8 rows on padded to 16 for tl.dot,
a broadcast product below), head dims up to 1024 (deepseek2's MLA: one kv "head" of dk 576 / dv 512), a
sliding window, sinks.
"""
from __future__ import annotations

import functools
import os

import torch

try:  # Triton is optional: without it attend runs its torch code.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

MAX_TOKENS = 8  # query tokens per call the kernel takes (decode is 1); more run attend's torch code
MAX_HEAD_DIM = 1024  # dk and dv the kernel takes (MLA's 576 / 512 included)
MAX_SPLITS = 128  # the combine kernel reads every split's max in one vector
ACC_ELEMS = 8192  # rows x dv of a program's accumulator: 64 registers a thread at 4 warps


def available() -> bool:
    return triton is not None


if triton is not None:

    # The cache length and the window are not specialized on: every view of the cache (the
    # graph's whole cache, an eager prefix) and every layer runs one compiled kernel.
    @triton.jit(do_not_specialize=["S", "window"])
    def _split_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, m_ptr, l_ptr, acc_ptr,
                      n_tok, n_head, S, scale, window, n_splits,
                      q_stride_t, q_stride_h, k_stride_s, k_stride_h, v_stride_s, v_stride_h,
                      GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCK_DV: tl.constexpr, USE_DOT: tl.constexpr):
        pid0 = tl.program_id(0)
        split = tl.program_id(1)
        n_mblocks = tl.cdiv(n_tok * GROUP, BLOCK_M)
        hkv = pid0 // n_mblocks
        mblock = pid0 % n_mblocks

        # Rows: (token, head of the group), token-major; padded rows are masked out.
        rows = mblock * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < n_tok * GROUP
        tok = rows // GROUP
        head = hkv * GROUP + rows % GROUP
        pos = tl.load(pos_ptr + tok, mask=row_ok, other=0).to(tl.int32)

        # The keys any row can see, cut into n_splits chunks of whole key blocks (on the device:
        # the work follows the position; the host never reads it).
        hi = tl.minimum(tl.max(tl.where(row_ok, pos, -1)) + 1, S)
        lo_window = tl.maximum(tl.min(tl.where(row_ok, pos, 2147483647)) - window + 1, 0)
        lo = tl.where(window > 0, lo_window, 0)
        chunk = tl.cdiv(tl.cdiv(hi - lo, n_splits), BLOCK_N) * BLOCK_N
        start = lo + split * chunk
        end = tl.minimum(start + chunk, hi)

        offs_n = tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        offs_dv = tl.arange(0, BLOCK_DV)
        dv_ok = offs_dv < DV
        q_rows = q_ptr + tok * q_stride_t + head * q_stride_h
        k_base = k_ptr + hkv * k_stride_h
        v_base = v_ptr + hkv * v_stride_h

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            keys = n0 + offs_n
            key_ok = keys < end
            s = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for d0 in tl.static_range(0, DK, BLOCK_K):
                d = d0 + offs_k
                d_ok = d < DK
                qc = tl.load(q_rows[:, None] + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
                kc = tl.load(k_base + keys[:, None] * k_stride_s + d[None, :],
                             mask=key_ok[:, None] & d_ok[None, :], other=0.0)
                if USE_DOT:
                    s += tl.dot(qc, tl.trans(kc), input_precision="ieee")
                else:
                    s += tl.sum(qc[:, None, :] * kc[None, :, :], axis=2)
            s = s * scale
            # Causal, and the sliding window: keys more than window - 1 back are hidden.
            visible = (keys[None, :] <= pos[:, None]) & key_ok[None, :] & row_ok[:, None]
            visible = visible & ((window <= 0) | (pos[:, None] - keys[None, :] < window))
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            vc = tl.load(v_base + keys[:, None] * v_stride_s + offs_dv[None, :],
                         mask=key_ok[:, None] & dv_ok[None, :], other=0.0)
            if USE_DOT:
                pv = tl.dot(p, vc, input_precision="ieee")
            else:
                pv = tl.sum(p[:, :, None] * vc[None, :, :], axis=1)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        # Partials [split, token, head]; an empty split writes only its max (-inf), which the
        # combine kernel reads as "nothing here" and skips its accumulator.
        part = (split * n_tok + tok) * n_head + head
        tl.store(m_ptr + part, m_i, mask=row_ok)
        tl.store(l_ptr + part, l_i, mask=row_ok)
        wrote = row_ok & ((rows * 0 + end) > start)
        tl.store(acc_ptr + part[:, None] * DV + offs_dv[None, :], acc, mask=wrote[:, None] & dv_ok[None, :])

    @triton.jit
    def _combine_kernel(m_ptr, l_ptr, acc_ptr, sink_ptr, out_ptr, n_rows, n_head, n_splits,
                        DV: tl.constexpr, HAS_SINK: tl.constexpr, SPLITS_P2: tl.constexpr,
                        BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr):
        row = tl.program_id(0)  # token * n_head + head
        offs_s = tl.arange(0, SPLITS_P2)
        m_all = tl.load(m_ptr + offs_s * n_rows + row, mask=offs_s < n_splits, other=float("-inf"))
        m = tl.max(m_all)
        if HAS_SINK:
            sink = tl.load(sink_ptr + row % n_head)
            m = tl.maximum(m, sink)
        # The key at the query's own position is always visible, so m is finite.
        offs_b = tl.arange(0, BLOCK_S)
        offs_dv = tl.arange(0, BLOCK_DV)
        dv_ok = offs_dv < DV
        denom = tl.zeros([BLOCK_S], tl.float32)
        num = tl.zeros([BLOCK_S, BLOCK_DV], tl.float32)
        for s0 in range(0, n_splits, BLOCK_S):
            sp = s0 + offs_b
            sp_ok = sp < n_splits
            ms = tl.load(m_ptr + sp * n_rows + row, mask=sp_ok, other=float("-inf"))
            live = ms > float("-inf")
            w = tl.where(live, tl.exp(ms - m), 0.0)
            ls = tl.load(l_ptr + sp * n_rows + row, mask=live, other=0.0)
            a = tl.load(acc_ptr + (sp * n_rows + row)[:, None] * DV + offs_dv[None, :],
                        mask=live[:, None] & dv_ok[None, :], other=0.0)
            denom += w * ls
            num += w[:, None] * a
        total = tl.sum(denom, axis=0)
        if HAS_SINK:
            total += tl.exp(sink - m)
        out = tl.sum(num, axis=0) / total
        tl.store(out_ptr + row * DV + offs_dv, out, mask=dv_ok)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few splits, so the tests cross split boundaries
    return torch.cuda.get_device_properties(device).multi_processor_count


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernel takes these shapes (else attend runs its torch code)."""
    n_tok, n_head, dk = q.shape
    n_kv = k.shape[1]
    return (triton is not None and 1 <= n_tok <= MAX_TOKENS and n_head % n_kv == 0
            and dk <= MAX_HEAD_DIM and v.shape[2] <= MAX_HEAD_DIM
            and q.dtype == k.dtype == v.dtype == torch.float32)


@functools.lru_cache(maxsize=None)
def plan(n_tok: int, n_head: int, n_kv: int, dk: int, dv: int, n_sm: int) -> dict:
    """Block sizes and the split count of one geometry. n_splits fills the GPU about twice
    over with (kv head x row block) programs; it never depends on the cache length, so the
    graph (whole cache) and the eager prefix give the same partials."""
    group = n_head // n_kv
    rows = n_tok * group
    block_dv = triton.next_power_of_2(dv)
    block_m = max(1, min(triton.next_power_of_2(rows), ACC_ELEMS // block_dv, 64))
    use_dot = block_m >= 8  # tl.dot needs 16 rows: 8 are padded to 16 (the work is memory-bound)
    if use_dot:
        block_m = max(block_m, 16)
        block_n = 64 if block_dv <= 128 else 32
    else:
        block_n = 16  # the broadcast product's [rows, keys, dims] tile stays small
    block_k = min(triton.next_power_of_2(dk), 64 if use_dot else 32)
    n_mblocks = triton.cdiv(rows, block_m)
    n_splits = max(1, min(MAX_SPLITS, triton.cdiv(2 * n_sm, n_kv * n_mblocks)))
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "BLOCK_DV": block_dv,
            "USE_DOT": use_dot, "n_mblocks": n_mblocks, "n_splits": n_splits,
            "num_warps": 8 if block_m * block_dv > 4096 else 4}


def _combine_blocks(n_splits: int, block_dv: int) -> dict:
    """The combine kernel's tiles: every split's max in one vector, accumulators 4096 values at a time."""
    splits_p2 = triton.next_power_of_2(n_splits)
    return {"SPLITS_P2": splits_p2, "BLOCK_S": max(1, min(splits_p2, 4096 // block_dv))}


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float,
                     window: int = 0, sinks: torch.Tensor | None = None,
                     n_splits: int | None = None) -> torch.Tensor:
    """attend's contract: q [T, H, dk] at `positions` [T] (a device tensor); k [S, Hkv, dk],
    v [S, Hkv, dv] for positions 0..S-1 (the whole cache or its filled prefix: only keys up
    to each query's position are read). Returns [T, H * dv]. `n_splits` overrides the split
    count (tests)."""
    n_tok, n_head, dk = q.shape
    S, n_kv, dv = v.shape
    q = q if q.stride(2) == 1 else q.contiguous()
    k = k if k.stride(2) == 1 else k.contiguous()
    v = v if v.stride(2) == 1 else v.contiguous()
    cfg = plan(n_tok, n_head, n_kv, dk, dv, _sm_count(q.device))
    splits = n_splits or cfg["n_splits"]
    group = n_head // n_kv
    rows = n_tok * n_head
    ml = torch.empty(2, splits, rows, device=q.device, dtype=torch.float32)  # each split's max and sum
    m, l_ = ml[0], ml[1]
    acc = torch.empty(splits, rows, dv, device=q.device, dtype=torch.float32)
    out = torch.empty(n_tok, n_head * dv, device=q.device, dtype=torch.float32)
    opts = {} if INTERPRETED else {"num_warps": cfg["num_warps"], "num_stages": 2}
    _split_kernel[(n_kv * cfg["n_mblocks"], splits)](
        q, k, v, positions, m, l_, acc, n_tok, n_head, S, float(scale), int(window), splits,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        GROUP=group, DK=dk, DV=dv, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        BLOCK_DV=cfg["BLOCK_DV"], USE_DOT=cfg["USE_DOT"], **opts)
    sink = sinks.to(torch.float32).contiguous() if sinks is not None else m  # m: an unread placeholder
    _combine_kernel[(rows,)](
        m, l_, acc, sink, out, rows, n_head, splits,
        DV=dv, HAS_SINK=sinks is not None, BLOCK_DV=cfg["BLOCK_DV"], **_combine_blocks(splits, cfg["BLOCK_DV"]),
        **({} if INTERPRETED else {"num_warps": 4}))
    return out


# (n_head, n_kv, dk, dv, window, sinks) of the real models' attention layers: the GPU tests'
# shapes and the sm_90 compile check's.
REAL_GEOMETRIES: dict[str, tuple[int, int, int, int, int, bool]] = {
    "qwen3-30b-a3b": (32, 4, 128, 128, 0, False),
    "mixtral-8x7b": (32, 8, 128, 128, 0, False),
    "gpt-oss-swa": (64, 8, 64, 64, 128, True),
    "gpt-oss-full": (64, 8, 64, 64, 0, True),
    "deepseek2-mla": (16, 1, 576, 512, 0, False),
    "deepseek3-mla": (128, 1, 576, 512, 0, False),
}


def aot_report(arch: int = 90, n_sm: int = 132) -> list[dict]:  # pragma: no cover - run in a subprocess
    """Both launches of every REAL_GEOMETRIES entry compiled for `arch` without a GPU (Triton
    ships ptxas), with their registers and spills (engine.quant.triton_aot.resource_usage)."""
    from functools import partial

    from engine.quant.triton_aot import compile_for, in_parallel, resource_usage

    ptrs = {n: "*fp32" for n in ("q_ptr", "k_ptr", "v_ptr", "m_ptr", "l_ptr", "acc_ptr", "sink_ptr", "out_ptr")}
    types = {**ptrs, "pos_ptr": "*i64", "scale": "fp32"}

    def row(name: str, label: str, n_splits: int, fn, const: dict, num_warps: int) -> dict:
        aligned = {arg for arg in fn.arg_names if "_stride_" in arg}  # row strides 16-aligned at a launch
        compiled = compile_for(fn, types, const, aligned, num_warps=num_warps, num_stages=2, arch=arch)
        return {"geometry": name, "kernel": label, "n_splits": n_splits, **resource_usage(compiled)}

    jobs = []
    for name, (n_head, n_kv, dk, dv, window, sinks) in REAL_GEOMETRIES.items():
        cfg = plan(1, n_head, n_kv, dk, dv, n_sm)
        jobs.append(partial(row, name, "split", cfg["n_splits"], _split_kernel, {
            "GROUP": n_head // n_kv, "DK": dk, "DV": dv, "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"],
            "BLOCK_K": cfg["BLOCK_K"], "BLOCK_DV": cfg["BLOCK_DV"], "USE_DOT": cfg["USE_DOT"]}, cfg["num_warps"]))
        combine = {"DV": dv, "HAS_SINK": sinks, "BLOCK_DV": cfg["BLOCK_DV"],
                   **_combine_blocks(cfg["n_splits"], cfg["BLOCK_DV"])}
        jobs.append(partial(row, name, "combine", cfg["n_splits"], _combine_kernel, combine, 4))
    return in_parallel(jobs)


if __name__ == "__main__":  # pragma: no cover - a report, run by hand or by the tests in a subprocess
    import argparse
    import json

    ap = argparse.ArgumentParser(description="compile the decode attention kernels for a GPU that is not here")
    ap.add_argument("--aot", action="store_true", help="print the sm_90 report as one JSON list")
    ap.add_argument("--arch", type=int, default=90)
    args = ap.parse_args()
    if INTERPRETED:
        raise SystemExit("unset TRITON_INTERPRET: kernels imported for the interpreter cannot be compiled")
    report = aot_report(args.arch)
    if args.aot:
        print(json.dumps(report))
    else:
        for r in report:
            print(f"{r['geometry']:14s} {r['kernel']:8s} splits={r['n_splits']:<3d} regs={r['regs']} "
                  f"local={r['local']} spills={r['spill_ops']} shared={r['shared']} loads={r['loads']}")
