"""The engine manager's process handling with a fake worker: crash causes, the restart cap,
load errors from /health, cancel, a fixed port kept across starts, a taken port, and no orphans even if the app is killed."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from app.address import port_in_use
from app.engine_manager import LAUNCHER, EngineManager, LaunchSpec, free_port
from app.tasks import TaskManager
from app.worker_state import Cause, State

FAKE = str(Path(__file__).with_name("fake_server.py"))


def fake(mode: str):
    return lambda spec, port: [sys.executable, FAKE, "--port", str(port), "--mode", mode]


@pytest.fixture
def manager(qtbot, app_paths):
    made = []

    def make(mode: str, **kw) -> EngineManager:
        tasks = TaskManager()
        m = EngineManager(app_paths, tasks, command=fake(mode), **kw)
        m.configure(LaunchSpec("model.gguf"))
        made.append((m, tasks))
        return m
    yield make
    for m, tasks in made:
        m.shutdown()
        tasks.wait(2)


def test_starts_reports_progress_and_stops_cleanly(qtbot, manager, port_is_free):
    m = manager("ok")
    progress = []
    m.progressChanged.connect(lambda p, s: progress.append((p, s)))
    with qtbot.waitSignal(m.ready, timeout=15000):
        m.start()
    assert m.state == State.READY and any(s == "reading model" for _, s in progress)
    pid, port = m.pid, m.port
    assert psutil.pid_exists(pid)
    m.shutdown()
    assert m.state == State.STOPPED and not psutil.pid_exists(pid) and port_is_free(port)
    assert "engine stopped" in m.logs.tail(5, ("app",))
    assert (m.paths.log / "engine.log").read_text().count("serving fake") >= 1


def test_gpu_oom_is_told_apart_and_not_retried(qtbot, manager):
    m = manager("oom")
    with qtbot.waitSignal(m.crashed, timeout=15000) as sig:
        m.start()
    crash, will_restart = sig.args
    assert crash.cause == Cause.GPU_OOM and not will_restart
    assert "CUDA out of memory" in crash.tail and m.state == State.CRASHED


def test_crash_loop_restarts_at_most_three_times(qtbot, manager):
    m = manager("segv")
    crashes = []
    m.crashed.connect(lambda c, r: crashes.append((c, r)))
    m.start()
    qtbot.waitUntil(lambda: len(crashes) == 4, timeout=30000)
    assert [r for _, r in crashes] == [True, True, True, False]
    assert crashes[-1][0].cause == Cause.OTHER and "SIGSEGV" in crashes[-1][0].summary
    qtbot.wait(1500)
    assert len(crashes) == 4 and m.state == State.CRASHED
    m.restart()  # the user's Restart gets a fresh allowance
    qtbot.waitUntil(lambda: len(crashes) == 8, timeout=30000)


def test_health_error_kills_worker_and_reports_bad_model(qtbot, manager):
    m = manager("error")
    with qtbot.waitSignal(m.crashed, timeout=15000) as sig:
        m.start()
    crash, will_restart = sig.args
    assert crash.cause == Cause.BAD_MODEL and "not a GGUF" in crash.summary and not will_restart
    assert m.pid is None


def test_cancel_load(qtbot, manager):
    m = manager("slow")
    m.start()
    qtbot.waitUntil(lambda: m.state == State.LOADING, timeout=15000)
    pid = m.pid
    m.cancel_load()
    qtbot.waitUntil(lambda: m.state == State.STOPPED, timeout=10000)
    qtbot.waitUntil(lambda: not psutil.pid_exists(pid), timeout=5000)


def test_stalled_load_times_out(qtbot, manager):
    m = manager("stuck", stall_timeout_s=1.0)
    with qtbot.waitSignal(m.crashed, timeout=20000) as sig:
        m.start()
    assert "no progress" in sig.args[0].summary and "42%" in sig.args[0].summary and not sig.args[1]


def _held_port() -> socket.socket:
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen(1)
    return held


def test_fixed_port_is_the_same_across_two_starts(qtbot, manager, port_is_free):
    m = manager("ok")
    port = free_port()
    m.configure(LaunchSpec("model.gguf", port=port))
    for _ in range(2):
        with qtbot.waitSignal(m.ready, timeout=15000):
            m.start()
        assert m.port == port and m.base_url == f"http://127.0.0.1:{port}"
        assert m.client(timeout=2).health()["status"] == "ok"
        m.shutdown()
        assert port_is_free(port)


def test_taken_port_is_reported_with_the_next_free_one_and_not_swapped(qtbot, manager):
    held = _held_port()
    taken = held.getsockname()[1]
    m = manager("ok")
    m.configure(LaunchSpec("model.gguf", port=taken))
    try:
        with qtbot.waitSignal(m.portBusy, timeout=5000) as sig:
            m.start()
        host, port, suggestion = sig.args
        assert (host, port) == ("127.0.0.1", taken) and suggestion > taken and not port_in_use(host, suggestion)
        assert m.state == State.STOPPED and m.pid is None and m.base_url is None
        assert f"port {taken} on 127.0.0.1 is in use by another program" in m.logs.tail(3, ("app",))
    finally:
        held.close()


def test_port_lost_to_a_race_is_reported_not_retried(qtbot, manager, monkeypatch):
    """Another program binds the port between the check and the worker's bind: the worker's error
    is recognised, and the same port is not retried in a loop."""
    import app.engine_manager as em
    held = _held_port()
    taken = held.getsockname()[1]
    monkeypatch.setattr(em, "port_in_use", lambda host, port: False)
    m = manager("ok")
    m.configure(LaunchSpec("model.gguf", port=taken))
    crashes = []
    m.crashed.connect(lambda c, r: crashes.append((c, r)))
    try:
        with qtbot.waitSignal(m.portBusy, timeout=20000) as sig:
            m.start()
        assert sig.args[1] == taken and not crashes and m.state == State.STOPPED
        assert m.policy.restarts_in_row == 0
    finally:
        held.close()


def test_worker_dies_with_a_killed_app(tmp_path):
    """PR_SET_PDEATHSIG: if the app itself is SIGKILLed, its worker still goes away."""
    if not sys.platform.startswith("linux"):
        pytest.skip("Linux only")
    worker_code = LAUNCHER.replace("from engine.cli import main\nsys.exit(main(sys.argv[1:]))\n",
                                   "import time\nprint('worker up', flush=True)\ntime.sleep(60)\n")
    app_code = textwrap.dedent(f"""
        import os, subprocess, sys, time
        env = dict(os.environ, MOESTUDIO_PARENT_PID=str(os.getpid()))
        p = subprocess.Popen([sys.executable, "-c", {worker_code!r}], env=env, stdout=subprocess.PIPE, text=True)
        p.stdout.readline()
        print(p.pid, flush=True)
        time.sleep(60)
    """)
    app = subprocess.Popen([sys.executable, "-c", app_code], stdout=subprocess.PIPE, text=True)
    worker = int(app.stdout.readline())
    assert psutil.pid_exists(worker)
    os.kill(app.pid, signal.SIGKILL)
    app.wait()
    deadline = time.time() + 5
    while time.time() < deadline and psutil.pid_exists(worker) and psutil.Process(worker).status() != "zombie":
        time.sleep(0.05)
    assert not psutil.pid_exists(worker) or psutil.Process(worker).status() == "zombie"
