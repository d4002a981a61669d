"""OLMoE: q/k RMS norm over the whole projection, NEOX RoPE, softmax top-k NOT renormalized."""
from __future__ import annotations

import torch

from engine.gguf.reader import ModelFile
from engine.models.common import build_gqa_moe
from engine.models.decoder import DecoderModel
from engine.models.gqa import QK_NORM_FULL


def build(mf: ModelFile, device: torch.device | str) -> DecoderModel:
    return build_gqa_moe(mf, device, neox=True, qk_norm=QK_NORM_FULL, norm_weights=False)
