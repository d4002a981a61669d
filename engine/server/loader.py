"""Which engine runs a model (`--engine hybrid|llamacpp|auto`), and loading it from a Config."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from engine.config import Config, resolve_device
from engine.errors import UserError

if TYPE_CHECKING:
    from engine.gguf.reader import ModelFile

log = logging.getLogger("moestudio.server")
Progress = Callable[[str, float], None]


@dataclass
class Loaded:
    engine: Any  # engine.runtime.engine.Engine or engine.baseline.llama_engine.LlamaEngine
    kind: str  # "hybrid" or "llamacpp"
    reason: str
    # What the engine runs with, under config.Config's field names: a setting on auto (or out of
    # the model's range, like a context above its training length) next to the value it became.
    effective: dict[str, Any] = field(default_factory=dict)


def unsupported_reason(mf: ModelFile) -> str | None:
    """Why the MoE Studio engine cannot compute this file, or None when it can."""
    from engine.models import UnsupportedArchitecture, check_architecture
    from engine.quant.dequant import SUPPORTED_TYPES

    try:
        check_architecture(mf.arch)
    except UnsupportedArchitecture as e:
        return str(e)
    bad = sorted({t.qtype.name for t in mf.tensors.values() if t.qtype not in SUPPORTED_TYPES})
    if bad:
        return f"quantization type(s) {', '.join(bad)} are not supported by the MoE Studio engine"
    per_layer = [s for s in ("attention.head_count", "attention.head_count_kv") if isinstance(mf.arch_key(s, 0), list)]
    if per_layer:
        return f"per-layer {mf.arch}.{per_layer[0]} is not supported by the MoE Studio engine"
    return None


# Why `--engine auto` runs llama.cpp on a machine without CUDA: the expert cache, which is what
# this engine adds, needs a GPU; on the CPU alone llama.cpp's kernels are several times faster
# (the demo model on 2 cores: 615 tok/s against 81 with --engine hybrid).
AUTO_CPU_REASON = ("auto: no CUDA GPU here; llama.cpp is faster on the CPU alone "
                   "(--engine hybrid runs the MoE Studio engine anyway)")


def choose_engine(path: str | Path, requested: str, device: str) -> tuple[str, str]:
    """(kind, reason): the one decision of which engine runs `path` on `device` (a torch device
    name, e.g. from config.resolve_device). `auto` takes llama.cpp without CUDA (AUTO_CPU_REASON);
    with CUDA it prefers the MoE Studio engine (load_engine then checks it against llama.cpp at the
    file's first load). `hybrid` on an unsupported model fails, and so does a model that neither
    engine can run, with llama.cpp's own reason."""
    from engine.baseline.llama_load import llamacpp_refusal
    from engine.gguf.check import open_model

    if requested == "llamacpp":
        refusal = llamacpp_refusal(path)
        if refusal:
            raise UserError(f"llama.cpp cannot run this model: {refusal}")
        return "llamacpp", "chosen with --engine llamacpp"
    mf = open_model(path)
    problem = unsupported_reason(mf)
    refusal = llamacpp_refusal(path) if problem or (requested == "auto" and not is_cuda(device)) else None
    if problem and refusal:
        raise UserError(f"neither engine can run this model: {problem}; llama.cpp: {refusal}")
    if requested == "hybrid":
        if problem:
            raise UserError(f"{problem}; use --engine llamacpp or auto")
        return "hybrid", "chosen with --engine hybrid"
    if problem:
        return "llamacpp", f"auto: {problem}"
    if not is_cuda(device):
        if refusal:  # a file llama.cpp refuses but this engine runs: it runs here, slower
            return "hybrid", f"auto: no CUDA GPU here, but llama.cpp cannot run this model ({refusal})"
        return "llamacpp", AUTO_CPU_REASON
    return "hybrid", f"auto: the MoE Studio engine supports {mf.arch} and every tensor type of this file"


def is_cuda(device: str) -> bool:
    return device == "cuda" or device.startswith("cuda:")


def _threads(cfg: Config) -> int:
    import psutil

    return cfg.threads or psutil.cpu_count(logical=False) or psutil.cpu_count() or 1


def load_hybrid(cfg: Config, progress: Progress) -> tuple[Any, dict[str, Any]]:
    from engine.moe.hybrid import attach_hybrid
    from engine.runtime.engine import Engine, EngineConfig

    config = EngineConfig.from_settings(cfg, resolve_device(cfg.device), threads=_threads(cfg))
    engine = Engine.load(cfg.model, config, progress, attach_experts=attach_hybrid)
    effective: dict[str, Any] = {"engine": "hybrid", "ctx": engine.n_ctx, "threads": config.threads,
                                 "device": str(engine.model.device)}
    cache = engine.telemetry.cache
    if cache is not None:
        effective.update(moe_expert_cache_size=cache.slots_per_layer, moe_gpu_miss_fraction=cache.miss_fraction,
                         load_mode=cache.load_mode, decode_miss_routes=cache.miss_routes)
    return engine, effective


def _n_cpu_moe(cfg: Config) -> int:
    """--n-cpu-moe for a GPU build of llama.cpp: given, or from the memory plan's fit."""
    if cfg.n_cpu_moe != "auto":
        return int(cfg.n_cpu_moe)
    from engine.plan.geometry import read_geometry
    from engine.plan.planner import PlanOptions, make_plan
    from engine.plan.probe import probe_hardware

    plan = make_plan(probe_hardware(bandwidth=False), read_geometry(cfg.model), cfg, PlanOptions(kv_type="f16"))
    return int(plan.settings.get("n_cpu_moe", 0))


def load_llamacpp(cfg: Config, progress: Progress) -> tuple[Any, dict[str, Any]]:
    from engine.baseline.llama_engine import LlamaEngine
    from engine.baseline.llama_load import llama_cpp
    from engine.gguf.reader import ModelFile
    from engine.plan.sizing import resolve_ctx

    gpu_build = bool(llama_cpp().llama_supports_gpu_offload())
    n_cpu_moe = _n_cpu_moe(cfg) if gpu_build else 0
    if gpu_build:
        log.info("llama.cpp GPU build: experts of the first %d layers stay on the CPU", n_cpu_moe)
    # The same context rule as the MoE Studio engine (0: the training length; more is capped to
    # it), so /health's n_ctx means the same on both engines.
    n_ctx_train = int(ModelFile.open(Path(cfg.model)).arch_key("context_length", 0))
    n_ctx = resolve_ctx(cfg.ctx, n_ctx_train) if n_ctx_train > 0 else cfg.ctx
    threads = _threads(cfg)
    engine = LlamaEngine.load(cfg.model, n_ctx=n_ctx, threads=threads, load_mode=cfg.load_mode,
                              n_cpu_moe=n_cpu_moe, prefill_chunk=cfg.prefill_chunk, progress=progress)
    return engine, {"engine": "llamacpp", "ctx": engine.n_ctx, "threads": threads,
                    "device": "cuda" if gpu_build else "cpu", "n_cpu_moe": n_cpu_moe,
                    "load_mode": "none" if cfg.load_mode == "none" else "mmap"}


def load_engine(cfg: Config, progress: Progress) -> Loaded:
    progress("choosing the engine", 0.0)
    device = resolve_device(cfg.device)
    kind, reason = choose_engine(cfg.model, cfg.engine, device)
    log.info("engine: %s (%s)", kind, reason)
    from engine.gguf.reader import GGUFError

    try:
        engine, effective = load_hybrid(cfg, progress) if kind == "hybrid" else load_llamacpp(cfg, progress)
    except GGUFError as e:  # e.g. a tensor the builder needs is missing: the file, not the server, is at fault
        raise UserError(f"cannot read the model: {e}") from None
    loaded = Loaded(engine, kind, reason, effective)
    if cfg.engine == "auto" and kind == "hybrid" and is_cuda(device):
        loaded = validated(cfg, loaded, progress)
    return loaded


def validated(cfg: Config, loaded: Loaded, progress: Progress) -> Loaded:
    """auto never runs this engine on a file where it does not match llama.cpp: checked at the
    file's first load (engine/validate.first_load_check, cached), llama.cpp takes over if not.
    load_engine calls it for auto on CUDA, the one place auto chooses this engine on its own."""
    from engine.validate import first_load_check

    progress("checking this engine against llama.cpp on this file (once per file)", 0.95)
    engine = loaded.engine
    failure = first_load_check(cfg.model, engine.model, str(engine.model.device))
    if failure is None:
        return Loaded(engine, "hybrid", f"{loaded.reason}; it matched llama.cpp on this file", loaded.effective)
    log.warning("engine: %s; falling back to llama.cpp", failure)
    close = getattr(engine.model.experts, "close", None)
    if close is not None:
        close()
    del engine, loaded
    engine, effective = load_llamacpp(cfg, progress)
    return Loaded(engine, "llamacpp", f"auto: {failure}", effective)
