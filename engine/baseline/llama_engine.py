"""The ordinary llama.cpp engine (llama-cpp-python's `Llama`) behind the torch engine's interface.

`LlamaEngine` has what the server uses of `engine.runtime.engine.Engine`: `tokenizer`, `n_ctx`,
`telemetry`, `prompt_tokens(request)` and `generate(request, cancel)` streaming the same
TokenEvent/DoneEvent. It tokenizes, renders chat templates and matches stop strings with the
same code as the torch engine, so a request means the same thing on both.

GPU placement (`--n-cpu-moe` behaviour): on a llama.cpp build with GPU offload every layer goes
to the GPU (n_gpu_layers = -1) except the expert tensors of the first N layers, which a
`tensor_buft_overrides` list pins to CPU memory, exactly what llama.cpp's `--n-cpu-moe N`
builds. The project's llama-cpp-python is a CPU build, where no override is needed; the
override list itself is still built and loaded by the tests (pinning experts to the CPU
buffer type is a no-op there), but the GPU split can only be exercised on a GPU build.
"""
from __future__ import annotations

import ctypes
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from engine.baseline.llama_load import llama_cpp, open_llama
from engine.errors import UserError
from engine.runtime.engine import ContextOverflow, DoneEvent, Engine, Event, Request, TokenEvent
from engine.runtime.stops import StopMatcher, Utf8Decoder
from engine.runtime.telemetry import Telemetry
from engine.runtime.tokenizer import Tokenizer

# llama.cpp common/arg.cpp LLM_FFN_EXPS_REGEX: the routed expert tensors of a layer.
EXPERT_TENSORS = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"
_params_lock = threading.Lock()  # the default-params factory is patched process-wide while loading


class _BuftOverride(ctypes.Structure):
    """struct llama_model_tensor_buft_override (llama.h); llama-cpp-python does not bind it."""
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def _cpu_buffer_type() -> int:
    lib = ctypes.CDLL(str(Path(llama_cpp().__file__).parent / "lib" / "libggml-cpu.so"))
    lib.ggml_backend_cpu_buffer_type.restype = ctypes.c_void_p
    return lib.ggml_backend_cpu_buffer_type()


def cpu_moe_overrides(first_layers: int) -> ctypes.Array | None:
    """The NULL-terminated override list of `--n-cpu-moe first_layers` (None for 0)."""
    if first_layers <= 0:
        return None
    buft = _cpu_buffer_type()
    table = (_BuftOverride * (first_layers + 1))()  # zeroed: the last entry is the terminator
    for i in range(first_layers):
        # ctypes keeps the assigned bytes alive in the array's own references.
        table[i].pattern = f"blk\\.{i}{EXPERT_TENSORS}".encode()
        table[i].buft = buft
    return table


@contextmanager
def _model_params(overrides: ctypes.Array | None, progress: Callable[[float], None] | None):
    """Adds buffer overrides and a load-progress callback to the params `Llama` is built with.

    `Llama` exposes neither; `open_llama` builds its params through the llama_cpp module's
    default-params factory, so that factory is wrapped for the duration of the load.
    """
    L = llama_cpp()
    callback = L.llama_progress_callback((lambda fraction, _user: progress(fraction) or True) if progress
                                         else (lambda fraction, _user: True))
    original = L.llama_model_default_params

    def params():
        p = original()
        if overrides is not None:
            p.tensor_buft_overrides = ctypes.addressof(overrides)
        p.progress_callback = callback
        return p

    with _params_lock:
        L.llama_model_default_params = params
        try:
            yield
        finally:
            L.llama_model_default_params = original


def open_llama_with(path: str | Path, *, overrides: ctypes.Array | None = None,
                    progress: Callable[[float], None] | None = None, **kwargs):
    with _model_params(overrides, progress):
        return open_llama(path, **kwargs)


class LlamaEngine:
    def __init__(self, llm, tokenizer: Tokenizer):
        self.llm, self.tokenizer = llm, tokenizer
        self.n_ctx: int = llm.n_ctx()
        self.telemetry = Telemetry("llamacpp", tokenizer.path.name)  # cache stays None: no expert cache
        self._lock = threading.Lock()

    @classmethod
    def load(cls, path: str | Path, *, n_ctx: int, threads: int | None, load_mode: str = "mmap",
             n_cpu_moe: int = 0, progress: Callable[[str, float], None] | None = None) -> LlamaEngine:
        """`n_cpu_moe` applies only on a GPU build; on a CPU build everything is on the CPU anyway."""
        report = progress or (lambda stage, fraction: None)
        gpu = bool(llama_cpp().llama_supports_gpu_offload())
        overrides = cpu_moe_overrides(n_cpu_moe) if gpu else None
        report("loading the model into llama.cpp", 0.0)
        llm = open_llama_with(path, overrides=overrides, progress=lambda f: report("loading the model into llama.cpp", 0.9 * f),
                              n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads,
                              n_gpu_layers=-1 if gpu else 0, use_mmap=load_mode == "mmap")
        report("loading tokenizer", 0.9)
        engine = cls(llm, Tokenizer(path))
        report("ready", 1.0)
        return engine

    # The torch engine's: it only reads self.tokenizer, so both engines count prompts identically.
    prompt_tokens = Engine.prompt_tokens

    def generate(self, request: Request, cancel: threading.Event | None = None) -> Iterator[Event]:
        with self._lock:
            yield from self._generate(request, cancel)

    def _generate(self, request: Request, cancel: threading.Event | None) -> Iterator[Event]:
        prompt = self.prompt_tokens(request)
        if len(prompt) >= self.n_ctx:
            raise ContextOverflow(f"the prompt has {len(prompt)} tokens; the context holds {self.n_ctx} "
                                  "(shorten the prompt or start the engine with a larger -c)")
        if request.max_tokens < 1:
            raise UserError("max_tokens must be at least 1")
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
        stops, utf8 = StopMatcher(request.stop), Utf8Decoder()
        t0 = time.perf_counter()
        t_first = t0
        emitted: list[str] = []
        reason, n_gen, stop_hit = "length", 0, False
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
                if self.tokenizer.is_eog(token) and not request.ignore_eos:
                    reason = "stop"
                    break
                text, hit = stops.feed(utf8.feed(self.tokenizer.piece(token)))
                emitted.append(text)
                yield TokenEvent(token, text)
                if hit:
                    reason, stop_hit = "stop", True
                    break
                if n_gen >= request.max_tokens or len(prompt) + n_gen >= self.n_ctx:
                    break
        finally:
            tokens.close()
        if not stop_hit:
            tail, hit = stops.feed(utf8.flush())
            tail += "" if hit else stops.flush()
            if tail:
                emitted.append(tail)
                yield TokenEvent(None, tail)
        t_end = time.perf_counter()
        prefill_s, decode_s = t_first - t0, t_end - t_first
        done = DoneEvent(
            finish_reason=reason, prompt_tokens=len(prompt), completion_tokens=n_gen, cached_tokens=reused,
            ttft_s=prefill_s, prefill_tokens_per_s=(len(prompt) - reused) / prefill_s if prefill_s > 0 else 0.0,
            decode_tokens_per_s=(n_gen - 1) / decode_s if n_gen > 1 and decode_s > 0 else 0.0,
            text="".join(emitted))
        self.telemetry.request_done(done.prompt_tokens, done.completion_tokens, done.ttft_s,
                                    done.prefill_tokens_per_s, done.decode_tokens_per_s)
        yield done
