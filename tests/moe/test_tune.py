"""Routing misses by measured cost: the split of a many-row step, and the timings it starts from."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from engine.models import build_model
from engine.moe.cpu_pool import CpuExpertPool
from engine.moe.tune import (STREAM_ALL_PAIRS_PER_EXPERT, RouteCosts, balanced_uploads, many_pairs, mapped_misses,
                              measure_costs, read_back_seconds, route_costs, streaming_pays, streams_all)
from engine.runtime.device_time import accelerator_seconds


def test_equal_costs_split_the_misses_in_half():
    assert balanced_uploads(np.ones(4), 0, RouteCosts(upload_s=1, cpu_s=1, cpu_row_s=0, gpu_s=0)) == 2


def test_costly_uploads_leave_every_miss_to_the_cpu_and_free_ones_take_all():
    rows = np.array([9, 3, 1])
    assert balanced_uploads(rows, 0, RouteCosts(upload_s=100, cpu_s=1, cpu_row_s=1, gpu_s=0)) == 0
    assert balanced_uploads(rows, 0, RouteCosts(upload_s=0, cpu_s=1, cpu_row_s=1, gpu_s=0)) == 3


def test_the_miss_with_many_rows_goes_up_and_the_single_rows_stay():
    # CPU costs 10, 1, 1, 1 against an upload of 3: uploading the first halves the step.
    costs = RouteCosts(upload_s=3, cpu_s=1, cpu_row_s=1, gpu_s=0)
    assert balanced_uploads(np.array([10, 1, 1, 1]), 0, costs) == 1


def test_the_gpu_side_counts_its_hits_and_its_compute():
    rows = np.array([10, 1, 1, 1])
    # busy with hits for as long as the CPU needs for everything: nothing goes up
    assert balanced_uploads(rows, 13, RouteCosts(upload_s=0, cpu_s=1, cpu_row_s=1, gpu_s=1)) == 0
    # compute slower than the copy: a streamed miss costs its compute (4), still worth it once
    assert balanced_uploads(rows, 0, RouteCosts(upload_s=0, cpu_s=1, cpu_row_s=1, gpu_s=4)) == 1


def test_a_step_streams_every_missing_expert_once_each_is_all_but_certain_to_be_chosen():
    costs = RouteCosts(upload_s=60e-6, cpu_s=120e-6, cpu_row_s=15e-6, gpu_s=16e-6)  # the H200's, Qwen3-30B-A3B
    # 128 experts, top-8: from 64 rows on every expert is chosen with probability > 1 - e^-4
    n = STREAM_ALL_PAIRS_PER_EXPERT * 128 // 8
    assert not streams_all(n - 1, 8, 128, costs) and streams_all(n, 8, 128, costs) and streams_all(4096, 8, 128, costs)
    # a stream that costs more than the CPU pool's FFN over an expert's rows: the routing decides
    assert not streams_all(n, 8, 128, RouteCosts(upload_s=1e-3, cpu_s=120e-6, cpu_row_s=15e-6, gpu_s=16e-6))


def test_streaming_pays_while_the_step_uses_the_experts_it_would_copy():
    costs = RouteCosts(upload_s=60e-6, cpu_s=150e-6, cpu_row_s=13e-6, gpu_s=16e-6)  # the H200's, Qwen3-30B-A3B
    assert many_pairs(512, 128) and not many_pairs(511, 128)
    # 8 GiB, a 512-row chunk, 41 resident experts in use and 87 missing (5.2 ms of copies):
    # a new text's chunk uses nearly all of them, dozens of rows each: read back, the GPU would
    # take the heavy ones up one by one after an idle of 0.2 ms (5.2 ms): streaming wins
    new_text = np.zeros(87)
    new_text[:80] = 40
    assert read_back_seconds(new_text[:80], 41, costs) == pytest.approx(41 * 16e-6 + 73 * 60e-6)  # 73 go up
    assert streaming_pays(87, new_text, 41, costs, 0.2e-3)
    # a chunk that uses fewer of them (50): their uploads and the CPU pool's share take 3.4 ms
    half = np.zeros(87)
    half[:50] = 40
    assert not streaming_pays(87, half, 41, costs, 0.2e-3)
    assert streaming_pays(87, half, 41, costs, 2e-3)  # unless the read-back idles the GPU longer
    # the residency adapted to the text: a few rows on a handful of the missing ones: read back
    adapted = np.zeros(87)
    adapted[:6] = 3
    assert read_back_seconds(adapted[:6], 41, costs) < 1e-3
    assert not streaming_pays(87, adapted, 41, costs, 1.5e-3)
    # 16 GiB: 19 missing copy in 1.1 ms, hidden behind the compute of the 109 resident ones
    assert streaming_pays(19, np.zeros(19), 109, costs, 0.0)


def test_measured_on_the_model_the_times_are_positive_and_the_fraction_between(tiny):
    model = build_model(tiny)
    layer = min(model.expert_weights)
    pool = CpuExpertPool(model.expert_weights, 1)
    try:
        t = measure_costs(layer, model.expert_weights[layer], torch.device("cpu"), pool)
    finally:
        pool.close()
    assert t["upload_s"] > 0 and t["stream_s"] > 0 and t["cpu_s"] > 0 and t["cpu_row_s"] >= 0 and t["gpu_s"] > 0
    assert 0 < t["fraction"] < 1
    assert t["cpu_expert_s"] >= 0 and t["mapped_s"] == 0  # no GPU: no mapped route
    costs = route_costs(t)  # a prompt streams its uploads: their back-to-back cost routes it
    assert (costs.upload_s, costs.cpu_s, costs.gpu_s) == (t["stream_s"], t["cpu_s"], t["gpu_s"])
    assert (costs.cpu_expert_s, costs.mapped_s) == (t["cpu_expert_s"], 0.0)
    assert not mapped_misses(8, costs).any()


def test_mapped_misses_split_a_layer_between_the_gpu_and_the_pool():
    """The H200's measured costs (Qwen3-30B-A3B Q4_K, session 26): a mapped read 137 µs, the
    pool 89 µs for one expert and 50 µs for each further one. One miss stays on the CPU;
    from two on, the first go mapped while the pool takes the rest (never all of them)."""
    costs = RouteCosts(upload_s=57e-6, cpu_s=89e-6, cpu_row_s=13e-6, gpu_s=16e-6, cpu_expert_s=50e-6,
                       mapped_s=137e-6)
    table = mapped_misses(8, costs)
    assert table.dtype == np.int32 and table.shape == (9,)
    assert table.tolist() == [0, 0, 1, 1, 1, 1, 2, 2, 2]
    for m, j in enumerate(table):  # no other split of m misses finishes sooner
        best = min(max(i * costs.mapped_s, costs.cpu_experts(m - i)) for i in range(m + 1))
        assert max(j * costs.mapped_s, costs.cpu_experts(m - j)) == best
    # a slow link: never; a slow pool: every miss mapped once the pool's side costs more
    assert not mapped_misses(8, RouteCosts(0, 89e-6, 0, 0, 50e-6, 2e-3)).any()
    assert mapped_misses(4, RouteCosts(0, 1e-3, 0, 0, 1e-3, 1e-6)).tolist() == [0, 1, 2, 3, 4]
    assert not mapped_misses(8, None).any()


def test_off_cuda_the_device_time_is_the_wall_time():
    assert accelerator_seconds(lambda: time.sleep(0.01), 3, torch.device("cpu")) >= 0.03


@pytest.mark.gpu
def test_the_device_time_leaves_the_launching_host_out():
    """A step's host work overlaps the layers before it: what an expert costs a prompt step is
    its kernels' time. Host sleeps between tiny kernels do not count; the kernels all ran."""
    x = torch.zeros(1024, device="cuda")

    def step() -> None:
        time.sleep(0.002)
        x.add_(1)
    assert accelerator_seconds(step, 4, torch.device("cuda")) < 0.002
    assert x[0].item() == 4


@pytest.mark.gpu
def test_the_mapped_route_is_timed_and_checked_at_load_on_pinned_experts(tiny, monkeypatch):
    """Experts in pinned RAM on CUDA: the mapped read is timed (and agreed with the CPU pool's
    result, or it would be 0); in the memory map, or with MOESTUDIO_MAPPED_MISSES=0, it is not."""
    from engine.moe.slots import resident_copies

    model = build_model(tiny, "cuda")
    layer = min(model.expert_weights)
    pinned = resident_copies(model.expert_weights, pin=True)
    pool = CpuExpertPool(pinned, 2)
    try:
        t = measure_costs(layer, pinned[layer], torch.device("cuda"), pool)
        assert t["mapped_s"] > 0 and t["cpu_expert_s"] >= 0
        assert measure_costs(layer, model.expert_weights[layer], torch.device("cuda"), pool)["mapped_s"] == 0
        monkeypatch.setenv("MOESTUDIO_MAPPED_MISSES", "0")
        assert measure_costs(layer, pinned[layer], torch.device("cuda"), pool)["mapped_s"] == 0
    finally:
        pool.close()
