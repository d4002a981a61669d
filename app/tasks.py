"""One task manager for background work (Anki's TaskManager shape).

`tasks.run(fn, on_done, on_error)` runs `fn()` on a pool thread; `on_done(result)` or
`on_error(exc)` then run on the GUI thread, delivered through a queued signal. Long-lived
streams (chat replies, the stats stream) run here too, reporting through their own signals;
the pool is sized so that they cannot starve short tasks such as /health polls. Plain Python
threads (concurrent.futures): their futures are easier to wait on at shutdown than QRunnables.
"""
from __future__ import annotations


import logging
import traceback
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Callable

from PySide6.QtCore import QObject, Signal, Slot

log = logging.getLogger("moestudio.app")


class _Bridge(QObject):
    finished = Signal(object)  # (callback, value, is_error) in one tuple


class TaskManager(QObject):
    def __init__(self, parent: QObject | None = None, max_threads: int = 8):
        super().__init__(parent)
        self._pool = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="moestudio-task")
        self._futures: set = set()
        self._bridge = _Bridge(self)
        self._bridge.finished.connect(self._finished)
        self._closed = False

    def run(self, fn: Callable[[], Any], on_done: Callable[[Any], None] | None = None,
            on_error: Callable[[BaseException], None] | None = None) -> None:
        if self._closed:
            return
        bridge = self._bridge

        def task() -> None:
            try:
                result = fn()
            except BaseException as e:  # reported on the GUI thread, never lost in a pool thread
                e.__traceback_text__ = traceback.format_exc()
                payload = (on_error, e, 1)
            else:
                payload = (on_done, result, 0)
            try:
                bridge.finished.emit(payload)
            except RuntimeError:
                pass  # the manager is gone (app quitting)

        fut = self._pool.submit(task)
        self._futures.add(fut)
        fut.add_done_callback(self._futures.discard)

    @Slot(object)
    def _finished(self, payload) -> None:
        callback, value, is_error = payload
        if callback is not None:
            callback(value)
        elif is_error:
            log.error("background task failed: %s", getattr(value, "__traceback_text__", value))

    def wait(self, timeout_s: float = 5.0) -> bool:
        """Stops taking tasks and waits for the running ones (app closing)."""
        self._closed = True
        done, pending = wait(list(self._futures), timeout=timeout_s)
        self._pool.shutdown(wait=False, cancel_futures=True)
        return not pending
