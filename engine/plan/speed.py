"""How fast a decode token can be on this machine: an estimate with a range, from the bytes a
token reads, the bandwidths that read them, and the fixed costs of each layer.

A token's time is the sum of (1) its weight reads: every dense weight and the selected experts
of every MoE layer, at the bandwidth of the memory each lives in (the RAM bandwidth the probe
measured, capped by what the kernels of one thread can consume; VRAM from NVML or the card's
class), and (2) what does not shrink with bytes: per layer the engine's op dispatch, kernel
launches and synchronisation, and on the GPU path each layer's round trip to the CPU pool for
its misses. The fixed costs are constants measured by the commands in docs/BENCHMARKS.md
("Decode speed estimates"), on two machines: the 2-core CI VM (CPU engines) and the H200
machine (GPU paths). Machines unlike those land elsewhere, hence a range rather than a promise;
once the engine has run a model here the measured rate replaces the estimate (engine/plan/measured.py).

Pure arithmetic (no torch, no I/O): the wizard re-prices it live.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.plan.geometry import Geometry

# --- the CPU engines, measured on the CI VM (2-core AMD EPYC with AVX2, 1 and 2 threads) ---
# Weight bytes one thread's kernels consume per second: ggml's quantized dot products
# (llama.cpp: 5.1-5.7 GB/s on the demo and a 4-layer Qwen3-30B-A3B; the hybrid engine's CPU
# expert pool) and torch's float32 products (the hybrid engine's dense layers on the CPU:
# ~6-7 GB/s). Below the one-thread RAM read there (~10 GB/s): a thread computes, not only reads.
CPU_THREAD_GBS = 6.0
# Fixed seconds per layer of a decode token: the hybrid engine's Python and torch dispatch of a
# decoder layer plus a CPU pool call (1.1-4 ms there, more on the demo than on the tiny model);
# llama.cpp's graph of a layer (too small to tell apart from its weight reads).
CPU_LAYER_S = {"hybrid": 2.5e-3, "llamacpp": 0.05e-3}
# A CPU with AVX-512 (ggml's wider kernels), measured on the CI kind with an AMD EPYC (Zen 4),
# scripts/check_decode_estimate.py: llama.cpp's one thread consumed 11.6 GB/s of weights on the
# demo and ~17 on the 4-layer Qwen3-30B-A3B; the hybrid engine's layers took ~1.4 ms of fixed
# time on the demo. The estimate takes these figures; its low end stays the AVX2 VM's, as
# AVX-512 CPUs of other makes were not measured.
CPU_THREAD_GBS_AVX512 = 12.0
CPU_LAYER_S_AVX512 = {"hybrid": 1.5e-3, "llamacpp": 0.05e-3}
# The demo and the 4-layer Qwen3-30B model measured within it on both engines, at 1 and 2
# threads, beside other work on the machine. A model whose weights fit the CPU's last-level
# cache (the 4 MiB test model) decodes faster on llama.cpp than RAM reads would allow.
CPU_RANGE = 2.0

# --- the GPU paths, measured on an NVIDIA H200 with 16 Xeon cores (session 5) ---
# Per layer of a decode token with every expert resident: the hybrid engine's CUDA graph
# (Qwen3-30B-A3B, 48 layers: 115.9 tok/s, of which 0.5 ms are weight reads); llama.cpp all on
# the GPU (241 tok/s on the same file).
GPU_LAYER_S = {"hybrid": 169e-6, "llamacpp": 75e-6}
# A layer whose token misses the expert cache waits for the CPU pool through the mailbox: a
# call wakes the pool's threads (~300 us in the graph decode: 13.3 ms over 33 calls of 1.6
# experts) and each missed expert adds its reads plus ~20 us (one-row pool calls: 89 us for one
# expert, +~54 us per extra 2.65 MB expert at 78 GB/s).
POOL_CALL_S = 300e-6
MISS_EXTRA_S = 20e-6
# Real text routes unevenly: a cache holding the hottest experts catches most of what uniform
# routing would miss (hits 74-98% at 25-60% of the experts resident, docs/BENCHMARKS.md). The
# estimate assumes it catches this share of them; uniform routing (hit rate = resident share)
# is the low end.
SKEWED_CATCH = 0.7
GPU_RANGE = 1.5  # fixed costs from one machine; the hit rate of a given text is not known ahead


def skewed_hit_rate(share: float) -> float:
    """The hit rate the estimate assumes with `share` of each layer's experts resident."""
    return share + (1 - share) * SKEWED_CATCH


@dataclass(frozen=True)
class DecodeEstimate:
    tokens_per_s: float  # the estimate
    low: float  # the range it gives
    high: float
    seconds: dict[str, float]  # where the estimated token's time goes
    explain: str

    def to_json(self) -> dict[str, Any]:
        return {"tokens_per_s": self.tokens_per_s, "low": self.low, "high": self.high,
                "seconds": {k: round(v, 6) for k, v in self.seconds.items()}, "explain": self.explain}


def cpu_gbs(threads: int, ram_gbs: float, ram_gbs_1: float, thread_gbs: float = CPU_THREAD_GBS) -> float:
    """Weight bytes per second `threads` CPU threads consume: each as fast as its kernels compute
    (`thread_gbs`, or as one thread reads, if that is slower), all together at most the RAM
    bandwidth."""
    return min(ram_gbs, threads * min(ram_gbs_1, thread_gbs))


def _mib(n: float) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


def _rates(t: float, t_low: float, t_high: float, factor: float) -> tuple[float, float, float]:
    return round(1 / t, 1), round(1 / (t_low * factor), 1), round(factor / t_high, 1)


def estimate_cpu(g: Geometry, engine: str, threads: int, ram_gbs: float, ram_gbs_1: float,
                 simd: str | None = None) -> DecodeEstimate:
    """Every weight in RAM, read by `threads` CPU threads (llama.cpp's CPU build, or this engine
    without a GPU: its dense weights then float32, its experts through ggml); `simd`: the CPU's
    widest vector extension (probe.cpu_simd), "avx512" taking that kind's measured figures."""
    dense = g.dense_values * 4 if engine == "hybrid" and g.dense_values else g.dense_bytes
    wide = simd == "avx512"

    def seconds(thread_gbs: float, layer_s: dict[str, float]) -> tuple[float, float, float]:
        """(GB/s the threads consume, weight seconds, fixed seconds) of a token."""
        gbs = cpu_gbs(threads, ram_gbs, ram_gbs_1, thread_gbs)
        return gbs, (dense + g.active_expert_bytes) / (gbs * 1e9), g.n_layer * layer_s[engine]

    reference = seconds(CPU_THREAD_GBS, CPU_LAYER_S)
    gbs, t_weights, t_fixed = seconds(CPU_THREAD_GBS_AVX512, CPU_LAYER_S_AVX512) if wide else reference
    t = t_weights + t_fixed
    tps, low, high = _rates(t, reference[1] + reference[2], t, CPU_RANGE)
    what = "float32 dense" if engine == "hybrid" else "dense"
    kind = "AVX-512, measured on a Zen 4 VM; the low end the AVX2 VM's" if wide else "measured on a 2-core VM"
    return DecodeEstimate(tps, low, high, {"weights": t_weights, "fixed": t_fixed}, (
        f"estimate: {what} {_mib(dense)} + experts {_mib(g.active_expert_bytes)} a token at {gbs:.1f} GB/s "
        f"({threads} thread{'s' * (threads != 1)}) = {t_weights * 1e3:.2f} ms, plus {g.n_layer} layers x "
        f"{t_fixed / g.n_layer * 1e3:g} ms fixed ({kind}); range x/{CPU_RANGE:g}..x{CPU_RANGE:g}"))


def estimate_hybrid_gpu(g: Geometry, share: float, threads: int, vram_gbs: float, ram_gbs: float,
                        ram_gbs_1: float) -> DecodeEstimate:
    """This engine with `share` of each layer's experts in VRAM: a decode token is one CUDA graph;
    its hits read VRAM, its misses are computed by the CPU pool while the graph waits."""
    k, n_moe = g.n_expert_used, len(g.moe_layers)
    per_expert = g.expert_bytes / (cpu_gbs(threads, ram_gbs, ram_gbs_1) * 1e9) + MISS_EXTRA_S

    def seconds(hit: float) -> dict[str, float]:
        misses = k * (1 - hit)  # per MoE layer
        return {"gpu weights": (g.dense_bytes + hit * g.active_expert_bytes) / (vram_gbs * 1e9),
                "fixed": g.n_layer * GPU_LAYER_S["hybrid"],
                "cpu misses": n_moe * ((1 - hit ** k) * POOL_CALL_S + misses * per_expert)}

    uniform, skewed = share, skewed_hit_rate(share)
    s_est, s_low = seconds(skewed), seconds(uniform)
    tps, low, high = _rates(sum(s_est.values()), sum(s_low.values()), sum(s_est.values()), GPU_RANGE)
    return DecodeEstimate(tps, low, high, s_est, (
        f"estimate at {skewed:.0%} hits (real text routes unevenly; {uniform:.0%} if it were uniform: the low end): "
        f"dense {_mib(g.dense_bytes)} + hits at {vram_gbs:g} GB/s VRAM, {g.n_layer} layers x "
        f"{GPU_LAYER_S['hybrid'] * 1e6:.0f} us fixed, {k * (1 - skewed):.1f} misses a layer on the CPU pool "
        f"({per_expert * 1e6:.0f} us each, {POOL_CALL_S * 1e6:.0f} us a call); fixed costs measured on an H200"))


def estimate_llamacpp_gpu(g: Geometry, n_cpu_moe: int, threads: int, vram_gbs: float, ram_gbs: float,
                          ram_gbs_1: float) -> DecodeEstimate:
    """A GPU build of llama.cpp: every weight on the GPU but the experts of the first `n_cpu_moe`
    layers, which its CPU threads compute from RAM."""
    per_layer = g.n_expert_used * g.expert_bytes
    cpu_layers = sum(1 for layer in g.moe_layers if layer < n_cpu_moe)
    s = {"gpu weights": (g.dense_bytes + (len(g.moe_layers) - cpu_layers) * per_layer) / (vram_gbs * 1e9),
         "cpu experts": cpu_layers * per_layer / (cpu_gbs(threads, ram_gbs, ram_gbs_1) * 1e9),
         "fixed": g.n_layer * GPU_LAYER_S["llamacpp"]}
    t = sum(s.values())
    tps, low, high = _rates(t, t, t, GPU_RANGE)
    return DecodeEstimate(tps, low, high, s, (
        f"estimate for llama.cpp with the experts of {cpu_layers} layers on the CPU: {_mib(cpu_layers * per_layer)} "
        f"a token from RAM, the rest at {vram_gbs:g} GB/s VRAM, {g.n_layer} layers x "
        f"{GPU_LAYER_S['llamacpp'] * 1e6:.0f} us fixed (measured on an H200); range x/{GPU_RANGE:g}..x{GPU_RANGE:g}"))
