"""The engine's Python API: load a GGUF once, then stream generations from it.

    from engine.moe.hybrid import attach_hybrid

    engine = Engine.load("model.gguf", EngineConfig(device="cuda"), attach_experts=attach_hybrid)
    for event in engine.generate(Request(messages=[{"role": "user", "content": "Hi"}])):
        ...

One sequence runs at a time (the server queues requests). The KV cache of the previous
generation is kept, and a new prompt that starts with the same tokens reuses it.
"""
from __future__ import annotations

import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Union

import torch

from engine.config import Config
from engine.errors import UserError
from engine.layers.sampler import Sampler, SamplingParams, token_logprobs
from engine.plan.sizing import resolve_ctx
from engine.runtime.progress import ByteProgress, Progress
from engine.runtime.stops import StopMatcher, Utf8Decoder
from engine.runtime.telemetry import Telemetry
from engine.runtime.tokenizer import Tokenizer

# Replaces a built model's `experts` (engine/layers/moe.Experts) and returns the executor, which
# names its `kind` and carries `counters` for the telemetry: engine/moe/hybrid.attach_hybrid. It
# reports the bytes it copies (experts into RAM, into GPU slots) through the Progress it is given,
# within [0.5, 0.9] of the load.
AttachExperts = Callable[[Any, "EngineConfig", Progress], Any]


# The settings the engine shares with engine/config.Config: same names, defaults and checks.
SHARED_SETTINGS = ("threads", "prefill_chunk", "moe_expert_cache_size", "moe_expert_cache_mib",
                   "moe_gpu_miss_fraction", "moe_profile_adapt", "moe_expert_profile", "load_mode",
                   "vram_budget_mib")


@dataclass(frozen=True)
class EngineConfig:
    device: str = "cpu"  # a torch device (engine/config.resolve_device turns "auto" into one)
    n_ctx: int = Config.ctx  # Config's `ctx`: 0 is the model's training length
    threads: int | None = Config.threads
    prefill_chunk: int = Config.prefill_chunk
    moe_expert_cache_size: str | int = Config.moe_expert_cache_size
    moe_expert_cache_mib: int | None = Config.moe_expert_cache_mib
    moe_gpu_miss_fraction: str | float = Config.moe_gpu_miss_fraction
    moe_profile_adapt: str = Config.moe_profile_adapt
    moe_expert_profile: str | None = Config.moe_expert_profile
    load_mode: str = Config.load_mode
    vram_budget_mib: int | None = Config.vram_budget_mib

    def __post_init__(self) -> None:
        checked = Config(ctx=self.n_ctx, **{name: getattr(self, name) for name in SHARED_SETTINGS})
        for name in SHARED_SETTINGS:
            object.__setattr__(self, name, getattr(checked, name))

    @classmethod
    def from_settings(cls, settings: Config, device: str, **overrides: Any) -> EngineConfig:
        """The engine's part of the user's settings, on a resolved torch `device`; `overrides` win."""
        shared = {name: getattr(settings, name) for name in SHARED_SETTINGS}
        return cls(**{"device": device, "n_ctx": settings.ctx, **shared, **overrides})


@dataclass
class Request:
    prompt: Union[str, list[int], None] = None  # raw text, or token ids, or...
    messages: list[dict] | None = None  # ...chat messages rendered with the model's template
    max_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    tools: list[dict] | None = None  # function definitions the chat template renders (OpenAI's shape)
    grammar: str | None = None  # an llguidance grammar the output must match (engine/layers/grammar.py)
    logprobs: int | None = None  # None: off; N: each token's log-probability and the N most likely
    special_tokens: bool = False  # decode control tokens as their text (a tool-call parser reads the markers)


@dataclass
class TokenEvent:
    token: int | None  # None: text held back until the end (a possible stop string, split UTF-8)
    text: str  # the text this token releases (may be empty while a stop string or UTF-8 is pending)
    logprob: float | None = None  # with Request.logprobs: the model's log-probability of `token`
    top_logprobs: tuple[tuple[int, float], ...] = ()  # with Request.logprobs: (token, log-probability), best first


@dataclass
class DoneEvent:
    finish_reason: str  # "stop" (end-of-generation token or stop string), "length", "cancelled"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens whose KV came from the previous generation
    ttft_s: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    text: str  # the whole completion as emitted


Event = Union[TokenEvent, DoneEvent]


class ContextOverflow(UserError):
    pass


class Completion:
    """The text side of one generation, shared by both engines: token bytes through UTF-8
    decoding and stop-string matching, the held-back tail, and the closing DoneEvent."""

    def __init__(self, stop: tuple[str, ...]):
        self._stops, self._utf8 = StopMatcher(stop), Utf8Decoder()
        self._pieces: list[str] = []
        self.stop_hit = False

    def accept(self, token: int, tokenizer: Tokenizer, request: Request, logits: torch.Tensor | None
               ) -> TokenEvent | None:
        """The event for a sampled token, or None when it ends generation (end-of-generation
        token); after the event, `stop_hit` says whether a stop string ended it. `logits`: the
        row the token was sampled from, for the log-probabilities the request asked for."""
        if tokenizer.is_eog(token) and not request.ignore_eos:
            return None
        event = TokenEvent(token, self.feed(tokenizer.piece(token, request.special_tokens)))
        if request.logprobs is not None and logits is not None:
            event.logprob, event.top_logprobs = token_logprobs(logits, token, request.logprobs)
        return event

    def feed(self, piece: bytes) -> str:
        """The text that token bytes `piece` release now (sets stop_hit on a stop string)."""
        text, self.stop_hit = self._stops.feed(self._utf8.feed(piece))
        self._pieces.append(text)
        return text

    def tail(self) -> str:
        """Text held back for a possible stop string or split character, once generation ends."""
        if self.stop_hit:
            return ""
        tail, hit = self._stops.feed(self._utf8.flush())
        tail += "" if hit else self._stops.flush()
        self._pieces.append(tail)
        return tail

    def done(self, telemetry: Telemetry, reason: str, n_prompt: int, n_gen: int, reused: int,
             t0: float, t_first: float) -> DoneEvent:
        prefill_s, decode_s = t_first - t0, time.perf_counter() - t_first
        done = DoneEvent(
            finish_reason=reason, prompt_tokens=n_prompt, completion_tokens=n_gen, cached_tokens=reused,
            ttft_s=prefill_s, prefill_tokens_per_s=(n_prompt - reused) / prefill_s if prefill_s > 0 else 0.0,
            decode_tokens_per_s=(n_gen - 1) / decode_s if n_gen > 1 and decode_s > 0 else 0.0,
            text="".join(self._pieces))
        telemetry.request_done(done.prompt_tokens, done.completion_tokens, done.ttft_s,
                               done.prefill_tokens_per_s, done.decode_tokens_per_s)
        return done


def request_grammar(request: Request, tokenizer: Tokenizer, n_vocab: int):
    """The request's TokenGrammar (engine/layers/grammar.py), or None when its output is free."""
    if request.grammar is None:
        return None
    from engine.layers.grammar import TokenGrammar

    return TokenGrammar(request.grammar, tokenizer, n_vocab)


class Engine:
    def __init__(self, model, tokenizer: Tokenizer, config: EngineConfig):
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.n_ctx = resolve_ctx(config.n_ctx, model.config.n_ctx_train)
        self.cache = model.new_cache(self.n_ctx)
        self._cached: list[int] = []  # tokens whose K/V the cache holds, in order
        self._lock = threading.Lock()
        self.telemetry = Telemetry("moestudio", tokenizer.path.name)

    @classmethod
    def load(cls, path: str | Path, config: EngineConfig = EngineConfig(), progress: Progress | None = None,
             attach_experts: AttachExperts | None = None) -> "Engine":
        """Without `attach_experts` the model keeps its reference expert executor (every expert
        dequantized on the device: the exactness baseline); callers pass the hybrid executor's
        (engine/moe/hybrid.attach_hybrid), which the runtime does not import."""
        from engine.gguf.reader import ModelFile
        from engine.models import build_model

        report = progress or (lambda stage, fraction: None)
        if config.threads:
            torch.set_num_threads(config.threads)
        mf = ModelFile.open(path)
        # The builder takes every tensor once: dense weights are read (dequantized, or copied to the
        # GPU), experts mapped. Without an expert executor to attach, building is most of the load.
        reading = ByteProgress(report, "reading the model's tensors", sum(t.n_bytes for t in mf.tensors.values()),
                               0.0, 0.5 if attach_experts is not None else 0.9)
        mf.on_tensor = reading.add
        try:
            model = build_model(mf, config.device)
        finally:
            mf.on_tensor = None
        executor = None
        if attach_experts is not None:
            report("preparing the expert cache", 0.5)
            executor = attach_experts(model, config, report)
        report("loading tokenizer", 0.9)
        engine = cls(model, Tokenizer(path), config)
        if executor is not None:
            engine.telemetry.engine = executor.kind
            engine.telemetry.cache = executor.counters
        if torch.device(config.device).type == "cuda":
            report("compiling the GPU kernels (a minute or more the first time on this machine)", 0.95)
            engine.warm_up()
        report("ready", 1.0)
        return engine

    def warm_up(self) -> None:
        """Launches every kernel a request launches, once, so that the first reply does not wait
        for Triton to compile them (with an empty cache on the H200, Qwen3-30B-A3B geometry: the
        dense-product variants take 89 s one after another, 32 s compiled first in parallel
        threads (DecoderModel.compile_dense_kernels); the whole load 72 s against 225 s; milliseconds from
        Triton's disk cache). Triton compiles a variant per divisibility by 16 of each integer
        argument, and the one-token-to-eight-row products one per row count: so a chunk-long prompt step,
        one of an odd length at an odd position, one of each row count from 8 down to 2, then
        decode tokens (the decode graph's capture, and before it, where asked, the timing of each kind
        of layer's expert step form, engine/moe/step_form.py); the chunk at 0 is captured as the prompt
        graph there (engine/runtime/prompt_runner.py). Made-up tokens: the expert cache learns
        nothing from them (HybridExperts.learning_paused) and the KV cache is emptied after."""
        from engine.quant.triton_kernels import DENSE_MAX_ROWS

        lengths = [self.config.prefill_chunk, 37, *range(DENSE_MAX_ROWS, 1, -1), 1, 1]
        lengths[0] = min(lengths[0], self.n_ctx - 1 - sum(lengths[1:]))
        if lengths[0] < 1:
            return  # a context too small to hold the warm-up: the first request compiles instead
        self.model.compile_dense_kernels()
        tokens = torch.arange(sum(lengths)) * 7919 % self.model.config.n_vocab
        learning_paused = getattr(self.model.experts, "learning_paused", nullcontext)
        with learning_paused():
            start = 0
            for n in lengths:
                self.model.forward(tokens[start:start + n], self.cache, start, last_only=n > 1,
                                   graph=n == self.config.prefill_chunk)
                start += n
            self.model.settle()
        self.forget()

    def prompt_tokens(self, request: Request) -> list[int]:
        if request.messages is not None:
            text = self.tokenizer.render_chat(request.messages, tools=request.tools)
            return self.tokenizer.encode(text, parse_special=True)
        if isinstance(request.prompt, str):
            return self.tokenizer.encode(request.prompt, add_special=self.tokenizer.add_bos, parse_special=True)
        if request.prompt:
            return list(request.prompt)
        raise UserError("a request needs a prompt or messages")

    def forget(self) -> None:
        """Empties the cache: the next prefill evaluates its whole prompt."""
        self.cache.truncate(0)
        self._cached = []

    def prefill(self, tokens: list[int]) -> tuple[torch.Tensor, int]:
        """Evaluates what the cache lacks of `tokens`, in chunks of `prefill_chunk`; returns the
        last logits and the tokens reused. Chunks end on multiples of `prefill_chunk`, so that
        after a reused prefix (a chat's earlier turns) the full chunks start where a fresh
        prompt's do: full chunks are CUDA graph replays where they can be, one graph per start
        (engine/runtime/prompt_runner.py)."""
        reuse = 0
        for a, b in zip(self._cached, tokens):
            if a != b:
                break
            reuse += 1
        reuse = min(reuse, len(tokens) - 1)  # the last prompt token must run to give logits
        self.cache.truncate(reuse)
        self._cached = self._cached[:reuse]
        logits = None
        try:
            size, start = self.config.prefill_chunk, reuse
            while start < len(tokens):
                # /v1/stats shows the progress of a long prompt (the app: "processing prompt 1,536 / 4,000")
                self.telemetry.prefill_progress(start, len(tokens))
                chunk = tokens[start:(start // size + 1) * size]
                logits = self.model.forward(torch.tensor(chunk), self.cache, start, last_only=True,
                                            graph=len(chunk) == size)
                self._cached.extend(chunk)
                start += len(chunk)
        finally:
            self.telemetry.prefill_done()
        return logits[-1], reuse

    def generate(self, request: Request, cancel: threading.Event | None = None) -> Iterator[Event]:
        """Streams TokenEvents, then one DoneEvent. Holds the engine until the iterator ends."""
        with self._lock:
            yield from self._generate(request, cancel)

    def checked_prompt(self, request: Request) -> list[int]:
        """The request's prompt tokens, refused with a clear error if they cannot run."""
        prompt = self.prompt_tokens(request)
        if len(prompt) >= self.n_ctx:
            raise ContextOverflow(f"the prompt has {len(prompt)} tokens; the context holds {self.n_ctx} "
                                  "(shorten the prompt or start the engine with a larger -c)")
        if request.max_tokens < 1:
            raise UserError("max_tokens must be at least 1")
        return prompt

    def _generate(self, request: Request, cancel: threading.Event | None) -> Iterator[Event]:
        prompt = self.checked_prompt(request)
        n_vocab = self.model.config.n_vocab
        sampler = Sampler(request.sampling, n_vocab)
        grammar = request_grammar(request, self.tokenizer, n_vocab)
        completion = Completion(request.stop)
        t0 = time.perf_counter()
        logits, reused = self.prefill(prompt)
        t_first = time.perf_counter()
        history = list(prompt)
        reason, n_gen = "length", 0
        while n_gen < request.max_tokens:
            if cancel is not None and cancel.is_set():
                reason = "cancelled"
                break
            budget = min(request.max_tokens - n_gen, self.n_ctx - len(history))
            token = sampler.sample(logits.float(), history, grammar.allowed(budget, logits) if grammar else None)
            n_gen += 1
            self.telemetry.token_generated()
            history.append(token)
            event = completion.accept(token, self.tokenizer, request, logits)
            if event is not None:
                yield event
            if grammar is not None:
                grammar.accept(token)
            if event is None or completion.stop_hit or (grammar is not None and grammar.finished):
                reason = "stop"
                break
            if len(history) >= self.n_ctx:
                break
            logits = self.model.forward(torch.tensor([token]), self.cache, len(history) - 1)[-1]
            self._cached.append(token)
        self.model.settle()
        tail = completion.tail()
        if tail:
            yield TokenEvent(None, tail)
        yield completion.done(self.telemetry, reason, len(prompt), n_gen, reused, t0, t_first)
