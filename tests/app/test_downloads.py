"""Downloads from a local hub (tests/app/fake_hub.py, real HTTP on 127.0.0.1, HF_ENDPOINT pointed
at it): search, a repo's quants with sizes, a verified download into the models folder, cancel and
resume with a Range request, and a checksum mismatch refused; then the same through the
Download dialog of the Models tab, whose window keeps running while bytes arrive."""
from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path

import pytest
from PySide6.QtCore import QTimer

from app.downloads import (Cancelled, ChecksumMismatch, Speed, destination, download, eta_text, fit_estimate,
                           partial_bytes, repo_choices, search_gguf_repos)
from app.library import ModelLibrary
from app.models_panel import ModelsPanel
from app.tasks import TaskManager
from engine.errors import UserError

from fake_hub import FakeHub  # tests/app is on sys.path (no package)

REPO = "unsloth/Qwen3-30B-A3B-GGUF"
Q4 = "Qwen3-30B-A3B-Q4_K_M.gguf"


@pytest.fixture
def hub(monkeypatch, make_model):
    model = Path(make_model("qwen3moe")).read_bytes()
    h = FakeHub({REPO: {Q4: model, "Qwen3-30B-A3B-Q8_0.gguf": model[:5000], "README.md": b"# card",
                        "BF16/Qwen3-30B-A3B-BF16-00001-of-00002.gguf": model[:3000],
                        "BF16/Qwen3-30B-A3B-BF16-00002-of-00002.gguf": model[3000:9000]},
                 "someone/tiny-llama-GGUF": {"tiny.Q2_K.gguf": b"GGUF" + bytes(100)}},
                downloads={REPO: 1000, "someone/tiny-llama-GGUF": 5}, wrong_sha256={f"{REPO}/Qwen3-30B-A3B-Q8_0.gguf"})
    monkeypatch.setenv("HF_ENDPOINT", h.start())
    h.model = model
    yield h
    h.stop()


def _choice(name: str):
    return next(c for c in repo_choices(REPO) if c.name == name)


def test_search_and_quants_with_sizes_and_checksums(hub):
    assert [h.repo_id for h in search_gguf_repos("gguf")] == [REPO, "someone/tiny-llama-GGUF"]  # most downloaded first
    assert [h.repo_id for h in search_gguf_repos("qwen3 30b")] == [REPO]
    with pytest.raises(UserError, match="type a few letters"):
        search_gguf_repos("  ")
    with pytest.raises(UserError, match="no such repository"):
        repo_choices("nobody/nothing")
    choices = {c.name: c for c in repo_choices(REPO)}
    assert set(choices) == {Q4, "Qwen3-30B-A3B-Q8_0.gguf", "BF16/Qwen3-30B-A3B-BF16-00001-of-00002.gguf"}
    q4, split = choices[Q4], choices["BF16/Qwen3-30B-A3B-BF16-00001-of-00002.gguf"]
    assert (q4.quant, q4.size, q4.files[0].sha256) == ("Q4_K_M", len(hub.model), hashlib.sha256(hub.model).hexdigest())
    assert split.quant == "BF16" and len(split.files) == 2 and split.size == 9000


def test_download_cancel_resume_and_verify(hub, tmp_path):
    hub.delay_s = 0.01
    q4 = _choice(Q4)
    cancel = threading.Event()
    seen = []

    def progress(done, total, speed):
        seen.append((done, total, speed))
        if done >= 2 << 20:
            cancel.set()

    with pytest.raises(Cancelled):
        download(q4, tmp_path, progress, cancel)
    dest = destination(tmp_path, REPO, Q4)
    part = dest.with_name(dest.name + ".part")
    kept = part.stat().st_size
    assert not dest.exists() and 2 << 20 <= kept < len(hub.model) and partial_bytes(tmp_path, q4) == kept
    assert seen[-1][1] == len(hub.model) and any(s > 0 for _, _, s in seen)
    hub.delay_s = 0.0
    seen.clear()
    path = download(q4, tmp_path, lambda d, t, s: seen.append(d), threading.Event())
    assert path == dest and dest.read_bytes() == hub.model and not part.exists()
    ranges = [r for m, p, r in hub.requests if p.endswith(Q4) and m == "GET"]
    assert ranges[-1] == f"bytes={kept}-"  # resumed, not started over
    assert seen[0] >= kept and seen[-1] == len(hub.model)


def test_split_model_downloads_all_parts(hub, tmp_path):
    split = _choice("BF16/Qwen3-30B-A3B-BF16-00001-of-00002.gguf")
    path = download(split, tmp_path, lambda *a: None, threading.Event())
    assert path.name.endswith("00001-of-00002.gguf")
    assert path.read_bytes() + path.with_name(path.name.replace("00001-of", "00002-of")).read_bytes() == hub.model[:9000]


def test_checksum_mismatch_is_refused_and_the_bytes_deleted(hub, tmp_path):
    q8 = _choice("Qwen3-30B-A3B-Q8_0.gguf")
    with pytest.raises(ChecksumMismatch, match="is not the hub's"):
        download(q8, tmp_path, lambda *a: None, threading.Event())
    dest = destination(tmp_path, REPO, q8.name)
    assert not dest.exists() and not dest.with_name(dest.name + ".part").exists()


def test_helpers():
    assert eta_text(100, 0) == "time left unknown" and eta_text(150, 1.0) == "2 min 30 s left"
    assert eta_text(7200, 1.0) == "2 h 0 min left"
    clock = iter([0.0, 1.0, 2.0, 10.0, 11.0])
    s = Speed(window_s=3.0, clock=lambda: next(clock))
    assert [s.add(d) for d in (0, 100, 200)] == [0.0, 100.0, 100.0]
    assert s.add(1000) == pytest.approx(800 / 8)  # old points drop out of the window
    hw = {"ram_total_bytes": 16 << 30, "gpus": [{"total_bytes": 8 << 30}]}
    assert fit_estimate(4 << 30, hw)[0] and fit_estimate(20 << 30, hw) == (True, "fits in RAM + VRAM (24 GiB)")
    assert fit_estimate(40 << 30, hw)[1].startswith("too big: 40.0 GiB")
    with pytest.raises(UserError, match="outside the models folder"):
        destination(Path("/m"), REPO, "../../evil.gguf")


@pytest.fixture
def panel(qtbot, tmp_path):
    tasks = TaskManager()
    lib = ModelLibrary(tmp_path / "models", tmp_path / "library.json")
    p = ModelsPanel(lib, tasks)
    qtbot.addWidget(p)
    yield p
    p.stop()
    tasks.wait(5)


def _row(table, text: str) -> int:
    return next(r for r in range(table.rowCount()) if table.item(r, 0).text().startswith(text))


def test_dialog_downloads_with_progress_cancel_resume_into_the_library(qtbot, hub, panel):
    panel.open_download()
    dlg = panel.download_dialog
    dlg.query.setText("qwen3")
    dlg.search_btn.click()
    qtbot.waitUntil(lambda: dlg.repos.count() == 1, timeout=10000)
    dlg.repos.setCurrentRow(0)
    qtbot.waitUntil(lambda: dlg.files.rowCount() == 3, timeout=10000)
    row = _row(dlg.files, Q4)
    assert dlg.files.item(row, 1).text() == "Q4_K_M" and dlg.files.item(row, 2).text() == "7.3 MiB"
    # the fit needs the hardware probe of the planner helper
    qtbot.waitUntil(lambda: dlg.files.item(row, 3).text().startswith("fits"), timeout=60000)
    dlg.files.selectRow(row)
    assert dlg.download_btn.text() == "Download" and dlg.download_btn.isEnabled()

    hub.delay_s = 0.02  # ~3 MB/s: time to see progress and cancel
    ticks = []
    timer = QTimer()
    timer.timeout.connect(lambda: ticks.append(time.monotonic()))
    timer.start(20)
    dlg.download_btn.click()
    assert dlg.busy and not dlg.download_btn.isEnabled() and dlg.cancel_btn.isEnabled()
    qtbot.waitUntil(lambda: dlg.progress_bar.value() >= 150, timeout=20000)
    assert "/s, " in dlg.status.text() and "left" in dlg.status.text()
    dlg.cancel_btn.click()
    qtbot.waitUntil(lambda: not dlg.busy, timeout=10000)
    timer.stop()
    assert max(b - a for a, b in zip(ticks, ticks[1:])) < 0.5  # the window kept running
    assert "Cancelled" in dlg.status.text() and dlg.download_btn.text() == "Resume"
    assert "resumable" in dlg.files.item(_row(dlg.files, Q4), 4).text()

    hub.delay_s = 0.0
    with qtbot.waitSignal(dlg.downloaded, timeout=20000) as sig:
        dlg.download_btn.click()
    assert Path(sig.args[0]).read_bytes() == hub.model and "verified" in dlg.status.text()
    assert any(r and r != "bytes=0-" for m, p, r in hub.requests if p.endswith(Q4))  # resumed
    # it lands in the library, read like any other model
    qtbot.waitUntil(lambda: panel.table.rowCount() == 1, timeout=10000)
    assert panel.table.item(0, 1).text() == "qwen3moe" and panel.entries[0].path == str(Path(sig.args[0]).resolve())


def test_dialog_reports_a_checksum_mismatch(qtbot, hub, panel):
    panel.open_download()
    dlg = panel.download_dialog
    dlg.query.setText("qwen3")
    dlg.search()
    qtbot.waitUntil(lambda: dlg.repos.count() == 1, timeout=10000)
    dlg.repos.setCurrentRow(0)
    qtbot.waitUntil(lambda: dlg.files.rowCount() == 3, timeout=10000)
    dlg.files.selectRow(_row(dlg.files, "Qwen3-30B-A3B-Q8_0"))
    dlg.download_btn.click()
    qtbot.waitUntil(lambda: not dlg.busy, timeout=10000)
    assert "sha256" in dlg.error.text() and "deleted" in dlg.error.text()
    assert panel.library.entries() == []


def test_dialog_says_when_the_hub_cannot_be_reached(qtbot, panel, monkeypatch):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{dead}")
    panel.open_download()
    dlg = panel.download_dialog
    dlg.query.setText("qwen3")
    dlg.search()
    # at once: huggingface_hub's search alone retries a refused connection for ~24 s first
    qtbot.waitUntil(lambda: dlg.error.text() != "", timeout=10000)
    assert dlg.error.text().startswith(f"search: cannot reach http://127.0.0.1:{dead}") and "\n" not in dlg.error.text()
