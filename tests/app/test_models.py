"""The model library and its tab: the models folder and opened files, what each header says, the
planner's "fits" verdict through the real planner helper, and choosing a model restarting the
engine on it from the Models tab and from the chat header's picker (the real main window,
offscreen, with the fake worker of tests/app/fake_server.py standing in for `moestudio serve`)."""
from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import pytest
from PySide6.QtCore import Qt

from app.engine_manager import free_port
from app.library import ModelLibrary, model_size
from app.main import MainWindow
from app.models_panel import FIT_COLUMN
from app.settings import AppSettings, read_preset
from engine.errors import UserError

FAKE = str(Path(__file__).with_name("fake_server.py"))


def fake_ok(spec, port):
    return [sys.executable, FAKE, "--port", str(port), "--mode", "ok"]


def test_library_lists_folder_and_opened_files_with_their_headers(tmp_path, make_model):
    models = tmp_path / "models"
    (models / "sub").mkdir(parents=True)
    in_folder = shutil.copy(make_model("qwen3moe"), models / "sub" / "qwen.gguf")
    elsewhere = make_model("gpt-oss")
    (models / "broken.gguf").write_bytes(b"GGUF" + bytes(40))
    (models / "half.gguf.part").write_bytes(b"x")  # a download in progress is not a model
    lib = ModelLibrary(models, tmp_path / "library.json")
    lib.add(elsewhere)
    with pytest.raises(UserError, match="cannot be added to the library"):
        lib.add(models / "broken.gguf")
    lib.mark_used(elsewhere, when=time.time() - 10)
    by_name = {Path(e.path).name: e for e in lib.entries()}
    assert set(by_name) == {"qwen.gguf", Path(elsewhere).name, "broken.gguf"}
    q, g, bad = by_name["qwen.gguf"], by_name[Path(elsewhere).name], by_name["broken.gguf"]
    assert (q.info.arch, q.info.n_expert, q.info.n_expert_used, q.info.main_quant) == ("qwen3moe", 8, 2, "Q4_K")
    assert q.size_bytes == Path(in_folder).stat().st_size and not q.opened and q.last_used is None
    assert g.info.arch == "gpt-oss" and g.opened and g.last_used is not None
    assert bad.info is None and bad.error and "(unreadable)" in bad.label
    assert [Path(e.path).name for e in lib.entries()][0] == Path(elsewhere).name  # most recently used first
    # remembered across instances (a new launch), and forgotten on request
    again = ModelLibrary(models, tmp_path / "library.json")
    assert {Path(e.path).name for e in again.entries()} == set(by_name)
    again.forget(g.path)
    assert Path(elsewhere).name not in {Path(e.path).name for e in again.entries()}
    assert Path(elsewhere).is_file()  # forgetting never deletes


def test_split_model_is_one_entry_with_the_size_of_all_shards(tmp_path, make_model):
    models = tmp_path / "models"
    models.mkdir()
    first = shutil.copy(make_model("qwen3moe"), models / "big-00001-of-00002.gguf")
    (models / "big-00002-of-00002.gguf").write_bytes(bytes(1000))
    entries = ModelLibrary(models, tmp_path / "l.json").entries()
    assert [Path(e.path).name for e in entries] == ["big-00001-of-00002.gguf"]
    assert entries[0].size_bytes == model_size(Path(first)) == Path(first).stat().st_size + 1000


@pytest.fixture
def window(qtbot, app_paths, make_model):
    a = Path(shutil.copy(make_model("qwen3moe"), app_paths.models / "alpha.gguf"))
    b = Path(shutil.copy(make_model("olmoe"), app_paths.models / "beta.gguf"))
    AppSettings(api_port=free_port()).save(app_paths.settings_file)
    win = MainWindow(app_paths, autostart=False, show_wizard_if_needed=False, command=fake_ok)
    qtbot.addWidget(win)
    win.show()
    win.models = (str(a.resolve()), str(b.resolve()))
    yield win
    win.engine.shutdown()
    win.models_panel.stop()
    win.tasks.wait(2)


def _row(win, path: str) -> int:
    t = win.models_panel.table
    return next(r for r in range(t.rowCount()) if t.item(r, 0).data(Qt.UserRole) == path)


def test_models_tab_shows_fit_and_starts_the_engine_on_the_chosen_model(qtbot, window):
    win, panel = window, window.models_panel
    alpha, beta = win.models
    qtbot.waitUntil(lambda: panel.table.rowCount() == 2, timeout=10000)
    t = panel.table
    assert t.item(_row(win, alpha), 1).text() == "qwen3moe" and t.item(_row(win, beta), 1).text() == "olmoe"
    assert t.item(_row(win, alpha), 2).text() == "8 (2 active)"
    # the planner's verdict, from the planner helper process (a tiny model fits any machine)
    qtbot.waitUntil(lambda: all(t.item(r, FIT_COLUMN).text().startswith("yes") for r in range(2)), timeout=60000)
    assert {win.chat.model_picker.itemData(i) for i in range(win.chat.model_picker.count())} == {alpha, beta}

    panel.table.selectRow(_row(win, alpha))
    with qtbot.waitSignal(win.engine.ready, timeout=15000):
        panel.use_btn.click()
    assert win.engine.spec.model == alpha and "alpha.gguf" in win.windowTitle()
    assert read_preset(win.paths.presets, win.settings.current_preset).model == alpha
    assert win.chat.model_picker.currentData() == alpha
    qtbot.waitUntil(lambda: t.item(_row(win, alpha), 6).text() == "just now", timeout=10000)
    first_pid = win.engine.pid

    # the chat header's picker: choosing beta restarts the engine on it
    picker = win.chat.model_picker
    with qtbot.waitSignal(win.engine.ready, timeout=15000):
        picker.setCurrentIndex(picker.findData(beta))
        picker.activated.emit(picker.currentIndex())
    assert win.engine.spec.model == beta and win.engine.pid != first_pid and "beta.gguf" in win.windowTitle()
    # and back: alpha's preset is found again, not duplicated
    presets_before = sorted(p.name for p in win.paths.presets.glob("*.toml"))
    with qtbot.waitSignal(win.engine.ready, timeout=15000):
        win.use_model(alpha)
    assert win.engine.spec.model == alpha
    assert sorted(p.name for p in win.paths.presets.glob("*.toml")) == presets_before


def test_open_file_is_remembered_and_bad_files_refused(qtbot, window, tmp_path, make_model):
    win, panel = window, window.models_panel
    qtbot.waitUntil(lambda: panel.table.rowCount() == 2, timeout=10000)
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("hello")
    assert not panel.add_file(str(not_gguf)) and "cannot be added to the library" in panel.error.text()
    outside = make_model("qwen2moe")
    assert panel.add_file(str(outside))
    qtbot.waitUntil(lambda: panel.table.rowCount() == 3, timeout=10000)
    panel.table.selectRow(_row(win, str(Path(outside).resolve())))
    assert panel.forget_btn.isEnabled()
    panel.forget_btn.click()
    qtbot.waitUntil(lambda: panel.table.rowCount() == 2, timeout=10000)
