"""Per-token mask time of llguidance and xgrammar over a ~150k-token vocabulary (docs/STRUCTURED_OUTPUT.md).

    python scripts/measure_grammar_masks.py [--vocab 151000] [--steps 300]

The vocabulary is synthetic but shaped like a real byte-level BPE one: the 256 bytes, then words
and word pieces of real English text (the stdlib docstrings engine/synth/corpus.py reads), with and
without a leading space, capitalised, and joined with punctuation, until the size is reached. Each
library then drives the same grammars for `--steps` tokens, choosing a random allowed token each step
(seeded), and the time to compute each step's mask is recorded. A library that is not installed is
skipped (xgrammar is not a dependency: `pip install xgrammar` to compare).
"""
from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import time

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}
GRAMMARS = {"json_schema": SCHEMA, "json_object": {"type": "object"}}


def vocabulary(size: int) -> list[bytes]:
    from engine.synth.corpus import stdlib_text

    words = sorted(set(re.findall(r"[A-Za-z]+|\d+|[^\sA-Za-z\d]+", stdlib_text())))
    tokens: list[bytes] = [bytes([b]) for b in range(256)]
    seen = set(tokens)

    def add(text: str) -> None:
        b = text.encode()
        if b not in seen:
            seen.add(b)
            tokens.append(b)

    for variant in (lambda w: w, lambda w: " " + w, str.capitalize, lambda w: " " + w.capitalize()):
        for w in words:
            add(variant(w))
    rng = random.Random(0)
    while len(tokens) < size - 1:  # word pieces and joins, as BPE merges make them
        w = rng.choice(words)
        cut = rng.randint(1, max(1, len(w)))
        add(rng.choice(("", " ", "_", ".", "(", '"', ", ")) + w[:cut] + rng.choice(("", "s", "ed", "ing", "_", '":')))
    tokens.append(b"<|end|>")
    return tokens[:size]


def summary(times: list[float]) -> str:
    times = sorted(times)
    return (f"median {statistics.median(times) * 1e6:7.0f} us, p90 {times[int(0.9 * len(times))] * 1e6:7.0f} us, "
            f"max {times[-1] * 1e6:7.0f} us")


def run_llguidance(tokens: list[bytes], steps: int) -> None:
    import llguidance
    import numpy as np

    class Source:
        eos_token_id, bos_token_id = len(tokens) - 1, None
        special_token_ids = [len(tokens) - 1]

        def __init__(self) -> None:
            self.tokens = tokens

        def __call__(self, text: bytes) -> list[int]:
            return list(text)  # byte tokens: a valid (not canonical) tokenization, enough for masks

    t = time.perf_counter()
    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Source()))
    print(f"llguidance {getattr(llguidance, '__version__', '')}: tokenizer {time.perf_counter() - t:.2f} s")
    for name, schema in GRAMMARS.items():
        rng = random.Random(1)
        t = time.perf_counter()
        matcher = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema)))
        first = time.perf_counter() - t
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            mask = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little")
            times.append(time.perf_counter() - t)
            allowed = np.flatnonzero(mask[:len(tokens)])
            if matcher.is_stopped() or not len(allowed):
                break
            matcher.consume_token(int(rng.choice(allowed)))
        print(f"  {name:<12} compile {first * 1e3:6.1f} ms; mask over {len(times)} steps: {summary(times)}")


def run_xgrammar(tokens: list[bytes], steps: int) -> None:
    import numpy as np
    import xgrammar as xgr

    t = time.perf_counter()
    info = xgr.TokenizerInfo(tokens, vocab_type=xgr.VocabType.RAW, vocab_size=len(tokens),
                             stop_token_ids=[len(tokens) - 1])
    compiler = xgr.GrammarCompiler(info)
    name = f"xgrammar {getattr(xgr, '__version__', '')}"
    print(f"{name}: tokenizer {time.perf_counter() - t:.2f} s")
    bitmask = xgr.allocate_token_bitmask(1, len(tokens))
    for name, schema in GRAMMARS.items():
        rng = random.Random(1)
        t = time.perf_counter()
        matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema), any_whitespace=False))
        first = time.perf_counter() - t
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            mask = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")
            times.append(time.perf_counter() - t)
            allowed = np.flatnonzero(mask[:len(tokens)])
            if matcher.is_terminated() or not len(allowed):
                break
            matcher.accept_token(int(rng.choice(allowed)))
        print(f"  {name:<12} compile {first * 1e3:6.1f} ms; mask over {len(times)} steps: {summary(times)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=151_000)
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    tokens = vocabulary(args.vocab)
    print(f"vocabulary: {len(tokens)} tokens")
    for run in (run_llguidance, run_xgrammar):
        try:
            run(tokens, args.steps)
        except ImportError as e:
            print(f"{run.__name__[4:]}: not installed ({e})")


if __name__ == "__main__":
    main()
