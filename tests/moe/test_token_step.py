"""The host side of the decode token's graph, on the CPU: the mailbox protocol against a thread
that plays the GPU's part (publish, wait for the flag, read the rows), and the learning from
the GPU's counters into the policies, the telemetry and the residency map. The GPU side (the
route and collect kernels inside a replayed graph) is tested on the device:
tests/engine/test_decode_runner.py."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from engine.errors import EngineError
from engine.models import build_model
from engine.moe.hybrid import HybridExperts, HybridOptions
from engine.moe.mailbox import CPU, MAPPED, Mailbox
from engine.moe.token_step import TokenExperts

D, K = 4, 2


def play_gpu(mb: Mailbox, token: int, slots: list[list[int]], results: dict, delay_s: float = 0.01) -> threading.Thread:
    """Publishes each layer in turn as the route kernel does (the mailbox where a pair is left to
    the CPU, else the sequence number alone); where one is, waits for the host's flag and reads
    the weighted rows as the collect kernel does."""
    def run():
        for i, layer_slots in enumerate(slots):
            time.sleep(delay_s)  # the layers before this one
            if CPU in layer_slots:
                mb.box_x[i] = torch.arange(D, dtype=torch.float32) + i
                mb.box_ids[i] = torch.tensor([i + 1, i + 2], dtype=torch.int32)
                mb.box_w[i] = torch.tensor([0.25, 0.75])
                mb.box_slots[i] = torch.tensor(layer_slots, dtype=torch.int32)
                mb.box_cpu[i] = token
            mb.seq[i] = token  # the release store (relaxed where nothing else was written)
            if CPU in layer_slots:  # mapped pairs (MAPPED) are the GPU's own: no wait for them
                deadline = time.monotonic() + 5
                while mb.flag[i] < token and time.monotonic() < deadline:
                    pass
                results[i] = mb.box_out[i].clone()
    t = threading.Thread(target=run)
    t.start()
    return t


def test_the_host_answers_missed_pairs_and_works_between_layers():
    mb = Mailbox([1, 3, 5], n_expert=8, k=K, n_embd=D, device=torch.device("cpu"), with_mailbox=True)
    mb.token_no = 1
    calls, idle = [], []

    def compute(layer, x, experts):
        calls.append((layer, experts.tolist()))
        return np.stack([x[0] * (e + 1) for e in experts])

    def work() -> bool:
        idle.append(1)
        return len(idle) < 3  # three units of other work, then none

    results: dict = {}
    gpu = play_gpu(mb, 1, [[0, -1], [2, 3], [-1, -1]], results)
    mb.serve(compute, work)
    gpu.join()
    assert calls == [(1, [2]), (5, [3, 4])]  # the layer without a miss is not computed
    x0, x2 = np.arange(D) + 0.0, np.arange(D) + 2.0
    assert np.allclose(results[0][1].numpy(), x0 * 3 * 0.75)  # expert 2's row, times its weight
    assert np.allclose(results[2].numpy(), np.stack([x2 * 4 * 0.25, x2 * 5 * 0.75]))
    assert mb.flag.tolist() == [1, 0, 1] and len(idle) == 3


def test_the_host_computes_only_the_pairs_left_to_the_cpu():
    """Pairs the GPU reads from mapped host memory (MAPPED) are not the host's: a layer with one of
    each gets the CPU pair computed, a layer of mapped pairs only is not answered at all."""
    mb = Mailbox([1, 3], n_expert=8, k=K, n_embd=D, device=torch.device("cpu"), with_mailbox=True)
    mb.token_no = 1
    calls = []

    def compute(layer, x, experts):
        calls.append((layer, experts.tolist()))
        return np.stack([x[0] * (e + 1) for e in experts])

    results: dict = {}
    gpu = play_gpu(mb, 1, [[MAPPED, CPU], [MAPPED, MAPPED]], results)
    mb.serve(compute, lambda: False)
    gpu.join()
    assert calls == [(1, [2])]  # layer 1's second pair (expert 2) alone
    assert np.allclose(results[0][1].numpy(), (np.arange(D) + 0.0) * 3 * 0.75)
    assert mb.flag.tolist() == [1, 0]


def test_a_layer_with_nothing_for_the_cpu_is_not_served_from_an_earlier_tokens_mailbox():
    """Token 2's layers leave nothing to the CPU, so they publish their number alone: token 1's
    mailbox, still holding a CPU pair, is not answered again."""
    mb = Mailbox([1, 3], n_expert=8, k=K, n_embd=D, device=torch.device("cpu"), with_mailbox=True)
    calls = []

    def compute(layer, x, experts):
        calls.append((layer, experts.tolist()))
        return np.stack([x[0] * (e + 1) for e in experts])

    for token, slots in ((1, [[0, CPU], [2, 3]]), (2, [[0, 1], [2, MAPPED]])):
        mb.token_no = token
        gpu = play_gpu(mb, token, slots, {})
        mb.serve(compute, lambda: False)
        gpu.join()
    assert calls == [(1, [2])] and mb.flag.tolist() == [1, 0]


def test_a_failing_pool_releases_the_gpu_then_raises():
    mb = Mailbox([0, 1], n_expert=8, k=K, n_embd=D, device=torch.device("cpu"), with_mailbox=True)
    mb.token_no = 1

    def compute(layer, x, experts):
        raise RuntimeError("boom")

    results: dict = {}
    gpu = play_gpu(mb, 1, [[-1, 0], [-1, 1]], results)
    with pytest.raises(EngineError, match="CPU expert pool failed on layer 0: RuntimeError: boom"):
        mb.serve(compute, lambda: False)
    gpu.join()
    assert sorted(results) == [0, 1]  # every waiting layer was released


def test_a_gpu_that_never_arrives_is_an_error_not_a_hang():
    mb = Mailbox([0], n_expert=8, k=K, n_embd=D, device=torch.device("cpu"), with_mailbox=True)
    mb.token_no = 1
    start = time.monotonic()
    with pytest.raises(EngineError, match="did not reach MoE layer 0"):
        mb.serve(lambda *a: None, lambda: False, timeout_s=0.2)
    assert time.monotonic() - start < 2


def test_a_timed_out_wait_on_the_gpu_is_reported_after_the_token():
    mb = Mailbox([4, 9], n_expert=8, k=K, n_embd=D, device=torch.device("cpu"), with_mailbox=True)
    mb.check()
    mb.error[0] = 2  # the collect kernel of the second layer gave up
    with pytest.raises(EngineError, match="did not answer MoE layer 9"):
        mb.check()
    mb.check()  # reported once


@pytest.mark.parametrize("policy", ["lru", "occurrence", "off"])
def test_learning_from_the_gpu_counters(make_model, policy):
    """The counters a token leaves on the GPU reach the telemetry and the policy; refills land
    and the residency map (the GPU's table) follows the slots."""
    model = build_model(make_model("qwen3moe", QT.Q4_K))
    h = HybridExperts(model.expert_weights, "cpu", HybridOptions(slots_per_layer=2, miss_fraction=0.0,
                                                                policy=policy, threads=1))
    tx = TokenExperts(h, model.config.n_expert_used, model.config.n_embd)
    mb = tx.mailbox
    assert mb.with_mailbox  # the slots start empty
    for token in range(12):  # every token picks experts 3 and 5 in each layer, 7 on odd tokens
        chosen = [3, 5] + ([7] if token % 2 else [])
        for i, layer in enumerate(mb.layers):
            mb.stats[i, chosen] += 1
            mb.stats[i, mb.n_expert] += int((h.layers[layer].slots.resident[chosen] >= 0).sum())
        mb.snapshot_stats()
        for _ in tx._learning():  # what runs in the gaps of serving: decisions, no copy
            assert not any(h.layers[layer].slots.pending for layer in mb.layers)
        tx._start_refills()
        tx._push_map()
    c = h.counters
    assert (c.gpu_hit + c.cpu_computed == 12 * 2 + 6).all()
    assert (c.cpu_computed > 0).all() and (c.gpu_hit > 0).all()
    for i, layer in enumerate(mb.layers):
        resident = h.layers[layer].slots.resident
        assert sorted(np.flatnonzero(resident >= 0).tolist()) == [3, 5]  # the two free slots took the first misses
        assert np.array_equal(mb.map[i].numpy(), resident)
        assert np.array_equal(c.residency[i], resident)
    assert c.heat[:, 7].min() > 0 and c.heat[:, 0].max() == 0
    h.close()
