"""`moestudio validate --matrix`: the verdict on every architecture x expert type the factory
writes, and on the demo model, at the lengths the app works at (docs/VALIDATION.md)."""
from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from engine.validate import Validation, validate

# Dense weights Q8_0 as in the real GGUFs people run (the tiny preset's default is F32).
MATRIX_EXPERT_TYPES = ("F16", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4")


def matrix_models(folder: Path) -> list[tuple[str, str, Path]]:
    """(architecture, expert type, path) of each model the matrix validates, written into `folder`."""
    from gguf import GGMLQuantizationType as QT

    from engine.synth.demo import DEMO_SPEC, demo_model_path
    from engine.synth.routing import routing
    from engine.synth.spec import ARCHITECTURES, EXPERT_QUANTS, preset
    from engine.synth.writer import write_model

    models = [(f"{DEMO_SPEC.arch} (demo)", DEMO_SPEC.expert_qtype.name, demo_model_path())]
    for arch in ARCHITECTURES:
        for name in MATRIX_EXPERT_TYPES:
            spec = preset("tiny", arch).with_(expert_qtype=EXPERT_QUANTS[name], dense_qtype=QT.Q8_0)
            path = write_model(folder / f"{arch}-{name}.gguf", spec, routing("qwen3-30b"), seed=0)
            models.append((arch, name, path))
    return models


def run_matrix(text: str, n_prompt: int, n_generate: int, device: str, as_json: bool = False) -> int:
    rows: list[tuple[str, str, Validation]] = []
    with tempfile.TemporaryDirectory(prefix="moestudio-validate-") as tmp:
        models = matrix_models(Path(tmp))
        if not as_json:
            print(table_header())
        for i, (arch, qtype, path) in enumerate(models, 1):
            print(f"[{i}/{len(models)}] {arch} {qtype}", file=sys.stderr, flush=True)
            v = validate(path, text, n_prompt, n_generate, device)
            rows.append((arch, qtype, v))
            if not as_json:
                print(table_row(arch, qtype, v), flush=True)
    if as_json:
        print(json.dumps([{"arch": a, "type": q, **asdict(v), "passed": v.passed} for a, q, v in rows], indent=2))
    failed = [f"{a} {q}: {'; '.join(v.failures)}" for a, q, v in rows if not v.passed]
    for line in failed:
        print(f"FAIL {line}", file=sys.stderr)
    return 1 if failed else 0


def table_header() -> str:
    return ("| architecture | experts | max logit diff (noise) | mean KL (noise) | top-1 agreement (noise) "
            "| routing agreement (noise) | verdict |\n|---|---|---|---|---|---|---|")


def table_row(arch: str, qtype: str, v: Validation) -> str:
    a, n = v.against_llama, v.noise
    return (f"| {arch} | {qtype} | {a.max_abs_diff:.1e} ({n.max_abs_diff:.1e}) | {a.mean_kl:.1e} ({n.mean_kl:.1e}) "
            f"| {a.top1_agreement:.2%} ({n.top1_agreement:.2%}) | {a.routing_agreement:.2%} "
            f"({n.routing_agreement:.2%}) | {'PASS' if v.passed else 'FAIL'} |")
