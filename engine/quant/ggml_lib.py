"""ctypes access to the libggml that llama-cpp-python ships (CPU backend).

Only what the engine uses is bound here; the library is loaded once, globally, so that
libggml-cpu resolves its symbols against the same libggml-base that llama.cpp uses.
"""
from __future__ import annotations

import ctypes as C
from functools import lru_cache
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT


class GGMLNotFound(RuntimeError):
    pass


def _lib_dir() -> Path:
    try:
        import llama_cpp
    except ImportError as e:  # pragma: no cover - the setup installs it
        raise GGMLNotFound("llama-cpp-python is not installed; run ./dev.sh setup") from e
    lib = Path(llama_cpp.__file__).parent / "lib"
    if not (lib / "libggml-base.so").exists():
        raise GGMLNotFound(f"libggml-base.so not found in {lib}")
    return lib


@lru_cache(maxsize=1)
def base() -> C.CDLL:
    lib = C.CDLL(str(_lib_dir() / "libggml-base.so"), mode=C.RTLD_GLOBAL)
    lib.ggml_quantize_chunk.restype = C.c_size_t
    lib.ggml_quantize_chunk.argtypes = [C.c_int, C.c_void_p, C.c_void_p, C.c_int64, C.c_int64, C.c_int64, C.c_void_p]
    lib.ggml_quantize_init.argtypes = [C.c_int]
    lib.ggml_row_size.restype = C.c_size_t
    lib.ggml_row_size.argtypes = [C.c_int, C.c_int64]
    lib.ggml_quantize_requires_imatrix.restype = C.c_bool
    lib.ggml_quantize_requires_imatrix.argtypes = [C.c_int]
    return lib


def row_size(qtype: QT, n_per_row: int) -> int:
    """Bytes of one row of `n_per_row` values stored as `qtype`."""
    return int(base().ggml_row_size(int(qtype), n_per_row))


def quantize(values: np.ndarray, qtype: QT) -> np.ndarray:
    """Quantizes float rows (last axis) to `qtype` with ggml's own quantizer.

    Returns uint8 blocks shaped like `values` with the last axis replaced by the row's byte
    size, ready for `GGUFWriter.add_tensor(..., raw_dtype=qtype)`.
    """
    src = np.ascontiguousarray(values, dtype=np.float32)
    n_per_row = src.shape[-1]
    nrows = src.size // n_per_row
    lib = base()
    if lib.ggml_quantize_requires_imatrix(int(qtype)):
        raise ValueError(f"{qtype.name} needs an importance matrix; the factory does not make those")
    dst = np.empty(src.shape[:-1] + (row_size(qtype, n_per_row),), dtype=np.uint8)
    lib.ggml_quantize_init(int(qtype))
    written = lib.ggml_quantize_chunk(int(qtype), src.ctypes.data, dst.ctypes.data, 0, nrows, n_per_row, None)
    if written != dst.nbytes:
        raise RuntimeError(f"ggml_quantize_chunk wrote {written} bytes, expected {dst.nbytes}")
    return dst


class GGMLTensor(C.Structure):
    """Mirror of `struct ggml_tensor` (ggml.h) for the ggml that llama-cpp-python 0.3.36 vendors."""


GGMLTensor._fields_ = [
    ("type", C.c_int), ("buffer", C.c_void_p), ("ne", C.c_int64 * 4), ("nb", C.c_size_t * 4),
    ("op", C.c_int), ("op_params", C.c_int32 * 16), ("flags", C.c_int32), ("src", C.POINTER(GGMLTensor) * 10),
    ("view_src", C.POINTER(GGMLTensor)), ("view_offs", C.c_size_t), ("data", C.c_void_p),
    ("name", C.c_char * 64), ("extra", C.c_void_p), ("padding", C.c_char * 8),
]


def tensor_to_numpy(ptr: int, dtype: np.dtype) -> np.ndarray:
    """Copies a computed tensor (any backend, views included) into a numpy array.

    The result is shaped like ggml's `ne` reversed. Views (the router's top-k is a view into
    its argsort) are read over their whole byte span and then strided as ggml strides them.
    """
    lib = base()
    lib.ggml_backend_tensor_get.argtypes = [C.c_void_p, C.c_void_p, C.c_size_t, C.c_size_t]
    lib.ggml_nbytes.restype = C.c_size_t
    lib.ggml_nbytes.argtypes = [C.c_void_p]
    t = C.cast(C.c_void_p(ptr), C.POINTER(GGMLTensor)).contents
    dtype = np.dtype(dtype)
    span = int(lib.ggml_nbytes(ptr))
    raw = np.empty(span, dtype=np.uint8)
    lib.ggml_backend_tensor_get(ptr, raw.ctypes.data, 0, span)
    shape = tuple(int(n) for n in reversed(t.ne))
    strides = tuple(int(n) for n in reversed(t.nb))
    if strides[-1] != dtype.itemsize:
        raise ValueError(f"tensor {t.name.decode()} does not hold {dtype.name} elements")
    return np.ndarray(shape, dtype=dtype, buffer=raw, strides=strides).copy()


# --- graph building and CPU compute (the CPU expert pool) ---------------------------------

class GGMLInitParams(C.Structure):
    _fields_ = [("mem_size", C.c_size_t), ("mem_buffer", C.c_void_p), ("no_alloc", C.c_bool)]


class GGMLCPlan(C.Structure):
    """Mirror of `struct ggml_cplan` (ggml-cpu.h)."""

    _fields_ = [("work_size", C.c_size_t), ("work_data", C.c_void_p), ("n_threads", C.c_int),
                ("threadpool", C.c_void_p), ("abort_callback", C.c_void_p), ("abort_callback_data", C.c_void_p),
                ("use_ref", C.c_bool)]


class GGMLThreadpoolParams(C.Structure):
    """Mirror of `struct ggml_threadpool_params` (ggml.h; GGML_MAX_N_THREADS = 512)."""

    _fields_ = [("cpumask", C.c_bool * 512), ("n_threads", C.c_int), ("prio", C.c_int), ("poll", C.c_uint32),
                ("strict_cpu", C.c_bool), ("paused", C.c_bool)]


GGML_TYPE_F32, GGML_TYPE_I32 = 0, 26
GGML_STATUS_SUCCESS = 0

_VP, _I64 = C.c_void_p, C.c_int64
# name: (restype, argtypes); tensors, contexts, graphs and threadpools travel as void pointers.
_BASE_GRAPH_API = {
    "ggml_init": (_VP, [GGMLInitParams]),
    "ggml_free": (None, [_VP]),
    "ggml_reset": (None, [_VP]),
    "ggml_tensor_overhead": (C.c_size_t, []),
    "ggml_graph_overhead_custom": (C.c_size_t, [C.c_size_t, C.c_bool]),
    "ggml_nbytes": (C.c_size_t, [_VP]),
    "ggml_new_tensor_2d": (_VP, [_VP, C.c_int, _I64, _I64]),
    "ggml_new_tensor_3d": (_VP, [_VP, C.c_int, _I64, _I64, _I64]),
    "ggml_mul_mat_id": (_VP, [_VP, _VP, _VP, _VP]),
    "ggml_add_id": (_VP, [_VP, _VP, _VP, _VP]),
    "ggml_swiglu_split": (_VP, [_VP, _VP, _VP]),
    "ggml_swiglu_oai": (_VP, [_VP, _VP, _VP, C.c_float, C.c_float]),
    "ggml_new_graph_custom": (_VP, [_VP, C.c_size_t, C.c_bool]),
    "ggml_build_forward_expand": (None, [_VP, _VP]),
    "ggml_threadpool_params_default": (GGMLThreadpoolParams, [C.c_int]),
}
_CPU_API = {
    "ggml_cpu_init": (None, []),
    "ggml_threadpool_new": (_VP, [C.POINTER(GGMLThreadpoolParams)]),
    "ggml_threadpool_free": (None, [_VP]),
    "ggml_graph_plan": (GGMLCPlan, [_VP, C.c_int, _VP]),
    "ggml_graph_compute": (C.c_int, [_VP, C.POINTER(GGMLCPlan)]),
}


class GGMLApi:
    """The graph-building half of libggml-base and the compute half of libggml-cpu, typed.

    Attribute access finds a function in whichever library defines it; ctypes releases the GIL
    for every call, so `ggml_graph_compute` runs while other Python threads proceed.
    """

    def __init__(self, base_lib: C.CDLL, cpu_lib: C.CDLL):
        for lib, table in ((base_lib, _BASE_GRAPH_API), (cpu_lib, _CPU_API)):
            for name, (restype, argtypes) in table.items():
                fn = getattr(lib, name)
                fn.restype, fn.argtypes = restype, argtypes
                setattr(self, name, fn)


@lru_cache(maxsize=1)
def cpu() -> GGMLApi:
    """libggml-cpu, loaded against the global libggml-base and initialised (ggml_cpu_init)."""
    b = base()
    api = GGMLApi(b, C.CDLL(str(_lib_dir() / "libggml-cpu.so"), mode=C.RTLD_GLOBAL))
    api.ggml_cpu_init()
    return api


def tensor(ptr: int) -> GGMLTensor:
    """The struct behind a tensor pointer (fields are live: writes go to ggml's memory)."""
    return C.cast(C.c_void_p(ptr), C.POINTER(GGMLTensor)).contents
