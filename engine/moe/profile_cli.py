"""`moestudio profile collect|show|convert`: which experts a workload uses, in GGUF or STRP files."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from engine.config import add_arguments, from_args, resolve_device
from engine.errors import UserError

if TYPE_CHECKING:
    from engine.moe.profile import Corpus, ExpertProfile, ModelIdentity


# The engine settings a collection runs with: serve's flags, names and defaults.
COLLECT_SETTINGS = ("ctx", "threads", "device", "prefill_chunk", "moe_expert_cache_size", "moe_expert_cache_mib",
                    "moe_gpu_miss_fraction", "load_mode", "vram_budget_mib")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="collect, show and convert expert profiles",
                       description="Expert profiles rank the experts a workload routes to, so the expert "
                       "cache starts with the right ones (--moe-expert-profile).")
    psub = p.add_subparsers(dest="profile_command", metavar="ACTION", required=True)

    c = psub.add_parser("collect", help="generate a corpus greedily and score the experts its decode steps use")
    c.add_argument("model", type=Path)
    c.add_argument("--corpus", required=True, type=Path,
                   help='JSON: {"version": 1, "weights": {FAMILY: W}, "requests": [{"family", '
                   '"prompt"|"prompt_file"|"messages", "max_tokens"}]}')
    c.add_argument("-o", "--output", required=True, type=Path, help="profile to write: .gguf or .strp")
    c.add_argument("--slots", type=int, help="STRP only: the cache size the ranking is for (ranks at most N)")
    add_arguments(c, COLLECT_SETTINGS)
    c.set_defaults(run=_collect)

    s = psub.add_parser("show", help="print a profile's geometry, identity and hottest experts")
    s.add_argument("file", type=Path)
    s.add_argument("--model", type=Path, help="also check the profile against this model")
    s.add_argument("--top", type=int, default=10, help="experts to list per layer (default 10)")
    s.set_defaults(run=_show)

    v = psub.add_parser("convert", help="convert between GGUF and STRP profiles (by the output's suffix)")
    v.add_argument("input", type=Path)
    v.add_argument("output", type=Path)
    v.add_argument("--slots", type=int, help="STRP output: the cache size the ranking is for (ranks at most N)")
    v.add_argument("--model", type=Path, help="check against this model and record its identity (STRP has none)")
    v.set_defaults(run=_convert)


def _open_model(path: Path):
    from engine.gguf.check import open_model

    return open_model(path)


def _collect(args: argparse.Namespace) -> int:
    from engine.moe.hybrid import attach_hybrid
    from engine.moe.profile import ModelIdentity, load_corpus, profile_format, save_profile
    from engine.runtime.engine import Engine, EngineConfig

    profile_format(args.output, args.slots)  # refuse a bad output before hours of generation
    corpus = load_corpus(args.corpus)
    identity = ModelIdentity.of(_open_model(args.model))
    settings = from_args(args)
    engine = Engine.load(args.model, EngineConfig.from_settings(settings, resolve_device(settings.device)),
                         attach_experts=attach_hybrid)

    def progress(done: int, total: int, family: str) -> None:
        print(f"profile: {done}/{total} requests done ({family})", file=sys.stderr, flush=True)

    profile = collect_profile(engine, corpus, progress, identity)
    save_profile(profile, args.output, args.slots)
    rows = sum(w.decode_rows for w in profile.workload)
    print(f"wrote {args.output}: {len(corpus.requests)} requests, {rows} decode rows, "
          f"{identity.describe()}")
    return 0


def _show(args: argparse.Namespace) -> int:
    from engine.moe.profile import STRP_MAGIC, ModelIdentity, fit, read_profile, read_strp

    if args.top < 1:
        raise UserError("--top must be at least 1")
    profile = read_profile(args.file)
    with open(args.file, "rb") as f:
        strp = read_strp(args.file) if f.read(4) == STRP_MAGIC else None
    src = profile.identity
    if strp is not None:
        print(f"format    STRP v1: {len(strp.ranked)} experts ranked for {strp.slots} slots")
    else:
        print("format    GGUF expert profile v1")
    print(f"source    {src.describe()}")
    if src.expert_hash is not None:
        print(f"identity  expert hash {src.expert_hash}, {src.expert_bytes / 2**20:.1f} MiB of experts "
              f"in a {src.file_size / 2**20:.1f} MiB file")
    else:
        print("identity  none (geometry only)")
    if args.model:
        fit(profile, ModelIdentity.of(_open_model(args.model)), f"profile {args.file}")
        print(f"model     {args.model} fits this profile")
    for w in profile.workload:
        print(f"workload  {w.family}: weight {w.weight:.0%}, {w.requests} request{'s' * (w.requests != 1)}, "
              f"{w.decode_rows} decode rows")
    for row, layer in enumerate(src.moe_layers):
        scores = profile.scores[row]
        top = [e for e in profile.top(layer, args.top) if scores[e] > 0]
        if not top:
            print(f"layer {layer:<3} nothing ranked")
        elif profile.counts is None:
            # Scores read from STRP (or converted from it) encode rank only: shares would be invented.
            print(f"layer {layer:<3} by rank: " + " ".join(map(str, top)))
        else:
            total = scores.sum()
            print(f"layer {layer:<3} top {len(top)} hold {scores[top].sum() / total:.0%}: "
                  + "  ".join(f"{e} {scores[e] / total:.1%}" for e in top))
    return 0


def _convert(args: argparse.Namespace) -> int:
    from engine.moe.profile import load_profile, profile_format, read_profile, save_profile

    profile_format(args.output, args.slots)
    if args.input.resolve() == args.output.resolve():
        raise UserError("the output would overwrite the input; give another file name")
    profile = load_profile(args.input, _open_model(args.model)) if args.model else read_profile(args.input)
    save_profile(profile, args.output, args.slots)
    if profile.identity.arch is None and args.output.suffix.lower() == ".gguf":
        print(f"note: {args.input} carries no model identity, so {args.output} holds geometry only; "
              "pass --model MODEL to record the model's", file=sys.stderr)
    print(f"wrote {args.output}")
    return 0


# ---- collection (the engine's generations scored into a profile) ----------------------------------

Progress = Callable[[int, int, str], None]  # (requests done, total, family of the last one)


class _DecodeCounter:
    """Wraps the expert executor and counts the experts each decode row routes to, per layer."""

    def __init__(self, executor, moe_layers: tuple[int, ...], n_expert: int) -> None:
        self.executor, self.n_expert = executor, n_expert
        self.row = {layer: i for i, layer in enumerate(moe_layers)}
        self.decoding = False
        self.reset()

    def reset(self) -> None:
        import numpy as np

        self.counts = np.zeros((len(self.row), self.n_expert))
        self.rows = np.zeros(len(self.row), dtype=np.int64)

    def __call__(self, layer, x, ids, weights):
        import numpy as np

        if self.decoding:
            i = self.row[layer]
            self.counts[i] += np.bincount(ids.reshape(-1).cpu().numpy(), minlength=self.n_expert)
            self.rows[i] += ids.shape[0]
        return self.executor(layer, x, ids, weights)


def collect_profile(engine, corpus: Corpus | str | os.PathLike[str], progress: Progress | None = None,
                    identity: ModelIdentity | None = None) -> ExpertProfile:
    """Generates every corpus request greedily on `engine` and scores its experts.

    score(layer, e) = sum over families of weight(family) x mean over the family's requests of
    (decode rows of the request routed to e) / (decode rows of the request).
    """
    from engine.layers.sampler import SamplingParams
    from engine.moe.profile import Corpus, ExpertProfile, ModelIdentity, Workload, describe_layers, load_corpus
    from engine.runtime.engine import Request

    import numpy as np

    corpus = corpus if isinstance(corpus, Corpus) else load_corpus(corpus)
    if identity is None:
        identity = ModelIdentity.of(engine.model.source)
    cfg = engine.model.config
    if tuple(cfg.moe_layers) != identity.moe_layers or cfg.n_expert != identity.n_expert:
        raise UserError(f"the engine's model ({cfg.arch}, MoE layers {describe_layers(tuple(cfg.moe_layers))}, "
                        f"{cfg.n_expert} experts) is not {identity.describe()}")
    requests = [Request(prompt=r.prompt, messages=r.messages, max_tokens=r.max_tokens,
                        sampling=SamplingParams(temperature=0.0), ignore_eos=True) for r in corpus.requests]
    # Refuse before the first (possibly hours-long) generation, not in the middle of the run.
    for i, request in enumerate(requests):
        n = len(engine.prompt_tokens(request))
        if n + 2 > engine.n_ctx:
            raise UserError(f"request #{i + 1}: its prompt has {n} tokens, which leaves no room to generate "
                            f"in a context of {engine.n_ctx} tokens")

    counter = _DecodeCounter(engine.model.experts, identity.moe_layers, identity.n_expert)
    shares = {f: np.zeros((len(identity.moe_layers), identity.n_expert)) for f in corpus.weights}
    n_requests, n_rows = dict.fromkeys(corpus.weights, 0), dict.fromkeys(corpus.weights, 0)
    counts = np.zeros_like(counter.counts)
    engine.model.experts = counter
    try:
        for i, (spec, request) in enumerate(zip(corpus.requests, requests)):
            counter.reset()
            counter.decoding = False
            # The first token event comes after prefill; every forward after it is decode. (Row
            # counts cannot tell: a prompt whose prefix is cached prefills in one row.)
            for _ in engine.generate(request):
                counter.decoding = True
            rows = int(counter.rows[0])
            shares[spec.family] += counter.counts / rows
            counts += counter.counts
            n_requests[spec.family] += 1
            n_rows[spec.family] += rows
            if progress is not None:
                progress(i + 1, len(requests), spec.family)
    finally:
        engine.model.experts = counter.executor
    scores = sum(corpus.weights[f] * shares[f] / n_requests[f] for f in corpus.weights)
    workload = tuple(Workload(f, corpus.weights[f], n_requests[f], n_rows[f]) for f in corpus.weights)
    return ExpertProfile(identity, scores, counts, workload)
