"""`moestudio validate`: does this engine compute what llama.cpp computes on this model file?

Both run the same tokens (a prompt, then llama.cpp's greedy continuation), and the report
compares logits (max abs diff, KL divergence of the next-token distributions, top-1
agreement) and the experts each MoE layer routed every token to.

How close is close enough is measured, not assumed. Two correct implementations differ by
float32 summation order, and on a quantized model the 8-bit activation rounding before
every matmul turns some of those ~1e-7 differences into whole quant steps that travel on
(engine/layers/precision.py). How far depends on the model and on the CPU's kernels, so
the engine runs a second time with its products accumulated in float64 (the same code, a
different and more exact summation order): the distance between its two runs is the noise
floor. The verdict asks that the distance to llama.cpp be of that size; a real bug (a
wrong scale, mask, rounding recipe or routing rule) is systematic and lands far outside it.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from engine.errors import UserError

if TYPE_CHECKING:
    from engine.baseline.oracle import Reference

# How much farther from llama.cpp than from its own float64 run the engine may land. The
# distance is a count of rounding flips and of what they touch, so it varies between two
# equally correct runs: over the validate matrix (docs/VALIDATION.md, 37 models, 640 tokens)
# the largest ratio of the distance to llama.cpp to the noise floor was 1.4 (max diff), 1.1
# (mean KL), 1.5 (top-1 changes + 1) and 1.0 (routing changes + 1); 4 leaves room for other
# CPUs' kernels while the bugs of tests/engine/test_validate.py land 12-10,000x outside.
NOISE_FACTOR = 4.0
# Floors under the noise-derived limits, for models with no activation rounding at all (F32
# weights): there the noise is float32 summation alone and llama.cpp's ggml kernels sum in
# other orders than torch (observed <= 1e-5 on logits of unit scale).
MIN_MAX_DIFF = 1e-3
MIN_MEAN_KL = 1e-6
# Counted events (a top-1 change, a routing change away from a near-tie) are compared as
# NOISE_FACTOR x (noise count + 1): a floor with none seen still allows a few.
TIE_GAP = 1e-3  # router-score units: closer than this, the k-th and k+1-th experts are a tie

# The lengths the app works at: a long pasted prompt, then a reply.
DEFAULT_PROMPT_TOKENS = 512
DEFAULT_GENERATED_TOKENS = 128


@dataclass
class Comparison:
    """How far one run's logits and routing are from a reference run's on the same tokens."""
    tokens: int
    max_abs_diff: float  # over positions whose routing agrees (a near-tie flip changes a whole expert)
    p99_abs_diff: float
    mean_kl: float  # over positions whose routing agrees, like max_abs_diff
    max_kl: float
    top1_agreement: float  # over positions where the reference's two best logits differ by more than 1e-3
    top1_disagreements: int
    routing_agreement: float  # share of (token, MoE layer) whose expert sets are equal
    routing_flips_at_ties: int  # (token, layer) that differ where the reference's k-th and k+1-th scores are close
    routing_mismatches_outside_ties: int


@dataclass
class Validation:
    against_llama: Comparison  # this engine vs llama.cpp
    noise: Comparison  # this engine vs itself accumulating in float64: the noise floor
    failures: list[str] = field(default_factory=list)
    kernels: str = ""  # the CPU kernel paths both ran on (torch's capability, ggml's features)

    @property
    def passed(self) -> bool:
        return not self.failures


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def compare(ref: "Reference", logits: np.ndarray, experts: np.ndarray, tie_gap: float = TIE_GAP) -> Comparison:
    """ref: engine.baseline.oracle.Reference (or another run shaped like one); logits [T, V];
    experts [T, n_moe_layers, k].

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
    agree = (logits.argmax(1) == ref.logits.argmax(1))[decided]
    return Comparison(len(logits), float(diff.max()), float(np.percentile(diff, 99)), float(kl.mean()),
                      float(kl.max()), float(agree.mean()), int((~agree).sum()), float(same.mean()),
                      int((~same & tie).sum()), int((~same & ~tie).sum()))


def judge(against_llama: Comparison, noise: Comparison) -> list[str]:
    """Why the distance to llama.cpp is not explained by the measured noise (empty: it is)."""
    failures = []

    def limit(value: float, floor: float, minimum: float, what: str) -> None:
        allowed = max(NOISE_FACTOR * floor, minimum)
        if value > allowed:
            failures.append(f"{what} {value:.2e} > {allowed:.2e} ({NOISE_FACTOR:g}x the noise floor {floor:.2e})")

    def count(value: int, floor: int, what: str) -> None:
        allowed = NOISE_FACTOR * (floor + 1)
        if value > allowed:
            failures.append(f"{what}: {value} > {allowed:g} ({NOISE_FACTOR:g}x (the noise floor's {floor} + 1))")

    limit(against_llama.max_abs_diff, noise.max_abs_diff, MIN_MAX_DIFF, "logits max |diff|")
    limit(against_llama.mean_kl, noise.mean_kl, MIN_MEAN_KL, "mean KL")
    count(against_llama.top1_disagreements, noise.top1_disagreements, "top-1 changes")
    count(against_llama.routing_mismatches_outside_ties, noise.routing_mismatches_outside_ties,
          "routing changes away from near-ties")
    return failures


def engine_run(model, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Logits and routed experts of this engine's model over `tokens`, in forwards of at most
    LOGIT_ROWS tokens over one cache (the logits the planner reserves memory for), none of a
    single token (that would be a decode graph's step)."""
    import torch

    from engine.plan.sizing import LOGIT_ROWS

    seen: dict[int, list[torch.Tensor]] = {}
    executor = model.experts

    def recording(layer, x, ids, weights):
        seen.setdefault(layer, []).append(ids.clone())
        return executor(layer, x, ids, weights)

    model.experts = recording
    cache = model.new_cache(len(tokens))
    rows = []
    try:
        for chunk in np.array_split(np.asarray(tokens), -(-len(tokens) // LOGIT_ROWS)):
            rows.append(model.forward(torch.from_numpy(chunk), cache).float().cpu().numpy())
    finally:
        model.experts = executor
    experts = np.stack([torch.cat(seen[layer]).cpu().numpy() for layer in sorted(seen)], axis=1)
    return np.concatenate(rows), experts


def noise_floor(model, ref: "Reference", logits: np.ndarray, experts: np.ndarray) -> Comparison:
    """The engine's float32 run (`logits`, `experts`) against its own float64-accumulated run."""
    import torch

    from engine.baseline.oracle import Reference
    from engine.layers.precision import accumulate_in

    with accumulate_in(torch.float64):
        exact_logits, exact_experts = engine_run(model, ref.tokens)
    exact = Reference(ref.tokens, exact_logits, ref.moe_layers, exact_experts, ref.probs)
    return compare(exact, logits, experts)


def validate(path: str | Path, prompt: str, n_prompt: int = DEFAULT_PROMPT_TOKENS,
             n_generate: int = DEFAULT_GENERATED_TOKENS, device: str = "cpu") -> Validation:
    from engine.baseline.oracle import run_reference
    from engine.gguf.check import open_model
    from engine.models import build_model
    from engine.runtime.tokenizer import tokenize_text
    from engine.server.loader import unsupported_reason

    # Checked by this engine's bounded reader before llama.cpp (tokenizer, reference) sees the file.
    mf = open_model(path)
    problem = unsupported_reason(mf)
    if problem:
        raise UserError(f"cannot validate {path}: {problem}")
    tokens = tokenize_text(path, prompt)[:n_prompt]
    if len(tokens) < 4:
        raise UserError("the prompt is too short: give at least a sentence of text")
    n_ctx = int(mf.arch_key("context_length", 0) or 0)
    if n_ctx and len(tokens) + n_generate > n_ctx:
        raise UserError(f"{len(tokens)} prompt + {n_generate} generated tokens exceed the model's context "
                        f"length {n_ctx}: lower --tokens or --generate")
    ref = run_reference(path, tokens, generate=n_generate)
    model = build_model(path, device)
    logits, experts = engine_run(model, ref.tokens)
    against_llama = compare(ref, logits, experts)
    noise = noise_floor(model, ref, logits, experts)
    return Validation(against_llama, noise, judge(against_llama, noise), cpu_kernels())


def cpu_kernels() -> str:
    """Which CPU code paths ran: torch's run-time capability and the features ggml was built with."""
    import torch

    from engine.baseline.llama_load import llama_cpp

    info = llama_cpp().llama_print_system_info().decode(errors="replace")
    ggml = " ".join(part.split("=")[0].strip() for part in info.split("|") if part.strip().endswith("= 1"))
    return f"torch {torch.backends.cpu.get_cpu_capability()}; ggml {ggml.replace('CPU : ', '')}"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("validate", help="check that this engine matches llama.cpp on a model",
                       description="Runs this engine and llama.cpp on the same tokens and compares them, "
                                   "against the noise floor of this engine's own float32 and float64 runs.")
    p.add_argument("model", type=Path, nargs="?", help="the GGUF to check (omit with --matrix)")
    p.add_argument("--matrix", action="store_true",
                   help="validate every architecture x expert type the synthetic factory writes, and the demo "
                        "model, and print the table (docs/VALIDATION.md)")
    p.add_argument("--prompt-file", type=Path, help="text to use (default: Python standard library docstrings)")
    p.add_argument("--tokens", type=int, default=DEFAULT_PROMPT_TOKENS,
                   help=f"prompt tokens (default {DEFAULT_PROMPT_TOKENS})")
    p.add_argument("--generate", type=int, default=DEFAULT_GENERATED_TOKENS,
                   help=f"greedy tokens after the prompt (default {DEFAULT_GENERATED_TOKENS})")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(run=_run)


def prompt_text(prompt_file: Path | None, n_tokens: int) -> str:
    if prompt_file is None:
        from engine.synth.corpus import stdlib_text

        return stdlib_text(max_chars=n_tokens * 8)
    try:
        return prompt_file.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise UserError(f"cannot read --prompt-file {prompt_file}: {e.strerror or e}") from None


def _run(args: argparse.Namespace) -> int:
    if args.tokens < 4 or args.generate < 0:
        raise UserError("--tokens must be at least 4 and --generate at least 0")
    text = prompt_text(args.prompt_file, args.tokens)
    if args.matrix:
        if args.model is not None:
            raise UserError("--matrix validates the factory's models: give no model file with it")
        from engine.validate_matrix import run_matrix

        return run_matrix(text, args.tokens, args.generate, args.device, as_json=args.json)
    if args.model is None:
        raise UserError("give a model file to validate, or --matrix")
    v = validate(args.model, text, args.tokens, args.generate, args.device)  # GGUFError is a UserError
    if args.json:
        print(json.dumps({**asdict(v), "passed": v.passed}, indent=2))
    else:
        print(report(v))
    return 0 if v.passed else 1


def report(v: Validation) -> str:
    a, n = v.against_llama, v.noise
    lines = [
        f"tokens compared      {a.tokens}",
        f"CPU kernels          {v.kernels}",
        "                     vs llama.cpp    noise floor (this engine, float32 vs float64)",
        f"logits max |diff|    {a.max_abs_diff:<15.2e} {n.max_abs_diff:.2e}",
        f"logits p99 |diff|    {a.p99_abs_diff:<15.2e} {n.p99_abs_diff:.2e}",
        f"mean KL              {a.mean_kl:<15.2e} {n.mean_kl:.2e}",
        f"top-1 agreement      {a.top1_agreement:<15.2%} {n.top1_agreement:.2%}",
        f"routing agreement    {a.routing_agreement:<15.2%} {n.routing_agreement:.2%}",
        f"  flips at ties      {a.routing_flips_at_ties:<15d} {n.routing_flips_at_ties}",
        f"  changes elsewhere  {a.routing_mismatches_outside_ties:<15d} {n.routing_mismatches_outside_ties}",
    ]
    if v.passed:
        lines.append("verdict              PASS: this engine matches llama.cpp on this model "
                     "(within the measured rounding noise)")
    else:
        lines.append("verdict              FAIL: this engine does not match llama.cpp here; use --engine llamacpp")
        lines += [f"  {f}" for f in v.failures]
    return "\n".join(lines)


# The check `--engine auto` runs the first time it loads a file: the tests' lengths, a few seconds.
FIRST_LOAD_PROMPT_TOKENS = 32
FIRST_LOAD_GENERATED_TOKENS = 16


def first_load_check(path: str | Path, model, device: str) -> str | None:
    """Why this engine should not run `path` (None: it validated), from a cache kept per file.

    `model` is the engine's loaded DecoderModel, run as it is (no second copy in memory). The
    verdict is cached under the file's fingerprint, this engine's version and the device
    type, so a file is checked once per machine, not at every start.
    """
    from engine.gguf.fingerprint import file_fingerprint
    from engine.synth.corpus import stdlib_text

    key = f"{file_fingerprint(path)}-{_engine_version()}-{device}"
    cached = _verdict_cache() / f"{key}.json"
    try:
        return json.loads(cached.read_text())["failure"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    from engine.baseline.oracle import run_reference
    from engine.runtime.tokenizer import tokenize_text

    tokens = tokenize_text(path, stdlib_text(max_chars=FIRST_LOAD_PROMPT_TOKENS * 8))[:FIRST_LOAD_PROMPT_TOKENS]
    ref = run_reference(path, tokens, generate=FIRST_LOAD_GENERATED_TOKENS)
    logits, experts = engine_run(model, ref.tokens)
    against_llama = compare(ref, logits, experts)
    failures = judge(against_llama, noise_floor(model, ref, logits, experts))
    failure = ("this engine did not match llama.cpp on this file (" + "; ".join(failures) +
               f"); details: moestudio validate {path}") if failures else None
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(".tmp")
        tmp.write_text(json.dumps({"failure": failure, "path": str(path), "against_llama": asdict(against_llama)}))
        tmp.replace(cached)
    except OSError:
        pass  # an unwritable cache only costs the check again next time
    return failure


def _verdict_cache() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("moestudio")) / "validation"


def _engine_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("moestudio")
    except PackageNotFoundError:
        return "dev"
