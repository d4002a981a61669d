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

import threading
import time
from pathlib import Path
from typing import Callable, Iterator

from engine.baseline.llama_load import llama_cpp
from engine.baseline.placement import cpu_moe_overrides, open_llama_with
from engine.runtime.engine import Completion, Engine, Event, Request, TokenEvent
from engine.runtime.telemetry import Telemetry
from engine.runtime.tokenizer import Tokenizer

class LlamaEngine:
    def __init__(self, llm, tokenizer: Tokenizer):
        self.llm, self.tokenizer = llm, tokenizer
        self.n_ctx: int = llm.n_ctx()
        self.telemetry = Telemetry("llamacpp", tokenizer.path.name)  # cache stays None: no expert cache
        self._lock = threading.Lock()

    @classmethod
    def load(cls, path: str | Path, *, n_ctx: int, threads: int | None, load_mode: str = "auto",
             n_cpu_moe: int = 0, progress: Callable[[str, float], None] | None = None) -> LlamaEngine:
        """`n_cpu_moe` applies only on a GPU build; on a CPU build everything is on the CPU anyway."""
        report = progress or (lambda stage, fraction: None)
        gpu = bool(llama_cpp().llama_supports_gpu_offload())
        overrides = cpu_moe_overrides(n_cpu_moe) if gpu else None
        report("loading the model into llama.cpp", 0.0)
        llm = open_llama_with(path, overrides=overrides, progress=lambda f: report("loading the model into llama.cpp", 0.9 * f),
                              n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads,
                              n_gpu_layers=-1 if gpu else 0, use_mmap=load_mode != "none")
        report("loading tokenizer", 0.9)
        engine = cls(llm, Tokenizer(path))
        report("ready", 1.0)
        return engine

    # The torch engine's: they only read self.tokenizer and self.n_ctx, so both engines count
    # and refuse prompts identically.
    prompt_tokens = Engine.prompt_tokens
    checked_prompt = Engine.checked_prompt

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
        t0 = time.perf_counter()
        t_first = t0
        reason, n_gen = "length", 0
        tokens = self.llm.generate(prompt, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p, temp=s.temperature,
                                   repeat_penalty=s.repeat_penalty, frequency_penalty=s.frequency_penalty,
                                   presence_penalty=s.presence_penalty)
        try:
            for token in tokens:
                if n_gen == 0:
                    t_first = time.perf_counter()
                if cancel is not None and cancel.is_set():
                    reason = "cancelled"
                    break
                n_gen += 1
                self.telemetry.token_generated()
                event = completion.accept(token, self.tokenizer, request.ignore_eos)
                if event is not None:
                    yield event
                if event is None or completion.stop_hit:
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
