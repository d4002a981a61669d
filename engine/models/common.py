"""Pieces every family builder uses: shared hyperparameters, experts, router, head."""
from __future__ import annotations

import torch

from engine.gguf.reader import ModelFile
from engine.layers.linear import Linear, load_vector
from engine.layers.moe import SILU, ExpertTensor, ExpertWeights, ReferenceExperts, Router, RouterConfig
from engine.models.decoder import Block, DecoderModel, Embedding, ModelConfig, MoEFFN

# Keep decoded experts for models whose experts fit comfortably in RAM as float32.
KEEP_DEQUANTIZED_BELOW = 1 << 30


def model_config(mf: ModelFile, *, head_dim_k: int | None = None, head_dim_v: int | None = None,
                 n_head_kv: int | None = None, n_dense_lead: int = 0) -> ModelConfig:
    n_layer = int(mf.arch_key("block_count"))
    n_embd = int(mf.arch_key("embedding_length"))
    n_head = int(mf.arch_key("attention.head_count"))
    head_dim = int(mf.arch_key("attention.key_length", n_embd // n_head))
    return ModelConfig(
        arch=mf.arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
        n_head_kv=n_head_kv if n_head_kv is not None else int(mf.arch_key("attention.head_count_kv", n_head)),
        head_dim_k=head_dim_k if head_dim_k is not None else head_dim,
        head_dim_v=head_dim_v if head_dim_v is not None else int(mf.arch_key("attention.value_length", head_dim)),
        n_vocab=mf.tensors["token_embd.weight"].shape[0],
        n_ctx_train=int(mf.arch_key("context_length")),
        rms_eps=float(mf.arch_key("attention.layer_norm_rms_epsilon")),
        n_expert=int(mf.arch_key("expert_count")),
        n_expert_used=int(mf.arch_key("expert_used_count")),
        moe_layers=tuple(range(n_dense_lead, n_layer)),
    )


def expert_weights(mf: ModelFile, layer: int, device: torch.device | str, activation: str = SILU) -> ExpertWeights:
    p = f"blk.{layer}"
    return ExpertWeights(ExpertTensor.load(mf, f"{p}.ffn_gate_exps", device),
                         ExpertTensor.load(mf, f"{p}.ffn_up_exps", device),
                         ExpertTensor.load(mf, f"{p}.ffn_down_exps", device), activation)


def router(mf: ModelFile, layer: int, device: torch.device | str, cfg: RouterConfig,
           selection_bias: str | None = None) -> Router:
    p = f"blk.{layer}"
    bias = load_vector(mf, selection_bias, device) if selection_bias and selection_bias in mf.tensors else None
    return Router(cfg, Linear.load(mf, f"{p}.ffn_gate_inp", device), bias)


def norm(mf: ModelFile, name: str, device: torch.device | str) -> torch.Tensor:
    return load_vector(mf, f"{name}.weight", device)


def assemble(mf: ModelFile, cfg: ModelConfig, blocks: list[Block], experts: dict[int, ExpertWeights],
             device: torch.device | str) -> DecoderModel:
    """Adds embedding, final norm and head (tied to the embedding when output.weight is absent)."""
    head = "output" if "output.weight" in mf.tensors else "token_embd"
    total = sum(3 * w.gate.expert_bytes * w.n_expert for w in experts.values())
    keep = total * 8 < KEEP_DEQUANTIZED_BELOW  # float32 is ~8x a 4-bit expert
    return DecoderModel(
        config=cfg,
        embed=Embedding(mf, "token_embd.weight", device),
        blocks=blocks,
        output_norm=norm(mf, "output_norm", device),
        output=Linear.load(mf, head, device, bias="output.bias"),
        expert_weights=experts,
        experts=ReferenceExperts(experts, device, keep_dequantized=keep),
        source=mf,
        device=device,
    )


def build_gqa_moe(mf: ModelFile, device: torch.device | str, *, neox: bool, qk_norm: str, norm_weights: bool,
                  shared=None) -> DecoderModel:
    """The GQA-attention MoE decoder that qwen3moe, qwen2moe, mixtral and olmoe are variants of.

    `shared(mf, layer, device)` builds a layer's shared expert, if the family has one.
    """
    from engine.models.gqa import GQAttention
    from engine.models.hparams import rope_config

    cfg = model_config(mf)
    rope = rope_config(mf, int(mf.arch_key("rope.dimension_count", cfg.head_dim_k)), neox=neox)
    rcfg = RouterConfig(cfg.n_expert, cfg.n_expert_used, norm_weights=norm_weights)
    blocks, experts = [], {}
    for i in range(cfg.n_layer):
        attn = GQAttention(mf, i, device, n_head=cfg.n_head, n_head_kv=cfg.n_head_kv, head_dim=cfg.head_dim_k,
                           rope=rope, eps=cfg.rms_eps, qk_norm=qk_norm)
        experts[i] = expert_weights(mf, i, device)
        ffn = MoEFFN(i, router(mf, i, device, rcfg), shared=shared(mf, i, device) if shared else None)
        blocks.append(Block(norm(mf, f"blk.{i}.attn_norm", device), attn, norm(mf, f"blk.{i}.ffn_norm", device), ffn))
    return assemble(mf, cfg, blocks, experts, device)
