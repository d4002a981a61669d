"""A model's memory geometry from its GGUF header: what each part of it costs in bytes.

Only the header is read (tensor sizes come from shapes and quant types), so a 60 GB model
costs milliseconds. Expert tensors are the routed `*_exps` ones (weights and biases); shared
experts, attention, norms, router and output head are "dense". Token embeddings are counted
apart: a decode step reads one row of them, so they stay in RAM.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from engine.errors import UserError

KV_BYTES = {"f16": 2, "f32": 4}


@dataclass(frozen=True)
class Geometry:
    name: str
    arch: str
    file_bytes: int
    n_layer: int
    moe_layers: tuple[int, ...]
    n_expert: int
    n_expert_used: int
    n_embd: int
    n_ff_exp: int
    n_head: int
    n_vocab: int
    n_ctx_train: int
    expert_bytes: int  # one expert of one layer, all its tensors (the mean over MoE layers)
    # The same in a GPU slot, whose layout pads Q6_K blocks and MXFP4 rows (engine/quant/layout.py): what a
    # slot costs in VRAM (expert_bytes is what an upload or a CPU computation reads).
    expert_slot_bytes: int
    experts_bytes_total: int
    dense_bytes: int  # every non-expert tensor but the token embeddings
    embedding_bytes: int
    kv_values_per_token: int  # K and V values one token adds over all layers
    head_dim_k: int = 0  # one attention head's query/key width (0 in plans written before it: n_embd / n_head)
    # The dense tensors' values: the MoE Studio engine on the CPU holds them as float32 (4 bytes
    # each), which is what a CPU decode token then reads (engine/layers/linear.py).
    dense_values: int = 0

    @property
    def kv_bytes_per_token(self) -> dict[str, int]:
        return {t: self.kv_values_per_token * b for t, b in KV_BYTES.items()}

    def kv_bytes(self, n_ctx: int, kv_type: str = "f32") -> int:
        return n_ctx * self.kv_values_per_token * KV_BYTES[kv_type]

    @property
    def active_expert_bytes(self) -> int:
        """Expert bytes one decoded token reads: the selected experts of every MoE layer."""
        return len(self.moe_layers) * self.n_expert_used * self.expert_bytes

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["kv_bytes_per_token"] = self.kv_bytes_per_token
        d["active_expert_bytes"] = self.active_expert_bytes
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Geometry:
        """The inverse of to_json (the GUI re-prices a plan from `moestudio plan --json`)."""
        values = {f.name: d.get(f.name, f.default) for f in fields(cls)}
        return cls(**{**values, "moe_layers": tuple(values["moe_layers"])})


def _head_dim_k(mf: Any, n_head: int) -> int:
    """The width of one head's query and key as attention reads them: deepseek2's MLA attends
    over the latent plus the rotary part."""
    kv_lora = int(mf.arch_key("attention.kv_lora_rank", 0) or 0)
    if kv_lora:
        return kv_lora + int(mf.arch_key("rope.dimension_count"))
    return int(mf.arch_key("attention.key_length", int(mf.arch_key("embedding_length")) // n_head))


def _kv_values_per_token(mf: Any, n_layer: int, n_head: int) -> int:
    kv_lora = int(mf.arch_key("attention.kv_lora_rank", 0) or 0)
    if kv_lora:
        # deepseek2 MLA: each layer caches the compressed latent plus the shared rotary key.
        return n_layer * (kv_lora + int(mf.arch_key("rope.dimension_count")))
    n_head_kv = mf.arch_key("attention.head_count_kv", n_head)
    key = int(mf.arch_key("attention.key_length", int(mf.arch_key("embedding_length")) // n_head))
    value = int(mf.arch_key("attention.value_length", key))
    heads = n_head_kv if isinstance(n_head_kv, list) else [n_head_kv] * n_layer  # per-layer arrays exist
    return sum(int(h) for h in heads[:n_layer]) * (key + value)


def read_geometry(path: str | Path) -> Geometry:
    # Imported here: the GUI imports this module to re-price plans, which reads no file.
    from engine.gguf.check import open_model

    # Types and ranges of what is read are checked here; MoE-ness is refused by geometry_of.
    return geometry_of(open_model(path, require_moe=False))


def geometry_of(mf: Any) -> Geometry:
    """The geometry of an opened engine.gguf.reader.ModelFile (the engine sizes from its own)."""
    from engine.gguf.reader import GGUFError
    from engine.quant.layout import layout_bytes

    path = Path(mf.path)
    try:
        n_layer = int(mf.arch_key("block_count"))
        n_head = int(mf.arch_key("attention.head_count"))
        n_expert = int(mf.arch_key("expert_count", 0) or 0)
        per_layer: dict[int, int] = {}
        slot_bytes = dense = embedding = dense_values = 0
        for name, t in mf.tensors.items():
            if name.startswith("token_embd."):
                embedding += t.n_bytes
            elif name.startswith("blk.") and "_exps.weight" in name:
                # (gpt-oss's expert biases stay on the accelerator for every expert: dense bytes)
                layer = int(name.split(".")[1])
                per_layer[layer] = per_layer.get(layer, 0) + t.n_bytes
                slot_bytes += layout_bytes(t.qtype, t.n_bytes, t.shape[-1])
            else:
                dense += t.n_bytes
                dense_values += math.prod(t.shape)
        if not n_expert or not per_layer:
            raise UserError(f"{path.name} is not a Mixture-of-Experts model (no expert tensors); "
                            "the planner sizes expert caches")
        embd = mf.tensors.get("token_embd.weight")
        return Geometry(
            name=path.name, arch=mf.arch, file_bytes=path.stat().st_size, n_layer=n_layer,
            moe_layers=tuple(sorted(per_layer)), n_expert=n_expert,
            n_expert_used=int(mf.arch_key("expert_used_count")), n_embd=int(mf.arch_key("embedding_length")),
            n_ff_exp=int(mf.arch_key("expert_feed_forward_length", 0) or 0), n_head=n_head,
            n_vocab=embd.shape[0] if embd else 0, n_ctx_train=int(mf.arch_key("context_length")),
            expert_bytes=sum(per_layer.values()) // (len(per_layer) * n_expert),
            expert_slot_bytes=-(-slot_bytes // (len(per_layer) * n_expert)),
            experts_bytes_total=sum(per_layer.values()), dense_bytes=dense, embedding_bytes=embedding,
            kv_values_per_token=_kv_values_per_token(mf, n_layer, n_head), head_dim_k=_head_dim_k(mf, n_head),
            dense_values=dense_values,
        )
    except GGUFError as e:  # its message starts with the path
        raise UserError(f"cannot read the model: {e}") from None
