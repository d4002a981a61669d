"""One module per architecture family; `build_model` picks the one a GGUF file names."""
from __future__ import annotations

from importlib import import_module
from pathlib import Path

import torch

from engine.errors import UserError
from engine.gguf.reader import ModelFile

# GGUF general.architecture -> module in this package with `build(mf, device)`.
FAMILIES = {
    "qwen3moe": "qwen3moe",
    "qwen2moe": "qwen2moe",
    "llama": "mixtral",
    "olmoe": "olmoe",
    "gpt-oss": "gpt_oss",
    "deepseek2": "deepseek2",
}


class UnsupportedArchitecture(UserError):
    pass


def check_architecture(arch: str) -> None:
    if arch not in FAMILIES:
        raise UnsupportedArchitecture(
            f"architecture {arch!r} is not supported by the MoE Studio engine "
            f"(supported: {', '.join(sorted(FAMILIES))})")


def build_model(source: str | Path | ModelFile, device: torch.device | str = "cpu"):
    """Maps a GGUF model into a DecoderModel on `device` (weights stay memory-mapped where possible)."""
    mf = source if isinstance(source, ModelFile) else ModelFile.open(source)
    check_architecture(mf.arch)
    return import_module(f"engine.models.{FAMILIES[mf.arch]}").build(mf, device)
