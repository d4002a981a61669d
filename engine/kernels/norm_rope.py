"""Fused RMS norm and RoPE (Triton): one launch each where the torch reference takes many.

`rms_norm(x, weight, eps)`: one launch, grid over rows (tokens, or tokens x heads for the
per-head q/k norms), a whole row of up to 8192 values in one program. It replaces torch's
pow / mean / add / rsqrt / mul / mul (6 kernels) of engine/layers/norm.rms_norm.

`add_rms_norm(h, delta, weight, eps)`: a block's residual add and the norm of the sum that
the next step reads (the ffn norm after attention, the next block's attn norm or the output
norm after the FFN), one launch writing both h + delta and its normalised row. It replaces the
add and the norm's launch (7 torch kernels): per layer the decode step's two residual adds and
two norms take 2 launches instead of 4 (14 in torch; DecoderModel.run, where only the first
block's attn norm stays a plain rms_norm).

`rope(q, k, positions, cos, sin, n_rot, neox, norms, eps)`: one launch rotates q and k (grid:
tokens x blocks of heads, the q heads' blocks first); positions are read on the device, so a
captured decode graph replays it at any position. It replaces the ~9 kernels per tensor of
the torch path (engine/layers/rope._apply_rope_torch: two gathers of the table, slices, four
products, two sums, cat/stack), i.e. ~18 for q and k together. With `norms` (qwen3moe's
per-head q/k RMS norm weights) each head row is normalised in registers before it is rotated:
qwen3moe's q/k norms and RoPE take 1 launch instead of 3 (~30 torch kernels). With `store`
(the GQA families, engine/layers/rope.rope_qk_store) the same launch writes k's rotated rows
and v's rows into the layer's KV cache at the positions: the step's two stores (index_copy_ in
a decode graph) are gone too.

Exactness: the same formulas as the torch code, in float32. RMS norm:
x * rsqrt(sum(x^2) / D + eps) * w, equal up to the order of the row's sum (and rsqrt's last
bit: CUDA's rsqrtf as in torch on CUDA, 1/sqrt as in torch on CPU); add_rms_norm's sum is
one rounded float32 add, bit-identical to torch's h + delta, its norm as rms_norm's. RoPE:
a*cos - b*sin and a*sin + b*cos with each product rounded to float32 before the sum (mul_rn:
no FMA contraction), so the result is bit-identical to the torch code's; with the per-head
norms, the rotation of the normalised row is the same (the norm: squares rounded as torch's
pow(2), the mean of a power-of-two head dim an exact product), equal to norm-then-rope up to
the order of the head row's sum.

Inputs need a contiguous last dimension only (views like q.view(n, heads, hd) or
deepseek2's strided slices q[..., nope:] and kv[:, None, kv_lora:] are read in place);
outputs are new contiguous tensors, as the torch code returns, or the cache rows with `store`.

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
MAX_ROPE_NORM_DIM = 256  # per-head norms in the RoPE launch: 16 heads' rows stay in registers


def _norm_warps(block: int) -> int:
    # 16 values per thread at the larger rows; a warp for a head's 64..256 values
    return max(1, min(8, block // 512))


if triton is not None:

    @triton.jit
    def _inv_rms(ss, n, eps, INTERP: tl.constexpr):
        """rsqrt(ss / n + eps): the mean correctly rounded, as torch's (n a float32 tensor of
        ss's shape, so Triton keeps the division a tensor op), rsqrt as torch's on the device."""
        return _rsqrt(tl.div_rn(ss, n) + eps, INTERP)

    @triton.jit
    def _rsqrt(v, INTERP: tl.constexpr):
        if INTERP:
            r = 1.0 / tl.sqrt(v)  # torch's rsqrt on CPU
        else:
            r = libdevice.rsqrt(v)  # CUDA's rsqrtf, as torch's rsqrt on CUDA
        return r

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_a, stride_b, n_b, D, eps,
                         HAS_W: tl.constexpr, BLOCK: tl.constexpr, INTERP: tl.constexpr):
        """One row: x's rows are (a, b) pairs of a [A, B, D] view (B = 1 for 2-D inputs)."""
        row = tl.program_id(0).to(tl.int64)
        a, b = row // n_b, row % n_b
        offs = tl.arange(0, BLOCK)
        mask = offs < D
        x = tl.load(x_ptr + a * stride_a + b * stride_b + offs, mask=mask, other=0.0)
        # D + 0 * row: a tensor even where Triton made D = 1 a constant
        y = x * _inv_rms(tl.sum(x * x, axis=0), (D + 0 * row).to(tl.float32), eps, INTERP)
        if HAS_W:
            y = y * tl.load(w_ptr + offs, mask=mask, other=0.0)
        tl.store(out_ptr + row * D + offs, y, mask=mask)

    @triton.jit
    def _add_rms_norm_kernel(h_ptr, d_ptr, w_ptr, ho_ptr, out_ptr, stride_h, stride_d, D, eps,
                             HAS_W: tl.constexpr, BLOCK: tl.constexpr, INTERP: tl.constexpr):
        """One row: s = h + delta (stored, rounded once as torch's add), then rms_norm(s)."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < D
        s = (tl.load(h_ptr + row * stride_h + offs, mask=mask, other=0.0)
             + tl.load(d_ptr + row * stride_d + offs, mask=mask, other=0.0))
        tl.store(ho_ptr + row * D + offs, s, mask=mask)
        y = s * _inv_rms(tl.sum(s * s, axis=0), (D + 0 * row).to(tl.float32), eps, INTERP)
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
    def _head_inv_rms(ss, eps, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, INTERP: tl.constexpr):
        """_inv_rms of BLOCK_H head rows' sums of squares, as a column. A power-of-two head dim
        divides exactly as a product by its reciprocal (rounded on its own: no FMA with + eps),
        which keeps the RoPE kernel free of the FMAs of the division routine."""
        if (HEAD_DIM & (HEAD_DIM - 1)) == 0:
            r = _rsqrt(_mul(ss, 1.0 / HEAD_DIM, INTERP) + eps, INTERP)
        else:
            r = _inv_rms(ss, tl.full([BLOCK_H], HEAD_DIM, tl.float32), eps, INTERP)
        return r[:, None]

    @triton.jit
    def _rope_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, v_ptr, vo_ptr,
                     q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h, n_qh, n_kh, n_q_blocks,
                     n_k_blocks, eps, HEAD_DIM: tl.constexpr, N_ROT: tl.constexpr, NEOX: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
                     QK_NORM: tl.constexpr, STORE_KV: tl.constexpr, BLOCK_D: tl.constexpr, INTERP: tl.constexpr):
        """Token t, a block of BLOCK_H heads of q (program_id(1) < n_q_blocks), of k (the next
        n_k_blocks) or, with STORE_KV, of v (the blocks after k's); with QK_NORM each q/k head row
        is first RMS-normalised with q's or k's weight (qwen3moe). With STORE_KV, ko and vo are
        the layer's KV cache [n_ctx, n_kh, HEAD_DIM]: k's rotated rows and v's rows land in the
        cache rows at the token's position (the store of a decode step, in this launch)."""
        t = tl.program_id(0).to(tl.int64)
        hb = tl.program_id(1)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        if hb >= n_q_blocks + n_k_blocks:  # STORE_KV: v's heads copied into the cache row
            hv = ((hb - n_q_blocks - n_k_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
            d = tl.arange(0, BLOCK_D)
            vmask = (hv < n_kh)[:, None] & (d < HEAD_DIM)[None, :]
            rows = tl.load(v_ptr + t * v_stride_t + hv[:, None] * v_stride_h + d[None, :], mask=vmask, other=0.0)
            tl.store(vo_ptr + (pos * n_kh + hv[:, None]) * HEAD_DIM + d[None, :], rows, mask=vmask)
        else:
            _rope_rows(q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, q_stride_t, q_stride_h,
                       k_stride_t, k_stride_h, n_qh, n_kh, n_q_blocks, eps, t, hb, pos, HEAD_DIM, N_ROT, NEOX,
                       BLOCK_H, BLOCK_HALF, BLOCK_REST, QK_NORM, STORE_KV, INTERP)

    @triton.jit
    def _rope_rows(q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, q_stride_t, q_stride_h,
                   k_stride_t, k_stride_h, n_qh, n_kh, n_q_blocks, eps, t, hb, pos, HEAD_DIM: tl.constexpr,
                   N_ROT: tl.constexpr, NEOX: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                   BLOCK_REST: tl.constexpr, QK_NORM: tl.constexpr, STORE_KV: tl.constexpr, INTERP: tl.constexpr):
        """_rope_kernel's q and k blocks: the rotated (normalised) head rows, q's at row t of qo,
        k's at row t of ko, or at the position's row of the cache with STORE_KV."""
        # Triton specialises an int argument of 1 as a constant (one k head: deepseek2's k_pe) and
        # multiples of 16 as aligned (so the loads vectorise); adding a zero tensor makes both
        # branches of the q/k choice int32 tensors while keeping that alignment.
        zero = hb * 0
        if hb < n_q_blocks:
            src, dst, wn, h0, row = q_ptr, qo_ptr, qn_ptr, hb * BLOCK_H, t
            st, sh, nh = q_stride_t + zero, q_stride_h + zero, n_qh + zero
        else:
            src, dst, wn, h0, row = k_ptr, ko_ptr, kn_ptr, (hb - n_q_blocks) * BLOCK_H, pos if STORE_KV else t
            st, sh, nh = k_stride_t + zero, k_stride_h + zero, n_kh + zero
        HALF: tl.constexpr = N_ROT // 2
        i = tl.arange(0, BLOCK_HALF)
        imask = i < HALF
        c = tl.load(cos_ptr + pos * HALF + i, mask=imask, other=0.0)[None, :]
        s = tl.load(sin_ptr + pos * HALF + i, mask=imask, other=0.0)[None, :]
        h = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)
        hmask = h < nh
        src_row = src + t * st + h[:, None] * sh
        dst_row = dst + (row * nh + h[:, None]) * HEAD_DIM
        jr = N_ROT + tl.arange(0, BLOCK_REST)  # dims past n_rot: they pass through (normalised)
        rmask = hmask[:, None] & (jr < HEAD_DIM)[None, :]
        if N_ROT < HEAD_DIM:
            rest = tl.load(src_row + jr[None, :], mask=rmask, other=0.0)
        if NEOX:  # (i, i + n_rot/2): two contiguous halves
            mask = hmask[:, None] & imask[None, :]
            a = tl.load(src_row + i[None, :], mask=mask, other=0.0)
            b = tl.load(src_row + HALF + i[None, :], mask=mask, other=0.0)
            if QK_NORM:  # rms_norm of the head row: x * rsqrt(mean(x^2) + eps) * w, as the torch code
                # squares rounded, as torch's pow(2), and the kernel keeps no FMA (see _mul)
                ss = tl.sum(_mul(a, a, INTERP), axis=1) + tl.sum(_mul(b, b, INTERP), axis=1)
                if N_ROT < HEAD_DIM:
                    ss += tl.sum(_mul(rest, rest, INTERP), axis=1)
                r = _head_inv_rms(ss, eps, HEAD_DIM, BLOCK_H, INTERP)
                a = a * r * tl.load(wn + i, mask=imask, other=0.0)[None, :]
                b = b * r * tl.load(wn + HALF + i, mask=imask, other=0.0)[None, :]
                if N_ROT < HEAD_DIM:
                    rest = rest * r * tl.load(wn + jr, mask=jr < HEAD_DIM, other=0.0)[None, :]
            tl.store(dst_row + i[None, :], _mul(a, c, INTERP) - _mul(b, s, INTERP), mask=mask)
            tl.store(dst_row + HALF + i[None, :], _mul(a, s, INTERP) + _mul(b, c, INTERP), mask=mask)
        else:  # (2i, 2i + 1): the rotated dims loaded contiguously, split into pairs in registers
            j = tl.arange(0, 2 * BLOCK_HALF)
            mask = hmask[:, None] & (j < N_ROT)[None, :]
            x = tl.load(src_row + j[None, :], mask=mask, other=0.0)
            if QK_NORM:
                ss = tl.sum(_mul(x, x, INTERP), axis=1)
                if N_ROT < HEAD_DIM:
                    ss += tl.sum(_mul(rest, rest, INTERP), axis=1)
                r = _head_inv_rms(ss, eps, HEAD_DIM, BLOCK_H, INTERP)
                # the weight in x's own layout (its rows repeated; cached), so the load is 16-byte wide
                x = x * r * tl.load(wn + j[None, :] + 0 * h[:, None], mask=mask, other=0.0)
                if N_ROT < HEAD_DIM:
                    rest = rest * r * tl.load(wn + jr, mask=jr < HEAD_DIM, other=0.0)[None, :]
            a, b = tl.split(tl.reshape(x, (BLOCK_H, BLOCK_HALF, 2)))
            y = tl.join(_mul(a, c, INTERP) - _mul(b, s, INTERP), _mul(a, s, INTERP) + _mul(b, c, INTERP))
            tl.store(dst_row + j[None, :], tl.reshape(y, (BLOCK_H, 2 * BLOCK_HALF)), mask=mask)
        if N_ROT < HEAD_DIM:
            tl.store(dst_row + jr[None, :], rest, mask=rmask)


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
    block = triton.next_power_of_2(d)
    _rms_norm_kernel[(n_a * n_b,)](
        x3, weight if weight is not None else x3, out, x3.stride(0), x3.stride(1), n_b, d, float(eps),
        HAS_W=weight is not None, BLOCK=block, INTERP=INTERPRETED, num_warps=_norm_warps(block))
    return out


def add_norm_supported(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """add_rms_norm's shapes: h and delta [T, D] alike, float32, contiguous rows (any row stride),
    D and the weight as norm_supported takes them."""
    return (h.dim() == 2 and delta.shape == h.shape and delta.dtype == torch.float32 and delta.stride(-1) == 1
            and delta.device == h.device and norm_supported(h, weight))


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor | None,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, rms_norm(h + delta)) in one launch, both new contiguous [T, D] tensors."""
    n, d = h.shape
    h_new = torch.empty(h.shape, dtype=torch.float32, device=h.device)
    out = torch.empty(h.shape, dtype=torch.float32, device=h.device)
    block = triton.next_power_of_2(d)
    _add_rms_norm_kernel[(n,)](
        h, delta, weight if weight is not None else h, h_new, out, h.stride(0), delta.stride(0), d, float(eps),
        HAS_W=weight is not None, BLOCK=block, INTERP=INTERPRETED, num_warps=_norm_warps(block))
    return h_new, out


def rope_supported(x: torch.Tensor, positions: torch.Tensor, n_rot: int) -> bool:
    """x [T, heads, head_dim] float32 with a contiguous last dimension, positions [T] integers
    on the same device, an even n_rot of at most head_dim."""
    return (x.dtype == torch.float32 and x.dim() == 3 and x.numel() > 0 and x.stride(-1) == 1
            and positions.dim() == 1 and positions.shape[0] == x.shape[0] and positions.device == x.device
            and positions.dtype in (torch.int32, torch.int64) and 0 < n_rot <= x.shape[-1] and n_rot % 2 == 0)


def rope_norm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """A per-head norm weight the RoPE launch can apply to x [T, heads, head_dim]: float32,
    contiguous, head_dim long, head_dim at most MAX_ROPE_NORM_DIM."""
    return (weight.dtype == torch.float32 and weight.dim() == 1 and weight.shape[0] == x.shape[-1]
            and weight.stride(0) == 1 and weight.device == x.device and x.shape[-1] <= MAX_ROPE_NORM_DIM)


def store_supported(k: torch.Tensor, store: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> bool:
    """Whether the RoPE launch can also store the step's k and v [T, heads, head_dim] into a
    layer's KV cache [n_ctx, heads, head_dim] (`store`: rope's (k_cache, v, v_cache); float32,
    contiguous caches; v's head dim is k's)."""
    k_cache, v, v_cache = store
    return (v.dtype == torch.float32 and v.dim() == 3 and v.stride(-1) == 1 and v.shape == k.shape
            and all(c.dtype == torch.float32 and c.is_contiguous() and c.shape[1:] == k.shape[1:]
                    and c.device == k.device for c in (k_cache, v_cache)))


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         n_rot: int, neox: bool, norms: tuple[torch.Tensor, torch.Tensor | None] | None = None,
         eps: float = 0.0,
         store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k [T, heads, head_dim] rotated at `positions` [T] with the tables cos/sin
    [n_positions, n_rot/2] (contiguous, on q's device), in one launch. k must share q's
    T and head_dim. `norms` (q's and k's weights, [head_dim] each): each head row is
    RMS-normalised with its weight and `eps` before it is rotated, in the same launch.
    `store` (k_cache, v, v_cache; store_supported): the rotated k rows and v's rows are written
    into the caches' rows at `positions` instead, and k_cache comes back in k's place."""
    t, n_qh, head_dim = q.shape
    n_kh = k.shape[1]
    qo = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    if store is None:
        ko = torch.empty(k.shape, dtype=torch.float32, device=q.device)
        v, vo = q, q  # unused without STORE_KV
    else:
        ko, v, vo = store
    block_h = min(_ROPE_BLOCK_H, triton.next_power_of_2(max(n_qh, n_kh)))
    n_q_blocks = triton.cdiv(n_qh, block_h)
    n_k_blocks = triton.cdiv(n_kh, block_h)
    qn, kn = norms if norms is not None else (q, q)  # unused without QK_NORM
    kn = kn if kn is not None else qn
    _rope_kernel[(t, n_q_blocks + n_k_blocks * (1 if store is None else 2))](
        q, k, qo, ko, positions, cos, sin, qn, kn, v, vo, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), n_qh, n_kh, n_q_blocks, n_k_blocks, float(eps), HEAD_DIM=head_dim, N_ROT=n_rot,
        NEOX=neox, BLOCK_H=block_h, BLOCK_HALF=triton.next_power_of_2(n_rot // 2),
        BLOCK_REST=triton.next_power_of_2(max(1, head_dim - n_rot)), QK_NORM=norms is not None,
        STORE_KV=store is not None, BLOCK_D=triton.next_power_of_2(head_dim), INTERP=INTERPRETED, num_warps=4)
    return qo, ko


# ------------------------------------------------------------------------------ sm_90 check

# The variants the model families launch: norm rows of n_embd (2048..7168), of a head (64..576)
# and olmoe's full q/k projections; RoPE at the head geometries of the GQA families and MLA's
# rope part (64 of 192 or 576 dims, read as a strided slice).
AOT_NORM_DIMS = (64, 128, 512, 576, 2048, 4096, 7168, 8192)
AOT_ADD_NORM_DIMS = (2048, 2880, 4096, 7168)  # the residual adds fused with the next norm: n_embd
AOT_ROPE = (  # (label, head_dim, n_rot, neox, per-head q/k norm)
    ("qwen3moe", 128, 128, True, True), ("neox", 128, 128, True, False), ("gpt-oss", 64, 64, True, False),
    ("mixtral", 128, 128, False, False), ("partial", 128, 64, True, False), ("partial+norm", 128, 64, True, True),
    ("normal+norm", 128, 128, False, True), ("deepseek2", 64, 64, False, False))


def aot_report(arch: int = 90) -> list[dict]:
    """Compiles every variant for `arch` without a GPU (Triton ships ptxas): resource usage each."""
    from functools import partial

    from engine.quant.triton_aot import compile_for, in_parallel, resource_usage

    jobs = []

    def row(label: str, fn, sig: dict, const: dict, num_warps: int, aligned: tuple[str, ...]) -> dict:
        # the `aligned` ints multiples of 16, as Triton specialises them at run time (rows of 16k values)
        compiled = compile_for(fn, sig, const, set(aligned), num_warps=num_warps, arch=arch)
        return {"kernel": label, "num_warps": num_warps, "ffma": _count_ffma(compiled), **resource_usage(compiled)}

    def compile_later(label: str, fn, sig: dict, const: dict, num_warps: int, aligned: tuple[str, ...] = ()) -> None:
        jobs.append(partial(row, label, fn, sig, const, num_warps, aligned))

    for d in AOT_NORM_DIMS:
        for has_w in (False, True):
            block = triton.next_power_of_2(d)
            sig = {"x_ptr": "*fp32", "w_ptr": "*fp32", "out_ptr": "*fp32", "stride_a": "i64", "stride_b": "i64",
                   "n_b": "i32", "D": "i32", "eps": "fp32"}
            compile_later(f"rms_norm D={d} w={int(has_w)}", _rms_norm_kernel, sig,
                          {"HAS_W": has_w, "BLOCK": block, "INTERP": False}, _norm_warps(block),
                          ("D", "stride_a", "stride_b") if d % 16 == 0 else ())
    for d in AOT_ADD_NORM_DIMS:
        block = triton.next_power_of_2(d)
        sig = {"h_ptr": "*fp32", "d_ptr": "*fp32", "w_ptr": "*fp32", "ho_ptr": "*fp32", "out_ptr": "*fp32",
               "stride_h": "i64", "stride_d": "i64", "D": "i32", "eps": "fp32"}
        compile_later(f"add_rms_norm D={d}", _add_rms_norm_kernel, sig,
                      {"HAS_W": True, "BLOCK": block, "INTERP": False}, _norm_warps(block),
                      ("D", "stride_h", "stride_d") if d % 16 == 0 else ())
    for label, head_dim, n_rot, neox, qk_norm in AOT_ROPE:
        sig = {"q_ptr": "*fp32", "k_ptr": "*fp32", "qo_ptr": "*fp32", "ko_ptr": "*fp32", "pos_ptr": "*i64",
               "cos_ptr": "*fp32", "sin_ptr": "*fp32", "qn_ptr": "*fp32", "kn_ptr": "*fp32", "v_ptr": "*fp32",
               "vo_ptr": "*fp32", "q_stride_t": "i32", "q_stride_h": "i32", "k_stride_t": "i32",
               "k_stride_h": "i32", "v_stride_t": "i32", "v_stride_h": "i32", "n_qh": "i32", "n_kh": "i32",
               "n_q_blocks": "i32", "n_k_blocks": "i32", "eps": "fp32"}
        # deepseek2's one k head arrives as the constant 1 (Triton's specialisation of 1)
        one_k_head = {"n_kh": 1} if label == "deepseek2" else {}
        # the GQA families store k and v in the launch (head dims alike); MLA's rope part does not
        for store in (False, True) if label != "deepseek2" else (False,):
            compile_later(f"rope {label}{' +kv' if store else ''}", _rope_kernel, sig,
                          {"HEAD_DIM": head_dim, "N_ROT": n_rot, "NEOX": neox, "BLOCK_H": _ROPE_BLOCK_H,
                           "BLOCK_HALF": triton.next_power_of_2(n_rot // 2),
                           "BLOCK_REST": triton.next_power_of_2(max(1, head_dim - n_rot)), "QK_NORM": qk_norm,
                           "STORE_KV": store, "BLOCK_D": triton.next_power_of_2(head_dim), "INTERP": False,
                           **one_k_head}, 4,
                          ("q_stride_t", "q_stride_h", "k_stride_t", "k_stride_h", "v_stride_t", "v_stride_h"))
    return in_parallel(jobs)


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
