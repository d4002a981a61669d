"""API keys: every route but /health needs the key (/health without it says only the status), the key
is never logged or echoed, a server without a key stays on loopback, and keys on disk are this user's only.

The routes are enumerated from the Starlette app `moestudio serve` builds, so a route added later
is checked here without anyone remembering to list it. The client-level checks (the official
OpenAI and Anthropic clients with a right and a wrong key) are tests/server/test_auth_and_process.py.
"""
from __future__ import annotations

import http.client
import json
import os
import socket
import stat
import subprocess
import sys

import pytest
from starlette.routing import Route

from app.credentials import load_or_create_api_key
from app.paths import AppPaths
from engine.config import Config, write_toml
from engine.server.app import build_app
from tests.server.conftest import Server, start_server

KEY = "mskey-4b1d9e7c-reliability-auth-0f3a"  # noqa: S105 - a test key, distinctive enough to grep for
WRONG_KEYS = ("wrong", "x" + KEY, KEY + "x", KEY[:-1])  # near misses must fail too (no prefix matching)
USER = [{"role": "user", "content": "Hi"}]
BODIES = {"/v1/chat/completions": {"messages": USER, "max_tokens": 2},
          "/v1/completions": {"prompt": "Hi", "max_tokens": 2},
          "/v1/messages": {"messages": USER, "max_tokens": 2},
          "/v1/messages/count_tokens": {"messages": USER}}


@pytest.fixture(scope="module")
def model(make_model):
    return make_model("qwen3moe")


@pytest.fixture(scope="module")
def keyed(model):
    s = start_server(model, "--engine", "hybrid", "-c", "512", env={"MOESTUDIO_API_KEY": KEY})
    assert s.health_seen[-1]["status"] == "ok", s.health_seen[-1]
    yield s
    if s.proc.poll() is None:  # the last test stops it itself to read the whole log
        assert s.stop() == 0, "".join(s.log)


@pytest.fixture(scope="module")
def routes(model) -> list[tuple[str, str]]:
    """(path, method) of every route the server answers, from the app `serve` builds."""
    app = build_app(Config(model=str(model), api_key=KEY))
    unknown = [r for r in app.routes if not isinstance(r, Route)]
    assert not unknown, f"teach this test how a {unknown} is protected"
    found = sorted((r.path, m) for r in app.routes for m in r.methods)
    assert {("/metrics", "GET"), ("/v1/stats/stream", "GET"), ("/v1/stats", "GET")} <= set(found)
    return found


def status_of(server: Server, method: str, path: str, headers: dict | None = None, body: dict | None = None) -> int:
    """The status only: the connection closes without reading the body (the stats stream never ends)."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    try:
        conn.request(method, path, body=json.dumps(body) if body is not None else None,
                     headers={"content-type": "application/json", **(headers or {})})
        return conn.getresponse().status
    finally:
        conn.close()


def test_every_route_but_health_needs_the_key(keyed, routes):
    for path, method in routes:
        if path == "/health":
            continue
        body = BODIES.get(path) if method == "POST" else None
        refused = [{}, {"Authorization": KEY}, {"Authorization": "Basic " + KEY}]  # only Bearer or x-api-key
        refused += [h for k in WRONG_KEYS for h in ({"Authorization": f"Bearer {k}"}, {"x-api-key": k})]
        for headers in refused:
            assert status_of(keyed, method, path, headers, body) == 401, (method, path, headers)
        assert status_of(keyed, method, f"{path}?api_key={KEY}", {}, body) == 401  # not in the URL either
        for headers in ({"Authorization": f"Bearer {KEY}"}, {"authorization": f"bearer {KEY}"}, {"x-api-key": KEY}):
            status = status_of(keyed, method, path, headers, body)
            if method in ("GET", "HEAD") or body is not None:
                assert status == 200, (method, path, headers, status)
            else:  # a route added after this test: the key was accepted, its answer to an empty body varies
                assert status != 401, (method, path, headers, status)


def test_health_without_the_key_says_only_the_status(keyed):
    """Anyone who reaches the port learns whether the server is up, not the model path or the settings."""
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": KEY[:-1]}):
        assert keyed.request("GET", "/health", headers=headers) == (200, {"status": "ok"}), headers
    for headers in ({"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
        status, health = keyed.request("GET", "/health", headers=headers)
        assert status == 200 and health["status"] == "ok" and health["model"] and health["engine"] == "hybrid"
        assert health["settings"]["api_key"] == "***" and KEY not in json.dumps(health)


def test_refusals_do_not_echo_the_key(keyed):
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/messages")):
        status, body = keyed.request(method, path, BODIES.get(path), headers={"x-api-key": "x" + KEY})
        assert status == 401 and KEY not in json.dumps(body), body


@pytest.mark.parametrize("host,key", [("0.0.0.0", None), ("::", None), ("example.invalid", None), ("0.0.0.0", "")])
def test_without_a_key_only_loopback_binds(run_serve, host, key):
    r = run_serve("--host", host, api_key=key)
    assert r.returncode == 2 and "without an API key" in r.stderr and "--api-key" in r.stderr, r.stderr


@pytest.fixture
def run_serve(model):
    env = {k: v for k, v in os.environ.items() if k != "MOESTUDIO_API_KEY"}

    def run(*args: str, api_key: str | None = None) -> subprocess.CompletedProcess:
        extra = {} if api_key is None else {"MOESTUDIO_API_KEY": api_key}
        return subprocess.run([sys.executable, "-m", "engine.cli", "serve", str(model), "--port", "0", *args],
                              capture_output=True, text=True, timeout=120, env={**env, **extra})
    return run


def test_app_key_file_and_its_folder_are_private(tmp_path):
    paths = AppPaths.under(tmp_path / "moestudio").ensure()  # folders made with the umask's mode, as on first run
    (paths.api_key_file.with_name("api_key.new")).write_text("left by a crash")
    os.chmod(paths.api_key_file.with_name("api_key.new"), 0o644)
    key = load_or_create_api_key(paths.api_key_file)
    assert stat.S_IMODE(paths.api_key_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(paths.config.stat().st_mode) == 0o700  # nobody else can even list it
    assert paths.api_key_file.read_text() == key and not paths.api_key_file.with_name("api_key.new").exists()
    os.chmod(paths.config, 0o755)  # loosened later (a backup restored, a chmod -R): tightened at the next start
    assert load_or_create_api_key(paths.api_key_file) == key
    assert stat.S_IMODE(paths.config.stat().st_mode) == 0o700


def test_a_preset_holding_a_key_is_private(tmp_path):
    umask = os.umask(0o022)
    os.umask(umask)
    plain = write_toml(tmp_path / "plain.toml", Config(ctx=2048))
    assert stat.S_IMODE(plain.stat().st_mode) == 0o666 & ~umask  # no secret in it: the usual mode
    secret = tmp_path / "keyed.toml"
    secret.write_text("")
    os.chmod(secret, 0o644)  # an existing, readable preset overwritten with a key
    write_toml(secret, Config(ctx=2048, api_key=KEY))
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600 and KEY in secret.read_text()


def test_the_key_is_never_logged(keyed):
    """Runs last: everything the server wrote, from start to a clean stop, after all the requests above
    (right keys, near misses, the key in a URL) and a malformed request carrying the key."""
    with socket.create_connection((keyed.host, keyed.port), timeout=10) as s:
        s.sendall(f"GET /v1/models HTTP/1.1\r\nHost: x\r\nx-api-key: {KEY}\r\nContent-Length: -1\r\n\r\n".encode())
        assert s.recv(4096).startswith(b"HTTP/1.1 400")
    assert keyed.stop() == 0
    log = "".join(keyed.log)
    assert "serving" in log and KEY not in log, log
