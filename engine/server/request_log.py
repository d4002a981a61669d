"""One log line per API request: endpoint, status, prompt and generated tokens, tok/s, duration.

The HTTP layer knows the status and the duration; the generation knows the tokens. A context
variable carries a per-request record from this middleware down to where the generation is
made (engine/server/generation.py attaches itself), so the endpoints pass nothing along; the
line is written when the response has ended, when the generation has its final counts, or
its partial ones when the client closed the stream early. The level follows the status (INFO, WARNING for 4xx, ERROR for 5xx): the
desktop app's Logs tab filters on it.
"""
from __future__ import annotations

import contextvars
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

log = logging.getLogger("moestudio.server")
UNLOGGED_PATHS = frozenset({"/health"})  # polled 4 times a second while a model loads

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass
class RequestRecord:
    generation: Any = None  # engine.server.generation.Generation, when the request made one


_current: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar("moestudio_request", default=None)


def attach(generation: Any) -> None:
    """Ties a generation to the request being served (if any), for its line in the log."""
    record = _current.get()
    if record is not None:
        record.generation = generation


def level_of(status: int | None) -> int:
    """None: no response was started (the client left first), which is not the server's fault."""
    if status is None:
        return logging.INFO
    return logging.ERROR if status >= 500 else logging.WARNING if status >= 400 else logging.INFO


def format_request(method: str, path: str, status: int | None, seconds: float, record: RequestRecord) -> str:
    parts = [f"request {method} {path} {status if status is not None else 'no response'}"]
    gen = record.generation
    if gen is not None and gen.done is not None:
        done = gen.done
        parts += [f"{done.prompt_tokens} prompt + {done.completion_tokens} generated tokens",
                  f"{done.decode_tokens_per_s:.1f} tok/s", f"finish {done.finish_reason}"]
    elif gen is not None:  # the client went away before the end
        parts += [f"{gen.prompt_tokens} prompt + {gen.generated_tokens} generated tokens", "closed by the client"]
    parts.append(f"{seconds:.2f} s")
    return ", ".join(parts)


class RequestLog:
    """ASGI middleware: logs each HTTP request (but /health) when its response has ended."""

    def __init__(self, app: App):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNLOGGED_PATHS:
            await self.app(scope, receive, send)
            return
        record = RequestRecord()
        token = _current.set(record)
        status: int | None = None
        started = time.perf_counter()

        async def send_noting_status(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        except Exception:
            status = status or 500  # the ASGI server answers 500 when the app fails before answering
            raise
        finally:
            _current.reset(token)
            log.log(level_of(status), format_request(scope["method"], scope["path"], status,
                                                     time.perf_counter() - started, record))
