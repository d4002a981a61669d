"""DeepSeek-V2/V3 (llama.cpp arch "deepseek2", src/models/deepseek2.cpp).

Multi-head latent attention in llama.cpp's absorbed form: the cache holds, per position, the
RMS-normed latent c (kv_lora_rank values) and one roped key part k_pe (rope_dim values)
shared by all heads, i.e. MQA with one KV head of width kv_lora_rank + rope_dim whose first
kv_lora_rank values are also the value. Each head's query is [attn_k_b[h] @ q_nope | q_pe]
and its output attn_v_b[h] @ (softmax · c). Leading dense SiLU FFN layers, then MoE layers
with shared experts; gating softmax (V2) or sigmoid with a selection bias (V3), optionally
group-limited (V3's expert_group_count); YaRN with DeepSeek's mscale folded into the
attention scale.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from engine.errors import UserError
from engine.gguf.reader import ModelFile
from engine.layers.attention import KVCache, attend
from engine.layers.linear import Linear, load_vector
from engine.layers.moe import SIGMOID, SOFTMAX, SOFTMAX_WEIGHT, Router, RouterConfig
from engine.layers import precision
from engine.layers.norm import rms_norm
from engine.layers.rope import RopeConfig, rope_qk
from engine.models.common import assemble, expert_weights, model_config, norm, router
from engine.models.decoder import Block, DecoderModel, DenseFFN, MoEFFN
from engine.models.hparams import rope_config
from engine.quant.activation import round_activation
from engine.quant.dequant import check_supported, dequantize

# llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE (0 = none: softmax, as old DeepSeek-V2 files).
GATING = {0: SOFTMAX, 1: SOFTMAX, 2: SIGMOID, 3: SOFTMAX_WEIGHT}


class UnsupportedDeepseek2(UserError):
    pass


class HeadBatchedWeight:
    """A 3-D weight [n_head, rows, cols] applied per head, as ggml_mul_mat batches it:
    y[t, h] = W[h] @ round(x[t, h]), the activation rounded to the weight's vec_dot_type."""

    def __init__(self, mf: ModelFile, name: str, device: torch.device | str):
        info = mf.tensors[name]
        check_supported(info.qtype, info.name)
        self.qtype, self.shape = info.qtype, info.shape
        self.weight = dequantize(mf.torch_raw(name).to(device), info.qtype, info.shape)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H, cols] -> [T, H, rows]."""
        return precision.einsum("thc,hrc->thr", round_activation(x, self.qtype), self.weight)


class MLAttention:
    def __init__(self, mf: ModelFile, layer: int, device: torch.device | str, *, n_head: int, kv_lora: int,
                 head_dim: int, rope: RopeConfig, eps: float, scale: float):
        p = f"blk.{layer}"
        if f"{p}.attn_k_b.weight" not in mf.tensors:
            raise UnsupportedDeepseek2(
                f"{mf.path}: layer {layer} has no attn_k_b/attn_v_b (a legacy file with an unsplit attn_kv_b); "
                "re-convert it with a current llama.cpp, or use the llama.cpp engine (--engine llamacpp)")
        if f"{p}.attn_q_a.weight" in mf.tensors:
            self.q_a = Linear.load(mf, f"{p}.attn_q_a", device)
            self.q_a_norm = load_vector(mf, f"{p}.attn_q_a_norm.weight", device)
            self.q = Linear.load(mf, f"{p}.attn_q_b", device)
        else:
            self.q_a = self.q_a_norm = None
            self.q = Linear.load(mf, f"{p}.attn_q", device)
        self.kv_a = Linear.load(mf, f"{p}.attn_kv_a_mqa", device)
        self.kv_a_norm = load_vector(mf, f"{p}.attn_kv_a_norm.weight", device)
        self.k_b = HeadBatchedWeight(mf, f"{p}.attn_k_b.weight", device)  # [H, kv_lora, nope]
        self.v_b = HeadBatchedWeight(mf, f"{p}.attn_v_b.weight", device)  # [H, v_dim, kv_lora]
        self.o = Linear.load(mf, f"{p}.attn_output", device)
        self.n_head, self.kv_lora, self.head_dim = n_head, kv_lora, head_dim
        self.n_rot = rope.n_rot
        self.nope = head_dim - rope.n_rot
        self.rope, self.eps, self.scale = rope, eps, scale

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache, layer: int,
                 start: int | None) -> torch.Tensor:
        n = x.shape[0]
        if self.q_a is not None:
            q = self.q(rms_norm(self.q_a(x), self.q_a_norm, self.eps))
        else:
            q = self.q(x)
        q = q.view(n, self.n_head, self.head_dim)
        q_nope = q[..., :self.nope]
        kv = self.kv_a(x)
        c = rms_norm(kv[:, :self.kv_lora], self.kv_a_norm, self.eps)
        # q_pe [T, H, rope] and k_pe [T, 1, rope], rotated in place of their strided slices
        q_pe, k_pe = rope_qk(q[..., self.nope:], kv[:, None, self.kv_lora:], positions, self.rope, cache.n_ctx)
        q_cat = torch.cat([self.k_b(q_nope), q_pe], dim=-1)  # [T, H, kv_lora + rope]
        keys, values = cache.store(layer, start, torch.cat([c[:, None, :], k_pe], dim=-1), c[:, None, :],
                                     positions)
        latent = attend(q_cat, keys, values, positions, self.scale).view(n, self.n_head, self.kv_lora)
        return self.o(self.v_b(latent).reshape(n, -1))


class GroupLimitedRouter(Router):
    """DeepSeek-V3's group-limited routing (llama-graph.cpp build_moe_ffn, n_expert_groups > 1):
    experts form n_group equal groups, a group scores the sum of its two best selection
    scores, and top-k runs only over the experts of the n_group_used best groups."""

    def __init__(self, router: Router, n_group: int, n_group_used: int):
        super().__init__(router.cfg, router.gate, router.selection_bias)
        self.n_group, self.n_group_used = n_group, n_group_used

    def kernel_groups(self) -> tuple[int, int] | None:
        return (self.n_group, self.n_group_used)  # the router kernel checks the group shape

    def select(self, selection: torch.Tensor) -> torch.Tensor:
        """Top-k among the experts of the n_group_used groups whose two best scores sum highest."""
        n = selection.shape[0]
        groups = selection.view(n, self.n_group, -1)
        group_scores = groups.topk(2, dim=-1).values.sum(dim=-1)
        keep = group_scores.topk(self.n_group_used, dim=-1).indices
        kept = torch.zeros(group_scores.shape, dtype=torch.bool, device=selection.device).scatter(1, keep, True)
        masked = groups.masked_fill(~kept[..., None], float("-inf")).view(n, -1)
        return torch.topk(masked, self.cfg.n_expert_used, dim=-1).indices


def kq_scale(rope: RopeConfig, yarn_log_mul: float, head_dim_k: int) -> float:
    """deepseek2.cpp: undo ggml's YaRN magnitude term, then fold DeepSeek's mscale² into the
    softmax scale (float32 arithmetic, as in C)."""
    f32 = np.float32
    ln = f32(math.log(f32(1.0) / f32(rope.freq_scale)))
    attn_factor_org = f32(rope.attn_factor) * (f32(1.0) + f32(0.1) * ln)
    mscale = attn_factor_org * (f32(1.0) + f32(0.1) * f32(yarn_log_mul) * ln)
    return float(f32(mscale * mscale) / f32(math.sqrt(f32(head_dim_k))))


def gating(mf: ModelFile, n_layer: int, n_vocab: int) -> str:
    func = int(mf.arch_key("expert_gating_func", 0))
    if func == 0 and n_layer in (47, 48) and n_vocab == 154880:  # GLM 4.7 Lite, as llama.cpp special-cases
        return SIGMOID
    if func not in GATING:
        raise UnsupportedDeepseek2(f"{mf.path}: unknown expert_gating_func {func}")
    return GATING[func]


def build(mf: ModelFile, device: torch.device | str) -> DecoderModel:
    if mf.arch_key("attention.temperature_scale", None):
        raise UnsupportedDeepseek2(f"{mf.path}: attention temperature scaling is not supported by the "
                                   "MoE Studio engine; the llama.cpp engine (--engine llamacpp) can run it")
    kv_lora = int(mf.arch_key("attention.kv_lora_rank"))
    n_rot = int(mf.arch_key("rope.dimension_count"))
    n_dense = int(mf.arch_key("leading_dense_block_count", 0))
    head_dim = int(mf.arch_key("attention.key_length_mla", 0)) or int(mf.arch_key("attention.key_length"))
    cfg = model_config(mf, head_dim_k=kv_lora + n_rot, head_dim_v=kv_lora, n_head_kv=1, n_dense_lead=n_dense)
    # Multi-token-prediction layers (nextn) follow the trunk in block_count; the trunk alone makes logits.
    n_nextn = int(mf.arch_key("nextn_predict_layers", 0) or 0)
    if n_nextn:
        n_trunk = cfg.n_layer - n_nextn
        cfg = dataclasses.replace(cfg, n_layer=n_trunk, moe_layers=tuple(range(n_dense, n_trunk)))

    # The converter writes 0.1 * mscale_all_dim; llama.cpp divides it by 0.1 at load (float32).
    log_mul = mf.arch_key("rope.scaling.yarn_log_multiplier", None)
    log_mul = float(np.float32(log_mul) / np.float32(0.1)) if log_mul is not None else 0.0
    rope = rope_config(mf, n_rot, neox=False, yarn_log_mul=log_mul)
    scale = kq_scale(rope, log_mul, head_dim)

    scale_w = float(mf.arch_key("expert_weights_scale", 0.0) or 0.0)
    rcfg = RouterConfig(cfg.n_expert, cfg.n_expert_used, gating=gating(mf, cfg.n_layer, cfg.n_vocab),
                        norm_weights=bool(mf.arch_key("expert_weights_norm", False)),
                        weights_scale=scale_w if scale_w else 1.0)
    n_group = int(mf.arch_key("expert_group_count", 0) or 0)
    n_group_used = int(mf.arch_key("expert_group_used_count", 0) or 0)
    blocks, experts = [], {}
    for i in range(cfg.n_layer):
        p = f"blk.{i}"
        attn = MLAttention(mf, i, device, n_head=cfg.n_head, kv_lora=kv_lora, head_dim=head_dim, rope=rope,
                           eps=cfg.rms_eps, scale=scale)
        if i < n_dense:
            ffn = DenseFFN(mf, p, device)
        else:
            experts[i] = expert_weights(mf, i, device)
            shared = DenseFFN(mf, p, device, suffix="_shexp") if f"{p}.ffn_up_shexp.weight" in mf.tensors else None
            gate = router(mf, i, device, rcfg, selection_bias=f"{p}.exp_probs_b.bias")
            if n_group > 1:
                gate = GroupLimitedRouter(gate, n_group, n_group_used)
            ffn = MoEFFN(i, gate, shared=shared)
        blocks.append(Block(norm(mf, f"{p}.attn_norm", device), attn, norm(mf, f"{p}.ffn_norm", device), ffn))
    return assemble(mf, cfg, blocks, experts, device)
