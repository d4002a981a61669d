"""Servers as users run them: `python -m engine.cli serve` subprocesses on loopback, tiny models."""
from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

START_TIMEOUT_S = 90


@dataclass
class Server:
    proc: subprocess.Popen
    host: str
    port: int
    log: list[str] = field(default_factory=list)
    health_seen: list[dict] = field(default_factory=list)  # every /health body until "ok"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def request(self, method: str, path: str, body: bytes | str | dict | None = None,
                headers: dict | None = None, timeout: float = 60) -> tuple[int, dict | str]:
        """One raw HTTP request; the JSON body decoded when it is JSON."""
        if isinstance(body, dict):
            body = json.dumps(body)
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            conn.request(method, path, body=body, headers={"content-type": "application/json", **(headers or {})})
            resp = conn.getresponse()
            data = resp.read().decode("utf-8", errors="replace")
        finally:
            conn.close()
        try:
            return resp.status, json.loads(data)
        except json.JSONDecodeError:
            return resp.status, data

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=30)


def moestudio(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def start_server(model: Path, *args: str, env: dict | None = None) -> Server:
    """Starts a server on a free port and waits until /health says ok or error (recording what it said).
    `log` holds stdout and stderr together: everything the server wrote, e.g. to check that no key is logged."""
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", str(model), "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})
    log: list[str] = []
    deadline = time.monotonic() + START_TIMEOUT_S
    match = None
    while match is None:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"server exited ({proc.wait()}) before listening:\n{''.join(log)}")
        log.append(line)
        match = re.search(r"at http://([\d.]+):(\d+)", line)
        assert time.monotonic() < deadline, "".join(log)
    threading.Thread(target=lambda: log.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    server = Server(proc, match.group(1), int(match.group(2)), log)
    while True:
        status, body = server.request("GET", "/health")
        server.health_seen.append(body)
        if body["status"] in ("ok", "error"):
            return server
        assert body["status"] == "loading" and time.monotonic() < deadline, f"{body}\n{''.join(log)}"
        time.sleep(0.05)


@pytest.fixture(scope="session")
def tiny_model(make_model) -> Path:
    return make_model("qwen3moe")


@pytest.fixture(scope="session")
def server(tiny_model):
    """The default server shared by the API test modules: the MoE Studio engine, named (auto would
    pick llama.cpp on a machine without CUDA)."""
    s = start_server(tiny_model, "--engine", "hybrid", "-c", "1024")
    assert s.health_seen[-1]["status"] == "ok", s.health_seen[-1]
    yield s
    assert s.stop() == 0, "".join(s.log)


@pytest.fixture(scope="session")
def tokenizer(tiny_model):
    from engine.runtime.tokenizer import Tokenizer

    return Tokenizer(tiny_model)


@pytest.fixture(scope="session")
def count_chat_tokens(tokenizer):
    """What the engine counts for a chat: the model's template, tokenized with special tokens."""
    return lambda messages: len(tokenizer.encode(tokenizer.render_chat(messages), parse_special=True))


@pytest.fixture(scope="session")
def serve():
    """serve(model, *args, env=None) -> Server; every server started is stopped (SIGTERM, exit 0) at the end."""
    started: list[Server] = []

    def start(model: Path, *args: str, env: dict | None = None) -> Server:
        started.append(start_server(model, *args, env=env))
        return started[-1]
    yield start
    running = [s for s in started if s.proc.poll() is None]  # not already stopped by its test
    for s in running:  # all signalled first: they shut down side by side (one by one took ~30 s)
        s.proc.send_signal(signal.SIGTERM)
    for s in running:
        assert s.proc.wait(timeout=30) == 0, "".join(s.log)


@pytest.fixture(scope="session")
def run_cli():
    """run_cli(*args, env=None) -> CompletedProcess of `python -m engine.cli ...`."""
    return moestudio
