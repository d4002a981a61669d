"""Qwen2-MoE: q/k/v biases, NEOX RoPE, softmax top-k not renormalized, plus a shared expert
scaled by sigmoid(w · x), computed as silu(z) / z like llama.cpp."""
from __future__ import annotations

import torch

from engine.gguf.reader import ModelFile
from engine.layers.linear import load_vector
from engine.layers.precision import matmul
from engine.models.common import build_gqa_moe
from engine.models.decoder import DecoderModel, DenseFFN
from engine.models.gqa import QK_NORM_NONE


class GatedSharedExpert:
    def __init__(self, mf: ModelFile, layer: int, device: torch.device | str):
        self.ffn = DenseFFN(mf, f"blk.{layer}", device, suffix="_shexp")
        self.gate = load_vector(mf, f"blk.{layer}.ffn_gate_inp_shexp.weight", device)  # F32 [n_embd]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        z = matmul(x, self.gate)[:, None]
        return self.ffn(x) * (z / (1.0 + torch.exp(-z)) / z)


def build(mf: ModelFile, device: torch.device | str) -> DecoderModel:
    return build_gqa_moe(mf, device, neox=True, qk_norm=QK_NORM_NONE, norm_weights=False, shared=GatedSharedExpert)
