"""The engine's HTTP API as the app uses it: /health, /v1/stats, the stats stream and streaming
chat completions. Standard library only (http.client), no Qt: calls block, so the Qt side runs
them in worker threads (app/tasks.py) and never on the GUI thread.

Why http.client in a thread rather than QNetworkAccessManager: the SSE parsing and the request
shapes are then plain Python, tested without an event loop, and shared by the chat, the
dashboard and the health poller; a stream is cancelled by shutting its socket from any thread,
which the server sees as a disconnect and answers by cancelling the generation.
"""
from __future__ import annotations

import http.client
import json
import socket
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator
from urllib.parse import urlsplit


class ApiError(Exception):
    def __init__(self, message: str, status: int | None = None, body: str = ""):
        super().__init__(message)
        self.status, self.body = status, body


class Cancelled(Exception):
    """The stream was closed by this side (stop button, shutdown)."""


@dataclass(frozen=True)
class SseEvent:
    event: str  # "message" unless the server named it
    data: str


class SseStream:
    """An open text/event-stream response; iterate for events, close() from any thread."""

    def __init__(self, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse):
        self._conn, self._resp = conn, resp
        self._closed = threading.Event()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        sock = self._conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a reader blocked in recv()
            except OSError:
                pass
        try:
            self._conn.close()
        except Exception:
            pass

    def __iter__(self) -> Iterator[SseEvent]:
        event, data = "message", []
        try:
            while True:
                try:
                    raw = self._resp.readline()
                except (OSError, ValueError, AttributeError, http.client.HTTPException):
                    if self.closed:
                        raise Cancelled() from None
                    raise
                if not raw:
                    if self.closed:
                        raise Cancelled()
                    return
                line = raw.decode("utf-8", "replace").rstrip("\r\n")
                if not line:
                    if data:
                        yield SseEvent(event, "\n".join(data))
                    event, data = "message", []
                elif line.startswith(":"):
                    continue  # comment / keep-alive
                else:
                    name, _, value = line.partition(":")
                    value = value[1:] if value.startswith(" ") else value
                    if name == "data":
                        data.append(value)
                    elif name == "event":
                        event = value
        finally:
            self.close()


class ApiClient:
    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 30.0):
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"not an http:// URL: {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.host, self.port = parts.hostname, parts.port or 80
        self.api_key, self.timeout = api_key, timeout

    def _headers(self, auth: bool = True, body: bool = False) -> dict[str, str]:
        h = {"Accept": "application/json"}
        if auth and self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        if body:
            h["Content-Type"] = "application/json"
        return h

    def _request(self, method: str, path: str, payload: Any = None, timeout: float | None = None,
                 auth: bool = True, accept: str | None = None, on_connect: Callable[[Any], None] | None = None,
                 ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout or self.timeout)
        headers = self._headers(auth, payload is not None)
        if accept:
            headers["Accept"] = accept
        body = json.dumps(payload).encode() if payload is not None else None
        try:
            conn.connect()
            if on_connect is not None:
                on_connect(conn)  # lets another thread abort a request still waiting for its headers
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
        except Exception:
            conn.close()
            raise
        if resp.status >= 400:
            text = resp.read().decode("utf-8", "replace")
            conn.close()
            raise ApiError(_error_message(text, resp.status), resp.status, text)
        return conn, resp

    def get_json(self, path: str, timeout: float | None = None, auth: bool = True) -> Any:
        conn, resp = self._request("GET", path, timeout=timeout, auth=auth)
        try:
            return json.loads(resp.read())
        finally:
            conn.close()

    def health(self, timeout: float = 2.0) -> dict:
        try:
            return self.get_json("/health", timeout=timeout)  # with a key set, the details need it
        except ApiError as e:  # 503 while the load failed: the body still says why
            try:
                body = json.loads(e.body)
            except ValueError:
                raise e from None
            if isinstance(body, dict) and "status" in body:
                return body
            raise

    def stats(self, timeout: float = 5.0) -> dict:
        return self.get_json("/v1/stats", timeout=timeout)

    def stats_stream(self) -> SseStream:
        conn, resp = self._request("GET", "/v1/stats/stream", timeout=None, accept="text/event-stream")
        conn.sock.settimeout(None) if conn.sock else None
        return SseStream(conn, resp)

    def chat_stream(self, payload: dict, read_timeout: float | None = 600.0,
                    on_connect: Callable[[Any], None] | None = None) -> SseStream:
        """POST /v1/chat/completions with stream=true; read_timeout bounds a silent server.

        The server sends its headers only once the first token exists (after the prompt's
        prefill): `on_connect(conn)` hands out the connection before that, so that a stop can
        abort the wait by shutting its socket."""
        payload = {**payload, "stream": True, "stream_options": {"include_usage": True}}
        conn, resp = self._request("POST", "/v1/chat/completions", payload, timeout=read_timeout,
                                   accept="text/event-stream", on_connect=on_connect)
        return SseStream(conn, resp)


def _error_message(text: str, status: int) -> str:
    try:
        body = json.loads(text)
    except ValueError:
        return f"HTTP {status}: {text[:300]}"
    err = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err)


def openai_base_url(base_url: str) -> str:
    return base_url.rstrip("/") + "/v1"


def anthropic_base_url(base_url: str) -> str:
    return base_url.rstrip("/")  # the Anthropic SDK appends /v1/messages itself


def abort_connection(conn: http.client.HTTPConnection) -> None:
    """Shuts a connection's socket from any thread (the reader then fails at once)."""
    sock = conn.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
