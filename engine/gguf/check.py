"""Is a sound GGUF file a model the loaders can build? Checks on the header only, before any loading.

The reader proves the file is a sound GGUF: every length and extent fits in the file. The model
builders (engine/models), the memory planner and llama.cpp then assume more of the metadata and
the tensor table: that the hyperparameters they read are numbers of the right kind, in a range
that cannot make them allocate without bound (a context length of 2^40 would size the KV cache
with `-c 0`; a block count of 2^40 a tuple of layers), that the model routes to experts, that the
expert and embedding tensors agree with the hyperparameters, and that no two tokens are the same
string (llama.cpp checks its other tokenizer arrays itself). A file that fails gets one GGUFError
naming the key or tensor, instead of a TypeError, a KeyError, a huge allocation inside a builder
or an abort inside llama.cpp.

`moestudio serve` runs this before it listens; like the reader it needs no torch.
"""
from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any, Callable

from engine.errors import UserError
from engine.gguf.reader import GGUFError, ModelFile

# Bounds far beyond any real model (the largest today: 128 layers, 512 experts, 10M tokens of
# context, widths of 32k): a value past one is corruption, not a model.
MAX_LAYERS = 4096
MAX_EXPERTS = 1 << 16  # STRP profiles index experts with a u16
MAX_WIDTH = 1 << 20
MAX_HEADS = 1 << 12
MAX_CONTEXT = 1 << 24

_EXPERT_TENSOR = re.compile(r"blk\.(\d+)\.(ffn_(?:gate|up|down|gate_up)_exps)\.weight")
Check = Callable[[Any], "str | None"]  # the problem with a value, or None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _whole(lo: int, hi: int) -> Check:
    def check(v: Any) -> str | None:
        if not _is_int(v):
            return f"must be a whole number, not {_shown(v)}"
        return None if lo <= v <= hi else f"is {v}, outside {lo}..{hi}"
    return check


def _per_layer(lo: int, hi: int) -> Check:
    """A whole number, or llama.cpp's per-layer array of them."""
    one = _whole(lo, hi)

    def check(v: Any) -> str | None:
        if isinstance(v, list):
            return next((f"item {i} {p}" for i, x in enumerate(v) if (p := one(x))), None)
        return one(v)
    return check


def _number(positive: bool = False) -> Check:
    def check(v: Any) -> str | None:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return f"must be a finite number, not {_shown(v)}"
        return f"must be positive, not {v}" if positive and v <= 0 else None
    return check


def _kind(kind: type, name: str) -> Check:
    return lambda v: None if isinstance(v, kind) else f"must be {name}, not {_shown(v)}"


def _shown(v: Any) -> str:
    text = repr(v) if not isinstance(v, list) else f"an array of {len(v)} items"
    text = text if len(text) <= 40 else text[:37] + "..."
    return f"{type(v).__name__} {text}" if not isinstance(v, list) else text


# Every `{arch}.` key the loaders read, with what they assume of it (engine/models,
# engine/plan/geometry.py, engine/moe/profile.py).
ARCH_KEYS: dict[str, Check] = {
    "block_count": _whole(1, MAX_LAYERS),
    "context_length": _whole(1, MAX_CONTEXT),
    "embedding_length": _whole(1, MAX_WIDTH),
    "feed_forward_length": _per_layer(0, MAX_WIDTH),
    "expert_count": _whole(0, MAX_EXPERTS),
    "expert_used_count": _whole(0, MAX_EXPERTS),
    "expert_feed_forward_length": _whole(0, MAX_WIDTH),
    "expert_shared_feed_forward_length": _whole(0, MAX_WIDTH),
    "expert_shared_count": _whole(0, MAX_EXPERTS),
    "expert_group_count": _whole(0, MAX_EXPERTS),
    "expert_group_used_count": _whole(0, MAX_EXPERTS),
    "expert_gating_func": _whole(0, 255),
    "expert_weights_scale": _number(),
    "expert_weights_norm": _kind(bool, "true or false"),
    "leading_dense_block_count": _whole(0, MAX_LAYERS),
    "nextn_predict_layers": _whole(0, MAX_LAYERS),
    "attention.head_count": _per_layer(1, MAX_HEADS),
    "attention.head_count_kv": _per_layer(0, MAX_HEADS),
    "attention.key_length": _whole(1, MAX_WIDTH),
    "attention.value_length": _whole(1, MAX_WIDTH),
    "attention.key_length_mla": _whole(0, MAX_WIDTH),
    "attention.value_length_mla": _whole(0, MAX_WIDTH),
    "attention.kv_lora_rank": _whole(0, MAX_WIDTH),
    "attention.q_lora_rank": _whole(0, MAX_WIDTH),
    "attention.layer_norm_rms_epsilon": _number(positive=True),
    "attention.sliding_window": _whole(0, MAX_CONTEXT),
    "attention.temperature_scale": _number(),
    "rope.dimension_count": _whole(0, MAX_WIDTH),
    "rope.freq_base": _number(positive=True),
    "rope.freq_base_swa": _number(positive=True),
    "rope.scaling.type": _kind(str, "a string"),
    "rope.scaling.factor": _number(),
    "rope.scaling.attn_factor": _number(),
    "rope.scaling.original_context_length": _whole(0, MAX_CONTEXT),
    "rope.scaling.yarn_log_multiplier": _number(),
}


class NotMoEModel(GGUFError):
    """A sound model file that does not route to experts: MoE Studio has nothing to offload."""


def check_model(mf: ModelFile, *, require_moe: bool = True) -> None:
    """GGUFError naming the first problem; `require_moe=False` for llama.cpp, which runs dense models too."""
    def fail(problem: str) -> GGUFError:
        return GGUFError(f"{mf.path}: {problem}")

    for suffix, check in ARCH_KEYS.items():
        key = f"{mf.arch}.{suffix}"
        if key in mf.metadata and (problem := check(mf.metadata[key])):
            raise fail(f"metadata {key} {problem}")
    n_layer, n_embd = mf.arch_key("block_count"), mf.arch_key("embedding_length")  # GGUFError if missing
    for suffix in ("attention.head_count", "attention.head_count_kv", "feed_forward_length"):
        value = mf.arch_key(suffix, None)
        if isinstance(value, list) and len(value) != n_layer:
            raise fail(f"metadata {mf.arch}.{suffix} has {len(value)} per-layer values for {n_layer} layers")
    n_vocab = _vocab_size(mf, fail)
    embd = mf.tensors.get("token_embd.weight")
    if embd is not None:
        if len(embd.shape) != 2 or embd.shape[1] != n_embd:
            raise fail(f"tensor token_embd.weight has shape {list(embd.shape)}, not [n_vocab, {n_embd}] "
                       f"({mf.arch}.embedding_length is {n_embd})")
        if n_vocab is not None and embd.shape[0] != n_vocab:
            raise fail(f"tensor token_embd.weight has {embd.shape[0]} rows for a vocabulary of {n_vocab} tokens")
    _check_experts(mf, fail, n_layer, n_embd, require_moe)


def _vocab_size(mf: ModelFile, fail: Callable[[str], GGUFError]) -> int | None:
    """The token count, or None if the file has no token strings (llama.cpp then refuses it itself).

    llama.cpp aborts the whole process (GGML_ASSERT in llama_vocab::load) when two tokens are the
    same string, which one flipped bit in the vocabulary can cause: refused here with a message."""
    tokens = mf.raw_strings("tokenizer.ggml.tokens")
    if tokens is None:
        return None
    # llama.cpp renames empty tokens before it maps strings to ids; so does this check.
    seen: dict[bytes, int] = {}
    for i, token in enumerate(tokens):
        token = token or f"[EMPTY_{i}]".encode()
        first = seen.setdefault(token, i)
        if first != i:
            raise fail(f"tokens {first} and {i} of tokenizer.ggml.tokens are the same string {token[:40]!r}; "
                       "the vocabulary is corrupt")
    return len(tokens)


def _check_experts(mf: ModelFile, fail: Callable[[str], GGUFError], n_layer: int, n_embd: int,
                   require_moe: bool) -> None:
    n_expert = mf.arch_key("expert_count", 0) or 0
    layers: dict[int, set[str]] = {}  # MoE layer -> the expert tensors it has
    for name, info in mf.tensors.items():
        m = _EXPERT_TENSOR.fullmatch(name)
        if not m:
            continue
        layer, kind = int(m.group(1)), m.group(2)
        if layer >= n_layer:
            raise fail(f"tensor {name} belongs to layer {layer}, but {mf.arch}.block_count is {n_layer}")
        if not n_expert:
            raise fail(f"tensor {name} holds experts, but {mf.arch}.expert_count is missing or 0")
        # numpy order [expert, rows, row]: gate/up read the embedding, down writes it.
        width = info.shape[1] if kind == "ffn_down_exps" else info.shape[-1]
        if len(info.shape) != 3 or info.shape[0] != n_expert or width != n_embd:
            want = "[experts, n_embd, width]" if kind == "ffn_down_exps" else "[experts, width, n_embd]"
            raise fail(f"tensor {name} has shape {list(info.shape)}, not {want} with {n_expert} experts and "
                       f"n_embd {n_embd}")
        layers.setdefault(layer, set()).add(kind)
    if not layers:
        if require_moe:
            raise NotMoEModel(f"{mf.path} is not a Mixture-of-Experts model (no expert tensors"
                              f"{'' if n_expert else f', no {mf.arch}.expert_count'}); MoE Studio runs MoE "
                              "models (--engine llamacpp runs it with plain llama.cpp)")
        return
    n_used = mf.arch_key("expert_used_count")
    if not 1 <= n_used <= n_expert:
        raise fail(f"metadata {mf.arch}.expert_used_count is {n_used}; it must be from 1 to "
                   f"{mf.arch}.expert_count ({n_expert})")
    routed = sorted(int(n.split(".")[1]) for n in mf.tensors if re.fullmatch(r"blk\.\d+\.ffn_gate_inp\.weight", n))
    if unrouted := [layer for layer in routed if layer not in layers]:
        raise fail(f"layer {unrouted[0]} has a router (blk.{unrouted[0]}.ffn_gate_inp.weight) but no expert tensors; "
                   "the model file is incomplete")
    # Every MoE layer holds the same expert tensors: one a layer lacks is a damaged or cut file.
    kinds = set().union(*layers.values())
    for layer in sorted(layers):
        missing = sorted(kinds - layers[layer])
        if missing:
            raise fail(f"tensor blk.{layer}.{missing[0]}.weight is missing (the other MoE layers have it); "
                       "the model file is incomplete")
        if f"blk.{layer}.ffn_gate_inp.weight" not in mf.tensors:
            raise fail(f"tensor blk.{layer}.ffn_gate_inp.weight (the router of MoE layer {layer}) is missing")


def open_model(path: str | os.PathLike[str], *, require_moe: bool = True) -> ModelFile:
    """The checked model file, or a UserError saying why not: the one way the command-line tools
    and the server open a model before building it."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"no such model file: {path}")
    try:
        mf = ModelFile.open(path)
        check_model(mf, require_moe=require_moe)
    except NotMoEModel:
        raise
    except GGUFError as e:
        # "cannot read the model": the words the app's crash classifier reads as a bad model.
        raise UserError(f"cannot read the model: {e}") from None
    except OSError as e:
        raise UserError(f"cannot read the model {path}: {e.strerror or e}") from None
    return mf
