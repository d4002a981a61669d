"""Loading models into llama.cpp (llama-cpp-python's low-level API) the way this project needs.

llama.cpp's CPU "extra buffer types" (AMX and weight repacking) crash in llama_decode on
AMX-capable CPUs for 2-D Q8_0/Q4_K weights (gdb: ggml_backend_amx_mul_mat; llama-cpp-python
0.3.36). Every load here turns them off (`use_extra_bufts = False`), at some CPU speed cost.

llama.cpp says why a load failed only in its log ("unknown model architecture: 'foomoe'"); the
log callback keeps the error lines of the load running on each thread, so a failed load raises
a UserError carrying llama.cpp's own reason whether or not MOESTUDIO_LLAMA_LOG shows the log.
"""
from __future__ import annotations

import contextlib
import os
import re
import threading
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Iterator

from engine.errors import UserError


_log_callback = None  # llama.cpp keeps the pointer: the callback must outlive every call
# ggml_log_level (ggml.h): an ERROR message may continue in CONT pieces.
_GGML_LOG_ERROR, _GGML_LOG_CONT = 4, 5
_load_log = threading.local()  # .errors: the error text of the load running on this thread, or None


@lru_cache(maxsize=1)
def llama_cpp() -> ModuleType:
    """The llama_cpp module, initialised once, its log routed through MOESTUDIO_LLAMA_LOG."""
    global _log_callback
    import llama_cpp as L

    L.llama_backend_init()
    _log_callback = L.llama_log_callback(_log)
    L.llama_log_set(_log_callback, None)
    return L


def _log(level, text, _user) -> None:  # noqa: ANN001 - C callback
    message = text.decode(errors="replace")
    errors = getattr(_load_log, "errors", None)
    if errors is not None and (level == _GGML_LOG_ERROR or (level == _GGML_LOG_CONT and errors)):
        errors.append(message)
    if os.environ.get("MOESTUDIO_LLAMA_LOG"):
        print(message, end="")


@contextlib.contextmanager
def _capturing_errors():
    """Collects llama.cpp's error log lines of this thread into the yielded list."""
    errors: list[str] = []
    _load_log.errors = errors
    try:
        yield errors
    finally:
        _load_log.errors = None


def _reason(errors: list[str]) -> str:
    """llama.cpp's first error line without its function-name prefix ("llama_model_load: ...")."""
    lines = [line.strip() for line in "".join(errors).splitlines() if line.strip()]
    if not lines:
        return "llama.cpp logged no reason (set MOESTUDIO_LLAMA_LOG=1 to see its whole log)"
    first = re.sub(r"^\w+: ", "", lines[0])
    return re.sub(r"^error loading model: ", "", first)


class LlamaLoadError(UserError):
    """llama.cpp refused a model file; `reason` is llama.cpp's own message."""

    def __init__(self, path: str | Path, reason: str):
        super().__init__(f"llama.cpp could not load {os.fsdecode(path)}: {reason}")
        self.reason = reason


def model_params(n_gpu_layers: int = 0):
    L = llama_cpp()
    p = L.llama_model_default_params()
    p.n_gpu_layers = n_gpu_layers
    p.use_extra_bufts = False
    return p


def load_model(path: str | Path, *, vocab_only: bool = False, n_gpu_layers: int = 0):
    """A llama_model pointer; the caller frees it with llama_model_free."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"no such model file: {path}")
    L = llama_cpp()
    p = model_params(n_gpu_layers)
    p.vocab_only = vocab_only
    with _capturing_errors() as errors:
        model = L.llama_model_load_from_file(os.fsencode(path), p)  # the OS's bytes: any file name loads
    if not model:
        raise LlamaLoadError(path, _reason(errors))
    return model


def llamacpp_refusal(path: str | Path) -> str | None:
    """Why llama.cpp cannot run this file (its own message), or None; reads the header and the
    vocabulary only, where llama.cpp checks the architecture and its hyperparameters."""
    try:
        L = llama_cpp()
        L.llama_model_free(load_model(path, vocab_only=True))
    except LlamaLoadError as e:
        return e.reason
    return None


@contextlib.contextmanager
def loaded_model(path: str | Path, **kwargs):
    L = llama_cpp()
    model = load_model(path, **kwargs)
    try:
        yield model
    finally:
        L.llama_model_free(model)


def open_llama(path: str | Path, **kwargs):
    """A high-level `llama_cpp.Llama` with the same workaround as `load_model`.

    `Llama` builds its model parameters itself and exposes no `use_extra_bufts`, so its
    default-parameter factory is swapped for the duration of the constructor.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"no such model file: {path}")
    L = llama_cpp()
    import llama_cpp.llama as high_level

    original = high_level.llama_cpp.llama_model_default_params
    high_level.llama_cpp.llama_model_default_params = lambda: model_params(kwargs.get("n_gpu_layers", 0))
    try:
        with _utf8_path(path) as name, _capturing_errors() as errors:
            return high_level.Llama(model_path=name, verbose=False, **kwargs)
    except ValueError:  # `Llama` says only "Failed to load model from file"; llama.cpp logged why
        raise LlamaLoadError(path, _reason(errors)) from None
    finally:
        high_level.llama_cpp.llama_model_default_params = original


@contextlib.contextmanager
def _utf8_path(path: Path) -> Iterator[str]:
    """A name for `path` that `Llama` can encode: it encodes model_path as UTF-8, which a file name
    of other bytes (POSIX) is not, so such a file is opened and named through /proc/self/fd."""
    name = str(path)
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        fd = os.open(path, os.O_RDONLY)
        try:
            yield f"/proc/self/fd/{fd}"  # llama.cpp maps the file; the map outlives the descriptor
        finally:
            os.close(fd)
        return
    yield name
