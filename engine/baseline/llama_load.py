"""Loading models into llama.cpp (llama-cpp-python's low-level API) the way this project needs.

llama.cpp's CPU "extra buffer types" (AMX and weight repacking) crash in llama_decode on
AMX-capable CPUs for 2-D Q8_0/Q4_K weights (gdb: ggml_backend_amx_mul_mat; llama-cpp-python
0.3.36). Every load here turns them off (`use_extra_bufts = False`), at some CPU speed cost.
"""
from __future__ import annotations

import contextlib
import os
from functools import lru_cache
from pathlib import Path
from types import ModuleType

from engine.errors import UserError


_log_callback = None  # llama.cpp keeps the pointer: the callback must outlive every call


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
    if os.environ.get("MOESTUDIO_LLAMA_LOG"):
        print(text.decode(errors="replace"), end="")


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
    model = L.llama_model_load_from_file(str(path).encode(), p)
    if not model:
        raise UserError(f"llama.cpp could not load {path} (set MOESTUDIO_LLAMA_LOG=1 to see why)")
    return model


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
        return high_level.Llama(model_path=str(path), verbose=False, **kwargs)
    except ValueError as e:
        raise UserError(f"llama.cpp could not load {path}: {e}") from None
    finally:
        high_level.llama_cpp.llama_model_default_params = original
