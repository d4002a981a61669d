"""Decode rates the engines measured on this machine, kept per model file and conditions, so
the plan shows what this machine did rather than an estimate once a model has run here.

The server records each finished generation of at least MIN_TOKENS tokens (engine/server/
worker.py); the planner (`moestudio plan`, the wizard) looks the record up for the engine,
device, threads and expert-cache size it plans. Stored as JSON in the user cache directory,
one file per model (keyed by engine/gguf/fingerprint.file_fingerprint), the last KEEP rates per
condition; the figure is their median, robust to one request that shared the CPU with something
else.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

MIN_TOKENS = 16  # shorter generations time mostly their first steps
KEEP = 8


def condition(engine: str, device: str, threads: int, slots: int) -> str:
    """The key of a measurement: what it depends on beyond the file. `device` is a torch device
    name ("cpu", "cuda", "cuda:1": any CUDA device counts as one); `slots` is the expert cache's
    slots per layer for this engine, llama.cpp's --n-cpu-moe for llama.cpp."""
    kind = "cuda" if device.startswith("cuda") else device
    return f"{engine}|{kind}|threads={threads}|slots={slots}"


def store_dir() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("moestudio")) / "decode-rates"


def _file(fingerprint: str) -> Path:
    return store_dir() / f"{fingerprint}.json"


def load(fingerprint: str) -> dict[str, Any]:
    """condition -> {"rates": [...], "tokens_per_s": median, "time": last}; {} when none."""
    try:
        data = json.loads(_file(fingerprint).read_text())
        return {k: {**v, "tokens_per_s": round(statistics.median(v["rates"]), 1)}
                for k, v in data.items() if isinstance(v, dict) and v.get("rates")}
    except (OSError, ValueError, TypeError, KeyError, statistics.StatisticsError):
        return {}


def record(fingerprint: str, key: str, tokens_per_s: float, model: str = "") -> None:
    """Adds one generation's decode rate (OSError if the cache cannot be written)."""
    path = _file(fingerprint)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    entry = data.get(key) if isinstance(data.get(key), dict) else {}
    rates = [float(r) for r in entry.get("rates", []) if isinstance(r, (int, float))][-(KEEP - 1):]
    data[key] = {"rates": rates + [round(tokens_per_s, 2)], "time": time.time(), "model": model}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def llama_gpu_build() -> bool:
    """Whether the llama.cpp that `--engine llamacpp` loads can use a GPU (the bundled one cannot)."""
    from engine.baseline.llama_load import llama_cpp

    return bool(llama_cpp().llama_supports_gpu_offload())


def speed_inputs(fingerprint: str, engine: str, has_gpu: bool) -> dict[str, Any]:
    """make_plan's keyword arguments for the decode speed of a model (its file's `fingerprint`)
    on `engine`: whether llama.cpp would use the GPU, and the rates measured here."""
    return {"engine": engine, "llama_gpu": engine == "llamacpp" and has_gpu and llama_gpu_build(),
            "measured": load(fingerprint)}
