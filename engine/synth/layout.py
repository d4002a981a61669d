"""Per-architecture GGUF layout: the metadata llama.cpp reads and the tensors it expects.

One function per architecture family, each listing exactly what differs (see llama.cpp
src/models/<arch>.cpp). Shapes are in numpy order (ggml's `ne` reversed).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from gguf import GGMLQuantizationType as QT

from engine.synth.spec import ModelSpec

F32 = QT.F32


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    qtype: QT
    role: str  # what engine.synth.weights makes for it
    layer: int = -1


@dataclass
class Layout:
    metadata: dict[str, Any]
    tensors: list[TensorSpec]

    def add(self, name: str, shape: tuple[int, ...], qtype: QT, role: str, layer: int = -1) -> None:
        # 1-D tensors (norms, biases) stay F32 as in real files; quant types need whole blocks.
        self.tensors.append(TensorSpec(name, shape, F32 if len(shape) == 1 else qtype, role, layer))


def _common_metadata(spec: ModelSpec) -> dict[str, Any]:
    a = spec.arch
    return {
        f"{a}.context_length": spec.n_ctx,
        f"{a}.embedding_length": spec.n_embd,
        f"{a}.block_count": spec.n_layer,
        f"{a}.attention.head_count": spec.n_head,
        f"{a}.attention.head_count_kv": spec.n_head_kv,
        f"{a}.attention.key_length": spec.head_dim,
        f"{a}.attention.value_length": spec.head_dim,
        f"{a}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{a}.rope.freq_base": spec.rope_base,
        f"{a}.rope.dimension_count": spec.rope_dim or spec.head_dim,
        f"{a}.expert_count": spec.n_expert,
        f"{a}.expert_used_count": spec.n_expert_used,
        f"{a}.expert_feed_forward_length": spec.n_ff_exp,
        f"{a}.feed_forward_length": spec.n_ff_dense or spec.n_ff_exp,
    }


def _globals(lay: Layout, spec: ModelSpec, n_vocab: int) -> None:
    lay.add("token_embd.weight", (n_vocab, spec.n_embd), spec.dense_qtype, "token_embd")
    lay.add("output_norm.weight", (spec.n_embd,), F32, "norm")
    lay.add("output.weight", (n_vocab, spec.n_embd), spec.dense_qtype, "output")


def _attention(lay: Layout, spec: ModelSpec, i: int, *, bias: bool = False) -> None:
    d, hd = spec.n_embd, spec.head_dim
    q, kv = spec.n_head * hd, spec.n_head_kv * hd
    lay.add(f"blk.{i}.attn_norm.weight", (d,), F32, "norm", i)
    lay.add(f"blk.{i}.attn_q.weight", (q, d), spec.dense_qtype, "attn_q", i)
    lay.add(f"blk.{i}.attn_k.weight", (kv, d), spec.dense_qtype, "attn_k", i)
    lay.add(f"blk.{i}.attn_v.weight", (kv, d), spec.dense_qtype, "attn_v", i)
    lay.add(f"blk.{i}.attn_output.weight", (d, q), spec.dense_qtype, "attn_output", i)
    if bias:
        lay.add(f"blk.{i}.attn_q.bias", (q,), F32, "attn_q_bias", i)
        lay.add(f"blk.{i}.attn_k.bias", (kv,), F32, "attn_k_bias", i)
        lay.add(f"blk.{i}.attn_v.bias", (kv,), F32, "zeros", i)


def _experts(lay: Layout, spec: ModelSpec, i: int) -> None:
    d, f, e = spec.n_embd, spec.n_ff_exp, spec.n_expert
    lay.add(f"blk.{i}.ffn_norm.weight", (d,), F32, "norm", i)
    lay.add(f"blk.{i}.ffn_gate_inp.weight", (e, d), F32, "router", i)
    lay.add(f"blk.{i}.ffn_gate_exps.weight", (e, f, d), spec.expert_qtype, "expert_gate", i)
    lay.add(f"blk.{i}.ffn_up_exps.weight", (e, f, d), spec.expert_qtype, "expert_up", i)
    lay.add(f"blk.{i}.ffn_down_exps.weight", (e, d, f), spec.expert_qtype, "expert_down", i)


def qwen3moe(spec: ModelSpec, n_vocab: int) -> Layout:
    lay = Layout(_common_metadata(spec), [])
    _globals(lay, spec, n_vocab)
    for i in range(spec.n_layer):
        _attention(lay, spec, i)
        lay.add(f"blk.{i}.attn_q_norm.weight", (spec.head_dim,), F32, "q_norm", i)
        lay.add(f"blk.{i}.attn_k_norm.weight", (spec.head_dim,), F32, "k_norm", i)
        _experts(lay, spec, i)
    return lay


def qwen2moe(spec: ModelSpec, n_vocab: int) -> Layout:
    lay = Layout(_common_metadata(spec), [])
    lay.metadata[f"{spec.arch}.expert_shared_feed_forward_length"] = spec.n_ff_dense
    _globals(lay, spec, n_vocab)
    d, fs = spec.n_embd, spec.n_ff_dense
    for i in range(spec.n_layer):
        _attention(lay, spec, i, bias=True)
        _experts(lay, spec, i)
        lay.add(f"blk.{i}.ffn_gate_inp_shexp.weight", (d,), F32, "shexp_gate_inp", i)
        lay.add(f"blk.{i}.ffn_gate_shexp.weight", (fs, d), spec.dense_qtype, "shexp_gate", i)
        lay.add(f"blk.{i}.ffn_up_shexp.weight", (fs, d), spec.dense_qtype, "shexp_up", i)
        lay.add(f"blk.{i}.ffn_down_shexp.weight", (d, fs), spec.dense_qtype, "shexp_down", i)
    return lay


def llama(spec: ModelSpec, n_vocab: int) -> Layout:
    """Mixtral: llama with `ffn_gate_inp` and stacked experts; RoPE on adjacent pairs."""
    lay = Layout(_common_metadata(spec), [])
    lay.metadata[f"{spec.arch}.feed_forward_length"] = spec.n_ff_exp  # llama sizes experts with this key
    _globals(lay, spec, n_vocab)
    for i in range(spec.n_layer):
        _attention(lay, spec, i)
        _experts(lay, spec, i)
    return lay


def olmoe(spec: ModelSpec, n_vocab: int) -> Layout:
    """q/k RMS norm over the whole projection, no top-k renormalization."""
    if spec.n_head_kv != spec.n_head:
        raise ValueError("olmoe normalizes the whole K projection with an n_embd-wide norm: n_head_kv must equal n_head")
    lay = Layout(_common_metadata(spec), [])
    lay.metadata[f"{spec.arch}.feed_forward_length"] = spec.n_ff_exp
    _globals(lay, spec, n_vocab)
    for i in range(spec.n_layer):
        _attention(lay, spec, i)
        lay.add(f"blk.{i}.attn_q_norm.weight", (spec.n_head * spec.head_dim,), F32, "q_norm", i)
        lay.add(f"blk.{i}.attn_k_norm.weight", (spec.n_head_kv * spec.head_dim,), F32, "k_norm", i)
        _experts(lay, spec, i)
    return lay


BUILDERS: dict[str, Callable[[ModelSpec, int], Layout]] = {
    "qwen3moe": qwen3moe,
    "qwen2moe": qwen2moe,
    "llama": llama,
    "olmoe": olmoe,
}


def layout(spec: ModelSpec, n_vocab: int) -> Layout:
    try:
        build = BUILDERS[spec.arch]
    except KeyError:
        raise ValueError(f"the factory cannot make {spec.arch!r}; it makes: {', '.join(BUILDERS)}") from None
    return build(spec, n_vocab)


# --- gpt-oss and deepseek2 ---------------------------------------------------------------------
# Rope scaling as the real files carry it (llama.cpp applies YaRN at every context length).
GPT_OSS_YARN = {"factor": 32.0, "original_context_length": 4096}
DEEPSEEK2_YARN = {"factor": 40.0, "original_context_length": 4096, "mscale_all_dim": 0.707}
DEEPSEEK2_GATING = {"softmax": 1, "sigmoid": 2}  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE
DEEPSEEK2_EXPERT_WEIGHTS_SCALE = 2.5


def gpt_oss(spec: ModelSpec, n_vocab: int) -> Layout:
    """openai-moe: biased q/k/v/o, per-head attention sinks, post-attention norm before the
    MoE, router and expert biases, every other layer sliding-window (layer 0 first), YaRN."""
    if not spec.sliding_window:
        raise ValueError("gpt-oss needs a sliding window (ModelSpec.sliding_window)")
    a = spec.arch
    lay = Layout(_common_metadata(spec), [])
    lay.metadata.update({
        f"{a}.attention.sliding_window": spec.sliding_window,
        # No sliding_window_pattern key, like the real files: llama.cpp defaults to 2 (even layers SWA).
        f"{a}.rope.scaling.type": "yarn",
        f"{a}.rope.scaling.factor": GPT_OSS_YARN["factor"],
        f"{a}.rope.scaling.original_context_length": GPT_OSS_YARN["original_context_length"],
    })
    _globals(lay, spec, n_vocab)
    d, hd, e, f = spec.n_embd, spec.head_dim, spec.n_expert, spec.n_ff_exp
    q, kv = spec.n_head * hd, spec.n_head_kv * hd
    for i in range(spec.n_layer):
        lay.add(f"blk.{i}.attn_norm.weight", (d,), F32, "norm", i)
        lay.add(f"blk.{i}.attn_q.weight", (q, d), spec.dense_qtype, "qk_noise", i)
        lay.add(f"blk.{i}.attn_q.bias", (q,), F32, "oai_qk_bias", i)
        lay.add(f"blk.{i}.attn_k.weight", (kv, d), spec.dense_qtype, "qk_noise", i)
        lay.add(f"blk.{i}.attn_k.bias", (kv,), F32, "oai_qk_bias", i)
        lay.add(f"blk.{i}.attn_v.weight", (kv, d), spec.dense_qtype, "attn_v", i)
        lay.add(f"blk.{i}.attn_v.bias", (kv,), F32, "bias", i)
        lay.add(f"blk.{i}.attn_output.weight", (d, q), spec.dense_qtype, "attn_output", i)
        lay.add(f"blk.{i}.attn_output.bias", (d,), F32, "bias", i)
        lay.add(f"blk.{i}.attn_sinks.weight", (spec.n_head,), F32, "attn_sinks", i)
        lay.add(f"blk.{i}.post_attention_norm.weight", (d,), F32, "norm", i)
        lay.add(f"blk.{i}.ffn_gate_inp.weight", (e, d), F32, "router", i)
        lay.add(f"blk.{i}.ffn_gate_inp.bias", (e,), F32, "bias", i)
        lay.add(f"blk.{i}.ffn_gate_exps.weight", (e, f, d), spec.expert_qtype, "expert_gate", i)
        lay.add(f"blk.{i}.ffn_gate_exps.bias", (e, f), F32, "bias", i)
        lay.add(f"blk.{i}.ffn_up_exps.weight", (e, f, d), spec.expert_qtype, "expert_up", i)
        lay.add(f"blk.{i}.ffn_up_exps.bias", (e, f), F32, "bias", i)
        lay.add(f"blk.{i}.ffn_down_exps.weight", (e, d, f), spec.expert_qtype, "expert_down", i)
        lay.add(f"blk.{i}.ffn_down_exps.bias", (e, d), F32, "bias", i)
    return lay


def deepseek2(spec: ModelSpec, n_vocab: int, *, gating: str = "softmax") -> Layout:
    """DeepSeek-V2/V3: MLA attention in the split (absorbed) form, leading dense layers,
    shared experts, scaled routing weights, YaRN with DeepSeek's mscale.

    `gating` "softmax" is DeepSeek-V2 (no top-k renormalization); "sigmoid" is DeepSeek-V3
    (renormalized, with an `exp_probs_b` selection bias).
    """
    if not (spec.kv_lora_rank and spec.rope_dim) or spec.rope_dim >= spec.head_dim:
        raise ValueError("deepseek2 needs kv_lora_rank > 0 and 0 < rope_dim < head_dim (the nope part)")
    if not 0 < spec.n_dense_lead < spec.n_layer or not spec.n_ff_dense or not spec.n_shared_expert:
        raise ValueError("deepseek2 needs leading dense layers, n_ff_dense and shared experts")
    if gating not in DEEPSEEK2_GATING:
        raise ValueError(f"deepseek2 gating is one of {', '.join(DEEPSEEK2_GATING)}")
    a = spec.arch
    hd, rope, kvr, qr = spec.head_dim, spec.rope_dim, spec.kv_lora_rank, spec.q_lora_rank
    nope, vd = hd - rope, hd - rope  # v_head_dim = qk_nope_head_dim, as in DeepSeek-V2/V3
    lay = Layout(_common_metadata(spec), [])
    lay.metadata.update({
        # MLA runs as MQA over the compressed cache: one KV head of kv_lora_rank + rope dims.
        f"{a}.attention.head_count_kv": 1,
        f"{a}.attention.key_length": kvr + rope,
        f"{a}.attention.value_length": kvr,
        f"{a}.attention.key_length_mla": hd,
        f"{a}.attention.value_length_mla": vd,
        # Always written: without it the loader demands it unless n_layer is 26/27 ("lite").
        f"{a}.attention.q_lora_rank": qr,
        f"{a}.attention.kv_lora_rank": kvr,
        f"{a}.leading_dense_block_count": spec.n_dense_lead,
        f"{a}.feed_forward_length": spec.n_ff_dense,
        f"{a}.expert_shared_count": spec.n_shared_expert,
        f"{a}.expert_weights_scale": DEEPSEEK2_EXPERT_WEIGHTS_SCALE,
        f"{a}.expert_weights_norm": gating == "sigmoid",
        f"{a}.expert_gating_func": DEEPSEEK2_GATING[gating],
        f"{a}.rope.scaling.type": "yarn",
        f"{a}.rope.scaling.factor": DEEPSEEK2_YARN["factor"],
        f"{a}.rope.scaling.original_context_length": DEEPSEEK2_YARN["original_context_length"],
        # The converter writes 0.1 * mscale_all_dim; llama.cpp divides by 0.1 again.
        f"{a}.rope.scaling.yarn_log_multiplier": 0.1 * DEEPSEEK2_YARN["mscale_all_dim"],
    })
    _globals(lay, spec, n_vocab)
    d, n_head, fs = spec.n_embd, spec.n_head, spec.n_ff_exp * spec.n_shared_expert
    for i in range(spec.n_layer):
        lay.add(f"blk.{i}.attn_norm.weight", (d,), F32, "norm", i)
        if qr:
            lay.add(f"blk.{i}.attn_q_a.weight", (qr, d), spec.dense_qtype, "mla_q_a", i)
            lay.add(f"blk.{i}.attn_q_a_norm.weight", (qr,), F32, "norm", i)
            lay.add(f"blk.{i}.attn_q_b.weight", (n_head * hd, qr), spec.dense_qtype, "mla_q_b", i)
        else:
            lay.add(f"blk.{i}.attn_q.weight", (n_head * hd, d), spec.dense_qtype, "mla_q", i)
        lay.add(f"blk.{i}.attn_kv_a_mqa.weight", (kvr + rope, d), spec.dense_qtype, "mla_kv_a", i)
        lay.add(f"blk.{i}.attn_kv_a_norm.weight", (kvr,), F32, "norm", i)
        lay.add(f"blk.{i}.attn_k_b.weight", (n_head, kvr, nope), spec.dense_qtype, "mla_k_b", i)
        lay.add(f"blk.{i}.attn_v_b.weight", (n_head, vd, kvr), spec.dense_qtype, "mla_v_b", i)
        lay.add(f"blk.{i}.attn_output.weight", (d, n_head * vd), spec.dense_qtype, "attn_output", i)
        if i < spec.n_dense_lead:
            lay.add(f"blk.{i}.ffn_norm.weight", (d,), F32, "norm", i)
            lay.add(f"blk.{i}.ffn_gate.weight", (spec.n_ff_dense, d), spec.dense_qtype, "ffn_gate", i)
            lay.add(f"blk.{i}.ffn_up.weight", (spec.n_ff_dense, d), spec.dense_qtype, "ffn_up", i)
            lay.add(f"blk.{i}.ffn_down.weight", (d, spec.n_ff_dense), spec.dense_qtype, "ffn_down", i)
            continue
        _experts(lay, spec, i)
        if gating == "sigmoid":
            lay.add(f"blk.{i}.exp_probs_b.bias", (spec.n_expert,), F32, "bias", i)
        lay.add(f"blk.{i}.ffn_gate_shexp.weight", (fs, d), spec.dense_qtype, "shexp_gate", i)
        lay.add(f"blk.{i}.ffn_up_shexp.weight", (fs, d), spec.dense_qtype, "shexp_up", i)
        lay.add(f"blk.{i}.ffn_down_shexp.weight", (d, fs), spec.dense_qtype, "shexp_down", i)
    return lay


BUILDERS["gpt-oss"] = gpt_oss
BUILDERS["deepseek2"] = deepseek2
