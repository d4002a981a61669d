"""The engine thread: loads the model in the background, then runs queued generations one at a time.

Generation is blocking torch/llama.cpp code, so it runs in one dedicated thread and never on
the event loop. Each request becomes a Job in a FIFO queue; the thread streams the job's
events back into an asyncio.Queue on the server's loop. A client that goes away sets the
job's cancel event: a waiting job is skipped, a running one stops at its next token, and the
next job starts.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from engine.config import Config
from engine.errors import UserError, printable
from engine.server.loader import Loaded, Progress, load_engine

log = logging.getLogger("moestudio.server")
END = object()  # the last item of every job's event queue


@dataclass
class Job:
    request: Any  # engine.runtime.engine.Request
    loop: asyncio.AbstractEventLoop
    cancel: threading.Event = field(default_factory=threading.Event)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)

    def deliver(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the server's loop has closed (shutdown): nobody is listening any more
            self.cancel.set()

    async def stream(self) -> AsyncIterator[Any]:
        """The engine's events; an engine exception is raised here, in the request's task."""
        while (item := await self.events.get()) is not END:
            if isinstance(item, BaseException):
                raise item
            yield item


class EngineWorker:
    def __init__(self, cfg: Config, loader: Callable[[Config, Progress], Loaded] = load_engine):
        self.cfg, self._loader = cfg, loader
        self.status, self.stage, self.progress = "loading", "starting", 0.0
        self.error: str | None = None
        self.loaded: Loaded | None = None
        self.running = 0  # 1 while a job generates
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._current: Job | None = None
        self._fingerprint: str | None = None  # the model file's, computed at the first recorded rate
        self._thread = threading.Thread(target=self._main, name="moestudio-engine", daemon=True)

    @property
    def engine(self) -> Any:
        return self.loaded.engine if self.loaded else None

    @property
    def waiting(self) -> int:
        return self._jobs.qsize()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Cancels the running job and ends the thread (a load in progress cannot be interrupted)."""
        if self._current is not None:
            self._current.cancel.set()
        self._jobs.put(None)
        self._thread.join(timeout)

    def submit(self, request: Any) -> Job:
        job = Job(request, asyncio.get_running_loop())
        self._jobs.put(job)
        return job

    def health(self) -> dict[str, Any]:
        model = printable(self.cfg.model)
        h: dict[str, Any] = {"status": self.status, "progress": round(100 * self.progress), "stage": self.stage,
                             "engine": self.loaded.kind if self.loaded else None,
                             "engine_reason": self.loaded.reason if self.loaded else None,
                             "n_ctx": self.loaded.engine.n_ctx if self.loaded else None,  # the context in use
                             # the values the engine runs with, by setting name ("settings" holds what was asked)
                             "effective": dict(self.loaded.effective) if self.loaded else None,
                             "model": model, "queue": {"running": self.running, "waiting": self.waiting},
                             "settings": {**self.cfg.public(), "model": model}}
        if self.error:
            h["error"] = self.error
        return h

    def _report(self, stage: str, fraction: float) -> None:
        self.stage, self.progress = stage, max(self.progress, min(1.0, fraction))

    def _measured(self, done: Any) -> None:
        """Keeps this generation's decode rate for the plan (engine/plan/measured.py): what the
        wizard and `moestudio plan` show for this model on this machine from now on."""
        from engine.plan import measured
        from engine.runtime.engine import DoneEvent

        if not isinstance(done, DoneEvent) or done.completion_tokens < measured.MIN_TOKENS or not done.decode_tokens_per_s:
            return
        eff = self.loaded.effective
        slots = eff.get("n_cpu_moe", 0) if self.loaded.kind == "llamacpp" else eff.get("moe_expert_cache_size", 0)
        key = measured.condition(self.loaded.kind, str(eff.get("device", "cpu")), int(eff.get("threads", 0)),
                                 int(slots or 0))
        try:
            if self._fingerprint is None:
                from engine.gguf.fingerprint import file_fingerprint

                self._fingerprint = file_fingerprint(self.cfg.model)
            measured.record(self._fingerprint, key, done.decode_tokens_per_s, printable(self.cfg.model))
        except OSError as e:  # an unwritable cache costs only the plan's figure
            log.debug("decode rate not recorded: %s", e)

    def _main(self) -> None:
        started = time.perf_counter()
        try:
            self.loaded = self._loader(self.cfg, self._report)
        except Exception as e:  # reported on /health; the server stays up to say why
            self.status, self.stage = "error", "failed"
            self.error = str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}"
            log.error("loading %s failed: %s", self.cfg.model, self.error, exc_info=not isinstance(e, UserError))
            return
        self.status, self.stage, self.progress = "ok", "ready", 1.0
        log.info("model ready in %.1f s", time.perf_counter() - started)
        while (job := self._jobs.get()) is not None:
            if job.cancel.is_set():  # its client left while it waited
                job.deliver(END)
                continue
            self._current, self.running = job, 1
            try:
                event = None
                for event in self.loaded.engine.generate(job.request, job.cancel):
                    job.deliver(event)
                self._measured(event)
            except Exception as e:
                if not isinstance(e, UserError):
                    log.exception("generation failed")
                job.deliver(e)
            finally:
                self._current, self.running = None, 0
                job.deliver(END)
