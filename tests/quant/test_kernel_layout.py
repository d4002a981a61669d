"""engine/quant/layout.py: the GPU copy's layout (Q6_K padded to 224-byte blocks, MXFP4 and Q8_0
rows planar) decodes to exactly the values of the GGUF bytes, and only those types change layout.
No Triton needed."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from engine.quant.dequant import dequantize, dequantize_blocks
from engine.quant.layout import (PLANAR_BLOCKS, Q6_K_BLOCK, Q6_K_PADDED_BLOCK, PlanarRows, copy_views,
                                 dequantize_layout, is_padded_q6_k, is_planar, kernel_layout, layout_bytes, pad_q6_k,
                                 planar, planar_row)
from engine.synth.randblocks import random_blocks


def _rows(qtype: QT, n: int, K: int, seed: int = 0) -> torch.Tensor:
    arr = random_blocks(np.random.default_rng(seed), qtype, (n, K), K ** -0.5)
    return torch.from_numpy(np.ascontiguousarray(arr).reshape(n, -1))


@pytest.mark.parametrize("n,K", [(1, 256), (5, 768), (3, 2048)])
def test_padded_q6_k_dequantizes_bit_identically(n: int, K: int) -> None:
    raw = _rows(QT.Q6_K, n, K, seed=K)
    padded = kernel_layout(raw, QT.Q6_K)
    assert padded.shape == (n, K // 256 * Q6_K_PADDED_BLOCK) and padded.is_contiguous()
    assert is_padded_q6_k(padded, QT.Q6_K, K) and not is_padded_q6_k(raw, QT.Q6_K, K)
    want = dequantize(raw, QT.Q6_K, (n, K))
    assert torch.equal(dequantize_layout(padded, QT.Q6_K, (n, K)), want)
    assert torch.equal(dequantize_layout(raw, QT.Q6_K, (n, K)), want)  # the GGUF layout passes through
    # The padding is zeros after each block's scale; the block bytes are the file's.
    blocks = padded.reshape(n, K // 256, Q6_K_PADDED_BLOCK)
    assert torch.equal(blocks[..., :Q6_K_BLOCK].reshape(n, -1), raw) and not blocks[..., Q6_K_BLOCK:].any()


PLANAR = [QT.MXFP4, QT.Q8_0]


@pytest.mark.parametrize("qtype", PLANAR, ids=lambda t: t.name)
@pytest.mark.parametrize("n,K", [(1, 32), (3, 512), (2, 2880)])
def test_planar_rows_dequantize_bit_identically(qtype: QT, n: int, K: int) -> None:
    raw = _rows(qtype, n, K, seed=K)
    laid_out = kernel_layout(raw, qtype)
    scale, quants = PLANAR_BLOCKS[qtype]
    blocks = K // 32
    assert laid_out.shape == (n, planar_row(qtype, K)) and laid_out.is_contiguous()
    assert is_planar(laid_out, qtype, K) and not is_planar(raw, qtype, K)
    want = dequantize(raw, qtype, (n, K))
    assert torch.equal(dequantize_layout(laid_out, qtype, (n, K)), want)
    assert torch.equal(dequantize_layout(raw, qtype, (n, K)), want)
    # Quants 16-aligned back to back, then the scales, then zeros to a multiple of 16 past them.
    gguf = raw.reshape(n, blocks, scale + quants)
    assert torch.equal(laid_out[:, :quants * blocks].reshape(n, blocks, quants), gguf[..., scale:])
    end = (quants + scale) * blocks
    assert torch.equal(laid_out[:, quants * blocks:end].reshape(n, blocks, scale), gguf[..., :scale])
    assert not laid_out[:, end:].any()


@pytest.mark.parametrize("qtype", PLANAR, ids=lambda t: t.name)
def test_planar_rows_never_have_the_gguf_size(qtype: QT) -> None:
    """The kernels tell the layouts apart by row size: it must differ for every K; and a K
    step's 16 bytes of scales (8 blocks of Q8_0, two steps of MXFP4) stay inside the row."""
    scale, quants = PLANAR_BLOCKS[qtype]
    for K in range(32, 32 * 2000, 32):
        row, gguf_row, blocks = planar_row(qtype, K), K // 32 * (scale + quants), K // 32
        assert row % 16 == 0 and row > gguf_row and row - gguf_row <= 16
        last_step_scales = quants * blocks + 16 * -(-blocks * scale // 16)
        assert last_step_scales <= row
    assert planar_row(QT.MXFP4, 2880) == 1536  # gpt-oss: 1,530 GGUF bytes a row
    assert planar_row(QT.Q8_0, 4096) == 4368 and planar_row(QT.Q8_0, 768) == 832


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q5_K], ids=lambda t: t.name)
def test_other_types_keep_the_gguf_layout(qtype: QT) -> None:
    raw = _rows(qtype, 4, 512)
    assert kernel_layout(raw, qtype) is raw
    assert not is_padded_q6_k(raw, qtype, 512) and not is_planar(raw, qtype, 512)
    assert torch.equal(dequantize_layout(raw, qtype, (4, 512)), dequantize(raw, qtype, (4, 512)))


def test_pad_q6_k_keeps_leading_axes_and_rejects_other_rows() -> None:
    raw = _rows(QT.Q6_K, 6, 512).reshape(2, 3, -1)  # e.g. [experts, rows, row_bytes]
    padded = pad_q6_k(raw)
    assert padded.shape == (2, 3, 2 * Q6_K_PADDED_BLOCK)
    assert torch.equal(dequantize_layout(padded, QT.Q6_K, (2, 3, 512)), dequantize(raw, QT.Q6_K, (2, 3, 512)))
    with pytest.raises(ValueError, match="210-byte blocks"):
        pad_q6_k(raw[..., :200])
    with pytest.raises(ValueError, match="uint8"):
        pad_q6_k(raw.to(torch.int16))


def test_dequantize_blocks_refuses_what_it_cannot_decode() -> None:
    raw = _rows(QT.Q6_K, 2, 256)
    with pytest.raises(ValueError, match="expected uint8 blocks"):
        dequantize_blocks(raw.reshape(2, Q6_K_BLOCK)[:1], QT.Q6_K, (2, 256))  # too few blocks
    with pytest.raises(ValueError, match="contiguous bytes"):
        dequantize_blocks(raw.repeat_interleave(2, dim=1).reshape(2, -1)[:, ::2], QT.Q6_K, (2, 256))
    with pytest.raises(ValueError, match="expected uint8 blocks"):
        dequantize_blocks(raw.reshape(-1, 2), QT.F16, (2, 256))  # not a block type


def test_copy_views_put_gguf_rows_into_either_layout() -> None:
    raw = _rows(QT.Q6_K, 4, 512).reshape(2, 2, -1)  # [experts, rows, row_bytes]
    slot = torch.zeros(2, 2, layout_bytes(QT.Q6_K, raw.shape[-1], 512), dtype=torch.uint8)
    assert slot.shape[-1] == 2 * Q6_K_PADDED_BLOCK
    src, dst = copy_views(raw[1], slot[0], QT.Q6_K)
    dst.copy_(src)
    assert torch.equal(slot[0], pad_q6_k(raw[1])) and not slot[1].any()
    same = torch.zeros_like(raw[0])
    s2, d2 = copy_views(raw[0], same, QT.Q6_K)  # same layout: the tensors themselves
    assert s2.shape == raw[0].shape and d2.data_ptr() == same.data_ptr()
    d2.copy_(s2)
    assert torch.equal(same, raw[0])
    with pytest.raises(ValueError, match="do not go into"):
        copy_views(raw[0], torch.zeros(2, 500, dtype=torch.uint8), QT.Q6_K)
    assert layout_bytes(QT.Q4_K, 144 * 3, 768) == 144 * 3


@pytest.mark.parametrize("qtype", PLANAR, ids=lambda t: t.name)
def test_copy_views_put_gguf_rows_into_planar_slots(qtype: QT) -> None:
    K = 2880
    block = sum(PLANAR_BLOCKS[qtype])
    raw = _rows(qtype, 6, K).reshape(3, 2, -1)  # [experts, rows, row_bytes]
    assert layout_bytes(qtype, raw.numel(), K) == 6 * planar_row(qtype, K)
    slots = torch.zeros(2, 2, planar_row(qtype, K), dtype=torch.uint8)
    src, dst = copy_views(raw, slots, qtype)
    assert isinstance(dst, PlanarRows) and src is raw
    experts, slot_rows = src.unbind(0), dst.unbind(0)
    slot_rows[1].copy_(experts[2])  # as the slots' copier does: one expert into one slot
    assert torch.equal(slots[1], planar(raw[2], qtype)) and not slots[0].any()
    with pytest.raises(ValueError, match="not the 90 blocks"):
        slot_rows[0].copy_(experts[0][:, :-block])
    with pytest.raises(ValueError, match="do not go into"):
        copy_views(raw, torch.zeros(2, 2, 90 * block + 32, dtype=torch.uint8), qtype)
