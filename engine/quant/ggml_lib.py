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
