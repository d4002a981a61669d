"""The stats stream (GET /v1/stats/stream) read on a worker thread, snapshots to the GUI as signals."""
from __future__ import annotations


import json
import threading
import time
from typing import Callable

import psutil
from PySide6.QtCore import QObject, Signal

from app.api_client import ApiClient, Cancelled
from app.tasks import TaskManager


class _Run:
    """One connection loop; a new start() makes a new run and retires the old one."""

    def __init__(self):
        self.stop = threading.Event()
        self.stream = None
        self.lock = threading.Lock()

    def close(self) -> None:
        self.stop.set()
        with self.lock:
            if self.stream is not None:
                self.stream.close()


class StatsStreamer(QObject):
    snapshot = Signal(dict)
    health = Signal(dict)  # while the model loads the stream sends the /health body
    status = Signal(str)

    def __init__(self, parent: QObject | None = None):
        super().__init__(parent)
        self._run: _Run | None = None

    @property
    def running(self) -> bool:
        return self._run is not None

    def start(self, tasks: TaskManager, client_factory: Callable[[], ApiClient | None],
              pid: Callable[[], int | None]) -> None:
        self.stop()
        run = self._run = _Run()
        tasks.run(lambda: self._loop(run, client_factory, pid))

    def stop(self) -> None:
        run, self._run = self._run, None
        if run is not None:
            run.close()

    def _loop(self, run: _Run, client_factory, pid_of) -> None:
        proc: psutil.Process | None = None
        while not run.stop.is_set():
            client = client_factory()
            if client is None:
                run.stop.wait(0.5)
                continue
            try:
                stream = client.stats_stream()
                with run.lock:
                    run.stream = stream
                if run.stop.is_set():
                    stream.close()
                self._emit(run, self.status, "connected")
                for event in stream:
                    data = json.loads(event.data)
                    if event.event == "health":
                        self._emit(run, self.health, data)
                        continue
                    pid = pid_of()
                    if pid and (proc is None or proc.pid != pid):
                        proc = psutil.Process(pid)
                        proc.cpu_percent(None)  # the first reading only starts the interval
                    try:
                        data["cpu_percent"] = proc.cpu_percent(None) if proc else None
                    except psutil.Error:
                        proc, data["cpu_percent"] = None, None
                    data["received"] = time.time()
                    self._emit(run, self.snapshot, data)
            except Cancelled:
                break
            except Exception as e:  # engine restarting or gone: try again shortly
                if run.stop.is_set():
                    break
                self._emit(run, self.status, f"stats stream: {e}")
                run.stop.wait(1.0)
            finally:
                with run.lock:
                    run.stream = None

    def _emit(self, run: _Run, signal, value) -> None:
        if run.stop.is_set():
            return  # a retired run says nothing more
        try:
            signal.emit(value)
        except RuntimeError:
            run.stop.set()  # the receiver is gone (app closing)
