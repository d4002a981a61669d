"""Constrained decoding: the tokens a grammar allows next, as a mask over the model's vocabulary.

Grammars are llguidance's (its JSON-schema compiler, Lark, regex). llguidance was chosen over
xgrammar (both install from PyPI for Python 3.11 x86_64 without a GPU): its masks took a median
20 us per token at a 151k vocabulary against xgrammar's 14 ms here (scripts/measure_grammar_masks.py,
docs/API.md), it needs no other package (xgrammar imports transformers), and it builds its token
trie straight from llama.cpp's vocabulary (`llguidance.llamacpp`: the token bytes both engines use).
One `TokenGrammar` follows one generation: `allowed()` before sampling, `accept(token)` after.

A grammar alone does not make a document finish: a model (a random-weight one surely) can keep a
string open, or open one more array item, until max_tokens cuts it. So within the last
CLOSING_WATCH tokens of the budget the choice is limited to the model's WATCH_CHOICES most likely
allowed tokens that still let the document close in time, plus the token of the closing policy.
Whether a token lets it close is played out on a copy of the grammar state: after the token,
the closing policy (always the allowed token that closes fastest: the end token; else tokens of
closing characters led by `"`, since inside a string only a quote closes; else tokens of `}` and
`]`; else separators (`,`, `":`), which end a number; else the longest allowed token: a forced
key, a digit) must reach the end token within the budget left. Every step follows the grammar, so the output always matches it, and it
is complete whenever the budget allows a complete document at all.
Grammars other than JSON close in two more ways, both tried before the ranks above: a special token
the grammar allows (a tool-call format's closing marker, e.g. GLM's `</arg_value>` after free text;
JSON never allows one), and the text a rule's `suffix` names (Qwen3-Coder's `\n</parameter>\n` after
a free-text value), written whole where the grammar takes it.
"""
from __future__ import annotations

import json
import math
import re
import threading
import weakref
from typing import Any

import numpy as np
import torch

from engine.errors import UserError

# Whitespace between JSON tokens would let a model (a random-weight one certainly) spend its
# whole budget on spaces; without it the output is compact JSON.
JSON_OPTIONS = {"whitespace_flexible": False}
CLOSING_WATCH = 128  # tokens before the budget ends from which each step checks that it can still close
WATCH_CHOICES = 4  # the model's most likely allowed tokens checked per step within CLOSING_WATCH


def json_schema_grammar(schema: dict[str, Any] | bool) -> str:
    """The llguidance grammar of JSON documents matching `schema`; UserError for a schema it cannot compile."""
    import llguidance

    return _checked(lambda: llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_OPTIONS),
                    "the JSON schema")


def any_json_object_grammar() -> str:
    """JSON mode: any JSON object."""
    return json_schema_grammar({"type": "object"})


def lark_grammar(lark: str) -> str:
    import llguidance

    return _checked(lambda: llguidance.LLMatcher.grammar_from_lark(lark), "the grammar")


def _checked(build: Any, what: str) -> str:
    """The grammar `build()` makes, refused in one line (naming `what`) if llguidance cannot compile it."""
    try:
        grammar = build()
    except ValueError as e:
        raise UserError(f"{what} cannot be used for constrained decoding: {e}") from None
    error = validate(grammar)
    if error:
        raise UserError(f"{what} cannot be used for constrained decoding: {error}")
    return grammar


def validate(grammar: str) -> str | None:
    """What is wrong with a grammar, or None."""
    import llguidance

    return llguidance.LLMatcher.validate_grammar(grammar) or None


_CLOSING_BYTES = frozenset(b'"}]')
_SEPARATOR_BYTES = frozenset(b'",:}]')


class _Vocabulary:
    """What a grammar needs of one tokenizer at one logit count, built once (about a second at 150k tokens):
    llguidance's tokenizer and the closing policy's preference per token (lower is preferred)."""

    def __init__(self, tokenizer: Any, n_vocab: int):
        from llguidance.llamacpp import lltokenizer_from_vocab

        self.n_vocab = n_vocab
        self.lltokenizer = lltokenizer_from_vocab(tokenizer.vocab, n_vocab=n_vocab, eos_token=tokenizer.eos)
        # rank first (0 end, 1 special tokens, 2 quote-led closing characters, 3 closing brackets,
        # 4 separators with them, 5 other), then the longer token
        preference = np.full(n_vocab, 5 << 16, dtype=np.int64)
        for token in range(min(n_vocab, tokenizer.n_vocab)):
            piece = tokenizer.piece(token)
            if _is_special(tokenizer, token):
                rank = 1
            elif piece and set(piece) <= _CLOSING_BYTES:
                rank = 2 if piece.startswith(b'"') else 3
            else:
                rank = 4 if piece and set(piece) <= _SEPARATOR_BYTES else 5
            preference[token] = (rank << 16) - min(len(piece), 0xFFFF)
        preference[tokenizer.eos] = 0
        self.preference = torch.from_numpy(preference)


def _is_special(tokenizer: Any, token: int) -> bool:
    """Whether llguidance treats `token` as special (lltokenizer_from_vocab's rule): a control token, or a
    user-defined one spelled like a marker, `<...>`. Text never matches it; only the grammar names it."""
    from engine.baseline.llama_load import llama_cpp

    L = llama_cpp()
    attr = L.llama_vocab_get_attr(tokenizer.vocab, token)
    if attr & L.LLAMA_TOKEN_ATTR_CONTROL:
        return True
    piece = tokenizer.piece(token, True)
    return bool(attr & L.LLAMA_TOKEN_ATTR_USER_DEFINED) and piece.startswith(b"<") and piece.endswith(b">")


_SUFFIX = re.compile(r'\[suffix=("(?:[^"\\]|\\.)*")')  # a Lark rule's suffix attribute, as a JSON string


_vocabularies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Tokenizer -> _Vocabulary
_vocabularies_lock = threading.Lock()


def _vocabulary(tokenizer: Any, n_vocab: int) -> _Vocabulary:
    with _vocabularies_lock:
        vocabulary = _vocabularies.get(tokenizer)
        if vocabulary is None or vocabulary.n_vocab != n_vocab:
            vocabulary = _vocabularies[tokenizer] = _Vocabulary(tokenizer, n_vocab)
        return vocabulary


class TokenGrammar:
    """A grammar's state over one generation. `tokenizer` is engine.runtime.tokenizer.Tokenizer;
    `n_vocab` the model's logit count (it may exceed the tokenizer's tokens: those are never allowed)."""

    def __init__(self, grammar: str, tokenizer: Any, n_vocab: int):
        import llguidance

        self._vocabulary = _vocabulary(tokenizer, n_vocab)
        self._matcher = llguidance.LLMatcher(self._vocabulary.lltokenizer, grammar)
        if self._matcher.is_error():
            raise UserError(f"the grammar cannot be used for constrained decoding: {self._matcher.get_error()}")
        self.n_vocab = n_vocab
        # The suffixes of the grammar's free-text rules, as tokens: what closes such a rule.
        self._closers = [tokens for text in {json.loads(m.group(1)) for m in _SUFFIX.finditer(grammar)}
                         if (tokens := tokenizer.encode(text))]
        self._recent: list[int] = []  # the last tokens accepted, as long as the longest closer

    def _mask(self, matcher: Any) -> torch.Tensor:
        bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        mask = torch.from_numpy(np.unpackbits(bits, bitorder="little")[:self.n_vocab].astype(bool))
        if not mask.any():
            raise RuntimeError(f"the grammar allows no token: {matcher.get_error()}")
        return mask

    def _closing_tokens(self, matcher: Any, mask: torch.Tensor, recent: list[int]) -> list[int]:
        """What the closing policy writes next: the end token or a special token where allowed, else the
        rest of a free-text rule's suffix that `recent` (the last tokens) began, or the whole suffix, where
        the grammar takes it, else the preferred allowed token."""
        preferred = int(torch.argmin(self._vocabulary.preference.masked_fill(~mask, 1 << 40)))
        if self._vocabulary.preference[preferred] >= 1 << 16:  # neither the end nor a special token
            for closer in self._closers:
                for begun in range(min(len(closer), len(recent) + 1) - 1, -1, -1):
                    if (begun == 0 or recent[-begun:] == closer[:begun]) and \
                            matcher.validate_tokens(closer[begun:]) == len(closer) - begun:
                        return closer[begun:]
        return [preferred]

    def _closes_within(self, token: int, budget: int) -> bool:
        """Whether `token`, then the closing policy, reach the end token in at most `budget` tokens."""
        matcher = self._matcher.deep_copy()
        matcher.consume_token(token)
        used, recent = 1, [*self._recent, token]
        while used < budget and not matcher.is_stopped():
            steps = self._closing_tokens(matcher, self._mask(matcher), recent)
            recent += steps
            if used + len(steps) > budget:
                return False
            for step in steps:
                matcher.consume_token(step)
            used += len(steps)
        return matcher.is_stopped()

    def allowed(self, budget: int, logits: torch.Tensor) -> torch.Tensor:
        """A bool mask [n_vocab] of the tokens to choose from next. `budget`: how many tokens may still
        be generated; `logits`: the model's row, which ranks the choices near the end of the budget."""
        mask = self._mask(self._matcher)
        if budget > CLOSING_WATCH:
            return mask
        closing = self._closing_tokens(self._matcher, mask, self._recent)[0]
        choices = torch.zeros_like(mask)
        choices[closing] = True  # closes within the budget whenever anything does
        likely = torch.topk(logits.float().cpu().masked_fill(~mask, -math.inf), min(WATCH_CHOICES, int(mask.sum())))
        for token in likely.indices.tolist():
            if token != closing and self._closes_within(token, budget):
                choices[token] = True
        return choices

    def accept(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: {self._matcher.get_error()}")
        if self._closers:
            self._recent = [*self._recent, token][-max(map(len, self._closers)):]

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more (generation should end here)."""
        return self._matcher.is_stopped()
