"""The wizard's window into the engine's planner, without importing the engine here.

The planner (engine/plan) is pure arithmetic, but the model summary it gives imports the GGUF
reader and the engine's support checks, which the app process must never load. So the wizard
starts one helper process (`python -m engine.plan.service`) that imports them once and then
answers JSON requests line by line in milliseconds. That is what makes "re-priced live as
values change" live rather than 4 s per keystroke.
"""
from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any, Callable

from PySide6.QtCore import QObject, QProcess, QProcessEnvironment, Signal

from app.engine_manager import PROJECT_ROOT
from app.logs import APP_LOG

log = logging.getLogger(APP_LOG)

class PlanService(QObject):
    """Requests go out as JSON lines; answers come back to the callbacks on the GUI thread."""

    ready = Signal()
    failed = Signal(str)

    def __init__(self, parent: QObject | None = None):
        super().__init__(parent)
        self._proc: QProcess | None = None
        self._next_id = 1
        self._pending: dict[int, tuple[Callable[[Any], None] | None, Callable[[str], None] | None,
                                       Callable[[list], None] | None]] = {}
        self._buffer = b""
        self._stderr: list[str] = []
        self.is_ready = False

    def start(self) -> None:
        if self._proc is not None:
            return
        proc = QProcess(self)
        env = QProcessEnvironment.systemEnvironment()
        env.insert("PYTHONUNBUFFERED", "1")
        env.insert("PYTHONPATH", os.pathsep.join(p for p in (str(PROJECT_ROOT), env.value("PYTHONPATH")) if p))
        proc.setProcessEnvironment(env)
        proc.setWorkingDirectory(str(PROJECT_ROOT))
        proc.readyReadStandardOutput.connect(self._read)
        proc.readyReadStandardError.connect(self._read_err)
        proc.finished.connect(self._finished)
        self._proc = proc
        proc.start(sys.executable, ["-m", "engine.plan.service"])

    def request(self, op: str, on_done: Callable[[Any], None] | None = None,
                on_error: Callable[[str], None] | None = None,
                on_progress: Callable[[list], None] | None = None, **params: Any) -> int:
        self.start()
        rid = self._next_id
        self._next_id += 1
        self._pending[rid] = (on_done, on_error, on_progress)
        self._proc.write((json.dumps({"id": rid, "op": op, **params}) + "\n").encode())
        return rid

    def forget(self, rid: int) -> None:
        """Drops the callbacks of a request whose answer no longer matters (a newer re-price)."""
        self._pending.pop(rid, None)

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.finished.disconnect(self._finished)
        proc.closeWriteChannel()  # the helper's loop ends at EOF
        if not proc.waitForFinished(2000):
            proc.kill()
            proc.waitForFinished(2000)
        self.is_ready = False

    def _read_err(self) -> None:
        if self._proc is not None:
            text = bytes(self._proc.readAllStandardError()).decode("utf-8", "replace")
            self._stderr.extend(text.splitlines())
            del self._stderr[:-40]

    def _read(self) -> None:
        if self._proc is None:
            return
        self._buffer += bytes(self._proc.readAllStandardOutput())
        *lines, self._buffer = self._buffer.split(b"\n")
        for raw in lines:
            try:
                msg = json.loads(raw)
            except ValueError:
                continue
            rid = msg.get("id")
            if rid == 0:
                if msg.get("result") == "ready":
                    self.is_ready = True
                    self.ready.emit()
                continue
            callbacks = self._pending.get(rid)
            if callbacks is None:
                continue
            on_done, on_error, on_progress = callbacks
            if "progress" in msg:
                if on_progress:
                    on_progress(msg["progress"])
                continue
            del self._pending[rid]
            if msg.get("ok"):
                if on_done:
                    on_done(msg["result"])
            elif on_error:
                on_error(msg.get("error", "unknown error"))

    def _finished(self, code: int, _status) -> None:
        self._read_err()
        error = f"the planner helper exited (code {code}): " + "\n".join(self._stderr[-10:])
        log.error(error)
        pending, self._pending = self._pending, {}
        self._proc = None
        self.is_ready = False
        for _, on_error, _ in pending.values():
            if on_error:
                on_error(error)
        self.failed.emit(error)
