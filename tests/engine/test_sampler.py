"""Sampler: exact filter sets, llama.cpp's order and penalty math, seeding, validation."""
from __future__ import annotations

import ctypes
import math

import numpy as np
import pytest
import torch

from engine.layers.sampler import Sampler, SamplingParams, apply_penalties, candidates, filtered_probs


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs], dtype=torch.float32)


def kept(logits: torch.Tensor, params: SamplingParams) -> set[int]:
    return set(torch.nonzero(filtered_probs(logits, [], params)).flatten().tolist())


def test_defaults_are_openai_like():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (1.0, 0, 1.0, 0.0)
    assert (p.repeat_penalty, p.presence_penalty, p.frequency_penalty, p.penalty_last_n, p.seed) == (
        1.0, 0.0, 0.0, 64, None)
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(filtered_probs(logits, [1, 2, 3], p), torch.softmax(logits, 0))


def test_greedy_is_argmax():
    gen = torch.Generator().manual_seed(1)
    sampler = Sampler(SamplingParams(temperature=0.0), vocab_size=1000)
    for _ in range(20):
        logits = torch.randn(1000, generator=gen) * 4
        assert sampler.sample(logits, []) == int(torch.argmax(logits))


def test_penalties_follow_llama_cpp_formulas():
    logits = torch.tensor([2.0, 1.9, -1.0, 0.5, 0.0])
    params = SamplingParams(repeat_penalty=1.5, frequency_penalty=0.1, presence_penalty=0.2, penalty_last_n=4)
    # Token 3 is outside the last-4 window; token 0 appears twice, 1, 2 and 4 once.
    history = [3, 0, 1, 0, 2]
    out = apply_penalties(logits, history, params)
    expected = torch.tensor([2.0 / 1.5 - (2 * 0.1 + 0.2), 1.9 / 1.5 - 0.3, -1.0 * 1.5 - 0.3, 0.5, 0.0])
    assert torch.allclose(out, expected)
    assert logits[0] == 2.0, "the caller's logits must not change"
    # Penalties apply before greedy too: the argmax moves from token 0 to token 1.
    assert Sampler(SamplingParams(temperature=0.0, repeat_penalty=1.5, frequency_penalty=0.1,
                                  presence_penalty=0.2, penalty_last_n=4), 5).sample(logits, history) == 1
    assert Sampler(SamplingParams(temperature=0.0), 5).sample(logits, history) == 0


def test_penalties_off_when_window_is_zero():
    logits = torch.tensor([2.0, 1.0])
    params = SamplingParams(repeat_penalty=2.0, penalty_last_n=0)
    assert torch.equal(apply_penalties(logits, [0, 0], params), logits)


def test_top_k_1_is_greedy():
    gen = torch.Generator().manual_seed(2)
    sampler = Sampler(SamplingParams(top_k=1, seed=5), vocab_size=300)
    for _ in range(20):
        logits = torch.randn(300, generator=gen)
        assert sampler.sample(logits, []) == int(torch.argmax(logits))


def test_top_p_keeps_smallest_set_reaching_p():
    logits = logits_of([0.15, 0.5, 0.05, 0.3])
    assert kept(logits, SamplingParams(top_p=0.75)) == {1, 3}
    assert kept(logits, SamplingParams(top_p=0.85)) == {1, 3, 0}
    assert kept(logits, SamplingParams(top_p=0.0)) == {1}
    probs = filtered_probs(logits, [], SamplingParams(top_p=0.75))
    assert torch.allclose(probs, torch.tensor([0.0, 0.625, 0.0, 0.375]))


def test_top_p_on_large_vocab_matches_full_sort():
    # More than 256 tokens are needed here, so the first-256 shortcut must fall back to a full sort.
    logits = torch.randn(5000, generator=torch.Generator().manual_seed(3))
    order = np.argsort(-logits.double().numpy(), kind="stable")
    cum = np.cumsum(torch.softmax(logits.double(), 0).numpy()[order])
    for p in (0.05, 0.5, 0.9, 0.999):
        n = int(np.searchsorted(cum, p)) + 1
        assert kept(logits, SamplingParams(top_p=p)) == set(order[:n].tolist())
        assert n > 1 and (p < 0.5 or n > 256)


def test_min_p_is_relative_to_max_prob():
    logits = logits_of([0.15, 0.5, 0.05, 0.3])
    assert kept(logits, SamplingParams(min_p=0.25)) == {0, 1, 3}  # threshold 0.125
    assert kept(logits, SamplingParams(min_p=0.5)) == {1, 3}  # threshold 0.25
    assert kept(logits, SamplingParams(min_p=1.0)) == {1}


def test_top_p_sees_top_k_survivors_only():
    logits = logits_of([0.4, 0.3, 0.2, 0.1])
    # Alone, 0.4 < 0.5 so two tokens stay; after top_k=2 the best has 4/7 >= 0.5.
    assert kept(logits, SamplingParams(top_p=0.5)) == {0, 1}
    assert kept(logits, SamplingParams(top_k=2, top_p=0.5)) == {0}


def test_temperature_comes_after_the_filters():
    logits = logits_of([0.15, 0.5, 0.05, 0.3])
    params = SamplingParams(temperature=0.1, top_p=0.75)
    # Tempering first would give token 1 ~99% alone; llama.cpp filters on the untempered probs.
    probs = filtered_probs(logits, [], params)
    assert set(torch.nonzero(probs).flatten().tolist()) == {1, 3}
    assert torch.allclose(probs[[1, 3]], torch.softmax(logits[[1, 3]] / 0.1, 0))


def test_draws_follow_the_filtered_distribution():
    logits = logits_of([0.15, 0.5, 0.05, 0.3])
    sampler = Sampler(SamplingParams(top_p=0.75, seed=7), vocab_size=4)
    counts = np.bincount([sampler.sample(logits, []) for _ in range(3000)], minlength=4)
    assert counts[0] == counts[2] == 0
    assert abs(counts[1] / 3000 - 0.625) < 0.04


def test_same_seed_same_tokens():
    gen = torch.Generator().manual_seed(4)
    rows = [torch.randn(2000, generator=gen) for _ in range(30)]

    def run(seed: int) -> list[int]:
        sampler = Sampler(SamplingParams(seed=seed, top_k=50, top_p=0.95), vocab_size=2000)
        return [sampler.sample(r, []) for r in rows]

    assert run(123) == run(123)
    assert run(123) != run(124)


def test_unseeded_samplers_differ():
    logits = torch.zeros(10_000)
    a, b = Sampler(SamplingParams(), 10_000), Sampler(SamplingParams(), 10_000)
    assert [a.sample(logits, []) for _ in range(5)] != [b.sample(logits, []) for _ in range(5)]


def test_full_size_vocab_every_filter():
    logits = torch.randn(256_000, generator=torch.Generator().manual_seed(5)) * 3
    params = SamplingParams(top_p=0.9, min_p=0.01, repeat_penalty=1.1, seed=0)
    sampler = Sampler(params, 256_000)
    tokens = [sampler.sample(logits, list(range(64))) for _ in range(3)]
    assert (filtered_probs(logits, list(range(64)), params)[tokens] > 0).all()


def test_wrong_logits_shape_is_rejected():
    with pytest.raises(ValueError, match=r"shape \(10,\)"):
        Sampler(SamplingParams(), 10).sample(torch.zeros(11), [])


@pytest.mark.parametrize("field, value, allowed", [
    ("temperature", -0.5, ">= 0"),
    ("temperature", math.inf, "finite"),
    ("temperature", math.nan, ">= 0"),
    ("top_k", -1, ">= 0"),
    ("top_k", 2.5, "integer"),
    ("top_p", 1.5, "[0, 1]"),
    ("min_p", -0.1, "[0, 1]"),
    ("repeat_penalty", 0.0, "> 0"),
    ("presence_penalty", 2.5, "[-2, 2]"),
    ("frequency_penalty", -3.0, "[-2, 2]"),
    ("penalty_last_n", -1, ">= 0"),
    ("top_p", "0.5", "[0, 1]"),
    ("seed", 1.5, "integer"),
])
def test_validation_names_field_and_range(field, value, allowed):
    with pytest.raises(ValueError, match=field) as err:
        SamplingParams(**{field: value})
    assert allowed in str(err.value)


# --- llama.cpp itself as the oracle ----------------------------------------------------------

def llama_cpp_probs(logits: torch.Tensor, history: list[int], p: SamplingParams) -> torch.Tensor:
    """Run llama.cpp's common chain up to (not including) dist; softmax of what survives, as [V]."""
    lc = pytest.importorskip("llama_cpp")
    n = logits.numel()
    data = (lc.llama_token_data * n)(*[lc.llama_token_data(i, float(x), 0.0) for i, x in enumerate(logits)])
    arr = lc.llama_token_data_array(data, n, -1, False)
    chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
    for s in (lc.llama_sampler_init_penalties(n, p.penalty_last_n, p.repeat_penalty,
                                              p.frequency_penalty, p.presence_penalty),
              lc.llama_sampler_init_top_k(p.top_k), lc.llama_sampler_init_top_p(p.top_p, 0),
              lc.llama_sampler_init_min_p(p.min_p, 0), lc.llama_sampler_init_temp(p.temperature)):
        lc.llama_sampler_chain_add(chain, s)
    for t in history:
        lc.llama_sampler_accept(chain, t)
    lc.llama_sampler_apply(chain, ctypes.byref(arr))
    lc.llama_sampler_free(chain)
    ids = torch.tensor([data[i].id for i in range(arr.size)])
    vals = torch.tensor([data[i].logit for i in range(arr.size)])
    return torch.zeros(n).index_put_((ids,), torch.softmax(vals, 0))


@pytest.mark.parametrize("params", [
    SamplingParams(),
    SamplingParams(temperature=0.0, repeat_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5),
    SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=1.3, top_p=0.8, repeat_penalty=1.2, penalty_last_n=8),
    SamplingParams(temperature=0.5, min_p=0.1, frequency_penalty=-0.4, presence_penalty=1.0),
    SamplingParams(top_k=5, top_p=0.3),
    SamplingParams(top_p=0.995),  # a nucleus of ~500: wider than the first 256 looked at
    SamplingParams(top_p=0.99, min_p=0.001),
])
def test_matches_llama_cpp_chain(params):
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(1000, generator=gen) * 2.5
    history = torch.randint(0, 40, (30,), generator=gen).tolist()
    ours = filtered_probs(logits, history, params)
    ref = llama_cpp_probs(logits, history, params)
    assert torch.equal(ours > 0, ref > 0)
    assert torch.allclose(ours, ref, atol=1e-6)
    assert len(candidates(logits, history, params)[0]) == int((ref > 0).sum())


def test_a_grammar_mask_leaves_only_the_allowed_tokens():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(1))
    allowed = torch.zeros(50, dtype=torch.bool)
    allowed[[3, 17, 40]] = True
    best = max((3, 17, 40), key=lambda t: float(logits[t]))
    assert Sampler(SamplingParams(temperature=0.0), 50).sample(logits, [], allowed) == best
    sampler = Sampler(SamplingParams(temperature=2.0, seed=5), 50)
    assert {sampler.sample(logits, [], allowed) for _ in range(200)} == {3, 17, 40}


def test_token_logprobs_are_the_raw_log_softmax():
    from engine.layers.sampler import token_logprobs

    logits = torch.randn(50, generator=torch.Generator().manual_seed(2))
    expected = torch.log_softmax(logits, 0)
    logprob, top = token_logprobs(logits, 7, 3)
    assert logprob == pytest.approx(float(expected[7]))
    assert [t for t, _ in top] == torch.topk(expected, 3).indices.tolist()
    assert [lp for _, lp in top] == pytest.approx(torch.topk(expected, 3).values.tolist())
    assert token_logprobs(logits, 7, 0)[1] == ()
