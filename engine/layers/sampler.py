"""Next-token sampling in llama.cpp's default order:
penalties → top_k → top_p → min_p → temperature → dist.

The order matters: top_p and min_p see the untempered distribution, exactly as in llama.cpp
(common/common.h `samplers` default), so a request behaves the same on both engines.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

# llama.cpp's top_p first looks for the nucleus among this many best tokens and only sorts the
# whole vocabulary when they are not enough (src/llama-sampler.cpp, llama_sampler_top_p_apply).
_TOP_P_FIRST_TRY = 256


@dataclass(frozen=True)
class SamplingParams:
    """OpenAI-style request defaults: every filter off, plain sampling at temperature 1."""

    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repeat_penalty: float = 1.0  # 1 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64  # 0 = no penalties
    seed: int | None = None  # None = fresh OS entropy per Sampler

    def __post_init__(self) -> None:
        # Each rule also rejects NaN, which fails every comparison.
        rules = (
            ("temperature", "a finite number >= 0 (0 = greedy)", lambda v: 0.0 <= v < math.inf),
            ("top_k", "an integer >= 0 (0 = off)", lambda v: isinstance(v, int) and v >= 0),
            ("top_p", "a number in [0, 1]", lambda v: 0.0 <= v <= 1.0),
            ("min_p", "a number in [0, 1]", lambda v: 0.0 <= v <= 1.0),
            ("repeat_penalty", "a finite number > 0 (1 = off)", lambda v: 0.0 < v < math.inf),
            ("presence_penalty", "a number in [-2, 2]", lambda v: -2.0 <= v <= 2.0),
            ("frequency_penalty", "a number in [-2, 2]", lambda v: -2.0 <= v <= 2.0),
            ("penalty_last_n", "an integer >= 0 (0 = off)", lambda v: isinstance(v, int) and v >= 0),
        )
        for name, allowed, ok in rules:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
                raise ValueError(f"{name} must be {allowed}, got {value!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or null, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def penalizes(self) -> bool:
        return self.penalty_last_n > 0 and (
            self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0)


def apply_penalties(logits: torch.Tensor, history: Sequence[int], params: SamplingParams) -> torch.Tensor:
    """llama.cpp's penalties over the last penalty_last_n tokens; a new tensor when anything changes."""
    if not params.penalizes or len(history) == 0:
        return logits
    window = list(history[-params.penalty_last_n:])
    ids, counts = torch.unique(torch.as_tensor(window, dtype=torch.long, device=logits.device),
                               return_counts=True)
    vals = logits[ids]
    # Dividing a negative logit would make the token *more* likely, hence multiply (<= 0, as llama.cpp).
    vals = torch.where(vals <= 0, vals * params.repeat_penalty, vals / params.repeat_penalty)
    vals = vals - (counts.to(vals.dtype) * params.frequency_penalty + params.presence_penalty)
    out = logits.clone()
    out[ids] = vals
    return out


def _sorted_head(probs: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The most probable tokens, sorted descending, enough for their sum to reach p: (probs, indices)."""
    head, order = torch.topk(probs, min(_TOP_P_FIRST_TRY, probs.numel()))
    if head.sum() >= p or head.numel() == probs.numel():
        return head, order
    # {probs >= floor} is always a prefix of the full sorted order, so lower the floor (cheap
    # masked sums) until that prefix holds p, then sort just it instead of the whole vocabulary.
    floor = head[-1]
    while torch.where(probs >= floor, probs, 0.0).sum() < p and floor > 0:
        floor = floor / 4
    order = torch.nonzero(probs >= floor).flatten()
    head, by_prob = torch.sort(probs[order], descending=True)
    return head, order[by_prob]


def candidates(logits: torch.Tensor, history: Sequence[int], params: SamplingParams
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens the chain leaves and their final probabilities: (ids [n] long, probs [n] float32)."""
    vals = apply_penalties(logits.float(), history, params)
    if params.greedy:
        best = torch.argmax(vals).reshape(1)
        return best, torch.ones(1, dtype=torch.float32, device=vals.device)

    ids = torch.arange(vals.numel(), device=vals.device)
    is_sorted = False
    if 0 < params.top_k < vals.numel():
        vals, ids = torch.topk(vals, params.top_k)
        is_sorted = True

    if params.top_p < 1.0:
        probs = torch.softmax(vals, 0)
        head, order = (probs, None) if is_sorted else _sorted_head(probs, params.top_p)
        # Keep up to and including the first token whose running sum reaches p (always >= 1 token).
        n_keep = min(int((torch.cumsum(head, 0) < params.top_p).sum()) + 1, head.numel())
        keep = slice(0, n_keep) if order is None else order[:n_keep]
        vals, ids = vals[keep], ids[keep]
        is_sorted = True

    if params.min_p > 0.0:
        # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p): no softmax needed.
        best = vals[0] if is_sorted else vals.max()
        keep = vals >= best + math.log(params.min_p)
        vals, ids = vals[keep], ids[keep]

    return ids, torch.softmax(vals / params.temperature, 0)


def filtered_probs(logits: torch.Tensor, history: Sequence[int], params: SamplingParams) -> torch.Tensor:
    """The whole-vocabulary distribution [V] that Sampler draws from (0 for filtered-out tokens)."""
    ids, probs = candidates(logits, history, params)
    return torch.zeros(logits.numel(), dtype=torch.float32, device=probs.device).index_put_((ids,), probs)


class Sampler:
    """Picks the next token from one row of logits; holds the seeded RNG of one generation."""

    def __init__(self, params: SamplingParams, vocab_size: int) -> None:
        self.params = params
        self.vocab_size = vocab_size
        self.generator = torch.Generator(device="cpu")
        if params.seed is None:
            self.generator.seed()
        else:
            # torch takes 64-bit seeds; masking keeps negative seeds (e.g. -1) valid and distinct.
            self.generator.manual_seed(params.seed & 0xFFFF_FFFF_FFFF_FFFF)

    def sample(self, logits: torch.Tensor, history: Sequence[int], allowed: torch.Tensor | None = None) -> int:
        """history: the prompt and generated tokens so far (llama-server penalizes prompt tokens too);
        allowed: a bool mask [V] of the tokens a grammar permits (engine/layers/grammar.py), or None."""
        if logits.shape != (self.vocab_size,):
            raise ValueError(f"expected logits of shape ({self.vocab_size},), got {tuple(logits.shape)}")
        if allowed is not None:  # before the chain, as llama.cpp applies a grammar sampler
            logits = logits.masked_fill(~allowed.to(logits.device), -math.inf)
        ids, probs = candidates(logits, history, self.params)
        # One draw per token, even when the choice is forced, like llama.cpp's dist sampler: the
        # random stream then depends only on how many tokens were sampled, not on the filters.
        u = torch.rand((), generator=self.generator, dtype=torch.float64)
        cdf = torch.cumsum(probs.cpu().double(), 0)
        i = min(int(torch.searchsorted(cdf, u * cdf[-1])), len(cdf) - 1)
        return int(ids[i])


def token_logprobs(logits: torch.Tensor, token: int, top_n: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The model's log-probability of `token` and its `top_n` most likely tokens, from raw logits
    (before penalties, filters, temperature and grammar: what the model itself predicts)."""
    logprobs = torch.log_softmax(logits.float(), 0)
    values, ids = torch.topk(logprobs, min(top_n, logprobs.numel()))
    return float(logprobs[token]), tuple(zip(ids.tolist(), values.tolist()))
