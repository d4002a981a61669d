"""The HTTP application: routes, API-key check, error shapes, and the engine thread's lifetime."""
from __future__ import annotations

import asyncio
import hmac
import logging
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Awaitable, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine.config import Config
from engine.errors import printable
from engine.gguf.reader import ModelFile
from engine.server import anthropic_api, ollama_api, openai_api, stats
from engine.server.errors import ApiError, api_of, error_response
from engine.server.request_log import RequestLog
from engine.server.worker import EngineWorker

log = logging.getLogger("moestudio.server")
Handler = Callable[[HttpRequest], Awaitable[Response]]


def _presented_key(http: HttpRequest) -> str | None:
    auth = http.headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return http.headers.get("x-api-key")


def _key_ok(http: HttpRequest, expected: bytes | None) -> bool:
    """Whether the request may pass: no key is set, or it presents the key (compared in constant time)."""
    if expected is None:
        return True
    given = _presented_key(http)
    return given is not None and hmac.compare_digest(given.encode(), expected)


def guarded(handler: Handler, api_key: str | None) -> Handler:
    """Checks the key, and turns ApiError into the path's API error shape."""
    expected = api_key.encode() if api_key else None

    async def endpoint(http: HttpRequest) -> Response:
        api = api_of(http.url.path)
        try:
            if not _key_ok(http, expected):
                raise ApiError(401, "missing or invalid API key (send 'Authorization: Bearer KEY' or "
                               "'x-api-key: KEY')", code="invalid_api_key")
            return await handler(http)
        except ApiError as e:
            return error_response(api, e)
        except ClientDisconnect:  # gone before its body was read (killed, timed out): not a server fault,
            # so no traceback in the log; nobody receives this answer
            return error_response(api, ApiError(400, "the client closed the request"))
        except Exception:
            log.exception("%s %s failed", http.method, http.url.path)
            return error_response(api, ApiError(500, "internal server error (see the server log)"))
    return endpoint


def health_endpoint(api_key: str | None) -> Handler:
    """GET /health: always JSON. Without a key set, or with it presented, the whole report; otherwise the
    status only, so the model path and settings are not shown to whoever can reach the port."""
    expected = api_key.encode() if api_key else None

    async def health(http: HttpRequest) -> Response:
        worker: EngineWorker = http.app.state.worker
        try:
            body = worker.health()
        except Exception as e:  # never a plain-text 500: the app and scripts parse this
            log.exception("GET /health failed")
            body = {"status": "error", "error": f"the health report failed: {type(e).__name__}: {e}"}
        if not _key_ok(http, expected):
            body = {"status": body["status"]}
        return JSONResponse(body, status_code=503 if body["status"] == "error" else 200)
    return health


async def _http_error(http: HttpRequest, exc: HTTPException) -> Response:
    """Unknown paths and wrong methods, in the error shape of the API the path belongs to."""
    message = f"no endpoint {http.method} {http.url.path}" if exc.status_code == 404 else str(exc.detail)
    return error_response(api_of(http.url.path), ApiError(exc.status_code, message))


def build_app(cfg: Config, worker: EngineWorker | None = None) -> Starlette:
    worker = worker or EngineWorker(cfg)
    key = cfg.api_key

    @asynccontextmanager
    async def lifespan(app: Starlette):
        worker.start()
        yield
        await asyncio.to_thread(worker.stop)  # joining the engine thread must not stall the loop

    routes = [Route("/health", health_endpoint(key), methods=["GET"])] + [
        Route(path, guarded(handler, key), methods=[method]) for path, handler, method in (
            ("/v1/chat/completions", openai_api.chat_completions, "POST"),
            ("/v1/completions", openai_api.completions, "POST"),
            ("/v1/models", openai_api.models, "GET"),
            ("/v1/messages", anthropic_api.messages, "POST"),
            ("/v1/messages/count_tokens", anthropic_api.count_tokens, "POST"),
            ("/api/version", ollama_api.version, "GET"),
            ("/api/tags", ollama_api.tags, "GET"),
            ("/api/show", ollama_api.show, "POST"),
            ("/api/chat", ollama_api.chat, "POST"),
            ("/api/generate", ollama_api.generate, "POST"),
            ("/v1/stats", stats.stats, "GET"),
            ("/v1/stats/stream", stats.stats_stream, "GET"),
            ("/metrics", stats.metrics_endpoint(worker), "GET"),
        )]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_error},
                    middleware=[Middleware(RequestLog)])
    model = Path(cfg.model)
    app.state.worker = worker
    app.state.model_id = printable(model.stem)
    info = model.stat()
    app.state.model_created, app.state.model_size = int(info.st_mtime), info.st_size
    app.state.model_arch = printable(str(ModelFile.open(model).get("general.architecture", "")))
    return app
