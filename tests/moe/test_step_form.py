"""The decode step's form, one launch or three (engine/moe/step_form.py), chosen on the real
kernels over a synthetic model's slots: Triton's interpreter here, the GPU on the device."""
from __future__ import annotations

import warnings

import pytest
import torch
from gguf import GGMLQuantizationType as QT

pytest.importorskip("triton")

from engine.errors import UserError  # noqa: E402
from engine.models import build_model  # noqa: E402
from engine.moe import step_form  # noqa: E402
from engine.moe.hybrid import HybridExperts, HybridOptions  # noqa: E402
from engine.moe.step_form import SlotLayer, StepForm  # noqa: E402
from engine.quant import triton_kernels as tk  # noqa: E402

DEVICE = "cpu" if tk.INTERPRETED else "cuda"
on_kernels = pytest.mark.skipif(not tk.INTERPRETED and not torch.cuda.is_available(),
                                reason="the kernels run in Triton's interpreter (no GPU) or on CUDA")
interp = pytest.mark.skipif(not tk.INTERPRETED, reason="the interpreter's run (the GPU's: the gpu tests)")


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch):
    monkeypatch.setattr(step_form, "_chosen", {})
    monkeypatch.setenv("MOESTUDIO_ONE_LAUNCH_STEP", "auto")
    if tk.INTERPRETED:  # one program per pair (the interpreter's fastest); its timings only need to exist
        for configs in (tk.GATE_UP_CONFIG, tk.DOWN_CONFIG):
            for tile in configs:
                monkeypatch.setitem(configs, tile, tk.TileConfig(256, 4))
        monkeypatch.setattr(tk, "GATE_UP_ROW_IN_TURNS", tk.TileConfig(256, 4))
        monkeypatch.setattr(step_form, "REPLAYS", 1)


def slot_layers(make_model, arch: str, qtype: QT, landed: int | None = None) -> tuple[HybridExperts, list, int]:
    """Every expert of the model in a slot, `landed` of them in each layer published as landed."""
    model = build_model(make_model(arch, qtype), DEVICE)
    n_expert = model.config.n_expert
    hybrid = HybridExperts(model.expert_weights, DEVICE, HybridOptions(slots_per_layer=n_expert, miss_fraction=0.0,
                                                                      policy="off"))
    hybrid.prefill_residency([(layer, e) for layer in hybrid.layer_ids for e in range(n_expert)])
    layers = []
    for L in hybrid.layers.values():
        L.slots.refresh()
        resident = L.slots.resident.copy()
        if landed is not None:
            resident[landed:] = -1
        layers.append(SlotLayer(L.w, L.slots.buffers, resident))
    return hybrid, layers, model.config.n_expert_used


ARCHS = [("qwen3moe", QT.Q4_K), ("gpt-oss", QT.MXFP4), ("qwen3moe", QT.Q8_0)]


@interp
@pytest.mark.parametrize("arch,qtype", ARCHS)
def test_one_launch_is_checked_then_timed_once_per_kind(make_model, arch, qtype):
    check_choice(make_model, arch, qtype)


@pytest.mark.gpu
@pytest.mark.parametrize("arch,qtype", ARCHS)
def test_gpu_one_launch_is_checked_then_timed_once_per_kind(make_model, arch, qtype):
    check_choice(make_model, arch, qtype)


def check_choice(make_model, arch: str, qtype: QT) -> None:
    """The engine's one launch (every tile at its default) gives its three launches' bits on the
    model's slots, so no warning; both forms are timed; the faster by ONE_LAUNCH_SHARE is kept,
    and asked again for the same kind the choice is not made again."""
    hybrid, layers, k = slot_layers(make_model, arch, qtype)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            form = step_form.choose(layers, k, torch.device(DEVICE))
        assert form.one_launch_us > 0 and form.three_launches_us > 0
        assert form.one_launch == (form.one_launch_us <= step_form.ONE_LAUNCH_SHARE * form.three_launches_us)
        assert step_form.choose(layers[::-1], k, torch.device(DEVICE)) is form
    finally:
        hybrid.close()


@on_kernels
def test_the_mode_forces_a_form_untimed(make_model, monkeypatch):
    hybrid, layers, k = slot_layers(make_model, "qwen3moe", QT.Q4_K)
    try:
        monkeypatch.setenv("MOESTUDIO_ONE_LAUNCH_STEP", "1")
        assert step_form.choose(layers, k, torch.device(DEVICE)) == StepForm(True)
        monkeypatch.setenv("MOESTUDIO_ONE_LAUNCH_STEP", "0")
        assert step_form.choose(layers, k, torch.device(DEVICE)) == StepForm(False)
        monkeypatch.delenv("MOESTUDIO_ONE_LAUNCH_STEP")  # the default: three launches, nothing run
        ran = []
        forward = tk.experts_forward
        monkeypatch.setattr(tk, "experts_forward", lambda *a, **kw: (ran.append(1), forward(*a, **kw)))
        assert step_form.choose(layers, k, torch.device(DEVICE)) == StepForm(False) and not ran
        monkeypatch.setenv("MOESTUDIO_ONE_LAUNCH_STEP", "yes")
        with pytest.raises(UserError, match="0 .* auto .* 1"):
            step_form.choose(layers, k, torch.device(DEVICE))
    finally:
        hybrid.close()


@on_kernels
def test_a_one_launch_that_differs_keeps_three_launches(make_model, monkeypatch):
    """One bit off in the one launch's output: a warning, and the three launches."""
    real = tk._expert_step

    def one_bit_off(*args) -> None:
        real(*args)
        args[8].view(torch.int32)[-1, 0, -1] ^= 1  # out

    monkeypatch.setattr(tk, "_expert_step", one_bit_off)
    hybrid, layers, k = slot_layers(make_model, "qwen3moe", QT.Q4_K)
    try:
        with pytest.warns(RuntimeWarning, match="differs from the three launches'"):
            assert step_form.choose(layers, k, torch.device(DEVICE)) == StepForm(False)
    finally:
        hybrid.close()


@on_kernels
def test_the_step_runs_on_landed_slots_only(make_model, monkeypatch):
    """With fewer landed experts than the top-k the timed pairs repeat them; with none landed
    nothing runs and the three launches stay."""
    ran = []
    forward = tk.experts_forward
    monkeypatch.setattr(tk, "experts_forward", lambda *a, **kw: (ran.append(a[5].clone()), forward(*a, **kw)))
    monkeypatch.setenv("MOESTUDIO_ONE_LAUNCH_STEP", "1")
    hybrid, layers, k = slot_layers(make_model, "qwen3moe", QT.Q4_K, landed=1)
    try:
        assert step_form.choose(layers, k, torch.device(DEVICE)) == StepForm(True)
        slot = layers[0].resident[0]
        assert ran and all(s.tolist() == [slot] * k for s in ran)
        step_form._chosen.clear()
        ran.clear()
        none = [SlotLayer(layer.w, layer.buffers, layer.resident * 0 - 1) for layer in layers]
        assert step_form.choose(none, k, torch.device(DEVICE)) == StepForm(False) and not ran
    finally:
        hybrid.close()
