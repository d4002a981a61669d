"""Reading the hyperparameters every family shares from GGUF metadata, with llama.cpp's defaults."""
from __future__ import annotations

import math

from engine.gguf.reader import ModelFile
from engine.layers.rope import RopeConfig


def rope_config(mf: ModelFile, n_rot: int, neox: bool, *, freq_base: float | None = None,
                yarn_log_mul: float | None = None) -> RopeConfig:
    """RoPE as llama.cpp's context sets it up (llama-context.cpp, llama_context constructor).

    A YaRN model gets ext_factor 1 and an attention factor that cancels ggml's own
    1 + 0.1 ln(factor) magnitude term, unless `rope.scaling.yarn_log_multiplier` asks for
    DeepSeek's mscale ratio.
    """
    scaling = mf.arch_key("rope.scaling.type", "linear")
    factor = float(mf.arch_key("rope.scaling.factor", 0.0) or 0.0)
    freq_scale = 1.0 if factor == 0.0 or scaling == "none" else 1.0 / factor
    n_ctx_train = int(mf.arch_key("context_length"))
    n_ctx_orig = int(mf.arch_key("rope.scaling.original_context_length", n_ctx_train))
    ext_factor = 1.0 if scaling == "yarn" else 0.0
    attn_factor = 1.0
    if ext_factor != 0.0:
        f = 1.0 / freq_scale

        def mscale(scale: float, m: float) -> float:
            return 1.0 if scale <= 1.0 else 0.1 * m * math.log(scale) + 1.0

        log_mul = float(mf.arch_key("rope.scaling.yarn_log_multiplier", 0.0)) if yarn_log_mul is None else yarn_log_mul
        if log_mul != 0.0:
            m = log_mul if (mf.arch == "deepseek2" and log_mul != 1.0) else 1.0
            attn_factor = mscale(f, m) / mscale(f, log_mul)
        else:
            attn_factor = mscale(f, 1.0)
        attn_factor *= 1.0 / (1.0 + 0.1 * math.log(f))
    attn_factor *= float(mf.arch_key("rope.scaling.attn_factor", 1.0))
    return RopeConfig(
        n_rot=n_rot, neox=neox,
        freq_base=float(freq_base if freq_base is not None else mf.arch_key("rope.freq_base", 10000.0)),
        freq_scale=freq_scale, ext_factor=ext_factor, attn_factor=attn_factor,
        # llama.cpp reads yarn_beta_* only for grok and mistral3; every family here keeps 32 and 1.
        beta_fast=32.0, beta_slow=1.0,
        n_ctx_orig=n_ctx_orig,
    )
