"""engine/quant/layout.py: the GPU copy's layout (Q6_K padded to 224-byte blocks, MXFP4 rows
planar) decodes to exactly the values of the GGUF bytes, and only those two types change layout.
No Triton needed."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from engine.quant.dequant import dequantize, dequantize_blocks
from engine.quant.layout import (MXFP4_BLOCK, Q6_K_BLOCK, Q6_K_PADDED_BLOCK, PlanarRows, copy_views,
                                 dequantize_layout, is_padded_q6_k, is_planar_mxfp4, kernel_layout, layout_bytes,
                                 mxfp4_planar_row, pad_q6_k, planar_mxfp4)
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


@pytest.mark.parametrize("n,K", [(1, 32), (3, 512), (2, 2880)])
def test_planar_mxfp4_dequantizes_bit_identically(n: int, K: int) -> None:
    raw = _rows(QT.MXFP4, n, K, seed=K)
    planar = kernel_layout(raw, QT.MXFP4)
    blocks = K // 32
    assert planar.shape == (n, mxfp4_planar_row(K)) and planar.is_contiguous()
    assert is_planar_mxfp4(planar, QT.MXFP4, K) and not is_planar_mxfp4(raw, QT.MXFP4, K)
    want = dequantize(raw, QT.MXFP4, (n, K))
    assert torch.equal(dequantize_layout(planar, QT.MXFP4, (n, K)), want)
    assert torch.equal(dequantize_layout(raw, QT.MXFP4, (n, K)), want)
    # Nibbles 16-aligned back to back, then the scales, then zeros to a multiple of 16 past them.
    gguf = raw.reshape(n, blocks, MXFP4_BLOCK)
    assert torch.equal(planar[:, :16 * blocks].reshape(n, blocks, 16), gguf[..., 1:])
    assert torch.equal(planar[:, 16 * blocks:17 * blocks], gguf[..., 0]) and not planar[:, 17 * blocks:].any()


def test_planar_mxfp4_rows_never_have_the_gguf_size() -> None:
    """The kernels tell the layouts apart by row size: it must differ for every K."""
    for K in range(32, 32 * 2000, 32):
        row = mxfp4_planar_row(K)
        assert row % 16 == 0 and row > K // 32 * MXFP4_BLOCK and row - K // 32 * MXFP4_BLOCK <= 16
    assert mxfp4_planar_row(2880) == 1536  # gpt-oss: 1,530 GGUF bytes a row


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q5_K, QT.Q8_0], ids=lambda t: t.name)
def test_other_types_keep_the_gguf_layout(qtype: QT) -> None:
    raw = _rows(qtype, 4, 512)
    assert kernel_layout(raw, qtype) is raw
    assert not is_padded_q6_k(raw, qtype, 512) and not is_planar_mxfp4(raw, qtype, 512)
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


def test_copy_views_put_gguf_rows_into_planar_mxfp4_slots() -> None:
    K = 2880
    raw = _rows(QT.MXFP4, 6, K).reshape(3, 2, -1)  # [experts, rows, row_bytes]
    assert layout_bytes(QT.MXFP4, raw.numel(), K) == 6 * 1536
    slots = torch.zeros(2, 2, mxfp4_planar_row(K), dtype=torch.uint8)
    src, dst = copy_views(raw, slots, QT.MXFP4)
    assert isinstance(dst, PlanarRows) and src is raw
    experts, slot_rows = src.unbind(0), dst.unbind(0)
    slot_rows[1].copy_(experts[2])  # as the slots' copier does: one expert into one slot
    assert torch.equal(slots[1], planar_mxfp4(raw[2])) and not slots[0].any()
    with pytest.raises(ValueError, match="not the 90 MXFP4 blocks"):
        slot_rows[0].copy_(experts[0][:, :-17])
    with pytest.raises(ValueError, match="do not go into"):
        copy_views(raw, torch.zeros(2, 2, 1530 + 32, dtype=torch.uint8), QT.MXFP4)
