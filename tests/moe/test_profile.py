"""Expert profiles: identity, both file formats, refusals, corpus checks, a real collection, the CLI."""
from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from engine.errors import UserError
from engine.gguf.reader import ModelFile
from engine.moe.profile import (MAX_REQUESTS, ExpertProfile, ModelIdentity, load_corpus,
                                load_profile, read_profile, read_strp, save_profile)
from engine.moe.hybrid import attach_hybrid
from engine.moe.profile_cli import collect_profile
from engine.runtime.engine import Engine, EngineConfig
from engine.synth.corpus import stdlib_text

K = 2  # the tiny models route each token to 2 of 8 experts


@pytest.fixture(scope="module")
def texts() -> list[str]:
    paragraphs = stdlib_text(max_chars=6000).split("\n\n")
    return [p[:400] for p in paragraphs if len(p) > 200][:4]


def write_corpus(tmp: Path, doc: dict, files: dict[str, str] | None = None) -> Path:
    for name, text in (files or {}).items():
        (tmp / name).write_text(text)
    path = tmp / "corpus.json"
    path.write_text(json.dumps(doc))
    return path


@pytest.fixture(scope="module")
def collected(tiny, identity, texts, tmp_path_factory):
    """A real collection over two families, with every executor call recorded independently."""
    tmp = tmp_path_factory.mktemp("corpus")
    doc = {"version": 1, "weights": {"prose": 3, "chat": 1}, "requests": [
        {"family": "prose", "prompt_file": "a.txt", "max_tokens": 12},
        {"family": "prose", "prompt": texts[1], "max_tokens": 7},
        {"family": "chat", "messages": [{"role": "user", "content": texts[2]}], "max_tokens": 9},
    ]}
    corpus = write_corpus(tmp, doc, {"a.txt": texts[0]})
    engine = Engine.load(tiny, EngineConfig(), attach_experts=attach_hybrid)
    calls: list[list[tuple[int, np.ndarray]]] = [[]]
    executor = engine.model.experts

    def recording(layer, x, ids, weights):
        calls[-1].append((layer, ids.cpu().numpy().copy()))
        return executor(layer, x, ids, weights)

    progress = []

    def on_progress(done: int, total: int, family: str) -> None:
        progress.append((done, total, family))
        calls.append([])

    engine.model.experts = recording
    profile = collect_profile(engine, corpus, on_progress)
    assert engine.model.experts is recording  # the counter unwrapped itself
    return profile, doc, calls[:-1], progress


def test_identity_of_a_model(tiny, identity, tmp_path):
    mf = ModelFile.open(tiny)
    experts = [t for n, t in mf.tensors.items() if "_exps." in n]
    assert (identity.arch, identity.n_layer, identity.moe_layers, identity.n_expert) == ("qwen3moe", 2, (0, 1), 8)
    assert identity.expert_bytes == sum(t.n_bytes for t in experts) and identity.file_size == tiny.stat().st_size
    assert identity == ModelIdentity.of(ModelFile.open(tiny))  # deterministic

    # One changed byte inside a sampled expert region changes the hash; a non-expert byte does not.
    def patched(tensor: str) -> str:
        copy = tmp_path / f"{tensor}.gguf"
        shutil.copy(tiny, copy)
        with open(copy, "r+b") as f:
            f.seek(mf.tensors[tensor].offset + 5)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0xFF]))
        return ModelIdentity.of(ModelFile.open(copy)).expert_hash

    assert patched("blk.1.ffn_down_exps.weight") != identity.expert_hash
    assert patched("token_embd.weight") == identity.expert_hash


def test_collection_counts_and_scores_follow_the_formula(collected, identity):
    profile, doc, calls, progress = collected
    assert progress == [(1, 3, "prose"), (2, 3, "prose"), (3, 3, "chat")]
    assert profile.identity == identity
    weights = {"prose": 0.75, "chat": 0.25}
    shares = {f: [] for f in weights}
    total = np.zeros((2, 8))
    for request, log in zip(doc["requests"], calls):
        # Independently: decode forwards are the one-row executor calls (these prompts are long).
        decode = [(layer, ids) for layer, ids in log if ids.shape[0] == 1]
        counts = np.zeros((2, 8))
        for layer, ids in decode:
            counts[layer] += np.bincount(ids.ravel(), minlength=8)
        rows = len(decode) // 2
        assert rows == request["max_tokens"]
        assert (counts.sum(axis=1) == rows * K).all()
        shares[request["family"]].append(counts / rows)
        total += counts
    expected = sum(w * np.mean(shares[f], axis=0) for f, w in weights.items())
    np.testing.assert_allclose(profile.scores, expected, rtol=1e-12)
    np.testing.assert_array_equal(profile.counts, total)
    assert (profile.counts.sum(axis=1) == 28 * K).all()  # 12 + 7 + 9 decode rows
    np.testing.assert_allclose(profile.scores.sum(axis=1), K)
    assert [(w.family, w.weight, w.requests, w.decode_rows) for w in profile.workload] == \
        [("prose", 0.75, 2, 19), ("chat", 0.25, 1, 9)]

    ranking = profile.ranking()
    assert len(ranking) == 16 and len(set(ranking)) == 16
    ranked_scores = [profile.scores[layer, e] for layer, e in ranking]
    assert ranked_scores == sorted(ranked_scores, reverse=True)
    assert profile.top(1, 3) == [e for layer, e in ranking if layer == 1][:3]
    per_layer = profile.ranking(slots_per_layer=3)
    assert len(per_layer) == 6 and [x for x in ranking if x in per_layer] == per_layer


def test_collection_on_a_model_with_a_leading_dense_layer(make_model, deepseek, texts, tmp_path):
    # The same prompt twice: the second prefill reuses the cached prefix and runs a single row,
    # which must not count as decode.
    doc = {"version": 1, "weights": {"a": 1}, "requests": [{"family": "a", "prompt": texts[3], "max_tokens": 5}] * 2}
    engine = Engine.load(make_model("deepseek2"), EngineConfig(), attach_experts=attach_hybrid)
    profile = collect_profile(engine, write_corpus(tmp_path, doc))
    assert profile.identity == deepseek and profile.counts.shape == (2, 8)
    assert profile.workload[0].decode_rows == 10
    assert (profile.counts.sum(axis=1) == 10 * K).all()
    assert [layer for layer, _ in profile.ranking()] and {layer for layer, _ in profile.ranking()} == {1, 2}


def test_ranking_ties_are_deterministic(identity):
    scores = np.zeros((2, 8))
    scores[1, 5] = scores[0, 6] = 1.0
    profile = ExpertProfile(identity, scores)
    assert profile.ranking()[:4] == [(0, 6), (1, 5), (0, 0), (0, 1)]
    assert profile.top(1, 2) == [5, 0]


def test_gguf_round_trip(collected, tmp_path):
    profile = collected[0]
    path = tmp_path / "p.gguf"
    save_profile(profile, path)
    back = read_profile(path)
    assert back.identity == profile.identity and back.workload == profile.workload
    np.testing.assert_array_equal(back.scores, profile.scores)
    np.testing.assert_array_equal(back.counts, profile.counts)
    assert back.ranking() == profile.ranking()
    fields = GGUFReader(path).fields
    f = fields["moe.profile.ranking_scores"]
    assert f.types == [GGUFValueType.ARRAY, GGUFValueType.FLOAT64] and len(f.data) == 16
    assert fields["moe.profile.source.moe_layers"].types == [GGUFValueType.ARRAY, GGUFValueType.UINT32]
    assert fields["moe.profile.source.expert_hash"].contents() == profile.identity.expert_hash
    assert fields["general.type"].contents() == "moe-profile"
    assert not GGUFReader(path).tensors


def test_strp_round_trip_and_layout(collected, tmp_path, tiny):
    profile = collected[0]
    path = tmp_path / "p.strp"
    save_profile(profile, path)
    data = path.read_bytes()
    positive = int((profile.scores > 0).sum())
    assert struct.unpack_from("<4sIIIII", data) == (b"STRP", 1, 2, 8, positive, positive)
    pairs = struct.unpack_from(f"<{2 * positive}H", data, 24)
    assert list(zip(pairs[::2], pairs[1::2])) == profile.ranking()[:positive]
    ranks = np.frombuffer(data, "<i4", offset=24 + 4 * positive).reshape(2, 8)
    for r, (layer, e) in enumerate(profile.ranking()):
        assert ranks[layer, e] == (r if r < positive else -1)

    back = load_profile(path, ModelFile.open(tiny))
    assert back.ranking() == profile.ranking()
    assert back.identity == profile.identity  # STRP has none: it takes on the model's

    save_profile(profile, tmp_path / "s.strp", slots=5)
    s = read_strp(tmp_path / "s.strp")
    assert (s.slots, s.ranked) == (5, tuple(profile.ranking()[:5]))


def test_strp_reader_ignores_a_frequency_table(tmp_path, identity):
    ranked = [(1, 3), (0, 0), (0, 7)]
    body = struct.pack("<4sIIIII", b"STRP", 1, 2, 8, 64, 3) + b"".join(struct.pack("<HH", *p) for p in ranked)
    body += np.random.default_rng(0).random(16, dtype=np.float32).tobytes()
    (tmp_path / "f.strp").write_bytes(body)
    profile = load_profile(tmp_path / "f.strp", identity)
    assert profile.ranking()[:3] == ranked and profile.counts is None


@pytest.fixture(scope="module")
def deepseek(make_model) -> ModelIdentity:
    return ModelIdentity.of(ModelFile.open(make_model("deepseek2")))


def test_strp_numbers_real_layers_for_leading_dense_layers(deepseek, tmp_path):
    assert (deepseek.n_layer, deepseek.moe_layers) == (3, (1, 2))
    scores = np.random.default_rng(1).random((2, 8))
    profile = ExpertProfile(deepseek, scores)
    save_profile(profile, tmp_path / "d.strp")
    s = read_strp(tmp_path / "d.strp")
    assert s.n_layers == 3 and {layer for layer, _ in s.ranked} == {1, 2}
    back = load_profile(tmp_path / "d.strp", deepseek)
    assert back.ranking() == profile.ranking() and back.identity == deepseek

    # A geometry-only GGUF (STRP converted without a model) fits the same way.
    save_profile(read_profile(tmp_path / "d.strp"), tmp_path / "d.gguf")
    assert read_profile(tmp_path / "d.gguf").identity.arch is None
    assert load_profile(tmp_path / "d.gguf", deepseek).ranking() == profile.ranking()

    dense = struct.pack("<4sIIIII", b"STRP", 1, 3, 8, 1, 1) + struct.pack("<HH", 0, 4) + bytes(4 * 24)
    (tmp_path / "dense.strp").write_bytes(dense)
    with pytest.raises(UserError, match="ranks experts of layer 0, which this model .* computes without experts"):
        load_profile(tmp_path / "dense.strp", deepseek)


def test_refuses_other_geometry_and_identity(collected, identity, tmp_path):
    profile = collected[0]
    big = replace(identity, n_layer=48, moe_layers=tuple(range(48)), n_expert=128)
    save_profile(ExpertProfile(big, np.ones((48, 128))), tmp_path / "big.gguf")
    with pytest.raises(UserError, match=r"is for qwen3moe with 48 layers × 128 experts; this model is "
                                        r"qwen3moe with 2 layers × 8 experts"):
        load_profile(tmp_path / "big.gguf", identity)
    save_profile(ExpertProfile(big, np.ones((48, 128))), tmp_path / "big.strp")
    with pytest.raises(UserError, match=r"is for 48 layers × 128 experts; this model is qwen3moe with 2 layers"):
        load_profile(tmp_path / "big.strp", identity)

    save_profile(replace(profile, identity=replace(identity, arch="olmoe")), tmp_path / "arch.gguf")
    with pytest.raises(UserError, match="is for olmoe with 2 layers × 8 experts"):
        load_profile(tmp_path / "arch.gguf", identity)
    save_profile(replace(profile, identity=replace(identity, expert_hash="b2s1:" + "0" * 32)), tmp_path / "h.gguf")
    with pytest.raises(UserError, match="another qwen3moe file of the same shape .*expert weights differ"):
        load_profile(tmp_path / "h.gguf", identity)


def _strp(n_layers=2, n_expert=8, slots=4, ranked=((0, 1), (1, 2)), version=1, magic=b"STRP", tail=0) -> bytes:
    head = struct.pack("<4sIIIII", magic, version, n_layers, n_expert, slots, len(ranked))
    return head + b"".join(struct.pack("<HH", *p) for p in ranked) + bytes(4 * n_layers * n_expert + tail)


@pytest.mark.parametrize("data, problem", [
    (_strp()[:0], "empty or truncated"),
    (_strp()[:3], "empty or truncated"),
    (_strp()[:10], "truncated: the header needs 24 bytes"),
    (_strp()[:24], "truncated: 2 ranked entries"),
    (_strp()[:26], "truncated"),
    (_strp()[:-1], "truncated"),
    (_strp(tail=3), "3 unexpected bytes at the end"),
    (b"PRTS" + _strp()[4:], "not an expert profile"),
    (_strp(version=2), "version 2 is not supported"),
    (_strp(slots=1), "ranks 2 experts for a cache of 1 slots"),
    (_strp(n_layers=0, ranked=()), "out of range"),
    (_strp(ranked=((2, 0),)), "outside 2 layers × 8 experts"),
    (_strp(ranked=((0, 8),)), "outside 2 layers × 8 experts"),
    (_strp(ranked=((0, 1), (0, 1))), "ranked twice"),
])
def test_corrupt_strp_is_refused(tmp_path, identity, data, problem):
    path = tmp_path / "bad.strp"
    path.write_bytes(data)
    with pytest.raises(UserError, match=problem):
        load_profile(path, identity)


def test_corrupt_gguf_is_refused(collected, tiny, identity, tmp_path):
    good = tmp_path / "p.gguf"
    save_profile(collected[0], good)
    data = good.read_bytes()
    for cut in (6, 30, 100, len(data) // 2, len(data) - 1):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(UserError):
            load_profile(tmp_path / "cut.gguf", identity)
    with pytest.raises(UserError, match="not an expert profile"):
        load_profile(tiny, identity)

    u32, arr, f64 = GGUFValueType.UINT32, GGUFValueType.ARRAY, GGUFValueType.FLOAT64
    base = {"moe.profile.version": (1, u32, None), "moe.profile.source.n_layer": (2, u32, None),
            "moe.profile.source.n_expert": (8, u32, None), "moe.profile.source.moe_layers": ([0, 1], arr, u32)}
    cases = [
        ({**base, "moe.profile.version": (2, u32, None)}, "version 2 is not supported"),
        (base, "ranking_scores' is missing"),
        ({**base, "moe.profile.ranking_scores": ([1.0] * 15, arr, f64)}, "has 15 values"),
        ({**base, "moe.profile.ranking_scores": ([-1.0] * 16, arr, f64)}, "negative or non-finite"),
        ({**base, "moe.profile.ranking_scores": ([1.0] * 16, arr, f64),
          "moe.profile.source.moe_layers": ([0, 5], arr, u32)}, "inconsistent geometry"),
    ]
    for keys, problem in cases:
        path = tmp_path / "w.gguf"
        w = GGUFWriter(path, "moe-profile")
        for key, (value, vtype, sub) in keys.items():
            w.add_key_value(key, value, vtype, sub_type=sub)
        w.write_header_to_file(path)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        w.close()
        with pytest.raises(UserError, match=problem):
            load_profile(path, identity)


# ---- the corpus -------------------------------------------------------------------------------

GOOD = {"version": 1, "weights": {"prose": 2, "code": 1}, "requests": [
    {"family": "prose", "prompt": "Some text to continue.", "max_tokens": 4},
    {"family": "code", "prompt_file": "code.txt", "max_tokens": 4},
]}


def _with(change) -> dict:
    doc = json.loads(json.dumps(GOOD))
    change(doc)
    return doc


@pytest.mark.parametrize("doc, problem", [
    (_with(lambda d: d["requests"][1].update(prompt_file="missing.txt")), "missing.txt does not exist"),
    (_with(lambda d: d["requests"][0].update(family="poetry")), "family 'poetry' has no weight"),
    (_with(lambda d: d["weights"].update(code=0)), "weight of family 'code' must be a positive number"),
    (_with(lambda d: d["weights"].update(code=-1.5)), "must be a positive number"),
    (_with(lambda d: d["weights"].update(code="1")), "must be a positive number"),
    (_with(lambda d: d["weights"].update(poetry=1)), "family 'poetry' has a weight but no requests"),
    (_with(lambda d: d["requests"][0].update(prompt="  \n")), "request #1: empty prompt"),
    (_with(lambda d: d["requests"][1].update(prompt_file="empty.txt")), "request #2: empty prompt"),
    (_with(lambda d: d["requests"][0].update(prompt=None)), "prompt must be a string"),
    (_with(lambda d: d["requests"][0].pop("prompt")), "needs exactly one of prompt, prompt_file, messages"),
    (_with(lambda d: d["requests"][0].update(prompt_file="code.txt")), "needs exactly one of"),
    (_with(lambda d: d["requests"][0].update(messages=[])), "needs exactly one of"),
    (_with(lambda d: d["requests"].__setitem__(0, {"family": "prose", "messages": [], "max_tokens": 4})),
     "messages must be a non-empty list"),
    (_with(lambda d: d["requests"].__setitem__(0, {"family": "prose", "max_tokens": 4,
                                                   "messages": [{"role": "user", "content": " "}]})),
     "every message is blank"),
    (_with(lambda d: d["requests"][0].update(max_tokens=0)), "max_tokens must be a whole number from 1 to"),
    (_with(lambda d: d["requests"][0].update(max_tokens=10**6)), "max_tokens"),
    (_with(lambda d: d["requests"][0].update(max_tokens="4")), "max_tokens"),
    (_with(lambda d: d["requests"][0].pop("max_tokens")), "max_tokens"),
    (_with(lambda d: d["requests"][0].update(promt="typo")), "request #1: unknown key 'promt'"),
    (_with(lambda d: d.update(version=2)), "version must be 1"),
    (_with(lambda d: d.pop("version")), "version must be 1"),
    (_with(lambda d: d.update(requests=[])), "requests\" must be a non-empty list"),
    (_with(lambda d: d.update(weights={})), "weights\" must map each family"),
    (_with(lambda d: d.update(requests=d["requests"] * (MAX_REQUESTS // 2 + 1))), "10002 requests is too many"),
    ([1, 2], "must be a JSON object"),
])
def test_bad_corpus_is_refused(tmp_path, doc, problem):
    path = write_corpus(tmp_path, doc, {"code.txt": "def f(x):\n    return x + 1\n", "empty.txt": ""})
    with pytest.raises(UserError, match=problem):
        load_corpus(path)


def test_corpus_files_and_json(tmp_path):
    path = write_corpus(tmp_path, GOOD, {"code.txt": "def f(x):\n    return x + 1\n"})
    corpus = load_corpus(path)
    assert corpus.weights == {"prose": 2 / 3, "code": 1 / 3}
    assert corpus.requests[1].prompt.startswith("def f(x)")
    path.write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        load_corpus(path)
    with pytest.raises(UserError, match="cannot read corpus"):
        load_corpus(tmp_path / "nowhere.json")


def test_a_prompt_that_fills_the_context_is_refused_before_generating(tiny, texts, tmp_path):
    engine = Engine.load(tiny, EngineConfig(n_ctx=32), attach_experts=attach_hybrid)
    generated = []
    engine.generate = lambda *a, **k: generated.append(a) or iter(())
    doc = {"version": 1, "weights": {"a": 1}, "requests": [
        {"family": "a", "prompt": "Short.", "max_tokens": 4},
        {"family": "a", "prompt": texts[0], "max_tokens": 4}]}
    with pytest.raises(UserError, match="request #2: its prompt has .* no room to generate"):
        collect_profile(engine, write_corpus(tmp_path, doc))
    assert not generated


# ---- the command line -------------------------------------------------------------------------

def moestudio(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine.cli", "profile", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def test_cli_collect_show_convert(tiny, texts, tmp_path, make_model):
    doc = {"version": 1, "weights": {"prose": 1, "docs": 1}, "requests": [
        {"family": "prose", "prompt": texts[0], "max_tokens": 6},
        {"family": "docs", "prompt_file": "b.txt", "max_tokens": 6}]}
    corpus = write_corpus(tmp_path, doc, {"b.txt": texts[1]})
    r = moestudio("collect", tiny, "--corpus", corpus, "-o", tmp_path / "p.gguf")
    assert r.returncode == 0, r.stderr
    assert "1/2 requests done (prose)" in r.stderr and "2/2 requests done (docs)" in r.stderr
    profile = load_profile(tmp_path / "p.gguf", ModelFile.open(tiny))
    assert (profile.counts.sum(axis=1) == 12 * K).all()

    r = moestudio("show", tmp_path / "p.gguf", "--model", tiny, "--top", "3")
    assert r.returncode == 0, r.stderr
    assert "qwen3moe with 2 layers × 8 experts" in r.stdout and "fits this profile" in r.stdout
    assert r.stdout.count("top 3 hold") == 2 and "docs: weight 50%, 1 request, 6 decode rows" in r.stdout

    r = moestudio("convert", tmp_path / "p.gguf", tmp_path / "p.strp", "--slots", "5")
    assert r.returncode == 0, r.stderr
    assert read_strp(tmp_path / "p.strp").ranked == tuple(profile.ranking()[:5])
    r = moestudio("convert", tmp_path / "p.strp", tmp_path / "q.gguf")
    assert r.returncode == 0 and "holds geometry only" in r.stderr
    assert read_profile(tmp_path / "q.gguf").identity.arch is None

    r = moestudio("show", tmp_path / "p.strp", "--model", make_model("deepseek2"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        f"moestudio: error: profile {tmp_path / 'p.strp'} is for 2 layers × 8 experts; this model is "
        "deepseek2 with 3 layers (MoE: 1-2) × 8 experts"]


def test_cli_refusals_are_one_line(tiny, tmp_path):
    bad = write_corpus(tmp_path, {"version": 1, "weights": {"a": 1}, "requests": [
        {"family": "a", "prompt": "", "max_tokens": 4}]})
    r = moestudio("collect", tiny, "--corpus", bad, "-o", tmp_path / "p.gguf")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "request #1: empty prompt" in r.stderr
    r = moestudio("collect", tiny, "--corpus", bad, "-o", tmp_path / "p.gguf", "--slots", "4")
    assert r.returncode == 2 and "slots apply to STRP output only" in r.stderr
    (tmp_path / "x.strp").write_bytes(_strp(slots=1))
    r = moestudio("convert", tmp_path / "x.strp", tmp_path / "x.gguf")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "n_ranked must not exceed slots" in r.stderr
