"""`moestudio validate`: does this engine compute what llama.cpp computes on this model file?

Both run the same tokens (a prompt, then llama.cpp's greedy continuation), and the report
compares logits (max abs diff, KL divergence of the next-token distributions, top-1
agreement) and the experts each MoE layer routed every token to.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from engine.errors import UserError

# Verdict thresholds: a correct engine lands far inside these on every model we test
# (tests/engine/test_parity.py states the per-case figures).
MAX_MEAN_KL = 1e-4
MIN_TOP1 = 0.98


@dataclass
class Validation:
    tokens: int
    max_abs_diff: float  # over positions whose routing agrees (a near-tie flip changes a whole expert)
    p99_abs_diff: float
    mean_kl: float  # over positions whose routing agrees, like max_abs_diff
    max_kl: float
    top1_agreement: float  # over positions where llama.cpp's two best logits differ by more than 1e-3
    routing_agreement: float  # share of (token, MoE layer) whose expert sets are equal
    routing_flips_at_ties: int  # (token, layer) that differ where llama.cpp's k-th and k+1-th scores are close
    routing_mismatches_outside_ties: int
    passed: bool


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def compare(ref, logits: np.ndarray, experts: np.ndarray, tie_gap: float = 1e-3) -> Validation:
    """ref: engine.baseline.oracle.Reference; logits [T, V]; experts [T, n_moe_layers, k].

    `tie_gap` is in router-score units: tiny differences upstream (summation order, a rounding
    step) move scores by far less, so a flip between experts closer than that is a tie.
    """
    same = (np.sort(experts, axis=-1) == np.sort(ref.experts, axis=-1)).all(axis=-1)
    k = ref.experts.shape[-1]
    scores = np.sort(ref.probs, axis=-1)[..., ::-1]
    tie = (scores[..., k - 1] - scores[..., k]) < tie_gap if scores.shape[-1] > k else np.zeros_like(same)
    flipped_at_tie = (~same & tie).any(axis=1)
    clean = ~flipped_at_tie
    diff = np.abs(logits - ref.logits).max(axis=1)[clean]
    lp, lq = _log_softmax(ref.logits), _log_softmax(logits)
    kl = (np.exp(lp) * (lp - lq)).sum(axis=1)[clean]
    best2 = np.sort(ref.logits, axis=1)[:, -2:]
    decided = (best2[:, 1] - best2[:, 0]) > 1e-3
    top1 = float((logits.argmax(1) == ref.logits.argmax(1))[decided].mean())
    mismatches = int((~same & ~tie).sum())
    passed = float(kl.mean()) < MAX_MEAN_KL and top1 >= MIN_TOP1 and mismatches == 0
    return Validation(len(logits), float(diff.max()), float(np.percentile(diff, 99)), float(kl.mean()),
                      float(kl.max()), top1, float(same.mean()), int((~same & tie).sum()), mismatches, passed)


def engine_run(model, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Logits and routed experts of this engine's model over `tokens` in one forward."""
    import torch

    seen: dict[int, "torch.Tensor"] = {}
    executor = model.experts

    def recording(layer, x, ids, weights):
        seen[layer] = ids.clone()
        return executor(layer, x, ids, weights)

    model.experts = recording
    try:
        logits = model.forward(torch.tensor(tokens), model.new_cache(len(tokens))).float().cpu().numpy()
    finally:
        model.experts = executor
    experts = np.stack([seen[layer].cpu().numpy() for layer in sorted(seen)], axis=1)
    return logits, experts


def validate(path: str | Path, prompt: str, n_prompt: int = 64, n_generate: int = 64,
             device: str = "cpu") -> Validation:
    from engine.baseline.oracle import run_reference
    from engine.gguf.check import open_model
    from engine.models import build_model
    from engine.runtime.tokenizer import tokenize_text
    from engine.server.loader import unsupported_reason

    # Checked by this engine's bounded reader before llama.cpp (tokenizer, reference) sees the file.
    problem = unsupported_reason(open_model(path))
    if problem:
        raise UserError(f"cannot validate {path}: {problem}")
    tokens = tokenize_text(path, prompt)[:n_prompt]
    if len(tokens) < 4:
        raise UserError("the prompt is too short: give at least a sentence of text")
    ref = run_reference(path, tokens, generate=n_generate)
    logits, experts = engine_run(build_model(path, device), ref.tokens)
    return compare(ref, logits, experts)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("validate", help="check that this engine matches llama.cpp on a model",
                       description="Runs this engine and llama.cpp on the same tokens and compares them.")
    p.add_argument("model", type=Path)
    p.add_argument("--prompt-file", type=Path, help="text to use (default: Python standard library docstrings)")
    p.add_argument("--tokens", type=int, default=64, help="prompt tokens (default 64)")
    p.add_argument("--generate", type=int, default=64, help="greedy tokens after the prompt (default 64)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    if args.prompt_file:
        try:
            text = args.prompt_file.read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            raise UserError(f"cannot read --prompt-file {args.prompt_file}: {e.strerror or e}") from None
    else:
        from engine.synth.corpus import stdlib_text

        text = stdlib_text(max_chars=args.tokens * 8)
    v = validate(args.model, text, args.tokens, args.generate, args.device)  # GGUFError is a UserError
    if args.json:
        print(json.dumps(asdict(v), indent=2))
    else:
        print(f"tokens compared      {v.tokens}")
        print(f"logits max |diff|    {v.max_abs_diff:.2e} (99th percentile {v.p99_abs_diff:.2e})")
        print(f"KL divergence        mean {v.mean_kl:.2e}, max {v.max_kl:.2e}")
        print(f"top-1 agreement      {v.top1_agreement:.2%}")
        print(f"routing agreement    {v.routing_agreement:.2%} "
              f"({v.routing_flips_at_ties} flips at near-ties, {v.routing_mismatches_outside_ties} elsewhere)")
        print("verdict              " + ("PASS: this engine matches llama.cpp on this model" if v.passed else
                                          "FAIL: this engine does not match llama.cpp here; use --engine llamacpp"))
    return 0 if v.passed else 1
