"""The API address in the app: fixed across engine starts, shown with copy buttons, editable in
the API tab, and a taken port reported with the next free one offered (the real main window,
offscreen, with the fake worker of tests/app/fake_server.py standing in for `moestudio serve`)."""
from __future__ import annotations

import socket
import stat
import sys
from pathlib import Path

import pytest
from PySide6.QtWidgets import QApplication

from app.address import DEFAULT_API_PORT
from app.engine_manager import free_port
from app.main import MainWindow
from app.settings import AppSettings, write_preset
from app.worker_state import State
from engine.config import Config

FAKE = str(Path(__file__).with_name("fake_server.py"))


def fake_ok(spec, port):
    return [sys.executable, FAKE, "--port", str(port), "--mode", "ok"]


@pytest.fixture
def window(qtbot, app_paths, tmp_path):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")  # the fake worker never reads it
    write_preset(app_paths.presets, "default", Config(model=str(model)))
    port = free_port()
    AppSettings(current_preset="default", api_port=port).save(app_paths.settings_file)
    win = MainWindow(app_paths, autostart=False, show_wizard_if_needed=False, command=fake_ok)
    qtbot.addWidget(win)
    win.fixed_port = port
    yield win
    win.engine.shutdown()
    win.tasks.wait(2)


def test_default_port_is_the_servers_default():
    assert AppSettings().api_port == DEFAULT_API_PORT == Config().port


def test_address_is_stable_across_two_engine_starts_and_shown_with_copy(qtbot, window):
    port = window.fixed_port
    url = f"http://127.0.0.1:{port}"
    assert window.api_panel.url.text() == url  # shown before any start: it does not change
    pids = []
    for start in (window.start_engine, window.restart_engine):
        with qtbot.waitSignal(window.engine.ready, timeout=15000):
            start()
        assert window.engine.port == port and window.engine.base_url == url
        assert window.url_label.text() == url and window.api_panel.status.text() == "serving"
        pids.append(window.engine.pid)
    assert pids[0] != pids[1]  # two processes, one address
    window.api_panel.url_row.copy_button.click()
    assert QApplication.clipboard().text() == url
    assert window.api_panel.openai_url.text() == url + "/v1"
    assert window.engine.stored_api_key not in window.api_panel.example.toPlainText()  # masked until revealed
    window.api_panel.key.parent().copy_button.click()
    assert QApplication.clipboard().text() == window.engine.api_key == window.engine.stored_api_key


def test_api_tab_changes_port_and_key_and_restarts(qtbot, window, app_paths):
    with qtbot.waitSignal(window.engine.ready, timeout=15000):
        window.start_engine()
    new_port = free_port()
    panel = window.api_panel
    panel.port.setValue(new_port)
    panel.key.setText("my-own-key")
    with qtbot.waitSignal(window.engine.ready, timeout=15000):
        panel.apply_btn.click()
    assert window.engine.port == new_port and window.engine.api_key == "my-own-key"
    assert panel.url.text() == f"http://127.0.0.1:{new_port}"
    saved = AppSettings.load(app_paths.settings_file)
    assert saved.api_port == new_port
    assert app_paths.api_key_file.read_text() == "my-own-key"
    assert stat.S_IMODE(app_paths.api_key_file.stat().st_mode) == 0o600
    # bad values: a one-line reason, nothing saved, the engine left as it is
    panel.host.setText("")
    panel.apply_btn.click()
    assert panel.error.text().startswith("API host:") and window.engine.port == new_port
    panel.host.setText("127.0.0.1")
    panel.key.setText("two words")
    panel.apply_btn.click()
    assert "API key" in panel.error.text() and app_paths.api_key_file.read_text() == "my-own-key"


def test_taken_port_is_reported_and_the_next_free_one_offered(qtbot, window, app_paths):
    held = socket.socket()
    held.bind(("127.0.0.1", window.fixed_port))
    held.listen(1)
    try:
        with qtbot.waitSignal(window.engine.portBusy, timeout=5000):
            window.start_engine()
        box = window.port_dialog
        assert box is not None and box.isVisible()
        assert f"Port {window.fixed_port} on 127.0.0.1 is in use by another program" in box.text()
        assert window.tabs.currentWidget() is window.api_panel and "is in use" in window.api_panel.error.text()
        assert window.engine.state == State.STOPPED
        suggestion = int(box.use_button.text().split()[-1])
        assert suggestion > window.fixed_port
        with qtbot.waitSignal(window.engine.ready, timeout=15000):
            box.use_button.click()
        assert window.engine.port == suggestion and AppSettings.load(app_paths.settings_file).api_port == suggestion
        assert window.api_panel.url.text().endswith(f":{suggestion}")
    finally:
        held.close()
