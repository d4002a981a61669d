"""The app's Qt-free parts: chat store, crash classification and restart policy, log buffer,
SSE parsing, reply measurement, Markdown helpers, dashboard series, key file."""
from __future__ import annotations

import http.server
import json
import os
import sqlite3
import stat
import threading

import numpy as np
import pytest

from app.api_client import ApiClient, ApiError, Cancelled
from app.chat.markdown import code_blocks, display_markdown
from app.chat.session import ReplyMeter, build_payload, format_stats
from app.credentials import load_or_create_api_key
from app.dashboard.series import Ring, StatsSeries, heat_image
from app.log_buffer import LogBuffer
from app.store import SCHEMA_VERSION, ChatStore, SchemaTooNew
from app.worker_state import Cause, RestartPolicy, classify_crash


# ---- store -------------------------------------------------------------------------------------
def test_store_schema_wal_and_roundtrip(tmp_path):
    s = ChatStore(tmp_path / "c.db")
    assert s.schema_version() == SCHEMA_VERSION
    assert s.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conv = s.create_conversation("t", "be brief", {"temperature": 0.2})
    u = s.add_message(conv.id, "user", "hello")
    a = s.add_message(conv.id, "assistant", "", status="streaming")
    s.update_message(a.id, content="partial")
    s.close()
    s2 = ChatStore(tmp_path / "c.db")  # reopened as after a crash: the streaming reply is kept, marked
    assert s2.recovered == 1
    msgs = s2.messages(conv.id)
    assert [(m.role, m.content, m.status) for m in msgs] == [("user", "hello", "done"),
                                                             ("assistant", "partial", "interrupted")]
    assert s2.conversation(conv.id).settings == {"temperature": 0.2}
    assert u.id < a.id


def test_store_refuses_newer_schema(tmp_path):
    db = sqlite3.connect(tmp_path / "c.db")
    db.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(SchemaTooNew):
        ChatStore(tmp_path / "c.db")


def test_regenerated_replies_keep_their_versions(tmp_path):
    s = ChatStore(tmp_path / "c.db")
    conv = s.create_conversation("t")
    s.add_message(conv.id, "user", "q")
    a = s.add_message(conv.id, "assistant", "first", stats={"completion_tokens": 1})
    assert (a.version, a.versions) == (1, 1)
    b = s.new_version(a.id)  # regenerate: the same row, emptied for the new reply; the old one kept
    assert (b.id, b.content, b.status, b.stats, b.version, b.versions) == (a.id, "", "streaming", None, 2, 2)
    s.update_message(b.id, content="second", status="stopped")
    s.new_version(b.id)
    s.update_message(b.id, content="third", status="done")
    assert [(v.version, v.content, v.status, v.stats) for v in s.other_versions(a.id)] == [
        (1, "first", "done", {"completion_tokens": 1}), (2, "second", "stopped", None)]
    shown = s.show_version(a.id, 1)  # the first one shown again: later turns continue from it
    assert (shown.content, shown.version, shown.versions, shown.stats) == ("first", 1, 3, {"completion_tokens": 1})
    assert [v.version for v in s.other_versions(a.id)] == [2, 3]
    assert s.new_version(a.id).version == 4  # numbers are never reused
    with pytest.raises(KeyError):
        s.show_version(a.id, 9)
    s.delete_messages_from(conv.id, a.id)  # an edit before the reply: its versions go with it
    assert s.db.execute("SELECT COUNT(*) FROM reply_versions").fetchone()[0] == 0


def test_a_version_1_database_is_migrated(tmp_path):
    from app.store import MIGRATIONS, _statements

    db = sqlite3.connect(tmp_path / "c.db")
    for stmt in _statements(MIGRATIONS[1]):
        db.execute(stmt)
    db.execute("INSERT INTO conversations(title, created, updated) VALUES ('old', 1, 1)")
    db.execute("INSERT INTO messages(conversation_id, role, content, created, updated) VALUES (1, 'assistant', 'x', 1, 1)")
    db.execute("PRAGMA user_version=1")
    db.commit()
    db.close()
    s = ChatStore(tmp_path / "c.db")
    assert s.schema_version() == SCHEMA_VERSION == 2
    [m] = s.messages(1)
    assert (m.content, m.version, m.versions) == ("x", 1, 1)
    assert s.new_version(m.id).versions == 2


def test_delete_really_deletes(tmp_path):
    path = tmp_path / "c.db"
    s = ChatStore(path)
    keep = s.create_conversation("keep")
    s.add_message(keep.id, "user", "ordinary words")
    gone = s.create_conversation("secret chat")
    for i in range(50):
        s.add_message(gone.id, "user", f"TOPSECRET-{i} " * 20)
    s.delete_conversation(gone.id)
    assert s.count_rows() == (1, 1)
    assert s.db.execute("SELECT COUNT(*) FROM messages WHERE conversation_id=?", (gone.id,)).fetchone()[0] == 0
    s.close()
    raw = b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("c.db"))
    assert b"TOPSECRET" not in raw  # overwritten on disk (secure_delete), not just unlinked from the tree


def test_search_rename_and_truncate(tmp_path):
    s = ChatStore(tmp_path / "c.db")
    a = s.create_conversation("alpha")
    b = s.create_conversation("beta")
    s.add_message(b.id, "user", "tell me about 100% pure_ideas")
    assert [c.id for c in s.conversations("alpha")] == [a.id]
    assert [c.id for c in s.conversations("100%")] == [b.id]
    assert [c.id for c in s.conversations("pure_i")] == [b.id]
    assert s.conversations("100_") == []  # LIKE wildcards are escaped
    s.rename(a.id, "gamma")
    assert s.conversation(a.id).title == "gamma"
    m1 = s.add_message(a.id, "user", "1")
    s.add_message(a.id, "assistant", "2")
    s.add_message(a.id, "user", "3")
    s.delete_messages_from(a.id, m1.id + 1)
    assert [m.content for m in s.messages(a.id)] == ["1"]


# ---- crash classification and restart policy ------------------------------------------------------
@pytest.mark.parametrize("tail,cause", [
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", Cause.GPU_OOM),
    ("moestudio: error: port 8080 on 127.0.0.1 is already in use (another server running?)", Cause.PORT_IN_USE),
    ("OSError: [Errno 98] Address already in use", Cause.PORT_IN_USE),
    ("engine.gguf.reader.GGUFError: not a GGUF file (bad magic b'PK\\x03\\x04')", Cause.BAD_MODEL),
    ("moestudio: error: no such model file: /x.gguf", Cause.BAD_MODEL),
    ("Segmentation fault", Cause.OTHER),
])
def test_classify_crash(tail, cause):
    crash = classify_crash("some startup line\n" + tail, exit_code=1)
    assert crash.cause == cause
    assert crash.summary and crash.advice and tail.splitlines()[-1] in crash.details()


def test_classify_kill_and_health_error():
    c = classify_crash("moestudio: model ready in 0.6 s", None, "SIGKILL")
    assert c.cause == Cause.OTHER and "SIGKILL" in c.summary
    c = classify_crash("", 0, None, error="cannot read the model: truncated tensor data")
    assert c.cause == Cause.BAD_MODEL and "truncated" in c.summary
    c = classify_crash("moestudio: error: ctx must be an integer >= 0, got 'x'", 2)
    assert c.cause == Cause.BAD_SETTINGS and c.summary.startswith("ctx must be")


def test_restart_policy_caps_and_resets():
    now = [0.0]
    p = RestartPolicy(max_restarts=3, stable_s=30, clock=lambda: now[0])
    other = classify_crash("Segmentation fault", 139)
    assert [p.should_restart(other) for _ in range(4)] == [True, True, True, False]
    p.on_ready()
    now[0] += 31  # a stable run resets the count
    assert p.should_restart(other)
    assert not p.should_restart(classify_crash("CUDA out of memory", 1))  # would only repeat
    assert not p.should_restart(classify_crash("not a GGUF file", 1))


# ---- logs -------------------------------------------------------------------------------------------
def test_log_buffer_lines_filter_tail():
    b = LogBuffer(max_lines=5)
    assert b.feed("stderr", "INFO one\nWARNING tw") == [b.lines[0]]
    b.feed("stderr", "o\nERROR three\n")
    b.feed("stdout", "plain")
    b.flush()
    assert [ln.text for ln in b.lines] == ["INFO one", "WARNING two", "ERROR three", "plain"]
    assert [ln.text for ln in b.filtered(min_level="WARNING")] == ["WARNING two", "ERROR three"]
    assert [ln.text for ln in b.filtered("thr")] == ["ERROR three"]
    assert b.tail(2) == "ERROR three\nplain"
    for i in range(10):
        b.add("app", str(i))
    assert len(b.lines) == 5


@pytest.mark.parametrize("text, level", [
    ("moestudio: INFO request POST /v1/chat/completions 200, 12 prompt + 30 generated tokens, 61.2 tok/s, "
     "finish stop, 0.61 s", "INFO"),
    ("moestudio: WARNING request POST /v1/chat/completions 400, 0.00 s", "WARNING"),
    ("moestudio: ERROR request GET /v1/stats 500, 0.01 s", "ERROR"),
    ("moestudio: error: port 8080 on 127.0.0.1 is already in use", "ERROR"),  # a refused setting or file
    ("moestudio: serving m.gguf at http://127.0.0.1:1 (loading in the background)", "INFO"),
])
def test_engine_lines_carry_the_level_the_logs_filter_uses(text, level):
    assert LogBuffer().add("stderr", text).level == level


# ---- HTTP client and SSE ---------------------------------------------------------------------------
class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hold = threading.Event()

    def log_message(self, *a):
        pass

    def do_GET(self):
        if self.path == "/health":
            body = json.dumps({"status": "error", "progress": 0, "stage": "failed", "error": "bad file"}).encode()
            self.send_response(503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            body = json.dumps({"error": {"message": "missing or invalid API key"}}).encode()
            self.send_response(401)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def chunk(text: str):
            data = text.encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()
        chunk(": keep-alive\n\n")
        chunk('data: {"choices": [{"delta": {"content": "Hel"}}]}\n\nevent: x\ndata: {"choices": [{"delta": ')
        chunk('{"content": "lo"}}]}\n\n')
        if self.headers.get("X-Hold"):
            self.hold.wait(10)
            return
        chunk("data: [DONE]\n\n")
        chunk("")


@pytest.fixture
def http_server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    _Handler.hold.set()
    srv.shutdown()


def test_sse_stream_and_errors(http_server):
    c = ApiClient(http_server, "k")
    events = list(c.chat_stream({"messages": []}))
    assert [(e.event, e.data) for e in events] == [
        ("message", '{"choices": [{"delta": {"content": "Hel"}}]}'),
        ("x", '{"choices": [{"delta": {"content": "lo"}}]}'), ("message", "[DONE]")]
    assert c.health()["error"] == "bad file"  # a 503 health body is still the health
    with pytest.raises(ApiError, match="invalid API key") as e:
        c.stats()
    assert e.value.status == 401


def test_sse_close_from_another_thread_cancels(http_server, monkeypatch):
    c = ApiClient(http_server, "k")
    monkeypatch.setattr(c, "_headers", lambda auth=True, body=False: {"X-Hold": "1", "Content-Type": "application/json"})
    stream = c.chat_stream({"messages": []})
    it = iter(stream)
    assert "Hel" in next(it).data
    next(it)
    threading.Timer(0.2, stream.close).start()
    with pytest.raises(Cancelled):
        next(it)


# ---- chat measurement and markdown -------------------------------------------------------------------
def test_reply_meter_stats():
    t = [10.0]
    m = ReplyMeter(clock=lambda: t[0])
    t[0] = 10.5
    m.feed({"choices": [{"delta": {"role": "assistant", "content": ""}}]})
    assert m.first_at is None
    m.feed({"choices": [{"delta": {"content": "a"}}]})
    for _ in range(10):
        t[0] += 0.1
        m.feed({"choices": [{"delta": {"content": "b"}}]})
    m.feed({"choices": [{"delta": {}, "finish_reason": "length"}]})
    m.feed({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 11}})
    s = m.stats()
    assert m.text == "a" + "b" * 10
    assert s["completion_tokens"] == 11 and s["prompt_tokens"] == 7 and s["finish_reason"] == "length"
    assert s["ttft_s"] == pytest.approx(0.5) and s["tokens_per_s"] == pytest.approx(10.0)
    assert "10.0 tok/s" in format_stats(s) and "TTFT 500 ms" in format_stats(s)


def test_payload():
    from app.store import Message
    hist = [Message(1, 1, "user", "hi"), Message(2, 1, "assistant", ""), Message(3, 1, "user", "again")]
    p = build_payload("sys", hist, {"temperature": 0.1, "seed": 5, "max_tokens": 9, "top_p": 0.5, "top_k": 40,
                                    "min_p": 0.05, "repeat_penalty": 1.1, "stop": ["\n\n", "END"]})
    assert p["messages"] == [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"},
                             {"role": "user", "content": "again"}]
    assert (p["temperature"], p["seed"], p["max_tokens"], p["top_p"]) == (0.1, 5, 9, 0.5)
    assert (p["top_k"], p["min_p"], p["repeat_penalty"], p["stop"]) == (40, 0.05, 1.1, ["\n\n", "END"])
    plain = build_payload("", hist, {"seed": -1})  # older chats' settings: the filters off, no stop strings
    assert "seed" not in plain and "stop" not in plain
    assert (plain["top_k"], plain["min_p"], plain["repeat_penalty"]) == (0, 0.0, 1.0)


def test_stop_strings_typed_one_per_line():
    from app.chat.session import format_stops, parse_stops
    assert parse_stops("END\n\\n\\n\n\nUser:\\t") == ["END", "\n\n", "User:\t"]
    assert parse_stops(format_stops(["a\nb", "c"])) == ["a\nb", "c"]
    with pytest.raises(ValueError, match="at most 16 stop strings"):
        parse_stops("\n".join(str(i) for i in range(17)))


def test_context_used_and_exports():
    import json

    from app.chat.session import chat_json, chat_markdown, context_used
    from app.store import Conversation, Message
    conv = Conversation(1, "Routers", "Be brief.", {"temperature": 0.2}, 10.0)
    hist = [Message(1, 1, "user", "What is MoE?"),
            Message(2, 1, "assistant", "Experts.", stats={"prompt_tokens": 20, "completion_tokens": 5},
                    version=2, versions=2),
            Message(3, 1, "user", "More?"), Message(4, 1, "assistant", "", status="stopped")]
    assert context_used(hist) == 25 and context_used(hist[:1]) is None
    md = chat_markdown(conv, hist)
    assert md.startswith("# Routers\n\n**System prompt:**\n\nBe brief.\n")
    assert "## You\n\nWhat is MoE?\n\n## Assistant\n\nExperts.\n" in md and md.count("*(no text)*") == 1
    earlier = {2: [Message(2, 1, "assistant", "Old answer.", version=1, versions=2)]}
    data = json.loads(chat_json(conv, hist, earlier))
    assert (data["title"], data["system_prompt"], data["settings"]) == ("Routers", "Be brief.", {"temperature": 0.2})
    assert [m["content"] for m in data["messages"]] == ["What is MoE?", "Experts.", "More?", ""]
    assert data["messages"][1]["version"] == 2 and data["messages"][1]["role"] == "assistant"
    assert data["messages"][1]["other_versions"] == [{"version": 1, "content": "Old answer.", "status": "done",
                                                      "stats": None}]


def test_code_blocks():
    text = "Here:\n```python\nprint(1)\n```\nand\n~~~\nls -l\n~~~\nthen ```inline``` and\n```sh\necho unfinished"
    assert code_blocks(text) == ["print(1)", "ls -l", "echo unfinished"]
    shown = display_markdown(text, streaming=True)
    assert shown.count("```") % 2 == 0  # the open fence is closed for rendering


# ---- dashboard series -------------------------------------------------------------------------------------
def _snap(t, hit, up, cpu, up_bytes, requests=1, resid=None, heat=None):
    return {"schema": 1, "time": t, "engine": "hybrid", "model": "m", "requests": requests,
            "decode_tokens_per_s_now": 10.0 * t, "last_request": {"prefill_tokens_per_s": 99.0},
            "ram_used_bytes": 2 << 30, "gpu_memory_used_bytes": None,
            "cache": {"layers": [0, 1], "n_expert": 4, "slots_per_layer": 2, "gpu_hit": hit, "uploaded": up,
                      "cpu_computed": cpu, "swaps": [0, 0], "bytes_uploaded": up_bytes, "cpu_busy_s": 0.0,
                      "residency": resid or [[0, -1, 1, -1], [-1, 0, -1, 1]],
                      "heat": heat or [[4.0, 0.0, 1.0, 0.0], [0.0, 2.0, 0.0, 1.0]]}}


def test_series_rates_from_counters():
    s = StatsSeries(capacity=8)
    s.ingest(_snap(100.0, [0, 0], [0, 0], [0, 0], 0))
    s.ingest(_snap(100.5, [6, 2], [1, 1], [0, 0], 1_000_000, requests=2))
    s.ingest(_snap(101.0, [6, 2], [1, 1], [0, 0], 1_000_000, requests=2))  # idle: a gap, not 0 %
    t, gpu = s.hits.view(0)
    assert list(t) == [0.0, 0.5, 1.0]
    assert gpu[1] == pytest.approx(80.0) and np.isnan(gpu[0]) and np.isnan(gpu[2])
    assert s.hits.view(1)[1][1] == pytest.approx(20.0)
    assert list(s.pcie.view()[1]) == pytest.approx([0.0, 2.0, 0.0])  # MB/s
    assert list(s.prefill.view()[1]) == [99.0]
    assert s.layer_hit_rate.tolist() == pytest.approx([6 / 7 * 100, 2 / 3 * 100])
    assert s.memory.view(0)[1][-1] == pytest.approx(2.0) and np.isnan(s.memory.view(1)[1][-1])
    # an engine restart: counters drop, no negative rates
    s.ingest(_snap(102.0, [1, 0], [0, 0], [0, 0], 0, requests=0))
    assert s.pcie.view()[1][-1] == 0.0 and np.isnan(s.hits.view(0)[1][-1])


def test_series_heat_image_and_no_cache():
    img = heat_image(np.array([[0, -1], [-1, 3]]), np.array([[4.0, 4.0], [0.0, 1.0]], np.float32))
    assert img.dtype == np.uint8 and img[0, 0] == 255 and img[0, 1] == 127 and img[1, 0] == 0
    assert 128 < img[1, 1] < 255
    s = StatsSeries()
    snap = _snap(1.0, [0, 0], [0, 0], [0, 0], 0)
    snap["cache"] = None
    s.ingest(snap)
    assert s.has_cache is False and s.hits.count == 0 and s.tokens.count == 1


def test_ring_wraps_contiguously():
    r = Ring(4)
    for i in range(10):
        r.append(float(i), float(i * 10))
        t, y = r.view()
        assert t.flags.c_contiguous and list(t) == [float(j) for j in range(max(0, i - 3), i + 1)]
    assert list(y) == [60.0, 70.0, 80.0, 90.0]


# ---- key file --------------------------------------------------------------------------------------------
def test_api_key_file_is_private_and_stable(tmp_path):
    path = tmp_path / "cfg" / "api_key"
    k1 = load_or_create_api_key(path)
    assert len(k1) >= 40 and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    os.chmod(path, 0o644)
    assert load_or_create_api_key(path) == k1 and stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_default_presets_folder_is_the_servers():
    from engine.config import presets_dir

    from app.paths import AppPaths
    assert AppPaths.default().presets == presets_dir()
