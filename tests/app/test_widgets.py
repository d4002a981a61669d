"""Widgets without an engine: conversation list, copy buttons, chat settings, export and the
context meter, settings form, logs panel, the dashboard's modes (GPU, CPU only, llama.cpp) and
its separate decode and prefill axes, and error dialogs."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from PySide6.QtWidgets import QApplication, QFileDialog, QMessageBox

from app.chat.controller import ChatController
from app.chat.widgets import ChatWidget
from app.dashboard.widgets import DashboardWidget
from app.dialogs import CrashDialog, ErrorDialog
from app.log_buffer import LogBuffer
from app.logs_widget import LogsWidget
from app.settings_panel import SettingsPanel
from app.store import ChatStore
from app.tasks import TaskManager
from app.worker_state import classify_crash


@pytest.fixture
def chat(qtbot, tmp_path):
    store = ChatStore(tmp_path / "c.db")
    ctl = ChatController(store, TaskManager(), lambda: None)
    w = ChatWidget(ctl)
    qtbot.addWidget(w)
    w.set_engine_ready(True)
    return w


def test_conversation_list_new_rename_search_delete(chat, qtbot, monkeypatch):
    ctl, store = chat.c, chat.c.store
    a = ctl.new_conversation()
    store.add_message(a.id, "user", "about routers")
    b = ctl.new_conversation()
    store.add_message(b.id, "user", "about kittens")
    ctl.rename(b.id, "Cats")
    assert [chat.conv_list.item(i).text() for i in range(chat.conv_list.count())] == ["Cats", "New chat"]
    chat.search.setText("router")
    assert chat.conv_list.count() == 1 and chat.conv_list.item(0).text() == "New chat"
    chat.search.clear()
    chat.conv_list.setCurrentRow(0)
    monkeypatch.setattr(QMessageBox, "question", lambda *a, **k: QMessageBox.Yes)
    chat.delete_btn.click()
    assert store.conversation(b.id) is None and store.messages(b.id) == []
    assert [c.id for c in store.conversations()] == [a.id] and ctl.current.id == a.id


def test_copy_buttons_and_settings_before_first_chat(chat, qtbot):
    chat.system_prompt.setPlainText("Answer in French.")
    chat.max_tokens.setValue(77)
    conv = chat.c.new_conversation()  # settings chosen before the first chat carry into it
    assert conv.system_prompt == "Answer in French." and conv.settings["max_tokens"] == 77
    m = chat.c.store.add_message(conv.id, "assistant", "Try:\n```sh\nls -l\n```\nor\n```py\nprint(2)\n```")
    chat.c.open(conv.id)
    w = chat.message_widgets()[-1]
    assert w.code_btn.isVisibleTo(w) and "print(2)" in w.body.text()
    w.code_btn.click()
    assert QApplication.clipboard().text() == "print(2)"
    w.copy_btn.click()
    assert QApplication.clipboard().text() == m.content


def test_sampling_filters_and_stop_strings_are_saved_per_chat(chat):
    conv = chat.c.new_conversation()
    chat.top_k.setValue(40)
    chat.min_p.setValue(0.05)
    chat.repeat_penalty.setValue(1.1)
    chat.stops.setPlainText("END\n\\n\\n")
    saved = chat.c.store.conversation(conv.id).settings
    assert (saved["top_k"], saved["min_p"], saved["repeat_penalty"], saved["stop"]) == (40, 0.05, 1.1, ["END", "\n\n"])
    assert chat.top_k.specialValueText() == "off" and chat.min_p.specialValueText() == "off"
    chat.stops.setPlainText("\n".join(f"s{i}" for i in range(17)))  # over the server's limit: said, not saved
    assert chat.settings_error.isVisibleTo(chat.settings_panel) and "at most 16" in chat.settings_error.text()
    assert chat.c.store.conversation(conv.id).settings["stop"] == ["END", "\n\n"]
    other = chat.c.new_conversation()
    chat.c.open(conv.id)  # reopened: the fields show what was saved
    assert chat.stops.toPlainText() == "END\n\\n\\n" and chat.top_k.value() == 40 and other.id != conv.id
    assert not chat.settings_error.isVisibleTo(chat.settings_panel)


def test_export_markdown_and_json_through_the_dialog(chat, tmp_path, monkeypatch):
    conv = chat.c.new_conversation()
    chat.c.rename(conv.id, "Routers / experts?")
    store = chat.c.store
    store.add_message(conv.id, "user", "What is MoE?")
    reply = store.add_message(conv.id, "assistant", "Experts.")
    store.new_version(reply.id)
    store.update_message(reply.id, content="Many experts.", status="done")
    chat.c.open(conv.id)
    offered = []

    def save_as(target):
        def dialog(parent, caption, start, filters):
            offered.append((Path(start).name, filters))
            return str(target), ""
        monkeypatch.setattr(QFileDialog, "getSaveFileName", dialog)
    save_as(tmp_path / "chat.md")
    chat.export_btn.click()
    assert offered[0][0] == "Routers _ experts_.md" and "JSON" in offered[0][1]
    assert (tmp_path / "chat.md").read_text(encoding="utf-8").startswith("# Routers / experts?\n")
    save_as(tmp_path / "chat.json")
    chat.export_btn.click()
    data = json.loads((tmp_path / "chat.json").read_text(encoding="utf-8"))
    assert data["messages"][1]["content"] == "Many experts."
    assert [v["content"] for v in data["messages"][1]["other_versions"]] == ["Experts."]
    save_as(tmp_path / "chat.txt")
    chat.export_btn.click()
    assert not (tmp_path / "chat.txt").exists() and "ending in .md" in chat.banner.text()


def test_context_meter(chat):
    conv = chat.c.new_conversation()
    chat.c.store.add_message(conv.id, "user", "hi")
    chat.c.store.add_message(conv.id, "assistant", "hello", stats={"prompt_tokens": 1000, "completion_tokens": 24})
    chat.c.open(conv.id)
    assert chat.context_label.text() == "Context 1,024 tokens"  # no engine: the context length is not known
    chat.set_context_size(4096)
    assert (chat.context_bar.value(), chat.context_bar.maximum()) == (1024, 4096)
    assert chat.context_label.text() == "Context 1,024 / 4,096 tokens"
    chat.c.new_conversation()
    assert chat.context_label.text() == "Context 0 / 4,096 tokens"


def test_send_without_engine_says_so(qtbot, tmp_path):
    ctl = ChatController(ChatStore(tmp_path / "c.db"), TaskManager(), lambda: None)
    errors = []
    ctl.error.connect(errors.append)
    assert not ctl.send("hello") and errors and "not running" in errors[0]


def test_settings_panel_round_trip_with_typed_widgets(qtbot):
    from PySide6.QtWidgets import QCheckBox, QComboBox, QDoubleSpinBox, QSpinBox

    from engine.config import ENGINES, LOAD_MODES, POLICIES, Config
    p = SettingsPanel()
    qtbot.addWidget(p)
    every = Config(model="/m.gguf", engine="hybrid", ctx=2048, threads=3, device="cuda:1", moe_expert_cache_size=12,
                   moe_gpu_miss_fraction=0.25, moe_profile_adapt="lru", moe_expert_profile="/p.strp",
                   vram_budget_mib=8000, load_mode="none", prefill_chunk=256, n_cpu_moe=4)
    p.set_config(every, "mine")
    assert p.config() == every  # no file to read limits from: every value kept as written
    p.set_config(Config(model="/m.gguf"), "mine")
    assert p.config() == Config(model="/m.gguf")  # defaults and "not set" round-trip too
    # the widgets follow the schema's domains (engine/config.py), not free text
    f = p.fields
    assert [f["engine"].combo.itemText(i) for i in range(f["engine"].combo.count())] == list(ENGINES)
    assert [f["moe_profile_adapt"].combo.itemText(i) for i in range(len(POLICIES))] == list(POLICIES)
    assert [f["load_mode"].combo.itemText(i) for i in range(len(LOAD_MODES))] == list(LOAD_MODES)
    assert isinstance(f["ctx"].spin, QSpinBox) and f["ctx"].spin.minimum() == 0
    assert f["ctx"].spin.specialValueText() == "the model's training length"
    assert f["threads"].spin.minimum() == 0 and f["threads"].spin.specialValueText() == "auto (physical cores)"
    assert isinstance(f["moe_gpu_miss_fraction"].spin, QDoubleSpinBox)
    assert isinstance(f["moe_gpu_miss_fraction"].auto, QCheckBox) and f["moe_gpu_miss_fraction"].auto.isChecked()
    cache = f["moe_expert_cache_size"]
    assert [cache.combo.itemText(i) for i in range(cache.combo.count())] == ["auto", "all", "number"]
    assert not cache.spin.isEnabled()
    from app.settings_panel import FileEditor, TextEditor
    assert {n for n, w in f.items() if isinstance(w, (FileEditor, TextEditor))} == {"model", "moe_expert_profile"}
    # a value the schema refuses (typed into the device box) is refused with the schema's words
    f["device"].combo.setCurrentText("gpu")
    with qtbot.assertNotEmitted(p.applyRequested):
        p.apply_btn.click()
    assert p.error.text() == "device must be auto, cpu, cuda or cuda:N, got 'gpu'"
    f["device"].combo.setCurrentText("cpu")
    with qtbot.waitSignal(p.applyRequested) as sent:
        p.apply_btn.click()
    assert sent.args[0] == Config(model="/m.gguf", device="cpu") and p.error.text() == ""
    assert isinstance(f["device"].combo, QComboBox)


def test_settings_panel_bounds_the_context_by_the_model_and_says_so(qtbot, make_model, tmp_path):
    """Context 999999 in a preset: shown clamped to the model's training length with a visible
    message, and saved as what the engine will run (never a value /health would contradict)."""
    from app.library import read_model_info
    from engine.config import Config
    model = str(make_model("qwen3moe"))
    train = read_model_info(model).n_ctx_train
    p = SettingsPanel()
    qtbot.addWidget(p)
    p.show()
    p.set_config(Config(model=model, ctx=999999, moe_expert_cache_size=99), "mine")
    assert p.fields["ctx"].spin.maximum() == train and p.fields["ctx"].value() == train
    assert p.fields["moe_expert_cache_size"].value() == 8  # the model's experts per layer
    note = p.model_note.text()
    assert p.model_note.isVisible() and f"trained context {train:,} tokens" in note
    assert f"ctx 999,999 is above this model's training context ({train:,} tokens)" in note and "clamped" in note
    with qtbot.waitSignal(p.applyRequested) as sent:
        p.apply_btn.click()
    assert sent.args[0].ctx == train and sent.args[0].moe_expert_cache_size == 8
    # typed past the bound: the spin box keeps the bound
    p.fields["ctx"].spin.lineEdit().selectAll()
    qtbot.keyClicks(p.fields["ctx"].spin.lineEdit(), "999999")
    assert p.fields["ctx"].value() <= train
    # a model typed in whose bounds were not read yet: the save is refused, saying why
    p.set_config(Config(model="/elsewhere.gguf", ctx=999999), "mine")
    assert p.fields["ctx"].value() == 999999 and p.model_note.text() == ""
    p.fields["model"].line.setText(model)  # no editingFinished: the limits are read at Save
    with qtbot.assertNotEmitted(p.applyRequested):
        p.apply_btn.click()
    assert "ctx 999,999 is above this model's training context" in p.error.text()


def test_settings_panel_shows_what_the_engine_uses(qtbot):
    from engine.config import Config
    p = SettingsPanel()
    qtbot.addWidget(p)
    p.set_config(Config(model="/m.gguf"), "mine")
    health = {"engine": "llamacpp", "engine_reason": "auto: no CUDA GPU here",
              "effective": {"engine": "llamacpp", "ctx": 4096, "threads": 2, "device": "cpu", "n_cpu_moe": 0,
                            "load_mode": "mmap"}}
    p.set_effective(health)
    assert p.effective["ctx"].text() == "engine: 4,096 tokens" and p.effective["threads"].text() == "engine: 2"
    assert p.effective["engine"].text() == "engine: llamacpp" and p.effective["moe_gpu_miss_fraction"].text() == ""
    assert p.engine_note.text() == "Running: llamacpp engine (auto: no CUDA GPU here)"
    fraction = p.fields["moe_gpu_miss_fraction"]  # on auto its number is what auto came to: here nothing
    assert fraction.value() == "auto" and fraction.spin.text() == "does not apply"
    p.set_effective({"engine": "hybrid", "effective": {"moe_expert_cache_size": 0, "moe_gpu_miss_fraction": 0.25}})
    assert p.effective["moe_expert_cache_size"].text() == "engine: 0 slots per layer"
    assert p.effective["moe_gpu_miss_fraction"].text() == "engine: 0.25" and p.effective["ctx"].text() == ""
    assert fraction.value() == "auto" and fraction.spin.text() == "0.250" and not fraction.spin.isEnabled()
    fraction.auto.setChecked(False)  # the user's own number: 0 is 0, and the engine's does not overwrite it
    fraction.spin.setValue(0.0)
    p.set_effective({"engine": "hybrid", "effective": {"moe_gpu_miss_fraction": 0.5}})
    assert fraction.value() == 0.0 and fraction.spin.text() == "0.000"
    fraction.auto.setChecked(True)
    p.set_effective(None)  # the engine stopped
    assert not any(label.text() for label in p.effective.values()) and p.engine_note.text() == ""
    # Save is outside the scrolled options: visible in a short window
    p.resize(700, 300)
    p.show()
    assert p.apply_btn.isVisible() and p.apply_btn.mapTo(p, p.apply_btn.rect().bottomLeft()).y() <= p.height()


def test_logs_filter_and_copy(qtbot, tmp_path):
    buf = LogBuffer()
    w = LogsWidget(buf, tmp_path)
    qtbot.addWidget(w)
    for line in buf.feed("stderr", "INFO loading\nWARNING slow disk\nERROR boom\n"):
        w.append(line)
    assert w.shown_text().count("\n") == 2
    w.filter.setText("disk")
    assert "slow disk" in w.shown_text() and "boom" not in w.shown_text()
    w.filter.clear()
    w.level.setCurrentIndex(2)  # ERROR and above
    assert "boom" in w.shown_text() and "slow" not in w.shown_text()
    w.copy()
    assert "boom" in QApplication.clipboard().text()


def _snap(t: float, requests: int, cache=None, vram=None, decode=5.0, prefill=None) -> dict:
    last = {"ttft_s": 0.05, "prefill_tokens_per_s": prefill, "decode_tokens_per_s": decode} if prefill else {}
    return {"schema": 1, "time": 100.0 + t, "engine": "hybrid" if cache else "llamacpp", "model": "m",
            "requests": requests, "decode_tokens_per_s_now": decode, "last_request": last,
            "ram_used_bytes": 1 << 30, "gpu_memory_used_bytes": vram, "cache": cache, "cpu_percent": 50.0}


def _cache(slots: int = 2) -> dict:
    return {"layers": [0, 1], "n_expert": 4, "slots_per_layer": slots, "gpu_hit": [6, 5], "uploaded": [1, 1],
            "cpu_computed": [1, 2], "swaps": [0, 1], "bytes_uploaded": 2_000_000, "cpu_busy_s": 0.5,
            "residency": [[0, 1, -1, -1], [-1, 0, 1, -1]] if slots else [[-1] * 4] * 2,
            "heat": [[1.0, 0.5, 0.0, 0.2]] * 2, "load_mode": "none", "miss_fraction": 0.2421875,
            "miss_fraction_tuning": {"upload_s": 8e-5, "cpu_s": 1.4e-4, "fraction": 0.64}}


def _shown(d: DashboardWidget) -> set[str]:
    return {name for name, w in d.panels.items() if w.isVisibleTo(d)}


def test_dashboard_without_expert_cache_says_so(qtbot):
    d = DashboardWidget()
    qtbot.addWidget(d)
    d.show()
    for t in range(3):
        d.ingest(_snap(t, t, decode=5.0 + t))
    d.redraw()
    assert d.mode == "no_cache" and _shown(d) == {"decode", "prefill", "memory", "cpu"}
    assert "llama.cpp engine" in d.mode_note.text() and d.mode_note.isVisibleTo(d)
    assert list(d.decode_curve.getData()[1]) == [5.0, 6.0, 7.0]
    assert d.hit_curves[0].getData()[1] is None or len(d.hit_curves[0].getData()[1]) == 0
    assert "resident" not in d.summary.text() and "VRAM" not in d.summary.text()
    # why llama.cpp runs: the server's reason (/health), told in this layout only
    assert not d.why_note.isVisibleTo(d)
    reason = ("auto: no CUDA GPU here; llama.cpp is faster on the CPU alone "
              "(--engine hybrid runs the MoE Studio engine anyway)")
    d.set_engine_reason(reason)
    assert d.why_note.isVisibleTo(d) and d.why_note.text() == f"<b>Why llama.cpp:</b> {reason}"
    d.ingest(_snap(3, 3, cache=_cache(slots=0)))  # the hybrid engine (another start): no such note
    d.redraw()
    assert d.mode == "cpu" and not d.why_note.isVisibleTo(d)


def test_dashboard_cpu_only_mode_shows_heat_cpu_and_ram_and_says_why(qtbot):
    d = DashboardWidget()
    qtbot.addWidget(d)
    d.show()
    d.ingest(_snap(0, 0, cache=_cache(slots=0)))
    d.ingest(_snap(1, 1, cache=_cache(slots=0)))
    d.redraw()
    assert d.mode == "cpu" and _shown(d) == {"decode", "prefill", "cpu", "memory", "heat"}
    assert "no GPU is in use" in d.mode_note.text() and d.mode_note.isVisibleTo(d)
    assert "Expert heat" in d.heat_plot.getPlotItem().titleLabel.text
    assert d.image.image.shape == (2, 4) and (d.image.image < 128).all()  # nothing resident: the RAM colours
    assert not d.vram_curve.isVisible() and "VRAM" not in d.summary.text()
    assert "CPU expert pool busy 0.50 s" in d.summary.text() and "hit rate" not in d.summary.text()
    # a GPU appears (another engine start): the GPU panels come back
    d.ingest(_snap(2, 2, cache=_cache(), vram=1 << 29))
    d.redraw()
    assert d.mode == "gpu" and _shown(d) == set(d.panels) and not d.mode_note.isVisibleTo(d)
    assert d.vram_curve.isVisible() and "VRAM 0.50 GiB" in d.summary.text()


def test_decode_and_prefill_have_separate_axes(qtbot):
    d = DashboardWidget()
    qtbot.addWidget(d)
    d.show()
    for t in range(4):  # prefill ~1,600 tok/s, decode ~60: each plot scales to its own numbers
        d.ingest(_snap(t, t, decode=58.0 + t, prefill=1600.0 + 10 * t))
    d.redraw()
    assert list(d.prefill_curve.getData()[1]) == [1610.0, 1620.0, 1630.0]
    assert d.prefill_curve.getViewBox() is not d.decode_curve.getViewBox()
    for plot in (d.decode_plot, d.prefill_plot):
        plot.getPlotItem().getViewBox().updateAutoRange()
    (_, decode_top) = d.decode_plot.getPlotItem().viewRange()[1]
    (prefill_low, _) = d.prefill_plot.getPlotItem().viewRange()[1]
    assert decode_top < 100 and prefill_low > 1000


def test_dashboard_summary_reports_the_measured_miss_split(qtbot):
    d = DashboardWidget()
    qtbot.addWidget(d)
    d.show()
    d.ingest(_snap(0, 1, cache=_cache(), vram=1 << 29))
    d.redraw()
    assert "misses uploaded 24% (measured); experts read from pinned RAM" in d.summary.text()
    assert "hit rate since start 68.8%" in d.summary.text()
    assert "prompt layer steps" not in d.summary.text()  # no prompt yet
    d.ingest(_snap(1, 2, cache={**_cache(), "prompt_steps": {"streamed": 30, "resident": 0, "read back": 66}},
                   vram=1 << 29))
    d.redraw()
    assert "prompt layer steps streamed 30, resident 0, read back 66" in d.summary.text()
    assert "CUDA graphs" not in d.summary.text()
    d.ingest(_snap(2, 3, cache={**_cache(), "prompt_steps": {"streamed": 0, "resident": 96, "read back": 0},
                                "prompt_graph_chunks": 2}, vram=1 << 29))
    d.redraw()
    assert "prompt chunks as CUDA graphs 2" in d.summary.text()
    assert "decode expert step" not in d.summary.text()  # no decode graph yet
    forms = {"Q4_K/Q4_K/Q6_K 2048x768": {"one_launch": True, "one_launch_us": 14.04, "three_launches_us": 19.5},
             "Q4_K/Q4_K/Q4_K 2048x768": {"one_launch": False, "one_launch_us": None, "three_launches_us": None}}
    d.ingest(_snap(3, 4, cache={**_cache(), "decode_expert_step": forms}, vram=1 << 29))
    d.redraw()
    assert "decode expert step Q4_K/Q4_K/Q6_K 2048x768: one launch (timed 14.0 against 19.5 \u00b5s)" \
        in d.summary.text()
    assert "decode expert step Q4_K/Q4_K/Q4_K 2048x768: three launches" in d.summary.text()


def test_error_dialogs_copy_details(qtbot):
    d = ErrorDialog("Bad thing", "it broke", "Traceback ...\nValueError: x")
    qtbot.addWidget(d)
    d.copy_btn.click()
    assert "ValueError: x" in QApplication.clipboard().text()
    crash = classify_crash("torch.OutOfMemoryError: CUDA out of memory", 1)
    c = CrashDialog(crash)
    qtbot.addWidget(c)
    assert "GPU memory" in c.windowTitle() and "expert cache size" in c.details_text
    assert c.restart_btn.isVisibleTo(c) and "CUDA out of memory" in c.details.toPlainText()
    c.copy_btn.click()
    assert "CUDA out of memory" in QApplication.clipboard().text()


def test_uncaught_errors_become_a_dialog(qtbot, monkeypatch):
    from app import main as app_main
    shown = []
    monkeypatch.setattr(app_main.ErrorDialog, "show", lambda self: shown.append(self))
    old = sys.excepthook
    app_main._install_excepthook(QApplication.instance())
    try:
        try:
            raise RuntimeError("surprise")
        except RuntimeError:
            sys.excepthook(*sys.exc_info())
    finally:
        sys.excepthook = old
    assert shown and "surprise" in shown[0].details_text and "Traceback" in shown[0].details_text


def test_single_instance(qtbot):
    from app.single_instance import SingleInstance
    first = SingleInstance("moestudio-test-instance")
    assert not first.notify_running(200) and first.listen()
    with qtbot.waitSignal(first.activated, timeout=3000):
        assert SingleInstance("moestudio-test-instance").notify_running()
    first.close()


def test_missing_x11_libraries_are_named(monkeypatch):
    from app.main import missing_x11_libraries
    monkeypatch.delenv("QT_QPA_PLATFORM", raising=False)
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    if not sys.platform.startswith("linux"):
        pytest.skip("Linux only")
    assert missing_x11_libraries(lambda lib: None if lib == "xcb-cursor" else "lib.so") == ["libxcb-cursor0"]
    assert missing_x11_libraries(lambda lib: "lib.so") == []
    monkeypatch.setattr(sys, "frozen", True, raising=False)  # the bundle brings its own
    assert missing_x11_libraries(lambda lib: None) == []
