"""Bad expert profiles and corpora are refused with a message, in the library and on the paths users take.

tests/moe/test_profile.py has the hand-picked refusals: another geometry or identity, a list of corrupt
STRP headers, five cuts and four metadata cases of a GGUF profile, the corpus rules (a missing prompt
file among them). This module makes the file cases exhaustive and adds the entry points: every
truncation of both formats, seeded byte flips, each GGUF profile key with a value of the wrong type,
a profile for another model given to `moestudio serve` (refused before it listens, which the app reads
as a settings problem), and corpora that are empty, not JSON in ways Python's parser reports with
other exceptions, or that name a prompt file that cannot be read.
"""
from __future__ import annotations

import json
import struct
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFValueType as VT
from gguf import GGUFWriter

from app.worker_state import Cause, classify_crash
from engine.errors import UserError
from engine.moe.profile import ExpertProfile, ModelIdentity, Workload, load_corpus, load_profile, save_profile
from tests.server.conftest import start_server

ROOT = Path(__file__).resolve().parents[2]
FLIPS = 400


@pytest.fixture(scope="module")
def profile(identity) -> ExpertProfile:
    rng = np.random.default_rng(1)
    shape = (len(identity.moe_layers), identity.n_expert)
    return ExpertProfile(identity, rng.random(shape), rng.integers(1, 40, shape).astype(float),
                         (Workload("chat", 0.75, 3, 40), Workload("code", 0.25, 1, 12)))


def refusal(path: Path, identity: ModelIdentity) -> str:
    with pytest.raises(UserError) as info:
        load_profile(path, identity)
    message = str(info.value)
    assert message and "\n" not in message, message
    return message


# ---- the file formats ----------------------------------------------------------------------------------

@pytest.mark.parametrize("suffix", [".gguf", ".strp"])
def test_every_truncation_is_refused(profile, identity, tmp_path, suffix):
    good = tmp_path / f"good{suffix}"
    save_profile(profile, good)
    assert load_profile(good, identity).identity.n_expert == identity.n_expert
    data = good.read_bytes()
    cut = tmp_path / f"cut{suffix}"
    for n in range(len(data)):
        cut.write_bytes(data[:n])
        message = refusal(cut, identity)
        assert str(cut) in message, (n, message)


@pytest.mark.parametrize("suffix", [".gguf", ".strp"])
def test_byte_flips_are_refused_or_fit(profile, identity, tmp_path, suffix):
    """A flip lands in a count, a type, a key, a score or the identity: each is either refused with a
    message or still describes this model's geometry; nothing else escapes."""
    good = tmp_path / f"good{suffix}"
    save_profile(profile, good)
    data = good.read_bytes()
    bad = tmp_path / f"flipped{suffix}"
    rng = np.random.default_rng(7)
    outcomes: Counter[str] = Counter()
    for _ in range(FLIPS):
        flipped = bytearray(data)
        for pos in rng.integers(0, len(data), int(rng.integers(1, 4))):
            flipped[pos] ^= 1 << int(rng.integers(0, 8))
        bad.write_bytes(bytes(flipped))
        try:
            fitted = load_profile(bad, identity)
        except UserError as e:
            assert str(e) and "\n" not in str(e)
            outcomes["refused"] += 1
            continue
        assert fitted.scores.shape == (len(identity.moe_layers), identity.n_expert)
        assert np.isfinite(fitted.scores).all() and (fitted.scores >= 0).all()
        outcomes["fit"] += 1
    assert outcomes["refused"] > 0 and outcomes["fit"] > 0, outcomes


def _gguf_profile(path: Path, identity: ModelIdentity, **changes) -> Path:
    """A GGUF profile written key by key; `changes` maps a key suffix (dots as __) to (value, type, item
    type), or to None to leave the key out."""
    n = len(identity.moe_layers) * identity.n_expert
    keys = {
        "version": (1, VT.UINT32, None),
        "ranking_scores": ([0.5] * n, VT.ARRAY, VT.FLOAT64),
        "counts": ([3.0] * n, VT.ARRAY, VT.FLOAT64),
        "source.n_layer": (identity.n_layer, VT.UINT32, None),
        "source.moe_layers": (list(identity.moe_layers), VT.ARRAY, VT.UINT32),
        "source.n_expert": (identity.n_expert, VT.UINT32, None),
        "source.architecture": (identity.arch, VT.STRING, None),
        "source.file_size": (identity.file_size, VT.UINT64, None),
        "source.expert_bytes": (identity.expert_bytes, VT.UINT64, None),
        "source.expert_hash": (identity.expert_hash, VT.STRING, None),
        "workload.families": (["chat"], VT.ARRAY, VT.STRING),
        "workload.weights": ([1.0], VT.ARRAY, VT.FLOAT64),
        "workload.requests": ([2], VT.ARRAY, VT.UINT32),
        "workload.decode_rows": ([20], VT.ARRAY, VT.UINT64),
    }
    for name, value in changes.items():
        keys[name.replace("__", ".")] = value
    w = GGUFWriter(path, "moe-profile")
    for key, entry in keys.items():
        if entry is not None:
            value, vtype, sub = entry
            w.add_key_value(f"moe.profile.{key}", value, vtype, sub_type=sub)
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return path


WRONG = "is missing or of the wrong type"
KEY_CASES = [
    ({"version": ("1", VT.STRING, None)}, "version '1' is not supported"),
    ({"version": (1.0, VT.FLOAT32, None)}, "version 1.0 is not supported"),
    ({"version": None}, "not an expert profile (no moe.profile.version)"),
    ({"source__n_layer": ("2", VT.STRING, None)}, f"'moe.profile.source.n_layer' {WRONG}"),
    ({"source__n_layer": (True, VT.BOOL, None)}, f"'moe.profile.source.n_layer' {WRONG}"),
    ({"source__n_layer": (0, VT.UINT32, None)}, "inconsistent geometry"),
    ({"source__n_expert": (2.0, VT.FLOAT64, None)}, f"'moe.profile.source.n_expert' {WRONG}"),
    ({"source__moe_layers": (1, VT.UINT32, None)}, f"'moe.profile.source.moe_layers' {WRONG}"),
    ({"source__moe_layers": (["0", "1"], VT.ARRAY, VT.STRING)}, f"'moe.profile.source.moe_layers' {WRONG}"),
    ({"source__moe_layers": ([1, 0], VT.ARRAY, VT.UINT32)}, "inconsistent geometry"),
    ({"source__moe_layers": ([0, 0], VT.ARRAY, VT.UINT32)}, "inconsistent geometry"),
    ({"ranking_scores": ("high", VT.STRING, None)}, f"'moe.profile.ranking_scores' {WRONG}"),
    ({"ranking_scores": ([True] * 16, VT.ARRAY, VT.BOOL)}, f"'moe.profile.ranking_scores' {WRONG}"),
    ({"ranking_scores": ([float("nan")] * 16, VT.ARRAY, VT.FLOAT64)}, "negative or non-finite"),
    ({"ranking_scores": ([float("inf")] * 16, VT.ARRAY, VT.FLOAT32)}, "negative or non-finite"),
    ({"ranking_scores": ([1.0] * 17, VT.ARRAY, VT.FLOAT64)}, "has 17 values"),
    ({"counts": (["1"] * 16, VT.ARRAY, VT.STRING)}, f"'moe.profile.counts' {WRONG}"),
    ({"counts": ([-1.0] * 16, VT.ARRAY, VT.FLOAT64)}, "negative or non-finite"),
    ({"source__architecture": (3, VT.UINT32, None)}, f"'moe.profile.source.architecture' {WRONG}"),
    ({"source__file_size": ("big", VT.STRING, None)}, f"'moe.profile.source.file_size' {WRONG}"),
    ({"source__expert_hash": None}, f"'moe.profile.source.expert_hash' {WRONG}"),
    ({"source__expert_hash": (7, VT.UINT64, None)}, f"'moe.profile.source.expert_hash' {WRONG}"),
    ({"workload__families": ([1], VT.ARRAY, VT.UINT32)}, f"'moe.profile.workload.families' {WRONG}"),
    ({"workload__weights": (["1"], VT.ARRAY, VT.STRING)}, f"'moe.profile.workload.weights' {WRONG}"),
    ({"workload__requests": None}, f"'moe.profile.workload.requests' {WRONG}"),
    ({"workload__decode_rows": ([1, 2], VT.ARRAY, VT.UINT64)}, "the moe.profile.workload arrays differ in length"),
]


@pytest.mark.parametrize("changes, words", KEY_CASES, ids=[f"{next(iter(c))}-{i}" for i, (c, _) in enumerate(KEY_CASES)])
def test_gguf_profile_keys_of_the_wrong_type(identity, tmp_path, changes, words):
    assert words in refusal(_gguf_profile(tmp_path / "p.gguf", identity, **changes), identity)


def test_the_written_keys_make_a_profile_that_fits(identity, tmp_path):
    """The cases above change one key each of a file that is itself accepted."""
    fitted = load_profile(_gguf_profile(tmp_path / "p.gguf", identity), identity)
    assert fitted.identity == identity and fitted.workload == (Workload("chat", 1.0, 2, 20),)


# ---- a profile for another model, given to the server --------------------------------------------------

def _strp(n_layers: int, n_expert: int, ranked: list[tuple[int, int]]) -> bytes:
    head = struct.pack("<4sIIIII", b"STRP", 1, n_layers, n_expert, len(ranked), len(ranked))
    return head + b"".join(struct.pack("<HH", *p) for p in ranked) + bytes(4 * n_layers * n_expert)


def test_serve_refuses_a_profile_for_another_model_before_listening(tiny, identity, profile, tmp_path):
    big = replace(identity, n_layer=48, moe_layers=tuple(range(48)), n_expert=128)
    save_profile(ExpertProfile(big, np.ones((48, 128))), tmp_path / "geometry.gguf")
    save_profile(replace(profile, identity=replace(identity, expert_hash="b2s1:" + "0" * 32)),
                 tmp_path / "identity.gguf")
    (tmp_path / "geometry.strp").write_bytes(_strp(48, 128, [(0, 1)]))
    (tmp_path / "corrupt.strp").write_bytes(_strp(2, 8, [(0, 1), (0, 1)]))
    cases = {
        "geometry.gguf": "is for qwen3moe with 48 layers × 128 experts; this model is qwen3moe with 2 layers",
        "identity.gguf": "was collected on another qwen3moe file of the same shape",
        "geometry.strp": "is for 48 layers × 128 experts; this model is qwen3moe with 2 layers",
        "corrupt.strp": "layer 0, expert 1 is ranked twice",
        "missing.gguf": "missing.gguf does not exist",
    }
    procs = {name: subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", str(tiny), "--port", "0",
                                     "--engine", "hybrid", "--moe-expert-profile", str(tmp_path / name)], cwd=ROOT, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE) for name in cases}
    for name, words in cases.items():
        _, err = procs[name].communicate(timeout=120)
        code = procs[name].returncode
        assert code == 2 and "Traceback" not in err and "serving" not in err, (name, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("moestudio: error: ") and words in lines[0], (name, err)
        # The app says "The engine refused its settings" and does not retry: the profile setting is at fault.
        assert classify_crash(err, code).cause == Cause.BAD_SETTINGS, (name, err)

    # A profile that fits is taken: the server listens and loads.
    save_profile(profile, tmp_path / "good.strp")
    s = start_server(tiny, "--engine", "hybrid", "-c", "256", "--moe-expert-profile", str(tmp_path / "good.strp"))
    try:
        assert s.health_seen[-1]["status"] == "ok", "".join(s.log)
    finally:
        assert s.stop() == 0


# ---- corpora -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, words", [
    ("", "is empty"),
    ("  \n\t ", "is empty"),
    ("{}", "version must be 1"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"version": 1' + "0" * 5000 + "}", "not valid JSON"),
    ('{"version": 1, "weights": {"a": 1}, "requests": []}', '"requests" must be a non-empty list'),
    ('{"version": 1, "weights": {"a": 1}, "requests": [{"family": "a", "prompt_file": "a\\u0000b", '
     '"max_tokens": 4}]}', "prompt_file must be a path"),
    ('{"version": 1, "weights": {"a": 1}, "requests": [{"family": "a", "prompt_file": ".", "max_tokens": 4}]}',
     "cannot read prompt file"),
], ids=["empty", "blank", "empty object", "nested", "5000-digit number", "no requests", "NUL in prompt_file",
        "prompt_file a directory"])
def test_corpora_that_are_empty_or_unreadable(tmp_path, text, words):
    corpus = tmp_path / "corpus.json"
    corpus.write_text(text)
    with pytest.raises(UserError) as info:
        load_corpus(corpus)
    assert words in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_collect_refuses_an_empty_corpus_or_a_directory_in_one_line(tiny, tmp_path):
    (tmp_path / "empty.json").write_text("")
    runs = {"empty.json": "is empty", ".": "cannot read corpus"}
    procs = {name: subprocess.Popen([sys.executable, "-m", "engine.cli", "profile", "collect", str(tiny),
                                     "--corpus", str(tmp_path / name), "-o", str(tmp_path / "out.gguf")],
                                    cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for name in runs}
    for name, words in runs.items():
        _, err = procs[name].communicate(timeout=120)
        assert procs[name].returncode == 2 and "Traceback" not in err, (name, err)
        assert err.count("\n") == 1 and words in err, (name, err)
    assert not (tmp_path / "out.gguf").exists()


def test_json_corpus_of_the_right_shape_still_loads(tmp_path):
    """The refusals above are about the input, not the reader: a minimal corpus loads."""
    corpus = tmp_path / "corpus.json"
    corpus.write_text(json.dumps({"version": 1, "weights": {"a": 1},
                                  "requests": [{"family": "a", "prompt": "Hello there.", "max_tokens": 4}]}))
    assert load_corpus(corpus).weights == {"a": 1.0}
