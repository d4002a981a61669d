"""`moestudio plan MODEL.gguf`: the memory plan for this machine (or an assumed GPU), as text or JSON."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from engine.errors import UserError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="propose a memory plan (expert cache, threads) for a model on this machine",
                       description="Reads the hardware (NVML, psutil) and the model's geometry and proposes where "
                       "each part goes, with the predicted decode ceiling.")
    p.add_argument("model", type=Path, help="GGUF model file")
    p.add_argument("-c", "--ctx", type=int, help="context length to plan for (default: 4096, or the model's "
                   "training context if shorter; the server does the same)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (what the wizard shows)")
    p.add_argument("--vram-budget-mib", type=int, help="use at most this much VRAM")
    p.add_argument("--kv-type", choices=("f16", "f32"), default="f32", help="KV cache type (engine: f32)")
    p.add_argument("--moe-expert-cache-size", help="expert slots per layer: N, all or auto (default)")
    p.add_argument("--moe-expert-cache-mib", type=int, help="expert cache in MiB")
    p.add_argument("--moe-gpu-miss-fraction", type=float, help="share of misses uploaded (default 0.17)")
    p.add_argument("-t", "--threads", type=int, help="CPU threads (default: physical cores)")
    p.add_argument("--assume-gpu-mib", type=int, help="plan for a GPU with this much free VRAM instead of the "
                   "probed one (e.g. to compare cards)")
    for dev in ("vram", "ram", "pcie"):
        p.add_argument(f"--{dev}-gbs", type=float, help=f"{dev.upper()} bandwidth in GB/s instead of the assumption")
    p.set_defaults(run=run)


def _options(args: argparse.Namespace, ctx: int):
    from engine.config import Config
    from engine.plan.planner import DEFAULT_MISS_FRACTION, PlanOptions

    cfg = Config(ctx=ctx, moe_expert_cache_size=args.moe_expert_cache_size or "auto",
                 moe_expert_cache_mib=args.moe_expert_cache_mib, vram_budget_mib=args.vram_budget_mib,
                 threads=args.threads, moe_gpu_miss_fraction=(DEFAULT_MISS_FRACTION if args.moe_gpu_miss_fraction
                                                              is None else args.moe_gpu_miss_fraction))
    return PlanOptions(ctx=cfg.ctx, kv_type=args.kv_type, vram_budget_mib=cfg.vram_budget_mib,
                       expert_cache_size=cfg.moe_expert_cache_size, expert_cache_mib=cfg.moe_expert_cache_mib,
                       miss_fraction=cfg.miss_fraction, threads=cfg.threads, vram_gbs=args.vram_gbs,
                       ram_gbs=args.ram_gbs, pcie_gbs=args.pcie_gbs)


def run(args: argparse.Namespace, nvml: object = True) -> int:
    """`nvml` is the probe seam (tests pass a fake NVML module)."""
    from engine.plan.geometry import read_geometry
    from engine.plan.planner import make_plan
    from engine.plan.probe import GpuInfo, probe_hardware

    from engine.server.loader import choose_engine

    choose_engine(args.model, "auto")  # no plan for a model that neither engine can run: say why instead
    geometry = read_geometry(args.model)
    hardware = probe_hardware(nvml)
    if args.assume_gpu_mib:
        gpu = GpuInfo(name=f"assumed GPU with {args.assume_gpu_mib} MiB", total_bytes=args.assume_gpu_mib << 20,
                      free_bytes=args.assume_gpu_mib << 20)
        hardware = replace(hardware, gpus=(gpu,))
    if args.ctx is not None and args.ctx > geometry.n_ctx_train:
        raise UserError(f"--ctx {args.ctx} exceeds the model's training context {geometry.n_ctx_train}")
    options = _options(args, args.ctx or min(4096, geometry.n_ctx_train))
    plan = make_plan(hardware, geometry, options)
    if args.json:
        json.dump(plan.to_json(hardware, geometry, options), sys.stdout, indent=2)
        print()
        return 0
    gpu = hardware.gpu
    print(f"model: {geometry.name} ({geometry.arch}, {len(geometry.moe_layers)} MoE layers x {geometry.n_expert} "
          f"experts, {geometry.n_expert_used} active)")
    print(f"machine: {gpu.name + f', {gpu.free_bytes >> 20:,} MiB VRAM free' if gpu else 'no GPU'}; "
          f"{hardware.ram_available_bytes >> 20:,} MiB RAM available; {hardware.physical_cores} cores")
    for line in plan.lines:
        figure = f"{line.bytes / (1 << 20):>10,.0f} MiB" if line.bytes is not None else f"{line.value:>14}"
        print(f"  {line.name:<22}{figure}  {line.where:<4} {line.explain}")
    for warning in plan.warnings:
        print(f"warning: {warning}")
    print("serve with: " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in plan.settings.items()))
    return 0
