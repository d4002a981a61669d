"""The factory's tokenizer: a GPT-2 style byte-level BPE stored in engine/synth/data.

It is written into each synthetic GGUF as `tokenizer.ggml.*` so llama.cpp tokenizes real text
into a realistic stream (about 4 characters per token on English prose), plus a ChatML template.
"""
from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources

import gguf

VOCAB_SIZE = 2048
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@lru_cache(maxsize=1)
def _load() -> tuple[list[str], list[str]]:
    data = json.loads(resources.files("engine.synth").joinpath("data/tokenizer.json").read_text("utf-8"))
    return data["tokens"], data["merges"]


def vocab_size() -> int:
    tokens, _ = _load()
    return len(tokens) + len(SPECIAL_TOKENS)


def add_tokenizer(writer: gguf.GGUFWriter) -> None:
    """Writes the vocabulary, merges, special token ids and chat template into `writer`."""
    tokens, merges = _load()
    all_tokens = tokens + list(SPECIAL_TOKENS)
    types = [gguf.TokenType.NORMAL] * len(tokens) + [gguf.TokenType.CONTROL] * len(SPECIAL_TOKENS)
    eos = all_tokens.index("<|endoftext|>")
    im_end = all_tokens.index("<|im_end|>")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(all_tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(eos)
    writer.add_eos_token_id(im_end)
    writer.add_eot_token_id(im_end)
    writer.add_pad_token_id(eos)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
