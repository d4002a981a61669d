"""The ordinary llama.cpp engine (llama-cpp-python's `Llama`) behind the torch engine's interface.

`LlamaEngine` has what the server uses of `engine.runtime.engine.Engine`: `tokenizer`, `n_ctx`,
`telemetry`, `prompt_tokens(request)` and `generate(request, cancel)` streaming the same
TokenEvent/DoneEvent. It tokenizes, renders chat templates and matches stop strings with the
same code as the torch engine, so a request means the same thing on both.

GPU placement (`--n-cpu-moe`) is engine/baseline/placement.py. The project's llama-cpp-python
is a CPU build, where no override is needed; the override list itself is still built and
loaded by the tests, but the GPU split can only be exercised on a GPU build.
"""
from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np
import torch

from engine.baseline.llama_load import llama_cpp
from engine.baseline.placement import cpu_moe_overrides, open_llama_with
from engine.config import Config
from engine.runtime.engine import Completion, Engine, Event, Request, TokenEvent, request_grammar
from engine.runtime.telemetry import Telemetry
from engine.runtime.tokenizer import Tokenizer

if TYPE_CHECKING:
    from engine.layers.grammar import TokenGrammar


def _masking(grammar: TokenGrammar, budget: Callable[[], int]) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """A llama-cpp-python logits processor that leaves only the tokens `grammar` allows; it runs first
    in llama.cpp's sampler chain, on the whole vocabulary in token order."""
    def apply(_input_ids: np.ndarray, logits: np.ndarray) -> np.ndarray:
        allowed = grammar.allowed(budget(), torch.from_numpy(logits))
        return np.where(allowed.numpy(), logits, -math.inf).astype(logits.dtype)
    return apply


class LlamaEngine:
    def __init__(self, llm, tokenizer: Tokenizer):
        self.llm, self.tokenizer = llm, tokenizer
        self.n_ctx: int = llm.n_ctx()
        self.telemetry = Telemetry("llamacpp", tokenizer.path.name)  # cache stays None: no expert cache
        self._lock = threading.Lock()

    @classmethod
    def load(cls, path: str | Path, *, n_ctx: int, threads: int | None, load_mode: str = "auto",
             n_cpu_moe: int = 0, prefill_chunk: int = Config.prefill_chunk,
             progress: Callable[[str, float], None] | None = None) -> LlamaEngine:
        """`n_cpu_moe` applies only on a GPU build; on a CPU build everything is on the CPU anyway."""
        report = progress or (lambda stage, fraction: None)
        gpu = bool(llama_cpp().llama_supports_gpu_offload())
        overrides = cpu_moe_overrides(n_cpu_moe) if gpu else None
        report("loading the model into llama.cpp", 0.0)
        llm = open_llama_with(path, overrides=overrides, progress=lambda f: report("loading the model into llama.cpp", 0.9 * f),
                              n_ctx=n_ctx, n_batch=prefill_chunk, n_threads=threads, n_threads_batch=threads,
                              n_gpu_layers=-1 if gpu else 0, use_mmap=load_mode != "none")
        report("loading tokenizer", 0.9)
        engine = cls(llm, Tokenizer(path))
        report("ready", 1.0)
        return engine

    # The torch engine's: they only read self.tokenizer and self.n_ctx, so both engines count
    # and refuse prompts identically.
    prompt_tokens = Engine.prompt_tokens
    checked_prompt = Engine.checked_prompt

    def _read_prompt(self, prompt: list[int], reused: int, cancel: threading.Event | None) -> bool:
        """Evaluates the prompt but its last token in chunks of n_batch, reporting progress in the
        telemetry as the torch engine does; Llama.generate then finds all but the last token
        cached and evaluates that one. False when cancelled on the way."""
        end, step = len(prompt) - 1, self.llm.n_batch
        if end - reused <= step:
            return True  # one chunk: nothing to report between chunks
        self.llm.n_tokens = reused  # the prefix generate would keep; eval drops the cache after it
        try:
            for start in range(reused, end, step):
                if cancel is not None and cancel.is_set():
                    return False
                self.telemetry.prefill_progress(start, len(prompt))
                self.llm.eval(prompt[start:min(start + step, end)])
        finally:
            self.telemetry.prefill_done()
        return True

    def _last_logits(self) -> torch.Tensor:
        """The logits the token just sampled came from: `Llama.generate` yields each token before it
        evaluates it, so the context's last output row is still that distribution."""
        L = llama_cpp()
        n_vocab = self.llm.n_vocab()
        row = L.llama_get_logits_ith(self.llm.ctx, -1)
        return torch.from_numpy(np.ctypeslib.as_array(row, shape=(n_vocab,)).copy())

    def generate(self, request: Request, cancel: threading.Event | None = None) -> Iterator[Event]:
        with self._lock:
            yield from self._generate(request, cancel)

    def _generate(self, request: Request, cancel: threading.Event | None) -> Iterator[Event]:
        prompt = self.checked_prompt(request)
        s = request.sampling
        L = llama_cpp()
        self.llm.set_seed(L.LLAMA_DEFAULT_SEED if s.seed is None else s.seed & 0xFFFFFFFF)
        self.llm.last_n_tokens_size = s.penalty_last_n
        reused = 0
        for a, b in zip(self.llm._input_ids, prompt):  # what Llama.generate will keep of its KV cache
            if a != b:
                break
            reused += 1
        reused = min(reused, len(prompt) - 1)
        completion = Completion(request.stop)
        grammar = request_grammar(request, self.tokenizer, self.llm.n_vocab())
        t0 = time.perf_counter()
        t_first = t0
        reason, n_gen = "length", 0

        if not self._read_prompt(prompt, reused, cancel):
            yield completion.done(self.telemetry, "cancelled", len(prompt), 0, reused, t0, time.perf_counter())
            return

        def budget() -> int:  # the tokens still allowed, read by the grammar as generation goes on
            return min(request.max_tokens - n_gen, self.n_ctx - len(prompt) - n_gen)
        tokens = self.llm.generate(prompt, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p, temp=s.temperature,
                                   repeat_penalty=s.repeat_penalty, frequency_penalty=s.frequency_penalty,
                                   presence_penalty=s.presence_penalty,
                                   logits_processor=None if grammar is None else [_masking(grammar, budget)])
        try:
            for token in tokens:
                if n_gen == 0:
                    t_first = time.perf_counter()
                if cancel is not None and cancel.is_set():
                    reason = "cancelled"
                    break
                n_gen += 1
                self.telemetry.token_generated()
                event = completion.accept(token, self.tokenizer, request,
                                          self._last_logits() if request.logprobs is not None else None)
                if event is not None:
                    yield event
                if grammar is not None:
                    grammar.accept(token)
                if event is None or completion.stop_hit or (grammar is not None and grammar.finished):
                    reason = "stop"
                    break
                if n_gen >= request.max_tokens or len(prompt) + n_gen >= self.n_ctx:
                    break
        finally:
            tokens.close()
        tail = completion.tail()
        if tail:
            yield TokenEvent(None, tail)
        yield completion.done(self.telemetry, reason, len(prompt), n_gen, reused, t0, t_first)
