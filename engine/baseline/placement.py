"""Placing a model's tensors in llama.cpp: the `--n-cpu-moe` split, without importing torch.

On a GPU build every layer goes to the GPU (n_gpu_layers = -1) except the expert tensors of the
first N layers, which a `tensor_buft_overrides` list pins to CPU memory, exactly what
llama.cpp's `--n-cpu-moe N` builds. This module stays free of torch: a CUDA build of llama.cpp
and torch's CUDA libraries crash when loaded into one process (seen on the GPU machine), so
the benchmark runs llama.cpp in a process of its own (engine/bench/llama_runner.py).
"""
from __future__ import annotations

import ctypes
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from engine.baseline.llama_load import llama_cpp, open_llama

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
