"""Writes a synthetic MoE model as a GGUF file that stock llama.cpp loads and runs."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGML_QUANT_SIZES, GGUFWriter

from engine.quant.ggml_lib import quantize
from engine.synth import tokenizer
from engine.synth.layout import TensorSpec, layout
from engine.synth.routing import Routing
from engine.synth.spec import ModelSpec
from engine.synth.weights import WeightMaker

Progress = Callable[[int, int, str], None]  # (bytes written, total bytes, tensor name)


def _encode(t: TensorSpec, values: np.ndarray) -> np.ndarray:
    if values.dtype == np.uint8:  # already quantized blocks
        return values
    if t.qtype == QT.F32:
        return values.astype(np.float32, copy=False)
    if t.qtype == QT.F16:
        return values.astype(np.float16)
    return quantize(values, t.qtype)


def _add_metadata(w: GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, (list, tuple)):
        w.add_array(key, list(value))
    else:
        raise TypeError(f"metadata {key}: unsupported value {value!r}")


def write_model(path: str | os.PathLike, spec: ModelSpec, routing: Routing, seed: int = 0,
                progress: Progress | None = None) -> Path:
    """Writes `spec` with `routing`-shaped weights to `path`; deterministic in `seed`.

    Tensors are generated and written one at a time, so memory stays at about the size of
    the largest tensor. The file is written under a temporary name and renamed at the end:
    an interrupted write never leaves a truncated model behind.
    """
    path = Path(path)
    lay = layout(spec, tokenizer.vocab_size(spec.chat))
    maker = WeightMaker(spec, routing, seed)

    tmp = path.with_name(path.name + ".partial")
    w = GGUFWriter(tmp, spec.arch)
    w.add_name(f"MoE Studio synthetic {spec.name or spec.arch} (random weights, routing {routing.name})")
    w.add_string("moestudio.synth.routing", routing.name)
    w.add_uint32("moestudio.synth.seed", seed)
    w.add_file_type(int(spec.expert_qtype))
    for key, value in lay.metadata.items():
        _add_metadata(w, key, value)
    tokenizer.add_tokenizer(w, spec.chat)


    for t in lay.tensors:
        block, type_size = GGML_QUANT_SIZES[t.qtype]
        nbytes = int(np.prod(t.shape)) // block * type_size
        w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), nbytes, raw_dtype=t.qtype)
    total = sum(ti.nbytes for ti in w.tensors[0].values())

    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        done = 0
        for t in lay.tensors:
            data = _encode(t, maker.make(t))
            w.write_tensor_data(data)
            done += data.nbytes
            if progress:
                progress(done, total, t.name)
        w.close()
        os.replace(tmp, path)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    return path
