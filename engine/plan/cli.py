"""`moestudio plan MODEL.gguf`: the memory plan for this machine (or an assumed GPU), as text or JSON."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from engine.config import add_arguments, flag, from_args
from engine.errors import UserError


# The settings a plan depends on: the same flags, names and checks as `moestudio serve`.
PLAN_SETTINGS = ("engine", "ctx", "threads", "prefill_chunk", "moe_expert_cache_size", "moe_expert_cache_mib",
                 "moe_gpu_miss_fraction", "vram_budget_mib")


def plan_device(device: str, hardware: object) -> str:
    """The device setting on the machine planned: auto is CUDA where the plan has a GPU."""
    return device if device != "auto" else ("cuda" if getattr(hardware, "gpu", None) else "cpu")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="propose a memory plan (expert cache, threads) for a model on this machine",
                       description="Reads the hardware (NVML, psutil) and the model's geometry and proposes where "
                       "each part goes, with the decode speed (measured here once the engine has run the model, else an "
                       "estimate with a range); the engine sizes its expert cache by "
                       "the same rule.")
    p.add_argument("model", nargs="?", help="GGUF model file (or `model` in --config/--preset)")
    add_arguments(p, PLAN_SETTINGS)
    p.add_argument("--json", action="store_true", help="print the plan as JSON (what the wizard shows)")
    p.add_argument("--kv-type", choices=("f16", "f32"), default="f32", help="KV cache type (engine: f32)")
    p.add_argument("--assume-gpu-mib", type=int, help="plan for a GPU with this much free VRAM instead of the "
                   "probed one (e.g. to compare cards)")
    for dev in ("vram", "ram", "pcie"):
        p.add_argument(f"--{dev}-gbs", type=float, help=f"{dev.upper()} bandwidth in GB/s instead of the assumption")
    p.set_defaults(run=run)


def run(args: argparse.Namespace, nvml: object = True) -> int:
    """`nvml` is the probe seam (tests pass a fake NVML module)."""
    from engine.gguf.fingerprint import file_fingerprint
    from engine.plan.geometry import read_geometry
    from engine.plan.measured import speed_inputs
    from engine.plan.planner import PlanOptions, make_plan
    from engine.plan.probe import GpuInfo, probe_hardware

    from engine.server.loader import choose_engine

    settings = from_args(args)
    if not settings.model:
        raise UserError("which model? give MODEL.gguf, or `model` in --config/--preset")
    hardware = probe_hardware(nvml)
    if args.assume_gpu_mib:
        gpu = GpuInfo(name=f"assumed GPU with {args.assume_gpu_mib} MiB", total_bytes=args.assume_gpu_mib << 20,
                      free_bytes=args.assume_gpu_mib << 20)
        hardware = replace(hardware, gpus=(gpu,))
    # The engine that would run on the machine planned (a GPU, probed or assumed, is a CUDA
    # machine); no plan for a model that neither engine can run: say why instead.
    kind, _reason = choose_engine(settings.model, settings.engine, plan_device(settings.device, hardware))
    geometry = read_geometry(settings.model)
    options = PlanOptions(kv_type=args.kv_type, vram_gbs=args.vram_gbs, ram_gbs=args.ram_gbs, pcie_gbs=args.pcie_gbs)
    speed = speed_inputs(file_fingerprint(settings.model), kind, hardware.gpu is not None)
    plan = make_plan(hardware, geometry, settings, options, **speed)
    if args.json:
        json.dump(plan.to_json(hardware, geometry, options), sys.stdout, indent=2)
        print()
        return 0
    gpu = hardware.gpu
    print(f"engine: {kind} ({_reason})")
    print(f"model: {geometry.name} ({geometry.arch}, {len(geometry.moe_layers)} MoE layers x {geometry.n_expert} "
          f"experts, {geometry.n_expert_used} active)")
    print(f"machine: {gpu.name + f', {gpu.free_bytes >> 20:,} MiB VRAM free' if gpu else 'no GPU'}; "
          f"{hardware.ram_available_bytes >> 20:,} MiB RAM available; {hardware.physical_cores} cores")
    for line in plan.lines:
        figure = (f"{line.bytes / (1 << 20):>10,.0f} MiB" if line.bytes is not None
                  else f"{'-' if line.value is None else line.value:>14}")
        print(f"  {line.name:<22}{figure}  {line.where:<4} {line.explain}")
    for warning in plan.warnings:
        print(f"warning: {warning}")
    print("serve with: " + " ".join(f"{flag(k)} {v}" for k, v in plan.settings.items()))
    return 0
