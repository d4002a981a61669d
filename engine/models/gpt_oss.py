"""gpt-oss (llama.cpp arch "gpt-oss", openai-moe.cpp): biased q/k/v/o, NEOX RoPE with YaRN,
per-head attention sinks, sliding-window attention on every other layer (layer 0 first),
post-attention norm as the FFN input, router bias, top-k on the raw logits then a softmax
over the selected k, expert biases and the clamped SwiGLU (swiglu_oai)."""
from __future__ import annotations

import numpy as np
import torch

from engine.gguf.reader import ModelFile
from engine.layers.moe import SOFTMAX_WEIGHT, SWIGLU_OAI, RouterConfig
from engine.models.common import assemble, expert_weights, model_config, norm, router
from engine.models.decoder import Block, DecoderModel, MoEFFN
from engine.models.gqa import GQAttention
from engine.models.hparams import rope_config


def swa_layers(mf: ModelFile, n_layer: int) -> list[bool]:
    """Which layers use the sliding window: llama.cpp's load_swa_pattern(ml, 2), dense_first off.

    `attention.sliding_window_pattern` may be a per-layer bool array or a period n (layer il is
    SWA iff il % n < n - 1; n = 0 makes every layer SWA); without it the period is 2.
    """
    pattern = mf.arch_key("attention.sliding_window_pattern", 2)
    if isinstance(pattern, (list, tuple)):
        return [bool(p) for p in pattern[:n_layer]]
    n = int(pattern)
    return [n == 0 or il % n < n - 1 for il in range(n_layer)]


def build(mf: ModelFile, device: torch.device | str) -> DecoderModel:
    cfg = model_config(mf)
    n_rot = int(mf.arch_key("rope.dimension_count", cfg.head_dim_k))
    rope = rope_config(mf, n_rot, neox=True)
    # Sliding-window layers take rope.freq_base_swa when the file has it (llama.cpp get_rope_freq_base).
    base_swa = mf.arch_key("rope.freq_base_swa", None)
    rope_swa = rope_config(mf, n_rot, neox=True, freq_base=float(base_swa)) if base_swa is not None else rope
    n_swa = int(mf.arch_key("attention.sliding_window"))
    is_swa = swa_layers(mf, cfg.n_layer)
    # llama.cpp's openai-moe loader never reads expert_weights_scale: the weights stay unscaled.
    rcfg = RouterConfig(cfg.n_expert, cfg.n_expert_used, gating=SOFTMAX_WEIGHT, norm_weights=False)
    kq_scale = float(np.float32(1.0) / np.sqrt(np.float32(n_rot)))  # 1.0f/sqrtf(float(n_rot))
    blocks, experts = [], {}
    for i in range(cfg.n_layer):
        attn = GQAttention(mf, i, device, n_head=cfg.n_head, n_head_kv=cfg.n_head_kv, head_dim=cfg.head_dim_k,
                           rope=rope_swa if is_swa[i] else rope, eps=cfg.rms_eps, window=n_swa if is_swa[i] else 0,
                           scale=kq_scale)
        experts[i] = expert_weights(mf, i, device, activation=SWIGLU_OAI)
        ffn = MoEFFN(i, router(mf, i, device, rcfg))
        blocks.append(Block(norm(mf, f"blk.{i}.attn_norm", device), attn,
                            norm(mf, f"blk.{i}.post_attention_norm", device), ffn))
    return assemble(mf, cfg, blocks, experts, device)
