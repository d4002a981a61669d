"""`moestudio chat`: slash commands are handled in the terminal, never sent to the model; the
loop on its own and the real command (llama.cpp on a tiny synthetic model) in a subprocess."""
from __future__ import annotations

import io
import subprocess
import sys

from engine.baseline.chat import chat_loop


def test_commands_stay_local_and_clear_forgets():
    seen: list[list[dict]] = []

    def complete(history):
        seen.append([dict(m) for m in history])
        yield from ("re", "ply")

    out, err = io.StringIO(), io.StringIO()
    chat_loop(["hello\n", "  \n", "/clear\n", "again\n", "/help\n", "/QUIT\n", "never read\n"], complete, out, err)
    assert seen == [[{"role": "user", "content": "hello"}], [{"role": "user", "content": "again"}]]
    assert out.getvalue() == "assistant> reply\nassistant> reply\n"
    assert "(conversation cleared)" in err.getvalue()
    assert "unknown command /help: /clear forgets the conversation, /exit or /quit" in err.getvalue()


def test_history_carries_replies_and_exit_stops():
    seen = []

    def complete(history):
        seen.append(len(history))
        yield "ok"

    chat_loop(["a", "b", "/exit", "c"], complete, io.StringIO(), io.StringIO())
    assert seen == [1, 3]  # the second turn sees the first question and its reply


def test_the_real_command_reads_stdin_until_exit(make_model):
    model = make_model("qwen3moe")
    r = subprocess.run([sys.executable, "-m", "engine.cli", "chat", str(model), "--max-tokens", "4", "-c", "256"],
                       input="hello\n/clear\n/exit\nnot sent\n", capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("assistant> ") == 1  # /exit ended it: "not sent" never reached the model
    assert "MoE Studio terminal chat" in r.stderr and "preview" not in r.stderr and "comes later" not in r.stderr
    assert "(conversation cleared)" in r.stderr and "/exit or /quit" in r.stderr
