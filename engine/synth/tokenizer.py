"""The factory's tokenizer: a GPT-2 style byte-level BPE stored in engine/synth/data.

It is written into each synthetic GGUF as `tokenizer.ggml.*` so llama.cpp tokenizes real text
into a realistic stream (about 4 characters per token on English prose), plus a ChatML template with Hermes-style tools.
"""
from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources

import gguf

VOCAB_SIZE = 2048
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# ChatML, with Hermes-style tools as Qwen2.5/Qwen3 templates render them: the tool signatures in
# the system turn, calls as <tool_call> JSON in the assistant turn, results as <tool_response> in a
# user turn. Without tools and tool messages the text is plain ChatML.
CHAT_TEMPLATE = (
    "{% if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n'"
    " 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\n</tools>\n\nFor each function call, return a json object with function name and arguments '"
    " 'within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, '"
    " '\"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{% elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{ '<|im_start|>assistant\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] %}"
    "{% set f = call['function'] if call['function'] is defined else call %}"
    "{% if not loop.first or message['content'] %}{{ '\n' }}{% endif %}"
    "{{ '<tool_call>\n{\"name\": \"' + f['name'] + '\", \"arguments\": ' }}"
    "{{ f['arguments'] if f['arguments'] is string else (f['arguments'] | tojson) }}{{ '}\n</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
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
