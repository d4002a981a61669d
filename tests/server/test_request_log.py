"""One log line per request (engine/server/request_log.py), read from a real server's stderr: the
endpoint, the status, the prompt and generated tokens, tok/s and the duration, at the level
the desktop app's Logs tab filters on."""
from __future__ import annotations

import re
import time

import pytest

from engine.server.request_log import level_of

LINE = re.compile(r"^moestudio: (INFO|WARNING|ERROR) request (\w+) (\S+) (\d{3})(.*), ([\d.]+) s$")


def _lines_after(server, start: int, path: str, timeout: float = 10.0) -> list[re.Match]:
    """The request lines for `path` the server wrote after log index `start` (its log is read on a thread)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [m for line in server.log[start:] if (m := LINE.match(line.rstrip("\n"))) and m.group(3) == path]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.02)


def test_a_generation_logs_tokens_rate_and_duration(server):
    start = len(server.log)
    status, body = server.request("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 7, "temperature": 0})
    assert status == 200, body
    [m] = _lines_after(server, start, "/v1/chat/completions")
    level, method, _path, code, middle, seconds = m.groups()
    assert (level, method, code) == ("INFO", "POST", "200")
    usage = body["usage"]
    assert f", {usage['prompt_tokens']} prompt + {usage['completion_tokens']} generated tokens, " in middle
    assert re.search(r", [\d.]+ tok/s, finish (length|stop)$", middle), middle
    assert float(seconds) > 0


def test_a_streamed_generation_is_logged_when_it_ends(server):
    start = len(server.log)
    status, text = server.request("POST", "/v1/completions", {"prompt": "once", "max_tokens": 5, "stream": True})
    assert status == 200 and "[DONE]" in text
    [m] = _lines_after(server, start, "/v1/completions")
    assert m.group(1) == "INFO" and m.group(4) == "200" and " generated tokens, " in m.group(5)


def test_refused_requests_are_warnings_and_health_polls_are_not_logged(server):
    start = len(server.log)
    status, _ = server.request("POST", "/v1/chat/completions", {"messages": "not a list"})
    assert status == 400
    server.request("GET", "/health")
    [m] = _lines_after(server, start, "/v1/chat/completions")
    assert (m.group(1), m.group(4), m.group(5)) == ("WARNING", "400", "")  # no tokens: nothing was generated
    assert not _lines_after(server, start, "/health", timeout=0.3)


def test_a_stream_the_client_closes_is_logged_with_its_partial_count(server):
    import http.client
    import json

    # The tiny model may sample its end of text first (then the request ends before the client
    # leaves, and is logged as finished): a few seeded draws, one of which must outlast the close.
    for seed in range(6):
        start = len(server.log)
        conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
        conn.request("POST", "/v1/completions", headers={"content-type": "application/json"},
                     body=json.dumps({"prompt": "go", "max_tokens": 4000, "stream": True, "seed": seed}))
        resp = conn.getresponse()
        assert resp.status == 200
        resp.fp.readline()  # the first event: generation has started
        conn.sock.close()  # gone mid-stream, as a stopped chat is
        conn.close()
        [m] = _lines_after(server, start, "/v1/completions", timeout=30)
        assert m.group(1) == "INFO", m.group(0)
        if re.fullmatch(r", \d+ prompt \+ \d+ generated tokens, closed by the client", m.group(5)):
            return
        assert re.fullmatch(r", \d+ prompt \+ \d+ generated tokens, [\d.]+ tok/s, finish stop", m.group(5)), m.group(0)
    pytest.fail("every seeded stream ended before the client closed it")


@pytest.mark.parametrize("status, level", [(200, "INFO"), (404, "WARNING"), (503, "ERROR"), (None, "INFO")])
def test_level_follows_status(status, level):
    import logging
    assert logging.getLevelName(level_of(status)) == level
