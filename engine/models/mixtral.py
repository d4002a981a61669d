"""Mixtral (GGUF arch `llama` with experts): NORMAL RoPE (adjacent pairs), softmax top-k renormalized."""
from __future__ import annotations

import torch

from engine.errors import UserError
from engine.gguf.reader import ModelFile
from engine.models.common import build_gqa_moe
from engine.models.decoder import DecoderModel
from engine.models.gqa import QK_NORM_NONE


def build(mf: ModelFile, device: torch.device | str) -> DecoderModel:
    if int(mf.arch_key("expert_count", 0)) == 0:
        raise UserError(f"{mf.path} is a dense llama model: the MoE Studio engine runs MoE models only "
                        "(the llama.cpp engine, --engine llamacpp, runs it)")
    return build_gqa_moe(mf, device, neox=False, qk_norm=QK_NORM_NONE, norm_weights=True)
