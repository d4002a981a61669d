"""`moestudio bench scenarios`: the speed sweep of docs/BENCHMARKS.md in one command.

Each scenario is a factory geometry with a routing setting at VRAM budgets; every budget runs
this engine (hybrid at the budget, and all-resident) and llama.cpp (the best --n-cpu-moe split
that fits, and all experts on the GPU) on the same file and token stream (engine/bench/speed.py);
the first scenario also runs the hybrid with --load-mode mmap.

Phases, so the slow parts can overlap on the device: `write` (the models, in parallel
processes), `engine`, `llama` (needs a CUDA llama-cpp-python, MOESTUDIO_LLAMA_SITE), `report`
(the markdown table). Results accumulate in DIR/results.json.

A shortened model (fewer layers than the geometry, when disk or time force it) gets a budget
that leaves its experts the same share as the full model's budget would:
  budget = layer dense x L + other dense + (full budget - full dense) x L / N.
"""
from __future__ import annotations

import argparse
import json
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from engine.bench.speed import add_ctx_argument, add_long_argument
from engine.config import resolve_device

MiB = 2**20


@dataclass(frozen=True)
class Scenario:
    geometry: str  # engine/synth preset
    routing: str
    budgets_gib: tuple[int, ...]
    layers: int | None = None  # None: the geometry's own

    @property
    def label(self) -> str:
        short = f"-{self.layers}L" if self.layers else ""
        return f"{self.geometry}{short}-{self.routing}"


SCENARIOS = (
    Scenario("qwen3-30b-a3b", "qwen3-30b", (8, 16)),
    Scenario("qwen3-30b-a3b", "flat", (8,)),
    Scenario("gpt-oss-120b", "qwen3-30b", (8, 16), layers=6),  # 36 layers are 61 GB: the device's disk is 64 GB
)


def _write(args: tuple[Scenario, str]) -> str:
    from engine.synth.routing import routing
    from engine.synth.spec import preset
    from engine.synth.writer import write_model

    sc, path = args
    spec = preset(sc.geometry)
    if sc.layers:
        spec = spec.with_(n_layer=sc.layers)
    if not Path(path).exists():
        write_model(Path(path), spec, routing(sc.routing), seed=0)
    return path


def emulated_budget_mib(path: Path, geometry: str, budget_gib: float) -> int:
    """The budget for a model shortened from `geometry` that keeps the full model's expert share."""
    from engine.gguf.reader import ModelFile
    from engine.synth.spec import preset

    mf = ModelFile.open(path)
    n_full, n = preset(geometry).n_layer, int(mf.arch_key("block_count"))
    layer_dense = sum(t.n_bytes for t in mf.tensors.values() if t.name.startswith("blk.") and "_exps." not in t.name)
    other = sum(t.n_bytes for t in mf.tensors.values() if not t.name.startswith("blk."))
    per_layer = layer_dense / n
    room_full = budget_gib * 1024 * MiB - (per_layer * n_full + other)
    return round((per_layer * n + other + room_full * n / n_full) / MiB)


def run(args: argparse.Namespace) -> int:
    from engine.bench.speed import bench

    out: Path = args.dir
    device = resolve_device(args.device)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    scenarios = [s for s in SCENARIOS if not args.only or s.label in args.only]
    models = {s.label: str(out / f"{s.label}.gguf") for s in scenarios}
    if "write" in args.phase:
        with ProcessPoolExecutor(len(scenarios)) as ex:
            for path in ex.map(_write, [(s, models[s.label]) for s in scenarios]):
                print("written", path, flush=True)
    for phase, runs in (("engine", ("hybrid", "resident")), ("llama", ("llama-split", "llama-gpu"))):
        if phase not in args.phase:
            continue
        for s in scenarios:
            for i, gib in enumerate(s.budgets_gib):
                key = f"{s.label}@{gib}GiB"
                path = Path(models[s.label])
                budget = emulated_budget_mib(path, s.geometry, gib) if s.layers else round(gib * 1024)
                wanted = tuple(r for r in runs if i == 0 or r in ("hybrid", "llama-split"))  # budget-free runs once
                if phase == "engine" and s is scenarios[0] and i == 0:
                    wanted += ("hybrid-mmap",)  # the memory map against the default's pinned copies, once
                scenario = {"label": s.label, "geometry": s.geometry, "routing": s.routing, "budget_gib": gib,
                            "layers": s.layers}

                def save(res: dict, key: str = key, scenario: dict = scenario) -> None:
                    res["scenario"] = scenario
                    results[key] = res
                    results_path.write_text(json.dumps(results, indent=2, default=float))

                res = bench(path, budget, device=device, threads=args.threads, n_prompt=args.prompt_tokens,
                            n_decode=args.decode_tokens, ctx=args.ctx, n_long=args.long_prompt_tokens, runs=wanted,
                            result=results.get(key), on_run=save)
                print(key, phase, {k: v.get("decode_tokens_per_s", v.get("error")) for k, v in res["runs"].items()},
                      flush=True)
    if "report" in args.phase:
        table = report(results)
        (out / "results.md").write_text(table)
        print(table)
    return 0


def _budget_free(results: dict, key: str, run: str) -> dict | None:
    """The resident / all-GPU run of a scenario (measured once, at its first budget)."""
    label = results[key]["scenario"]["label"]
    for k, r in results.items():
        if r["scenario"]["label"] == label and run in r["runs"]:
            return r["runs"][run]
    return None


def report(results: dict) -> str:
    """Markdown: one row per scenario and budget, ratios within that run's machine and stream."""
    head = ("| scenario | budget | hybrid decode tok/s | hit / upload / CPU | miss fraction | llama split (n_cpu_moe) "
            "| hybrid / split | resident | llama all-GPU | hybrid / all-GPU | resident / all-GPU "
            "| prefill hybrid / split (long prompt) | prefill resident / all-GPU (long prompt) "
            "| hybrid prompt layer steps streamed / read back (long prompt) | share of bound | peak VRAM MiB |\n|"
            + "---|" * 16 + "\n")
    rows = []
    for key, r in results.items():
        runs = r["runs"]
        h, sp = runs.get("hybrid", {}), runs.get("llama-split", {})
        res, gpu = _budget_free(results, key, "resident") or {}, _budget_free(results, key, "llama-gpu") or {}

        def f(run: dict, field: str, fmt: str = "{:.1f}") -> str:
            if run.get(field) is not None:
                return fmt.format(run[field])
            return run.get("error", "-")[:40]

        def ratio(a: dict, b: dict, field: str = "decode_tokens_per_s") -> str:
            return f"{a[field] / b[field]:.2f}x" if field in a and field in b else "-"

        def prefill(a: dict, b: dict) -> str:
            return f"{ratio(a, b, 'prefill_tokens_per_s')} ({ratio(a, b, 'long_prefill_tokens_per_s')})"

        def steps(field: str) -> str:
            n = h.get(field)
            return f"{n['streamed']} / {n['read back']}" if n else "-"

        mix = (f"{h['gpu_hit']:.0%} / {h['uploaded']:.0%} / {h['cpu']:.0%}" if "gpu_hit" in h else "-")
        if h.get("mapped"):  # decode misses the GPU read from pinned RAM (tune.mapped_misses)
            mix += f" (+{h['mapped']:.0%} mapped)"
        rows.append(f"| {r['scenario']['label']} | {r['scenario']['budget_gib']} GiB ({r['budget_mib']:.0f} MiB) "
                    f"| {f(h, 'decode_tokens_per_s')} | {mix} | {f(h, 'miss_fraction', '{:.3f}')} "
                    f"| {f(sp, 'decode_tokens_per_s')} ({sp.get('n_cpu_moe', '-')}) | {ratio(h, sp)} "
                    f"| {f(res, 'decode_tokens_per_s')} | {f(gpu, 'decode_tokens_per_s')} | {ratio(h, gpu)} "
                    f"| {ratio(res, gpu)} | {prefill(h, sp)} | {prefill(res, gpu)} "
                    f"| {steps('prefill_steps')} ({steps('long_prefill_steps')}) "
                    f"| {f(h, 'share_of_bound', '{:.0%}')} | {f(h, 'peak_vram_mib', '{:.0f}')} |")
    return head + "\n".join(rows) + "\n" + "".join(f"\n{note}" for note in compile_notes(results))


def compile_notes(results: dict) -> list[str]:
    """A line for each run whose timed part compiled kernels (engine/bench/compiles.py): its
    figures hold the compiles."""
    notes = []
    for key, r in results.items():
        for name, run in r["runs"].items():
            c = run.get("timed_jit_compiles") or {}
            if c.get("count"):
                notes.append(f"- {key} {name}: {c['count']} kernel compiles inside the timed runs "
                             f"({c['seconds']:.2f} s: {', '.join(c['kernels'])}); its figures hold them")
    return notes


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("scenarios", help="the docs/BENCHMARKS.md sweep: geometries x routings x budgets")
    p.add_argument("dir", type=Path, help="models and results.json go here")
    p.add_argument("--phase", default="write,engine,llama,report",
                   help="comma-separated: write, engine, llama, report (default: all)")
    p.add_argument("--only", nargs="*", help="scenario labels to run (default: all)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: cuda when there is one)")
    p.add_argument("-t", "--threads", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=64)
    add_long_argument(p, 4096)
    add_ctx_argument(p)
    p.set_defaults(run=run)
