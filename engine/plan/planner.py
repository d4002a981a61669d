"""The memory plan: where each part of a model goes and how fast decoding can then be.

`make_plan(hardware, geometry, settings)` is pure arithmetic (no I/O, no torch), so the GUI
can re-price it live as the user moves a slider. Its JSON is what `moestudio plan --json`
prints and what the wizard shows. The settings are the engine's own (engine/config.Config).

Where the VRAM goes is engine/plan/sizing.place, the rule the engine sizes its expert cache
by, so the slots planned are the slots the engine makes. The decode speed is the rate the
engine measured on this machine for the same model and conditions when there is one
(engine/plan/measured.py, looked up by the caller), else an estimate with a range
(engine/plan/speed.py: the bytes a token reads over the measured bandwidths, plus the fixed
costs per layer measured for the engine that will run it).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from engine.config import Config
from engine.plan import speed
from engine.plan.geometry import KV_BYTES, Geometry
from engine.plan.measured import condition
from engine.plan.probe import GpuInfo, Hardware
from engine.plan.sizing import MIB, balanced_fraction, place, resolve_ctx, workspace_bytes

# 2: "options" hold the planner's assumptions only; staging and headroom sized as the engine does.
# 3: "decode speed" (measured, or an estimate with a range) replaces the "decode ceiling".
SCHEMA = 3
# Assumed bandwidths (GB/s), used when nothing better is known; each can be overridden.
DEFAULT_RAM_GBS = 40.0  # when not measured: dual-channel DDR4-3200 peaks at 51 GB/s; reads reach ~80% of it
PCIE_LANE_GBS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
DEFAULT_PCIE = (4, 16)  # generation, width when NVML cannot tell
ACHIEVED = 0.8  # share of a theoretical peak (VRAM, PCIe) that streaming kernels and copies reach
# Typical memory bandwidth by VRAM size when NVML cannot tell: (up to GiB, GB/s, example cards).
VRAM_CLASSES = ((8, 272, "RTX 4060"), (12, 360, "RTX 3060 12 GB"), (16, 448, "RTX 4060 Ti 16 GB / 5060 Ti"),
                (24, 936, "RTX 3090 / 4090"), (48, 864, "RTX A6000 / L40"), (1 << 20, 2000, "datacenter HBM"))


@dataclass(frozen=True)
class PlanOptions:
    """What the planner assumes beyond the user's settings (engine/config.Config)."""
    kv_type: str = "f32"  # the engine's KV cache is float32 (the exactness contract); llama.cpp's is f16
    vram_gbs: float | None = None
    ram_gbs: float | None = None
    pcie_gbs: float | None = None

    def __post_init__(self) -> None:
        if self.kv_type not in KV_BYTES:
            raise ValueError(f"kv_type must be one of {', '.join(KV_BYTES)}")


@dataclass
class PlanLine:
    name: str
    bytes: int | None  # None for lines that are not memory (threads, miss fraction, speed)
    where: str  # "gpu", "ram" or "-"
    explain: str
    value: float | int | None = None  # the line's figure when it is not bytes


@dataclass
class Plan:
    mode: str  # "gpu" or "cpu"
    lines: list[PlanLine]
    settings: dict[str, Any]  # what to pass to `moestudio serve` (config keys)
    expert_cache: dict[str, Any]
    decode: dict[str, Any]
    bandwidth_gbs: dict[str, Any]
    fits: bool
    warnings: list[str] = field(default_factory=list)

    def to_json(self, hardware: Hardware, geometry: Geometry, options: PlanOptions) -> dict[str, Any]:
        return {"schema": SCHEMA, "model": geometry.to_json(), "hardware": hardware.to_json(),
                "options": asdict(options), **asdict(self)}


def _vram_gbs(gpu: GpuInfo, override: float | None) -> tuple[float, str]:
    if override:
        return override, "given"
    if gpu.memory_bandwidth_gbs:
        return round(gpu.memory_bandwidth_gbs * ACHIEVED, 1), f"NVML peak {gpu.memory_bandwidth_gbs} GB/s x {ACHIEVED}"
    gib = gpu.total_bytes / (1 << 30)
    upto, gbs, cards = next(c for c in VRAM_CLASSES if gib <= c[0] + 0.5)
    return round(gbs * ACHIEVED, 1), f"assumed for a {upto} GiB-class GPU ({cards}: {gbs} GB/s) x {ACHIEVED}"


def _pcie_gbs(gpu: GpuInfo, override: float | None) -> tuple[float, str]:
    if override:
        return override, "given"
    known = gpu.pcie_generation in PCIE_LANE_GBS and gpu.pcie_width
    gen, width = (gpu.pcie_generation, gpu.pcie_width) if known else DEFAULT_PCIE
    what = "NVML" if known else "assumed"
    return round(PCIE_LANE_GBS[gen] * width * ACHIEVED, 1), f"{what} PCIe gen {gen} x{width} x {ACHIEVED}"


def _mib(n: int) -> str:
    return f"{n / MIB:,.0f} MiB" if n >= 100 * MIB else f"{n / MIB:,.1f} MiB"


def _decode(est: speed.DecodeEstimate, key: str, measured: dict[str, Any] | None,
            bytes_per_token: dict[str, int], hit_rate: float) -> tuple[PlanLine, dict[str, Any]]:
    """The decode speed line and JSON: the rate measured here under the same conditions when
    there is one, else the estimate (labelled so, with its range)."""
    got = (measured or {}).get(key)
    if got:
        n = len(got["rates"])
        figure, source = got["tokens_per_s"], "measured"
        explain = (f"measured on this machine: median of the last {n} generation{'s' * (n != 1)} with these "
                   f"settings; the {est.explain.split(':', 1)[0]} was {est.tokens_per_s:,.1f} "
                   f"({est.low:,.1f}-{est.high:,.1f})")
    else:
        figure, source = est.tokens_per_s, "estimate"
        explain = f"{est.explain} = {est.low:,.1f}-{est.high:,.1f} tok/s"
    line = PlanLine("decode speed", None, "-", explain, figure)
    return line, {"tokens_per_s": figure, "source": source, "estimate": est.to_json(),
                  "measured": {"tokens_per_s": got["tokens_per_s"], "rates": got["rates"]} if got else None,
                  "condition": key, "hit_rate_assumed": round(hit_rate, 4), "bytes_per_token": bytes_per_token}


def _fraction_line(engine: str, fraction: float | None, how: str) -> PlanLine:
    """The miss fraction the engine will use: what the wizard and Settings show beside "auto".
    Without a GPU the MoE Studio engine uses 0 (engine/moe/hybrid.attach_hybrid); llama.cpp has
    no such setting (None: it does not apply)."""
    if engine == "llamacpp":
        return PlanLine("miss fraction", None, "-", "does not apply: llama.cpp has no expert cache")
    if fraction is None:
        return PlanLine("miss fraction", None, "-", f"0: {how}", 0.0)
    return PlanLine("miss fraction", None, "-", "share of a prompt step's distinct misses uploaded to the GPU; the "
                    "rest run on the CPU (a decode token's misses all run on the CPU pool, inside its CUDA graph) "
                    f"({how})", fraction)


def _cpu_plan(hw: Hardware, g: Geometry, s: Config, o: PlanOptions, threads: int, ram: tuple[float, float, str],
              engine: str, measured: dict[str, Any] | None) -> Plan:
    ram_gbs, ram_gbs_1, ram_src = ram
    ctx = resolve_ctx(s.ctx, g.n_ctx_train)
    kv, work = g.kv_bytes(ctx, o.kv_type), workspace_bytes(g, ctx, s.prefill_chunk)
    est = speed.estimate_cpu(g, engine, threads, ram_gbs, ram_gbs_1, hw.cpu_simd)
    decode_line, decode = _decode(est, condition(engine, "cpu", threads, 0), measured,
                                  {"vram": 0, "pcie": 0, "ram": g.dense_bytes + g.active_expert_bytes}, 0.0)
    need = g.file_bytes + kv + work
    lines = [
        PlanLine("dense weights", g.dense_bytes, "ram", "attention, router, shared experts, norms and output head"),
        PlanLine("experts", g.experts_bytes_total, "ram", f"{len(g.moe_layers)} layers x {g.n_expert} experts, "
                 "memory-mapped from the GGUF file"),
        PlanLine("KV cache", kv, "ram", f"{ctx} tokens x {g.kv_bytes_per_token[o.kv_type]:,} bytes ({o.kv_type})"),
        PlanLine("compute workspace", work, "ram", f"estimate for a {s.prefill_chunk}-token prefill chunk"),
        PlanLine("CPU threads", None, "-", "one per physical core: the CPU pool is bound by memory bandwidth, "
                 "and hyper-threads only contend for it", threads),
        _fraction_line(engine, None, "no GPU to upload to: every miss runs on the CPU pool, whatever the setting"),
        decode_line,
    ]
    warnings = ["no NVIDIA GPU found: the engine runs on the CPU"]
    if need > hw.ram_available_bytes:
        warnings.append(f"the model needs {_mib(need)} but {_mib(hw.ram_available_bytes)} of RAM is available: "
                        "pages will be read from disk on every pass, which is many times slower")
    return Plan(mode="cpu", lines=lines, fits=need <= hw.ram_total_bytes, warnings=warnings,
                settings={"device": "cpu", "ctx": ctx, "threads": threads, "moe_expert_cache_size": 0},
                expert_cache={"slots_per_layer": 0, "bytes": 0, "resident_share": 0.0},
                decode=decode, bandwidth_gbs={"ram": ram_gbs, "ram_1_thread": ram_gbs_1, "sources": {"ram": ram_src}})


def _ram_gbs(hw: Hardware, o: PlanOptions) -> tuple[float, float, str]:
    """(all threads, one thread, where from): given, measured by the probe, or assumed."""
    if o.ram_gbs:
        return o.ram_gbs, o.ram_gbs, "given"
    if hw.ram_read_gbs:
        return (hw.ram_read_gbs, hw.ram_read_gbs_1 or hw.ram_read_gbs,
                f"measured: {hw.ram_read_gbs} GB/s on {hw.physical_cores} threads, {hw.ram_read_gbs_1} on one")
    return DEFAULT_RAM_GBS, DEFAULT_RAM_GBS, "assumed (dual-channel DDR4-3200 x 0.8)"


def make_plan(hw: Hardware, g: Geometry, s: Config = Config(), o: PlanOptions = PlanOptions(), *,
              engine: str = "hybrid", llama_gpu: bool = False, measured: dict[str, Any] | None = None) -> Plan:
    """The plan for settings `s` (the user's: `moestudio serve` takes the same) on machine `hw`,
    its decode speed for `engine` ("hybrid" or "llamacpp"; `llama_gpu`: llama.cpp is a GPU build)
    from `measured` (engine/plan/measured.load of the model) when it has these conditions."""
    threads = s.threads or hw.physical_cores
    ram = _ram_gbs(hw, o)
    ram_gbs, ram_gbs_1, ram_src = ram
    gpu = hw.gpu
    if gpu is None or (engine == "llamacpp" and not llama_gpu):
        return _cpu_plan(hw, g, s, o, threads, ram, engine, measured)
    vram_gbs, vram_src = _vram_gbs(gpu, o.vram_gbs)
    pcie_gbs, pcie_src = _pcie_gbs(gpu, o.pcie_gbs)
    if s.miss_fraction is None:
        # What the engine's measurement (engine/moe/tune.py) balances, from bandwidths instead of timings.
        fraction = balanced_fraction(upload_s=1 / pcie_gbs, cpu_s=1 / ram_gbs)
        fraction_how = (f"auto: estimated from {pcie_gbs} GB/s PCIe against {ram_gbs} GB/s RAM; the engine "
                        "measures its own at load")
    else:
        fraction, fraction_how = s.miss_fraction, "given"
    p = place(g, gpu.free_bytes, ctx=s.ctx, prefill_chunk=s.prefill_chunk,
              moe_expert_cache_size=s.moe_expert_cache_size, moe_expert_cache_mib=s.moe_expert_cache_mib,
              vram_budget_mib=s.vram_budget_mib, miss_fraction=fraction, kv_type=o.kv_type)
    slots, cache = p.slots_per_layer, p.cache_bytes
    share = slots / g.n_expert
    layer_bytes = g.n_expert * g.expert_bytes
    room = p.free_for_experts + p.staging_bytes  # llama.cpp stages nothing
    llama_fit = max(0, min(len(g.moe_layers), room // layer_bytes)) if layer_bytes else 0
    n_cpu_moe = 0 if llama_fit == len(g.moe_layers) else g.moe_layers[len(g.moe_layers) - llama_fit - 1] + 1
    if engine == "llamacpp":
        est = speed.estimate_llamacpp_gpu(g, n_cpu_moe, threads, vram_gbs, ram_gbs, ram_gbs_1)
        on_cpu = sum(1 for layer in g.moe_layers if layer < n_cpu_moe)
        key, hit = condition("llamacpp", "cuda", threads, n_cpu_moe), 1 - on_cpu / len(g.moe_layers)
    else:
        est = speed.estimate_hybrid_gpu(g, share, threads, vram_gbs, ram_gbs, ram_gbs_1)
        key, hit = condition("hybrid", "cuda", threads, slots), speed.skewed_hit_rate(share)
    hits = int(hit * g.active_expert_bytes)
    decode_line, decode = _decode(est, key, measured, {"vram": g.dense_bytes + hits, "pcie": 0,
                                                       "ram": g.active_expert_bytes - hits}, hit)
    lines = [
        PlanLine("dense weights", g.dense_bytes, "gpu", "attention, router, shared experts, norms and output head; "
                 "read by every token"),
        PlanLine("KV cache", p.kv_bytes, "gpu", f"{p.ctx} tokens x {g.kv_bytes_per_token[o.kv_type]:,} bytes "
                 f"({o.kv_type})"),
        PlanLine("compute workspace", p.workspace_bytes, "gpu", f"estimate: logits, activations and fused attention "
                 f"of a {s.prefill_chunk}-token prefill chunk"),
        PlanLine("upload staging", p.staging_bytes, "gpu", f"{p.staging_slots} "
                 f"slot{'s' * (p.staging_slots != 1)} shared by the layers for the misses a step uploads"),
        PlanLine("headroom", p.headroom_bytes, "gpu", "left free for the CUDA context, allocator and other programs "
                 "(1 GiB, or an eighth of a smaller budget)"),
        PlanLine("expert cache", cache, "gpu", f"{slots} of {g.n_expert} experts per layer x {len(g.moe_layers)} layers "
                 f"({share:.0%} resident; {_mib(g.expert_slot_bytes)} per expert in a slot)", slots),
        PlanLine("experts left in RAM", g.experts_bytes_total - slots * len(g.moe_layers) * g.expert_bytes, "ram",
                 "memory-mapped; computed by the CPU pool or uploaded when routed to"),
        PlanLine("token embeddings", g.embedding_bytes, "ram", "one row read per token: stays in RAM"),
        PlanLine("CPU threads", None, "-", "one per physical core for the CPU expert pool", threads),
        _fraction_line(engine, fraction, fraction_how),
        decode_line,
    ]
    warnings = []
    if p.free_for_experts < 0:
        warnings.append(f"dense weights, KV cache and workspace need {_mib(-p.free_for_experts)} more VRAM than the "
                        f"budget of {_mib(p.budget_bytes)}: lower -c, or run on the CPU (--device cpu)")
    elif cache > p.free_for_experts:
        warnings.append(f"the requested expert cache is {_mib(cache - p.free_for_experts)} larger than the VRAM left "
                        "for it")
    if g.experts_bytes_total - cache + g.embedding_bytes > hw.ram_available_bytes:
        warnings.append("the experts left in RAM exceed the available RAM: misses will page from disk")
    return Plan(
        mode="gpu", lines=lines, fits=p.fits, warnings=warnings,
        settings={"device": "cuda", "ctx": p.ctx, "threads": threads, "moe_expert_cache_size": slots,
                  "moe_gpu_miss_fraction": s.moe_gpu_miss_fraction, "n_cpu_moe": n_cpu_moe},
        expert_cache={"slots_per_layer": slots, "bytes": cache, "resident_share": round(share, 4),
                      "vram_budget_bytes": p.budget_bytes},
        decode=decode,
        bandwidth_gbs={"vram": vram_gbs, "pcie": pcie_gbs, "ram": ram_gbs, "ram_1_thread": ram_gbs_1,
                       "sources": {"vram": vram_src, "pcie": pcie_src, "ram": ram_src}},
    )
