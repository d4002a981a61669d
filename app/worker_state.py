"""The engine worker's life, without Qt: states, crash causes, the restart policy.

The Qt side (app/engine_manager.py) feeds events in (process started, /health answered,
process exited) and acts on what this module decides, so every rule here is testable
without a process.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from enum import Enum


class State(str, Enum):
    STOPPED = "stopped"  # no worker (never started, or stopped on purpose)
    STARTING = "starting"  # process launched, /health not answering yet (Python and torch importing)
    LOADING = "loading"  # /health answers "loading": the model is being read
    READY = "ready"  # /health answers "ok"
    STOPPING = "stopping"  # terminate sent, waiting for the exit
    CRASHED = "crashed"  # exited (or /health said "error") without being asked to

    @property
    def running(self) -> bool:
        return self in (State.STARTING, State.LOADING, State.READY)


class Cause(str, Enum):
    GPU_OOM = "gpu_oom"
    BAD_MODEL = "bad_model"
    PORT_IN_USE = "port_in_use"
    BAD_SETTINGS = "bad_settings"
    OTHER = "other"


TITLES = {
    Cause.GPU_OOM: "The engine ran out of GPU memory",
    Cause.BAD_MODEL: "The engine could not load this model",
    Cause.PORT_IN_USE: "The engine's port was already in use",
    Cause.BAD_SETTINGS: "The engine refused its settings",
    Cause.OTHER: "The engine stopped unexpectedly",
}
ADVICE = {
    Cause.GPU_OOM: "Lower the expert cache size (or set a VRAM budget) in the setup wizard's plan page, "
                   "close other programs that use the GPU, or shorten the context.",
    Cause.BAD_MODEL: "Check that the file is a complete GGUF model (a download may have been cut short). "
                     "Models this engine cannot compute run with the llama.cpp engine (Settings: engine = llamacpp).",
    Cause.PORT_IN_USE: "Another program holds the port: choose another one in the API tab.",
    Cause.BAD_SETTINGS: "Fix the setting named above in the Settings tab or the setup wizard.",
    Cause.OTHER: "The log tail below shows the last thing the engine said.",
}

_PATTERNS: list[tuple[Cause, re.Pattern[str]]] = [
    (Cause.GPU_OOM, re.compile(r"CUDA out of memory|OutOfMemoryError|cudaErrorMemoryAllocation|"
                               r"CUBLAS_STATUS_ALLOC_FAILED|out of (GPU|device) memory|"
                               r"failed to allocate .*(CUDA|GPU|VRAM)|ggml_backend_cuda.*alloc", re.I)),
    (Cause.PORT_IN_USE, re.compile(r"address already in use|errno 98\b|errno 48\b|"
                                   r"only one usage of each socket address|port \d+ (on \S+ )?is (already )?in use", re.I)),
    (Cause.BAD_MODEL, re.compile(r"GGUFError|not a GGUF|invalid GGUF|bad magic|cannot read .*\.gguf|"
                                 r"no such (model )?file|is not supported by the MoE Studio engine|"
                                 r"quantization type .* is not supported|unknown model architecture|"
                                 r"failed to load model|is not a Mixture-of-Experts model|truncated|"
                                 r"unexpected end of (file|data)", re.I)),
]
_USER_ERROR = re.compile(r"^moestudio(?: serve)?: error: (.*)$", re.M)


@dataclass(frozen=True)
class Crash:
    cause: Cause
    summary: str  # one line: the error the engine printed, or how the process ended
    tail: str  # the last lines of its stderr
    exit_code: int | None

    @property
    def title(self) -> str:
        return TITLES[self.cause]

    @property
    def advice(self) -> str:
        return ADVICE[self.cause]

    def details(self) -> str:
        return f"{self.title}\n{self.summary}\n\n{self.advice}\n\n--- engine output (last lines) ---\n{self.tail}"


def classify_crash(tail: str, exit_code: int | None = None, signal_name: str | None = None,
                   error: str | None = None) -> Crash:
    """What went wrong, from the stderr tail (and /health's error text, when it gave one)."""
    text = "\n".join(t for t in (error, tail) if t)
    cause = next((c for c, pat in _PATTERNS if pat.search(text)), None)
    user_errors = _USER_ERROR.findall(text)
    if cause is None:
        cause = Cause.BAD_SETTINGS if user_errors and exit_code == 2 else Cause.OTHER
    if error:
        summary = error.strip().splitlines()[-1] if error.strip() else error
    elif user_errors:
        summary = user_errors[-1]
    else:
        last_exc = [ln for ln in tail.splitlines() if re.match(r"^\w*(Error|Exception)\b", ln)]
        if last_exc:
            summary = last_exc[-1]
        elif signal_name:
            summary = f"the engine process was killed ({signal_name})"
        else:
            summary = f"the engine process exited with code {exit_code}"
    return Crash(cause, summary.strip()[:500], tail, exit_code)


class RestartPolicy:
    """Restart a crashed worker automatically at most `max_restarts` times in a row.

    A run that stayed ready for `stable_s` seconds resets the count (jupyter_client's
    KernelRestarter rule). Crashes that would only repeat (a bad model, bad settings, no GPU
    memory for this plan) are never retried automatically: the user has to change something.
    """

    RETRYABLE = (Cause.OTHER, Cause.PORT_IN_USE)

    def __init__(self, max_restarts: int = 3, stable_s: float = 30.0, clock=time.monotonic):
        self.max_restarts, self.stable_s, self.clock = max_restarts, stable_s, clock
        self.restarts_in_row = 0
        self._ready_since: float | None = None

    def on_start(self) -> None:
        self._ready_since = None

    def on_ready(self) -> None:
        self._ready_since = self.clock()

    def should_restart(self, crash: Crash) -> bool:
        if self._ready_since is not None and self.clock() - self._ready_since >= self.stable_s:
            self.restarts_in_row = 0
        self._ready_since = None
        if crash.cause not in self.RETRYABLE or self.restarts_in_row >= self.max_restarts:
            return False
        self.restarts_in_row += 1
        return True

    def reset(self) -> None:
        self.restarts_in_row = 0
        self._ready_since = None
