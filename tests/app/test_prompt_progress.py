"""The chat shows how much of a long prompt the engine has read ("processing prompt 96 / 310")
before the first token: a real `moestudio serve` on loopback reading the prompt in chunks of
2 tokens, the stats stream and the chat widget offscreen, wired as app/main.py wires them."""
from __future__ import annotations

import re

import pytest

from app.api_client import ApiClient
from app.chat.controller import ChatController
from app.chat.session import format_prompt_progress
from app.chat.widgets import ChatWidget
from app.dashboard.streamer import StatsStreamer
from app.store import ChatStore
from app.tasks import TaskManager
from tests.server.conftest import start_server

pytestmark = pytest.mark.slow


def test_format_prompt_progress_groups_thousands() -> None:
    assert format_prompt_progress(1536, 4000) == "processing prompt 1,536 / 4,000"


def test_chat_shows_prompt_progress_from_a_real_server(qtbot, tmp_path, make_model) -> None:
    server = start_server(make_model("qwen3moe"), "--engine", "hybrid", "-c", "1024", "--prefill-chunk", "2")
    tasks = TaskManager()
    streamer = StatsStreamer()
    try:
        assert server.health_seen[-1]["status"] == "ok"
        client = lambda: ApiClient(server.url, timeout=60)  # noqa: E731
        ctl = ChatController(ChatStore(tmp_path / "c.db"), tasks, client)
        w = ChatWidget(ctl)
        qtbot.addWidget(w)
        w.set_engine_ready(True)
        streamer.snapshot.connect(ctl.on_stats)
        streamer.start(tasks, client, lambda: server.proc.pid)
        notes: list[str] = []
        ctl.promptProgress.connect(lambda msg_id, done, total: notes.append(
            w._widgets[msg_id].status_label.text()))
        ctl.new_conversation()
        ctl.set_settings({"max_tokens": 2, "seed": 1})
        assert ctl.send("Please summarize: " + " ".join(f"point {i}," for i in range(150)))
        qtbot.waitUntil(lambda: not ctl.busy, timeout=120_000)
        reply = ctl.messages()[-1]
        assert reply.role == "assistant" and reply.status == "done", reply
        shown = [re.search(r"processing prompt ([\d,]+) / ([\d,]+)", n) for n in notes]
        assert shown and all(shown), notes
        done = [int(m.group(1).replace(",", "")) for m in shown]
        totals = {int(m.group(2).replace(",", "")) for m in shown}
        assert len(totals) == 1 and done == sorted(done) and done[-1] < totals.pop(), notes
        # the note gives way to the reply's own once text arrives
        assert "processing prompt" not in w._widgets[reply.id].status_label.text()
    finally:
        streamer.stop()
        tasks.wait()
        assert server.stop() == 0, "".join(server.log)
