"""The decoder every supported family shares: embed, N blocks of attention + FFN, norm, head.

A family module (engine/models/<arch>.py) reads its hyperparameters and builds the blocks;
what differs between families is in those modules. The expert computation is not owned by
the blocks: `DecoderModel.experts` is passed in at each forward, so the hybrid engine can
replace the reference executor without touching the model.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np
import torch

from engine.gguf.reader import ModelFile
from engine.layers.attention import KVCache, forget_masks
from engine.layers.linear import Linear, compile_dense_kernels
from engine.layers.moe import Experts, ExpertWeights, Router, activate, SILU
from engine.layers.norm import add_rms_norm, rms_norm
from engine.quant.dequant import check_supported, dequantize


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim_k: int  # per-head width of what the KV cache holds
    head_dim_v: int
    n_vocab: int
    n_ctx_train: int
    rms_eps: float
    n_expert: int
    n_expert_used: int
    moe_layers: tuple[int, ...]


class Attention(Protocol):
    def __call__(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache, layer: int,
                 start: int | None) -> torch.Tensor:
        """`positions` [T] on the device; `start` their first as a host int, or None inside a
        CUDA graph (the whole cache is attended, masked by position)."""


class DenseFFN:
    """gate/up/down with SiLU: deepseek2's leading dense layers and the shared experts."""

    def __init__(self, mf: ModelFile, prefix: str, device: torch.device | str, suffix: str = ""):
        self.gate = Linear.load(mf, f"{prefix}.ffn_gate{suffix}", device)
        self.up = Linear.load(mf, f"{prefix}.ffn_up{suffix}", device)
        self.down = Linear.load(mf, f"{prefix}.ffn_down{suffix}", device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(activate(SILU, self.gate(x), self.up(x)))


@dataclass
class MoEFFN:
    layer: int
    router: Router
    shared: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __call__(self, x: torch.Tensor, experts: Experts) -> torch.Tensor:
        ids, weights = self.router(x)
        out = experts(self.layer, x, ids, weights)
        return out + self.shared(x) if self.shared is not None else out


@dataclass
class Block:
    attn_norm: torch.Tensor
    attention: Attention
    ffn_norm: torch.Tensor
    ffn: MoEFFN | DenseFFN

    @property
    def is_moe(self) -> bool:
        return isinstance(self.ffn, MoEFFN)


class Embedding:
    """Token rows decoded on demand from the (memory-mapped) GGUF table."""

    def __init__(self, mf: ModelFile, name: str, device: torch.device | str):
        info = mf.tensors[name]
        check_supported(info.qtype, info.name)
        self.raw, self.qtype, self.row_shape, self.device = mf.torch_raw(name), info.qtype, info.shape[1:], device

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.decode(self.rows(tokens).to(self.device))

    def rows(self, tokens: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The raw table rows (uint8 [T, row bytes], host) of `tokens`: numpy's take, which copies
        a row at a time (torch's indexing of a uint8 table goes byte by byte: 2.2 ms against
        0.2 ms for 512 rows of Qwen3's 1,680-byte Q6_K rows on the 2-core CI machine). `out`: a
        host tensor (the runners' pinned staging) taken into directly: copying the rows into it
        with torch took 8-18 ms for 512 rows on the H200's host (session 23; 0.09 ms on 2 idle
        cores: by elimination, torch's parallel copy beside the CPU pool's spinning threads)."""
        taken = np.take(self.raw.numpy(), tokens.cpu().numpy(), axis=0, out=None if out is None else out.numpy())
        return out if out is not None else torch.from_numpy(taken)

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        """Float32 [rows, n_embd] of raw table rows (uint8 [rows, row bytes]) on the device."""
        return dequantize(rows, self.qtype, (rows.shape[0], *self.row_shape))


@dataclass
class DecoderModel:
    config: ModelConfig
    embed: Embedding
    blocks: list[Block]
    output_norm: torch.Tensor
    output: Linear
    expert_weights: dict[int, ExpertWeights]
    experts: Experts
    source: ModelFile
    device: torch.device | str = "cpu"
    _runner: object | None = field(default=None, repr=False)  # DecodeRunner of the last cache decoded
    _prompt_runner: object | None = field(default=None, repr=False)  # PromptRunner of the last cache prefilled

    def new_cache(self, n_ctx: int) -> KVCache:
        c = self.config
        return KVCache(c.n_layer, n_ctx, c.n_head_kv, c.head_dim_k, c.head_dim_v, self.device)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: KVCache, start: int | None = None, *,
                last_only: bool = False, graph: bool = False) -> torch.Tensor:
        """Logits [T, n_vocab] for `tokens` [T] placed at positions start.. (default: cache end);
        with `last_only` [1, n_vocab], the last token's: all a prompt needs (the output head
        over every row of a chunk of a 150k-token vocabulary is a product as large as the rest
        of the chunk's, and its float32 weights a transient of 4 bytes a parameter). `graph`:
        a full prompt chunk, which recurs at this start (the prompt runner may capture it)."""
        start = cache.length if start is None else start
        end = start + tokens.numel()
        if end > cache.n_ctx:
            raise ValueError(f"context full: {end} tokens exceed the context length {cache.n_ctx}")
        if cuda_graphs_enabled(self.device):
            if tokens.numel() == 1:
                return self._decode_runner(cache).step(tokens, start)
            if graph:
                logits = self._chunk_runner(cache, tokens.numel()).step(tokens, start, last_only)
                if logits is not None:
                    return logits
        positions = torch.arange(start, end, device=self.device)
        logits = self.run(self.embed(tokens), positions, cache, start, self.experts, last_only)
        cache.length = end
        return logits

    def run(self, h: torch.Tensor, positions: torch.Tensor, cache: KVCache, start: int | None,
            experts: Experts, last_only: bool = False) -> torch.Tensor:
        """The forward from the embedded rows h [T, D] to the logits, written once: eagerly for
        prompts, and captured as the decode token's CUDA graph (start None: attention is given
        the whole cache and reads up to the device-side position; nothing here may wait for the
        host)."""
        eps = self.config.rms_eps
        forget_masks()
        # Each residual add is fused with the norm that reads its sum (add_rms_norm: one launch
        # on the kernels' path): x is always the normalised h the next step takes.
        next_norms = [b.attn_norm for b in self.blocks[1:]] + [self.output_norm]
        x = rms_norm(h, self.blocks[0].attn_norm if self.blocks else self.output_norm, eps)
        for i, (block, next_norm) in enumerate(zip(self.blocks, next_norms)):
            h, x = add_rms_norm(h, block.attention(x, positions, cache, i, start), block.ffn_norm, eps)
            h, x = add_rms_norm(h, block.ffn(x, experts) if block.is_moe else block.ffn(x), next_norm, eps)
        return self.output(x[-1:] if last_only else x)

    def compile_dense_kernels(self) -> None:
        """Compiles, in parallel threads, the few-row dense kernel's variants the forward launches
        (layers/linear.compile_dense_kernels): the head's at one row (a prompt step keeps its last
        row), the blocks' weights at every count up to the kernel's."""
        from engine.quant.triton_kernels import DENSE_MAX_ROWS

        compile_dense_kernels([(self.output, 1)] + [(lin, DENSE_MAX_ROWS) for lin in self._block_linears()])

    def _block_linears(self) -> list[Linear]:
        """Every Linear the blocks hold (attention projections, routers, shared experts, dense
        FFNs, whatever a family keeps them in), each once."""
        found, seen, stack = [], set(), list(self.blocks)
        while stack:
            obj = stack.pop()
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            if isinstance(obj, Linear):
                found.append(obj)
            elif isinstance(obj, (list, tuple)):
                stack.extend(obj)
            elif isinstance(obj, dict):
                stack.extend(obj.values())
            elif type(obj).__module__.startswith("engine.") and hasattr(obj, "__dict__"):
                stack.extend(vars(obj).values())
        return found

    def settle(self) -> None:
        """Brings the expert counters up to date at a request's end (the decode graph's trail by
        one token, a prompt graph's replays are learnt once landed)."""
        if self._runner is not None:
            self._runner.settle()
        settle_prompt = getattr(self.experts, "settle_prompt", None)
        if settle_prompt is not None:
            settle_prompt()

    def _decode_runner(self, cache: KVCache):
        from engine.runtime.decode_runner import DecodeRunner

        if self._runner is None or self._runner.cache is not cache:
            if self._runner is not None:
                self._runner.close()
            self._runner = None  # free the old graph's memory before capturing a new one
            self._runner = DecodeRunner(self, cache)
        return self._runner

    def _chunk_runner(self, cache: KVCache, rows: int):
        from engine.runtime.prompt_runner import PromptRunner

        if self._prompt_runner is None or self._prompt_runner.cache is not cache or self._prompt_runner.n_rows != rows:
            if self._prompt_runner is not None:
                self._prompt_runner.close()
            self._prompt_runner = None  # free the old graphs' memory before capturing new ones
            self._prompt_runner = PromptRunner(self, cache, rows)
        return self._prompt_runner


def cuda_graphs_enabled(device: torch.device | str) -> bool:
    """One-token steps and full prompt chunks replay CUDA graphs on CUDA devices unless
    MOESTUDIO_CUDA_GRAPHS=0."""
    import os

    return torch.device(device).type == "cuda" and os.environ.get("MOESTUDIO_CUDA_GRAPHS", "1") != "0"
