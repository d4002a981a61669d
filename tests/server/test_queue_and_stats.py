"""The request queue under disconnects and load, and the telemetry endpoints."""
from __future__ import annotations

import http.client
import json
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

USER = [{"role": "user", "content": "Tell me a long story."}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def completion_tokens(server) -> int:
    return server.request("GET", "/v1/stats")[1]["completion_tokens"]


def test_disconnect_mid_stream_frees_the_queue(server, client):
    before = completion_tokens(server)
    stream = client.chat.completions.create(model="m", messages=USER, max_tokens=200, temperature=0, stream=True)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()  # the client goes away after 3 chunks
    started = time.monotonic()
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       temperature=0)
    assert r.usage.completion_tokens == 4 and time.monotonic() - started < 10
    # The abandoned generation stopped early instead of running its 200 tokens to the end.
    assert completion_tokens(server) - before - 4 < 100
    assert server.request("GET", "/health")[1]["queue"] == {"running": 0, "waiting": 0}


def test_twenty_concurrent_streams_all_complete(server, client):
    def one(i: int) -> tuple[str, int]:
        stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"Count to {i}"}],
                                                max_tokens=6, temperature=0.5, seed=i, stream=True,
                                                stream_options={"include_usage": True})
        chunks = list(stream)
        finish = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
        return finish, chunks[-1].usage.completion_tokens

    started = time.monotonic()
    with ThreadPoolExecutor(20) as pool:
        results = list(pool.map(one, range(20)))
    assert len(results) == 20 and all(f in ("length", "stop") and 1 <= n <= 6 for f, n in results)
    assert time.monotonic() - started < 120


def read_stats_stream(server, seconds: float) -> list[tuple[float, dict]]:
    """(arrival time, snapshot) for every snapshot the stream sends within `seconds`."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
    conn.request("GET", "/v1/stats/stream")
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    got, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        line = resp.readline().decode()
        if line.startswith("data: "):
            got.append((time.monotonic(), json.loads(line[6:])))
    conn.close()
    return got


def test_stats_stream_rate_busy_and_idle(server, client):
    idle = read_stats_stream(server, 2.5)
    assert 2 <= len(idle) <= 4  # about one a second
    # 1000 tokens take seconds even on a fast machine: the generation outlasts the 1.2 s window
    stream = client.chat.completions.create(model="m", messages=USER, max_tokens=1000, temperature=0, stream=True)
    next(iter(stream))  # generating now
    busy = read_stats_stream(server, 1.2)
    assert server.request("GET", "/health")[1]["queue"]["running"] == 1, "the generation ended before the window"
    stream.close()
    gaps = [b[0] - a[0] for a, b in zip(busy, busy[1:])]
    assert len(busy) >= 5 and max(gaps) < 0.3  # >= 4 snapshots a second while generating
    assert busy[-1][1]["schema"] == 1 and busy[-1][1]["decode_tokens_per_s_now"] > 0


def test_stats_snapshot(server):
    status, snap = server.request("GET", "/v1/stats")
    assert status == 200 and snap["engine"] == "hybrid" and snap["requests"] >= 1 and snap["prefill"] is None
    cache = snap["cache"]
    assert len(cache["gpu_hit"]) == len(cache["layers"]) and len(cache["residency"][0]) == cache["n_expert"]
    assert (cache["load_mode"], cache["miss_fraction"], cache["miss_fraction_tuning"]) == ("mmap", 0.0, None)


def test_metrics_parse_with_prometheus_client(server):
    status, text = server.request("GET", "/metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["moestudio_up"].samples[0].value == 1
    assert families["moestudio_requests"].type == "counter" and families["moestudio_requests"].samples[0].value >= 1
    assert families["moestudio_engine_info"].samples[0].labels["engine"] == "hybrid"
    hits = families["moestudio_expert_gpu_hit"].samples
    assert {s.labels["layer"] for s in hits} == {"0", "1"}
    assert families["moestudio_gpu_miss_fraction"].samples[0].value == 0.0  # no GPU here: every miss on the CPU
    steps = {s.labels["route"]: s.value for s in families["moestudio_prompt_layer_steps"].samples
             if s.name.endswith("_total")}
    assert steps["streamed"] == steps["resident"] == 0 < steps["read_back"]  # the CPU has no grouped GEMM
    assert families["moestudio_prompt_graph_chunks"].samples[0].value == 0  # nor CUDA graphs


@pytest.mark.parametrize("engine", ["hybrid", "llamacpp"])
def test_stats_carry_prefill_progress_while_a_prompt_runs(serve, tiny_model, engine):
    """A long prompt read in chunks of 2 tokens: /v1/stats shows tokens processed / total as it
    goes (the app's "processing prompt 1,536 / 4,000"), and nothing once the prompt is read."""
    s = serve(tiny_model, "--engine", engine, "-c", "1024", "--prefill-chunk", "2")
    prompt = " ".join(f"item {i}," for i in range(120))
    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(s.request, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 1})
        seen = []
        while not done.done():
            seen.append(s.request("GET", "/v1/stats")[1]["prefill"])
            time.sleep(0.01)
        status, body = done.result()
    assert status == 200, body
    total = body["usage"]["prompt_tokens"]
    running = [p for p in seen if p is not None]
    assert len(running) >= 3, f"the prompt's progress was seen {len(running)} times in {len(seen)} polls"
    assert all(p["total"] == total and 0 <= p["processed"] < total for p in running), running
    processed = [p["processed"] for p in running]
    assert processed == sorted(processed) and processed[-1] > processed[0], processed
    assert s.request("GET", "/v1/stats")[1]["prefill"] is None
