"""The llama.cpp engine behind the same API, and `--engine auto` choosing it: without CUDA, and for
what the MoE Studio engine cannot run."""
from __future__ import annotations

import openai
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from engine.config import Config
from engine.errors import UserError
from engine.server.loader import AUTO_CPU_REASON, Loaded, choose_engine, load_hybrid, validated

USER = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def iq4_model(make_model):
    """IQ4_NL experts: llama.cpp runs them, the MoE Studio engine does not."""
    return make_model("qwen3moe", QT.IQ4_NL)


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_auto_with_cuda_prefers_hybrid_and_falls_back_with_a_reason(tiny_model, iq4_model, device):
    """The decision alone, for a CUDA device (no GPU needed: nothing is loaded)."""
    assert choose_engine(tiny_model, "auto", device) == (
        "hybrid", "auto: the MoE Studio engine supports qwen3moe and every tensor type of this file")
    kind, reason = choose_engine(iq4_model, "auto", device)
    assert kind == "llamacpp" and "IQ4_NL" in reason
    assert choose_engine(iq4_model, "llamacpp", device) == ("llamacpp", "chosen with --engine llamacpp")
    with pytest.raises(UserError, match="IQ4_NL.*--engine llamacpp"):
        choose_engine(iq4_model, "hybrid", device)


def test_auto_without_cuda_picks_llamacpp_unless_hybrid_is_asked_for(tiny_model, iq4_model):
    """On the CPU alone llama.cpp is several times faster and the expert cache has no GPU to live on."""
    assert AUTO_CPU_REASON == ("auto: no CUDA GPU here; llama.cpp is faster on the CPU alone "
                               "(--engine hybrid runs the MoE Studio engine anyway)")
    assert choose_engine(tiny_model, "auto", "cpu") == ("llamacpp", AUTO_CPU_REASON)
    assert choose_engine(tiny_model, "hybrid", "cpu") == ("hybrid", "chosen with --engine hybrid")
    assert choose_engine(tiny_model, "llamacpp", "cpu") == ("llamacpp", "chosen with --engine llamacpp")
    kind, reason = choose_engine(iq4_model, "auto", "cpu")  # the file's own reason comes first
    assert kind == "llamacpp" and "IQ4_NL" in reason
    with pytest.raises(UserError, match="IQ4_NL.*--engine llamacpp"):
        choose_engine(iq4_model, "hybrid", "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto picks the MoE Studio engine with CUDA")
def test_auto_serves_llamacpp_without_cuda_and_says_why(serve, tiny_model):
    s = serve(tiny_model, "-c", "1024")
    health = s.request("GET", "/health")[1]
    assert health["engine"] == "llamacpp" and health["engine_reason"] == AUTO_CPU_REASON
    assert health["effective"] == {"engine": "llamacpp", "ctx": 1024, "threads": health["effective"]["threads"],
                                   "device": "cpu", "n_cpu_moe": 0, "load_mode": "mmap"}
    assert f"engine: llamacpp ({AUTO_CPU_REASON})" in "".join(s.log)  # and in the log the app shows
    assert chat(s.url).usage.completion_tokens == 8
    assert s.request("GET", "/v1/stats")[1]["cache"] is None  # the dashboard's llama.cpp layout


def chat(url: str, **kwargs):
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    return client.chat.completions.create(model="m", messages=USER, max_tokens=8, temperature=0, **kwargs)


def test_llamacpp_answers_the_same_request_as_the_hybrid_engine(serve, server, tiny_model, count_chat_tokens):
    llama = serve(tiny_model, "--engine", "llamacpp", "-c", "1024")
    health = llama.request("GET", "/health")[1]
    assert health["engine"] == "llamacpp" and health["engine_reason"] == "chosen with --engine llamacpp"
    ours, theirs = chat(server.url), chat(llama.url)
    assert theirs.usage.prompt_tokens == ours.usage.prompt_tokens == count_chat_tokens(USER)
    # Same request, same counts. (The texts may part at a near-tie: llama.cpp's KV cache here is F16,
    # the engine's F32; tests/engine/test_parity.py compares the two with equal KV types.)
    assert theirs.usage.completion_tokens == ours.usage.completion_tokens == 8
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(llama.url, stream=True) if c.choices)
    assert streamed == theirs.choices[0].message.content
    snap = llama.request("GET", "/v1/stats")[1]
    assert snap["engine"] == "llamacpp" and snap["cache"] is None and snap["completion_tokens"] >= 16
    assert "moestudio_expert_gpu_hit" not in llama.request("GET", "/metrics")[1]  # absent, not faked


def test_auto_serves_an_unsupported_quant_through_llamacpp(serve, iq4_model):
    s = serve(iq4_model)
    health = s.request("GET", "/health")[1]
    assert health["engine"] == "llamacpp" and "IQ4_NL" in health["engine_reason"]
    r = chat(s.url, stop=["\n\n"])
    assert r.usage.completion_tokens >= 1 and r.choices[0].finish_reason in ("length", "stop")


def test_cpu_moe_overrides_reach_llama_cpp(tiny_model):
    """The --n-cpu-moe override list is built and read by llama.cpp (on this CPU build it moves nothing)."""
    from engine.baseline.llama_engine import LlamaEngine
    from engine.baseline.placement import cpu_moe_overrides, open_llama_with
    from engine.layers.sampler import SamplingParams
    from engine.runtime.engine import Request
    from engine.runtime.tokenizer import Tokenizer

    table = cpu_moe_overrides(2)
    assert [table[i].pattern for i in range(2)] == [rb"blk\.0\.ffn_(up|down|gate|gate_up)_(ch|)exps",
                                                     rb"blk\.1\.ffn_(up|down|gate|gate_up)_(ch|)exps"]
    assert table[2].pattern is None and cpu_moe_overrides(0) is None
    request = Request(messages=USER, max_tokens=6, sampling=SamplingParams(temperature=0))
    pinned = LlamaEngine(open_llama_with(tiny_model, overrides=table, n_ctx=256), Tokenizer(tiny_model))
    plain = LlamaEngine.load(tiny_model, n_ctx=256, threads=None)
    assert list(pinned.generate(request))[-1].text == list(plain.generate(request))[-1].text
    table[0].pattern = rb"blk\.0\.ffn_(up"  # an invalid regex: llama.cpp refuses the load, so it read the list
    with pytest.raises(UserError, match="could not load"):
        open_llama_with(tiny_model, overrides=table, n_ctx=256)


def test_the_hybrid_engine_on_a_model_it_cannot_run_is_refused_before_listening(run_cli, iq4_model):
    r = run_cli("serve", str(iq4_model), "--engine", "hybrid", "--port", "0")
    assert r.returncode == 2 and "serving" not in r.stderr
    assert r.stderr.strip() == ("moestudio: error: quantization type(s) IQ4_NL are not supported by the MoE Studio "
                                "engine; use --engine llamacpp or auto")


def test_auto_checks_a_file_once_and_falls_back_where_the_engine_does_not_match(make_model):
    """At a file's first load auto (on CUDA: the one case where it picks this engine by itself)
    validates this engine against llama.cpp (engine/validate.py) and keeps the verdict in the user
    cache; a recorded mismatch sends the file to llama.cpp, with why. The check itself runs on the
    engine's own device, here the CPU, in process: what load_engine does after choosing."""
    import json

    from engine.gguf.fingerprint import file_fingerprint
    from engine.validate import _engine_version, _verdict_cache

    path = make_model("olmoe", QT.Q8_0)
    cfg = Config(model=str(path), device="cpu")
    kind, reason = choose_engine(path, "auto", "cuda")
    verdict = _verdict_cache() / f"{file_fingerprint(path)}-{_engine_version()}-cpu.json"
    assert not verdict.exists()
    first = validated(cfg, hybrid(cfg, kind, reason), _quiet)
    assert first.kind == "hybrid" and first.reason == f"{reason}; it matched llama.cpp on this file"
    assert json.loads(verdict.read_text())["failure"] is None

    verdict.write_text(json.dumps({"failure": "this engine did not match llama.cpp on this file (mean KL 1e-2)"}))
    second = validated(cfg, hybrid(cfg, kind, reason), _quiet)
    assert second.kind == "llamacpp" and second.effective["engine"] == "llamacpp"
    assert second.reason == "auto: this engine did not match llama.cpp on this file (mean KL 1e-2)"
    from engine.runtime.engine import Request

    events = list(second.engine.generate(Request(messages=USER, max_tokens=2, ignore_eos=True)))
    assert events[-1].completion_tokens == 2


def _quiet(stage: str, fraction: float) -> None:
    pass


def hybrid(cfg: Config, kind: str, reason: str) -> Loaded:
    engine, effective = load_hybrid(cfg, _quiet)
    return Loaded(engine, kind, reason, effective)
