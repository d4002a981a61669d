"""The factory's tokenizer: a GPT-2 style byte-level BPE stored in engine/synth/data.

It is written into each synthetic GGUF as `tokenizer.ggml.*` so llama.cpp tokenizes real text
into a realistic stream (about 4 characters per token on English prose), plus a chat template. The
template and its special tokens follow a chat family (ModelSpec.chat): ChatML with Hermes-style tools
(the default), or the tool-call formats of gpt-oss (harmony), Mistral (v3 JSON list or [ARGS]),
DeepSeek (V3/R1 or V3.1), GLM-4.5/4.6 and Qwen3-Coder, each with that family's markers as special
tokens, so tool calling is tested end to end on every format the server parses
(engine/server/tool_formats.py). GLM's and Qwen3-Coder's templates are the models' own
(data/GLM-4.6.jinja, data/Qwen3-Coder.jinja, as llama.cpp keeps them in models/templates); their tags
are user-defined tokens, as in those models' vocabularies (rendered as text even when special tokens are not).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

import gguf

VOCAB_SIZE = 2048
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # in every family, in this order

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


def _args(f: str) -> str:
    """Jinja: a call's arguments as JSON (clients send them as a string or as an object)."""
    return f"({f}['arguments'] if {f}['arguments'] is string else ({f}['arguments'] | tojson))"


_FN = "{% set f = call['function'] if call['function'] is defined else call %}"

# gpt-oss's harmony format, shortened from its template: tools as a TypeScript-like namespace in a
# developer message, calls as commentary messages to functions.NAME, results from functions.NAME.
HARMONY_TEMPLATE = (
    "{{ '<|start|>system<|message|>You are a helpful assistant.<|end|>' }}"
    "{% if tools or messages[0]['role'] == 'system' %}{{ '<|start|>developer<|message|>' }}"
    "{% if messages[0]['role'] == 'system' %}{{ '# Instructions\n\n' + messages[0]['content'] + '\n\n' }}{% endif %}"
    "{% if tools %}{{ '# Tools\n\n## functions\n\nnamespace functions {\n\n' }}"
    "{% for tool in tools %}{% set f = tool['function'] if tool['function'] is defined else tool %}"
    "{{ '// ' + (f['description'] or '') + '\ntype ' + f['name'] + ' = (_: ' + (f['parameters'] | tojson) + ') => any;\n\n' }}"
    "{% endfor %}{{ '} // namespace functions' }}{% endif %}{{ '<|end|>' }}{% endif %}"
    "{% set ns = namespace(tool='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% elif message['role'] == 'user' %}{{ '<|start|>user<|message|>' + message['content'] + '<|end|>' }}"
    "{% elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{% for call in message['tool_calls'] %}" + _FN + "{% set ns.tool = f['name'] %}"
    "{{ '<|start|>assistant<|channel|>commentary to=functions.' + f['name'] + ' <|constrain|>json<|message|>' }}"
    "{{ " + _args("f") + " }}{{ '<|call|>' }}{% endfor %}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<|start|>assistant<|channel|>final<|message|>' + message['content'] + '<|end|>' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|start|>functions.' + ns.tool + ' to=assistant<|channel|>commentary<|message|>' + message['content'] + '<|end|>' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start|>assistant' }}{% endif %}"
)


def _mistral_template(json_list: bool) -> str:
    """Mistral's [INST] format with tools: [AVAILABLE_TOOLS] first, calls as `[TOOL_CALLS][{...}]`
    (v3: Mixtral 8x22B, Nemo) or `[TOOL_CALLS]NAME[ARGS]{...}` (Devstral, Ministral 3)."""
    if json_list:
        calls = ("{{ '[TOOL_CALLS][' }}{% for call in message['tool_calls'] %}" + _FN +
                 "{% if not loop.first %}{{ ', ' }}{% endif %}"
                 "{{ '{\"name\": \"' + f['name'] + '\", \"arguments\": ' }}{{ " + _args("f") + " }}{{ '}' }}"
                 "{% endfor %}{{ ']</s>' }}")
        result = "{{ '[TOOL_RESULTS]{\"content\": ' + (message['content'] | tojson) + '}[/TOOL_RESULTS]' }}"
    else:
        calls = ("{% for call in message['tool_calls'] %}" + _FN +
                 "{{ '[TOOL_CALLS]' + f['name'] + '[ARGS]' }}{{ " + _args("f") + " }}{% endfor %}{{ '</s>' }}")
        result = "{{ '[TOOL_RESULTS]' + message['content'] + '[/TOOL_RESULTS]' }}"
    return (
        "{{ bos_token }}"
        "{% if tools %}{{ '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{% endif %}"
        "{% for message in messages %}"
        "{% if message['role'] == 'system' %}{{ message['content'] + '\n\n' }}"
        "{% elif message['role'] == 'user' %}{{ '[INST]' + message['content'] + '[/INST]' }}"
        "{% elif message['role'] == 'assistant' and message.get('tool_calls') %}" + calls +
        "{% elif message['role'] == 'assistant' %}{{ message['content'] + '</s>' }}"
        "{% elif message['role'] == 'tool' %}" + result +
        "{% endif %}{% endfor %}"
    )


def _deepseek_template(fenced: bool) -> str:
    """DeepSeek's format: calls between <｜tool▁calls▁begin｜> and <｜tool▁calls▁end｜>, each
    `function<｜tool▁sep｜>NAME` + a ```json block (V3, R1) or `NAME<｜tool▁sep｜>{...}` (V3.1)."""
    if fenced:
        call = ("{{ '<｜tool▁call▁begin｜>function<｜tool▁sep｜>' + f['name'] + '\n```json\n' }}{{ " + _args("f") +
                " }}{{ '\n```<｜tool▁call▁end｜>' }}")
        listing = "{{ '- ' + f['name'] + ':\n```json\n' + (tool | tojson) + '\n```\n' }}"
    else:
        call = "{{ '<｜tool▁call▁begin｜>' + f['name'] + '<｜tool▁sep｜>' }}{{ " + _args("f") + " }}{{ '<｜tool▁call▁end｜>' }}"
        listing = "{{ '### ' + f['name'] + '\n' + (tool | tojson) + '\n' }}"
    return (
        "{{ bos_token }}"
        "{% for message in messages %}{% if message['role'] == 'system' %}{{ message['content'] + '\n\n' }}"
        "{% endif %}{% endfor %}"
        "{% if tools %}{{ '## Tools\n\nYou have the following functions available:\n\n' }}"
        "{% for tool in tools %}{% set f = tool['function'] if tool['function'] is defined else tool %}"
        + listing + "{% endfor %}{{ '\n' }}{% endif %}"
        "{% for message in messages %}"
        "{% if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
        "{% elif message['role'] == 'assistant' and message.get('tool_calls') %}"
        "{{ '<｜Assistant｜>' + (message['content'] or '') + '<｜tool▁calls▁begin｜>' }}"
        "{% for call in message['tool_calls'] %}" + _FN + call + "{% endfor %}"
        "{{ '<｜tool▁calls▁end｜><｜end▁of▁sentence｜>' }}"
        "{% elif message['role'] == 'assistant' %}{{ '<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>' }}"
        "{% elif message['role'] == 'tool' %}"
        "{{ '<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜><｜tool▁outputs▁end｜>' }}"
        "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
    )


_DEEPSEEK_TOKENS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                    "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
                    "<｜tool▁output▁end｜>")
_MISTRAL_TOKENS = ("<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]",
                   "[ARGS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]")


_GLM_CONTROL = ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")
_TOOL_TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
_GLM_TAGS = ("<think>", "</think>", *_TOOL_TAGS, "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")


def _template(name: str) -> str:
    return resources.files("engine.synth").joinpath(f"data/{name}").read_text("utf-8")


@dataclass(frozen=True)
class ChatFamily:
    template: str
    tokens: tuple[str, ...] = ()  # control tokens after SPECIAL_TOKENS
    bos: str = "<|endoftext|>"
    eos: str = "<|im_end|>"  # llama.cpp adds the family's other end tokens (<|call|>, ...) by their text
    tags: tuple[str, ...] = ()  # user-defined tokens after the control tokens
    eot: str | None = None  # the end-of-turn token, when it is not `eos`
    eom: str | None = None  # the end-of-message token (the turn goes on after a tool's result), if any


CHAT_FAMILIES = {
    "hermes": ChatFamily(CHAT_TEMPLATE),
    "harmony": ChatFamily(HARMONY_TEMPLATE, ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>",
                                             "<|return|>", "<|call|>"), eos="<|return|>"),
    "mistral": ChatFamily(_mistral_template(json_list=False), _MISTRAL_TOKENS, bos="<s>", eos="</s>"),
    "mistral-v3": ChatFamily(_mistral_template(json_list=True), _MISTRAL_TOKENS, bos="<s>", eos="</s>"),
    "deepseek": ChatFamily(_deepseek_template(fenced=True), _DEEPSEEK_TOKENS, bos="<｜begin▁of▁sentence｜>",
                           eos="<｜end▁of▁sentence｜>"),
    "deepseek-v3.1": ChatFamily(_deepseek_template(fenced=False), _DEEPSEEK_TOKENS, bos="<｜begin▁of▁sentence｜>",
                                eos="<｜end▁of▁sentence｜>"),
    # As GLM-4.5's GGUF: eos <|endoftext|>, end of turn <|user|>, end of message <|observation|> (a reply
    # ends where the user's turn or a tool's result would begin).
    "glm": ChatFamily(_template("GLM-4.6.jinja"), _GLM_CONTROL, bos="[gMASK]", eos="<|endoftext|>", tags=_GLM_TAGS,
                      eot="<|user|>", eom="<|observation|>"),
    "qwen3-coder": ChatFamily(_template("Qwen3-Coder.jinja"), tags=_TOOL_TAGS),
}




@lru_cache(maxsize=1)
def _load() -> tuple[list[str], list[str]]:
    data = json.loads(resources.files("engine.synth").joinpath("data/tokenizer.json").read_text("utf-8"))
    return data["tokens"], data["merges"]


def vocab_size(chat: str = "hermes") -> int:
    tokens, _ = _load()
    family = CHAT_FAMILIES[chat]
    return len(tokens) + len(SPECIAL_TOKENS) + len(family.tokens) + len(family.tags)


def add_tokenizer(writer: gguf.GGUFWriter, chat: str = "hermes") -> None:
    """Writes the vocabulary, merges, special token ids and the chat family's template into `writer`."""
    family = CHAT_FAMILIES[chat]
    tokens, merges = _load()
    special = list(SPECIAL_TOKENS) + list(family.tokens)
    all_tokens = tokens + special + list(family.tags)
    types = ([gguf.TokenType.NORMAL] * len(tokens) + [gguf.TokenType.CONTROL] * len(special)
             + [gguf.TokenType.USER_DEFINED] * len(family.tags))
    eos = all_tokens.index(family.eos)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(all_tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(all_tokens.index(family.bos))
    writer.add_eos_token_id(eos)
    writer.add_eot_token_id(all_tokens.index(family.eot or family.eos))
    if family.eom:
        writer.add_eom_token_id(all_tokens.index(family.eom))
    writer.add_pad_token_id(all_tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(family.template)
