"""A GGUF's tokenizer and chat template, exactly as llama.cpp applies them.

The vocabulary is loaded by llama.cpp itself in vocab-only mode (no weights), so token ids,
byte pieces and end-of-generation tokens are llama.cpp's. Chat templates are the GGUF's own
Jinja template, rendered as llama-cpp-python renders it.
"""
from __future__ import annotations

import ctypes
from functools import cached_property, lru_cache
from pathlib import Path

from engine.baseline.llama_load import llama_cpp, load_model
from engine.errors import UserError

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class Tokenizer:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        L = llama_cpp()
        self._model = load_model(self.path, vocab_only=True)
        self._vocab = L.llama_model_get_vocab(self._model)
        self.n_vocab = L.llama_vocab_n_tokens(self._vocab)
        self.eos = L.llama_vocab_eos(self._vocab)
        self.bos = L.llama_vocab_bos(self._vocab)
        self.add_bos = bool(L.llama_vocab_get_add_bos(self._vocab))
        self._eog = {t for t in range(self.n_vocab) if L.llama_vocab_is_eog(self._vocab, t)}
        self.chat_template = self._meta("tokenizer.chat_template")

    @property
    def vocab(self):
        """llama.cpp's vocabulary pointer (valid while this Tokenizer lives)."""
        return self._vocab

    def _meta(self, key: str) -> str | None:
        L = llama_cpp()
        buf = ctypes.create_string_buffer(1 << 16)
        n = L.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            L.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", errors="replace")

    def __del__(self) -> None:
        if getattr(self, "_model", None):
            llama_cpp().llama_model_free(self._model)
            self._model = None

    def encode(self, text: str, *, add_special: bool = False, parse_special: bool = False) -> list[int]:
        """Token ids of `text`; `parse_special` turns "<|im_start|>" and the like into their ids."""
        L = llama_cpp()
        data = text.encode("utf-8")
        cap = len(data) + 16
        out = (L.llama_token * cap)()
        n = L.llama_tokenize(self._vocab, data, len(data), out, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            out = (L.llama_token * cap)()
            n = L.llama_tokenize(self._vocab, data, len(data), out, cap, add_special, parse_special)
        return list(out[:n])

    def piece(self, token: int, special: bool = False) -> bytes:
        """The bytes token `token` contributes to the text; control tokens contribute none unless
        `special` (then their own text, e.g. "<|im_start|>", as a tool-call parser needs it)."""
        L = llama_cpp()
        buf = ctypes.create_string_buffer(64)
        n = L.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = L.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def decode(self, tokens: list[int], special: bool = False) -> str:
        return b"".join(self.piece(t, special) for t in tokens).decode("utf-8", errors="replace")

    @cached_property
    def special_texts(self) -> frozenset[str]:
        """The text of every control token: what decoding with special=True adds to the plain text."""
        L = llama_cpp()
        control = L.LLAMA_TOKEN_ATTR_CONTROL
        return frozenset(text for t in range(self.n_vocab) if L.llama_vocab_get_attr(self._vocab, t) & control
                         if (text := self.piece(t, True).decode("utf-8", errors="replace")))

    def special_token(self, text: str) -> int | None:
        """The id of the one token that `text` is, if it is a special (control or user-defined) token."""
        ids = self.encode(text, parse_special=True)
        if len(ids) != 1:
            return None
        L = llama_cpp()
        attr = L.llama_vocab_get_attr(self._vocab, ids[0])
        return ids[0] if attr & (L.LLAMA_TOKEN_ATTR_CONTROL | L.LLAMA_TOKEN_ATTR_USER_DEFINED) else None

    def is_eog(self, token: int) -> bool:
        return token in self._eog

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:
        """The prompt text for `messages` under the model's template (`tools`, OpenAI-shaped function
        definitions, reach the template as `tools`). A last assistant message with content is a
        prefill: the prompt ends inside that message, so the reply continues it (llama-server does the same)."""
        last = messages[-1] if messages else None
        # A turn of tool calls is complete: the reply comes after their results, not inside it.
        prefill = (add_generation_prompt and last is not None and last.get("role") == "assistant"
                   and not last.get("tool_calls"))
        if prefill and last.get("content"):
            # Rendered as a closed turn with a marker for its content: what precedes the marker is the
            # template's opening of the turn, whatever the template (the closing after it is dropped).
            marker = "\u2063moestudio-prefill\u2063"
            text = self._render([*messages[:-1], {**last, "content": marker}], False, tools)
            if text.count(marker) != 1:
                raise UserError(f"the chat template of {self.path.name} cannot continue an assistant message "
                                "(it does not render the last assistant message's content as given)")
            return text[:text.index(marker)] + last["content"]
        if prefill:
            messages = messages[:-1]  # an empty prefill: an ordinary reply
        return self._render(messages, add_generation_prompt, tools)

    def _render(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None) -> str:
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        def token_text(t: int) -> str:
            return self.piece(t, True).decode("utf-8", errors="replace") if t >= 0 else ""

        try:  # compiling the template (in the constructor) fails on a corrupt one as rendering does
            fmt = Jinja2ChatFormatter(self.chat_template or CHATML, eos_token=token_text(self.eos),
                                      bos_token=token_text(self.bos), add_generation_prompt=add_generation_prompt)
            return fmt(messages=messages, tools=tools).prompt
        except Exception as e:  # a template error is the model file's problem: say which
            raise UserError(f"the chat template of {self.path.name} failed to render: {e}") from None


@lru_cache(maxsize=8)
def tokenizer(path: str | Path) -> Tokenizer:
    return Tokenizer(path)


def tokenize_text(path: str | Path, text: str) -> list[int]:
    """Plain text (no special tokens) as the model's token ids."""
    return tokenizer(str(path)).encode(text)
