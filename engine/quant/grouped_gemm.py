"""Grouped expert GEMM (Triton, tensor cores) for steps of many rows: prefill.

The decode kernels (triton_kernels.py) give one program per (token, top-k) pair and read each
weight row once per pair: right for a few pairs, wasteful for a 512-token chunk in which an
expert sees dozens of rows. Here the pairs are sorted by slot (expert) and each expert's run of
rows is padded to the tile height BLOCK_M; a program takes one M tile (rows of one expert) and
one N tile of the output, walks K, decodes the weight tile from the GGUF bytes in the slot
buffers in registers, and multiplies it with the tile's activation rows on the tensor cores
(`tl.dot`: int8 operands and int32 sums for the quantized types, fp16/bf16 for 16-bit ones).
Three launches of the grouped kernels and two roundings per layer step, whatever the number of
experts:

0. x rounded for the gate/up type (triton_kernels.round_rows, the decode path's kernel);
1. `_gate_up_kernel`, grid (M tiles, n_ff / BLOCK_N): gate and up of the tile's expert against
   its rows, biases, the activation -> h [padded rows, n_ff];
2. h rounded for the down type (round_rows again);
3. `_down_kernel`, grid (M tiles, n_embd / BLOCK_N): down, bias, times the routing weight,
   stored into the executor's per_slot[pos, tok, :] (padding rows store nothing).

Exactness: as llama.cpp, the activation is rounded to the weight type's vec-dot type first
(round_activation: Q8_K for K-quants, Q8_0 for Q8_0 and MXFP4, f16/bf16 for 16-bit weights).
The integer types then multiply on the int8 tensor cores as ggml's integer dot products do:
the activation's int8 quants times small integers decoded from the weight blocks, one product
per 32 values, exact in int32, the scales applied outside the products:
- Q4_K, Q5_K: per chunk of 64 values (two sub-blocks j), sum_j sc_j * dot(qx_j, q_j) and
  sum_j m_j * sum(qx_j) (the rounding's block sums, Rounded.sums), both int32;
  acc += dx * (d * S - dmin * M);
- Q6_K: q - 32 in [-32, 31]; its scales change every 16 values, so each 32-value product is
  taken twice with the activation's other half zeroed; acc += dx * d * sum(sc * dot);
- Q8_0, MXFP4: per block of 32, acc += dx * dw * dot(qx, q) (MXFP4's q: the doubled e2m1
  values, triton_kernels._e2m1_low; dw its halved e8m0 scale); the blocks as the file holds
  them or planar (layout.planar);
- F16, BF16: the rounded activation and the weights in their own 16-bit type (fp32 accumulate).
The integer sums are ggml's; the result equals the torch path (round_activation(x) @
dequantize(W).T in float32) up to float32 summation order: the decode kernels' tolerance, 2e-5
of the output's largest magnitude per kernel (tests/quant/test_grouped_gemm.py).

`TRITON_INTERPRET=1` (before triton_kernels is imported) runs these kernels on CPU tensors.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

from engine.moe.copier import aligned_offsets, upload_tables
from engine.plan.sizing import GROUPED_BLOCK_M
from engine.quant import triton_kernels as tk

triton = tk.triton
if triton is not None:
    import triton.language as tl

    # The decode kernels' type ids, block decoders and activation (jit helpers), shared, not copied.
    from engine.quant.triton_kernels import (  # noqa: F401 (constexpr globals the kernels read)
        _BF16, _F16, _MXFP4, _MXFP4_PLANAR, _Q4_K, _Q5_K, _Q6_K, _Q6_K_PADDED, _Q8_0, _Q8_0_PLANAR, _activate,
        _e2m1_low, _e8m0_half, _f16_bits)

# Weight types the grouped kernels decode: every type the decode kernels take.
GROUPED_TYPES: frozenset[QT] = tk.KERNEL_TYPES


if triton is not None:

    @triton.jit
    def _u16(ptr):
        """An fp16 field (2-aligned) at byte pointers `ptr`, widened to float32."""
        return _f16_bits(tl.load(ptr.to(tl.pointer_type(tl.uint16))).to(tl.int32))

    @triton.jit
    def _k4_chunk_scales(s, c):
        """get_scale_min_k4 of sub-blocks 2c and 2c + 1 (chunk c of 0..3) from the 12 scale bytes
        at `s` ([1, BLOCK_N] byte pointers, 4-aligned), read as three 32-bit words (three loads,
        not six byte loads): (sc0, m0, sc1, m1) as int32."""
        w0 = tl.load(s.to(tl.pointer_type(tl.uint32)))  # bytes 0..3: the scales (j < 4) or high bits
        w1 = tl.load((s + 4).to(tl.pointer_type(tl.uint32)))  # 4..7: the mins (j < 4) or high bits
        w2 = tl.load((s + 8).to(tl.pointer_type(tl.uint32)))  # 8..11: both low nibbles (j >= 4)
        shift = 16 * (c % 2)  # sub-block 2c's byte within each word; 2c + 1's is the next
        sc0, m0 = _k4_sc_m_of(w0 >> shift, w1 >> shift, w2 >> shift, c < 2)
        sc1, m1 = _k4_sc_m_of(w0 >> (shift + 8), w1 >> (shift + 8), w2 >> (shift + 8), c < 2)
        return sc0, m0, sc1, m1

    @triton.jit
    def _i8(v):
        """The low byte of int32 v as a signed value, masked then folded by its sign bit (as
        (v << 24) >> 24 the sm_90 Q6_K down kernel kept 16 bytes of stack at 128 registers)."""
        b = v & 255
        return b - ((b & 128) << 1)

    @triton.jit
    def _k4_sc_m_of(a, b, e, low):
        """One sub-block j's (scale, min) from bytes s[j % 4], s[j % 4 + 4], s[j % 4 + 8] in the
        low bits of a, b, e; `low`: j < 4."""
        a = (a & 255).to(tl.int32)
        b = (b & 255).to(tl.int32)
        e = (e & 255).to(tl.int32)
        sc = tl.where(low, a & 63, (e & 15) | ((a >> 6) << 4))
        m = tl.where(low, b & 63, (e >> 4) | ((b >> 6) << 4))
        return sc, m

    @triton.jit
    def _a_tile(a_ptr, a_rows, live_m, k0, KP: tl.constexpr, WIDTH: tl.constexpr):
        """Activation columns k0 .. k0 + WIDTH of the tile's rows (a_rows [BLOCK_M, 1] row
        indices into a [rows, KP] tensor; dead rows read 0), in the tensor's own type."""
        k = tl.arange(0, WIDTH)[None, :]
        return tl.load(a_ptr + a_rows * KP + k0 + k, mask=live_m, other=0)

    @triton.jit
    def _idot(a, q):
        """Exact int32 [BLOCK_M, BLOCK_N] = a (int8 [BLOCK_M, 32]) . q (small ints [32, BLOCK_N])."""
        return tl.dot(a, q.to(tl.int8), out_dtype=tl.int32)

    @triton.jit
    def _k_step(acc, w, ks, xq_ptr, xd_ptr, xs_ptr, xv_ptr, a_rows, live_m, K: tl.constexpr, QW: tl.constexpr,
                INTERP: tl.constexpr):
        """acc [BLOCK_M, BLOCK_N] += K step ks (256 values) of the rounded activation rows
        times the weight rows at byte pointers w [1, BLOCK_N] (one GGUF row each)."""
        KP: tl.constexpr = (K + 255) // 256 * 256
        i = tl.arange(0, 32)[:, None]  # 32 values of a sub-block, along K
        if QW == _Q4_K or QW == _Q5_K:
            if QW == _Q4_K:
                blk = w + ks * 144
                qs = blk + 16
            else:
                blk = w + ks * 176
                qs = blk + 48
            d = _u16(blk)
            dmin = _u16(blk + 2)
            dx = tl.load(xd_ptr + a_rows * (KP // 32) + ks * 8, mask=live_m, other=0.0)
            sums = xs_ptr + a_rows * (KP // 32) + ks * 8
            # Two 32-deep int8 products per chunk, scaled after: one 64-deep fp16 product of sc * q
            # (exact in fp16) was 1.7x slower, its operand routed through shared memory (session 18).
            # The scales' sum stays int32 over the block (|s| < 2^25) and meets d once, as in ggml's
            # CPU dot; the mins' term goes into acc each chunk (an int32 tile of it kept over the
            # block makes the gate/up kernel spill on sm_90).
            s = tl.zeros(acc.shape, tl.int32)
            for c in range(4):  # a loop, not unrolled: one chunk's tiles live at a time
                # values 64c + i: sub-block 2c, the low nibbles of qs[32c + i]; 64c + 32 + i:
                # sub-block 2c + 1, the high nibbles
                byte = tl.load(qs + 32 * c + i).to(tl.int32)
                lo = byte & 15
                hi = byte >> 4
                if QW == _Q5_K:  # the fifth bits: bits 2c and 2c + 1 of qh[i]
                    qh = tl.load(blk + 16 + i).to(tl.int32)
                    lo = lo | (((qh >> (2 * c)) & 1) << 4)
                    hi = hi | (((qh >> (2 * c + 1)) & 1) << 4)
                a_lo = _a_tile(xq_ptr, a_rows, live_m, ks * 256 + 64 * c, KP, 32)
                a_hi = _a_tile(xq_ptr, a_rows, live_m, ks * 256 + 64 * c + 32, KP, 32)
                sc0, m0, sc1, m1 = _k4_chunk_scales(blk + 4, c)
                # the chunk's two sub-blocks: sum_j sc_j * dot(qx_j, q_j) and sum_j m_j * sum(qx_j),
                # exact in int32
                s += _idot(a_lo, lo) * sc0 + _idot(a_hi, hi) * sc1
                # the sub-blocks' two block sums in one 8-byte load (little-endian: 2c in the low half)
                pair = tl.load((sums + 2 * c).to(tl.pointer_type(tl.int64)), mask=live_m, other=0)
                m = pair.to(tl.int32) * m0 + (pair >> 32).to(tl.int32) * m1
                acc -= dx * (dmin * m.to(tl.float32))
            acc += dx * (d * s.to(tl.float32))
        elif QW == _Q6_K or QW == _Q6_K_PADDED:
            # 210-byte blocks, or the slots' 224-byte ones (layout.pad_q6_k: the same fields)
            blk = w + ks * (224 if QW == _Q6_K_PADDED else 210)
            d = _u16(blk + 208)
            dx = tl.load(xd_ptr + a_rows * (KP // 32) + ks * 8, mask=live_m, other=0.0)
            first = tl.arange(0, 32)[None, :] < 16  # the activation's half under a sub-block's first scale
            s = tl.zeros(acc.shape, tl.int32)  # the block's int32 sum (|s| < 2^28), scaled once (see Q4_K)
            for c in range(4):  # a loop, not unrolled: one chunk's tiles live at a time
                # values 64c + 32h + i: ql[64(c // 2) + 32h + i] nibble c % 2, qh[128 + 32(c // 2) + i]
                # bits 2(2(c % 2) + h); int8 scales at 192 + 4c + 2h (i < 16) and + 1 (i >= 16)
                qh = tl.load(blk + 128 + 32 * (c // 2) + i).to(tl.int32)
                if QW == _Q6_K_PADDED:  # the chunk's four scales as one word (padded blocks are 16-aligned)
                    scales = tl.load((blk + 192 + 4 * c).to(tl.pointer_type(tl.int32)))
                for h in tl.static_range(2):
                    lo = (tl.load(blk + 64 * (c // 2) + 32 * h + i).to(tl.int32) >> (4 * (c % 2))) & 15
                    q = (lo | (((qh >> (2 * (2 * (c % 2) + h))) & 3) << 4)) - 32
                    a = _a_tile(xq_ptr, a_rows, live_m, ks * 256 + 64 * c + 32 * h, KP, 32)
                    if QW == _Q6_K_PADDED:
                        sc_a = _i8(scales >> (16 * h))
                        sc_b = _i8(scales >> (16 * h + 8))
                    else:
                        sc_a = tl.load((blk + 192 + 4 * c + 2 * h).to(tl.pointer_type(tl.int8))).to(tl.int32)
                        sc_b = tl.load((blk + 193 + 4 * c + 2 * h).to(tl.pointer_type(tl.int8))).to(tl.int32)
                    s += _idot(tl.where(first, a, 0), q) * sc_a + _idot(tl.where(first, 0, a), q) * sc_b
            acc += dx * (d * s.to(tl.float32))
        elif QW == _Q8_0 or QW == _Q8_0_PLANAR or QW == _MXFP4 or QW == _MXFP4_PLANAR:
            NB: tl.constexpr = K // 32
            for b in range(8):  # a loop, not unrolled: one block's tiles live at a time
                # Blocks past the row's end read its last block again: the activation there is 0.
                bi = tl.minimum(ks * 8 + b, NB - 1)
                if QW == _Q8_0:
                    bp = w + bi * 34
                    q = tl.load((bp + 2 + i).to(tl.pointer_type(tl.int8))).to(tl.int32)
                    dw = _u16(bp)
                elif QW == _Q8_0_PLANAR:  # the quants, then the f16 scales (layout.planar)
                    q = tl.load((w + bi * 32 + i).to(tl.pointer_type(tl.int8))).to(tl.int32)
                    dw = _u16(w + NB * 32 + bi * 2)
                else:
                    if QW == _MXFP4:  # 17-byte blocks: e, then 16 nibble bytes
                        byte = tl.load(w + bi * 17 + 1 + i % 16)
                        e = tl.load(w + bi * 17).to(tl.int32)
                    else:  # planar (layout.planar_mxfp4): the nibble bytes, then the scales
                        byte = tl.load(w + bi * 16 + i % 16)
                        e = tl.load(w + NB * 16 + bi).to(tl.int32)
                    q = _e2m1_low(byte.to(tl.int32) >> (4 * (i // 16)), INTERP) & 255  # byte 0: the value, int8
                    q = q - ((q & 128) << 1)
                    dw = _e8m0_half(e)
                a = _a_tile(xq_ptr, a_rows, live_m, ks * 256 + 32 * b, KP, 32)
                s = _idot(a, q).to(tl.float32)
                dx = tl.load(xd_ptr + a_rows * (KP // 32) + ks * 8 + b, mask=live_m, other=0.0)
                acc += s * (dx * dw)
        else:  # F16, BF16: the rounded activation is a 16-bit value already
            t = tl.arange(0, 64)[:, None]
            for c in range(4):  # a loop, not unrolled: one chunk's tiles live at a time
                k = ks * 256 + 64 * c + t
                a = _a_tile(xv_ptr, a_rows, live_m, ks * 256 + 64 * c, KP, 64)
                if QW == _F16:
                    wv = tl.load(w.to(tl.pointer_type(tl.float16)) + k, mask=k < K, other=0.0)
                    a = a.to(tl.float16)
                else:
                    bits = tl.load(w.to(tl.pointer_type(tl.uint16)) + k, mask=k < K, other=0).to(tl.int32)
                    wv = (bits << 16).to(tl.float32, bitcast=True)
                    if not INTERP:  # the interpreter's dot would multiply bf16 bit patterns: float32 (exact)
                        wv = wv.to(tl.bfloat16)
                        a = a.to(tl.bfloat16)
                acc = tl.dot(a, wv, acc)
        return acc

    @triton.jit
    def _gate_up_kernel(xgq_ptr, xgd_ptr, xgs_ptr, xgv_ptr, xuq_ptr, xud_ptr, xus_ptr, xuv_ptr,
                        g_ptr, g_slot_bytes, g_row_bytes, u_ptr, u_slot_bytes, u_row_bytes,
                        gb_ptr, ub_ptr, h_ptr, tok_ptr, tslot_ptr, texp_ptr,
                        N: tl.constexpr, K: tl.constexpr, QG: tl.constexpr, QU: tl.constexpr, ACT: tl.constexpr,
                        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        INTERP: tl.constexpr):
        """Grid (M tiles, N / BLOCK_N): h[rows of the tile, n] = act(x[tok] . gate[slot], x[tok] .
        up[slot]) (+ biases) for the tile's BLOCK_M padded rows (row_tok -1: padding, x = 0)."""
        mt = tl.program_id(0)
        nb = tl.program_id(1)
        slot = tl.load(tslot_ptr + mt).to(tl.int64)
        if slot < 0:  # a tile past the step's last (Groups.on_device sizes the grid for the most there can be)
            return
        rows_m = mt * BLOCK_M + tl.arange(0, BLOCK_M)
        tok = tl.load(tok_ptr + rows_m)
        live_m = (tok >= 0)[:, None]
        a_rows = tl.maximum(tok, 0).to(tl.int64)[:, None]
        n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        live_n = n < N
        n_c = tl.minimum(n, N - 1).to(tl.int64)[None, :]  # loads stay in bounds; stores are masked
        g_w = g_ptr + slot * g_slot_bytes + n_c * g_row_bytes
        u_w = u_ptr + slot * u_slot_bytes + n_c * u_row_bytes
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        NS: tl.constexpr = (K + 255) // 256
        for ks in range(0, NS):
            acc_g = _k_step(acc_g, g_w, ks, xgq_ptr, xgd_ptr, xgs_ptr, xgv_ptr, a_rows, live_m, K, QG, INTERP)
            acc_u = _k_step(acc_u, u_w, ks, xuq_ptr, xud_ptr, xus_ptr, xuv_ptr, a_rows, live_m, K, QU, INTERP)
        if HAS_BIAS:
            e = tl.load(texp_ptr + mt).to(tl.int64)
            acc_g += tl.load(gb_ptr + e * N + n, mask=live_n, other=0.0)[None, :]
            acc_u += tl.load(ub_ptr + e * N + n, mask=live_n, other=0.0)[None, :]
        h = _activate(acc_g, acc_u, ACT)
        tl.store(h_ptr + rows_m.to(tl.int64)[:, None] * N + n[None, :], h, mask=live_n[None, :])

    @triton.jit
    def _down_kernel(hq_ptr, hd_ptr, hs_ptr, hv_ptr, d_ptr, d_slot_bytes, d_row_bytes, db_ptr, wt_ptr, wt_stride_tok,
                     out_ptr, out_stride_pos, out_stride_tok, tok_ptr, pos_ptr, tslot_ptr, texp_ptr, N,
                     K: tl.constexpr, QD: tl.constexpr, HAS_BIAS: tl.constexpr, WEIGHTED: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERP: tl.constexpr):
        """Grid (M tiles, N / BLOCK_N): out[pos, tok, n] = (h[row] . down[slot] (+ bias)) x the
        routing weight, for the tile's live rows; h rounded for the down type, [padded rows, K]."""
        mt = tl.program_id(0)
        nb = tl.program_id(1)
        slot = tl.load(tslot_ptr + mt).to(tl.int64)
        if slot < 0:  # a tile past the step's last (Groups.on_device sizes the grid for the most there can be)
            return
        rows_m = mt * BLOCK_M + tl.arange(0, BLOCK_M)
        tok = tl.load(tok_ptr + rows_m)
        live = tok >= 0
        a_rows = rows_m.to(tl.int64)[:, None]
        n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        live_n = n < N
        n_c = tl.minimum(n, N - 1).to(tl.int64)[None, :]
        d_w = d_ptr + slot * d_slot_bytes + n_c * d_row_bytes
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        NS: tl.constexpr = (K + 255) // 256
        for ks in range(0, NS):
            acc = _k_step(acc, d_w, ks, hq_ptr, hd_ptr, hs_ptr, hv_ptr, a_rows, live[:, None], K, QD, INTERP)
        if HAS_BIAS:
            e = tl.load(texp_ptr + mt).to(tl.int64)
            acc += tl.load(db_ptr + e * N + n, mask=live_n, other=0.0)[None, :]
        tok64 = tl.maximum(tok, 0).to(tl.int64)
        pos = tl.load(pos_ptr + rows_m, mask=live, other=0).to(tl.int64)
        if WEIGHTED:
            acc = acc * tl.load(wt_ptr + tok64 * wt_stride_tok + pos, mask=live, other=0.0)[:, None]
        dst = out_ptr + pos[:, None] * out_stride_pos + tok64[:, None] * out_stride_tok + n[None, :]
        tl.store(dst, acc, mask=live[:, None] & live_n[None, :])

    # A step's layout on the device (Groups.on_device) in three launches: ranks within blocks of
    # pairs, the plan (slot runs, tiles, padding, rows per expert), then each pair's row. The
    # counts are not specialized on (Triton would compile a variant per count's divisibility by 16,
    # e.g. for a prompt's last, shorter chunk).
    @triton.jit(do_not_specialize=["n_pairs"])
    def _layout_rank_kernel(ids_ptr, slot_of_ptr, n_pairs, slot_ptr, rank_ptr, block_count_ptr,
                            NS: tl.constexpr, BLOCK: tl.constexpr):
        """Grid (pair blocks,): each pair's slot, its rank among the pairs of its slot in the
        block, and the block's pairs per slot."""
        b = tl.program_id(0)
        i = b * BLOCK + tl.arange(0, BLOCK)
        live = i < n_pairs
        slots = tl.arange(0, NS)
        e = tl.load(ids_ptr + i, mask=live, other=0)
        s = tl.where(live, tl.load(slot_of_ptr + e, mask=live, other=-1), -1)
        hit = (s[:, None] == slots[None, :]).to(tl.int32)
        earlier = tl.cumsum(hit, axis=0) - hit
        tl.store(slot_ptr + i, s, mask=live)
        tl.store(rank_ptr + i, tl.sum(hit * earlier, axis=1), mask=live)
        tl.store(block_count_ptr + b * NS + slots, tl.sum(hit, axis=0))

    @triton.jit(do_not_specialize=["n_blocks", "n_tiles"])
    def _layout_plan_kernel(block_count_ptr, n_blocks, exp_of_slot_ptr, n_slots, n_expert, n_tiles,
                            block_first_ptr, tok_ptr, pos_ptr, tslot_ptr, texp_ptr, ecount_ptr,
                            NS: tl.constexpr, BLOCK_M: tl.constexpr, RB: tl.constexpr, CHUNK: tl.constexpr):
        """Grid (1,): each slot's run padded to BLOCK_M in slot order, the first row of each
        block's pairs of each slot, every row padding (-1) until the scatter, the tiles' slots
        and experts (-1 past the last live tile) and the step's rows per expert."""
        slots = tl.arange(0, NS)
        count = tl.zeros([NS], dtype=tl.int32)
        for b0 in range(0, n_blocks, RB):
            bi = b0 + tl.arange(0, RB)
            c = tl.load(block_count_ptr + bi[:, None] * NS + slots[None, :], mask=(bi < n_blocks)[:, None], other=0)
            count += tl.sum(c, axis=0)
        tiles = (count + BLOCK_M - 1) // BLOCK_M
        tile_end = tl.cumsum(tiles, axis=0)
        total = tl.sum(tiles, axis=0)
        running = (tile_end - tiles) * BLOCK_M
        for b0 in range(0, n_blocks, RB):
            bi = b0 + tl.arange(0, RB)
            m = (bi < n_blocks)[:, None]
            c = tl.load(block_count_ptr + bi[:, None] * NS + slots[None, :], mask=m, other=0)
            tl.store(block_first_ptr + bi[:, None] * NS + slots[None, :],
                     running[None, :] + tl.cumsum(c, axis=0) - c, mask=m)
            running += tl.sum(c, axis=0)
        for r0 in range(0, n_tiles * BLOCK_M, CHUNK):
            r = r0 + tl.arange(0, CHUNK)
            pad = tl.full([CHUNK], -1, tl.int32)
            tl.store(tok_ptr + r, pad, mask=r < n_tiles * BLOCK_M)
            tl.store(pos_ptr + r, pad, mask=r < n_tiles * BLOCK_M)
        for t0 in range(0, n_tiles, CHUNK // NS):
            t = t0 + tl.arange(0, CHUNK // NS)
            slot = tl.sum((tile_end[None, :] <= t[:, None]).to(tl.int32), axis=1)
            live = t < total
            e = tl.load(exp_of_slot_ptr + slot, mask=live, other=-1)
            tl.store(tslot_ptr + t, tl.where(live, slot, -1), mask=t < n_tiles)
            tl.store(texp_ptr + t, tl.where(live, e, -1), mask=t < n_tiles)
        for e0 in range(0, n_expert, CHUNK):
            ex = e0 + tl.arange(0, CHUNK)
            tl.store(ecount_ptr + ex, tl.zeros([CHUNK], dtype=tl.int32), mask=ex < n_expert)
        tl.debug_barrier()  # the zeros above land before the counts below
        exp = tl.load(exp_of_slot_ptr + slots, mask=slots < n_slots, other=-1)
        tl.store(ecount_ptr + exp, count, mask=exp >= 0)

    @triton.jit(do_not_specialize=["n_pairs"])
    def _layout_scatter_kernel(slot_ptr, rank_ptr, block_first_ptr, n_pairs, tok_ptr, pos_ptr,
                               K: tl.constexpr, NS: tl.constexpr, BLOCK: tl.constexpr):
        """Grid (pair blocks,): each pair's token and top-k position at its row."""
        b = tl.program_id(0)
        i = b * BLOCK + tl.arange(0, BLOCK)
        s = tl.load(slot_ptr + i, mask=i < n_pairs, other=-1)
        live = (i < n_pairs) & (s >= 0)
        row = tl.load(block_first_ptr + b * NS + s, mask=live, other=0) + tl.load(rank_ptr + i, mask=live, other=0)
        tl.store(tok_ptr + row, (i // K).to(tl.int32), mask=live)
        tl.store(pos_ptr + row, (i % K).to(tl.int32), mask=live)


# -------------------------------------------------------------------- host side

@dataclass(frozen=True)
class GroupedConfig:
    block_m: int  # rows of one expert per tile (each expert's run is padded to a multiple)
    block_n: int  # output columns per tile
    num_warps: int = 4
    num_stages: int = 2


# Defaults per kernel and weight type (gate's for gate/up, down's for down; block_m alike, as
# both kernels walk the same padded runs, whatever the gate and down types). A 512-token chunk
# gives each of 128 experts ~32 rows (top-8), so 32-row tiles pad far fewer rows than 64-row
# ones. Measured on the H200 (session 9; Qwen3-30B-A3B experts, all four launches, random
# routing, one tile for both kernels; .runs-style sweep, docs/BENCHMARKS.md), µs per layer
# step at 512 / 4,096 tokens:
#   Q4_K  32x64 w4 s3   1,059 / 6,039   (32x64 w4 s2: 1,166 / 6,414; 64x64 w4 s2: 2,224 / 9,603)
#   Q6_K  32x64 w4 s3   1,635 / 8,676   (32x64 w4 s2: 1,605 / 9,048; 32x64 w8 s2: 1,623 / 9,216)
#   Q8_0  32x64 w4 s2     929 / 4,841   (64x64 w4 s2: 1,064 / 4,404)
# Session 18 re-swept Q4_K (8 tiles incl. 8 warps, 4 stages, 32- and 128-wide, 64-row): 32x64 w4 s3
# still the fastest, 1,032 / 5,990 µs. Q5_K takes Q4_K's tile (not timed on its own). Compiled
# for sm_90 (engine/quant/triton_aot.py, tests/quant/test_grouped_gemm.py), these spill nothing.
# `moestudio bench kernels --only grouped --sweep` times others. block_m is the planner's
# GROUPED_BLOCK_M, which reserves the padded rows.
_K_QUANTS = (QT.Q4_K, QT.Q5_K, QT.Q6_K)
GATE_UP_CONFIG: dict[QT, GroupedConfig] = {t: GroupedConfig(GROUPED_BLOCK_M, 64, 4, 3 if t in _K_QUANTS else 2)
                                           for t in GROUPED_TYPES}
DOWN_CONFIG: dict[QT, GroupedConfig] = dict(GATE_UP_CONFIG)
# A prompt's dense products (dense() below) run the down kernel with one weight for every row:
# taller tiles pad nothing there and decode each weight tile for more rows. Measured on the H200
# (session 11, `moestudio bench kernels --only prompt --sweep`; Qwen3-30B-A3B's fused q/k/v 2048 ->
# 5120 and output 4096 -> 2048), µs at 512 / 4,096 rows:
#   Q8_0  q/k/v  128x64 w4 s2  133 / 718  (32x64 w4 s3: 195 / 1,319; 64x64 w4 s2: 158 / 1,005)
#         output 128x64 w4 s2  122 / 611  (32x64 w4 s3: 144 / 1,100; 64x64 w4 s2: 109 / 874)
#   Q4_K  32x64 w4 s3 stays (210 / 1,531 for q/k/v): every taller tile was slower (64x64 w4 s3
#         spills registers, 300 / 2,148; 64x64 w8 s3 does not, 355 / 2,662).
# The other types keep the down kernel's tile until measured.
DENSE_CONFIG: dict[QT, GroupedConfig] = {**DOWN_CONFIG, QT.Q8_0: GroupedConfig(128, 64, 4, 2)}


def supports(w) -> bool:
    """Whether these kernels run the experts `w` (engine.layers.moe.ExpertWeights)."""
    return tk.supports(w) and all(t.qtype in GROUPED_TYPES for t in (w.gate, w.up, w.down))


@dataclass
class Groups:
    """The pairs of a step laid out for the grouped kernels: sorted by slot, each slot's run of
    rows padded to block_m. row_tok/row_pos [tiles * block_m] (-1: padding), tile_slot and
    tile_exp [tiles], all int32 on the device."""

    row_tok: torch.Tensor
    row_pos: torch.Tensor
    tile_slot: torch.Tensor
    tile_exp: torch.Tensor
    block_m: int

    @property
    def tiles(self) -> int:
        return self.tile_slot.numel()

    @classmethod
    def build(cls, ids_host: np.ndarray, slot_of: np.ndarray, block_m: int, device) -> "Groups":
        """ids_host [T, k] expert ids; slot_of [n_expert] -> slot, -1 for experts not in this
        batch (their pairs are left out)."""
        pair_slot = slot_of[ids_host]
        tok, pos = np.nonzero(pair_slot >= 0)
        slot = pair_slot[tok, pos]
        order = np.argsort(slot, kind="stable")
        tok, pos, slot = tok[order], pos[order], slot[order]
        slots, start, count = np.unique(slot, return_index=True, return_counts=True)
        tiles = -(-count // block_m)
        first_tile = np.concatenate([[0], np.cumsum(tiles)[:-1]]).astype(np.int64)
        group = np.repeat(np.arange(len(slots)), count)
        row = first_tile[group] * block_m + (np.arange(len(tok)) - start[group])
        n_rows = int(tiles.sum()) * block_m
        meta = np.full((2, n_rows), -1, np.int32)
        meta[0, row], meta[1, row] = tok, pos
        tile_slot = np.repeat(slots, tiles).astype(np.int32)
        live = slot_of >= 0
        exp_of_slot = np.full(int(slot_of.max(initial=-1)) + 1, -1, np.int32)
        exp_of_slot[slot_of[live]] = np.nonzero(live)[0]
        tables = upload_tables([meta[0], meta[1], tile_slot, exp_of_slot[tile_slot]], torch.device(device))
        return cls(*tables, block_m)

    @classmethod
    def on_device(cls, ids: torch.Tensor, slot_of: torch.Tensor, exp_of_slot: torch.Tensor,
                  block_m: int) -> tuple["Groups", torch.Tensor]:
        """`build` on the device in three launches (_layout_*_kernel), without reading the
        routing back, and the step's rows per expert (int32 [n_expert]): ids [T, k] expert ids;
        slot_of [n_expert] -> slot of every expert (all resident); exp_of_slot [slots] -> expert
        (-1: none). The tile count depends on the routing, so the tables are sized for the most a
        step can have, P + min(slots, P) x (block_m - 1) rows for P pairs (as the planner
        reserves them), and the tiles past the last have slot -1 (the kernels return at once)."""
        T, k = ids.shape
        n_pairs, n_slots, n_expert = T * k, exp_of_slot.numel(), slot_of.numel()
        n_tiles = (n_pairs + min(n_slots, n_pairs) * (block_m - 1)) // block_m
        ns, block, rb = layout_tiles(n_slots)
        n_blocks = triton.cdiv(n_pairs, block)
        rows = n_tiles * block_m
        lengths = [rows, rows, n_tiles, n_tiles, n_expert, n_pairs, n_pairs, n_blocks * ns, n_blocks * ns]
        offsets, end = aligned_offsets(lengths)
        packed = torch.empty(end, dtype=torch.int32, device=ids.device)
        (row_tok, row_pos, tile_slot, tile_exp, expert_rows, pair_slot, rank, block_count,
         block_first) = (packed[o:o + n] for o, n in zip(offsets, lengths))
        ids = ids.reshape(-1)
        _layout_rank_kernel[(n_blocks,)](ids, slot_of, n_pairs, pair_slot, rank, block_count, NS=ns, BLOCK=block)
        _layout_plan_kernel[(1,)](block_count, n_blocks, exp_of_slot, n_slots, n_expert, n_tiles, block_first,
                                  row_tok, row_pos, tile_slot, tile_exp, expert_rows, NS=ns, BLOCK_M=block_m,
                                  RB=rb, CHUNK=LAYOUT_TILE)
        _layout_scatter_kernel[(n_blocks,)](pair_slot, rank, block_first, n_pairs, row_tok, row_pos, K=k, NS=ns,
                                            BLOCK=block)
        return cls(row_tok, row_pos, tile_slot, tile_exp, block_m), expert_rows


# Elements of the layout kernels' [pairs, slots] tiles (64 a thread at 4 warps), and of the plan's
# [blocks, slots] reads, whose running sums spill registers at 8,192 (sm_90 cubin). The plan is one
# program walking every pair block in turn: its time is its steps'. Measured on the H200 (session 20,
# Groups.on_device in a replayed graph, 128 slots, top-8, skewed routing), µs at 512 / 4,096 tokens,
# one tile for all three kernels: 2,048 elements 39.7 / 247; 4,096 21.8 / 112; 8,192 16.8 / 62.6;
# 16,384 18.1 / 49.2; 8 or 16 warps slower at every size. This split (session 21, the same bench,
# 2,048 again 39.6 / 247.4): 17.1 / 69.4.
LAYOUT_TILE = 8192
PLAN_READ_TILE = 4096


def layout_tiles(n_slots: int) -> tuple[int, int, int]:
    """The layout kernels' constants for a layer of `n_slots` slots: NS (the slots padded to a
    power of two), BLOCK (pairs a rank or scatter program takes, LAYOUT_TILE elements) and RB
    (blocks a plan step reads, PLAN_READ_TILE elements)."""
    ns = max(16, triton.next_power_of_2(n_slots))
    return ns, max(16, LAYOUT_TILE // ns), max(1, PLAN_READ_TILE // ns)


def _sums(r: tk.Rounded) -> torch.Tensor:
    """The block sums the K-quant min terms read: rows must be rounded by round_rows(..., grouped=True)."""
    if r.sums is None:
        raise ValueError("the grouped GEMM takes rows rounded with round_rows(..., grouped=True)")
    return r.sums


def _opts(cfg: GroupedConfig) -> dict:
    return {} if tk.INTERPRETED else {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def gate_up(xg: tk.Rounded, xu: tk.Rounded, gate_buf: torch.Tensor, up_buf: torch.Tensor, w, groups: Groups,
            cfg: GroupedConfig | None = None) -> torch.Tensor:
    """h [tiles * block_m, n_ff] float32: act(x . gate (+bias), x . up (+bias)) per padded row
    (padding rows hold act(bias)); xg, xu: the token rows rounded for the gate and up types."""
    cfg = cfg or GATE_UP_CONFIG[w.gate.qtype]
    n_ff, d_in = w.gate.shape[1], w.gate.shape[2]
    h = torch.empty((groups.tiles * groups.block_m, n_ff), dtype=torch.float32, device=xg.padded.device)
    if groups.tiles == 0:
        return h
    assert cfg.block_m == groups.block_m and xg.K == d_in
    has_bias = w.gate.bias is not None
    gb = w.gate.bias if has_bias else h
    ub = w.up.bias if w.up.bias is not None else gb
    _gate_up_kernel[(groups.tiles, triton.cdiv(n_ff, cfg.block_n))](
        xg.quants, xg.scales, _sums(xg), xg.padded, xu.quants, xu.scales, _sums(xu), xu.padded,
        gate_buf, gate_buf.stride(0), gate_buf.stride(1), up_buf, up_buf.stride(0), up_buf.stride(1),
        gb, ub, h, groups.row_tok, groups.tile_slot, groups.tile_exp,
        N=n_ff, K=d_in, QG=tk.kernel_type(w.gate.qtype, gate_buf, d_in), QU=tk.kernel_type(w.up.qtype, up_buf, d_in),
        ACT=tk._ACT[w.activation], HAS_BIAS=has_bias,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, INTERP=tk.INTERPRETED, **_opts(cfg))
    return h


def down(hr: tk.Rounded, down_buf: torch.Tensor, w, groups: Groups, weights: torch.Tensor | None,
         out: torch.Tensor, cfg: GroupedConfig | None = None) -> None:
    """out[pos, tok, :] = (hr[row] . down[slot] (+bias)) * weights[tok, pos] for every live row;
    `out` [k, T, D] (the executor's per_slot, last axis contiguous); weights None: unweighted."""
    assert hr.K == w.down.shape[2]
    _down_launch(hr, down_buf, w.down.qtype, w.down.bias, groups, weights, out, cfg or DOWN_CONFIG[w.down.qtype])


def _down_launch(hr: tk.Rounded, buf: torch.Tensor, qtype: QT, bias: torch.Tensor | None, groups: Groups,
                 weights: torch.Tensor | None, out: torch.Tensor, cfg: GroupedConfig) -> None:
    """The down kernel over slot rows buf [slots, n_out, row_bytes] of `qtype` (down's launch,
    and dense's with the whole weight as slot 0)."""
    if groups.tiles == 0:
        return
    assert out.stride(2) == 1 and cfg.block_m == groups.block_m
    n_out = buf.shape[1]
    db = bias if bias is not None else hr.padded
    wt = weights if weights is not None else hr.padded
    _down_kernel[(groups.tiles, triton.cdiv(n_out, cfg.block_n))](
        hr.quants, hr.scales, _sums(hr), hr.padded, buf, buf.stride(0), buf.stride(1), db, wt, wt.stride(0),
        out, out.stride(0), out.stride(1), groups.row_tok, groups.row_pos, groups.tile_slot, groups.tile_exp, n_out,
        K=hr.K, QD=tk.kernel_type(qtype, buf, hr.K), HAS_BIAS=bias is not None, WEIGHTED=weights is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, INTERP=tk.INTERPRETED, **_opts(cfg))


@functools.lru_cache(maxsize=8)
def _all_rows(n_rows: int, block_m: int, device: str) -> Groups:
    """Groups of n_rows rows that all go to slot 0, in order (a prompt chunk's rows through a
    dense weight); kept, as a prompt's chunks repeat one size."""
    return Groups.build(np.zeros((n_rows, 1), np.int64), np.zeros(1, np.int32), block_m, device)


def dense(x: torch.Tensor, raw: torch.Tensor, qtype: QT, cfg: GroupedConfig | None = None) -> torch.Tensor:
    """round(x) @ W.T for x [T, K] float32 (any T; last axis contiguous) and a dense weight kept as
    its GGUF rows raw [1, n_out, row_bytes] (layers/linear.Linear's copy, Q6_K in either layout):
    the down kernel with the whole weight as one expert that every row goes to. Two launches
    (round x; the product) and no float copy of W: prompts' dense products on the int8 tensor
    cores, exact as the experts' are (the decode sizes, up to triton_kernels.DENSE_MAX_ROWS
    rows, take triton_kernels.dense)."""
    cfg = cfg or DENSE_CONFIG[qtype]
    out = torch.empty((1, x.shape[0], raw.shape[1]), dtype=torch.float32, device=x.device)
    if x.shape[0]:
        rows = _all_rows(x.shape[0], cfg.block_m, str(x.device))
        _down_launch(tk.round_rows(x, qtype, grouped=True), raw, qtype, None, rows, None, out, cfg)
    return out[0]


def experts_forward(x: torch.Tensor, buffers, w, ids_host: np.ndarray, slot_of: np.ndarray,
                    weights: torch.Tensor | None, out: torch.Tensor, gate_up_cfg: GroupedConfig | None = None,
                    down_cfg: GroupedConfig | None = None) -> None:
    """Every (token, top-k) pair whose expert has a slot in `slot_of` ([n_expert] -> slot or -1),
    weighted, into out[pos, tok, :]; other pairs are not touched. x [T, D] float32 (rows
    contiguous), buffers = [gate, up, down] slot buffers (engine/moe/slots.LayerSlots)."""
    cfg = gate_up_cfg or GATE_UP_CONFIG[w.gate.qtype]
    groups_forward(x, buffers, w, Groups.build(ids_host, slot_of, cfg.block_m, x.device), weights, out,
                   gate_up_cfg, down_cfg)


def groups_forward(x: torch.Tensor, buffers, w, groups: Groups, weights: torch.Tensor | None, out: torch.Tensor,
                   gate_up_cfg: GroupedConfig | None = None, down_cfg: GroupedConfig | None = None) -> None:
    """experts_forward over pairs already laid out (Groups.build, or Groups.on_device)."""
    gate_up_cfg = gate_up_cfg or GATE_UP_CONFIG[w.gate.qtype]
    down_cfg = down_cfg or DOWN_CONFIG[w.down.qtype]
    if gate_up_cfg.block_m != down_cfg.block_m or groups.block_m != gate_up_cfg.block_m:
        raise ValueError("gate/up and down tiles must pad the expert runs alike (block_m)")
    if groups.tiles == 0:
        return
    xg = tk.round_rows(x, w.gate.qtype, grouped=True)
    same_x = tk._vt(w.up.qtype, grouped=True) == tk._vt(w.gate.qtype, grouped=True)
    xu = xg if same_x else tk.round_rows(x, w.up.qtype, grouped=True)
    h = gate_up(xg, xu, buffers[0], buffers[1], w, groups, gate_up_cfg)
    down(tk.round_rows(h, w.down.qtype, grouped=True), buffers[2], w, groups, weights, out, down_cfg)
