"""Slot buffers hold experts in the kernels' layout (engine/quant/layout.py): Q6_K blocks
padded to 224 bytes and MXFP4 rows made planar as they are copied in, every other type byte
for byte; what a slot decodes to is exactly the expert of the GGUF file, for resident and
staging slots alike."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from engine.models import build_model
from engine.moe.copier import Copier, upload_tables
from engine.moe.slots import LayerSlots, StagingSlots
from engine.plan.geometry import read_geometry
from engine.quant.dequant import dequantize
from engine.quant.layout import Q6_K_BLOCK, Q6_K_PADDED_BLOCK, layout_bytes


@pytest.mark.parametrize("arch,qtype", [("llama", QT.Q6_K), ("qwen3moe", QT.Q4_K), ("gpt-oss", QT.MXFP4)])
def test_slots_decode_to_the_gguf_experts(make_model, arch: str, qtype: QT) -> None:
    path = make_model(arch, qtype)
    model = build_model(path)
    w = next(iter(model.expert_weights.values()))
    tensors = (w.gate, w.up, w.down)
    assert {t.qtype for t in tensors} == {qtype}
    cpu = torch.device("cpu")
    slots = LayerSlots(w, n_slots=2, staging=StagingSlots(w, 1, cpu), device=cpu, copier=Copier(cpu))
    for n, buffers in ((2, slots.buffers), (1, slots.staging.buffers)):
        for buf, t in zip(buffers, tensors):
            row_bytes = t.raw.shape[-1]
            want = {QT.Q6_K: row_bytes // Q6_K_BLOCK * Q6_K_PADDED_BLOCK, QT.MXFP4: row_bytes // 17 * 16 + 16}
            assert buf.shape == (n, t.shape[1], want.get(qtype, row_bytes))
            assert want.get(qtype, row_bytes) == layout_bytes(qtype, row_bytes, t.shape[2])
    # The planner prices a slot at what the engine allocates for it.
    assert read_geometry(path).expert_slot_bytes == slots.expert_bytes
    last = w.n_expert - 1
    slots.copier.wait(slots.load([(0, last), (1, 0)]))
    assert slots.refresh() == 2 and slots.resident[last] == 0 and slots.resident[0] == 1
    (staged,) = slots.stage([1])
    for slot, is_staged, expert in ((0, False, last), (1, False, 0), (staged, True, 1)):
        for got, t in zip(slots.weights(slot, is_staged), tensors):
            assert torch.equal(got, dequantize(t.raw[expert], t.qtype, t.shape[1:]))
    if qtype == QT.Q6_K:  # the padding after each block is never written
        for buf in slots.buffers + slots.staging.buffers:
            assert not buf.reshape(-1, Q6_K_PADDED_BLOCK)[:, Q6_K_BLOCK:].any()
    if qtype == QT.MXFP4:  # nor the padding after each row's scales
        for buf, t in zip(slots.buffers + slots.staging.buffers, tensors * 2):
            assert not buf[..., t.raw.shape[-1]:].any()


def test_the_residency_version_moves_whenever_the_map_does(make_model) -> None:
    """The decode token's step re-sends the residency map to the GPU only when some layer's
    version moved (token_step.TokenExperts._push_map): every change of `resident` must move it,
    and a refresh that lands nothing must not."""
    model = build_model(make_model("qwen3moe"))
    w = next(iter(model.expert_weights.values()))
    cpu = torch.device("cpu")
    slots = LayerSlots(w, n_slots=2, staging=None, device=cpu, copier=Copier(cpu, delay_s=0.05))
    seen = [slots.version]

    def moved() -> bool:
        seen.append(slots.version)
        return seen[-1] != seen[-2]

    handle = slots.load([(0, 3), (1, 5)])  # empty slots: nothing leaves the map yet
    assert not moved()
    assert slots.refresh() == 0 and not moved()  # in flight
    slots.copier.wait(handle)
    assert slots.refresh() == 2 and moved() and slots.resident[3] == 0
    assert slots.refresh() == 0 and not moved()
    slots.copier.wait(slots.load([(0, 6)]))  # expert 3 leaves the map at once
    assert slots.resident[3] == -1 and moved()
    assert slots.refresh() == 1 and moved() and slots.resident[6] == 0


def test_int32_tables_upload_in_one_copy_each_on_a_16_byte_boundary() -> None:
    tables = [np.arange(n, dtype=np.int64) * 3 for n in (5, 0, 7, 4, 1)]
    got = upload_tables(tables, torch.device("cpu"))
    assert [g.tolist() for g in got] == [t.tolist() for t in tables]
    assert all(g.dtype == torch.int32 and g.data_ptr() % 16 == 0 for g in got)
    assert len({g.untyped_storage().data_ptr() for g in got}) == 1  # one buffer, one copy
