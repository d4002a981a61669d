"""One generation as both APIs drive it: tokenize, check the context, queue, stream or collect.

The prompt is tokenized before queueing, so a request over the context length gets a 400
at once and usage counts come from the same token ids the engine runs. Streams start their
HTTP response only after the first event, so an engine error before any token still gets a
proper status code; while a request waits (in the queue or for its first token) a watcher
notices a client that disconnects and cancels the job.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, AsyncIterator

from starlette.requests import Request as HttpRequest

from engine.errors import UserError
from engine.server import request_log
from engine.server.errors import ApiError
from engine.server.tools import template_messages
from engine.server.worker import EngineWorker, Job


def ready_engine(worker: EngineWorker) -> Any:
    if worker.status == "loading":
        raise ApiError(503, f"the model is still loading ({round(100 * worker.progress)}%: {worker.stage}); "
                       "poll GET /health until its status is ok", code="model_loading")
    if worker.status == "error":
        raise ApiError(503, f"the model failed to load: {worker.error}", code="model_load_failed")
    return worker.engine


async def _prompt_tokens(engine: Any, request: Any, param: str) -> list[int]:
    try:  # chat templates and long prompts take a while: off the event loop
        return await asyncio.to_thread(engine.prompt_tokens, request)
    except UserError as e:
        raise ApiError(400, str(e), param=param) from None


async def _watch_disconnect(http: HttpRequest, job: Job) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass
    job.cancel.set()


@dataclass
class Outcome:
    text: str
    done: Any  # engine.runtime.engine.DoneEvent
    stop_sequence: str | None  # the stop string that ended it, if one did
    tokens: list[Any]  # the TokenEvents of sampled tokens (with log-probabilities when asked for)


class Generation:
    def __init__(self, worker: EngineWorker, job: Job, prompt_tokens: int, stops: tuple[str, ...]):
        self.worker, self.job, self.prompt_tokens, self.stops = worker, job, prompt_tokens, stops
        self.special_tokens = job.request.special_tokens
        self._tokens: list[int] = []
        self.done: Any = None  # the engine's DoneEvent, once it came
        request_log.attach(self)
        self._first: Any = None
        self._iter: AsyncIterator[Any] | None = None

    @classmethod
    async def start(cls, worker: EngineWorker, *, max_tokens: int | None, sampling: Any, stops: tuple[str, ...],
                    messages: list[dict] | None = None, prompt: str | list[int] | None = None,
                    param: str = "messages", grammar: str | None = None, logprobs: int | None = None,
                    tools: list[dict] | None = None, special_tokens: bool = False) -> Generation:
        """`grammar`: an llguidance grammar the output must match; `logprobs`: None, or how many
        alternatives each token's event lists; `tools`: function definitions for the chat template;
        `special_tokens`: decode special tokens as text, for a reply that is read in its model's format
        (engine/server/tools.Reading; always with tools)."""
        from engine.runtime.engine import Request

        engine = ready_engine(worker)
        if messages is not None:
            messages = template_messages(messages, engine.tokenizer)
        tokens = await _prompt_tokens(engine, Request(prompt=prompt, messages=messages, tools=tools), param)
        if len(tokens) >= engine.n_ctx:
            raise ApiError(400, f"the prompt is {len(tokens)} tokens long but the context holds {engine.n_ctx} "
                           "(shorten the prompt, or restart the server with a larger -c)", param=param,
                           code="context_length_exceeded")
        # Without max_tokens a generation runs until it stops or the context is full.
        limit = min(max_tokens or engine.n_ctx, engine.n_ctx - len(tokens))
        job = worker.submit(Request(prompt=tokens, max_tokens=limit, sampling=sampling, stop=stops, grammar=grammar,
                                    logprobs=logprobs, special_tokens=special_tokens or tools is not None))
        return cls(worker, job, len(tokens), stops)

    @property
    def generated_tokens(self) -> int:
        return len(self._tokens)

    @staticmethod
    async def count(worker: EngineWorker, *, messages: list[dict], tools: list[dict] | None = None) -> int:
        """How many tokens the prompt of `messages` (and `tools`) is, without generating."""
        from engine.runtime.engine import Request

        engine = ready_engine(worker)
        messages = template_messages(messages, engine.tokenizer)
        return len(await _prompt_tokens(engine, Request(messages=messages, tools=tools), "messages"))

    async def _events(self) -> AsyncIterator[Any]:
        try:
            async for event in self.job.stream():
                if getattr(event, "token", None) is not None:
                    self._tokens.append(event.token)
                if getattr(event, "finish_reason", None) is not None:
                    self.done = event
                yield event
        except UserError as e:
            raise ApiError(400, str(e)) from None
        except ApiError:
            raise
        except Exception as e:
            raise ApiError(500, f"generation failed: {type(e).__name__}: {e}") from None

    async def wait_first(self, http: HttpRequest) -> None:
        """Waits (queued, then prefilling) for the first event, cancelling the job if the client leaves."""
        self._iter = self._events().__aiter__()
        watcher = asyncio.create_task(_watch_disconnect(http, self.job))
        try:
            self._first = await self._iter.__anext__()
        except StopAsyncIteration:  # skipped in the queue: the client has already gone
            raise ApiError(400, "the client closed the request") from None
        except BaseException:
            self.job.cancel.set()
            raise
        finally:
            watcher.cancel()

    async def events(self) -> AsyncIterator[Any]:
        """All events (after wait_first). Leaving early, e.g. on disconnect, cancels the job."""
        try:
            yield self._first
            async for event in self._iter:
                yield event
        finally:
            self.job.cancel.set()  # a no-op once the job has finished

    async def collect(self, http: HttpRequest) -> Outcome:
        await self.wait_first(http)
        watcher = asyncio.create_task(_watch_disconnect(http, self.job))
        try:
            events = [e async for e in self.events()]
        finally:
            watcher.cancel()
        done = events[-1]
        sampled = [e for e in events[:-1] if e.token is not None]
        return Outcome(done.text, done, self.stop_sequence(done), sampled)

    def stop_sequence(self, done: Any) -> str | None:
        """Which stop string ended the generation: the one the raw token text holds where the output ends."""
        if done.finish_reason != "stop" or not self.stops:
            return None
        raw = self.worker.engine.tokenizer.decode(self._tokens, self.special_tokens)
        return next((s for s in self.stops if raw.startswith(s, len(done.text))), None)
