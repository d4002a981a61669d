"""The app itself is SIGKILLed while a reply streams: nothing that was checkpointed is lost.

The real app (`python -m app.main`, offscreen) runs over its own user folders with a preset for
the tiny qwen3moe and starts its real worker. MOESTUDIO_TEST_SEND (app/main.py) sends one message
once the engine is ready; the test watches the chat database read-only, and once the growing reply
has been checkpointed it kills the app with SIGKILL: no Python cleanup, no close, no WAL checkpoint.
Then: the database passes `PRAGMA integrity_check`, the earlier chat, the user message and at least
the checkpointed text are there, the app opened again shows the reply as interrupted, and the worker
went away with the app (PR_SET_PDEATHSIG) instead of being left holding the model in memory.
"""
from __future__ import annotations

import os
import signal
import sqlite3
import stat
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # before pytest-qt's QApplication exists

from app.engine_manager import free_port
from app.paths import AppPaths
from app.settings import AppSettings, write_preset
from app.store import ChatStore
from engine.config import Config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
SENT = "Tell me everything about mixtures of experts"
EARLIER = [("user", "An earlier question"), ("assistant", "An earlier answer, shown before the crash")]
CHECKPOINTED_CHARS = 40  # kill once this much of the reply is in the database (several 100 ms checkpoints)
WORKER_EXIT_S = 10.0  # SIGTERM from the kernel, then uvicorn's 3 s graceful shutdown at most


def _read_reply(db: Path, conv_id: int) -> tuple[str, str] | None:
    """(status, content) of the conversation's newest assistant row, read without writing anything."""
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1.0)
    except sqlite3.OperationalError:
        return None  # the app has not created the file yet
    try:
        row = con.execute("SELECT status, content FROM messages WHERE conversation_id=? AND role='assistant' "
                          "ORDER BY id DESC LIMIT 1", (conv_id,)).fetchone()
        return tuple(row) if row else None
    except sqlite3.OperationalError:  # no schema yet
        return None
    finally:
        con.close()


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # dead, waiting for init to reap it
    except psutil.NoSuchProcess:
        return True


@pytest.fixture(scope="module")
def killed_app(make_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("app-kill")
    runtime = root / "runtime"
    runtime.mkdir(mode=0o700)
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "MOESTUDIO_TEST_SEND": SENT,
           "XDG_CONFIG_HOME": str(root / "config"), "XDG_DATA_HOME": str(root / "data"),
           "XDG_STATE_HOME": str(root / "state"), "XDG_CACHE_HOME": str(root / "cache"),
           # Qt puts the single-instance socket in TMPDIR: apart from any other MoE Studio running here
           "TMPDIR": str(runtime), "XDG_RUNTIME_DIR": str(runtime)}
    with pytest.MonkeyPatch.context() as mp:  # the folders the app will compute from the same environment
        for k in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME", "XDG_CACHE_HOME"):
            mp.setenv(k, env[k])
        paths = AppPaths.default().ensure()
    assert str(paths.config).startswith(str(root)) and str(paths.log).startswith(str(root))
    # A first run as the user left it: a preset for the model and a chat that already has one exchange.
    write_preset(paths.presets, "kill-test", Config(model=str(make_model("qwen3moe")), ctx=1024, engine="hybrid"))
    store = ChatStore(paths.chat_db)
    # seed and temperature as tests/app/test_studio.py: this tiny model then runs to max_tokens
    conv = store.create_conversation("Before the crash", settings={"max_tokens": 1000, "seed": 7, "temperature": 0.9})
    for role, text in EARLIER:
        store.add_message(conv.id, role, text)
    store.close()
    AppSettings(current_preset="kill-test", last_conversation=conv.id, api_port=free_port()).save(paths.settings_file)

    output = root / "app-output.txt"  # a file, not a pipe nobody reads while the app runs
    with output.open("w") as out:
        app = subprocess.Popen([sys.executable, "-m", "app.main"], cwd=ROOT, env=env, stdout=out, stderr=out)
    try:
        deadline, seen, workers = time.monotonic() + 180, None, []
        while seen is None:
            assert app.poll() is None, f"the app exited ({app.returncode}):\n{output.read_text()}"
            assert time.monotonic() < deadline, "no checkpointed reply within 180 s"
            row = _read_reply(paths.chat_db, conv.id)
            if row and row[0] == "streaming" and len(row[1]) >= CHECKPOINTED_CHARS:
                workers = [p for p in psutil.Process(app.pid).children(recursive=True) if "serve" in p.cmdline()]
                seen = row[1]
            else:
                time.sleep(0.02)
        os.kill(app.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        assert app.wait(10) == -signal.SIGKILL
        assert len(workers) == 1, workers
        while not _gone(workers[0].pid) and time.monotonic() - killed_at < 30:
            time.sleep(0.05)
        worker_exit_s = time.monotonic() - killed_at
        if not _gone(workers[0].pid):  # the failure test_worker_does_not_outlive_the_app reports: no orphan left
            workers[0].kill()
        print(f"\napp killed with {len(seen)} characters checkpointed; worker gone {worker_exit_s:.2f} s later")
    finally:
        if app.poll() is None:
            app.kill()
            app.wait()
    return SimpleNamespace(paths=paths, conv_id=conv.id, seen=seen, worker_exit_s=worker_exit_s,
                           app_output=output.read_text())


def test_database_is_intact_and_keeps_every_checkpointed_message(killed_app, qapp):
    db = killed_app.paths.chat_db
    assert Path(f"{db}-wal").stat().st_size > 0  # left by the kill (a clean close truncates it): read from it
    con = sqlite3.connect(db)
    try:
        assert con.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        rows = con.execute("SELECT role, content, status FROM messages WHERE conversation_id=? ORDER BY id",
                           (killed_app.conv_id,)).fetchall()
    finally:
        con.close()
    assert [(r, c) for r, c, _ in rows[:3]] == [*EARLIER, ("user", SENT)]
    (role, content, status), = rows[3:]
    assert role == "assistant" and status == "streaming"  # as the kill left it
    assert content.startswith(killed_app.seen)  # no checkpoint lost (later ones may have landed before the kill)
    print(f"\n{len(content)} characters of the reply in the database after the kill ({len(killed_app.seen)} seen)")

    from app.main import MainWindow  # the app started again over the same folders, as a user would

    win = MainWindow(killed_app.paths, autostart=False, show_wizard_if_needed=False)
    try:
        assert win.store.recovered == 1
        assert win.chat_ctl.current.id == killed_app.conv_id
        msgs = win.chat_ctl.messages()
        assert [(m.role, m.content, m.status) for m in msgs] == [
            *((r, c, "done") for r, c in EARLIER), ("user", SENT, "done"), ("assistant", content, "interrupted")]
        widgets = win.chat.message_widgets()
        assert [w.msg.content for w in widgets] == [m.content for m in msgs]
        assert "interrupted" in widgets[-1].status_label.text()  # the reply says it was cut off
    finally:
        win.close()
    again = ChatStore(db)
    assert again.recovered == 0  # recovery is persistent: once interrupted, it stays so
    again.close()


def test_worker_does_not_outlive_the_app(killed_app):
    assert killed_app.worker_exit_s < WORKER_EXIT_S, f"the worker outlived the app by {killed_app.worker_exit_s:.1f} s"


def test_generated_key_is_private_and_never_logged(killed_app):
    paths = killed_app.paths
    key_file = paths.api_key_file
    key = key_file.read_text().strip()
    assert len(key) >= 32
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(key_file.parent.stat().st_mode) & 0o077 == 0  # the folder is this user's only
    logs = sorted(paths.log.glob("*.log*"))
    assert {p.name for p in logs} >= {"app.log", "engine.log"}
    assert "engine ready" in (paths.log / "engine.log").read_text()  # the worker's output was logged
    for p in logs:
        assert key not in p.read_text(errors="replace"), p
    assert key not in killed_app.app_output
