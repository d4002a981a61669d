"""What a synthetic model looks like: architecture, dimensions, quant types, named presets."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from gguf import GGMLQuantizationType as QT

ARCHITECTURES = ("qwen3moe", "qwen2moe", "llama", "olmoe", "gpt-oss", "deepseek2")

EXPERT_QUANTS = {
    "F16": QT.F16, "Q8_0": QT.Q8_0, "Q4_K": QT.Q4_K, "Q5_K": QT.Q5_K, "Q6_K": QT.Q6_K, "MXFP4": QT.MXFP4,
}
DENSE_QUANTS = {"F32": QT.F32, "F16": QT.F16, "Q8_0": QT.Q8_0}


@dataclass(frozen=True)
class ModelSpec:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ctx: int = 4096
    n_ff_dense: int = 0  # leading dense FFN layers (deepseek2) and the shared expert width
    n_shared_expert: int = 0
    n_dense_lead: int = 0  # deepseek2: layers before the first MoE layer
    expert_qtype: QT = QT.Q4_K
    dense_qtype: QT = QT.F32
    rope_base: float = 10000.0
    sliding_window: int = 0  # gpt-oss: every other layer attends to this many tokens
    # deepseek2 (MLA)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    rope_dim: int = 0  # the rotary part of each head (MLA); 0 = whole head
    name: str = ""
    chat: str = "hermes"  # the chat template and its special tokens (engine/synth/tokenizer.CHAT_FAMILIES)

    def with_(self, **changes) -> "ModelSpec":
        return dataclasses.replace(self, **changes)

    @property
    def is_geometry(self) -> bool:
        """Geometry presets are big: their experts are written as random quantized blocks."""
        return self.n_embd >= 1024


def _tiny(arch: str) -> ModelSpec:
    # n_embd 256 and expert width 256 keep every K-quant row a whole number of 256-value blocks.
    base = ModelSpec(arch=arch, n_layer=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=64,
                     n_expert=8, n_expert_used=2, n_ff_exp=256, n_ctx=1024, name=f"tiny-{arch}")
    if arch == "qwen2moe":
        return base.with_(n_ff_dense=256, n_shared_expert=1)
    if arch == "olmoe":
        return base.with_(n_head_kv=4)  # its q/k norm spans the whole projection: needs n_head_kv == n_head
    if arch == "gpt-oss":
        # A short window so the sliding-window mask matters within a test's few dozen tokens.
        return base.with_(expert_qtype=QT.MXFP4, sliding_window=16, n_expert_used=4, rope_base=150000.0)
    if arch == "deepseek2":
        return base.with_(n_layer=3, n_dense_lead=1, n_ff_dense=256, n_shared_expert=1, n_head_kv=4,
                          head_dim=64, q_lora_rank=0, kv_lora_rank=256, rope_dim=32)
    return base


# Per-layer shapes of real models; `--layers N` shortens them.
GEOMETRIES = {
    "qwen3-30b-a3b": ModelSpec(arch="qwen3moe", n_layer=48, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128,
                               n_expert=128, n_expert_used=8, n_ff_exp=768, n_ctx=40960, rope_base=1e6,
                               expert_qtype=QT.Q4_K, dense_qtype=QT.Q8_0, name="qwen3-30b-a3b"),
    "gpt-oss-20b": ModelSpec(arch="gpt-oss", n_layer=24, n_embd=2880, n_head=64, n_head_kv=8, head_dim=64,
                             n_expert=32, n_expert_used=4, n_ff_exp=2880, n_ctx=131072, rope_base=150000.0,
                             sliding_window=128, expert_qtype=QT.MXFP4, dense_qtype=QT.Q8_0, name="gpt-oss-20b"),
    "gpt-oss-120b": ModelSpec(arch="gpt-oss", n_layer=36, n_embd=2880, n_head=64, n_head_kv=8, head_dim=64,
                              n_expert=128, n_expert_used=4, n_ff_exp=2880, n_ctx=131072, rope_base=150000.0,
                              sliding_window=128, expert_qtype=QT.MXFP4, dense_qtype=QT.Q8_0, name="gpt-oss-120b"),
    "mixtral-8x7b": ModelSpec(arch="llama", n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, head_dim=128,
                              n_expert=8, n_expert_used=2, n_ff_exp=14336, n_ctx=32768, rope_base=1e6,
                              expert_qtype=QT.Q4_K, dense_qtype=QT.Q8_0, name="mixtral-8x7b"),
}

PRESETS = ("tiny", *GEOMETRIES)


def preset(name: str, arch: str | None = None) -> ModelSpec:
    """A named preset. `tiny` exists for every architecture and needs `arch`."""
    if name == "tiny":
        if arch not in ARCHITECTURES:
            raise ValueError(f"tiny needs --arch, one of: {', '.join(ARCHITECTURES)}")
        return _tiny(arch)
    if name not in GEOMETRIES:
        raise ValueError(f"unknown preset {name!r}; choose from: {', '.join(PRESETS)}")
    spec = GEOMETRIES[name]
    if arch is not None and arch != spec.arch:
        raise ValueError(f"preset {name} is a {spec.arch} model, not {arch}")
    return spec
