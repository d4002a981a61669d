"""Fused RMS norm and RoPE (Triton): one launch each where the torch reference takes many.

`rms_norm(x, weight, eps)`: one launch, grid over rows (tokens, or tokens x heads for the
per-head q/k norms), a whole row of up to 8192 values in one program. It replaces torch's
pow / mean / add / rsqrt / mul / mul (6 kernels) of engine/layers/norm.rms_norm.

`rope(q, k, positions, cos, sin, n_rot, neox)`: one launch rotates q and, when given, k
(grid: tokens x blocks of heads, the q heads' blocks first); positions are read on the
device, so a captured decode graph replays it at any position. It replaces the ~9 kernels
per tensor of engine/layers/rope.apply_rope (two gathers of the table, slices, four
products, two sums, cat/stack), i.e. ~18 for q and k together.

Exactness: the same formulas as the torch code, in float32. RMS norm:
x * rsqrt(sum(x^2) / D + eps) * w, equal up to the order of the row's sum (and rsqrt's last
bit: CUDA's rsqrtf as in torch on CUDA, 1/sqrt as in torch on CPU). RoPE: a*cos - b*sin and
a*sin + b*cos with each product rounded to float32 before the sum (mul_rn: no FMA
contraction), so the result is bit-identical to the torch code's.

Inputs need a contiguous last dimension only (views like q.view(n, heads, hd) or
deepseek2's strided slices q[..., nope:] and kv[:, None, kv_lora:] are read in place);
outputs are new contiguous tensors, as the torch code returns.

`TRITON_INTERPRET=1` (set before this module is imported) runs the kernels on CPU tensors
through Triton's interpreter (the CPU tests); `python -m engine.kernels.norm_rope` compiles
every variant for sm_90 without a GPU and prints the resource usage as JSON.
"""
from __future__ import annotations

import os

import torch

try:  # Triton is optional: without it the torch path runs.
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
MAX_NORM_DIM = 8192  # a row stays in registers (n_embd up to 7168 and head dims up to 576)
_ROPE_BLOCK_H = 16  # heads per RoPE program: a decode token's q heads take 1..4 programs


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _norm_warps(block: int) -> int:
    # 16 values per thread at the larger rows; a warp for a head's 64..256 values
    return max(1, min(8, block // 512))


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_a, stride_b, n_b, D, eps,
                         HAS_W: tl.constexpr, BLOCK: tl.constexpr, INTERP: tl.constexpr):
        """One row: x's rows are (a, b) pairs of a [A, B, D] view (B = 1 for 2-D inputs)."""
        row = tl.program_id(0).to(tl.int64)
        a, b = row // n_b, row % n_b
        offs = tl.arange(0, BLOCK)
        mask = offs < D
        x = tl.load(x_ptr + a * stride_a + b * stride_b + offs, mask=mask, other=0.0)
        # correctly rounded, as torch's mean (D + 0 * row: a tensor even where Triton made D = 1 a constant)
        mean = tl.div_rn(tl.sum(x * x, axis=0), (D + 0 * row).to(tl.float32))
        if INTERP:
            r = 1.0 / tl.sqrt(mean + eps)  # torch's rsqrt on CPU
        else:
            r = libdevice.rsqrt(mean + eps)  # CUDA's rsqrtf, as torch's rsqrt on CUDA
        y = x * r
        if HAS_W:
            y = y * tl.load(w_ptr + offs, mask=mask, other=0.0)
        tl.store(out_ptr + row * D + offs, y, mask=mask)

    @triton.jit
    def _mul(a, b, INTERP: tl.constexpr):
        """A float32 product rounded on its own: no FMA contraction with the sum that follows
        (numpy, under the interpreter, never contracts)."""
        if INTERP:
            p = a * b
        else:
            p = libdevice.mul_rn(a, b)
        return p

    @triton.jit
    def _rope_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, cos_ptr, sin_ptr,
                     q_stride_t, q_stride_h, k_stride_t, k_stride_h, n_qh, n_kh, n_q_blocks,
                     HEAD_DIM: tl.constexpr, N_ROT: tl.constexpr, NEOX: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr, INTERP: tl.constexpr):
        """Token t, a block of BLOCK_H heads of q (program_id(1) < n_q_blocks) or of k."""
        t = tl.program_id(0).to(tl.int64)
        hb = tl.program_id(1)
        # Triton specialises an int argument of 1 as a constant (one k head: deepseek2's k_pe) and
        # multiples of 16 as aligned (so the loads vectorise); adding a zero tensor makes both
        # branches of the q/k choice int32 tensors while keeping that alignment.
        zero = hb * 0
        if hb < n_q_blocks:
            src, dst, h0 = q_ptr, qo_ptr, hb * BLOCK_H
            st, sh, nh = q_stride_t + zero, q_stride_h + zero, n_qh + zero
        else:
            src, dst, h0 = k_ptr, ko_ptr, (hb - n_q_blocks) * BLOCK_H
            st, sh, nh = k_stride_t + zero, k_stride_h + zero, n_kh + zero
        HALF: tl.constexpr = N_ROT // 2
        pos = tl.load(pos_ptr + t).to(tl.int64)
        i = tl.arange(0, BLOCK_HALF)
        imask = i < HALF
        c = tl.load(cos_ptr + pos * HALF + i, mask=imask, other=0.0)[None, :]
        s = tl.load(sin_ptr + pos * HALF + i, mask=imask, other=0.0)[None, :]
        h = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)
        hmask = h < nh
        src_row = src + t * st + h[:, None] * sh
        dst_row = dst + (t * nh + h[:, None]) * HEAD_DIM
        if NEOX:  # (i, i + n_rot/2): two contiguous halves
            mask = hmask[:, None] & imask[None, :]
            a = tl.load(src_row + i[None, :], mask=mask, other=0.0)
            b = tl.load(src_row + HALF + i[None, :], mask=mask, other=0.0)
            tl.store(dst_row + i[None, :], _mul(a, c, INTERP) - _mul(b, s, INTERP), mask=mask)
            tl.store(dst_row + HALF + i[None, :], _mul(a, s, INTERP) + _mul(b, c, INTERP), mask=mask)
        else:  # (2i, 2i + 1): the rotated dims loaded contiguously, split into pairs in registers
            j = tl.arange(0, 2 * BLOCK_HALF)
            mask = hmask[:, None] & (j < N_ROT)[None, :]
            x = tl.load(src_row + j[None, :], mask=mask, other=0.0)
            a, b = tl.split(tl.reshape(x, (BLOCK_H, BLOCK_HALF, 2)))
            y = tl.join(_mul(a, c, INTERP) - _mul(b, s, INTERP), _mul(a, s, INTERP) + _mul(b, c, INTERP))
            tl.store(dst_row + j[None, :], tl.reshape(y, (BLOCK_H, 2 * BLOCK_HALF)), mask=mask)
        if N_ROT < HEAD_DIM:  # dims past n_rot pass through
            j = N_ROT + tl.arange(0, BLOCK_REST)
            rmask = hmask[:, None] & (j < HEAD_DIM)[None, :]
            tl.store(dst_row + j[None, :], tl.load(src_row + j[None, :], mask=rmask, other=0.0), mask=rmask)


def available() -> bool:
    return triton is not None


def _as_rows3(x: torch.Tensor) -> torch.Tensor:
    """x as an [A, B, D] view whose last dimension is contiguous (a copy only for >3-D inputs
    that cannot be flattened in place)."""
    if x.dim() == 1:
        return x.view(1, 1, -1)
    if x.dim() == 2:
        return x[:, None, :]
    if x.dim() == 3:
        return x
    return x.reshape(-1, 1, x.shape[-1])


def norm_supported(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """Shapes the kernel takes: float32, a contiguous last dimension of at most MAX_NORM_DIM,
    a weight of that length (or none)."""
    d = x.shape[-1] if x.dim() else 0
    return (x.dtype == torch.float32 and x.dim() >= 1 and 0 < d <= MAX_NORM_DIM and x.numel() > 0
            and x.stride(-1) == 1
            and (weight is None or (weight.dtype == torch.float32 and weight.dim() == 1 and weight.shape[0] == d
                                    and weight.stride(0) == 1 and weight.device == x.device)))


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) [* weight] over the last dimension, in one launch."""
    x3 = _as_rows3(x)
    n_a, n_b, d = x3.shape
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    block = _next_pow2(d)
    _rms_norm_kernel[(n_a * n_b,)](
        x3, weight if weight is not None else x3, out, x3.stride(0), x3.stride(1), n_b, d, float(eps),
        HAS_W=weight is not None, BLOCK=block, INTERP=INTERPRETED, num_warps=_norm_warps(block))
    return out


def rope_supported(x: torch.Tensor, positions: torch.Tensor, n_rot: int) -> bool:
    """x [T, heads, head_dim] float32 with a contiguous last dimension, positions [T] integers
    on the same device, an even n_rot of at most head_dim."""
    return (x.dtype == torch.float32 and x.dim() == 3 and x.numel() > 0 and x.stride(-1) == 1
            and positions.dim() == 1 and positions.shape[0] == x.shape[0] and positions.device == x.device
            and positions.dtype in (torch.int32, torch.int64) and 0 < n_rot <= x.shape[-1] and n_rot % 2 == 0)


def rope(q: torch.Tensor, k: torch.Tensor | None, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         n_rot: int, neox: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q (and k) [T, heads, head_dim] rotated at `positions` [T] with the tables cos/sin
    [n_positions, n_rot/2] (contiguous, on q's device), in one launch. k must share q's
    T and head_dim."""
    t, n_qh, head_dim = q.shape
    n_kh = k.shape[1] if k is not None else 0
    qo = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    ko = torch.empty(k.shape, dtype=torch.float32, device=q.device) if k is not None else None
    block_h = min(_ROPE_BLOCK_H, _next_pow2(max(n_qh, n_kh)))
    n_q_blocks = triton.cdiv(n_qh, block_h)
    n_k_blocks = triton.cdiv(n_kh, block_h)
    kk, kko = (k, ko) if k is not None else (q, qo)  # unused when n_k_blocks == 0
    _rope_kernel[(t, n_q_blocks + n_k_blocks)](
        q, kk, qo, kko, positions, cos, sin, q.stride(0), q.stride(1), kk.stride(0), kk.stride(1),
        n_qh, n_kh, n_q_blocks, HEAD_DIM=head_dim, N_ROT=n_rot, NEOX=neox, BLOCK_H=block_h,
        BLOCK_HALF=_next_pow2(n_rot // 2), BLOCK_REST=_next_pow2(max(1, head_dim - n_rot)), INTERP=INTERPRETED,
        num_warps=4)
    return qo, ko


# ------------------------------------------------------------------------------ sm_90 check

# The variants the model families launch: norm rows of n_embd (2048..7168), of a head (64..576)
# and olmoe's full q/k projections; RoPE at the head geometries of the GQA families and MLA's
# rope part (64 of 192 or 576 dims, read as a strided slice).
AOT_NORM_DIMS = (64, 128, 512, 576, 2048, 4096, 7168, 8192)
AOT_ROPE = (  # (label, head_dim, n_rot, neox)
    ("qwen3moe", 128, 128, True), ("gpt-oss", 64, 64, True), ("mixtral", 128, 128, False),
    ("partial", 128, 64, True), ("deepseek2", 64, 64, False))


def aot_report(arch: int = 90) -> list[dict]:
    """Compiles every variant for `arch` without a GPU (Triton ships ptxas): resource usage each."""
    from triton.compiler import ASTSource

    from engine.quant.triton_aot import _target, resource_usage

    rows = []

    def compile_one(label: str, fn, sig: dict, const: dict, num_warps: int, aligned: tuple[str, ...] = ()) -> None:
        # Pointers 16-byte aligned and the `aligned` ints multiples of 16, as Triton specialises
        # them at run time (torch's allocations; rows of 16k values).
        attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
                 if name.endswith("_ptr") or name in aligned}
        src = ASTSource(fn, {**sig, **{k: "constexpr" for k in const}}, const, attrs)
        compiled = triton.compile(src, target=_target(arch), options={"num_warps": num_warps, "num_stages": 1})
        rows.append({"kernel": label, "num_warps": num_warps, "ffma": _count_ffma(compiled),
                     **resource_usage(compiled)})

    for d in AOT_NORM_DIMS:
        for has_w in (False, True):
            block = _next_pow2(d)
            sig = {"x_ptr": "*fp32", "w_ptr": "*fp32", "out_ptr": "*fp32", "stride_a": "i64", "stride_b": "i64",
                   "n_b": "i32", "D": "i32", "eps": "fp32"}
            compile_one(f"rms_norm D={d} w={int(has_w)}", _rms_norm_kernel, sig,
                        {"HAS_W": has_w, "BLOCK": block, "INTERP": False}, _norm_warps(block),
                        ("D", "stride_a", "stride_b") if d % 16 == 0 else ())
    for label, head_dim, n_rot, neox in AOT_ROPE:
        sig = {"q_ptr": "*fp32", "k_ptr": "*fp32", "qo_ptr": "*fp32", "ko_ptr": "*fp32", "pos_ptr": "*i64",
               "cos_ptr": "*fp32", "sin_ptr": "*fp32", "q_stride_t": "i32", "q_stride_h": "i32",
               "k_stride_t": "i32", "k_stride_h": "i32", "n_qh": "i32", "n_kh": "i32", "n_q_blocks": "i32"}
        # deepseek2's one k head arrives as the constant 1 (Triton's specialisation of 1)
        one_k_head = {"n_kh": 1} if label == "deepseek2" else {}
        compile_one(f"rope {label}", _rope_kernel, sig,
                    {"HEAD_DIM": head_dim, "N_ROT": n_rot, "NEOX": neox, "BLOCK_H": _ROPE_BLOCK_H,
                     "BLOCK_HALF": _next_pow2(n_rot // 2), "BLOCK_REST": _next_pow2(max(1, head_dim - n_rot)),
                     "INTERP": False, **one_k_head}, 4, ("q_stride_t", "q_stride_h", "k_stride_t", "k_stride_h"))
    return rows


def _count_ffma(compiled) -> int:
    """Fused float multiply-adds in the SASS (RoPE must have none: its products are rounded
    before the sums, as torch's separate kernels round them)."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([str(tool), "--dump-sass", f.name], capture_output=True, text=True).stdout
    return len(re.findall(r"\bFFMA\b", sass))


def main() -> None:  # pragma: no cover - run by hand or by the tests in a subprocess
    import json

    if INTERPRETED:
        raise SystemExit("unset TRITON_INTERPRET: kernels imported for the interpreter cannot be compiled")
    print(json.dumps(aot_report()))


if __name__ == "__main__":  # pragma: no cover
    main()
