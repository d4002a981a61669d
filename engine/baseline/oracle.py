"""The reference: llama.cpp itself, run on a GGUF, returning logits and the routed experts.

Route to the experts: llama.cpp names the router's top-k result `ffn_moe_topk-<layer>` in
every architecture's graph (llama-graph.cpp, build_moe_ffn). The scheduler's eval callback
asks for exactly those tensors (and `ffn_moe_probs-<layer>` to tell ties apart) and copies
them out with ggml_backend_tensor_get after they are computed. Logits come from
llama_get_logits with every position marked as an output.

The KV cache is F32 and flash attention off, so the only rounding left that differs from a
float32 computation is ggml's activation quantization in its CPU matmuls (documented in
engine/quant); that is what makes this usable as a parity oracle.
"""
from __future__ import annotations

import ctypes as C
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.baseline.llama_load import llama_cpp, load_model
from engine.quant.ggml_lib import GGMLTensor, tensor_to_numpy

_CAPTURED = re.compile(r"^(ffn_moe_topk|ffn_moe_probs)-(\d+)$")
GGML_TYPE_F32 = 0


@dataclass
class Reference:
    tokens: list[int]
    logits: np.ndarray | None  # [n_tokens, n_vocab] float32
    moe_layers: list[int]  # layer index of each MoE layer, in order
    experts: np.ndarray  # [n_tokens, n_moe_layers, k] int32, in llama.cpp's top-k order
    probs: np.ndarray  # [n_tokens, n_moe_layers, n_expert] router probabilities (selection scores)
    n_expert: int = field(init=False)

    def __post_init__(self) -> None:
        self.n_expert = int(self.probs.shape[-1])


def run_reference(model_path: str | Path, tokens: list[int], *, generate: int = 0, logits: bool = True,
                  n_threads: int | None = None, chunk: int = 512) -> Reference:
    """Evaluates `tokens` from position 0 with llama.cpp (CPU) and captures routing.

    With `generate` > 0 it then appends that many greedy tokens (end-of-generation tokens
    do not stop it), one decode step each, so `tokens`, `logits` and `experts` of the
    result cover the prompt and the continuation.
    """
    L = llama_cpp()
    captured: dict[tuple[str, int], list[np.ndarray]] = {}
    errors: list[BaseException] = []

    @L.ggml_backend_sched_eval_callback
    def on_tensor(ptr, ask, _user):
        name = C.cast(ptr, C.POINTER(GGMLTensor)).contents.name.decode(errors="replace")
        m = _CAPTURED.match(name)
        if ask:
            return m is not None
        if m:
            try:
                dtype = np.int32 if m.group(1) == "ffn_moe_topk" else np.float32
                arr = tensor_to_numpy(ptr, dtype)
                captured.setdefault((m.group(1), int(m.group(2))), []).append(arr.reshape(arr.shape[-2], arr.shape[-1]))
            except BaseException as e:  # an exception cannot cross the C callback: re-raised below
                errors.append(e)
                return False
        return True

    tokens = list(tokens)
    n_total = len(tokens) + generate
    rows: list[np.ndarray] = []
    model = load_model(model_path)
    try:
        cp = L.llama_context_default_params()
        cp.n_ctx = max(n_total, 16)
        cp.n_batch = cp.n_ubatch = min(chunk, max(len(tokens), 1))
        cp.type_k = cp.type_v = GGML_TYPE_F32
        cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        # On a GPU build the weights stay on the CPU (n_gpu_layers 0); these keep the KV cache and
        # the big-batch matmuls there too, so the reference computes on the CPU everywhere.
        cp.op_offload = False
        cp.offload_kqv = False
        if n_threads:
            cp.n_threads = cp.n_threads_batch = n_threads
        cp.cb_eval = on_tensor
        ctx = L.llama_init_from_model(model, cp)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not create a context for {model_path}")
        try:
            n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
            pos = 0
            pending = tokens
            while True:
                for start in range(0, len(pending), cp.n_batch):
                    part = pending[start:start + cp.n_batch]
                    out = _decode(L, ctx, part, pos, n_vocab)
                    pos += len(part)
                    rows.append(out if logits else out[-1:])
                if pos >= n_total:
                    break
                nxt = int(np.argmax(rows[-1][-1]))
                tokens.append(nxt)
                pending = [nxt]
        finally:
            L.llama_free(ctx)
    finally:
        L.llama_model_free(model)

    if errors:
        raise errors[0]
    layers = sorted({il for kind, il in captured if kind == "ffn_moe_topk"})
    # Each callback holds one ubatch [n_tokens_in_chunk, k]: stack chunks along tokens.
    experts = np.stack([np.concatenate(captured[("ffn_moe_topk", il)]) for il in layers], axis=1)
    probs = np.stack([np.concatenate(captured[("ffn_moe_probs", il)]) for il in layers], axis=1)
    all_logits = np.concatenate(rows) if logits else None
    return Reference(tokens, all_logits, layers, experts, probs)


def _decode(L, ctx, part: list[int], pos: int, n_vocab: int) -> np.ndarray:
    """Decodes `part` at positions pos.., returning the logits of every position.

    Every position must be an output: llama.cpp drops non-output rows before the last
    layer's FFN, which would hide that layer's routing for them.
    """
    batch = L.llama_batch_init(len(part), 0, 1)
    try:
        for i, tok in enumerate(part):
            batch.token[i] = tok
            batch.pos[i] = pos + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = True
        batch.n_tokens = len(part)
        rc = L.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with code {rc}")
        return np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(len(part), n_vocab)).copy()
    finally:
        L.llama_batch_free(batch)
