"""The residency policies' decisions, step by step, on hand-made observations.

A small world: 8 experts, 3 slots. `apply` plays the executor's part: a refill takes the slot out
of the residency map and (copies landing at once here) puts the new expert in.
"""
from __future__ import annotations

import numpy as np
import pytest

from engine.moe.policy import AdaptParams, Policy

N_EXPERT, N_SLOTS = 8, 3


class World:
    def __init__(self, name: str, params: AdaptParams = AdaptParams()):
        self.policy = Policy(name, N_EXPERT, N_SLOTS, params)
        self.slot_expert = np.full(N_SLOTS, -1, np.int32)
        self.resident = np.full(N_EXPERT, -1, np.int32)
        self.in_flight: set[int] = set()

    def step(self, *experts: int, rows: list[int] | None = None, land: bool = True,
             tokens: int = 1) -> list[tuple[int, int]]:
        ids = np.array(sorted(experts))
        refills = self.policy.refills(ids, np.array(rows or [1] * len(ids)), self.slot_expert, self.resident,
                                      self.in_flight, tokens)
        for slot, expert in refills:
            old = self.slot_expert[slot]
            if old >= 0:
                self.resident[old] = -1
            self.slot_expert[slot] = expert
            if land:
                self.resident[expert] = slot
            else:
                self.in_flight.add(expert)
        return refills

    def holds(self) -> set[int]:
        return {int(e) for e in self.slot_expert if e >= 0}


@pytest.mark.parametrize("name", ["off", "occurrence", "occurrence-sync", "lru", "lfru"])
def test_every_policy_first_fills_empty_slots_hottest_first(name):
    w = World(name)
    assert w.step(1, 2, 5, rows=[1, 3, 2]) == [(0, 2), (1, 5), (2, 1)]
    assert w.holds() == {1, 2, 5}


def test_off_never_refills_a_full_cache():
    w = World("off")
    w.step(0, 1, 2)
    assert all(w.step(5, 6, 7) == [] for _ in range(10))
    assert w.holds() == {0, 1, 2}


def test_an_expert_in_flight_is_not_asked_for_twice():
    w = World("lru")
    assert w.step(4, land=False) == [(0, 4)]
    assert w.step(4) == []


def test_lru_evicts_the_least_recently_used_but_never_one_this_step_used():
    w = World("lru")
    w.step(0, 1, 2)  # fills slots 0, 1, 2
    w.step(1, 2)
    assert w.step(2, 5) == [(0, 5)]  # 0 is the least recently used
    # every resident expert was used this step: the miss waits
    assert w.step(5, 1, 2, 6) == []
    assert w.holds() == {5, 1, 2}


def test_lru_does_not_evict_a_slot_whose_copy_is_in_flight():
    w = World("lru")
    w.step(0, 1)
    w.step(2, land=False)  # slot 2 holds 2, still in flight
    assert w.step(6) == [(0, 6)]
    assert w.step(7) == [(1, 7)]
    assert w.step(3) == [(0, 3)]
    assert w.slot_expert[2] == 2  # untouched while its copy is in flight


def test_lfru_admits_a_miss_only_if_it_is_at_least_as_frequent_as_the_victim():
    w = World("lfru")
    w.step(0, 1, 2, rows=[5, 5, 5])
    assert w.step(7) == []  # one use against five
    for _ in range(8):
        w.step(7, rows=[4])
    assert (7 in w.holds()) and len(w.holds()) == 3


def test_occurrence_updates_every_few_steps_and_needs_a_margin():
    params = AdaptParams(every=4, decay=1.0, swaps=1, margin=1.5, min_count=2.0)
    w = World("occurrence", params)
    w.step(0, 1, 2)  # step 1: fill
    w.step(0, 1, 2)  # step 2
    assert w.step(7) == []  # step 3: not an update step
    assert w.step(7) == []  # step 4: 7 counts 2, the coldest resident 2: short of the margin
    for _ in range(3):
        w.step(7)  # steps 5-7
    assert w.step(7) == [(0, 7)]  # step 8: 7 counts 6 against 2 + 1.5; one swap per update
    assert w.holds() == {7, 1, 2}


def test_occurrence_lets_a_prompt_re_rank_the_cache_as_its_tokens_updates_would():
    params = AdaptParams(every=4, decay=1.0, swaps=1, margin=1.5, min_count=2.0)
    w = World("occurrence", params)
    w.step(0, 1, 2)  # fill
    # A 12-token prompt (tokens 2-13) passes three update points: up to three swaps at once, hottest first,
    # each still by the margin (5 is short of it: 3 against the coldest resident's 1 + 1.5).
    assert w.step(0, 5, 6, 7, rows=[1, 3, 12, 8], tokens=12) == [(1, 6), (2, 7)]
    assert w.holds() == {0, 6, 7}
    # Tokens 14-15 pass none of them, the 16th token's step one.
    assert w.step(5, rows=[20], tokens=2) == []
    assert w.step(5) == [(0, 5)]


@pytest.mark.parametrize("name", ["off", "occurrence", "lru"])
def test_placeholders_serve_hits_and_give_way_like_empty_slots_until_used(name):
    w = World(name)
    for slot, expert in enumerate((0, 1, 2)):  # filled at load without evidence
        w.slot_expert[slot], w.resident[expert] = expert, slot
    w.policy.hold_placeholders(np.arange(N_SLOTS))
    assert w.step(1, 5, rows=[1, 2]) == [(0, 5)]  # 1 hit (no longer a placeholder), 5 takes slot 0
    assert w.step(6) == [(2, 6)]  # the last placeholder
    assert w.holds() == {5, 1, 6}
    if name == "off":  # static once the fill is done
        assert w.step(7) == []


@pytest.mark.parametrize("name", ["occurrence", "lru"])
def test_a_placeholder_given_away_is_not_also_a_victim(name):
    w = World(name, AdaptParams(every=1, decay=1.0, swaps=4, margin=0.0, min_count=0.0))
    w.step(0)  # slot 0: expert 0, used
    w.step(1)  # slot 1: expert 1, used
    w.step(2)  # slot 2: expert 2, used
    w.slot_expert[1], w.resident[1], w.resident[3] = 3, -1, 1  # slot 1 now holds 3, filled without evidence
    w.policy.hold_placeholders(np.array([1]))
    refills = w.step(5, 6, rows=[9, 8])
    assert refills[0] == (1, 5)  # the placeholder first
    slots = [s for s, _ in refills]
    assert len(slots) == len(set(slots)), refills
