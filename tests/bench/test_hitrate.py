"""`moestudio bench hitrate`: every policy replayed over the real routing llama.cpp recorded."""
from __future__ import annotations

import json
import subprocess
import sys

from engine.bench.hitrate import policy_hit_rates
from engine.moe.policy import POLICIES
from engine.runtime.tokenizer import tokenize_text


def test_every_policy_accounts_for_every_selection(tiny, prompt_text):
    tokens = tokenize_text(tiny, prompt_text)[:48]
    rates = policy_hit_rates(tiny, tokens, prefill=16, slots=3, miss_fraction=0.5)
    assert set(rates) == set(POLICIES)
    for name, r in rates.items():
        assert abs(r["gpu_hit"] + r["uploaded"] + r["cpu"] - 1) < 1e-9, name
        assert r["uploaded"] > 0 and r["host_us_per_layer_step"] > 0, name
    assert rates["off"]["swaps"] == 0  # the prefill filled the cache; off never changes it after
    assert rates["lru"]["swaps"] > rates["occurrence"]["swaps"]
    assert rates["occurrence"] == {**rates["occurrence-sync"],
                                   "host_us_per_layer_step": rates["occurrence"]["host_us_per_layer_step"]}


def test_the_command_prints_json(tiny):
    out = subprocess.run([sys.executable, "-m", "engine.cli", "bench", "hitrate", str(tiny), "--tokens", "96",
                          "--cache-share", "0.5", "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["slots_per_layer"] == 4 and report["n_expert"] == 8
    assert set(report["policies"]) == set(POLICIES)
