"""Which experts live in a layer's slots: the residency policies.

Every policy sees the same observations (the distinct experts a layer step routed to, with
how many rows picked each) and answers with refills: (slot, expert) copies to start. All of
them first fill empty slots with missed experts, then placeholders: slots the engine filled at
load without evidence (no profile), which serve hits until then but give way like empty ones.
Then:

* off            static after the fill (a profile, if given, did the fill at start)
* occurrence     Strata's adaptive tier: decayed counts (x decay per update), a miss becomes a
                 candidate once its count reaches min_count, it replaces the coldest resident
                 expert only by a margin, at most `swaps` refills per update, an update every
                 `every` tokens; copies land asynchronously and decode never waits for them.
                 A step of many tokens (a prompt) holds that many tokens' updates at once, so
                 a prompt re-ranks the cache for the decode that follows it (on a recorded
                 Qwen3-30B routing at 36 of 128 slots, the first 16 tokens after a 512-token
                 prompt hit 91% instead of 71% when a prompt made one update's swaps)
* occurrence-sync the same decisions, but the step waits for its copies (the control)
* lru            every missed expert replaces the least recently used one (at most `swaps`/step)
* lfru           evicts the least frequently used (decayed), recency breaking ties, and admits a
                 missed expert only if it is at least as frequent as the victim
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

POLICIES = ("off", "occurrence", "occurrence-sync", "lru", "lfru")


@dataclass(frozen=True)
class AdaptParams:
    every: int = 4  # tokens per occurrence update
    decay: float = 0.7
    swaps: int = 4
    margin: float = 1.5
    min_count: float = 2.0


class Policy:
    """Per-layer state for one policy; `refills` is called once per layer step."""

    def __init__(self, name: str, n_expert: int, n_slots: int, params: AdaptParams = AdaptParams()):
        if name not in POLICIES:
            raise ValueError(f"unknown residency policy {name!r}; choose from: {', '.join(POLICIES)}")
        self.name, self.params, self.n_slots = name, params, n_slots
        self.counts = np.zeros(n_expert, np.float64)  # decayed access counts
        self.last_use = np.zeros(n_expert, np.int64)
        self.placeholder = np.zeros(n_slots, bool)  # filled without evidence; free until its expert is used
        self.step = 0  # layer steps seen
        self.tokens = 0  # tokens those steps held (occurrence updates every `every` of them)
        self._step_decay = params.decay ** (1 / params.every)  # occurrence's half-life, per step

    def hold_placeholders(self, slots: np.ndarray) -> None:
        self.placeholder[slots] = True

    @property
    def synchronous(self) -> bool:
        return self.name == "occurrence-sync"

    def refills(self, experts: np.ndarray, rows: np.ndarray, slot_expert: np.ndarray,
                resident: np.ndarray, in_flight: set[int], tokens: int = 1) -> list[tuple[int, int]]:
        """(slot, expert) refills after a step of `tokens` tokens that routed rows[i] rows to
        experts[i]."""
        self.step += 1
        self.tokens += tokens
        if self.name in ("lru", "lfru"):
            self.counts *= self._step_decay
        self.counts[experts] += rows
        self.last_use[experts] = self.step
        if self.placeholder.any():  # a placeholder whose expert was used is one no longer
            self.placeholder &= self.counts[slot_expert] == 0
        missed = experts[resident[experts] < 0]
        if not missed.size:
            return []
        missed = [e for e in missed[np.argsort(-self.counts[missed], kind="stable")].tolist() if e not in in_flight]
        free = (slot_expert < 0).nonzero()[0].tolist()
        if self.placeholder.any():
            free += self.placeholder.nonzero()[0].tolist()
        out = list(zip(free, missed))
        self.placeholder[[s for s, _ in out]] = False
        missed = missed[len(out):]
        if self.name == "off" or not missed or self.n_slots == 0:
            return out
        busy = [s for s, _ in out]  # a placeholder just given away is still landed: not a victim too
        if self.name in ("occurrence", "occurrence-sync"):
            return out + self._occurrence(missed, slot_expert, resident, tokens, busy)
        return out + self._replace(missed[:self.params.swaps], slot_expert, resident, busy)

    def _landed(self, slot_expert: np.ndarray, resident: np.ndarray, busy: list[int]) -> np.ndarray:
        """Slots whose expert has landed (a slot in flight cannot be evicted), but for `busy`."""
        landed = ((slot_expert >= 0) & (resident[slot_expert] == np.arange(self.n_slots))).nonzero()[0]
        return landed[~np.isin(landed, busy)] if busy else landed

    def _occurrence(self, missed: list[int], slot_expert: np.ndarray, resident: np.ndarray,
                    tokens: int, busy: list[int]) -> list[tuple[int, int]]:
        p = self.params
        updates = self.tokens // p.every - (self.tokens - tokens) // p.every  # update points this step passed
        if not updates:
            return []
        self.counts *= p.decay
        candidates = [e for e in missed if self.counts[e] >= p.min_count]
        landed = self._landed(slot_expert, resident, busy)
        victims = landed[np.argsort(self.counts[slot_expert[landed]], kind="stable")].tolist()
        out = []
        for e, s in zip(candidates, victims):
            if len(out) == p.swaps * updates or self.counts[e] < self.counts[slot_expert[s]] + p.margin:
                break
            out.append((s, e))
        return out

    def _replace(self, missed: list[int], slot_expert: np.ndarray, resident: np.ndarray,
                 busy: list[int]) -> list[tuple[int, int]]:
        landed = self._landed(slot_expert, resident, busy)
        used = self.last_use[slot_expert[landed]]
        if self.name == "lru":
            order = landed[np.argsort(used, kind="stable")]
        else:
            order = landed[np.lexsort((used, self.counts[slot_expert[landed]]))]
        out = []
        for e, s in zip(missed, order.tolist()):
            if self.last_use[slot_expert[s]] == self.step:
                break  # never evict an expert this very step used
            if self.name == "lfru" and self.counts[e] < self.counts[slot_expert[s]]:
                break
            out.append((s, e))
        return out
