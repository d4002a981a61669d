"""The MoE block: router, top-k selection and weighting, and the expert computation.

Routing follows llama.cpp's build_moe_ffn (llama-graph.cpp) for every gating function the
supported architectures use. The expert computation is a separate object (`Experts`) so the
hybrid engine can split the same maths between accelerator slots and a CPU pool; the one
here is the reference: dequantize the selected experts and multiply in float32, with the
activation rounding of engine/layers/linear.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from gguf import GGMLQuantizationType as QT

from engine.gguf.reader import ModelFile
from engine.kernels import triton_applies
from engine.layers.linear import Linear, optional_vector
from engine.layers.precision import matmul
from engine.quant.activation import round_activation
from engine.quant.dequant import check_supported, dequantize

SOFTMAX, SIGMOID, SOFTMAX_WEIGHT = "softmax", "sigmoid", "softmax_weight"
SILU, SWIGLU_OAI = "silu", "swiglu_oai"
WEIGHT_SUM_MIN = 6.103515625e-5  # llama.cpp clamps the top-k weight sum to the smallest f16 normal


@dataclass(frozen=True)
class RouterConfig:
    n_expert: int
    n_expert_used: int
    gating: str = SOFTMAX
    norm_weights: bool = True
    weights_scale: float = 1.0


class Router:
    def __init__(self, cfg: RouterConfig, gate: Linear, selection_bias: torch.Tensor | None = None):
        self.cfg, self.gate, self.selection_bias = cfg, gate, selection_bias

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [T, k] (int64) and weights [T, k] for x [T, D]."""
        return self.route(self.gate(x))

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [T, k] (int64) and weights [T, k] for router logits [T, n_expert]: one Triton
        launch (engine/kernels/router.py) where `triton_applies` and the kernel computes this
        router's selection (`kernel_groups`), else the torch reference."""
        groups = self.kernel_groups()
        if groups is not None and triton_applies(logits.device):
            from engine.kernels import router as kernel  # imports this module: not at the top

            if kernel.supports(logits, self.cfg, self.selection_bias, groups):
                return kernel.route(logits, self.cfg, self.selection_bias, groups)
        return self.route_torch(logits)

    def kernel_groups(self) -> tuple[int, int] | None:
        """(n_group, n_group_used) with which the router kernel computes this router's `select`
        ((1, 1): plain top-k); None where it does not (a subclass's own selection)."""
        return (1, 1) if type(self).select is Router.select else None

    def route_torch(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference (and CPU path) of `route`: llama.cpp's build_moe_ffn routing."""
        cfg = self.cfg
        if cfg.gating == SOFTMAX:
            probs = torch.softmax(logits, dim=-1)
        elif cfg.gating == SIGMOID:
            probs = torch.sigmoid(logits)
        elif cfg.gating == SOFTMAX_WEIGHT:
            probs = logits
        else:
            raise ValueError(f"unknown gating {cfg.gating!r}")
        selection = probs + self.selection_bias if self.selection_bias is not None else probs
        ids = self.select(selection)
        weights = torch.gather(probs, 1, ids)
        if cfg.gating == SOFTMAX_WEIGHT:
            weights = torch.softmax(weights, dim=-1)
        if cfg.norm_weights:
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=WEIGHT_SUM_MIN)
        if cfg.weights_scale not in (0.0, 1.0):
            weights = weights * cfg.weights_scale
        return ids, weights

    def select(self, selection: torch.Tensor) -> torch.Tensor:
        """ids [T, k] of the best-scoring experts (deepseek2's group-limited routing overrides this)."""
        return torch.topk(selection, self.cfg.n_expert_used, dim=-1).indices


def activate(kind: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The gated activation between the up/gate and the down projection."""
    if kind == SILU:
        return gate / (1.0 + torch.exp(-gate)) * up
    if kind == SWIGLU_OAI:  # gpt-oss: ggml_swiglu_oai with alpha 1.702, limit 7
        x = gate.clamp(max=7.0)
        y = up.clamp(-7.0, 7.0)
        return x / (1.0 + torch.exp(-1.702 * x)) * (y + 1.0)
    raise ValueError(f"unknown activation {kind!r}")


@dataclass
class ExpertTensor:
    """One stacked expert tensor [n_expert, rows, cols] kept as raw GGUF bytes (memory-mapped)."""

    raw: torch.Tensor  # uint8 [n_expert, rows, row_bytes]
    qtype: QT
    shape: tuple[int, int, int]
    bias: torch.Tensor | None  # [n_expert, rows] float32

    @classmethod
    def load(cls, mf: ModelFile, name: str, device: torch.device | str) -> "ExpertTensor":
        info = mf.tensors[f"{name}.weight"]
        check_supported(info.qtype, info.name)
        return cls(mf.torch_raw(info.name), info.qtype, info.shape, optional_vector(mf, f"{name}.bias", device))

    def expert(self, e: int, device: torch.device | str) -> torch.Tensor:
        """Float32 weight [rows, cols] of expert e."""
        return dequantize(self.raw[e].to(device), self.qtype, self.shape[1:])

    @property
    def expert_bytes(self) -> int:
        return self.raw[0].numel()


@dataclass
class ExpertWeights:
    gate: ExpertTensor
    up: ExpertTensor
    down: ExpertTensor
    activation: str = SILU

    @property
    def n_expert(self) -> int:
        return self.gate.shape[0]


def expert_ffn(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
               w: ExpertWeights, e: int) -> torch.Tensor:
    """One expert on rows x [n, D] given its float32 weights; biases and rounding included."""
    g = matmul(round_activation(x, w.gate.qtype), gate.T)
    u = matmul(round_activation(x, w.up.qtype), up.T)
    if w.gate.bias is not None:
        g = g + w.gate.bias[e]
    if w.up.bias is not None:
        u = u + w.up.bias[e]
    a = activate(w.activation, g, u)
    d = matmul(round_activation(a, w.down.qtype), down.T)
    return d + w.down.bias[e] if w.down.bias is not None else d


class Experts(Protocol):
    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for each token t: [T, D]."""


class ReferenceExperts:
    """Every expert dequantized on the compute device when used (optionally kept)."""

    def __init__(self, layers: dict[int, ExpertWeights], device: torch.device | str, keep_dequantized: bool):
        self.layers, self.device, self.keep = layers, device, keep_dequantized
        self._cache: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def weights_of(self, layer: int, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        key = (layer, e)
        if key in self._cache:
            return self._cache[key]
        w = self.layers[layer]
        mats = (w.gate.expert(e, self.device), w.up.expert(e, self.device), w.down.expert(e, self.device))
        if self.keep:
            self._cache[key] = mats
        return mats

    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        w = self.layers[layer]
        k = ids.shape[1]
        per_slot = torch.zeros(k, *x.shape, dtype=x.dtype, device=x.device)
        for e in torch.unique(ids).tolist():
            tok, slot = torch.nonzero(ids == e, as_tuple=True)
            out = expert_ffn(x[tok], *self.weights_of(layer, e), w, e)
            per_slot[slot, tok] = out * weights[tok, slot, None]
        # llama.cpp adds the weighted experts slot by slot: keep that summation order.
        total = per_slot[0]
        for j in range(1, k):
            total = total + per_slot[j]
        return total
