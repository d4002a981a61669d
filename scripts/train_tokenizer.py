"""Regenerates engine/synth/data/tokenizer.json: a byte-level BPE trained on stdlib docstrings.

The result is committed so that every machine gets the same vocabulary; run this only to
change it:  pip install -e '.[dev]' && python scripts/train_tokenizer.py
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engine.synth.corpus import stdlib_text
from engine.synth.tokenizer import SPECIAL_TOKENS, VOCAB_SIZE

OUT = Path(__file__).resolve().parents[1] / "engine" / "synth" / "data" / "tokenizer.json"


def main() -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(stdlib_text().split("\n\n"), trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    OUT.write_text(json.dumps({"tokens": [t for t, _ in vocab], "merges": merges}, ensure_ascii=False))
    print(f"wrote {OUT}: {len(vocab)} tokens, {len(merges)} merges")


if __name__ == "__main__":
    main()
