"""The routing knob moves the statistics that matter to an expert cache, in the asked direction."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from engine.baseline.oracle import run_reference
from engine.runtime.tokenizer import tokenize_text
from engine.synth.corpus import stdlib_text
from engine.synth.spec import preset
from engine.synth.stats import layer_stats, lru_hit_rate, routing_stats


def test_lru_hit_rate_counts_hits_after_warmup():
    ids = np.array([[0, 1], [0, 2], [1, 2], [3, 4]])
    # capacity 3: token 1 hits 0; token 2: 1 hits (cache 1,0,2 -> 0,2 most recent, 1 still in); token 3 misses
    assert lru_hit_rate(ids, capacity=3, warmup=1) == pytest.approx(3 / 6)
    assert lru_hit_rate(ids, capacity=2, warmup=1) == pytest.approx(2 / 6)


def test_layer_stats_on_a_constant_and_a_rotating_stream():
    constant = np.tile([[1, 2]], (100, 1))
    s = layer_stats(constant, n_expert=8)
    assert s["next_token_repeat"] == 1.0 and s["median_reuse_distance"] == 1.0
    assert s["experts_touched"] == 2 and s["top10pct_share"] == pytest.approx(0.5)
    rotating = np.array([[(2 * t) % 8, (2 * t + 1) % 8] for t in range(100)])
    r = layer_stats(rotating, n_expert=8)
    assert r["next_token_repeat"] == 0.0 and r["median_reuse_distance"] == 4.0
    assert r["entropy"] == pytest.approx(1.0, abs=1e-3)


@pytest.fixture(scope="module")
def knob_stats(make_model):
    spec = preset("tiny", "qwen3moe").with_(n_expert=32, n_expert_used=4, expert_qtype=QT.Q8_0)
    text = stdlib_text(max_chars=4000)
    out = {}
    for name in ("qwen3-30b", "flat", "token-only"):
        path = make_model(spec, routing_name=name)
        ref = run_reference(path, tokenize_text(path, text)[:512], logits=False)
        out[name] = routing_stats(ref.experts, ref.n_expert)["mean"]
    return out


@pytest.mark.parametrize("metric", ["next_token_repeat", "lru_hit_25pct", "top10pct_share"])
def test_knob_orders_locality_and_skew(knob_stats, metric):
    assert knob_stats["qwen3-30b"][metric] > knob_stats["flat"][metric] > knob_stats["token-only"][metric]


def test_qwen3_setting_is_far_from_random(knob_stats):
    s = knob_stats["qwen3-30b"]
    assert s["next_token_repeat"] > 0.35 and s["lru_hit_50pct"] > 0.8
