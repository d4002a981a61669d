"""The engine worker process: start, staged load progress, logs, crash handling, restart, stop.

`moestudio serve` runs in a QProcess on the fixed address of the app settings (app/address.py)
with the API key kept in the config folder (given through the environment, so it stays out of
`ps`). A port another program holds is found before the start (and if the worker still loses the
race, from its error) and reported through `portBusy` with the next free port, never silently
swapped: tools configured against the address would break. Its stdout and stderr feed the logs panel
and a rotating file. /health is polled (off the GUI thread) for the load progress. A crash is
classified from the stderr tail (app/worker_state.py) and restarted automatically at most
`max_restarts` times in a row when a retry can help. Quitting terminates the worker, waits,
and kills it if it does not exit.

No orphans even if the app itself is killed: the worker is started through a three-line
launcher that asks Linux to send it SIGTERM when its parent dies (PR_SET_PDEATHSIG) before it
runs `engine.cli serve`; that is the same as `python -m engine.cli serve ...` otherwise. In the
bundle, `sys.executable` is the frozen `moestudio`, which runs `-c CODE` as python does
(packaging/moestudio_entry.py), so the same command works there.
"""
from __future__ import annotations


import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from PySide6.QtCore import QObject, QProcess, QProcessEnvironment, QTimer, Signal

from app.address import DEFAULT_API_HOST, base_url, next_free_port, port_in_use
from app.api_client import ApiClient
from app.credentials import load_or_create_api_key
from app.log_buffer import LogBuffer, LogLine
from app.logs import APP_LOG, ENGINE_LOG, setup_logging
from app.paths import AppPaths
from app.tasks import TaskManager
from app.worker_state import Cause, Crash, RestartPolicy, State, classify_crash

log = logging.getLogger(APP_LOG)
engine_log = logging.getLogger(ENGINE_LOG)
PROJECT_ROOT = Path(__file__).resolve().parent.parent

LAUNCHER = (
    "import ctypes,os,signal,sys\n"
    "if sys.platform.startswith('linux'):\n"
    "    try: ctypes.CDLL(None).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG\n"
    "    except Exception: pass\n"
    "    if str(os.getppid()) != os.environ.get('MOESTUDIO_PARENT_PID', str(os.getppid())): sys.exit(0)\n"
    "from engine.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


@dataclass(frozen=True)
class LaunchSpec:
    """What to run: the model, the preset/config file, the address, and any extra serve flags."""
    model: str
    config_file: Path | None = None
    extra_args: tuple[str, ...] = ()
    api_key: str | None = None  # a key the preset itself sets wins over the app's (the server reads it)
    host: str = DEFAULT_API_HOST
    port: int = 0  # 0: a free port chosen at each start (tests); the app passes its fixed port

    def serve_args(self, port: int) -> list[str]:
        args = ["serve", self.model, "--host", self.host, "--port", str(port)]
        if self.config_file:
            args += ["--config", str(self.config_file)]
        return args + list(self.extra_args)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_command(spec: LaunchSpec, port: int) -> list[str]:
    return [sys.executable, "-c", LAUNCHER, *spec.serve_args(port)]


class EngineManager(QObject):
    stateChanged = Signal(str)  # State value
    progressChanged = Signal(int, str)  # percent, stage
    logLine = Signal(object)  # LogLine
    crashed = Signal(object, bool)  # Crash, will restart automatically
    ready = Signal(dict)  # the /health answer
    restarting = Signal(int)  # attempt number
    portBusy = Signal(str, int, int)  # host, the taken port, the next free one (0: none found)

    POLL_MS = 250

    def __init__(self, paths: AppPaths, tasks: TaskManager, parent: QObject | None = None, *,
                 max_restarts: int = 3, stable_s: float = 30.0, stall_timeout_s: float = 600.0,
                 command: Callable[[LaunchSpec, int], list[str]] = default_command):
        super().__init__(parent)
        self.paths, self.tasks, self.command = paths, tasks, command
        setup_logging(paths.log)  # engine.log: the worker's output, rotating
        self.stored_api_key = self.api_key = load_or_create_api_key(paths.api_key_file)
        self.logs = LogBuffer()
        self.policy = RestartPolicy(max_restarts, stable_s)
        self.stall_timeout_s = stall_timeout_s
        self.spec: LaunchSpec | None = None
        self.state = State.STOPPED
        self.port: int | None = None
        self.health: dict = {}
        self.last_crash: Crash | None = None
        self.progress = (0, "")
        self._proc: QProcess | None = None
        self._generation = 0  # bumps at every start: stale /health answers are dropped
        self._poll_in_flight = False
        self._last_progress_change = time.monotonic()
        self._stopping_on_purpose = False
        self._health_error: str | None = None
        self._timer = QTimer(self)
        self._timer.setInterval(self.POLL_MS)
        self._timer.timeout.connect(self._poll)

    # ---- public API ------------------------------------------------------------------------
    @property
    def base_url(self) -> str | None:
        return base_url(self.spec.host, self.port) if self.port and self.spec else None

    @property
    def pid(self) -> int | None:
        if self._proc is None or self._proc.state() == QProcess.NotRunning:
            return None
        return int(self._proc.processId()) or None

    def client(self, timeout: float = 30.0) -> ApiClient | None:
        return ApiClient(self.base_url, self.api_key, timeout) if self.base_url else None

    def configure(self, spec: LaunchSpec) -> None:
        self.spec = spec

    def start(self, spec: LaunchSpec | None = None) -> None:
        if spec is not None:
            self.spec = spec
        if self.spec is None:
            raise RuntimeError("no model configured")
        if self._proc is not None and self._proc.state() != QProcess.NotRunning:
            self.shutdown()
        self.policy.on_start()
        self._launch()

    def restart(self) -> None:
        """The Restart action: a fresh start, and a fresh count of automatic restarts."""
        self.policy.reset()
        self.start()

    def cancel_load(self) -> None:
        if self.state in (State.STARTING, State.LOADING):
            self._log_app("load cancelled")
            self.stop()

    def stop(self) -> None:
        """Asks the worker to exit (SIGTERM); kills it if it is still there after 8 s. Returns at once."""
        self._timer.stop()
        proc = self._proc
        if proc is None or proc.state() == QProcess.NotRunning:
            self._set_state(State.STOPPED)
            return
        self._stopping_on_purpose = True
        self._set_state(State.STOPPING)
        proc.terminate()
        QTimer.singleShot(8000, lambda p=proc: p.state() != QProcess.NotRunning and p.kill())

    def shutdown(self, timeout_ms: int = 8000) -> None:
        """Stops the worker and waits for it: terminate, wait, kill, wait (used on quit)."""
        self._timer.stop()
        proc = self._proc
        if proc is None:
            self._set_state(State.STOPPED)
            return
        if proc.state() != QProcess.NotRunning:
            self._stopping_on_purpose = True
            self._set_state(State.STOPPING)
            proc.terminate()
            if not proc.waitForFinished(timeout_ms):
                self._log_app(f"the engine did not exit within {timeout_ms / 1000:.0f} s; killing it")
                proc.kill()
                proc.waitForFinished(5000)
        self._set_state(State.STOPPED)

    # ---- process ---------------------------------------------------------------------------
    def _launch(self) -> None:
        self._generation += 1
        self.api_key = self.spec.api_key or self.stored_api_key
        if self.spec.port and port_in_use(self.spec.host, self.spec.port):
            self.port = None
            self._port_busy(self.spec.port)
            return
        self.port = self.spec.port or free_port()
        self.health, self._health_error = {}, None
        self._stopping_on_purpose = False
        self._poll_in_flight = False
        proc = QProcess(self)
        env = QProcessEnvironment.systemEnvironment()
        env.insert("MOESTUDIO_API_KEY", self.api_key)
        env.insert("MOESTUDIO_PARENT_PID", str(os.getpid()))
        env.insert("PYTHONUNBUFFERED", "1")
        env.insert("PYTHONPATH", os.pathsep.join(p for p in (str(PROJECT_ROOT), env.value("PYTHONPATH")) if p))
        proc.setProcessEnvironment(env)
        proc.setWorkingDirectory(str(PROJECT_ROOT))
        gen = self._generation
        proc.readyReadStandardOutput.connect(lambda: self._read(proc, "stdout"))
        proc.readyReadStandardError.connect(lambda: self._read(proc, "stderr"))
        proc.finished.connect(lambda code, status: self._finished(proc, gen, code, status))
        proc.errorOccurred.connect(lambda err: self._error(proc, gen, err))
        argv = self.command(self.spec, self.port)
        self._log_app("starting engine: " + " ".join(a if "\n" not in a else "<launcher>" for a in argv))
        self._proc = proc
        self._set_progress(0, "starting the engine process")
        self._set_state(State.STARTING)
        proc.start(argv[0], argv[1:])
        self._timer.start()

    def _read(self, proc: QProcess, source: str) -> None:
        data = proc.readAllStandardOutput() if source == "stdout" else proc.readAllStandardError()
        for line in self.logs.feed(source, bytes(data).decode("utf-8", "replace")):
            self._emit_line(line)

    def _emit_line(self, line: LogLine) -> None:
        engine_log.info("[%s] %s", line.source, line.text)
        self.logLine.emit(line)

    def _log_app(self, text: str) -> None:
        log.info(text)
        line = self.logs.add("app", text)
        engine_log.info("[app] %s", text)
        self.logLine.emit(line)

    def _error(self, proc: QProcess, gen: int, err: QProcess.ProcessError) -> None:
        if err == QProcess.FailedToStart and gen == self._generation:
            self._timer.stop()
            crash = Crash(Cause.OTHER, f"could not start the engine process: {proc.errorString()}", "", None)
            self._crash(crash, allow_restart=False)

    def _finished(self, proc: QProcess, gen: int, code: int, status: QProcess.ExitStatus) -> None:
        self._read(proc, "stdout")
        self._read(proc, "stderr")
        for line in self.logs.flush():
            self._emit_line(line)
        if gen != self._generation:
            return
        self._timer.stop()
        if self._stopping_on_purpose:
            self._log_app(f"engine stopped (exit code {code})")
            self._set_state(State.STOPPED)
            return
        sig = None
        if status == QProcess.CrashExit:
            try:
                sig = signal.Signals(code).name
            except ValueError:
                sig = f"signal {code}"
        crash = classify_crash(self.logs.tail(60), None if sig else code, sig, self._health_error)
        self._crash(crash)

    def _port_busy(self, port: int) -> None:
        host = self.spec.host
        suggestion = next_free_port(host, port)
        self._log_app(f"port {port} on {host} is in use by another program"
                      + (f"; port {suggestion} is free" if suggestion else "") + ": the engine was not started")
        self._set_state(State.STOPPED)
        self.portBusy.emit(host, port, suggestion or 0)

    def _crash(self, crash: Crash, allow_restart: bool = True) -> None:
        self.last_crash = crash
        if crash.cause == Cause.PORT_IN_USE and self.spec.port:  # another program bound it after our check
            self._port_busy(self.spec.port)
            return
        restart = allow_restart and self.policy.should_restart(crash)
        self._log_app(f"engine crashed: {crash.title}: {crash.summary}"
                      + (f" (automatic restart {self.policy.restarts_in_row} of {self.policy.max_restarts})"
                         if restart else ""))
        self._set_state(State.CRASHED)
        self.crashed.emit(crash, restart)
        if restart:
            attempt = self.policy.restarts_in_row
            self.restarting.emit(attempt)
            QTimer.singleShot(300 * attempt, self._auto_restart)

    def _auto_restart(self) -> None:
        if self.state == State.CRASHED:
            self._launch()

    # ---- /health polling -------------------------------------------------------------------
    def _poll(self) -> None:
        if self._poll_in_flight or self.state not in (State.STARTING, State.LOADING):
            return
        if time.monotonic() - self._last_progress_change > self.stall_timeout_s:
            self._health_error = (f"loading made no progress for {self.stall_timeout_s:.0f} s "
                                  f"(stuck at {self.progress[0]}%: {self.progress[1]})")
            self._log_app(self._health_error)
            self._kill_for_error()
            return
        client = self.client(timeout=1.0)
        gen = self._generation
        self._poll_in_flight = True

        def done(h):
            self._poll_in_flight = False
            if gen == self._generation:
                self._on_health(h)

        def failed(_e):
            self._poll_in_flight = False  # not listening yet: Python and torch are still importing

        self.tasks.run(client.health, done, failed)

    def _on_health(self, h: dict) -> None:
        if self.state not in (State.STARTING, State.LOADING):
            return
        self.health = h
        status = h.get("status")
        pct = int(h.get("progress") or 0)
        stage = str(h.get("stage") or status or "")
        if status == "ok":
            self._timer.stop()
            self._set_progress(100, "ready")
            self.policy.on_ready()
            self._set_state(State.READY)
            self._log_app(f"engine ready on {self.base_url} ({h.get('engine', '?')} engine)")
            self.ready.emit(h)
        elif status == "error":
            self._health_error = str(h.get("error") or "the engine reported an error while loading")
            self._log_app(f"engine reported: {self._health_error}")
            self._kill_for_error()
        else:
            self._set_progress(pct, stage)
            self._set_state(State.LOADING)

    def _kill_for_error(self) -> None:
        """The worker is alive but failed (or is stuck): end it and report a crash with the error."""
        self._timer.stop()
        proc, gen = self._proc, self._generation
        self._generation += 1  # its exit is reported here, not by _finished
        if proc is not None and proc.state() != QProcess.NotRunning:
            proc.terminate()
            if not proc.waitForFinished(3000):
                proc.kill()
                proc.waitForFinished(3000)
        crash = classify_crash(self.logs.tail(60), proc.exitCode() if proc else None, None, self._health_error)
        self._generation = gen  # _crash may restart, which bumps it again
        self._crash(crash, allow_restart=False)

    # ---- state ----------------------------------------------------------------------------
    def _set_state(self, state: State) -> None:
        if state != self.state:
            self.state = state
            self.stateChanged.emit(state.value)

    def _set_progress(self, pct: int, stage: str) -> None:
        if (pct, stage) != self.progress:
            self.progress = (pct, stage)
            self._last_progress_change = time.monotonic()
            self.progressChanged.emit(pct, stage)
