"""Decode kernels (Triton) that read weights in their GGUF bytes: fused expert kernels over slot
buffers, and the dense product of up to 8 rows (`dense`, see "dense products" below).

The work item is a *pair* (token row t, top-k position j) whose expert lives in slot `slot` of
a layer's slot buffers (engine/moe/slots.LayerSlots.buffers: gate, up and down as uint8
[n_slots, rows, row_bytes], each row a run of GGUF blocks; Q6_K blocks padded to 224 bytes,
engine/quant/layout.py). Three launches per batch of pairs
(the hybrid executor sends one batch for its hits, one for its uploads; no Python per expert):

0. `_round_rows_kernel`, grid (tokens, K / 256): the activation rows rounded as
   engine/quant/activation.round_activation rounds them for the gate/up type (values; for Q8_K
   also the int8 quants and per-256 scales), zero-padded to whole K steps.
1. `_gate_up_kernel`, grid (pairs, n_ff / BLOCK_N, split): the gate and up rows of the pair's
   expert against the token's rounded activation, biases, the activation function (SiLU, or
   gpt-oss's SWIGLU_OAI) -> h [pairs, n_ff]; the last program to finish of each 256 values of a
   pair's h (a semaphore) then rounds them for the down type. A launch of few pairs (one token's
   8: 192 programs of 32 rows for 132 SMs) splits its K steps over `split` programs (SplitK),
   whose partial sums the last of them adds, in order, before the activation. One token's Q4_K,
   Q5_K, padded Q6_K and planar MXFP4 pairs take `_gate_up_k4_kernel` instead (the same grid and
   results; lanes along K).
2. `_down_kernel`, grid (pairs, n_embd / BLOCK_N): the rounded h against the down rows, plus
   bias, times the routing weight, stored straight into the executor's per_slot[j, t, :].

On sm_90 and later gate/up (after the step's own rounding) and down are programmatic dependent
launches (dependent_launches): each starts while the launch before it ends, loading the pair
tables and its first weights, and waits for that launch's results (gdc_wait) before it reads them.

A dense product (attention projections, output head, shared experts at decode) is two
launches: `_round_rows_kernel`, then `_dense_kernel` (or, for 16-bit and laid-out weights, a
kernel with lanes along K: `dense_tile`), grid (n_out / BLOCK_N, split): each program a block of
weight rows times a slice of the K steps against every activation row, the slices' partial sums
added by the last program of each row block (SplitK); the product is a dependent launch as gate/up is.

Exactness: the rounding is bit-exact with round_activation (correctly rounded divisions,
half-to-even); weights decode with dequant.py's arithmetic; products are summed in float32
(Q4_K/Q5_K: exact int32 sums of quant products, scaled in float32). Results equal
`engine.layers.moe.expert_ffn` up to float32 summation order and rounding.

Rounding needs block-wide maxima (cross-thread reductions, CTA barriers), so it stays out of
the weight loops; those only load, decode and multiply. The tile and the memory access pattern
are described at "weight tiles" below.

`TRITON_INTERPRET=1` (set before this module is imported) runs the same kernels on CPU
tensors through Triton's interpreter: the tests use it where there is no GPU.
"""
from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType as QT

from engine.quant.layout import is_padded_q6_k, is_planar

try:  # Triton is optional: without it the torch path runs.
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Weight types these kernels decode (their GGUF type ids are the kernels' QT constexpr).
KERNEL_TYPES: frozenset[QT] = frozenset({QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q8_0, QT.MXFP4, QT.F16, QT.BF16})
KSTEP = 256  # activation values per K step
# Kernel type id of Q6_K rows whose blocks are padded from 210 to 224 bytes (layout.pad_q6_k):
# every block 16-aligned, so the kernels load them 16 bytes at a time instead of 2.
Q6_K_PADDED = 256 + int(QT.Q6_K)
# Kernel type ids of planar MXFP4 and Q8_0 rows (layout.planar): every block's quants (16 nibble
# bytes, 32 int8) 16-aligned, its scale in a run of scales after them, so the kernels load 16
# bytes at a time instead of 1 or 2.
MXFP4_PLANAR = 256 + int(QT.MXFP4)
Q8_0_PLANAR = 256 + int(QT.Q8_0)
# Vec-dot type id of activations rounded to Q8_0 for MXFP4 weights in the decode kernels: each
# block's int8 quants in the order of the weights' nibbles (_e2m1_dot), the values as Q8_0's.
Q8_0_NIBBLES = 512 + int(QT.Q8_0)
# The kernel type id of each type's rows in layout.kernel_layout's layout.
LAID_OUT_TYPES: dict[QT, int] = {QT.Q6_K: Q6_K_PADDED, QT.MXFP4: MXFP4_PLANAR, QT.Q8_0: Q8_0_PLANAR}


def available() -> bool:
    return triton is not None


if triton is not None:
    _Q4_K = tl.constexpr(int(QT.Q4_K))
    _Q5_K = tl.constexpr(int(QT.Q5_K))
    _Q6_K = tl.constexpr(int(QT.Q6_K))
    _Q6_K_PADDED = tl.constexpr(Q6_K_PADDED)
    _Q8_0 = tl.constexpr(int(QT.Q8_0))
    _Q8_0_PLANAR = tl.constexpr(Q8_0_PLANAR)
    _Q8_0_NIBBLES = tl.constexpr(Q8_0_NIBBLES)
    _MXFP4 = tl.constexpr(int(QT.MXFP4))
    _MXFP4_PLANAR = tl.constexpr(MXFP4_PLANAR)
    _F16 = tl.constexpr(int(QT.F16))
    _BF16 = tl.constexpr(int(QT.BF16))
    _Q8_K = tl.constexpr(int(QT.Q8_K))

    # ---------------------------------------------------------------- activation rounding
    # Rounding needs block-wide maxima, i.e. cross-thread reductions and CTA barriers. They
    # are kept out of the weight loops (barriers would stop the compiler from issuing the
    # weight loads early): x is rounded by _round_rows_kernel, h by the last program of each
    # pair's K step of it in _gate_up_kernel; the weight loops then only load rounded values.

    @triton.jit
    def _rint(v, INTERP: tl.constexpr):
        """Round half to even (ggml's nearest_int / _mm256_round_ps)."""
        if INTERP:
            r = (v + 12582912.0) - 12582912.0  # exact for |v| < 2^22; numpy does not contract
        else:
            r = libdevice.rint(v)
        return r

    @triton.jit
    def _q8_k(v, INTERP: tl.constexpr):
        """quantize_row_q8_K_ref for one block of 256 values: (quants as float, scale d, and
        whether the block is all zero); round_activation's value is where(zero, 0, d * q)."""
        iv = tl.arange(0, 256)
        av = tl.abs(v)
        amax = tl.max(av)
        # The first value of largest magnitude (the reference loop's strict `>`), signed.
        idx = tl.min(tl.where(av == amax, iv, 1 << 20))
        vmax = tl.sum(tl.where(iv == idx, v, 0.0))
        zero = vmax == 0.0
        iscale = tl.math.div_rn(tl.full((), -127.0, tl.float32), tl.where(zero, 1.0, vmax))
        d = tl.math.div_rn(tl.full((), 1.0, tl.float32), iscale)
        q = tl.minimum(_rint(iscale * v, INTERP), 127.0)
        return q, d, zero

    @triton.jit
    def _q8_0(v, INTERP: tl.constexpr):
        """Q8_0 (ggml's x86 recipe) for blocks of 32 along axis 1 of v [n, 32]: the quants (as
        float) and each block's scale, fp16-rounded; round_activation's value is d * q."""
        amax = tl.max(tl.abs(v), axis=1)
        c127 = tl.zeros_like(amax) + 127.0
        d = tl.math.div_rn(amax, c127)
        inv = tl.where(amax != 0.0, tl.math.div_rn(c127, tl.where(amax != 0.0, amax, 1.0)), 0.0)
        return _rint(v * inv[:, None], INTERP), d.to(tl.float16).to(tl.float32)

    @triton.jit
    def _bf16_round(v):
        """float32 -> bfloat16 -> float32, round half to even (torch's conversion; finite v).
        In integers: Triton's interpreter truncates in its own bf16 conversion."""
        bits = v.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return ((bits >> 16) << 16).to(tl.float32, bitcast=True)

    @triton.jit
    def _nibble_position(j):
        """Where value j of a block of 32 goes in Q8_0_NIBBLES' order: byte b of word 4h + l
        holds the value of nibble b of half h of MXFP4 quant word l (_e2m1_dot), i.e. byte
        4l + 2h + b // 2's low nibble (value 4l + 2h + b // 2) for even b, its high one (16 on)
        for odd b."""
        return ((j % 4) // 2) * 16 + ((j % 16) // 4) * 4 + (j % 2) * 2 + j // 16

    @triton.jit
    def _round_chunk(src, dst, dst_q, dst_d, dst_s, c, K: tl.constexpr, VT: tl.constexpr, INTERP: tl.constexpr,
                     SUMS: tl.constexpr):
        """dst[256c : 256c + 256] = round_activation(src[...]) for vec-dot type VT (a GGUF
        type id: Q8_K, Q8_0, F16, BF16; Q8_0_NIBBLES; anything else copies). For Q8_K and Q8_0 also
        the int8 quants (dst_q, same positions; Q8_0_NIBBLES: each block's in MXFP4's nibble order,
        _nibble_position) and the scales: Q8_K's at dst_d[8c] (0 for an all-zero block), Q8_0's at
        dst_d[8c + b] for its blocks b; with SUMS, Q8_K's quants summed per 32 at dst_s[8c + b]
        (int32: the grouped GEMM's K-quant min terms). dst rows are padded to whole K steps:
        positions from K on receive zeros."""
        if VT == _Q8_K:
            i = c * 256 + tl.arange(0, 256)
            q, d, zero = _q8_k(tl.load(src + i, cache_modifier=".cg"), INTERP)
            tl.store(dst + i, tl.where(zero, 0.0, d * q))
            tl.store(dst_q + i, q.to(tl.int8))
            tl.store(dst_d + c * 8, tl.where(zero, 0.0, d))
            if SUMS:
                tl.store(dst_s + c * 8 + tl.arange(0, 8), tl.sum(tl.reshape(q, (8, 32)), axis=1).to(tl.int32))
        elif VT == _Q8_0 or VT == _Q8_0_NIBBLES:
            j = tl.arange(0, 32)[None, :]
            i = c * 256 + tl.arange(0, 8)[:, None] * 32 + j
            v = tl.load(src + i, mask=i < K, other=0.0, cache_modifier=".cg")
            q, d = _q8_0(v, INTERP)
            tl.store(dst + i, d[:, None] * q)  # zeros into the padding up to the K step
            if VT == _Q8_0_NIBBLES:
                tl.store(dst_q + i - j + _nibble_position(j), q.to(tl.int8))
            else:
                tl.store(dst_q + i, q.to(tl.int8))
            tl.store(dst_d + c * 8 + tl.arange(0, 8), d)
        else:
            i = c * 256 + tl.arange(0, 256)
            v = tl.load(src + i, mask=i < K, other=0.0, cache_modifier=".cg")
            if VT == _F16:
                v = v.to(tl.float16).to(tl.float32)
            elif VT == _BF16:
                v = _bf16_round(v)
            tl.store(dst + i, v)

    @triton.jit
    def _round_row_step(x_ptr, x_stride, out_ptr, q_ptr, d_ptr, s_ptr, r, c, K: tl.constexpr, VT: tl.constexpr,
                        INTERP: tl.constexpr, SUMS: tl.constexpr):
        """K step c of row r rounded (_round_chunk) into rows padded to KP = 256 * ceil(K / 256)."""
        r64 = r.to(tl.int64)
        KP: tl.constexpr = (K + 255) // 256 * 256
        _round_chunk(x_ptr + r64 * x_stride, out_ptr + r64 * KP, q_ptr + r64 * KP, d_ptr + r64 * (KP // 32),
                     s_ptr + r64 * (KP // 32), c, K, VT, INTERP, SUMS)

    @triton.jit
    def _round_rows_kernel(x_ptr, x_stride, out_ptr, q_ptr, d_ptr, s_ptr, K: tl.constexpr, VT: tl.constexpr,
                           INTERP: tl.constexpr, SUMS: tl.constexpr, PDL: tl.constexpr):
        """Grid (rows, KP / 256): out[row] = round_activation(x[row]), zero-padded to KP, the
        next multiple of 256 (for Q8_K and Q8_0 also q [rows, KP] int8 and d [rows, KP / 32];
        for Q8_K with SUMS also s [rows, KP / 32], the quants' sums per 32). With PDL a
        dependent launch after it (see dependent_launches) may start at once."""
        if PDL:
            gdc_launch_dependents()
        _round_row_step(x_ptr, x_stride, out_ptr, q_ptr, d_ptr, s_ptr, tl.program_id(0), tl.program_id(1), K, VT,
                        INTERP, SUMS)

    # ---------------------------------------------------------------- weight tiles
    # A K step (256 activation values) of one program is a tile [2 (p), BLOCK_N (r), C, S, E]:
    # each of BLOCK_N rows gets two lanes (p), which read adjacent runs of the row's bytes of
    # that step (so a row's two lanes cover whole 32-byte sectors, and 16 rows fill a warp);
    # a lane holds C runs, each S vector accesses of E elements (16-byte runs of K-quants as
    # 4 words; 2-aligned Q6_K and Q8_0 as int16 pairs; 1-aligned MXFP4 as bytes; F16 as 8s).
    # Every tensor of a step (quants, block headers, activation values) is built at that full
    # shape, headers and activations with zero strides where they do not vary: Triton's
    # coalescing pass then gives all of them one layout (it takes the widest access among
    # memory ops of one shape) with the runs inside a lane, so nothing moves through shared
    # memory, repeated addresses fold into one load, and scales are picked out of a header
    # run by a select-and-sum whose positions are compile-time constants (a register read).
    #
    # The K-quants, Q8_0 and MXFP4 multiply in integers, as ggml does: quants are masked out
    # of whole 32-bit words (Q4_K/Q5_K nibbles and fifth bits, Q6_K nibbles and top bits,
    # MXFP4 nibbles mapped to int8 by a prmt table lookup) and dotted with the activation's
    # int8 quants (Q8_K or Q8_0, from the rounding kernels) by dp4a, four products per
    # instruction; each group of values that shares scales then adds
    #   dx * (d * sc * sum(q * qx) - dmin * m * sum(qx))
    # exact integer sums scaled in float32: the reference's value up to float rounding.
    # F16 and BF16 multiply floats. The next step's bytes are loaded while the current step
    # is computed (register double buffering); partial sums are reduced once, at the end.

    @triton.jit
    def _axes(BLOCK_N: tl.constexpr, QT: tl.constexpr):
        """Index tensors of the step tile [2 (p), BLOCK_N (r), C (c), S, E]: position l = S-index *
        E + E-index within a run, E elements per vector access. The order of the axes matters:
        Triton lays lanes over the contiguous E axis, then p, then rows (the other axes have
        no contiguity and go in index order), so c and S stay inside a lane: a lane holds whole
        runs, and picks and sums along a run need no other lane."""
        p = tl.arange(0, 2)[:, None, None, None, None]
        r = tl.arange(0, BLOCK_N)[None, :, None, None, None]
        if QT == _F16 or QT == _BF16:
            c = tl.arange(0, 8)[None, None, :, None, None]
            l = tl.arange(0, 2)[None, None, None, :, None] * 8 + tl.arange(0, 8)[None, None, None, None, :]
        else:
            c = tl.arange(0, 4)[None, None, :, None, None]
            if QT == _Q8_0:  # a block's 16 int16 (2-aligned): 8 words of 2 halves
                l = tl.arange(0, 8)[None, None, None, :, None] * 2 + tl.arange(0, 2)[None, None, None, None, :]
            elif QT == _Q6_K:  # a 16-byte run as 8 int16 (2-aligned): 4 words of 2 halves
                l = tl.arange(0, 4)[None, None, None, :, None] * 2 + tl.arange(0, 2)[None, None, None, None, :]
            elif QT == _MXFP4:  # a block's 16 quant bytes (1-aligned): 4 words of 4 bytes
                l = tl.arange(0, 4)[None, None, None, :, None] * 4 + tl.arange(0, 4)[None, None, None, None, :]
            else:  # Q4_K, Q5_K, padded Q6_K, planar MXFP4 and Q8_0: a 16-byte run as 4 words
                l = tl.arange(0, 1)[None, None, None, :, None] * 4 + tl.arange(0, 4)[None, None, None, None, :]
        return p, r, c, l

    @triton.jit
    def _zero_acc(BLOCK_N: tl.constexpr, QT: tl.constexpr):
        if QT == _F16 or QT == _BF16:
            acc = tl.zeros((2, BLOCK_N, 8), tl.float32)
        else:
            acc = tl.zeros((2, BLOCK_N, 4), tl.float32)
        return acc

    @triton.jit
    def _reduce_acc(acc):
        return tl.sum(tl.sum(acc, axis=2), axis=0)

    @triton.jit
    def _runsum(v):
        """Sum along the runs (the last two axes), inside each lane."""
        return tl.sum(tl.sum(v, axis=4), axis=3)

    @triton.jit
    def _ld(ptr, REV: tl.constexpr, mask=None, other=None):
        """tl.load of a step tile. Triton orders a load's dimensions of equal contiguity by
        index, ascending up to 3.6 and descending in later releases: with REV the load is
        issued on the tile permuted to [c, s, r, p, e], so that either way the lanes go to
        p and r and the runs stay inside a lane; the result is permuted back (a relabeling)."""
        if REV:
            q = tl.permute(ptr, (2, 3, 1, 0, 4))
            if mask is None:
                v = tl.load(q)
            else:
                v = tl.load(q, mask=tl.permute(mask, (2, 3, 1, 0, 4)), other=other)
            v = tl.permute(v, (3, 2, 0, 1, 4))
        else:
            v = tl.load(ptr, mask=mask, other=other)
        return v

    @triton.jit
    def _pick(run, l, k):
        """Element k (compile-time per run) of int32 runs: a select-and-sum that folds to a
        register read."""
        return _runsum(tl.where(l == k, run, 0))

    @triton.jit
    def _pick_i8(halves, l, k):
        """Signed byte k (compile-time per run) of runs held as int16 elements (in int32)."""
        v = _pick((halves >> ((k % 2) * 8)) & 255, l, k // 2)
        return v - ((v & 128) << 1)

    @triton.jit
    def _f16_bits(bits):
        return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _word_byte(words, l, k):
        """Byte k of 16-byte runs held as four little-endian int32 words."""
        return _pick((words >> ((k % 4) * 8)) & 255, l, k // 4)

    @triton.jit
    def _word_i8(words, l, k):
        """Signed byte k (compile-time per run) of 16-byte runs held as four int32 words."""
        v = _word_byte(words, l, k)
        return v - ((v & 128) << 1)

    @triton.jit
    def _dp4a(a, b, INTERP: tl.constexpr, SIGNED_A: tl.constexpr = False, acc=None):
        """sum over the 4 bytes of a[k] * b[k], b signed, a unsigned or signed (PTX dp4a), plus acc
        where given."""
        if INTERP:
            s = a * 0 if acc is None else acc
            for k in tl.static_range(4):
                ak = (a >> (8 * k)) & 255
                bk = (b >> (8 * k)) & 255
                if SIGNED_A:
                    ak = ak - ((ak & 128) << 1)
                s += ak * (bk - ((bk & 128) << 1))
        elif acc is not None:
            s = tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;" if SIGNED_A else
                                          "dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, acc], dtype=tl.int32,
                                          is_pure=True, pack=1)
        elif SIGNED_A:
            s = tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, 0;", "=r,r,r", [a, b], dtype=tl.int32,
                                          is_pure=True, pack=1)
        else:
            s = tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, 0;", "=r,r,r", [a, b], dtype=tl.int32,
                                          is_pure=True, pack=1)
        return s

    @triton.jit
    def _prmt(a, b, sel, INTERP: tl.constexpr):
        """PTX prmt.b32 (default mode): byte k of the result is byte sel[k] & 7 of the 8 bytes b:a
        (a = bytes 0..3), or where sel[k]'s msb is set that byte's sign replicated (0 or 255)."""
        if INTERP:
            out = sel * 0
            for k in tl.static_range(4):
                s = (sel >> (4 * k)) & 15
                i = s & 7
                src = tl.where(i < 4, a >> ((i & 3) * 8), b >> ((i & 3) * 8)) & 255
                src = tl.where(s > 7, ((src >> 7) & 1) * 255, src)
                out = out | (src << (8 * k))
        else:
            out = tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, sel], dtype=tl.int32,
                                            is_pure=True, pack=1)
        return out

    @triton.jit
    def _words(v, E: tl.constexpr):
        """int32 words from runs of E = 2 (int16) or 4 (bytes) parts along the last axis."""
        e = tl.arange(0, E)[None, None, None, None, :]
        v32 = v.to(tl.int32)
        if E == 2:
            parts = tl.where(e == 0, v32 & 0xFFFF, v32 << 16)
        else:
            parts = (v32 & 255) << (e * 8)
        return tl.sum(parts, axis=4)

    @triton.jit
    def _e8m0_half(e):
        """MXFP4's block scale from its e8m0 byte `e` (int32), halved as ggml_e8m0_to_fp32_half halves it
        for the doubled e2m1 values: 2^(e - 128), subnormal for e < 2."""
        return tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _e2m1_lookup(sel, INTERP: tl.constexpr):
        """MXFP4's doubled e2m1 values (0, 1, 2, 3, 4, 6, 8, 12) and their negatives at the 4 nibbles of
        prmt selector `sel`, each a magnitude's 3 bits (msb clear: prmt would replicate a byte's sign
        there): two words of packed int8."""
        z = sel * 0
        return (_prmt(z + 0x03020100, z + 0x0C080604, sel, INTERP),
                _prmt(z - 33620224, z - 185009412, sel, INTERP))  # 0xFDFEFF00, 0xF4F8FAFC: -0 .. -12

    @triton.jit
    def _e2m1_low(w, INTERP: tl.constexpr):
        """The low nibbles of the 4 bytes of w as MXFP4's doubled e2m1 values, packed int8, chosen
        per byte by bit 3 (the grouped GEMM's decode, a value per element)."""
        x3 = w & 0x07070707
        y = (x3 | (x3 >> 4)) & 0x00FF00FF
        pos, neg = _e2m1_lookup((y | (y >> 8)) & 0xFFFF, INTERP)
        m = ((w >> 3) & 0x01010101) * 255
        return (pos & ~m) | (neg & m)

    @triton.jit
    def _e2m1_dot(w, xa, xb, INTERP: tl.constexpr, SIGNED: tl.constexpr):
        """The 8 MXFP4 values of word w (its nibbles, as doubled e2m1 values) dotted with 8 int8
        activation quants in their order (Q8_0_NIBBLES): xa's 4 bytes go with the nibbles of w's
        low half (byte 0's low, its high, byte 1's low, its high), xb's with its high half's.

        Split by sign (not SIGNED): prmt looks each raw nibble up in the table of magnitudes, and
        where the nibble's sign bit (its msb) is set gives the looked-up byte's sign instead, 0.
        So a lookup of w gives the positive values and zeros, one of w with every sign bit flipped
        the negative values' magnitudes and zeros, and the dot is the first's less the second's:
        four prmt and four dp4a for 8 values. SIGNED: the values themselves, as ggml's
        get_int_from_table_16 decodes them (six prmt), and two dp4a. On Hopper prmt and the other
        bit operations share the integer pipe and dp4a goes to the multiply pipe (both at half the
        issue rate), so the split form is the cheaper for one activation row; where the compiler
        decodes a word once for several rows (dense products, runs of pairs) each row costs the
        signed form two dp4a against four. (From GGUF's 17-byte blocks, whose words are assembled
        byte by byte, the signed form compiles to fewer instructions either way: sm_90, one row.)"""
        if SIGNED:
            q = w & 0x77777777
            pick = 0x32103210 | ((w >> 1) & 0x44444444)  # nibble k of a half: its position, + 4 if negative
            pos, neg = _e2m1_lookup(q, INTERP)
            lo = _prmt(pos, neg, pick, INTERP)
            pos, neg = _e2m1_lookup(q >> 16, INTERP)
            dot = _dp4a(_prmt(pos, neg, pick >> 16, INTERP), xb, INTERP, True) + _dp4a(lo, xa, INTERP, True)
        else:
            z = w * 0
            lo = z + 0x03020100
            hi = z + 0x0C080604
            f = w ^ -2004318072  # 0x88888888
            pos = _dp4a(_prmt(lo, hi, w >> 16, INTERP), xb, INTERP, acc=_dp4a(_prmt(lo, hi, w, INTERP), xa, INTERP))
            neg = _dp4a(_prmt(lo, hi, f >> 16, INTERP), xb, INTERP, acc=_dp4a(_prmt(lo, hi, f, INTERP), xa, INTERP))
            dot = pos - neg
        return dot

    @triton.jit
    def _k4_scale_min(hdr, l, j, low):
        """get_scale_min_k4 of sub-blocks j from Q4_K/Q5_K headers (16 bytes as 4 words);
        `low` is j < 4 at the reduced shape."""
        a = _word_byte(hdr, l, 4 + j)
        b = _word_byte(hdr, l, 8 + j)
        e = _word_byte(hdr, l, 4 + (j & 3))
        sc = tl.where(low, a & 63, (b & 15) | ((e >> 6) << 4))
        mn = tl.where(low, b & 63, (b >> 4) | ((a >> 6) << 4))
        return sc.to(tl.float32), mn.to(tl.float32)

    @triton.jit
    def _weight_rows(w_ptr, row_bytes, nb, N, BLOCK_N: tl.constexpr):
        """Byte pointers [1, BLOCK_N, 1, 1, 1] to the quantized tile's rows nb * BLOCK_N ... of the
        weight rows at w_ptr, those past N at its last row (loads stay in bounds; stores are masked)."""
        r4 = tl.arange(0, BLOCK_N)[None, :, None, None, None]
        return w_ptr + tl.minimum(nb * BLOCK_N + r4, N - 1).to(tl.int64) * row_bytes

    @triton.jit
    def _load_w(rows, ks, K: tl.constexpr, BLOCK_N: tl.constexpr, QT: tl.constexpr, REV: tl.constexpr):
        """The raw bytes of K step `ks` for rows at byte pointers `rows` [1, BLOCK_N, 1, 1, 1] (_weight_rows):
        up to four full-shape tensors (unused ones repeat the first)."""
        p, r, c, l = _axes(BLOCK_N, QT)
        z = p * 0 + c * 0  # zero strides (with r and l: the full shape)
        if QT == _Q4_K:
            # d, dmin (f16) | scales[12] | qs[128]; 144-byte blocks, 16-aligned
            blk = rows + ks * 144
            a = (blk + 16 + c * 32 + p * 16).to(tl.pointer_type(tl.int32))
            a = _ld(a + l, REV)
            b = _ld(blk.to(tl.pointer_type(tl.int32)) + l + z, REV)  # the 16-byte header
            cc = a
            dd = a
        elif QT == _Q5_K:
            # d, dmin | scales[12] | qh[32] | qs[128]; 176-byte blocks, 16-aligned
            blk = rows + ks * 176
            a = _ld((blk + 48 + c * 32 + p * 16).to(tl.pointer_type(tl.int32)) + l, REV)
            b = _ld(blk.to(tl.pointer_type(tl.int32)) + l + z, REV)
            cc = _ld((blk + 16 + p * 16).to(tl.pointer_type(tl.int32)) + l + c * 0, REV)
            dd = a
        elif QT == _Q6_K_PADDED:
            # as Q6_K below in 224-byte blocks (16-aligned): the same runs as 4 words each
            blk = rows + ks * 224
            a = _ld((blk + c * 32 + p * 16).to(tl.pointer_type(tl.int32)) + l, REV)
            b = _ld((blk + 128 + (c // 2) * 32 + p * 16).to(tl.pointer_type(tl.int32)) + l, REV)
            cc = _ld((blk + 192).to(tl.pointer_type(tl.int32)) + l + z, REV)
            dd = _ld((blk + 208).to(tl.pointer_type(tl.int32)) + l + z, REV, (l == 0) & (z == 0), 0)
        elif QT == _Q6_K:
            # ql[128] | qh[64] | scales[16] (int8) | d (f16); 210-byte blocks, 2-aligned: int16s
            blk = rows + ks * 210
            a = _ld((blk + c * 32 + p * 16).to(tl.pointer_type(tl.uint16)) + l, REV)
            b = _ld((blk + 128 + (c // 2) * 32 + p * 16).to(tl.pointer_type(tl.uint16)) + l, REV)
            cc = _ld((blk + 192).to(tl.pointer_type(tl.uint16)) + l + z, REV)
            dd = _ld((blk + 208).to(tl.pointer_type(tl.uint16)) + l + z, REV, (l == 0) & (z == 0), 0)
        elif QT == _Q8_0:
            # d (f16) | qs[32] (int8): 34-byte blocks, block 2c + p of the step, as int16s.
            # Blocks past the row's end read its last block again: the activation there is 0.
            bp = rows + tl.minimum(ks * 8 + c * 2 + p, K // 32 - 1) * 34
            a = _ld((bp + 2).to(tl.pointer_type(tl.uint16)) + l, REV)
            b = _ld(bp.to(tl.pointer_type(tl.uint16)) + l + r * 0, REV, (l == 0) & (r >= 0), 0)
            cc = a
            dd = a
        elif QT == _MXFP4:
            # e (e8m0) | qs[16]: 17-byte blocks, block 2c + p of the step, bytes
            bp = rows + tl.minimum(ks * 8 + c * 2 + p, K // 32 - 1) * 17
            a = _ld(bp + 1 + l, REV)
            b = _ld(bp + l + r * 0, REV, (l == 0) & (r >= 0), 0)
            cc = a
            dd = a
        elif QT == _MXFP4_PLANAR:
            # qs[16] of every block | the blocks' e8m0 scales (layout.planar_mxfp4): block 2c + p
            # of the step's 16 nibble bytes as 4 words, and the 16 scales of steps ks and ks ^ 1 as
            # 4 (both 16-aligned, unmasked: every access of the step one 16-byte layout; the
            # scales' padding keeps the second run inside the row)
            NB: tl.constexpr = K // 32
            a = _ld((rows + tl.minimum(ks * 8 + c * 2 + p, NB - 1) * 16).to(tl.pointer_type(tl.int32)) + l, REV)
            b = _ld((rows + NB * 16 + (ks // 2) * 16).to(tl.pointer_type(tl.int32)) + l + z, REV)
            cc = a
            dd = a
        elif QT == _Q8_0_PLANAR:
            # qs[32] of every block | the blocks' f16 scales (layout.planar): blocks c and 4 + c of
            # the step, lane p their bytes 16p ... 16p + 15 as 4 words (a, cc), and the step's 8
            # scales as 4 (b: 16-aligned, inside the row thanks to the scales' padding)
            NB: tl.constexpr = K // 32
            a = _ld((rows + tl.minimum(ks * 8 + c, NB - 1) * 32 + p * 16).to(tl.pointer_type(tl.int32)) + l, REV)
            cc = _ld((rows + tl.minimum(ks * 8 + 4 + c, NB - 1) * 32 + p * 16).to(tl.pointer_type(tl.int32)) + l,
                     REV)
            b = _ld((rows + NB * 32 + ks * 16).to(tl.pointer_type(tl.int32)) + l + z, REV)
            dd = a
        elif QT == _F16:
            k = ks * 256 + c * 32 + p * 16 + l
            a = _ld(rows.to(tl.pointer_type(tl.float16)) + k, REV, (k < K) & (r >= 0), 0.0)
            b = a
            cc = a
            dd = a
        else:  # BF16
            k = ks * 256 + c * 32 + p * 16 + l
            a = _ld(rows.to(tl.pointer_type(tl.uint16)) + k, REV, (k < K) & (r >= 0), 0)
            b = a
            cc = a
            dd = a
        return a, b, cc, dd

    @triton.jit
    def _use_w(acc, a, b, cc, dd, x_row, xq_row, xd_row, ks, K: tl.constexpr, BLOCK_N: tl.constexpr,
               QT: tl.constexpr, INTERP: tl.constexpr, REV: tl.constexpr, SHARED: tl.constexpr = False):
        """acc += K step `ks` of the rows (raw bytes a, b, cc, dd from _load_w) dotted with
        the rounded activation row: values at x_row; for Q8_K, int8 quants at xq_row and
        block scales at xd_row. SHARED: the launch dots the same bytes with several rows
        (MXFP4's decode, _e2m1_dot)."""
        p, r, c, l = _axes(BLOCK_N, QT)
        x0 = x_row + ks * 256 + r * 0  # zero stride along rows: the activation is shared
        if QT == _Q4_K or QT == _Q5_K:
            # qs byte 32c + 16p + i: low nibble -> value 64c + 16p + i (sub-block 2c), high
            # nibble -> + 32 (sub-block 2c + 1); Q5_K's fifth bits: bits 2c / 2c + 1 of byte
            # 16p + i of qh. Word l of a run holds bytes 4l .. 4l + 3.
            z = p * 0 + c * 0 + r * 0
            qlo = a & 0x0F0F0F0F
            qhi = (a >> 4) & 0x0F0F0F0F
            if QT == _Q5_K:
                qlo = qlo | (((cc >> (c * 2)) & 0x01010101) << 4)
                qhi = qhi | (((cc >> (c * 2 + 1)) & 0x01010101) << 4)
            xw = xq_row.to(tl.pointer_type(tl.int32)) + ks * 64 + c * 16 + p * 4 + l + r * 0
            xlo = _ld(xw, REV)
            xhi = _ld(xw + 8, REV)
            ones = xlo * 0 + 0x01010101
            slo = _runsum(_dp4a(qlo, xlo, INTERP)).to(tl.float32)
            shi = _runsum(_dp4a(qhi, xhi, INTERP)).to(tl.float32)
            blo = _runsum(_dp4a(ones, xlo, INTERP)).to(tl.float32)
            bhi = _runsum(_dp4a(ones, xhi, INTERP)).to(tl.float32)
            dx_bits = _ld(xd_row.to(tl.pointer_type(tl.int32)) + ks * 8 + l + z, REV, (l == 0) & (z == 0), 0)
            dx = _pick(dx_bits, l, 0).to(tl.float32, bitcast=True)
            w0 = _pick(b, l, 0)
            d = _f16_bits(w0 & 0xFFFF)
            dmin = _f16_bits((w0 >> 16) & 0xFFFF)
            low = (tl.arange(0, 4) * 2 < 4)[None, None, :]
            sc0, mn0 = _k4_scale_min(b, l, c * 2, low)
            sc1, mn1 = _k4_scale_min(b, l, c * 2 + 1, low)
            acc += dx * (((d * sc0) * slo - (dmin * mn0) * blo) + ((d * sc1) * shi - (dmin * mn1) * bhi))
        elif QT == _Q6_K or QT == _Q6_K_PADDED:
            # ql byte 32c + 16p + i: low nibble -> value 128(c//2) + 32(c%2) + 16p + i, high
            # -> + 64; top bits from qh[32(c//2) + 16p + i] at shift 2(c%2) (+4); one int8
            # scale per 16 values: index 8(c//2) + 2(c%2) + p (+4 for high). Unsigned 6-bit
            # quants in dp4a, less 32 times the activation's quant sum. Words of 4 quants sit
            # on axis 3 (Q6_K: int16 pairs along axis 4 packed into words; padded: the words).
            if QT == _Q6_K_PADDED:
                ql = tl.sum(a, axis=3)
                qh = tl.sum(b, axis=3)
                xw = xq_row.to(tl.pointer_type(tl.int32)) + ks * 64 + (c // 2) * 32 + (c % 2) * 8 + p * 4 + l + r * 0
                xlo = tl.sum(_ld(xw, REV), axis=3)
                xhi = tl.sum(_ld(xw + 16, REV), axis=3)
            else:
                ql = _words(a, 2)
                qh = _words(b, 2)
                xw = (xq_row.to(tl.pointer_type(tl.uint16)) + ks * 128 + (c // 2) * 64 + (c % 2) * 16 + p * 8 + l
                      + r * 0)
                xlo = _words(_ld(xw, REV), 2)
                xhi = _words(_ld(xw + 32, REV), 2)
            sh = (tl.arange(0, 4) % 2 * 2)[None, None, :, None]
            q0 = (ql & 0x0F0F0F0F) | (((qh >> sh) & 0x03030303) << 4)
            q1 = ((ql >> 4) & 0x0F0F0F0F) | (((qh >> (sh + 4)) & 0x03030303) << 4)
            ones = xlo * 0 + 0x01010101
            s0 = tl.sum(_dp4a(q0, xlo, INTERP) - 32 * _dp4a(ones, xlo, INTERP), axis=3).to(tl.float32)
            s1 = tl.sum(_dp4a(q1, xhi, INTERP) - 32 * _dp4a(ones, xhi, INTERP), axis=3).to(tl.float32)
            si = (c // 2) * 8 + (c % 2) * 2  # + p: both lanes' candidates are picked, then chosen
            p3 = tl.arange(0, 2)[:, None, None]
            if QT == _Q6_K_PADDED:
                sc0 = tl.where(p3 == 0, _word_i8(cc, l, si), _word_i8(cc, l, si + 1)).to(tl.float32)
                sc1 = tl.where(p3 == 0, _word_i8(cc, l, si + 4), _word_i8(cc, l, si + 5)).to(tl.float32)
            else:
                scales = cc.to(tl.int32)
                sc0 = tl.where(p3 == 0, _pick_i8(scales, l, si), _pick_i8(scales, l, si + 1)).to(tl.float32)
                sc1 = tl.where(p3 == 0, _pick_i8(scales, l, si + 4), _pick_i8(scales, l, si + 5)).to(tl.float32)
            d = _f16_bits(_pick(dd.to(tl.int32), l, 0) & 0xFFFF)
            z = p * 0 + c * 0 + r * 0
            dx_bits = _ld(xd_row.to(tl.pointer_type(tl.int32)) + ks * 8 + l + z, REV, (l == 0) & (z == 0), 0)
            dx = _pick(dx_bits, l, 0).to(tl.float32, bitcast=True)
            acc += dx * ((d * sc0) * s0 + (d * sc1) * s1)
        elif QT == _Q8_0 or QT == _MXFP4:
            # One block per (p, c): the integer dot of its quants with the activation's Q8_0
            # quants, times both scales. MXFP4: byte i holds values i (low nibble) and 16 + i, the
            # activation's quants go in the nibbles' order (_e2m1_dot).
            blk = c * 2 + p
            if QT == _Q8_0:
                xq = xq_row.to(tl.pointer_type(tl.uint16)) + ks * 128 + blk * 16 + l + r * 0
                sw = tl.sum(_dp4a(_words(a, 2), _words(_ld(xq, REV), 2), INTERP, True), axis=3)
                dw = _f16_bits(_pick(b.to(tl.int32), l, 0) & 0xFFFF)
            else:
                xq = xq_row.to(tl.pointer_type(tl.uint8)) + ks * 256 + blk * 32 + l + r * 0
                sw = tl.sum(_e2m1_dot(_words(a, 4), _words(_ld(xq, REV), 4), _words(_ld(xq + 16, REV), 4), INTERP,
                                      True), axis=3)
                dw = _e8m0_half(_pick(b.to(tl.int32), l, 0) & 255)
            # The step's 8 activation scales as one run (no stride along p: one layout for
            # all); each lane picks its block's (compile-time candidates 2c, 2c + 1 by p).
            z = p * 0 + c * 0 + r * 0
            xd = _ld(xd_row.to(tl.pointer_type(tl.int32)) + ks * 8 + l + z, REV, (l < 8) & (z == 0), 0)
            c2 = c * 2
            p3 = tl.arange(0, 2)[:, None, None]
            dx = tl.where(p3 == 0, _pick(xd, l, c2), _pick(xd, l, c2 + 1)).to(tl.float32, bitcast=True)
            acc += (dw * dx) * sw.to(tl.float32)
        elif QT == _MXFP4_PLANAR:
            # Block 2c + p: word l of its nibbles (values 4l .. 4l + 3 in the low nibbles, 16 + 4l ..
            # in the high ones) dotted with the activation's words l and 4 + l of the block, which
            # hold those values in the nibbles' order (_e2m1_dot).
            blk = c * 2 + p
            xw = xq_row.to(tl.pointer_type(tl.int32)) + ks * 64 + blk * 8 + l + r * 0
            sw = _runsum(_e2m1_dot(a, _ld(xw, REV), _ld(xw + 4, REV), INTERP, SHARED))
            # Its e8m0 scale: byte 2 (c % 2) + p of word 2 (ks % 2) + c // 2 of b (the scales of
            # steps ks - ks % 2 and the next); its activation scale: word 2 (c % 2) + p of run
            # c // 2 of the step's two runs of 4. Registers picked at compile time (c), then chosen
            # by the step's parity and by the lane (p).
            p3 = tl.arange(0, 2)[:, None, None]
            c3 = tl.arange(0, 4)[None, None, :]
            word = tl.where(ks % 2 == 0, _pick(b, l, c // 2), _pick(b, l, 2 + c // 2))
            dw = _e8m0_half((word >> ((c3 % 2) * 16 + p3 * 8)) & 255)
            xd = xd_row.to(tl.pointer_type(tl.int32)) + ks * 8 + l + p * 0 + c * 0 + r * 0
            run = tl.where(c < 2, _ld(xd, REV), _ld(xd + 4, REV))
            dx = tl.where(p3 == 0, _pick(run, l, (c % 2) * 2), _pick(run, l, (c % 2) * 2 + 1)).to(tl.float32,
                                                                                                 bitcast=True)
            acc += (dw * dx) * sw.to(tl.float32)
        elif QT == _Q8_0_PLANAR:
            # Blocks c (a) and 4 + c (cc), lane p their quants 16p ... 16p + 15: dotted with the
            # activation's, times both scales (the weights' f16 scale of block j: half j % 2 of
            # word j // 2 of b; the activation's 8 as two runs of 4 words).
            xw = xq_row.to(tl.pointer_type(tl.int32)) + ks * 64 + c * 8 + p * 4 + l + r * 0
            s_lo = _runsum(_dp4a(a, _ld(xw, REV), INTERP, True)).to(tl.float32)
            s_hi = _runsum(_dp4a(cc, _ld(xw + 32, REV), INTERP, True)).to(tl.float32)
            c3 = tl.arange(0, 4)[None, None, :]
            half = (c3 % 2) * 16
            d_lo = _f16_bits((_pick(b, l, c // 2) >> half) & 0xFFFF)
            d_hi = _f16_bits((_pick(b, l, 2 + c // 2) >> half) & 0xFFFF)
            xd = xd_row.to(tl.pointer_type(tl.int32)) + ks * 8 + l + p * 0 + c * 0 + r * 0
            dx_lo = _pick(_ld(xd, REV), l, c).to(tl.float32, bitcast=True)
            dx_hi = _pick(_ld(xd + 4, REV), l, c).to(tl.float32, bitcast=True)
            acc += (d_lo * dx_lo) * s_lo + (d_hi * dx_hi) * s_hi
        else:  # F16, BF16
            k = c * 32 + p * 16 + l
            if QT == _F16:
                w = a.to(tl.float32)
            else:
                w = (a.to(tl.int32) << 16).to(tl.float32, bitcast=True)
            acc += _runsum(w * _ld(x0 + k, REV))
        return acc

    # ---------------------------------------------------------------- the two kernels

    @triton.jit
    def _activate(g, u, ACT: tl.constexpr):
        """The gated activation of gate g and up u (this and the grouped GEMM's kernels)."""
        if ACT == 0:  # SiLU(g) * u, as engine.layers.moe.activate writes it
            h = g / (1.0 + tl.exp(-g)) * u
        else:  # SWIGLU_OAI: alpha 1.702, limit 7
            g7 = tl.minimum(g, 7.0)
            u7 = tl.minimum(tl.maximum(u, -7.0), 7.0)
            h = g7 / (1.0 + tl.exp(-1.702 * g7)) * (u7 + 1.0)
        return h

    @triton.jit
    def _fence_stores(rows, INTERP: tl.constexpr):
        """Before a split-K semaphore's atomic: every thread fences its stores, then the CTA
        syncs, so the program that counts last sees every store of the programs before it."""
        if not INTERP:
            tl.inline_asm_elementwise("fence.acq_rel.gpu;\n\tmov.u32 $0, $1;", "=r,r", [rows], dtype=tl.int32,
                                      is_pure=False, pack=1)
        tl.debug_barrier()

    # ---------------------------------------------------------------- one launch for the step
    # experts_forward(one_launch=True) runs round x, gate/up and down as one grid, ids in that
    # order: a program whose inputs another program makes waits for a flag that program publishes
    # (x's K steps; h's). Programs only wait on lower ids, which CUDA dispatches first (the
    # forward-progress assumption of CUB's decoupled look-back), and the interpreter runs in id
    # order. The flags hold the launch's epoch, so none needs resetting: the last program to end
    # sets the epoch that the next launch's programs read (step state: epoch, programs ended,
    # a wait timed out, then the flags).

    @triton.jit
    def acquire_load(ptr, SYS: tl.constexpr, INTERP: tl.constexpr):
        """*ptr, ordered before the program's later loads (acquire at system scope, the host's
        flags; else at GPU scope)."""
        if INTERP:
            v = tl.load(ptr, volatile=True)
        elif SYS:
            v = tl.inline_asm_elementwise("ld.acquire.sys.global.b32 $0, [$1];", "=r,l", [ptr],
                                          dtype=tl.int32, is_pure=False, pack=1)
        else:
            v = tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr],
                                          dtype=tl.int32, is_pure=False, pack=1)
        return v

    @triton.jit
    def clock_ns(like):
        """The GPU's global timer in ns (`like`: any scalar, for the shape)."""
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [like], dtype=tl.int64,
                                         is_pure=False, pack=1)

    @triton.jit
    def _publish(flag_ptr, epoch, like, INTERP: tl.constexpr):
        """flag <- epoch once every thread's earlier stores are visible at GPU scope."""
        _fence_stores(like, INTERP)
        tl.atomic_xchg(flag_ptr, epoch, sem="release", scope="gpu")

    @triton.jit
    def _await(flag_ptr, n, epoch, state_ptr, timeout_ns, INTERP: tl.constexpr):
        """Until flags [0, n) all hold epoch, each at most timeout_ns; a wait that times out sets
        the step state's word 2 and goes on (a hang would take the desktop with it).

        Each thread waits on its own acquire loads, so its later loads see what the flag
        publishes; threads may diverge here, so nothing in the wait may take a CTA barrier (a
        Triton scalar atomic does: the timeout is stored by each late thread in PTX)."""
        for c in range(n):
            got = acquire_load(flag_ptr + c, False, INTERP)
            if got != epoch:
                if INTERP:  # the interpreter runs lower ids first: a flag not yet set never will be
                    tl.store(state_ptr + 2, 1)
                else:
                    deadline = clock_ns(epoch) + timeout_ns
                    while (got != epoch) & (clock_ns(epoch) < deadline):
                        # a short sleep between polls leaves the SM's issue slots and L2 to the
                        # programs being waited for
                        tl.inline_asm_elementwise("nanosleep.u32 32;\n\tmov.u32 $0, 0;", "=r,r", [epoch],
                                                  dtype=tl.int32, is_pure=False, pack=1)
                        got = acquire_load(flag_ptr + c, False, INTERP)
                    if got != epoch:
                        tl.inline_asm_elementwise("st.relaxed.gpu.global.b32 [$1], 1;\n\tmov.u32 $0, 0;", "=r,l",
                                                  [state_ptr + 2], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _gate_up_finish(g, u, rows, p, nb, s, split, n_pairs, gb_ptr, ub_ptr, h_ptr, hr_ptr, hq_ptr, hd_ptr,
                        part_ptr, count_ptr, pair_exp, h_flags, epoch, N: tl.constexpr, VT_DOWN: tl.constexpr,
                        ACT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, INTERP: tl.constexpr,
                        STEP: tl.constexpr):
        """The end of gate/up program (p, nb, s) (either tile): its gate and up sums g, u for
        `rows`; with split > 1 its partials, which the last program of the row block adds in split
        order; then bias, activation, h, and the last row block of each 256 values of the pair's
        h rounds those 256 (semaphores: count_ptr[p * NSH + chunk], then the split's per row
        block); in one launch (STEP) it then publishes h_flags[p * NSH + chunk]."""
        NB: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
        live = rows < N
        p64 = p.to(tl.int64)
        NSH: tl.constexpr = (N + 255) // 256
        finish = split == 1  # constexpr where Triton specialized split to 1, else a runtime flag
        if split > 1:
            part = part_ptr + (p64 * split + s) * (2 * N)
            tl.store(part + rows, g, mask=live)
            tl.store(part + N + rows, u, mask=live)
            _fence_stores(rows, INTERP)
            block_sem = count_ptr + n_pairs * NSH + p * NB + nb
            finish = tl.atomic_add(block_sem, 1, sem="acq_rel", scope="gpu") == split - 1
            if finish:
                tl.store(block_sem, 0)
                part = part_ptr + p64 * (split * 2 * N)
                g = tl.load(part + rows, mask=live, other=0.0, cache_modifier=".cg")
                u = tl.load(part + N + rows, mask=live, other=0.0, cache_modifier=".cg")
                for j in range(1, split):
                    g += tl.load(part + j * 2 * N + rows, mask=live, other=0.0, cache_modifier=".cg")
                    u += tl.load(part + j * 2 * N + N + rows, mask=live, other=0.0, cache_modifier=".cg")
        if finish:
            if HAS_BIAS:
                e = tl.load(pair_exp + p).to(tl.int64)
                g = g + tl.load(gb_ptr + e * N + rows, mask=live, other=0.0)
                u = u + tl.load(ub_ptr + e * N + rows, mask=live, other=0.0)
            h = _activate(g, u, ACT)
            h_row = h_ptr + p64 * N
            tl.store(h_row + rows, h, mask=live)
            # The last row block to finish of each 256 values of h (a K step of the down product,
            # rounded on its own) rounds them for the down weights: the same semaphore pattern,
            # one per pair and step, reset by that program. (One per pair, its last program
            # rounding the whole row, left a serial tail of n_ff / 256 roundings: gpt-oss's 12.)
            _fence_stores(rows, INTERP)
            PER_CHUNK: tl.constexpr = 256 // BLOCK_N
            c = nb // PER_CHUNK
            chunk_sem = count_ptr + p * NSH + c
            done = tl.atomic_add(chunk_sem, 1, sem="acq_rel", scope="gpu")
            if done == tl.minimum(PER_CHUNK, NB - c * PER_CHUNK) - 1:
                tl.store(chunk_sem, 0)
                _round_chunk(h_row, hr_ptr + p64 * (NSH * 256), hq_ptr + p64 * (NSH * 256),
                             hd_ptr + p64 * (NSH * 8), hd_ptr, c, N, VT_DOWN, INTERP, False)
                if STEP:
                    _publish(h_flags + p * NSH + c, epoch, rows, INTERP)

    # The gate/up and down kernels are thin: each program's work is a function of its ids (p, nb,
    # s), which the one-launch step kernel calls as well. The step arguments (x_flags, h_flags,
    # epoch, state_ptr, timeout_ns) are only read there (STEP; WAIT_X where x is rounded in it).

    @triton.jit
    def _gate_up_tile_program(p, nb, s, xg_ptr, xgq_ptr, xgd_ptr, xu_ptr, xuq_ptr, xud_ptr,
                              g_ptr, g_slot_bytes, g_row_bytes, u_ptr, u_slot_bytes, u_row_bytes,
                              gb_ptr, ub_ptr, h_ptr, hr_ptr, hq_ptr, hd_ptr, part_ptr, count_ptr,
                              pair_tok, pair_slot, pair_exp, n_pairs, split, steps,
                              x_flags, h_flags, epoch, state_ptr, timeout_ns,
                              N: tl.constexpr, K: tl.constexpr, QG: tl.constexpr, QU: tl.constexpr,
                              SAME_X: tl.constexpr, VT_DOWN: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
                              BLOCK_N: tl.constexpr, UNROLL: tl.constexpr, INTERP: tl.constexpr, REV: tl.constexpr,
                              STEP: tl.constexpr, WAIT_X: tl.constexpr, PDL: tl.constexpr):
        """Program (p, nb, s) of _gate_up_kernel."""
        if PDL:
            gdc_launch_dependents()
        tok = tl.load(pair_tok + p).to(tl.int64)
        # A pair without a slot here (< 0: the CPU pool computes it, or a launch over mapped host
        # memory) does nothing: its programs end before reading a byte, in both kernels, so a
        # graph keeps one shape whatever the routing.
        slot_or_none = tl.load(pair_slot + p)
        if slot_or_none < 0:
            return
        slot = slot_or_none.to(tl.int64)
        NS: tl.constexpr = (K + 255) // 256
        xg_row = xg_ptr + tok * (NS * 256)  # rounded rows are padded to whole K steps
        xgq_row = xgq_ptr + tok * (NS * 256)
        xgd_row = xgd_ptr + tok * (NS * 8)
        if SAME_X:
            xu_row = xg_row
            xuq_row = xgq_row
            xud_row = xgd_row
        else:
            xu_row = xu_ptr + tok * (NS * 256)
            xuq_row = xuq_ptr + tok * (NS * 256)
            xud_row = xud_ptr + tok * (NS * 8)
        g_rows = _weight_rows(g_ptr + slot * g_slot_bytes, g_row_bytes, nb, N, BLOCK_N)
        u_rows = _weight_rows(u_ptr + slot * u_slot_bytes, u_row_bytes, nb, N, BLOCK_N)
        acc_g = _zero_acc(BLOCK_N, QG)
        acc_u = _zero_acc(BLOCK_N, QU)
        k0 = s * steps
        k1 = tl.minimum(k0 + steps, NS)
        if UNROLL:  # every K step: gate_up never splits an unrolled tile
            if WAIT_X:
                _await(x_flags + tok * NS, NS, epoch, state_ptr, timeout_ns, INTERP)
            if PDL:
                gdc_wait()
            for ks in tl.static_range(0, NS):
                ga, gb, gc, gd = _load_w(g_rows, ks, K, BLOCK_N, QG, REV)
                ua, ub, uc, ud = _load_w(u_rows, ks, K, BLOCK_N, QU, REV)
                acc_g = _use_w(acc_g, ga, gb, gc, gd, xg_row, xgq_row, xgd_row, ks, K, BLOCK_N, QG, INTERP, REV)
                acc_u = _use_w(acc_u, ua, ub, uc, ud, xu_row, xuq_row, xud_row, ks, K, BLOCK_N, QU, INTERP, REV)
        elif QG == _F16 or QG == _BF16 or QU == _F16 or QU == _BF16:
            # 16-bit weights: a lane's bytes of a step fill 64 registers a matrix; no second set
            if WAIT_X:
                _await(x_flags + tok * NS + k0, k1 - k0, epoch, state_ptr, timeout_ns, INTERP)
            if PDL:
                gdc_wait()
            for ks in range(k0, k1):
                ga, gb, gc, gd = _load_w(g_rows, ks, K, BLOCK_N, QG, REV)
                ua, ub, uc, ud = _load_w(u_rows, ks, K, BLOCK_N, QU, REV)
                acc_g = _use_w(acc_g, ga, gb, gc, gd, xg_row, xgq_row, xgd_row, ks, K, BLOCK_N, QG, INTERP, REV)
                acc_u = _use_w(acc_u, ua, ub, uc, ud, xu_row, xuq_row, xud_row, ks, K, BLOCK_N, QU, INTERP, REV)
        else:  # the next step's bytes of both matrices are loaded ahead (register double-buffering)
            ga, gb, gc, gd = _load_w(g_rows, k0, K, BLOCK_N, QG, REV)
            ua, ub, uc, ud = _load_w(u_rows, k0, K, BLOCK_N, QU, REV)
            if WAIT_X:  # the first step's weights are on their way meanwhile
                _await(x_flags + tok * NS + k0, k1 - k0, epoch, state_ptr, timeout_ns, INTERP)
            if PDL:  # the same, while the launch before ends
                gdc_wait()
            for ks in range(k0, k1):
                nk = tl.minimum(ks + 1, k1 - 1)
                nga, ngb, ngc, ngd = _load_w(g_rows, nk, K, BLOCK_N, QG, REV)
                nua, nub, nuc, nud = _load_w(u_rows, nk, K, BLOCK_N, QU, REV)
                acc_g = _use_w(acc_g, ga, gb, gc, gd, xg_row, xgq_row, xgd_row, ks, K, BLOCK_N, QG, INTERP, REV)
                acc_u = _use_w(acc_u, ua, ub, uc, ud, xu_row, xuq_row, xud_row, ks, K, BLOCK_N, QU, INTERP, REV)
                ga, gb, gc, gd = nga, ngb, ngc, ngd
                ua, ub, uc, ud = nua, nub, nuc, nud
        rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        _gate_up_finish(_reduce_acc(acc_g), _reduce_acc(acc_u), rows, p, nb, s, split, n_pairs, gb_ptr, ub_ptr,
                        h_ptr, hr_ptr, hq_ptr, hd_ptr, part_ptr, count_ptr, pair_exp, h_flags, epoch, N, VT_DOWN, ACT,
                        HAS_BIAS, BLOCK_N, INTERP, STEP)

    # The split is a runtime argument: it follows the launch's pair count, and a constexpr would
    # compile a variant per count class (Triton still gives split 1 a variant of its own).
    @triton.jit(do_not_specialize=["n_pairs", "steps"])
    def _gate_up_kernel(xg_ptr, xgq_ptr, xgd_ptr, xu_ptr, xuq_ptr, xud_ptr,
                        g_ptr, g_slot_bytes, g_row_bytes, u_ptr, u_slot_bytes, u_row_bytes,
                        gb_ptr, ub_ptr, h_ptr, hr_ptr, hq_ptr, hd_ptr, part_ptr, count_ptr,
                        pair_tok, pair_slot, pair_exp, n_pairs, split, steps,
                        N: tl.constexpr, K: tl.constexpr, QG: tl.constexpr, QU: tl.constexpr, SAME_X: tl.constexpr,
                        VT_DOWN: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
                        BLOCK_N: tl.constexpr, UNROLL: tl.constexpr, PASSES: tl.constexpr, INTERP: tl.constexpr,
                        REV: tl.constexpr, PDL: tl.constexpr):
        """Grid (pairs, N / BLOCK_N, split). x*: the rounded activations [T, K] (values, Q8_K
        quants, Q8_K scales [T, K / 256]) for the gate and the up type; h [pairs, N] and, rounded
        for the down type, hr (values), hq, hd (Q8_K quants and scales). Program (p, nb, s) takes
        K steps s * steps ... (s + 1) * steps of its rows; with split > 1 it stores its partial
        sums in part [pairs, split, 2, N] and the last program of the row block to finish (a
        semaphore per pair and row block, after the h steps' own) adds them in split order, so
        the result does not depend on which program finishes last, then activates. (PASSES: 1, the
        row tile's turns.)"""
        _gate_up_tile_program(tl.program_id(0), tl.program_id(1), tl.program_id(2), xg_ptr, xgq_ptr, xgd_ptr,
                              xu_ptr, xuq_ptr, xud_ptr, g_ptr, g_slot_bytes, g_row_bytes, u_ptr, u_slot_bytes,
                              u_row_bytes, gb_ptr, ub_ptr, h_ptr, hr_ptr, hq_ptr, hd_ptr, part_ptr, count_ptr,
                              pair_tok, pair_slot, pair_exp, n_pairs, split, steps, count_ptr, count_ptr, 0,
                              count_ptr, 0, N, K, QG, QU, SAME_X, VT_DOWN, ACT, HAS_BIAS, BLOCK_N, UNROLL, INTERP, REV,
                              False, False, PDL)

    @triton.jit
    def _down_store(y, rows, p, db_ptr, wt_ptr, wt_stride_tok, out_ptr, out_stride_pos, out_stride_tok, pair_tok,
                    pair_pos, pair_exp, N, HAS_BIAS: tl.constexpr, WEIGHTED: tl.constexpr):
        """The end of a down program (either tile): pair p's sums y for `rows`, plus the bias,
        times the routing weight, into out[pos, tok, rows]."""
        live = rows < N
        if HAS_BIAS:
            e = tl.load(pair_exp + p).to(tl.int64)
            y = y + tl.load(db_ptr + e * N + rows, mask=live, other=0.0)
        tok = tl.load(pair_tok + p).to(tl.int64)
        pos = tl.load(pair_pos + p).to(tl.int64)
        if WEIGHTED:
            y = y * tl.load(wt_ptr + tok * wt_stride_tok + pos)
        tl.store(out_ptr + pos * out_stride_pos + tok * out_stride_tok + rows, y, mask=live)

    @triton.jit
    def _down_program(p, nb, hr_ptr, hq_ptr, hd_ptr, d_ptr, d_slot_bytes, d_row_bytes, db_ptr, wt_ptr,
                      wt_stride_tok, out_ptr, out_stride_pos, out_stride_tok, pair_tok, pair_pos, pair_slot, pair_exp,
                      N, h_flags, epoch, state_ptr, timeout_ns, K: tl.constexpr, QD: tl.constexpr,
                      HAS_BIAS: tl.constexpr, WEIGHTED: tl.constexpr, BLOCK_N: tl.constexpr, UNROLL: tl.constexpr,
                      INTERP: tl.constexpr, REV: tl.constexpr, STEP: tl.constexpr, PDL: tl.constexpr):
        """Program (p, nb) of _down_kernel; in one launch (STEP) it waits for the pair's h."""
        slot_or_none = tl.load(pair_slot + p)
        if slot_or_none < 0:  # no slot here (see _gate_up_tile_program)
            return
        d_rows = _weight_rows(d_ptr + slot_or_none.to(tl.int64) * d_slot_bytes, d_row_bytes, nb, N, BLOCK_N)
        NS: tl.constexpr = (K + 255) // 256
        p64 = p.to(tl.int64)
        x_row = hr_ptr + p64 * (NS * 256)
        xq_row = hq_ptr + p64 * (NS * 256)
        xd_row = hd_ptr + p64 * (NS * 8)
        acc = _zero_acc(BLOCK_N, QD)
        if UNROLL:
            if STEP:
                _await(h_flags + p * NS, NS, epoch, state_ptr, timeout_ns, INTERP)
            if PDL:
                gdc_wait()
            for ks in tl.static_range(0, NS):
                a, b, cc, dd = _load_w(d_rows, ks, K, BLOCK_N, QD, REV)
                acc = _use_w(acc, a, b, cc, dd, x_row, xq_row, xd_row, ks, K, BLOCK_N, QD, INTERP, REV)
        else:
            a, b, cc, dd = _load_w(d_rows, 0, K, BLOCK_N, QD, REV)
            if STEP:  # the first step's weights are on their way meanwhile
                _await(h_flags + p * NS, NS, epoch, state_ptr, timeout_ns, INTERP)
            if PDL:  # the same, while the launch before ends
                gdc_wait()
            for ks in range(0, NS):
                na, nb2, nc, nd = _load_w(d_rows, tl.minimum(ks + 1, NS - 1), K, BLOCK_N, QD, REV)
                acc = _use_w(acc, a, b, cc, dd, x_row, xq_row, xd_row, ks, K, BLOCK_N, QD, INTERP, REV)
                a, b, cc, dd = na, nb2, nc, nd
        _down_store(_reduce_acc(acc), nb * BLOCK_N + tl.arange(0, BLOCK_N), p, db_ptr, wt_ptr, wt_stride_tok,
                    out_ptr, out_stride_pos, out_stride_tok, pair_tok, pair_pos, pair_exp, N, HAS_BIAS, WEIGHTED)

    @triton.jit
    def _down_kernel(hr_ptr, hq_ptr, hd_ptr, d_ptr, d_slot_bytes, d_row_bytes, db_ptr, wt_ptr, wt_stride_tok,
                     out_ptr, out_stride_pos, out_stride_tok, pair_tok, pair_pos, pair_slot, pair_exp, N,
                     K: tl.constexpr, QD: tl.constexpr, HAS_BIAS: tl.constexpr, WEIGHTED: tl.constexpr,
                     BLOCK_N: tl.constexpr, UNROLL: tl.constexpr, INTERP: tl.constexpr, REV: tl.constexpr,
                     PDL: tl.constexpr):
        """Grid (pairs, N / BLOCK_N). hr/hq/hd: the rounded h [pairs, K]; out[pos, tok, :N]."""
        _down_program(tl.program_id(0), tl.program_id(1), hr_ptr, hq_ptr, hd_ptr, d_ptr, d_slot_bytes, d_row_bytes,
                      db_ptr, wt_ptr, wt_stride_tok, out_ptr, out_stride_pos, out_stride_tok, pair_tok, pair_pos,
                      pair_slot, pair_exp, N, pair_slot, 0, pair_slot, 0, K, QD, HAS_BIAS, WEIGHTED, BLOCK_N, UNROLL,
                      INTERP, REV, False, PDL)

    # ---------------------------------------------------------------- dense products

    @triton.jit
    def _dense_rows(acc, t: tl.constexpr, ROWS: tl.constexpr, a, b, cc, dd, xr_ptr, xq_ptr, xd_ptr, ks,
                    K: tl.constexpr, BLOCK_N: tl.constexpr, QW: tl.constexpr, INTERP: tl.constexpr,
                    REV: tl.constexpr):
        """acc of activation row t += this K step, where the launch has more than t rows."""
        if t < ROWS:
            KP: tl.constexpr = (K + 255) // 256 * 256
            acc = _use_w(acc, a, b, cc, dd, xr_ptr + t * KP, xq_ptr + t * KP, xd_ptr + t * (KP // 32), ks, K,
                         BLOCK_N, QW, INTERP, REV, ROWS > 1)
        return acc

    @triton.jit
    def _dense_out(sums, t: tl.constexpr, ROWS: tl.constexpr, dst, N, rows, live):
        """Stores row t's sums for the block's weight rows at dst + t * N + rows."""
        if t < ROWS:
            tl.store(dst + t * N + rows, sums, mask=live)

    @triton.jit
    def _dense_finish(s0, s1, s2, s3, s4, s5, s6, s7, part_ptr, out_ptr, count_ptr, nb, s, N,
                      ROWS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, INTERP: tl.constexpr):
        """The end of a one-dimensional dense program: activation rows' sums s0 .. s7 (those of
        rows past ROWS unused) into out, or with SPLIT > 1 into this slice's partials, which the
        last program of the row block adds in split order (_dense_split_sum)."""
        rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        live = rows < N
        dst = out_ptr if SPLIT == 1 else part_ptr + s.to(tl.int64) * (ROWS * N)
        _dense_out(s0, 0, ROWS, dst, N, rows, live)
        _dense_out(s1, 1, ROWS, dst, N, rows, live)
        _dense_out(s2, 2, ROWS, dst, N, rows, live)
        _dense_out(s3, 3, ROWS, dst, N, rows, live)
        _dense_out(s4, 4, ROWS, dst, N, rows, live)
        _dense_out(s5, 5, ROWS, dst, N, rows, live)
        _dense_out(s6, 6, ROWS, dst, N, rows, live)
        _dense_out(s7, 7, ROWS, dst, N, rows, live)
        _dense_split_sum(part_ptr, out_ptr, count_ptr, nb, rows, live, N, ROWS, SPLIT, INTERP)

    @triton.jit
    def _dense_kernel(xr_ptr, xq_ptr, xd_ptr, w_ptr, w_row_bytes, part_ptr, out_ptr, count_ptr, N,
                      K: tl.constexpr, QW: tl.constexpr, ROWS: tl.constexpr, SPLIT: tl.constexpr,
                      STEPS: tl.constexpr, BLOCK_N: tl.constexpr, INTERP: tl.constexpr, REV: tl.constexpr,
                      PDL: tl.constexpr):
        """Grid (N / BLOCK_N, SPLIT): out [ROWS, N] = rounded x [ROWS, K] . W [N, K] (GGUF rows
        of w_row_bytes). Program (nb, s) takes weight rows nb * BLOCK_N ... and K steps
        s * STEPS ... (s + 1) * STEPS, and multiplies each step's decoded bytes with all ROWS
        activation rows (the weights are read once whatever the rows). With SPLIT > 1 it stores
        its partial sums in part [SPLIT, ROWS, N]; the last program of a row block to finish
        (a semaphore per row block, reset by that program) adds the SPLIT partials in split
        order, so the result does not depend on which program finishes last. With PDL it reads x
        only after the launch before it ended (a dependent launch: dependent_launches)."""
        nb = tl.program_id(0)
        s = tl.program_id(1)
        w_rows = _weight_rows(w_ptr, w_row_bytes, nb, N, BLOCK_N)
        NS: tl.constexpr = (K + 255) // 256
        k0 = s * STEPS
        k1 = tl.minimum(k0 + STEPS, NS)
        acc0 = _zero_acc(BLOCK_N, QW)
        acc1 = _zero_acc(BLOCK_N, QW)
        acc2 = _zero_acc(BLOCK_N, QW)
        acc3 = _zero_acc(BLOCK_N, QW)
        acc4 = _zero_acc(BLOCK_N, QW)
        acc5 = _zero_acc(BLOCK_N, QW)
        acc6 = _zero_acc(BLOCK_N, QW)
        acc7 = _zero_acc(BLOCK_N, QW)
        # The next step's bytes are loaded while this one is computed (register double
        # buffering), except for 16-bit weights, whose step already fills 64 registers a lane.
        PREFETCH: tl.constexpr = QW != _F16 and QW != _BF16
        if PREFETCH:
            a, b, cc, dd = _load_w(w_rows, k0, K, BLOCK_N, QW, REV)
        if PDL:  # the first step's weights are on their way while the launch before ends
            gdc_wait()
        for ks in range(k0, k1):
            if PREFETCH:
                na, nb2, nc, nd = _load_w(w_rows, tl.minimum(ks + 1, k1 - 1), K, BLOCK_N, QW, REV)
            else:
                a, b, cc, dd = _load_w(w_rows, ks, K, BLOCK_N, QW, REV)
            acc0 = _dense_rows(acc0, 0, ROWS, a, b, cc, dd, xr_ptr, xq_ptr, xd_ptr, ks, K, BLOCK_N, QW, INTERP, REV)
            acc1 = _dense_rows(acc1, 1, ROWS, a, b, cc, dd, xr_ptr, xq_ptr, xd_ptr, ks, K, BLOCK_N, QW, INTERP, REV)
            acc2 = _dense_rows(acc2, 2, ROWS, a, b, cc, dd, xr_ptr, xq_ptr, xd_ptr, ks, K, BLOCK_N, QW, INTERP, REV)
            acc3 = _dense_rows(acc3, 3, ROWS, a, b, cc, dd, xr_ptr, xq_ptr, xd_ptr, ks, K, BLOCK_N, QW, INTERP, REV)
            acc4 = _dense_rows(acc4, 4, ROWS, a, b, cc, dd, xr_ptr, xq_ptr, xd_ptr, ks, K, BLOCK_N, QW, INTERP, REV)
            acc5 = _dense_rows(acc5, 5, ROWS, a, b, cc, dd, xr_ptr, xq_ptr, xd_ptr, ks, K, BLOCK_N, QW, INTERP, REV)
            acc6 = _dense_rows(acc6, 6, ROWS, a, b, cc, dd, xr_ptr, xq_ptr, xd_ptr, ks, K, BLOCK_N, QW, INTERP, REV)
            acc7 = _dense_rows(acc7, 7, ROWS, a, b, cc, dd, xr_ptr, xq_ptr, xd_ptr, ks, K, BLOCK_N, QW, INTERP, REV)
            if PREFETCH:
                a, b, cc, dd = na, nb2, nc, nd
        _dense_finish(_reduce_acc(acc0), _reduce_acc(acc1), _reduce_acc(acc2), _reduce_acc(acc3),
                      _reduce_acc(acc4), _reduce_acc(acc5), _reduce_acc(acc6), _reduce_acc(acc7),
                      part_ptr, out_ptr, count_ptr, nb, s, N, ROWS, SPLIT, BLOCK_N, INTERP)

    @triton.jit
    def _dense_split_sum(part_ptr, out_ptr, count_ptr, nb, rows, live, N, ROWS: tl.constexpr, SPLIT: tl.constexpr,
                         INTERP: tl.constexpr):
        """After a split program stored its partial sums: the last program of row block nb to
        finish (a semaphore per row block, reset by that program) adds the SPLIT partials in
        split order into out, so the result does not depend on which program finishes last."""
        if SPLIT > 1:
            # The split-K semaphore, as in _gate_up_kernel; the last program reads the partials from L2.
            _fence_stores(rows, INTERP)
            done = tl.atomic_add(count_ptr + nb, 1, sem="acq_rel", scope="gpu")
            if done == SPLIT - 1:
                tl.store(count_ptr + nb, 0)
                for t in tl.static_range(0, ROWS):
                    y = tl.load(part_ptr + t * N + rows, mask=live, other=0.0, cache_modifier=".cg")
                    for j in tl.static_range(1, SPLIT):
                        y += tl.load(part_ptr + (j * ROWS + t) * N + rows, mask=live, other=0.0,
                                     cache_modifier=".cg")
                    tl.store(out_ptr + t * N + rows, y, mask=live)

    # ---------------------------------------------------------------- 16-bit dense products
    # F16 and BF16 rows need no decoding, so they take tiles of their own. For one activation
    # row ("row16"), a K step is [BLOCK_N rows, DENSE16_STEP values]: each lane reads 16
    # contiguous bytes of a row, a warp 512 and the program's warps side by side along K, so a
    # row's 2 KB come in one access on 4 warps, as llama.cpp's mul_mat_vec reads a row with a
    # block. Products accumulate elementwise in float32 and are summed along K once, at the end;
    # for more rows, tensor cores, a step of 256 values. The one-row kernel rounds x itself (no
    # launch before it) and loads the weights evict-first: read once, they should not push the
    # activation out of L1 and L2. H100, a row a program against 8 rows on 256-value steps split
    # over K after a rounding launch: Mixtral's 4096 x 14336 F16 40.27 against 42.98 us (0.97 of the
    # copy's bandwidth; llama.cpp's mul_mat_vec 1.00x per byte), BF16 40.40 against 44.69; Qwen3's
    # 4096 x 2048 7.49 against 10.79. (2 rows a program: F16 at Mixtral's K 42.8-43.3 us.)

    @triton.jit
    def _load16(w_rows, ks, k, K: tl.constexpr):
        """Step ks of the rows [BLOCK_N, 1] (16-bit elements): a partial last step masked."""
        if K % 256 == 0:
            w = tl.load(w_rows + ks * 256 + k)
        else:
            w = tl.load(w_rows + ks * 256 + k, mask=ks * 256 + k < K, other=0)
        return w

    @triton.jit
    def _dense16_kernel(x_ptr, xq_ptr, xd_ptr, w_ptr, w_row_bytes, part_ptr, out_ptr, count_ptr, N,
                        K: tl.constexpr, QW: tl.constexpr, ROWS: tl.constexpr, SPLIT: tl.constexpr,
                        STEPS: tl.constexpr, BLOCK_N: tl.constexpr, STEP: tl.constexpr, INTERP: tl.constexpr,
                        PDL: tl.constexpr):
        """_dense_kernel's product (its grid, arguments and split-K: STEPS K steps of 256 a
        program) for F16 and BF16 weights (QW) and one activation row (ROWS = 1): out [1, N] =
        round_activation(x) [1, K] . W [N, K], with x [K] float32 as it is, not rounded (xq, xd
        are not read), in steps of STEP values (DENSE16_STEP). The values of x are loaded at the
        tile's full shape (zero stride along n) so that Triton gives them the weights' layout:
        nothing moves through shared memory in the loop."""
        nb = tl.program_id(0)
        s = tl.program_id(1)
        n = nb * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
        k = tl.arange(0, STEP)[None, :]
        w_rows = w_ptr.to(tl.pointer_type(tl.uint16)) + tl.minimum(n, N - 1).to(tl.int64) * (w_row_bytes // 2)
        k0 = s * (STEPS * 256)
        k1 = tl.minimum(k0 + STEPS * 256, K)
        # a step may pass the program's slice or the row: the last of a slice of steps not a whole STEP
        MASKED: tl.constexpr = K % STEP != 0 or (SPLIT > 1 and STEPS * 256 % STEP != 0)
        acc = tl.zeros((BLOCK_N, STEP), tl.float32)
        if PDL:
            gdc_wait()
        for kk in range(k0, k1, STEP):
            if MASKED:
                live = kk + k < k1
                bits = tl.load(w_rows + kk + k, mask=live, other=0, eviction_policy="evict_first")
                x = tl.load(x_ptr + kk + k + n * 0, mask=live, other=0.0)
            else:
                bits = tl.load(w_rows + kk + k, eviction_policy="evict_first")
                x = tl.load(x_ptr + kk + k + n * 0)
            if QW == _F16:
                w = bits.to(tl.float16, bitcast=True).to(tl.float32)
                x = x.to(tl.float16).to(tl.float32)
            else:
                w = (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)
                x = _bf16_round(x)
            acc += w * x
        y = tl.sum(acc, axis=1)
        _dense_finish(y, y, y, y, y, y, y, y, part_ptr, out_ptr, count_ptr, nb, s, N, ROWS, SPLIT, BLOCK_N, INTERP)

    @triton.jit
    def _dense16_mma_kernel(xr_ptr, xq_ptr, xd_ptr, w_ptr, w_row_bytes, part_ptr, out_ptr, count_ptr, N,
                            K: tl.constexpr, QW: tl.constexpr, ROWS: tl.constexpr, SPLIT: tl.constexpr,
                            STEPS: tl.constexpr, BLOCK_N: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr):
        """_dense16_kernel's product for several activation rows, on tensor cores: per K step
        W [BLOCK_N, 256] . x^T [256, 16] (the rows padded to mma's 16 with zeros), in F16 or
        BF16 as the weights, which hold the rounded activation exactly (round_activation
        rounds it to the weights' type), products summed in float32. Elementwise, each row's
        sums would take a lane's registers 8 times over (a third of the bandwidth at 8 rows)."""
        nb = tl.program_id(0)
        s = tl.program_id(1)
        n = nb * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
        k = tl.arange(0, 256)[None, :]
        w_rows = w_ptr.to(tl.pointer_type(tl.uint16)) + tl.minimum(n, N - 1).to(tl.int64) * (w_row_bytes // 2)
        t = tl.arange(0, 16)[:, None]
        KP: tl.constexpr = (K + 255) // 256 * 256
        x_rows = xr_ptr + tl.minimum(t, ROWS - 1) * KP
        NS: tl.constexpr = (K + 255) // 256
        k0 = s * STEPS
        k1 = tl.minimum(k0 + STEPS, NS)
        acc = tl.zeros((BLOCK_N, 16), tl.float32)
        if PDL:
            gdc_wait()
        for ks in range(k0, k1):
            bits = _load16(w_rows, ks, k, K)
            x = tl.load(x_rows + ks * 256 + k, mask=(t < ROWS) & (k >= 0), other=0.0)
            if QW == _F16:
                acc = tl.dot(bits.to(tl.float16, bitcast=True), tl.trans(x.to(tl.float16)), acc)
            else:
                w = (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)
                if INTERP:  # numpy has no bfloat16: the same products of the same values in float32
                    acc = tl.dot(w, tl.trans(x), acc, input_precision="ieee")
                else:
                    acc = tl.dot(w.to(tl.bfloat16), tl.trans(x.to(tl.bfloat16)), acc)
        rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        live = rows < N
        dst = out_ptr if SPLIT == 1 else part_ptr + s.to(tl.int64) * (ROWS * N)
        cols = tl.arange(0, 16)[None, :]
        tl.store(dst + cols * N + rows[:, None], acc, mask=live[:, None] & (cols < ROWS))
        _dense_split_sum(part_ptr, out_ptr, count_ptr, nb, rows, live, N, ROWS, SPLIT, INTERP)

    # ---------------------------------------------------------------- planar Q8_0 dense products
    # Planar Q8_0 rows (layout.planar) hold a K step's 256 quants in 256 contiguous bytes, so for
    # one activation row a warp reads two steps of a weight row at once, as the 16-bit kernel
    # reads its rows: a tile [32 (g), BLOCK_N (rows), 4 (words)], lane g holding half-block g of
    # the step pair (16 contiguous bytes), 512 bytes a row per access, where the quantized tile
    # gives a row two lanes. Each lane dots its 16 quants with the activation's (dp4a) and
    # scales the sum by both blocks' scales, which it picks out of 16-byte runs of them: every
    # load of the tile has one shape and one contiguity (4 words), so Triton gives all one
    # layout and nothing moves through shared memory. Sums along K are reduced once, at the
    # end. It takes one row: at 4 and 8 its per-row registers make it far slower than the
    # quantized tile (H200, Mixtral's 4096 x 14336: 65.6 against 44.8 us, 130 against 58).

    @triton.jit
    def _row_tile(w_ptr, w_row_bytes, nb, N, BLOCK_N: tl.constexpr, PASSES: tl.constexpr = 1,
                  LANES: tl.constexpr = 32):
        """Row block nb of the tile [32 (g: lanes), BLOCK_N (n: weight rows), 4 (wd: words)]: its
        index tensors and its weight rows as int32 word pointers (rows past N read row N - 1).
        Where a program takes its rows in PASSES turns of BLOCK_N (N a multiple of PASSES), turn
        0's: rows nb * BLOCK_N * PASSES + PASSES * i (turn j's: j rows on, w_row_bytes // 4 * j
        words; rows past N read rows N - PASSES ... N - 1). LANES: 32 x the warps that lie along K
        (a warp's lanes take four K steps, the next warp's the next four)."""
        g = tl.arange(0, LANES)[:, None, None]
        n = nb * BLOCK_N * PASSES + tl.arange(0, BLOCK_N)[None, :, None] * PASSES
        wd = tl.arange(0, 4)[None, None, :]
        rows = tl.minimum(n, N - PASSES).to(tl.int64)
        return g, n, wd, w_ptr.to(tl.pointer_type(tl.int32)) + rows * (w_row_bytes // 4)

    @triton.jit
    def _ld3(ptr, REV: tl.constexpr, mask=None, WEIGHTS: tl.constexpr = False):
        """tl.load (masked, zeros elsewhere) of a [32, BLOCK_N, 4] tile with the lanes along its
        first axis whatever order this Triton gives dimensions of equal contiguity (REV: see _ld);
        also of a lane's one value, [32, BLOCK_N, 1], where its addresses tell Triton no contiguity
        (clamped: Triton would otherwise give a thread consecutive lanes' values, a layout the tile's
        sums then reach through shared memory). WEIGHTS: bytes read once, loaded evict-first, so
        that they do not push the activation out of L1 and L2 (H100, one row of Mixtral's 4096 x
        14336: Q4_K 17.28 against 17.97 us, planar Q8_0 26.72 against 27.55; Qwen3's 4096 x 2048 Q4_K
        4.91 against 5.43; one token's expert step within 2%, gpt-oss 26.23 against 27.48)."""
        policy: tl.constexpr = "evict_first" if WEIGHTS else ""
        if REV:
            if mask is None:
                v = tl.permute(tl.load(tl.permute(ptr, (1, 0, 2)), eviction_policy=policy), (1, 0, 2))
            else:
                v = tl.permute(tl.load(tl.permute(ptr, (1, 0, 2)), mask=tl.permute(mask, (1, 0, 2)), other=0,
                                       eviction_policy=policy), (1, 0, 2))
        elif mask is None:
            v = tl.load(ptr, eviction_policy=policy)
        else:
            v = tl.load(ptr, mask=mask, other=0, eviction_policy=policy)
        return v

    @triton.jit
    def _q8p_load(w_words, kp, k1, g, wd, NB: tl.constexpr, REV: tl.constexpr):
        """Step pair kp, kp + 1 (the second, or both, masked past k1): the lanes' quant words,
        and their blocks' weight scales picked out of the 16-byte runs of scales after the
        quants (the run of step kp + g // 16; unclamped: a partial last step's run lies in the
        scales' padding)."""
        blk = (kp + g // 16) * 8 + (g % 16) // 2
        live = (kp + g // 16 < k1) & (wd >= 0)
        w = _ld3(w_words + tl.minimum(blk, NB - 1) * 8 + (g % 2) * 4 + wd, REV, live, True)
        run = _ld3(w_words + NB * 8 + (kp + g // 16) * 4 + wd, REV, live, True)
        # block b of a run of 8 scales: half b % 2 of word b // 2 (b depends on the lane alone)
        word = tl.sum(tl.where(wd == (g % 16) // 4, run, 0), axis=2)
        half = word >> ((tl.arange(0, 32) % 16 // 2 % 2) * 16)[:, None]
        return w, _f16_bits(half & 0xFFFF)

    @triton.jit
    def _dense_q8p_kernel(xr_ptr, xq_ptr, xd_ptr, w_ptr, w_row_bytes, part_ptr, out_ptr, count_ptr, N,
                          K: tl.constexpr, QW: tl.constexpr, ROWS: tl.constexpr, SPLIT: tl.constexpr,
                          STEPS: tl.constexpr, BLOCK_N: tl.constexpr, INTERP: tl.constexpr, REV: tl.constexpr,
                          PDL: tl.constexpr):
        """_dense_kernel's product (its grid, arguments and split-K) for planar Q8_0 weights and
        one activation row (ROWS = 1), in the tile above: out [1, N] = rounded x [1, K] . W [N, K],
        from the activation's int8 quants xq and block scales xd (the values xr are not read)."""
        nb = tl.program_id(0)
        s = tl.program_id(1)
        g, n, wd, w_words = _row_tile(w_ptr, w_row_bytes, nb, N, BLOCK_N)
        NB: tl.constexpr = K // 32
        NS: tl.constexpr = (K + 255) // 256
        k0 = s * STEPS
        k1 = tl.minimum(k0 + STEPS, NS)
        acc = tl.zeros((32, BLOCK_N), tl.float32)
        w, dw = _q8p_load(w_words, k0, k1, g, wd, NB, REV)  # the next pair loads while this one is used
        if PDL:
            gdc_wait()
        for kp in range(k0, k1, 2):
            nw, ndw = _q8p_load(w_words, kp + 2, k1, g, wd, NB, REV)
            # the activation's quant words and the run of 4 block scales holding the lane's
            # (zero stride along the weight rows)
            blk = (kp + g // 16) * 8 + (g % 16) // 2 + n * 0 + wd * 0
            live = (kp + g // 16 < k1) & (n >= 0) & (wd >= 0)
            xq = _ld3(xq_ptr.to(tl.pointer_type(tl.int32)) + kp * 64 + g * 4 + wd + n * 0, REV, live)
            run = _ld3(xd_ptr.to(tl.pointer_type(tl.int32)) + blk // 4 * 4 + wd, REV, live)
            dx = tl.sum(tl.where(wd == blk % 4, run, 0), axis=2).to(tl.float32, bitcast=True)
            acc += tl.sum(_dp4a(w, xq, INTERP, True), axis=2).to(tl.float32) * (dw * dx)
            w, dw = nw, ndw
        y = tl.sum(acc, axis=0)
        _dense_finish(y, y, y, y, y, y, y, y, part_ptr, out_ptr, count_ptr, nb, s, N, ROWS, SPLIT, BLOCK_N, INTERP)

    # ---------------------------------------------------------------- K-quant and MXFP4 one-row dense products
    # The same idea for GGUF Q4_K / Q5_K rows, padded Q6_K and planar MXFP4, whose K step is one
    # block (144 / 176 / 224 bytes, 16-aligned) or eight (MXFP4: 8 x 16 quant bytes): a warp reads
    # four steps of a weight row at once. K-quants: eight lanes a block, lane g holding 16
    # contiguous bytes of block g // 8's quants (its piece g % 8), its block's 16-byte header
    # (Q6_K: its scales, and the run holding d; the block's eight lanes read one run) and, for
    # Q5_K / Q6_K, the 16 bytes of high bits its quants take: 576 (704, 896) contiguous bytes of
    # a row an access, where the quantized tile gives a row two lanes of 16. MXFP4: lane g holds
    # block g's 16 nibble bytes (512 contiguous bytes an access) and the 16-byte run of e8m0
    # scales holding its own (16 lanes read one run). Each lane picks its scales out of those
    # runs (which bytes depends on the lane: a select-and-sum over its own words).

    @triton.jit
    def _run_byte(run, wd, k3, k2):
        """Byte k of each lane's 16-byte run held as 4 words along wd; k per lane, given as
        [32, 1, 1] (k3) and [32, 1] (k2)."""
        word = tl.sum(tl.where(wd == k3 // 4, run, 0), axis=2)
        return (word >> ((k2 % 4) * 8)) & 255

    @triton.jit
    def _k4_lane_scale_min(hdr, wd, j3, j2):
        """get_scale_min_k4 of sub-block j (per lane) from Q4_K/Q5_K header runs."""
        a = _run_byte(hdr, wd, 4 + j3, 4 + j2)
        b = _run_byte(hdr, wd, 8 + j3, 8 + j2)
        e = _run_byte(hdr, wd, 4 + (j3 & 3), 4 + (j2 & 3))
        low = j2 < 4
        sc = tl.where(low, a & 63, (b & 15) | ((e >> 6) << 4))
        mn = tl.where(low, b & 63, (b >> 4) | ((a >> 6) << 4))
        return sc.to(tl.float32), mn.to(tl.float32)

    @triton.jit
    def _k4_load(w_words, kq, k1, g, wd, K: tl.constexpr, QW: tl.constexpr, REV: tl.constexpr,
                 SPAN: tl.constexpr):
        """Steps kq ... kq + SPAN - 1 (those from k1 on masked): the lanes' quant words, their header
        runs (Q8_0: scale runs; MXFP4: the lane's block's e8m0 scale, [32, BLOCK_N, 1]), their runs of
        high bits (Q5_K, Q6_K; Q8_0: a block's quants 16-31) and Q6_K's run holding d (unused ones
        repeat the quant words). SPAN 4: a
        warp's eight-lane groups take four steps of one row; SPAN 1: one step each, of their own
        rows (w_words says which)."""
        NS: tl.constexpr = (K + 255) // 256
        lane = g if SPAN == 4 else g % 8
        if QW == _MXFP4_PLANAR:  # qs[16] of every block | their e8m0 scales, zero-padded (layout.planar)
            NB: tl.constexpr = K // 32
            blk = kq * 8 + lane
            live = (blk < k1 * 8) & (blk < NB) & (wd >= 0)
            w = _ld3(w_words + tl.minimum(blk, NB - 1) * 4 + wd, REV, live, True)
            # the lane's block's scale byte (a warp's lanes read consecutive bytes); a block past the
            # row's end reads its last (its quants are 0)
            scales = (w_words + NB * 4).to(tl.pointer_type(tl.uint8))
            e = _ld3(scales + tl.minimum(blk, NB - 1), REV, None, True).to(tl.int32)
            out = w, e, w, w
        elif QW == _Q8_0_PLANAR:  # qs[32] of every block | their f16 scales, zero-padded: a lane a block
            NB8: tl.constexpr = K // 32
            blk = kq * 8 + lane
            live = (blk < k1 * 8) & (blk < NB8) & (wd >= 0)
            qs = w_words + tl.minimum(blk, NB8 - 1) * 8 + wd
            hdr = _ld3(w_words + NB8 * 8 + (blk // 8) * 4 + wd, REV, live, True)  # the run of the step's 8 scales
            out = _ld3(qs, REV, live, True), hdr, _ld3(qs + 4, REV, live, True), hdr
        else:
            blk = kq + lane // 8
            live = (blk < k1) & (wd >= 0)
            if QW == _Q4_K:  # d, dmin | scales[12] | qs[128]
                base = w_words + tl.minimum(blk, NS - 1) * 36
                w = _ld3(base + 4 + (g % 8) * 4 + wd, REV, live, True)
                out = w, _ld3(base + wd, REV, live, True), w, w  # the 16-byte header: d, dmin, scales
            elif QW == _Q5_K:  # d, dmin | scales[12] | qh[32] | qs[128]
                base = w_words + tl.minimum(blk, NS - 1) * 44
                w = _ld3(base + 12 + (g % 8) * 4 + wd, REV, live, True)
                qh = _ld3(base + 4 + (g % 2) * 4 + wd, REV, live, True)
                out = w, _ld3(base + wd, REV, live, True), qh, w
            else:  # padded Q6_K: ql[128] | qh[64] | scales[16] | d, zeros; piece c: qh bytes 32 (c // 4) + 16 (c % 2)
                base = w_words + tl.minimum(blk, NS - 1) * 56
                w = _ld3(base + (g % 8) * 4 + wd, REV, live, True)
                qh = _ld3(base + 32 + (g % 8 // 4 * 2 + g % 2) * 4 + wd, REV, live, True)
                out = w, _ld3(base + 48 + wd, REV, live, True), qh, _ld3(base + 52 + wd, REV, live, True)
        return out

    @triton.jit
    def _k4_dot(w, hdr, qh, dd, xq_ptr, xd_ptr, kq, k1, g, n, wd, K: tl.constexpr, QW: tl.constexpr,
                INTERP: tl.constexpr, REV: tl.constexpr, SPAN: tl.constexpr, SHARED: tl.constexpr = False):
        """Each lane's 32 values of steps kq ... kq + SPAN - 1 (_k4_load) dotted with the
        activation's int8 quants (Q8_K; MXFP4: Q8_0), scaled per group of values sharing scales,
        [LANES, BLOCK_N] (g's lanes: SPAN 4 steps a warp, its warps' steps one after another)."""
        LANES: tl.constexpr = g.shape[0]  # 32 a warp along K
        lane = g if SPAN == 4 else g % 8
        lane2 = tl.arange(0, LANES)[:, None] if SPAN == 4 else tl.arange(0, LANES)[:, None] % 8
        if QW == _MXFP4_PLANAR:
            # block blk: word wd of its nibbles (values 4wd .. 4wd + 3 low, 16 + 4wd .. high) with the
            # activation's words wd and 4 + wd, in the nibbles' order (_e2m1_dot)
            NB: tl.constexpr = K // 32
            blk = kq * 8 + lane + n * 0 + wd * 0
            live = (blk < k1 * 8) & (blk < NB)
            xw = xq_ptr.to(tl.pointer_type(tl.int32)) + blk * 8 + wd
            sw = tl.sum(_e2m1_dot(w, _ld3(xw, REV, live), _ld3(xw + 4, REV, live), INTERP, SHARED), axis=2)
            dw = _e8m0_half(hdr)  # hdr: the block's e8m0 scale
            # Q8_0's scale of the block (rows padded to whole K steps: a block past them reads the last)
            NS: tl.constexpr = (K + 255) // 256
            dx = _ld3(xd_ptr + tl.minimum(kq * 8 + lane + n * 0, NS * 8 - 1), REV)
            out = tl.sum(dw * dx, axis=2) * sw.to(tl.float32)
        elif QW == _Q8_0_PLANAR:  # a lane's block: quants 0-15 in w, 16-31 in qh; Q8_0 activations
            NB8: tl.constexpr = K // 32
            blk = kq * 8 + lane + n * 0 + wd * 0
            live = (blk < k1 * 8) & (blk < NB8)
            xw = xq_ptr.to(tl.pointer_type(tl.int32)) + blk * 8 + wd
            sw = tl.sum(_dp4a(w, _ld3(xw, REV, live), INTERP, True) + _dp4a(qh, _ld3(xw + 4, REV, live), INTERP, True),
                        axis=2)
            # block b of the run of 8 scales: half b % 2 of word b // 2
            b2 = (kq * 8 + lane2) % 8
            word = tl.sum(tl.where(wd == (kq * 8 + lane) % 8 // 2, hdr, 0), axis=2)
            dw = _f16_bits((word >> (b2 % 2 * 16)) & 0xFFFF)
            run = _ld3(xd_ptr.to(tl.pointer_type(tl.int32)) + blk // 4 * 4 + wd, REV, live)
            dx = tl.sum(tl.where(wd == blk % 4, run, 0), axis=2).to(tl.float32, bitcast=True)
            out = (dw * dx) * sw.to(tl.float32)
        else:
            blk = kq + lane // 8 + n * 0 + wd * 0
            live = (blk < k1)
            # Q8_K's scale of the block: the first word of a run of 4 at 8 words a step
            run = _ld3(xd_ptr.to(tl.pointer_type(tl.int32)) + blk * 8 + wd, REV, live)
            dx = tl.sum(tl.where(wd == 0, run, 0), axis=2).to(tl.float32, bitcast=True)
            xw = xq_ptr.to(tl.pointer_type(tl.int32)) + blk * 64 + wd
            if QW == _Q6_K_PADDED:
                # piece c = g % 8 holds ql bytes 16c ...: half h = c // 4, a = c // 2 % 2, o = c % 2; low
                # nibbles are values 128h + 32a + 16o + i (scale 8h + 2a + o), high ones 64 on (scale
                # + 4); top bits from qh at shift 2a (+ 4). 6-bit quants less 32 in the sums.
                c3 = g % 8
                c2 = tl.arange(0, LANES)[:, None] % 8
                sh = c3 // 2 % 2 * 2
                q0 = (w & 0x0F0F0F0F) | (((qh >> sh) & 0x03030303) << 4)
                q1 = ((w >> 4) & 0x0F0F0F0F) | (((qh >> (sh + 4)) & 0x03030303) << 4)
                xlo = _ld3(xw + c3 // 4 * 32 + c3 % 4 * 4, REV, live)
                xhi = _ld3(xw + c3 // 4 * 32 + c3 % 4 * 4 + 16, REV, live)
                ones = xlo * 0 + 0x01010101
                s0 = tl.sum(_dp4a(q0, xlo, INTERP) - 32 * _dp4a(ones, xlo, INTERP), axis=2).to(tl.float32)
                s1 = tl.sum(_dp4a(q1, xhi, INTERP) - 32 * _dp4a(ones, xhi, INTERP), axis=2).to(tl.float32)
                si3 = c3 // 4 * 8 + c3 // 2 % 2 * 2 + c3 % 2
                si2 = c2 // 4 * 8 + c2 // 2 % 2 * 2 + c2 % 2
                b0 = _run_byte(hdr, wd, si3, si2)
                b1 = _run_byte(hdr, wd, si3 + 4, si2 + 4)
                sc0 = (b0 - ((b0 & 128) << 1)).to(tl.float32)
                sc1 = (b1 - ((b1 & 128) << 1)).to(tl.float32)
                d = _f16_bits(tl.sum(tl.where(wd == 0, dd, 0), axis=2) & 0xFFFF)
                out = dx * ((d * sc0) * s0 + (d * sc1) * s1)
            else:
                c3 = g % 8 // 2
                c2 = tl.arange(0, LANES)[:, None] % 8 // 2
                qlo = w & 0x0F0F0F0F
                qhi = (w >> 4) & 0x0F0F0F0F
                # Q5_K: qh byte i's bit 2c is the fifth bit of low nibble i of sub-block 2c, bit 2c + 1 the high's
                if QW == _Q5_K:
                    qlo = qlo | (((qh >> (c3 * 2)) & 0x01010101) << 4)
                    qhi = qhi | (((qh >> (c3 * 2 + 1)) & 0x01010101) << 4)
                # the activation's quant words of the lane's values (low nibbles; high ones 32 values on)
                xlo = _ld3(xw + c3 * 16 + (g % 2) * 4, REV, live)
                xhi = _ld3(xw + c3 * 16 + (g % 2) * 4 + 8, REV, live)
                ones = xlo * 0 + 0x01010101
                slo = tl.sum(_dp4a(qlo, xlo, INTERP), axis=2).to(tl.float32)
                shi = tl.sum(_dp4a(qhi, xhi, INTERP), axis=2).to(tl.float32)
                blo = tl.sum(_dp4a(ones, xlo, INTERP), axis=2).to(tl.float32)
                bhi = tl.sum(_dp4a(ones, xhi, INTERP), axis=2).to(tl.float32)
                w0 = tl.sum(tl.where(wd == 0, hdr, 0), axis=2)
                d = _f16_bits(w0 & 0xFFFF)
                dmin = _f16_bits((w0 >> 16) & 0xFFFF)
                sc0, mn0 = _k4_lane_scale_min(hdr, wd, c3 * 2, c2 * 2)
                sc1, mn1 = _k4_lane_scale_min(hdr, wd, c3 * 2 + 1, c2 * 2 + 1)
                out = dx * (((d * sc0) * slo - (dmin * mn0) * blo) + ((d * sc1) * shi - (dmin * mn1) * bhi))
        return out

    @triton.jit
    def _k4_sums(w, hdr, qh, dd, w_words, xq_ptr, xd_ptr, k0, k1, g, n, wd, K: tl.constexpr, QW: tl.constexpr,
                 BLOCK_N: tl.constexpr, INTERP: tl.constexpr, REV: tl.constexpr, SPAN: tl.constexpr):
        """The row tile's sums over K steps k0 ... k1 of one weight: (w, hdr, qh, dd) are its first
        SPAN steps, loaded by the caller (which may wait for x meanwhile); each next SPAN load while
        these are used. SPAN 4: [BLOCK_N], a row a tile column; SPAN 1: [4 * BLOCK_N], rows
        4c ... 4c + 3 in column c (the eight-lane groups' own rows, _down_row_program)."""
        acc = tl.zeros((32, BLOCK_N), tl.float32)
        for kq in range(k0, k1, SPAN):
            nw, nhdr, nqh, ndd = _k4_load(w_words, kq + SPAN, k1, g, wd, K, QW, REV, SPAN)
            acc += _k4_dot(w, hdr, qh, dd, xq_ptr, xd_ptr, kq, k1, g, n, wd, K, QW, INTERP, REV, SPAN)
            w, hdr, qh, dd = nw, nhdr, nqh, ndd
        return _k4_rows(acc, BLOCK_N, SPAN)

    @triton.jit
    def _k4_rows(acc, BLOCK_N: tl.constexpr, SPAN: tl.constexpr):
        """The row tile's per-lane sums acc [32, BLOCK_N] added up per row (see _k4_sums)."""
        if SPAN == 4:
            y = tl.sum(acc, axis=0)
        else:
            y = tl.reshape(tl.permute(tl.sum(tl.reshape(acc, (4, 8, BLOCK_N)), axis=1), (1, 0)), (4 * BLOCK_N,))
        return y

    @triton.jit
    def _dense_k4_kernel(xr_ptr, xq_ptr, xd_ptr, w_ptr, w_row_bytes, part_ptr, out_ptr, count_ptr, N,
                         K: tl.constexpr, QW: tl.constexpr, ROWS: tl.constexpr, SPLIT: tl.constexpr,
                         STEPS: tl.constexpr, BLOCK_N: tl.constexpr, INTERP: tl.constexpr, REV: tl.constexpr,
                         PDL: tl.constexpr, K_WARPS: tl.constexpr = 1):
        """_dense_kernel's product (its grid, arguments and split-K) for Q4_K, Q5_K, padded Q6_K,
        planar MXFP4 or Q8_0 weights (QW) and 1-8 activation rows, in the tile above: out [ROWS, N]
        = rounded x [ROWS, K] . W [N, K], from the activation's int8 quants xq and scales xd (xr is
        not read); each weight load serves every row (llama.cpp's mmvq does the same). K_WARPS:
        warps side by side along K, 4 K steps each an access (the program's warps, its rows in
        each), their sums added at the end; 1: a program's warps split its rows."""
        nb = tl.program_id(0)
        s = tl.program_id(1)
        g, n, wd, w_words = _row_tile(w_ptr, w_row_bytes, nb, N, BLOCK_N, 1, 32 * K_WARPS)
        NS: tl.constexpr = (K + 255) // 256
        k0 = s * STEPS
        k1 = tl.minimum(k0 + STEPS, NS)
        w, hdr, qh, dd = _k4_load(w_words, k0, k1, g, wd, K, QW, REV, 4)
        if PDL:
            gdc_wait()
        a0 = tl.zeros((32 * K_WARPS, BLOCK_N), tl.float32)
        a1 = a0
        a2 = a0
        a3 = a0
        a4 = a0
        a5 = a0
        a6 = a0
        a7 = a0
        for kq in range(k0, k1, 4 * K_WARPS):
            nw, nhdr, nqh, ndd = _k4_load(w_words, kq + 4 * K_WARPS, k1, g, wd, K, QW, REV, 4)
            a0 = _k4_row(a0, 0, ROWS, w, hdr, qh, dd, xq_ptr, xd_ptr, kq, k1, g, n, wd, K, QW, INTERP, REV)
            a1 = _k4_row(a1, 1, ROWS, w, hdr, qh, dd, xq_ptr, xd_ptr, kq, k1, g, n, wd, K, QW, INTERP, REV)
            a2 = _k4_row(a2, 2, ROWS, w, hdr, qh, dd, xq_ptr, xd_ptr, kq, k1, g, n, wd, K, QW, INTERP, REV)
            a3 = _k4_row(a3, 3, ROWS, w, hdr, qh, dd, xq_ptr, xd_ptr, kq, k1, g, n, wd, K, QW, INTERP, REV)
            a4 = _k4_row(a4, 4, ROWS, w, hdr, qh, dd, xq_ptr, xd_ptr, kq, k1, g, n, wd, K, QW, INTERP, REV)
            a5 = _k4_row(a5, 5, ROWS, w, hdr, qh, dd, xq_ptr, xd_ptr, kq, k1, g, n, wd, K, QW, INTERP, REV)
            a6 = _k4_row(a6, 6, ROWS, w, hdr, qh, dd, xq_ptr, xd_ptr, kq, k1, g, n, wd, K, QW, INTERP, REV)
            a7 = _k4_row(a7, 7, ROWS, w, hdr, qh, dd, xq_ptr, xd_ptr, kq, k1, g, n, wd, K, QW, INTERP, REV)
            w, hdr, qh, dd = nw, nhdr, nqh, ndd
        _dense_finish(tl.sum(a0, axis=0), tl.sum(a1, axis=0), tl.sum(a2, axis=0), tl.sum(a3, axis=0),
                      tl.sum(a4, axis=0), tl.sum(a5, axis=0), tl.sum(a6, axis=0), tl.sum(a7, axis=0),
                      part_ptr, out_ptr, count_ptr, nb, s, N, ROWS, SPLIT, BLOCK_N, INTERP)

    @triton.jit
    def _k4_row(acc, t: tl.constexpr, ROWS: tl.constexpr, w, hdr, qh, dd, xq_ptr, xd_ptr, kq, k1, g, n, wd,
                K: tl.constexpr, QW: tl.constexpr, INTERP: tl.constexpr, REV: tl.constexpr):
        """acc of activation row t += these steps (_k4_dot), where the launch has more than t rows."""
        if t < ROWS:
            KP: tl.constexpr = (K + 255) // 256 * 256
            acc += _k4_dot(w, hdr, qh, dd, xq_ptr + t * KP, xd_ptr + t * (KP // 32), kq, k1, g, n, wd, K, QW,
                           INTERP, REV, 4, ROWS > 1)
        return acc

    # gate/up in the same tile, for the same types' experts at one token (_gate_up_kernel's grid,
    # arguments, results and end): a pair's BLOCK_N rows of gate and up a program, four K steps
    # a warp's access.

    @triton.jit
    def _gate_up_row_program(p, nb, s, xg_ptr, xgq_ptr, xgd_ptr, xu_ptr, xuq_ptr, xud_ptr,
                             g_ptr, g_slot_bytes, g_row_bytes, u_ptr, u_slot_bytes, u_row_bytes,
                             gb_ptr, ub_ptr, h_ptr, hr_ptr, hq_ptr, hd_ptr, part_ptr, count_ptr,
                             pair_tok, pair_slot, pair_exp, n_pairs, split, steps,
                             x_flags, h_flags, epoch, state_ptr, timeout_ns,
                             N: tl.constexpr, K: tl.constexpr, QG: tl.constexpr, QU: tl.constexpr,
                             SAME_X: tl.constexpr, VT_DOWN: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
                             BLOCK_N: tl.constexpr, PASSES: tl.constexpr, INTERP: tl.constexpr, REV: tl.constexpr,
                             STEP: tl.constexpr, WAIT_X: tl.constexpr, PDL: tl.constexpr):
        """Program (p, nb, s) of _gate_up_k4_kernel: its BLOCK_N rows in PASSES turns (_row_tile),
        the last steps of a turn loaded with the next turn's first (so a program's loads never
        stop), one end for them all (_gate_up_finish: one semaphore, one h rounding)."""
        if PDL:
            gdc_launch_dependents()
        tok = tl.load(pair_tok + p).to(tl.int64)
        slot_or_none = tl.load(pair_slot + p)
        if slot_or_none < 0:  # no slot here (see _gate_up_tile_program)
            return
        slot = slot_or_none.to(tl.int64)
        R: tl.constexpr = BLOCK_N // PASSES
        g, n, wd, g_words = _row_tile(g_ptr + slot * g_slot_bytes, g_row_bytes, nb, N, R, PASSES)
        _, _, _, u_words = _row_tile(u_ptr + slot * u_slot_bytes, u_row_bytes, nb, N, R, PASSES)
        NS: tl.constexpr = (K + 255) // 256
        xgq_row = xgq_ptr + tok * (NS * 256)
        xgd_row = xgd_ptr + tok * (NS * 8)
        if SAME_X:
            xuq_row = xgq_row
            xud_row = xgd_row
        else:
            xuq_row = xuq_ptr + tok * (NS * 256)
            xud_row = xud_ptr + tok * (NS * 8)
        k0 = s * steps
        k1 = tl.minimum(k0 + steps, NS)
        gw, gh, gq, gd = _k4_load(g_words, k0, k1, g, wd, K, QG, REV, 4)  # the next four load while these are used
        uw, uh, uq, ud = _k4_load(u_words, k0, k1, g, wd, K, QU, REV, 4)
        if WAIT_X:  # the first steps' weights are on their way meanwhile
            _await(x_flags + tok * NS + k0, k1 - k0, epoch, state_ptr, timeout_ns, INTERP)
        if PDL:  # the same, while the launch before ends
            gdc_wait()
        if PASSES > 1:
            turn = tl.arange(0, PASSES)[None, :]
            sums_g = tl.zeros((R, PASSES), tl.float32)
            sums_u = tl.zeros((R, PASSES), tl.float32)
        for j in tl.static_range(PASSES):
            acc_g = tl.zeros((32, R), tl.float32)
            acc_u = tl.zeros((32, R), tl.float32)
            for kq in range(k0, k1, 4):
                if j + 1 < PASSES:  # after this turn's last steps, the next turn's first
                    # (a row on in arithmetic: a selected pointer would lose its alignment, and
                    # its loads their width)
                    turn_on = (kq + 4 >= k1).to(tl.int64)
                    nk = kq + 4 - turn_on * (kq + 4 - k0)
                    ngw, ngh, ngq, ngd = _k4_load(g_words + turn_on * (g_row_bytes // 4), nk, k1, g, wd, K, QG, REV,
                                                  4)
                    nuw, nuh, nuq, nud = _k4_load(u_words + turn_on * (u_row_bytes // 4), nk, k1, g, wd, K, QU, REV,
                                                  4)
                else:
                    ngw, ngh, ngq, ngd = _k4_load(g_words, kq + 4, k1, g, wd, K, QG, REV, 4)
                    nuw, nuh, nuq, nud = _k4_load(u_words, kq + 4, k1, g, wd, K, QU, REV, 4)
                acc_g += _k4_dot(gw, gh, gq, gd, xgq_row, xgd_row, kq, k1, g, n, wd, K, QG, INTERP, REV, 4)
                acc_u += _k4_dot(uw, uh, uq, ud, xuq_row, xud_row, kq, k1, g, n, wd, K, QU, INTERP, REV, 4)
                gw, gh, gq, gd = ngw, ngh, ngq, ngd
                uw, uh, uq, ud = nuw, nuh, nuq, nud
            if PASSES > 1:
                sums_g += tl.where(turn == j, tl.sum(acc_g, axis=0)[:, None], 0.0)
                sums_u += tl.where(turn == j, tl.sum(acc_u, axis=0)[:, None], 0.0)
                g_words += g_row_bytes // 4
                u_words += u_row_bytes // 4
        if PASSES > 1:  # row i * PASSES + j of the program's: turn j's row i
            g_sums = tl.reshape(sums_g, (BLOCK_N,))
            u_sums = tl.reshape(sums_u, (BLOCK_N,))
        else:
            g_sums = tl.sum(acc_g, axis=0)
            u_sums = tl.sum(acc_u, axis=0)
        _gate_up_finish(g_sums, u_sums, nb * BLOCK_N + tl.arange(0, BLOCK_N), p, nb, s, split, n_pairs, gb_ptr,
                        ub_ptr, h_ptr, hr_ptr, hq_ptr, hd_ptr, part_ptr, count_ptr, pair_exp, h_flags, epoch, N,
                        VT_DOWN, ACT, HAS_BIAS, BLOCK_N, INTERP, STEP)

    # Over several tokens (GROUP of them, 2-8) the row tiles let one program serve every pair of
    # a slot: pairs come sorted by slot, a slot at most once a token, so a slot's pairs are a run
    # of up to GROUP; its first pair's programs lead (so does every GROUP-th pair, which bounds a
    # run whatever the order) and load each weight once for the run's tokens, as llama.cpp's mmvq
    # loads a dense weight once for up to 8 rows; the run's other programs end at once. Each
    # pair's sums are the ungrouped tile's, in the same order: the same bits.

    @triton.jit
    def _follows(pair_slot, p, slot, GROUP: tl.constexpr):
        """Whether pair p, of slot `slot`, is a member of the run before it (runs of at most GROUP)."""
        return (p % GROUP != 0) & (tl.load(pair_slot + tl.maximum(p - 1, 0)) == slot)

    @triton.jit
    def _run_member(pair_slot, q, n_pairs, slot, before, GROUP: tl.constexpr):
        """Whether pair q, the pair after a member (`before`), belongs to the run `slot` leads."""
        same = tl.load(pair_slot + tl.minimum(q, n_pairs - 1)) == slot
        return before & (q < n_pairs) & (q % GROUP != 0) & same

    @triton.jit
    def _run_tok(pair_tok, q, n_pairs):
        return tl.load(pair_tok + tl.minimum(q, n_pairs - 1)).to(tl.int64)

    @triton.jit
    def _k4_member(acc_g, acc_u, m: tl.constexpr, GROUP: tl.constexpr, member, tok, gw, gh, gq, gd, uw, uh, uq,
                   ud, xgq_ptr, xgd_ptr, xuq_ptr, xud_ptr, kq, k1, g, n, wd, K: tl.constexpr, QG: tl.constexpr,
                   QU: tl.constexpr, SAME_X: tl.constexpr, INTERP: tl.constexpr, REV: tl.constexpr):
        """Run member m's gate and up sums += these four K steps, where it is one."""
        if m < GROUP:
            if member:
                NS: tl.constexpr = (K + 255) // 256
                xgq_row = xgq_ptr + tok * (NS * 256)
                xgd_row = xgd_ptr + tok * (NS * 8)
                acc_g += _k4_dot(gw, gh, gq, gd, xgq_row, xgd_row, kq, k1, g, n, wd, K, QG, INTERP, REV, 4, GROUP > 1)
                if SAME_X:
                    acc_u += _k4_dot(uw, uh, uq, ud, xgq_row, xgd_row, kq, k1, g, n, wd, K, QU, INTERP, REV, 4,
                                     GROUP > 1)
                else:
                    acc_u += _k4_dot(uw, uh, uq, ud, xuq_ptr + tok * (NS * 256), xud_ptr + tok * (NS * 8), kq, k1,
                                     g, n, wd, K, QU, INTERP, REV, 4, GROUP > 1)
        return acc_g, acc_u

    @triton.jit
    def _gate_up_member_end(acc_g, acc_u, m: tl.constexpr, GROUP: tl.constexpr, member, rows, p, nb, s, split,
                            n_pairs, gb_ptr, ub_ptr, h_ptr, hr_ptr, hq_ptr, hd_ptr, part_ptr, count_ptr, pair_exp,
                            N: tl.constexpr, VT_DOWN: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
                            BLOCK_N: tl.constexpr, INTERP: tl.constexpr):
        """_gate_up_finish for run member m (pair p + m), where it is one."""
        if m < GROUP:
            if member:
                _gate_up_finish(tl.sum(acc_g, axis=0), tl.sum(acc_u, axis=0), rows, p + m, nb, s, split, n_pairs,
                                gb_ptr, ub_ptr, h_ptr, hr_ptr, hq_ptr, hd_ptr, part_ptr, count_ptr, pair_exp,
                                count_ptr, 0, N, VT_DOWN, ACT, HAS_BIAS, BLOCK_N, INTERP, False)

    @triton.jit
    def _gate_up_run_program(p, nb, s, xgq_ptr, xgd_ptr, xuq_ptr, xud_ptr,
                             g_ptr, g_slot_bytes, g_row_bytes, u_ptr, u_slot_bytes, u_row_bytes,
                             gb_ptr, ub_ptr, h_ptr, hr_ptr, hq_ptr, hd_ptr, part_ptr, count_ptr,
                             pair_tok, pair_slot, pair_exp, n_pairs, split, steps,
                             N: tl.constexpr, K: tl.constexpr, QG: tl.constexpr, QU: tl.constexpr,
                             SAME_X: tl.constexpr, VT_DOWN: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
                             BLOCK_N: tl.constexpr, GROUP: tl.constexpr, INTERP: tl.constexpr, REV: tl.constexpr,
                             PDL: tl.constexpr):
        """Program (p, nb, s) of _gate_up_k4_kernel over GROUP tokens: _gate_up_row_program's
        (rows at once) for the run of pairs pair p leads."""
        if PDL:
            gdc_launch_dependents()
        slot = tl.load(pair_slot + p)
        if slot < 0:  # no slot here (see _gate_up_tile_program)
            return
        if _follows(pair_slot, p, slot, GROUP):
            return  # its leader takes it
        g, n, wd, g_words = _row_tile(g_ptr + slot.to(tl.int64) * g_slot_bytes, g_row_bytes, nb, N, BLOCK_N)
        _, _, _, u_words = _row_tile(u_ptr + slot.to(tl.int64) * u_slot_bytes, u_row_bytes, nb, N, BLOCK_N)
        k0 = s * steps
        k1 = tl.minimum(k0 + steps, (K + 255) // 256)
        gw, gh, gq, gd = _k4_load(g_words, k0, k1, g, wd, K, QG, REV, 4)
        uw, uh, uq, ud = _k4_load(u_words, k0, k1, g, wd, K, QU, REV, 4)
        m1 = _run_member(pair_slot, p + 1, n_pairs, slot, slot >= 0, GROUP)
        m2 = _run_member(pair_slot, p + 2, n_pairs, slot, m1, GROUP)
        m3 = _run_member(pair_slot, p + 3, n_pairs, slot, m2, GROUP)
        m4 = _run_member(pair_slot, p + 4, n_pairs, slot, m3, GROUP)
        m5 = _run_member(pair_slot, p + 5, n_pairs, slot, m4, GROUP)
        m6 = _run_member(pair_slot, p + 6, n_pairs, slot, m5, GROUP)
        m7 = _run_member(pair_slot, p + 7, n_pairs, slot, m6, GROUP)
        t0 = _run_tok(pair_tok, p, n_pairs)
        t1 = _run_tok(pair_tok, p + 1, n_pairs)
        t2 = _run_tok(pair_tok, p + 2, n_pairs)
        t3 = _run_tok(pair_tok, p + 3, n_pairs)
        t4 = _run_tok(pair_tok, p + 4, n_pairs)
        t5 = _run_tok(pair_tok, p + 5, n_pairs)
        t6 = _run_tok(pair_tok, p + 6, n_pairs)
        t7 = _run_tok(pair_tok, p + 7, n_pairs)
        if PDL:  # the first steps' weights are on their way while the launch before ends
            gdc_wait()
        g0 = tl.zeros((32, BLOCK_N), tl.float32)
        u0 = g0
        g1 = g0
        u1 = g0
        g2 = g0
        u2 = g0
        g3 = g0
        u3 = g0
        g4 = g0
        u4 = g0
        g5 = g0
        u5 = g0
        g6 = g0
        u6 = g0
        g7 = g0
        u7 = g0
        for kq in range(k0, k1, 4):
            ngw, ngh, ngq, ngd = _k4_load(g_words, kq + 4, k1, g, wd, K, QG, REV, 4)
            nuw, nuh, nuq, nud = _k4_load(u_words, kq + 4, k1, g, wd, K, QU, REV, 4)
            g0, u0 = _k4_member(g0, u0, 0, GROUP, True, t0, gw, gh, gq, gd, uw, uh, uq, ud, xgq_ptr, xgd_ptr, xuq_ptr,
                                xud_ptr, kq, k1, g, n, wd, K, QG, QU, SAME_X, INTERP, REV)
            g1, u1 = _k4_member(g1, u1, 1, GROUP, m1, t1, gw, gh, gq, gd, uw, uh, uq, ud, xgq_ptr, xgd_ptr, xuq_ptr,
                                xud_ptr, kq, k1, g, n, wd, K, QG, QU, SAME_X, INTERP, REV)
            g2, u2 = _k4_member(g2, u2, 2, GROUP, m2, t2, gw, gh, gq, gd, uw, uh, uq, ud, xgq_ptr, xgd_ptr, xuq_ptr,
                                xud_ptr, kq, k1, g, n, wd, K, QG, QU, SAME_X, INTERP, REV)
            g3, u3 = _k4_member(g3, u3, 3, GROUP, m3, t3, gw, gh, gq, gd, uw, uh, uq, ud, xgq_ptr, xgd_ptr, xuq_ptr,
                                xud_ptr, kq, k1, g, n, wd, K, QG, QU, SAME_X, INTERP, REV)
            g4, u4 = _k4_member(g4, u4, 4, GROUP, m4, t4, gw, gh, gq, gd, uw, uh, uq, ud, xgq_ptr, xgd_ptr, xuq_ptr,
                                xud_ptr, kq, k1, g, n, wd, K, QG, QU, SAME_X, INTERP, REV)
            g5, u5 = _k4_member(g5, u5, 5, GROUP, m5, t5, gw, gh, gq, gd, uw, uh, uq, ud, xgq_ptr, xgd_ptr, xuq_ptr,
                                xud_ptr, kq, k1, g, n, wd, K, QG, QU, SAME_X, INTERP, REV)
            g6, u6 = _k4_member(g6, u6, 6, GROUP, m6, t6, gw, gh, gq, gd, uw, uh, uq, ud, xgq_ptr, xgd_ptr, xuq_ptr,
                                xud_ptr, kq, k1, g, n, wd, K, QG, QU, SAME_X, INTERP, REV)
            g7, u7 = _k4_member(g7, u7, 7, GROUP, m7, t7, gw, gh, gq, gd, uw, uh, uq, ud, xgq_ptr, xgd_ptr, xuq_ptr,
                                xud_ptr, kq, k1, g, n, wd, K, QG, QU, SAME_X, INTERP, REV)
            gw, gh, gq, gd = ngw, ngh, ngq, ngd
            uw, uh, uq, ud = nuw, nuh, nuq, nud
        rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        _gate_up_member_end(g0, u0, 0, GROUP, True, rows, p, nb, s, split, n_pairs, gb_ptr, ub_ptr, h_ptr, hr_ptr,
                            hq_ptr, hd_ptr, part_ptr, count_ptr, pair_exp, N, VT_DOWN, ACT, HAS_BIAS, BLOCK_N, INTERP)
        _gate_up_member_end(g1, u1, 1, GROUP, m1, rows, p, nb, s, split, n_pairs, gb_ptr, ub_ptr, h_ptr, hr_ptr,
                            hq_ptr, hd_ptr, part_ptr, count_ptr, pair_exp, N, VT_DOWN, ACT, HAS_BIAS, BLOCK_N, INTERP)
        _gate_up_member_end(g2, u2, 2, GROUP, m2, rows, p, nb, s, split, n_pairs, gb_ptr, ub_ptr, h_ptr, hr_ptr,
                            hq_ptr, hd_ptr, part_ptr, count_ptr, pair_exp, N, VT_DOWN, ACT, HAS_BIAS, BLOCK_N, INTERP)
        _gate_up_member_end(g3, u3, 3, GROUP, m3, rows, p, nb, s, split, n_pairs, gb_ptr, ub_ptr, h_ptr, hr_ptr,
                            hq_ptr, hd_ptr, part_ptr, count_ptr, pair_exp, N, VT_DOWN, ACT, HAS_BIAS, BLOCK_N, INTERP)
        _gate_up_member_end(g4, u4, 4, GROUP, m4, rows, p, nb, s, split, n_pairs, gb_ptr, ub_ptr, h_ptr, hr_ptr,
                            hq_ptr, hd_ptr, part_ptr, count_ptr, pair_exp, N, VT_DOWN, ACT, HAS_BIAS, BLOCK_N, INTERP)
        _gate_up_member_end(g5, u5, 5, GROUP, m5, rows, p, nb, s, split, n_pairs, gb_ptr, ub_ptr, h_ptr, hr_ptr,
                            hq_ptr, hd_ptr, part_ptr, count_ptr, pair_exp, N, VT_DOWN, ACT, HAS_BIAS, BLOCK_N, INTERP)
        _gate_up_member_end(g6, u6, 6, GROUP, m6, rows, p, nb, s, split, n_pairs, gb_ptr, ub_ptr, h_ptr, hr_ptr,
                            hq_ptr, hd_ptr, part_ptr, count_ptr, pair_exp, N, VT_DOWN, ACT, HAS_BIAS, BLOCK_N, INTERP)
        _gate_up_member_end(g7, u7, 7, GROUP, m7, rows, p, nb, s, split, n_pairs, gb_ptr, ub_ptr, h_ptr, hr_ptr,
                            hq_ptr, hd_ptr, part_ptr, count_ptr, pair_exp, N, VT_DOWN, ACT, HAS_BIAS, BLOCK_N, INTERP)

    @triton.jit(do_not_specialize=["n_pairs", "steps"])
    def _gate_up_k4_kernel(xg_ptr, xgq_ptr, xgd_ptr, xu_ptr, xuq_ptr, xud_ptr,
                           g_ptr, g_slot_bytes, g_row_bytes, u_ptr, u_slot_bytes, u_row_bytes,
                           gb_ptr, ub_ptr, h_ptr, hr_ptr, hq_ptr, hd_ptr, part_ptr, count_ptr,
                           pair_tok, pair_slot, pair_exp, n_pairs, split, steps,
                           N: tl.constexpr, K: tl.constexpr, QG: tl.constexpr, QU: tl.constexpr,
                           SAME_X: tl.constexpr, VT_DOWN: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
                           BLOCK_N: tl.constexpr, UNROLL: tl.constexpr, PASSES: tl.constexpr,
                           GROUP: tl.constexpr, INTERP: tl.constexpr, REV: tl.constexpr, PDL: tl.constexpr):
        """_gate_up_kernel for Q4_K, Q5_K, padded Q6_K, planar MXFP4 or Q8_0 gate and up weights (QG, QU),
        lanes along K, a program's BLOCK_N rows in PASSES turns, or over GROUP > 1 tokens a run of
        pairs of one slot at once (UNROLL unused)."""
        if GROUP > 1:
            _gate_up_run_program(tl.program_id(0), tl.program_id(1), tl.program_id(2), xgq_ptr, xgd_ptr, xuq_ptr,
                                 xud_ptr, g_ptr, g_slot_bytes, g_row_bytes, u_ptr, u_slot_bytes, u_row_bytes, gb_ptr,
                                 ub_ptr, h_ptr, hr_ptr, hq_ptr, hd_ptr, part_ptr, count_ptr, pair_tok, pair_slot,
                                 pair_exp, n_pairs, split, steps, N, K, QG, QU, SAME_X, VT_DOWN, ACT, HAS_BIAS,
                                 BLOCK_N, GROUP, INTERP, REV, PDL)
        else:
            _gate_up_row_program(tl.program_id(0), tl.program_id(1), tl.program_id(2), xg_ptr, xgq_ptr, xgd_ptr,
                                 xu_ptr, xuq_ptr, xud_ptr, g_ptr, g_slot_bytes, g_row_bytes, u_ptr, u_slot_bytes,
                                 u_row_bytes, gb_ptr, ub_ptr, h_ptr, hr_ptr, hq_ptr, hd_ptr, part_ptr, count_ptr,
                                 pair_tok, pair_slot, pair_exp, n_pairs, split, steps, count_ptr, count_ptr, 0,
                                 count_ptr, 0, N, K, QG, QU, SAME_X, VT_DOWN, ACT, HAS_BIAS, BLOCK_N, PASSES, INTERP,
                                 REV, False, False, PDL)

    # down in the same tile (_down_kernel's grid, arguments and results; hr and UNROLL unused): a
    # pair's BLOCK_N rows a program over all K steps of h, one token's default (expert_down_tile).
    # Under four K steps (Qwen3's K = 768: three, which left a quarter of the lanes idle) each eight
    # lanes take a row of their own.

    @triton.jit
    def _down_row_tile(w_ptr, w_row_bytes, nb, N, BLOCK_N: tl.constexpr, SPAN: tl.constexpr):
        """_row_tile for down's row tile: under four K steps (SPAN 1) lane g of column c takes row
        4c + g // 8 of the program's 4 * BLOCK_N."""
        if SPAN == 4:
            g, n, wd, words = _row_tile(w_ptr, w_row_bytes, nb, N, BLOCK_N)
        else:
            g = tl.arange(0, 32)[:, None, None]
            n = tl.arange(0, BLOCK_N)[None, :, None]
            wd = tl.arange(0, 4)[None, None, :]
            row = tl.minimum(nb * BLOCK_N * 4 + n * 4 + g // 8, N - 1).to(tl.int64)
            words = w_ptr.to(tl.pointer_type(tl.int32)) + row * (w_row_bytes // 4)
        return g, n, wd, words

    @triton.jit
    def _down_row_program(p, nb, hq_ptr, hd_ptr, d_ptr, d_slot_bytes, d_row_bytes, db_ptr, wt_ptr, wt_stride_tok,
                          out_ptr, out_stride_pos, out_stride_tok, pair_tok, pair_pos, pair_slot, pair_exp, N,
                          h_flags, epoch, state_ptr, timeout_ns, K: tl.constexpr, QD: tl.constexpr,
                          HAS_BIAS: tl.constexpr, WEIGHTED: tl.constexpr, BLOCK_N: tl.constexpr,
                          INTERP: tl.constexpr, REV: tl.constexpr, STEP: tl.constexpr, PDL: tl.constexpr):
        """Program (p, nb) of _down_k4_kernel; in one launch (STEP) it waits for the pair's h. Under
        four K steps (Qwen3's K = 768) a warp's eight-lane groups take a step each of rows of their
        own, so that none idles: a program then covers 4 * BLOCK_N rows (down_rows_per_program)."""
        slot_or_none = tl.load(pair_slot + p)
        if slot_or_none < 0:  # no slot here (see _gate_up_tile_program)
            return
        NS: tl.constexpr = (K + 255) // 256
        SPAN: tl.constexpr = 1 if NS < 4 else 4
        ROWS: tl.constexpr = BLOCK_N * 4 // SPAN
        g, n, wd, d_words = _down_row_tile(d_ptr + slot_or_none.to(tl.int64) * d_slot_bytes, d_row_bytes, nb, N,
                                           BLOCK_N, SPAN)
        p64 = p.to(tl.int64)
        xq_row = hq_ptr + p64 * (NS * 256)
        xd_row = hd_ptr + p64 * (NS * 8)
        w, hdr, qh, dd = _k4_load(d_words, 0, NS, g, wd, K, QD, REV, SPAN)
        if SPAN == 1:  # under four K steps every step's weights are on their way before the wait
            if NS > 1:
                w1, hdr1, qh1, dd1 = _k4_load(d_words, 1, NS, g, wd, K, QD, REV, SPAN)
            if NS > 2:
                w2, hdr2, qh2, dd2 = _k4_load(d_words, 2, NS, g, wd, K, QD, REV, SPAN)
        if STEP:  # the first steps' weights are on their way meanwhile
            _await(h_flags + p * NS, NS, epoch, state_ptr, timeout_ns, INTERP)
        if PDL:  # the same, while the launch before ends
            gdc_wait()
        if SPAN == 1:  # _k4_sums' order: step 0, 1, 2
            acc = tl.zeros((32, BLOCK_N), tl.float32)
            acc += _k4_dot(w, hdr, qh, dd, xq_row, xd_row, 0, NS, g, n, wd, K, QD, INTERP, REV, SPAN)
            if NS > 1:
                acc += _k4_dot(w1, hdr1, qh1, dd1, xq_row, xd_row, 1, NS, g, n, wd, K, QD, INTERP, REV, SPAN)
            if NS > 2:
                acc += _k4_dot(w2, hdr2, qh2, dd2, xq_row, xd_row, 2, NS, g, n, wd, K, QD, INTERP, REV, SPAN)
            y = _k4_rows(acc, BLOCK_N, SPAN)
        else:
            y = _k4_sums(w, hdr, qh, dd, d_words, xq_row, xd_row, 0, NS, g, n, wd, K, QD, BLOCK_N, INTERP, REV,
                         SPAN)
        _down_store(y, nb * ROWS + tl.arange(0, ROWS), p, db_ptr, wt_ptr, wt_stride_tok,
                    out_ptr, out_stride_pos, out_stride_tok, pair_tok, pair_pos, pair_exp, N, HAS_BIAS, WEIGHTED)

    @triton.jit
    def _k4_down_member(acc, m: tl.constexpr, GROUP: tl.constexpr, member, p, w, hdr, qh, dd, hq_ptr, hd_ptr, kq,
                        g, n, wd, K: tl.constexpr, QD: tl.constexpr, INTERP: tl.constexpr, REV: tl.constexpr,
                        SPAN: tl.constexpr):
        """Run member m's (pair p + m's) down sums += these SPAN K steps, where it is one."""
        if m < GROUP:
            if member:
                NS: tl.constexpr = (K + 255) // 256
                q = (p + m).to(tl.int64)
                acc += _k4_dot(w, hdr, qh, dd, hq_ptr + q * (NS * 256), hd_ptr + q * (NS * 8), kq, NS, g, n, wd, K,
                               QD, INTERP, REV, SPAN, GROUP > 1)
        return acc

    @triton.jit
    def _down_member_end(acc, m: tl.constexpr, GROUP: tl.constexpr, member, rows, p, db_ptr, wt_ptr, wt_stride_tok,
                         out_ptr, out_stride_pos, out_stride_tok, pair_tok, pair_pos, pair_exp, N,
                         HAS_BIAS: tl.constexpr, WEIGHTED: tl.constexpr, BLOCK_N: tl.constexpr, SPAN: tl.constexpr):
        """_down_store for run member m (pair p + m), where it is one."""
        if m < GROUP:
            if member:
                _down_store(_k4_rows(acc, BLOCK_N, SPAN), rows, p + m, db_ptr, wt_ptr, wt_stride_tok, out_ptr,
                            out_stride_pos, out_stride_tok, pair_tok, pair_pos, pair_exp, N, HAS_BIAS, WEIGHTED)

    @triton.jit
    def _down_run_program(p, nb, n_pairs, hq_ptr, hd_ptr, d_ptr, d_slot_bytes, d_row_bytes, db_ptr, wt_ptr,
                          wt_stride_tok, out_ptr, out_stride_pos, out_stride_tok, pair_tok, pair_pos, pair_slot,
                          pair_exp, N, K: tl.constexpr, QD: tl.constexpr, HAS_BIAS: tl.constexpr,
                          WEIGHTED: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr, INTERP: tl.constexpr,
                          REV: tl.constexpr, PDL: tl.constexpr):
        """Program (p, nb) of _down_k4_kernel over GROUP tokens: _down_row_program's (its rows, its
        sums' order) for the run of pairs pair p leads."""
        slot = tl.load(pair_slot + p)
        if slot < 0:  # no slot here (see _gate_up_tile_program)
            return
        if _follows(pair_slot, p, slot, GROUP):
            return  # its leader takes it
        NS: tl.constexpr = (K + 255) // 256
        SPAN: tl.constexpr = 1 if NS < 4 else 4
        g, n, wd, d_words = _down_row_tile(d_ptr + slot.to(tl.int64) * d_slot_bytes, d_row_bytes, nb, N, BLOCK_N,
                                           SPAN)
        w, hdr, qh, dd = _k4_load(d_words, 0, NS, g, wd, K, QD, REV, SPAN)
        m1 = _run_member(pair_slot, p + 1, n_pairs, slot, slot >= 0, GROUP)
        m2 = _run_member(pair_slot, p + 2, n_pairs, slot, m1, GROUP)
        m3 = _run_member(pair_slot, p + 3, n_pairs, slot, m2, GROUP)
        m4 = _run_member(pair_slot, p + 4, n_pairs, slot, m3, GROUP)
        m5 = _run_member(pair_slot, p + 5, n_pairs, slot, m4, GROUP)
        m6 = _run_member(pair_slot, p + 6, n_pairs, slot, m5, GROUP)
        m7 = _run_member(pair_slot, p + 7, n_pairs, slot, m6, GROUP)
        if PDL:  # the first steps' weights are on their way while the launch before ends
            gdc_wait()
        a0 = tl.zeros((32, BLOCK_N), tl.float32)
        a1 = a0
        a2 = a0
        a3 = a0
        a4 = a0
        a5 = a0
        a6 = a0
        a7 = a0
        for kq in range(0, NS, SPAN):
            nw, nhdr, nqh, ndd = _k4_load(d_words, kq + SPAN, NS, g, wd, K, QD, REV, SPAN)
            a0 = _k4_down_member(a0, 0, GROUP, True, p, w, hdr, qh, dd, hq_ptr, hd_ptr, kq, g, n, wd, K, QD, INTERP,
                                 REV, SPAN)
            a1 = _k4_down_member(a1, 1, GROUP, m1, p, w, hdr, qh, dd, hq_ptr, hd_ptr, kq, g, n, wd, K, QD, INTERP,
                                 REV, SPAN)
            a2 = _k4_down_member(a2, 2, GROUP, m2, p, w, hdr, qh, dd, hq_ptr, hd_ptr, kq, g, n, wd, K, QD, INTERP,
                                 REV, SPAN)
            a3 = _k4_down_member(a3, 3, GROUP, m3, p, w, hdr, qh, dd, hq_ptr, hd_ptr, kq, g, n, wd, K, QD, INTERP,
                                 REV, SPAN)
            a4 = _k4_down_member(a4, 4, GROUP, m4, p, w, hdr, qh, dd, hq_ptr, hd_ptr, kq, g, n, wd, K, QD, INTERP,
                                 REV, SPAN)
            a5 = _k4_down_member(a5, 5, GROUP, m5, p, w, hdr, qh, dd, hq_ptr, hd_ptr, kq, g, n, wd, K, QD, INTERP,
                                 REV, SPAN)
            a6 = _k4_down_member(a6, 6, GROUP, m6, p, w, hdr, qh, dd, hq_ptr, hd_ptr, kq, g, n, wd, K, QD, INTERP,
                                 REV, SPAN)
            a7 = _k4_down_member(a7, 7, GROUP, m7, p, w, hdr, qh, dd, hq_ptr, hd_ptr, kq, g, n, wd, K, QD, INTERP,
                                 REV, SPAN)
            w, hdr, qh, dd = nw, nhdr, nqh, ndd
        rows = nb * (BLOCK_N * 4 // SPAN) + tl.arange(0, BLOCK_N * 4 // SPAN)
        _down_member_end(a0, 0, GROUP, True, rows, p, db_ptr, wt_ptr, wt_stride_tok, out_ptr, out_stride_pos,
                         out_stride_tok, pair_tok, pair_pos, pair_exp, N, HAS_BIAS, WEIGHTED, BLOCK_N, SPAN)
        _down_member_end(a1, 1, GROUP, m1, rows, p, db_ptr, wt_ptr, wt_stride_tok, out_ptr, out_stride_pos,
                         out_stride_tok, pair_tok, pair_pos, pair_exp, N, HAS_BIAS, WEIGHTED, BLOCK_N, SPAN)
        _down_member_end(a2, 2, GROUP, m2, rows, p, db_ptr, wt_ptr, wt_stride_tok, out_ptr, out_stride_pos,
                         out_stride_tok, pair_tok, pair_pos, pair_exp, N, HAS_BIAS, WEIGHTED, BLOCK_N, SPAN)
        _down_member_end(a3, 3, GROUP, m3, rows, p, db_ptr, wt_ptr, wt_stride_tok, out_ptr, out_stride_pos,
                         out_stride_tok, pair_tok, pair_pos, pair_exp, N, HAS_BIAS, WEIGHTED, BLOCK_N, SPAN)
        _down_member_end(a4, 4, GROUP, m4, rows, p, db_ptr, wt_ptr, wt_stride_tok, out_ptr, out_stride_pos,
                         out_stride_tok, pair_tok, pair_pos, pair_exp, N, HAS_BIAS, WEIGHTED, BLOCK_N, SPAN)
        _down_member_end(a5, 5, GROUP, m5, rows, p, db_ptr, wt_ptr, wt_stride_tok, out_ptr, out_stride_pos,
                         out_stride_tok, pair_tok, pair_pos, pair_exp, N, HAS_BIAS, WEIGHTED, BLOCK_N, SPAN)
        _down_member_end(a6, 6, GROUP, m6, rows, p, db_ptr, wt_ptr, wt_stride_tok, out_ptr, out_stride_pos,
                         out_stride_tok, pair_tok, pair_pos, pair_exp, N, HAS_BIAS, WEIGHTED, BLOCK_N, SPAN)
        _down_member_end(a7, 7, GROUP, m7, rows, p, db_ptr, wt_ptr, wt_stride_tok, out_ptr, out_stride_pos,
                         out_stride_tok, pair_tok, pair_pos, pair_exp, N, HAS_BIAS, WEIGHTED, BLOCK_N, SPAN)

    @triton.jit
    def _down_k4_kernel(hr_ptr, hq_ptr, hd_ptr, d_ptr, d_slot_bytes, d_row_bytes, db_ptr, wt_ptr, wt_stride_tok,
                        out_ptr, out_stride_pos, out_stride_tok, pair_tok, pair_pos, pair_slot, pair_exp, N,
                        K: tl.constexpr, QD: tl.constexpr, HAS_BIAS: tl.constexpr, WEIGHTED: tl.constexpr,
                        BLOCK_N: tl.constexpr, UNROLL: tl.constexpr, GROUP: tl.constexpr, INTERP: tl.constexpr,
                        REV: tl.constexpr, PDL: tl.constexpr):
        """_down_kernel for Q4_K, Q5_K, padded Q6_K, planar MXFP4 or Q8_0 down weights (QD), lanes along
        K; over GROUP > 1 tokens a run of pairs of one slot at once."""
        if GROUP > 1:
            _down_run_program(tl.program_id(0), tl.program_id(1), tl.num_programs(0), hq_ptr, hd_ptr, d_ptr,
                              d_slot_bytes, d_row_bytes, db_ptr, wt_ptr, wt_stride_tok, out_ptr, out_stride_pos,
                              out_stride_tok, pair_tok, pair_pos, pair_slot, pair_exp, N, K, QD, HAS_BIAS, WEIGHTED,
                              BLOCK_N, GROUP, INTERP, REV, PDL)
        else:
            _down_row_program(tl.program_id(0), tl.program_id(1), hq_ptr, hd_ptr, d_ptr, d_slot_bytes, d_row_bytes,
                              db_ptr, wt_ptr, wt_stride_tok, out_ptr, out_stride_pos, out_stride_tok, pair_tok,
                              pair_pos, pair_slot, pair_exp, N, pair_slot, 0, pair_slot, 0, K, QD, HAS_BIAS, WEIGHTED,
                              BLOCK_N, INTERP, REV, False, PDL)

    @triton.jit
    def _round_x_program(r, x_ptr, x_stride, xg_ptr, xgq_ptr, xgd_ptr, xu_ptr, xuq_ptr, xud_ptr, x_flags, epoch,
                         K: tl.constexpr, VT_G: tl.constexpr, VT_U: tl.constexpr, SAME_X: tl.constexpr,
                         INTERP: tl.constexpr):
        """Program r of the step's rounding: K step r % NS of token r // NS rounded for the gate
        type and, unless it rounds alike, the up type; then x_flags[r] published."""
        NS: tl.constexpr = (K + 255) // 256
        _round_row_step(x_ptr, x_stride, xg_ptr, xgq_ptr, xgd_ptr, xgd_ptr, r // NS, r % NS, K, VT_G, INTERP, False)
        if not SAME_X:
            _round_row_step(x_ptr, x_stride, xu_ptr, xuq_ptr, xud_ptr, xud_ptr, r // NS, r % NS, K, VT_U, INTERP,
                            False)
        _publish(x_flags + r, epoch, tl.arange(0, 2), INTERP)

    # The one-launch step (experts_forward(one_launch=True)): a 1-D grid of n_rounds rounding
    # programs (tokens x K steps; none where x was rounded before), then gate/up's, then down's,
    # both pair by pair (gate/up: a pair's row blocks, each block's K slices together), so that
    # the first pairs' h is ready by the time their down programs are dispatched, which is only
    # once every gate/up program was. All take the one num_warps, and the registers of the
    # largest of them.
    @triton.jit(do_not_specialize=["n_pairs", "steps", "n_rounds", "d_blocks"])
    def _expert_step_kernel(x_ptr, x_stride, xg_ptr, xgq_ptr, xgd_ptr, xu_ptr, xuq_ptr, xud_ptr,
                            g_ptr, g_slot_bytes, g_row_bytes, u_ptr, u_slot_bytes, u_row_bytes,
                            gb_ptr, ub_ptr, h_ptr, hr_ptr, hq_ptr, hd_ptr, part_ptr, count_ptr,
                            d_ptr, d_slot_bytes, d_row_bytes, db_ptr, wt_ptr, wt_stride_tok,
                            out_ptr, out_stride_pos, out_stride_tok, pair_tok, pair_pos, pair_slot, pair_exp,
                            n_pairs, split, steps, n_rounds, d_out, d_blocks, state_ptr, timeout_ns,
                            N: tl.constexpr, K: tl.constexpr, QG: tl.constexpr, QU: tl.constexpr, QD: tl.constexpr,
                            SAME_X: tl.constexpr, VT_G: tl.constexpr, VT_U: tl.constexpr, VT_DOWN: tl.constexpr,
                            ACT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DOWN_BIAS: tl.constexpr,
                            WEIGHTED: tl.constexpr, ROW: tl.constexpr, DOWN_ROW: tl.constexpr, BLOCK_G: tl.constexpr,
                            BLOCK_D: tl.constexpr, PASSES_G: tl.constexpr, UNROLL: tl.constexpr,
                            UNROLL_DOWN: tl.constexpr, ROUND_X: tl.constexpr, INTERP: tl.constexpr,
                            REV: tl.constexpr):
        """Round x (ROUND_X; else x* hold x rounded), gate/up (the row tile where ROW, else the
        quantized tile; BLOCK_G rows, in PASSES_G turns in the row tile) and down (the row tile
        where DOWN_ROW, else the quantized tile; BLOCK_D rows) in one grid. The arguments of the
        three kernels, down's programs a pair (d_blocks: down_rows_per_program), and the step state
        at state_ptr: epoch, programs ended, a wait timed out, x's flags [n_rounds], h's
        [pairs, N / 256]."""
        pid = tl.program_id(0)
        epoch = tl.load(state_ptr, volatile=True) + 1
        x_flags = state_ptr + 3
        h_flags = x_flags + n_rounds
        NBG: tl.constexpr = (N + BLOCK_G - 1) // BLOCK_G
        n_gate_up = n_pairs * NBG * split
        if pid < n_rounds:
            if ROUND_X:
                _round_x_program(pid, x_ptr, x_stride, xg_ptr, xgq_ptr, xgd_ptr, xu_ptr, xuq_ptr, xud_ptr, x_flags,
                                 epoch, K, VT_G, VT_U, SAME_X, INTERP)
        elif pid < n_rounds + n_gate_up:
            q = pid - n_rounds
            s = q % split
            nb = q // split % NBG
            p = q // (split * NBG)
            if ROW:
                _gate_up_row_program(p, nb, s, xg_ptr, xgq_ptr, xgd_ptr, xu_ptr, xuq_ptr, xud_ptr, g_ptr,
                                     g_slot_bytes, g_row_bytes, u_ptr, u_slot_bytes, u_row_bytes, gb_ptr, ub_ptr,
                                     h_ptr, hr_ptr, hq_ptr, hd_ptr, part_ptr, count_ptr, pair_tok, pair_slot,
                                     pair_exp, n_pairs, split, steps, x_flags, h_flags, epoch, state_ptr, timeout_ns,
                                     N, K, QG, QU, SAME_X, VT_DOWN, ACT, HAS_BIAS, BLOCK_G, PASSES_G, INTERP, REV,
                                     True, ROUND_X, False)
            else:
                _gate_up_tile_program(p, nb, s, xg_ptr, xgq_ptr, xgd_ptr, xu_ptr, xuq_ptr, xud_ptr, g_ptr,
                                      g_slot_bytes, g_row_bytes, u_ptr, u_slot_bytes, u_row_bytes, gb_ptr, ub_ptr,
                                      h_ptr, hr_ptr, hq_ptr, hd_ptr, part_ptr, count_ptr, pair_tok, pair_slot,
                                      pair_exp, n_pairs, split, steps, x_flags, h_flags, epoch, state_ptr, timeout_ns,
                                      N, K, QG, QU, SAME_X, VT_DOWN, ACT, HAS_BIAS, BLOCK_G, UNROLL, INTERP, REV,
                                      True, ROUND_X, False)
        else:
            q = pid - n_rounds - n_gate_up
            if DOWN_ROW:
                _down_row_program(q // d_blocks, q % d_blocks, hq_ptr, hd_ptr, d_ptr, d_slot_bytes, d_row_bytes,
                                  db_ptr, wt_ptr, wt_stride_tok, out_ptr, out_stride_pos, out_stride_tok, pair_tok,
                                  pair_pos, pair_slot, pair_exp, d_out, h_flags, epoch, state_ptr, timeout_ns, N, QD,
                                  HAS_DOWN_BIAS, WEIGHTED, BLOCK_D, INTERP, REV, True, False)
            else:
                _down_program(q // d_blocks, q % d_blocks, hr_ptr, hq_ptr, hd_ptr, d_ptr, d_slot_bytes, d_row_bytes,
                              db_ptr, wt_ptr, wt_stride_tok, out_ptr, out_stride_pos, out_stride_tok, pair_tok,
                              pair_pos, pair_slot, pair_exp, d_out, h_flags, epoch, state_ptr, timeout_ns, N, QD,
                              HAS_DOWN_BIAS, WEIGHTED, BLOCK_D, UNROLL_DOWN, INTERP, REV, True, False)
        # The last program to end (all others have read the epoch) sets it for the next launch.
        if tl.atomic_add(state_ptr + 1, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
            tl.store(state_ptr + 1, 0)
            tl.store(state_ptr, epoch)

    @triton.jit
    def _order_probe_kernel(ptr):
        i = tl.arange(0, 2)[:, None, None] * 1000 + tl.arange(0, 4)[None, :, None] * 100 \
            + tl.arange(0, 4)[None, None, :]
        tl.store(ptr + i, tl.load(ptr + i) + 1.0)


# -------------------------------------------------------------------- host side

@functools.lru_cache(maxsize=None)
def reversed_ties(target=None) -> bool:
    """Whether this Triton orders a load's dimensions of equal contiguity by descending index
    (the kernels' REV): read off a tiny probe compiled (not run) for `target` (default: the
    current GPU). Triton 3.6 orders them ascending; later releases descending."""
    if INTERPRETED or triton is None:
        return False
    from triton.compiler import ASTSource

    if target is None:
        target = triton.runtime.driver.active.get_current_target()
    probe = triton.compile(ASTSource(_order_probe_kernel, {"ptr": "*fp32"}, {}, {}), target=target,
                           options={"num_warps": 1})
    m = re.search(r"order = \[2, (\d), (\d)\]", probe.asm["ttgir"])
    if m is None:
        raise RuntimeError("could not read the load layout order of the Triton probe kernel")
    return (m.group(1), m.group(2)) == ("1", "0")


PROGRAMS_PER_SM = 4  # programs wanted per SM (split-K's target): enough loads in flight to cover HBM latency
RUN_MAX_TOKENS = 8  # the row tiles' run programs keep one accumulator a token
# pairs a run program serves by default (TileConfig.group): H100, 8 tokens, both row tiles in runs of
# 2 / 4 / 8: Qwen3 Q8_0 87.16 / 96.29 / 111.87 us, Q6_K 97.53 / 109.58 / 124.03, gpt-oss MXFP4 213.12 /
# 214.11 / 237.66 (fewer live accumulators, more programs that lead)
RUN_GROUP = 2


@dataclass(frozen=True)
class TileConfig:
    block_n: int  # weight rows per program (quantized tiles: a warp covers 16 rows, two lanes per row)
    # (num_warps: warps per program; more than block_n / 16 of them cost layout conversions)
    num_warps: int
    unroll: bool = False  # the expert tiles: K steps fully unrolled, or a loop that loads one step ahead
    num_stages: int = 1  # Triton's own pipeliner: only the 16-bit tensor-core product has work for it
    programs_per_sm: int = PROGRAMS_PER_SM  # SplitK.choose's target for this tile
    maxnreg: int | None = None  # registers a thread may take (None: as many as ptxas wants), for occupancy
    # gate/up's row tile: a program takes its block_n rows in this many turns of block_n / passes
    # (rows per program against registers: the turns share them)
    passes: int = 1
    # the row tiles over several tokens: a program serves at most this many pairs of a slot's run
    # (run_group; fewer pairs, fewer live accumulators and registers, more programs that lead)
    group: int = RUN_GROUP
    # the lanes-along-K dense tile: warps side by side along K (num_warps of them, each with all the
    # program's rows), or 1: warps split the rows
    k_warps: int = 1


# The expert kernels' tiles and their defaults (expert_tile, expert_down_tile and gate_up_config pick):
#   "tile"  the quantized tile ("weight tiles" above), every type and token count (_gate_up_kernel,
#           _down_kernel). It puts two lanes on a row and 16 rows on a warp, so BLOCK_N = 16 x
#           num_warps gives each lane pair one row; 2 warps and 32 rows keep enough programs for
#           decode (Qwen3-30B: 8 pairs x 24 of them for gate/up); 32 x num_warps gives a lane two.
#   "row"   ROW_TILE_TYPES at one token; at 2-8 tokens gate/up of planar Q8_0, padded Q6_K and planar
#           MXFP4 (_GATE_UP_ROW_TYPES), down of planar Q8_0 and padded Q6_K (_DOWN_RUN_TYPES): a warp's
#           lanes along each weight row, four K steps an access (_gate_up_k4_kernel, _down_k4_kernel;
#           BLOCK_N rows on num_warps warps). H100, one token's step of Qwen3-30B (gpt-oss-120b for
#           MXFP4), down in it against the quantized tile: 16.86 / 18.61 us Q4_K, 19.01 / 22.08 Q6_K,
#           23.19 / 27.60 Q8_0, 40.14 / 43.03 MXFP4; planar Q8_0's gate/up in it too: 21.00. Over 4 and
#           8 tokens the quantized tile stays faster for Q4_K's gate/up (H100, gate/up in row turns:
#           43.79 / 72.27 against 41.45 / 70.53 us).
# `moestudio bench kernels --sweep` times the alternatives on the device.
GATE_UP_CONFIG: dict[str, TileConfig] = {"tile": TileConfig(32, 2), "row": TileConfig(4, 4)}
# gate/up's row tile: 8 rows a program in two turns of 4 (TileConfig.passes), which fit Qwen3's
# one-token gate/up in 0.73 of a wave where 4 rows at once took 1.45 (H100: Q4_K 17.58 against 18.61
# us, Q6_K 20.60 against 22.08, planar Q8_0's step 18.82 against 21.11; planar MXFP4, since its decode
# split by sign, gpt-oss's step 27.07 against 28.01). Every gate/up in the row tile takes them, one
# token's or several's (a pair a program: runs take no turns). H100, Qwen3's 8-token step (gpt-oss's
# for MXFP4), gate/up in turns against the default before: planar Q8_0 76.71 against 85.01 us in runs
# of 2 (4 tokens 50.23 against 54.59), padded Q6_K 84.45 against 86.47 in the quantized tile (2 tokens
# 31.64 against 35.48), planar MXFP4 128.17 against 132.59 (4 tokens 78.19 against 90.45)
GATE_UP_ROW_IN_TURNS = TileConfig(8, 4, passes=2)
DOWN_CONFIG: dict[str, TileConfig] = {"tile": TileConfig(32, 2), "row": TileConfig(4, 4)}
# Exceptions by (tile, kernel type) to GATE_UP_CONFIG (gate and up of that one type) and DOWN_CONFIG.
# Planar MXFP4's quantized tiles under a cap of 128 registers (H100, gpt-oss-120b's 8-token step
# 155.30 against 164.92 us; its gate/up took 136 on sm_90); its down row on 2 warps (one token's step
# 38.67 against 40.63 us on 4). The cap slows Q6_K's gate/up tile (168 registers: 105.79 against 92.25).
# Q4_K's gate/up tile (2-8 tokens) under the same cap: it compiles to 128 registers with or without it (sm_90,
# the same 1,048 instructions), but ptxas then orders them otherwise. H100, Qwen3's 2 / 4 / 8-token step in
# two runs, capped against the default timed before and after the other configs: 25.67 / 41.24 / 69.06 us
# against 26.85-27.32 / 41.38-42.00 / 70.17-70.24; 26.04 / 41.04 / 69.50 against 26.96-27.61 / 41.62-41.70
# / 70.17-70.55.
_TILE_CAPPED = TileConfig(32, 2, maxnreg=128)  # MXFP4's two tiles (timed capped together), Q4_K's gate/up
GATE_UP_BY_TYPE: dict[tuple[str, int], TileConfig] = {("tile", MXFP4_PLANAR): _TILE_CAPPED,
                                                       ("tile", int(QT.Q4_K)): _TILE_CAPPED}
DOWN_BY_TYPE: dict[tuple[str, int], TileConfig] = {("tile", MXFP4_PLANAR): _TILE_CAPPED,
                                                   ("row", MXFP4_PLANAR): TileConfig(4, 2)}
# the types the lanes-along-K kernels read (_dense_k4_kernel, _gate_up_k4_kernel, _down_k4_kernel)
ROW_TILE_TYPES = (int(QT.Q4_K), int(QT.Q5_K), Q6_K_PADDED, MXFP4_PLANAR, Q8_0_PLANAR)
# gate/up in the row tile over 2-8 tokens: planar Q8_0 (both row tiles in runs took Qwen3's 8 tokens in
# 87.16 against 101.38 us in the quantized tiles; 2 tokens 37.11 against 40.35), then padded Q6_K and
# planar MXFP4 in turns (GATE_UP_ROW_IN_TURNS); Q4_K and Q5_K stay in the quantized tile (see the tiles)
_GATE_UP_ROW_TYPES = (Q8_0_PLANAR, Q6_K_PADDED, MXFP4_PLANAR)
# down in the row tile's runs of RUN_GROUP pairs over 2-8 tokens: planar Q8_0 and padded Q6_K (H100,
# Qwen3's 8-token step with gate/up in the quantized tile 86.11 against 92.25 us; Q4_K_M's, down Q6_K,
# 74.24 against 79.16; Q4_K 71.50 against 69.52, MXFP4 169.21 against 164.92)
_DOWN_RUN_TYPES = (Q8_0_PLANAR, Q6_K_PADDED)


def _row_tokens(types: tuple[int, ...], tokens: int, several: tuple[int, ...]) -> bool:
    """Whether a launch over `tokens` tokens' pairs and weights of kernel types `types` takes the row
    tile: at one token every type it reads, at 2-RUN_MAX_TOKENS the types of `several`."""
    return set(types) <= set(ROW_TILE_TYPES) and (
        tokens == 1 or (tokens <= RUN_MAX_TOKENS and set(types) <= set(several)))


def expert_tile(qg: int, qu: int, tokens: int) -> str:
    """The tile (a GATE_UP_CONFIG key) of a gate/up launch over `tokens` tokens' pairs and
    weights of kernel types `qg`, `qu` (kernel_type)."""
    return "row" if _row_tokens((qg, qu), tokens, _GATE_UP_ROW_TYPES) else "tile"


def expert_down_tile(qd: int, tokens: int) -> str:
    """The tile (a DOWN_CONFIG key) of a down launch over `tokens` tokens' pairs and weights of
    kernel type `qd`: one default for the three launches and the one-launch step, whose results
    are then the same bits."""
    return "row" if _row_tokens((qd,), tokens, _DOWN_RUN_TYPES) else "tile"


def run_group(tile: str, cfg: TileConfig, tokens: int) -> int:
    """The GROUP constexpr of a row-tile launch over `tokens` tokens' pairs in `cfg`: at 2-8
    tokens each program serves the run of pairs of its slot, up to cfg.group of them (1: a pair
    a program; also for rows in turns, which runs do not take)."""
    return min(tokens, cfg.group) if tile == "row" and 1 < tokens <= RUN_MAX_TOKENS and cfg.passes == 1 else 1


def gate_up_config(tile: str, qg: int, qu: int, n_ff: int) -> TileConfig:
    """The default config of gate/up's tile `tile` (any number of tokens' pairs), weights of kernel
    types `qg`, `qu` and `n_ff` rows: the row tile's in turns where its rows divide into them."""
    if tile == "row" and n_ff % GATE_UP_ROW_IN_TURNS.passes == 0:
        return GATE_UP_ROW_IN_TURNS
    return GATE_UP_BY_TYPE.get((tile, qg), GATE_UP_CONFIG[tile]) if qg == qu else GATE_UP_CONFIG[tile]


def down_config(tile: str, qd: int) -> TileConfig:
    """The default config of down's tile `tile` over weights of kernel type `qd`."""
    return DOWN_BY_TYPE.get((tile, qd), DOWN_CONFIG[tile])


_ACT = {"silu": 0, "swiglu_oai": 1}


def supports(w) -> bool:
    """Whether these kernels can run the experts `w` (engine.layers.moe.ExpertWeights)."""
    if triton is None or w.activation not in _ACT:
        return False
    return all(t.qtype in KERNEL_TYPES for t in (w.gate, w.up, w.down))


def _launch_opts(cfg: TileConfig | None, dependent: bool = False) -> dict:
    """Triton's launch options for tile `cfg`; `dependent`: a programmatic dependent launch
    (dependent_launches says where the device has them)."""
    if INTERPRETED or cfg is None:
        return {}
    return {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
            **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}), **({"launch_pdl": True} if dependent else {})}


@functools.lru_cache(maxsize=None)
def dependent_launches(device: str) -> bool:
    """Whether launches on `device` can be programmatic dependents (PDL: sm_90 and later, with a
    Triton that launches them). A dependent launch's programs start once every program of the
    launch before it has started; they load what does not depend on it (pair tables, the first
    weights) and wait for its end (gdc_wait) before reading its results or writing anything. So a
    launch is made dependent only where the launch before it is this step's own, and the tables
    it reads early were written before that one began: gate/up after the step's rounding of x,
    down after gate/up (experts_forward), the dense product after its rounding (dense). The
    kernels compiled for such a device wait and let their dependents start in any launch (a
    no-op where nothing depends)."""
    dev = torch.device(device)
    if INTERPRETED or triton is None or dev.type != "cuda":
        return False
    from triton.backends.nvidia.compiler import CUDAOptions

    return "launch_pdl" in CUDAOptions.__dataclass_fields__ and torch.cuda.get_device_capability(dev)[0] >= 9


def kernel_type(qtype: QT, rows: torch.Tensor, K: int) -> int:
    """The kernels' type id for weight rows `rows` [..., row_bytes] of `qtype` with K values
    a row: Q6_K_PADDED, MXFP4_PLANAR or Q8_0_PLANAR where they are in layout.kernel_layout's
    layout, else the GGUF type id."""
    laid_out = is_padded_q6_k(rows, qtype, K) or is_planar(rows, qtype, K)
    return LAID_OUT_TYPES[qtype] if laid_out else int(qtype)


def _vt(qtype: QT, grouped: bool = False) -> int:
    """The kernels' vec-dot type id of activations for weights of qtype: activation_type's, but for
    MXFP4 in the decode kernels (not the grouped GEMM's) Q8_0_NIBBLES."""
    from engine.quant.activation import activation_type

    return Q8_0_NIBBLES if qtype == QT.MXFP4 and not grouped else int(activation_type(qtype))


class HostTensor:
    """A pinned host tensor handed to Triton as a pointer: under UVA its address is valid on the
    GPU as well (Triton refuses CPU tensors themselves). Shape and strides stay readable, so
    expert rows in pinned RAM [experts, rows, row_bytes] stand in for slot buffers
    (experts_forward: the GPU then reads them over PCIe, the mapped miss route)."""

    def __init__(self, t: torch.Tensor):
        self.t, self.dtype, self.shape = t, t.dtype, t.shape

    def data_ptr(self) -> int:
        return self.t.data_ptr()

    def stride(self, dim: int) -> int:
        return self.t.stride(dim)


_counters: dict[tuple, torch.Tensor] = {}


# Semaphores allocated at once per device and stream: more than any launch takes (pairs; a
# split dense product's row blocks, fewer than 8192 whenever it splits), so the tensor is
# never replaced while a captured CUDA graph still points at it.
COUNTERS = 8192


def _counter(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 semaphores, one per pair or row block, per device and stream (launches on
    one stream run in order); every launch leaves the ones it used at zero."""
    key = (device, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    c = _counters.get(key)
    if c is None or c.numel() < n:
        c = torch.zeros(max(n, COUNTERS), dtype=torch.int32, device=device)
        _counters[key] = c
    return c


@dataclass
class Rounded:
    """Rows rounded for one weight type, zero-padded to whole K steps (KP = 256 * ceil(K/256)):
    `padded` [rows, KP] = round_activation(rows, type) then zeros; for Q8_K and Q8_0 (K-quant,
    Q8_0 and MXFP4 weights) also `quants` (int8 [rows, KP]; for MXFP4 in the decode kernels
    each block's in nibble order, Q8_0_NIBBLES) and `scales` ([rows, KP / 32]: Q8_0's per block
    of 32, Q8_K's at every eighth place); `sums` in the grouped GEMM's rounding (int32 [rows,
    KP / 32]: Q8_K's quants summed per 32, which its K-quant min terms take), else None."""

    padded: torch.Tensor
    quants: torch.Tensor
    scales: torch.Tensor
    sums: torch.Tensor | None
    K: int

    @property
    def values(self) -> torch.Tensor:
        return self.padded[:, :self.K]

    @classmethod
    def empty(cls, rows: int, K: int, device, sums: bool = False) -> "Rounded":
        kp = -(-K // KSTEP) * KSTEP
        return cls(torch.empty((rows, kp), dtype=torch.float32, device=device),
                   torch.empty((rows, kp), dtype=torch.int8, device=device),
                   torch.empty((rows, kp // 32), dtype=torch.float32, device=device),
                   torch.empty((rows, kp // 32), dtype=torch.int32, device=device) if sums else None, K)


def round_rows(x: torch.Tensor, weight_qtype: QT, grouped: bool = False) -> Rounded:
    """round_activation(x, weight_qtype) for x [T, K] float32 (any row stride), one launch, for the
    decode kernels, or with `grouped` for the grouped GEMM's (also Q8_K's per-32 sums of quants,
    Rounded.sums; MXFP4's quants in their values' order)."""
    T, K = x.shape
    out = Rounded.empty(T, K, x.device, grouped)
    if T:
        _round_rows_kernel[(T, triton.cdiv(K, KSTEP))](x, x.stride(0), out.padded, out.quants, out.scales,
                                                      out.sums if grouped else out.scales, K=K,
                                                      VT=_vt(weight_qtype, grouped), INTERP=INTERPRETED, SUMS=grouped,
                                                      PDL=dependent_launches(str(x.device)),
                                                      **_launch_opts(TileConfig(0, 4)))
    return out


# Split-K: a product of few weight rows (one token's experts, a small projection) puts a
# slice of its K steps on each of several programs, so that every SM has loads in flight.
@dataclass(frozen=True)
class SplitK:
    split: int  # programs along K per block of weight rows
    steps: int  # K steps (of 256) per program

    @classmethod
    def choose(cls, n_out: int, K: int, sm_count: int, tile: TileConfig) -> "SplitK":
        """The fewest K slices that give `n_out` weight rows (in blocks of the tile's block_n)
        about the tile's programs_per_sm programs per SM, at least one K step each: a wide product
        (an output head) is not split and needs no reduction; in tiles of 32 rows and 4 programs
        an SM on 132 SMs a 4096 x 2048 projection takes 4 slices of 2 steps (512 programs), a
        512-row k/v projection one step per program (8 slices), one token's Qwen3-30B gate/up
        (8 experts x 768 rows x 2048) 3 slices of 3, 3 and 2 steps."""
        n_steps = -(-K // KSTEP)
        blocks = -(-n_out // tile.block_n)
        wanted = -(-tile.programs_per_sm * sm_count // blocks)
        steps = -(-n_steps // max(1, min(wanted, n_steps)))
        return cls(-(-n_steps // steps), steps)


@functools.lru_cache(maxsize=None)
def sm_count(device: str) -> int:
    """Streaming multiprocessors of a CUDA device (1 elsewhere: the interpreter runs programs
    one after another, so splitting K there only adds work)."""
    dev = torch.device(device)
    return torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1


@dataclass(frozen=True)
class _GateUpPlan:
    """How gate/up runs a launch's pairs: its tile (a GATE_UP_CONFIG key), config, kernel types
    (kernel_type), split over K and row blocks a pair."""
    tile: str
    cfg: TileConfig
    qg: int
    qu: int
    split: SplitK
    blocks: int
    n_pairs: int

    @classmethod
    def make(cls, w, gate_buf, up_buf, tokens: int, n_pairs: int, device: torch.device,
             cfg: TileConfig | None, split: SplitK | None, tile: str | None = None) -> "_GateUpPlan":
        n_ff, d_in = w.gate.shape[1], w.gate.shape[2]
        qg, qu = kernel_type(w.gate.qtype, gate_buf, d_in), kernel_type(w.up.qtype, up_buf, d_in)
        tile = tile or expert_tile(qg, qu, tokens)
        if tile == "row" and not (qg in ROW_TILE_TYPES and qu in ROW_TILE_TYPES):
            raise ValueError(f"the row tile of gate/up reads Q4_K, Q5_K, padded Q6_K, planar MXFP4 and planar Q8_0, "
                             f"not {w.gate.qtype.name} / {w.up.qtype.name} in the layout given")
        cfg = cfg or gate_up_config(tile, qg, qu, n_ff)
        if KSTEP % cfg.block_n:
            raise ValueError(f"gate/up tiles of {cfg.block_n} rows: a tile's rows must divide a K step's {KSTEP}")
        if cfg.passes > 1 and (tile != "row" or cfg.block_n % cfg.passes or n_ff % cfg.passes):
            raise ValueError(f"gate/up in {cfg.passes} turns: only the row tile takes turns, of rows that divide "
                             f"its {cfg.block_n} and the experts' {n_ff} ({tile} tile asked)")
        blocks = triton.cdiv(n_ff, cfg.block_n)
        if split is None:
            split = SplitK.choose(n_pairs * blocks * cfg.block_n, d_in, sm_count(str(device)), cfg)
            if cfg.unroll or n_pairs * (blocks + -(-n_ff // KSTEP)) > COUNTERS:
                split = SplitK(1, -(-d_in // KSTEP))
        assert split.split == 1 or not cfg.unroll, "an unrolled tile takes every K step"
        return cls(tile, cfg, qg, qu, split, blocks, n_pairs)

    def tensors(self, w, h: torch.Tensor, hr: Rounded) -> tuple:
        """The gate/up kernels' arguments gb_ptr ... count_ptr: the biases (h where there are
        none), h, hr, the split's partial sums (h where unsplit) and the semaphores: one per pair
        and K step of h (its rounding), and with a split one per pair and row block."""
        P, n_ff = self.n_pairs, h.shape[1]
        split = self.split.split
        part = torch.empty((P, split, 2, n_ff), dtype=torch.float32, device=h.device) if split > 1 else h
        gb = w.gate.bias if w.gate.bias is not None else h
        ub = w.up.bias if w.up.bias is not None else gb
        h_steps = -(-n_ff // KSTEP)
        count = _counter(h.device, P * (h_steps + self.blocks) if split > 1 else P * h_steps)
        return gb, ub, h, hr.padded, hr.quants, hr.scales, part, count


def gate_up(xg: Rounded, xu: Rounded, gate_buf: torch.Tensor, up_buf: torch.Tensor, w,
            pair_tok: torch.Tensor, pair_slot: torch.Tensor, pair_exp: torch.Tensor,
            cfg: TileConfig | None = None, split: SplitK | None = None,
            dependent: bool = False, tile: str | None = None) -> tuple[torch.Tensor, Rounded]:
    """h [pairs, n_ff] = act(x[tok] . gate[slot] (+bias), x[tok] . up[slot] (+bias)), and h
    rounded for the down weights. xg, xu: the token rows rounded (round_rows) for the gate and
    the up type (pass the same object when the two round alike). `split` over K defaults to
    SplitK.choose for the launch's row blocks on this device (a few pairs, one token's,
    would leave most SMs idle). `dependent`: launched as a programmatic dependent where the
    device has them, only right after the rounding of xg, xu (dependent_launches says why).
    `tile`: a GATE_UP_CONFIG key, by default expert_tile's ("row" takes ROW_TILE_TYPES only)."""
    n_ff, d_in = w.gate.shape[1], w.gate.shape[2]
    P = pair_tok.numel()
    h = torch.empty((P, n_ff), dtype=torch.float32, device=xg.values.device)
    hr = Rounded.empty(P, n_ff, h.device)
    if P == 0:
        return h, hr
    assert xg.values.shape[1] == d_in
    plan = _GateUpPlan.make(w, gate_buf, up_buf, xg.padded.shape[0], P, h.device, cfg, split, tile)
    kernel = _gate_up_k4_kernel if plan.tile == "row" else _gate_up_kernel
    pdl = dependent_launches(str(h.device))
    kernel[(P, plan.blocks, plan.split.split)](
        xg.padded, xg.quants, xg.scales, xu.padded, xu.quants, xu.scales,
        gate_buf, gate_buf.stride(0), gate_buf.stride(1), up_buf, up_buf.stride(0), up_buf.stride(1),
        *plan.tensors(w, h, hr), pair_tok, pair_slot, pair_exp, P, plan.split.split, plan.split.steps,
        N=n_ff, K=d_in, QG=plan.qg, QU=plan.qu, SAME_X=xg is xu, VT_DOWN=_vt(w.down.qtype), ACT=_ACT[w.activation],
        HAS_BIAS=w.gate.bias is not None, BLOCK_N=plan.cfg.block_n, UNROLL=plan.cfg.unroll, PASSES=plan.cfg.passes,
        INTERP=INTERPRETED, REV=reversed_ties(), PDL=pdl, **_launch_opts(plan.cfg, dependent and pdl),
        **({"GROUP": run_group(plan.tile, plan.cfg, xg.padded.shape[0])} if plan.tile == "row" else {}))
    return h, hr


def down_rows_per_program(tile: str, cfg: TileConfig, K: int) -> int:
    """Rows of the down product a program of tile `tile` (a DOWN_CONFIG key) in `cfg` covers, at
    K values a row: the row tile under four K steps gives each eight lanes a row of their own
    (_down_row_program's SPAN, the same rule)."""
    return cfg.block_n * 4 if tile == "row" and -(-K // KSTEP) < 4 else cfg.block_n


def _down_tile_type(w, down_buf: torch.Tensor, tile: str | None, tokens: int) -> tuple[str, int]:
    """down's tile over `tokens` tokens' pairs (`tile`, by default expert_down_tile's) and the
    kernel type of its weights, which that tile must read."""
    qd = kernel_type(w.down.qtype, down_buf, w.down.shape[2])
    tile = tile or expert_down_tile(qd, tokens)
    if tile == "row" and qd not in ROW_TILE_TYPES:
        raise ValueError(f"the row tile of down reads Q4_K, Q5_K, padded Q6_K, planar MXFP4 and planar Q8_0, "
                         f"not {w.down.qtype.name} in the layout given")
    return tile, qd


def down(hr: Rounded, down_buf: torch.Tensor, w, pair_tok: torch.Tensor, pair_pos: torch.Tensor,
         pair_slot: torch.Tensor, pair_exp: torch.Tensor, weights: torch.Tensor | None, out: torch.Tensor,
         cfg: TileConfig | None = None, tile: str | None = None, dependent: bool = False) -> None:
    """out[pos, tok, :] = (hr[p] . down[slot] (+bias)) * weights[tok, pos] for each pair p.

    hr: h rounded for the down type (gate_up's second result); `out` [k, T, D] (the
    executor's per_slot, last axis contiguous); with weights None the result is unweighted.
    `tile`: a DOWN_CONFIG key, by default expert_down_tile's ("row" takes ROW_TILE_TYPES only).
    `dependent`: launched as a programmatic dependent where the device has them, only right
    after the gate_up launch that made hr (dependent_launches says why)."""
    d_out, n_ff = w.down.shape[1], w.down.shape[2]
    P = pair_tok.numel()
    if P == 0:
        return
    assert out.stride(2) == 1
    tile, qd = _down_tile_type(w, down_buf, tile, out.shape[1])
    cfg = cfg or down_config(tile, qd)
    has_bias = w.down.bias is not None
    db = w.down.bias if has_bias else hr.padded
    wt = weights if weights is not None else hr.padded
    grid = (P, triton.cdiv(d_out, down_rows_per_program(tile, cfg, n_ff)))
    pdl = dependent_launches(str(out.device))
    (_down_k4_kernel if tile == "row" else _down_kernel)[grid](
        hr.padded, hr.quants, hr.scales, down_buf, down_buf.stride(0), down_buf.stride(1), db, wt, wt.stride(0),
        out, out.stride(0), out.stride(1), pair_tok, pair_pos, pair_slot, pair_exp, d_out,
        K=n_ff, QD=qd, HAS_BIAS=has_bias, WEIGHTED=weights is not None,
        BLOCK_N=cfg.block_n, UNROLL=cfg.unroll, INTERP=INTERPRETED, REV=reversed_ties(), PDL=pdl,
        **_launch_opts(cfg, dependent and pdl),
        **({"GROUP": run_group(tile, cfg, out.shape[1])} if tile == "row" else {}))


def _rounds_alike(w) -> bool:
    """Whether x rounds alike for the experts' gate and up types (then one rounding serves both)."""
    return _vt(w.up.qtype) == _vt(w.gate.qtype)


def round_inputs(x: torch.Tensor, w) -> tuple[Rounded, Rounded]:
    """x [T, D] rounded for the experts' gate and up types (one object where they round alike):
    the first launch of experts_forward, which a second launch over the same rows can share."""
    xg = round_rows(x, w.gate.qtype)
    return xg, (xg if _rounds_alike(w) else round_rows(x, w.up.qtype))


def experts_forward(x: torch.Tensor, buffers, w, pair_tok: torch.Tensor, pair_pos: torch.Tensor,
                    pair_slot: torch.Tensor, pair_exp: torch.Tensor, weights: torch.Tensor | None,
                    out: torch.Tensor, gate_up_cfg: TileConfig | None = None,
                    down_cfg: TileConfig | None = None, gate_up_split: SplitK | None = None,
                    rounded: tuple[Rounded, Rounded] | None = None, one_launch: bool = False,
                    down_tile: str | None = None, gate_up_tile: str | None = None,
                    rounded_just_before: bool = False) -> None:
    """Every pair's expert output, weighted, into out[pos, tok, :]: three launches in all
    (round x, unless `rounded` holds round_inputs(x, w) already; gate/up + activation + round h;
    down), or with `one_launch` the same programs in one grid (_expert_step_kernel; bit for bit
    the three launches' result with the same down tile, so the form changes how, not what).
    `gate_up_tile`: a GATE_UP_CONFIG key, by default expert_tile's pick for the launch.
    `down_tile`: a DOWN_CONFIG key, by default expert_down_tile's; in one launch at gate/up's
    num_warps (down_cfg must take those). A pair whose slot is negative does nothing. Where the device
    has programmatic dependent launch (dependent_launches), down, and gate/up after its own
    rounding of x (or after `rounded`'s, where `rounded_just_before` says that was the launch
    right before on this stream), start while the launch before them ends.

    x [T, D] float32; buffers = [gate, up, down] uint8 slot buffers [slots, rows, row_bytes]
    (GGUF rows, or as layout.kernel_layout lays them out, as LayerSlots does: Q6_K padded, MXFP4
    and Q8_0 planar; or HostTensor rows in pinned RAM); pair_* int32 [P] on x's device (pairs
    sorted by slot let pairs of one expert meet in L2)."""
    if pair_tok.numel() == 0:
        return
    if one_launch:
        _expert_step(x, buffers, w, pair_tok, pair_pos, pair_slot, pair_exp, weights, out, gate_up_cfg, down_cfg,
                     gate_up_split, rounded, down_tile, gate_up_tile)
        return
    xg, xu = rounded or round_inputs(x, w)
    _, hr = gate_up(xg, xu, buffers[0], buffers[1], w, pair_tok, pair_slot, pair_exp, gate_up_cfg, gate_up_split,
                    dependent=rounded is None or rounded_just_before, tile=gate_up_tile)
    down(hr, buffers[2], w, pair_tok, pair_pos, pair_slot, pair_exp, weights, out, down_cfg, down_tile,
         dependent=True)


# A one-launch step's wait gives up after this, far beyond the step's own length: every wait is
# on programs of the same launch, so only a broken dispatch order could make one time out.
STEP_WAIT_NS = 200_000_000
_step_states: dict[torch.device, torch.Tensor] = {}


def _step_state(device: torch.device, n: int) -> torch.Tensor:
    """The one-launch step's state on `device` (epoch, programs ended, a wait timed out, then
    flags), made zeroed by the first launch, for every stream: the epoch protocol takes the
    launches one after another, as the engine runs them. Never replaced (a captured graph
    holds its address), so that first launch must not be captured: a capture would replay the
    zeroing with the graph."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if n > COUNTERS:
        raise ValueError(f"a one-launch step of {n - 3} flags: more than the {COUNTERS - 3} it keeps")
    state = _step_states.get(device)
    if state is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the one-launch expert step's first launch on a device makes its state, so it "
                               "cannot be captured: launch the step once before capturing a graph of it")
        with torch.inference_mode(False):  # a normal tensor: step_timed_out zeroes it in either mode
            state = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
        _step_states[device] = state
    return state


def step_error_word(device: torch.device) -> torch.Tensor:
    """The one-launch step's error word on `device`: int32 [1], nonzero once a wait timed out (a
    step's result is then wrong) until zeroed; the decode graph copies it out each token."""
    return _step_state(device, 3)[2:3]


def step_timed_out(device: torch.device) -> bool:
    """Whether a wait of a one-launch step on `device` timed out since the last call (that step's
    result is wrong); the call clears it. Synchronizes with the current stream."""
    word = step_error_word(device)
    late = bool(word.item())
    word.zero_()
    return late


def step_down_config(down_tile: str, qd: int, num_warps: int) -> TileConfig:
    """A one-launch step's default down tile over weights of kernel type `qd`: down_config's, its
    rows a warp kept on gate/up's warps (the launch's register cap is gate/up's)."""
    base = down_config(down_tile, qd)
    return TileConfig(base.block_n * num_warps // base.num_warps, num_warps, base.unroll)


def _expert_step(x: torch.Tensor, buffers, w, pair_tok: torch.Tensor, pair_pos: torch.Tensor,
                 pair_slot: torch.Tensor, pair_exp: torch.Tensor, weights: torch.Tensor | None, out: torch.Tensor,
                 gate_up_cfg: TileConfig | None, down_cfg: TileConfig | None, split: SplitK | None,
                 rounded: tuple[Rounded, Rounded] | None, down_tile: str | None, gate_up_tile: str | None) -> None:
    """experts_forward(one_launch=True)."""
    T, d_in = x.shape
    n_ff, d_out = w.down.shape[2], w.down.shape[1]
    P, dev = pair_tok.numel(), x.device
    if rounded is None:
        xg = Rounded.empty(T, d_in, dev)
        xu = xg if _rounds_alike(w) else Rounded.empty(T, d_in, dev)
    else:
        xg, xu = rounded
    plan = _GateUpPlan.make(w, buffers[0], buffers[1], T, P, dev, gate_up_cfg, split, gate_up_tile)
    gd, ud, dd = buffers
    down_tile, qd = _down_tile_type(w, dd, down_tile, T)
    down_cfg = down_cfg or step_down_config(down_tile, qd, plan.cfg.num_warps)
    if down_cfg.num_warps != plan.cfg.num_warps:
        raise ValueError(f"one launch runs gate/up and down on one num_warps: {plan.cfg.num_warps} and "
                         f"{down_cfg.num_warps} asked")
    h = torch.empty((P, n_ff), dtype=torch.float32, device=dev)
    hr = Rounded.empty(P, n_ff, dev)
    n_rounds = T * -(-d_in // KSTEP) if rounded is None else 0
    state = _step_state(dev, 3 + n_rounds + P * -(-n_ff // KSTEP))
    d_blocks = triton.cdiv(d_out, down_rows_per_program(down_tile, down_cfg, n_ff))
    has_down_bias = w.down.bias is not None
    db = w.down.bias if has_down_bias else h
    wt = weights if weights is not None else h
    grid = (n_rounds + P * plan.blocks * plan.split.split + P * d_blocks,)
    _expert_step_kernel[grid](
        x, x.stride(0), xg.padded, xg.quants, xg.scales, xu.padded, xu.quants, xu.scales,
        gd, gd.stride(0), gd.stride(1), ud, ud.stride(0), ud.stride(1), *plan.tensors(w, h, hr),
        dd, dd.stride(0), dd.stride(1), db, wt, wt.stride(0), out, out.stride(0), out.stride(1),
        pair_tok, pair_pos, pair_slot, pair_exp, P, plan.split.split, plan.split.steps, n_rounds, d_out, d_blocks,
        state, STEP_WAIT_NS, N=n_ff, K=d_in, QG=plan.qg, QU=plan.qu, QD=qd,
        SAME_X=xg is xu, VT_G=_vt(w.gate.qtype), VT_U=_vt(w.up.qtype), VT_DOWN=_vt(w.down.qtype),
        ACT=_ACT[w.activation], HAS_BIAS=w.gate.bias is not None, HAS_DOWN_BIAS=has_down_bias,
        WEIGHTED=weights is not None, ROW=plan.tile == "row", DOWN_ROW=down_tile == "row", BLOCK_G=plan.cfg.block_n,
        BLOCK_D=down_cfg.block_n, PASSES_G=plan.cfg.passes,
        UNROLL=plan.cfg.unroll, UNROLL_DOWN=down_cfg.unroll, ROUND_X=rounded is None, INTERP=INTERPRETED,
        REV=reversed_ties(), **_launch_opts(plan.cfg))


def dense_supported(qtype: QT) -> bool:
    return triton is not None and qtype in KERNEL_TYPES


# Dense products of up to DENSE_MAX_ROWS rows (attention projections, output head, shared
# experts, dense FFNs at decode): each program a block of weight rows times a slice of the K
# steps (split-K), so that a one-row product of few output rows still puts work on every SM.
# Five tiles (dense_tile picks one), each with its kernel and its default:
#   "tile"  quantized weights: one weight row per lane pair as in the expert kernels (_dense_kernel)
#   "row"   one activation row of planar Q8_0 weights: a warp's lanes along each weight row
#           (_dense_q8p_kernel; BLOCK_N rows on num_warps warps)
#   "row16" one activation row of F16 or BF16 weights, the warps too along each row; x rounded in
#           the kernel, no launch before it (_dense16_kernel: "16-bit dense products")
#   "row_kquant"  the same for 1-8 rows of Q4_K, Q5_K, padded Q6_K or planar MXFP4 weights and 2-8
#           of planar Q8_0, four K steps an access (_dense_k4_kernel; one row of planar Q8_0 where asked)
#   "mma"   2-8 rows of 16-bit weights on tensor cores (_dense16_mma_kernel; BLOCK_N rows a
#           program, Triton's pipeliner keeping num_stages steps in flight)
DENSE_MAX_ROWS = 8  # activation rows one launch multiplies (the kernel's accumulators)
# (A "row_kquant" program is one warp over 2 rows, unsplit wherever there are 132 of them: on the
# H200 within 8% of the best tile and split at each one-row decode shape, the split's reduction
# costing more than the SMs it fills; on the H100 at 2 and 8 rows of Mixtral's 4096 x 14336,
# 1.07-1.84x faster than the quantized tile and within 5% of the best config of either, but Q4_K's
# 2 rows (bn4w4: 19.63 against 22.82 us) and Q5_K's 8 (the quantized tile bn64w2: 39.41 against 44.09).)
DENSE_CONFIG: dict[str, TileConfig] = {"tile": TileConfig(32, 2), "row": TileConfig(8, 4),
                                       "row16": TileConfig(1, 4, programs_per_sm=1),
                                       "row_kquant": TileConfig(2, 1, programs_per_sm=1),
                                       "mma": TileConfig(32, 4, num_stages=2)}
_SIXTEEN_BIT = (int(QT.F16), int(QT.BF16))


def dense_tile(qw: int, rows: int) -> str:
    """The tile (a DENSE_CONFIG key) of a dense product of `rows` activation rows over weights
    of kernel type `qw` (kernel_type)."""
    if qw in _SIXTEEN_BIT:
        return "mma" if rows > 1 else "row16"
    if rows == 1 and qw == Q8_0_PLANAR:
        return "row"
    return "row_kquant" if qw in ROW_TILE_TYPES else "tile"


# One row of long weight rows in row_kquant: 2 warps side by side along K, over 2 rows a program.
# At K = 14,336 (Mixtral's 4096 x 14336) the default's 1-warp programs leave an SM 16 warps; this
# config ran 1.12x for Q4_K, 1.06x Q5_K, 1.03x padded Q6_K, 1.11x planar MXFP4 (H100, session 41,
# same-run A/B). At K = 2,048-4,096 a warp pair gets 2 loop turns or fewer and the sweep found it
# 0.94-1.06x by type and shape, so those keep the default.
LONG_ROW_K = 8192
LONG_ROW_CONFIG = TileConfig(2, 2, programs_per_sm=1, k_warps=2)


def dense_config(qw: int, rows: int, K: int, tile: str | None = None) -> TileConfig:
    """The default config of a dense product of `rows` activation rows over weights of kernel
    type `qw` with rows of K values, in `tile` (by default dense_tile's)."""
    tile = tile or dense_tile(qw, rows)
    if tile not in DENSE_CONFIG:
        raise ValueError(f"no dense tile {tile!r}; the tiles: {', '.join(DENSE_CONFIG)}")
    if tile == "row_kquant" and rows == 1 and K >= LONG_ROW_K:
        return LONG_ROW_CONFIG
    return DENSE_CONFIG[tile]


DENSE16_STEP = 1024  # values of a row the one-row 16-bit tile reads a K step: 16 bytes a lane, on 4 warps
# the tiles whose kernel rounds x itself, from x as it is (dense launches no rounding before them)
ROUNDING_TILES = ("row16",)


def dense_kernel(qw: int, rows: int, cfg: TileConfig, target=None, tile: str | None = None) -> tuple[Callable, dict]:
    """The kernel of a dense product of `rows` activation rows and weights of kernel type `qw`
    (kernel_type) in `tile` (a DENSE_CONFIG key, by default dense_tile's; ROW_TILE_TYPES read in
    "tile" and "row_kquant" alike) of config `cfg`, and the constexprs it takes beyond the ones all
    take (K, QW, ROWS, SPLIT, STEPS, BLOCK_N, INTERP, PDL), for compile target `target` (default:
    the current GPU)."""
    default = dense_tile(qw, rows)
    tile = tile or default
    if tile != default and not (tile in ("tile", "row_kquant") and qw in ROW_TILE_TYPES):
        raise ValueError(f"a dense product of {rows} rows of kernel type {qw} takes the {default} tile (or, where "
                         f"the type is laid out for row_kquant, that tile or the quantized one), not {tile}")
    if tile == "row_kquant":
        return _dense_k4_kernel, {"REV": reversed_ties(target), "K_WARPS": cfg.k_warps}
    if qw in _SIXTEEN_BIT:
        if tile == "mma":
            return _dense16_mma_kernel, {}
        return _dense16_kernel, {"STEP": DENSE16_STEP}
    kernel = {"tile": _dense_kernel, "row": _dense_q8p_kernel}[tile]
    return kernel, {"REV": reversed_ties(target)}


def dense(x: torch.Tensor, raw: torch.Tensor, qtype: QT, n_out: int, cfg: TileConfig | None = None,
          split: SplitK | None = None, tile: str | None = None) -> torch.Tensor:
    """round(x) @ W.T for x [T, K] float32 (T <= DENSE_MAX_ROWS, rows contiguous) and a dense
    weight W [n_out, K] kept as its GGUF rows raw [1, n_out, row_bytes] (or as
    layout.kernel_layout lays them out: Q6_K padded, MXFP4 planar): the split-K product, after
    a launch that rounds x (which it starts beside where the device has dependent launches)
    except in ROUNDING_TILES, which round x themselves. `split` defaults to SplitK.choose for
    this device; `tile`, `cfg`: dense_kernel's tile (by default dense_tile's) and its config
    (by default dense_config's)."""
    T, K = x.shape
    if T > DENSE_MAX_ROWS:
        raise ValueError(f"dense takes at most {DENSE_MAX_ROWS} rows, got {T}: use dequantize + matmul")
    if T == 0:
        return torch.empty((0, n_out), dtype=torch.float32, device=x.device)
    tile = tile or dense_tile(kernel_type(qtype, raw, K), T)
    return _dense_product(x if tile in ROUNDING_TILES else round_rows(x, qtype), raw, qtype, n_out, cfg, split,
                          tile=tile)


def compile_dense(raw: torch.Tensor, qtype: QT, n_out: int, K: int, rows: int) -> None:
    """Compiles, without launching it, the product `dense` launches for `rows` rows of this
    weight (the rounding launch before it, where there is one, is one per K and type, compiled
    by the first product)."""
    tile = dense_tile(kernel_type(qtype, raw, K), rows)
    x = (torch.empty((rows, K), dtype=torch.float32, device=raw.device) if tile in ROUNDING_TILES
         else Rounded.empty(rows, K, raw.device))
    _dense_product(x, raw, qtype, n_out, compile_only=True, tile=tile)


def _dense_product(x: Rounded | torch.Tensor, raw: torch.Tensor, qtype: QT, n_out: int, cfg: TileConfig | None = None,
                   split: SplitK | None = None, compile_only: bool = False, tile: str | None = None) -> torch.Tensor:
    """The product of `dense`, of rows x rounded by round_rows (Rounded) or, for ROUNDING_TILES, as they are."""
    rounded = isinstance(x, Rounded)
    T, K = (x.padded.shape[0], x.K) if rounded else x.shape
    out = torch.empty((T, n_out), dtype=torch.float32, device=raw.device)
    qw = kernel_type(qtype, raw, K)
    tile = tile or dense_tile(qw, T)
    if rounded == (tile in ROUNDING_TILES):
        raise ValueError(f"the {tile} tile takes x "
                         + ("as it is, not rounded" if rounded else "rounded by round_rows"))
    cfg = cfg or dense_config(qw, T, K, tile)
    kernel, extra = dense_kernel(qw, T, cfg, tile=tile)  # refuses a tile that cannot read the weights
    split = split or SplitK.choose(n_out, K, sm_count(str(raw.device)), cfg)
    blocks = triton.cdiv(n_out, cfg.block_n)
    if split.split > 1:
        part = torch.empty((split.split, T, n_out), dtype=torch.float32, device=raw.device)
        count = _counter(raw.device, blocks)
    else:
        part, count = out, _counter(raw.device, 1)
    grid = (blocks, split.split)
    launch = functools.partial(kernel.warmup, grid=grid) if compile_only else kernel[grid]
    # a dependent launch right after the rounding of x; a tile that rounds x itself follows whatever
    # wrote x, which does not let it start early
    pdl = rounded and dependent_launches(str(raw.device))
    xs = (x.padded, x.quants, x.scales) if rounded else (x, x, x)
    launch(*xs, raw, raw.stride(1), part, out, count, n_out,
           K=K, QW=qw, ROWS=T, SPLIT=split.split, STEPS=split.steps, BLOCK_N=cfg.block_n,
           INTERP=INTERPRETED, PDL=pdl, **extra, **_launch_opts(cfg, pdl))
    return out


def compile_in_parallel(compiles: list[Callable[[], None]]) -> None:
    """Runs compile-only launches (compile_dense) with their compiles spread over threads, one per
    core: Triton releases the GIL in its compiler passes, so N variants take about as long as
    the longest of them on N cores, not their sum (the prompt's dense variants, 89 s one after
    another on the H200's host). A Triton without AsyncCompileMode compiles them in turn."""
    if INTERPRETED:
        return  # the interpreter compiles nothing
    mode = getattr(triton, "AsyncCompileMode", None)
    if mode is None or len(compiles) < 2:
        for compile_one in compiles:
            compile_one()
        return
    with ThreadPoolExecutor(min(len(compiles), os.cpu_count() or 1)) as pool, mode(pool):
        for compile_one in compiles:
            compile_one()
