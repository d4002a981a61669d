"""The main window rendered offscreen at the small size the README promises (1024x640): no
plot title wider than its plot, no label that cannot wrap, a chat list that elides long
titles instead of scrolling sideways."""
from __future__ import annotations

import pytest
from PySide6.QtCore import QSize
from PySide6.QtWidgets import QApplication, QLabel

from app.main import MainWindow

from tests.app.test_widgets import _cache, _snap

SMALL = QSize(1024, 640)


@pytest.fixture
def small_window(qtbot, app_paths):
    win = MainWindow(app_paths, autostart=False, show_wizard_if_needed=False)
    qtbot.addWidget(win)
    win.resize(SMALL)
    win.show()
    qtbot.waitExposed(win)
    return win


def _labels_fit(root) -> None:
    """Text that cannot wrap must fit its label."""
    for label in root.findChildren(QLabel):
        if label.isVisibleTo(root) and label.text() and not label.wordWrap():
            assert label.sizeHint().width() <= label.width() + 1, f"{label.text()!r} clipped to {label.width()} px"


def _settle(qtbot) -> None:
    for _ in range(3):
        QApplication.processEvents()
        qtbot.wait(20)


@pytest.mark.parametrize("mode, cache, vram", [("gpu", _cache(), 1 << 29), ("cpu", _cache(slots=0), None),
                                               ("no_cache", None, None)])
def test_dashboard_titles_fit_at_1024x640(small_window, qtbot, mode, cache, vram):
    win, dash = small_window, small_window.dashboard
    assert win.minimumSizeHint().width() <= SMALL.width() and win.minimumSizeHint().height() <= SMALL.height()
    assert win.windowTitle() == "MoE Studio"  # no model chosen yet
    win.tabs.setCurrentWidget(dash)
    for t in range(3):
        dash.ingest(_snap(t, t, cache=cache, vram=vram, decode=60.0, prefill=1600.0))
    dash.redraw()
    _settle(qtbot)
    assert win.size() == SMALL and dash.mode == mode
    plots = dash.visible_plots()
    assert len(plots) == {"gpu": 8, "cpu": 5, "no_cache": 4}[mode]
    for plot in plots:
        title = plot.getPlotItem().titleLabel
        width = title.item.boundingRect().width()
        assert 0 < width <= plot.width(), f"{title.text!r} is {width:.0f} px in a {plot.width()} px plot"
        assert plot.height() >= 100, f"{title.text!r}: plot only {plot.height()} px high"
    _labels_fit(dash)


def test_chat_list_elides_long_titles_without_sideways_scroll(small_window, qtbot):
    win = small_window
    ctl = win.chat_ctl
    long_title = "A very long chat title about routers, experts, caches and the PCIe bus, " * 3 + "the end"
    conv = ctl.new_conversation()
    ctl.rename(conv.id, long_title)
    win.chat.settings_btn.setChecked(True)  # the widest chat layout: the settings column open too
    _settle(qtbot)
    lst = win.chat.conv_list
    item = lst.item(0)
    assert item.toolTip() == long_title
    assert lst.horizontalScrollBar().maximum() == 0 and not lst.horizontalScrollBar().isVisible()
    assert lst.visualItemRect(item).right() <= lst.viewport().width()
    assert lst.textElideMode().name == "ElideRight"
    assert win.size() == SMALL
    store = ctl.store  # a reply with several versions and a known context use: every label of a turn shows
    store.add_message(conv.id, "user", "hello")
    reply = store.add_message(conv.id, "assistant", "one", stats={"prompt_tokens": 90000, "completion_tokens": 31000})
    store.new_version(reply.id)
    store.update_message(reply.id, content="two", status="done",
                         stats={"prompt_tokens": 90000, "completion_tokens": 31000, "tokens_per_s": 12.5, "ttft_s": 0.2})
    ctl.open(conv.id)
    win.chat.set_engine_ready(True)
    win.chat.set_context_size(131072)
    _settle(qtbot)
    assert win.chat.context_label.text() == "Context 121,000 / 131,072 tokens"
    assert win.chat.message_widgets()[-1].version_label.isVisibleTo(win.chat)
    _labels_fit(win.chat)


def test_models_and_api_tabs_fit_at_1024x640(small_window, qtbot, make_model):
    import shutil

    win = small_window
    shutil.copy(make_model("qwen3moe"), win.paths.models / "a-model-with-a-rather-long-file-name-Q4_K_M.gguf")
    win.models_panel.refresh()
    qtbot.waitUntil(lambda: win.models_panel.table.rowCount() == 1, timeout=10000)
    win.chat.set_models([(e.path, e.label) for e in win.models_panel.entries], win.models_panel.entries[0].path)
    win.chat.settings_btn.setChecked(True)  # the widest chat layout
    win.chat.set_context_size(131072)
    _settle(qtbot)
    assert win.size() == SMALL and win.chat.model_picker.width() >= 140
    _labels_fit(win.chat)  # the header's model picker beside the context meter
    for tab in (win.models_panel, win.api_panel):
        win.tabs.setCurrentWidget(tab)
        _settle(qtbot)
        assert win.size() == SMALL
        _labels_fit(tab)
    table = win.models_panel.table
    assert table.horizontalScrollBar().maximum() == 0  # every column visible without sideways scroll
    api = win.api_panel
    assert api.apply_btn.isVisibleTo(api) and api.apply_btn.mapTo(api, api.apply_btn.rect().bottomLeft()).y() <= api.height()
    win.models_panel.stop()
