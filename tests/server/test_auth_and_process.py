"""API keys on both APIs through the official clients, and the server as a process: refusals, port in
use, signals. Every route's key check, logs and binding without a key: tests/reliability/test_auth.py."""
from __future__ import annotations

import signal
import socket

import anthropic
import openai
import pytest

KEY = "test-key-7f3a9c"  # noqa: S105 - a test fixture, not a secret
USER = [{"role": "user", "content": "Hi"}]
# Greedy: with the default (unseeded) sampling the tiny model sometimes ends its reply at the first
# token, and the reply's length is what shows the accepted key was served.
GREEDY = 0.0


@pytest.fixture(scope="module")
def keyed(serve, tiny_model):
    # The key comes from the environment, as it should in real use: it stays out of `ps`.
    return serve(tiny_model, "--engine", "hybrid", "-c", "512", env={"MOESTUDIO_API_KEY": KEY})


def test_openai_key_accepted_and_refused(keyed):
    good = openai.OpenAI(base_url=keyed.url + "/v1", api_key=KEY, max_retries=0)
    reply = good.chat.completions.create(model="m", messages=USER, max_tokens=2, temperature=GREEDY)
    assert reply.usage.completion_tokens == 2
    bad = openai.OpenAI(base_url=keyed.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.chat.completions.create(model="m", messages=USER, max_tokens=2)
    assert e.value.status_code == 401
    assert e.value.body["code"] == "invalid_api_key" and e.value.body["type"] == "authentication_error"


def test_anthropic_key_accepted_and_refused(keyed):
    good = anthropic.Anthropic(base_url=keyed.url, api_key=KEY, max_retries=0)  # sends x-api-key
    reply = good.messages.create(model="m", messages=USER, max_tokens=2, extra_body={"temperature": GREEDY})
    assert reply.usage.output_tokens == 2
    bad = anthropic.Anthropic(base_url=keyed.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model="m", messages=USER, max_tokens=2)
    assert e.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                       "message": e.value.body["error"]["message"]}}


def test_port_in_use_is_one_clear_line(run_cli, tiny_model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = run_cli("serve", str(tiny_model), "--port", str(port))
    assert r.returncode != 0
    assert r.stderr.strip() == (f"moestudio: error: port {port} on 127.0.0.1 is already in use "
                                "(another server running?); stop it or choose another --port")


def test_bad_settings_are_refused_before_listening(run_cli, tiny_model, tmp_path):
    r = run_cli("serve", str(tiny_model), "--moe-gpu-miss-fraction", "1.5")
    assert r.returncode == 2 and "moe_gpu_miss_fraction must be 'auto' or a number in [0, 1], got '1.5'" in r.stderr
    r = run_cli("serve", str(tmp_path / "missing.gguf"))
    assert r.returncode == 2 and "no such model file" in r.stderr


def test_sigint_stops_mid_generation_and_releases_the_port(serve, tiny_model):
    s = serve(tiny_model, "--engine", "hybrid", "-c", "512")
    stream = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0).chat.completions.create(
        model="m", messages=USER, max_tokens=400, stream=True)
    next(iter(stream))
    assert s.stop(signal.SIGINT) in (0, 130)
    with socket.socket() as again:
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do: TIME_WAIT may linger
        again.bind((s.host, s.port))  # no listener holds the port any more
