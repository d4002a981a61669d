"""Which engine runs a model (`--engine hybrid|llamacpp|auto`), and loading it from a Config."""
from __future__ import annotations

import logging
from dataclasses import dataclass
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


def choose_engine(path: str | Path, requested: str) -> tuple[str, str]:
    """(kind, reason). `auto` prefers the MoE Studio engine; `hybrid` on an unsupported model fails,
    and so does a model that neither engine can run, with llama.cpp's own reason."""
    from engine.baseline.llama_load import llamacpp_refusal
    from engine.gguf.check import open_model

    if requested == "llamacpp":
        refusal = llamacpp_refusal(path)
        if refusal:
            raise UserError(f"llama.cpp cannot run this model: {refusal}")
        return "llamacpp", "chosen with --engine llamacpp"
    mf = open_model(path)
    problem = unsupported_reason(mf)
    if problem:
        refusal = llamacpp_refusal(path)
        if refusal:
            raise UserError(f"neither engine can run this model: {problem}; llama.cpp: {refusal}")
    if requested == "hybrid":
        if problem:
            raise UserError(f"{problem}; use --engine llamacpp or auto")
        return "hybrid", "chosen with --engine hybrid"
    if problem:
        return "llamacpp", f"auto: {problem}"
    return "hybrid", f"auto: the MoE Studio engine supports {mf.arch} and every tensor type of this file"


def _threads(cfg: Config) -> int:
    import psutil

    return cfg.threads or psutil.cpu_count(logical=False) or psutil.cpu_count() or 1


def _hybrid(cfg: Config, progress: Progress):
    from engine.moe.hybrid import attach_hybrid
    from engine.runtime.engine import Engine, EngineConfig

    config = EngineConfig.from_settings(cfg, resolve_device(cfg.device), threads=_threads(cfg))
    return Engine.load(cfg.model, config, progress, attach_experts=attach_hybrid)


def _n_cpu_moe(cfg: Config) -> int:
    """--n-cpu-moe for a GPU build of llama.cpp: given, or from the memory plan's fit."""
    if cfg.n_cpu_moe != "auto":
        return int(cfg.n_cpu_moe)
    from engine.plan.geometry import read_geometry
    from engine.plan.planner import PlanOptions, make_plan
    from engine.plan.probe import probe_hardware

    plan = make_plan(probe_hardware(), read_geometry(cfg.model), cfg, PlanOptions(kv_type="f16"))
    return int(plan.settings.get("n_cpu_moe", 0))


def _llamacpp(cfg: Config, progress: Progress):
    from engine.baseline.llama_engine import LlamaEngine
    from engine.baseline.llama_load import llama_cpp

    gpu_build = bool(llama_cpp().llama_supports_gpu_offload())
    n_cpu_moe = _n_cpu_moe(cfg) if gpu_build else 0
    if gpu_build:
        log.info("llama.cpp GPU build: experts of the first %d layers stay on the CPU", n_cpu_moe)
    return LlamaEngine.load(cfg.model, n_ctx=cfg.ctx, threads=_threads(cfg), load_mode=cfg.load_mode,
                            n_cpu_moe=n_cpu_moe, progress=progress)


def load_engine(cfg: Config, progress: Progress) -> Loaded:
    progress("choosing the engine", 0.0)
    kind, reason = choose_engine(cfg.model, cfg.engine)
    log.info("engine: %s (%s)", kind, reason)
    from engine.gguf.reader import GGUFError

    try:
        engine = _hybrid(cfg, progress) if kind == "hybrid" else _llamacpp(cfg, progress)
    except GGUFError as e:  # e.g. a tensor the builder needs is missing: the file, not the server, is at fault
        raise UserError(f"cannot read the model: {e}") from None
    if cfg.engine == "auto" and kind == "hybrid":
        engine, kind, reason = _validated(cfg, engine, reason, progress)
    return Loaded(engine, kind, reason)


def _validated(cfg: Config, engine: Any, reason: str, progress: Progress) -> tuple[Any, str, str]:
    """auto never runs this engine on a file where it does not match llama.cpp: checked at the
    file's first load (engine/validate.first_load_check, cached), llama.cpp takes over if not."""
    from engine.validate import first_load_check

    progress("checking this engine against llama.cpp on this file (once per file)", 0.95)
    failure = first_load_check(cfg.model, engine.model, str(engine.model.device))
    if failure is None:
        return engine, "hybrid", f"{reason}; it matched llama.cpp on this file"
    log.warning("engine: %s; falling back to llama.cpp", failure)
    close = getattr(engine.model.experts, "close", None)
    if close is not None:
        close()
    del engine
    return _llamacpp(cfg, progress), "llamacpp", f"auto: {failure}"
