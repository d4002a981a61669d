"""Weight values for each tensor role of a synthetic model (see engine.synth.routing)."""
from __future__ import annotations

import zlib

import numpy as np

from engine.synth.layout import TensorSpec
from engine.synth.randblocks import random_blocks
from engine.synth.routing import Routing, Subspaces, qk_amplitude, recency_pattern
from engine.synth.spec import ModelSpec

NEOX_ROPE = {"qwen3moe", "qwen2moe", "olmoe", "gpt-oss"}
NOISE = 0.02  # relative size of the unstructured part of shaped projections
EXPERT_OUT = 0.5  # rms of one expert's output relative to a unit-rms hidden state
C_LEVEL = 1.0  # value of each constant dimension in a token embedding


class WeightMaker:
    """Makes every tensor from (seed, tensor name) alone, so tensors can be written in any order."""

    def __init__(self, spec: ModelSpec, routing: Routing, seed: int):
        self.spec, self.routing, self.seed = spec, routing, seed
        self.sub = Subspaces.of(spec.n_embd)
        rot_dim = spec.rope_dim or spec.head_dim
        self.pattern = recency_pattern(rot_dim, neox=spec.arch in NEOX_ROPE, rope_base=spec.rope_base)
        self.qk_amplitude = qk_amplitude(routing.window, spec.head_dim)
        # Shared across layers: the router's view of a token and of its context.
        rng = self._rng("router-directions")
        nt = self.sub.t.stop - self.sub.t.start
        ns = self.sub.s.stop - self.sub.s.start
        self.router_t = _unit_rows(rng.standard_normal((spec.n_expert, nt)))
        self.router_s = _unit_rows(rng.standard_normal((spec.n_expert, ns)))

    def _rng(self, name: str) -> np.random.Generator:
        return np.random.default_rng([self.seed, zlib.crc32(name.encode())])

    def make(self, t: TensorSpec) -> np.ndarray:
        """float32 values, or uint8 raw blocks when random quantized blocks stand in for experts."""
        rng = self._rng(t.name)
        role = t.role
        if role == "norm":
            return np.ones(t.shape, np.float32)
        if role == "zeros":
            return np.zeros(t.shape, np.float32)
        if role.startswith("expert_") and self.spec.is_geometry and t.qtype.name != "F16":
            fan_in = t.shape[-1]
            std = (EXPERT_OUT / np.sqrt(self.spec.n_expert_used * fan_in)) if role == "expert_down" else 1 / np.sqrt(fan_in)
            return random_blocks(rng, t.qtype, t.shape, std)
        maker = getattr(self, f"_{role}")
        return maker(t, rng).astype(np.float32, copy=False)

    # --- embeddings and head -------------------------------------------------------------
    def _token_embd(self, t: TensorSpec, rng: np.random.Generator) -> np.ndarray:
        e = np.zeros(t.shape, np.float32)
        e[:, self.sub.c] = C_LEVEL
        e[:, self.sub.t] = rng.standard_normal((t.shape[0], self.sub.t.stop - self.sub.t.start))
        return e

    def _output(self, t: TensorSpec, rng: np.random.Generator) -> np.ndarray:
        return rng.standard_normal(t.shape) / np.sqrt(t.shape[1])

    # --- attention: constant q/k on C, values from T, output into S ------------------------
    def _constant_read(self, t: TensorSpec, rng: np.random.Generator, amplitude: float) -> np.ndarray:
        """Rows per head = amplitude * pattern, reading the mean of the C dims."""
        n_heads = t.shape[0] // self.pattern.size if not self.spec.rope_dim else t.shape[0] // self.spec.head_dim
        w = rng.standard_normal(t.shape) * (NOISE / np.sqrt(t.shape[1]))
        nc = self.sub.c.stop - self.sub.c.start
        head = np.zeros(t.shape[0] // n_heads, np.float32)
        head[-self.pattern.size:] = self.pattern  # MLA keeps the rotary part at the end of a head
        w[:, self.sub.c] += np.tile(head, n_heads)[:, None] * (amplitude / (nc * C_LEVEL))
        return w

    def _attn_q(self, t: TensorSpec, rng: np.random.Generator) -> np.ndarray:
        return self._constant_read(t, rng, self._qk_amplitude_in_weights())

    _attn_k = _attn_q

    def _qk_amplitude_in_weights(self) -> float:
        # Archs with a q/k norm get their amplitude from the norm weight instead; without one,
        # q scales with 1/rms of the normed hidden state, about 1/C_LEVEL here.
        return 1.0 if self.spec.arch in ("qwen3moe", "olmoe") else self.qk_amplitude

    def _q_norm(self, t: TensorSpec, rng: np.random.Generator) -> np.ndarray:
        return np.full(t.shape, self.qk_amplitude, np.float32)

    _k_norm = _q_norm

    def _attn_v(self, t: TensorSpec, rng: np.random.Generator) -> np.ndarray:
        w = rng.standard_normal(t.shape) * (NOISE / np.sqrt(t.shape[1]))
        nt = self.sub.t.stop - self.sub.t.start
        w[:, self.sub.t] += rng.standard_normal((t.shape[0], nt)) / np.sqrt(nt)
        return w

    def _attn_output(self, t: TensorSpec, rng: np.random.Generator) -> np.ndarray:
        w = rng.standard_normal(t.shape) * (NOISE / np.sqrt(t.shape[1]))
        ns = self.sub.s.stop - self.sub.s.start
        # Averaging k recent tokens shrinks a vector by ~sqrt(k): the gain restores unit scale.
        w[self.sub.s, :] += rng.standard_normal((ns, t.shape[1])) * (2.0 / np.sqrt(t.shape[1]))
        return w

    def _attn_q_bias(self, t: TensorSpec, rng: np.random.Generator) -> np.ndarray:
        return np.zeros(t.shape, np.float32)

    _attn_k_bias = _attn_q_bias

    # --- router: token vs context mix plus a popularity bias ---------------------------------
    def _router(self, t: TensorSpec, rng: np.random.Generator) -> np.ndarray:
        r = self.routing
        w = np.zeros(t.shape, np.float32)
        w[:, self.sub.t] = self.router_t * (r.sharpness * (1 - r.context))
        w[:, self.sub.s] = self.router_s * (r.sharpness * r.context)
        # Each layer gets its own mix of the shared directions, so layers differ but correlate.
        w[:, self.sub.t] += _unit_rows(rng.standard_normal(self.router_t.shape)) * (0.5 * r.sharpness * (1 - r.context))
        w[:, self.sub.s] += _unit_rows(rng.standard_normal(self.router_s.shape)) * (0.5 * r.sharpness * r.context)
        nc = self.sub.c.stop - self.sub.c.start
        popularity = rng.standard_normal(t.shape[0]) * r.skew
        w[:, self.sub.c] = popularity[:, None] / (nc * C_LEVEL)
        return w

    # --- experts and shared experts ------------------------------------------------------------
    def _expert_gate(self, t: TensorSpec, rng: np.random.Generator) -> np.ndarray:
        return rng.standard_normal(t.shape) / np.sqrt(t.shape[-1])

    _expert_up = _expert_gate
    _shexp_gate = _expert_gate
    _shexp_up = _expert_gate
    _ffn_gate = _expert_gate
    _ffn_up = _expert_gate

    def _expert_down(self, t: TensorSpec, rng: np.random.Generator) -> np.ndarray:
        return rng.standard_normal(t.shape) * (EXPERT_OUT / np.sqrt(self.spec.n_expert_used * t.shape[-1]))

    _shexp_down = _expert_down
    _ffn_down = _expert_down

    def _shexp_gate_inp(self, t: TensorSpec, rng: np.random.Generator) -> np.ndarray:
        return rng.standard_normal(t.shape) / np.sqrt(t.shape[-1])

    def _bias(self, t: TensorSpec, rng: np.random.Generator) -> np.ndarray:
        return rng.standard_normal(t.shape) * 0.02

    # --- gpt-oss and deepseek2 roles -----------------------------------------------------------
    def _qk_noise(self, t: TensorSpec, rng: np.random.Generator) -> np.ndarray:
        """gpt-oss q/k weights: small noise only; the constant query/key lives in the biases."""
        return rng.standard_normal(t.shape) * (NOISE / np.sqrt(t.shape[1]))

    def _oai_qk_bias(self, t: TensorSpec, rng: np.random.Generator) -> np.ndarray:
        """gpt-oss q/k biases: amplitude * pattern per head, so query and key are exactly constant.

        llama.cpp's YaRN rope multiplies q and k by 1 + 0.1 ln(factor) (ggml rope_yarn), so the
        amplitude is divided by that: the kernel's peak score stays `window`.
        """
        from engine.synth.layout import GPT_OSS_YARN

        mscale = 1.0 + 0.1 * np.log(GPT_OSS_YARN["factor"])
        return np.tile(self.pattern, t.shape[0] // self.pattern.size) * (self.qk_amplitude / mscale)

    def _attn_sinks(self, t: TensorSpec, rng: np.random.Generator) -> np.ndarray:
        """Per-head sink logits a little below the recency kernel's peak score (`window`).

        A sink there takes a modest share of the attention: enough that an engine which drops
        the sinks visibly disagrees with llama.cpp, too little to swamp the kernel.
        """
        return self.routing.window - rng.uniform(0.5, 1.5, t.shape)

    def _mla_amplitude(self) -> float:
        """q/k amplitude of the MLA rotary part for a peak score of `window`.

        Only rope_dim of a head's dims carry the pattern, and deepseek2 scales scores by
        mscale^2 / sqrt(key_length_mla) with YaRN's mscale = 1 + 0.1 mscale_all_dim ln(factor).
        """
        from engine.synth.layout import DEEPSEEK2_YARN

        y = DEEPSEEK2_YARN
        mscale = 1.0 + 0.1 * y["mscale_all_dim"] * np.log(y["factor"])
        return float(np.sqrt(self.routing.window * np.sqrt(self.spec.head_dim) / (self.pattern.size * mscale**2)))

    def _mla_head_pattern(self) -> np.ndarray:
        head = np.zeros(self.spec.head_dim, np.float32)
        head[-self.pattern.size:] = self.pattern  # the rotary part is the end of an MLA head
        return np.tile(head, self.spec.n_head)

    def _mla_q(self, t: TensorSpec, rng: np.random.Generator) -> np.ndarray:
        """attn_q without q compression: constant rotary part read off C, nope parts noise."""
        return self._constant_read(t, rng, self._mla_amplitude())

    def _mla_q_a(self, t: TensorSpec, rng: np.random.Generator) -> np.ndarray:
        """q compression (q_lora_rank > 0): row 0 reads the constant C mean, the rest is noise."""
        w = rng.standard_normal(t.shape) * (NOISE / np.sqrt(t.shape[1]))
        nc = self.sub.c.stop - self.sub.c.start
        w[0, self.sub.c] += 1.0 / (nc * C_LEVEL)
        return w

    def _mla_q_b(self, t: TensorSpec, rng: np.random.Generator) -> np.ndarray:
        """q decompression: the RMS-normed q_a row 0 (about sqrt(q_lora_rank)) becomes the
        constant rotary query of every head; the nope parts are noise."""
        w = rng.standard_normal(t.shape) * (NOISE / np.sqrt(t.shape[1]))
        w[:, 0] += self._mla_head_pattern() * (self._mla_amplitude() / np.sqrt(t.shape[1]))
        return w

    def _mla_kv_a(self, t: TensorSpec, rng: np.random.Generator) -> np.ndarray:
        """attn_kv_a_mqa: rows [0, kv_lora_rank) compress the token part T (values, and the keys'
        nope part through attn_k_b); the last rope_dim rows are the one rotary key shared by all
        heads: a constant pattern read off C."""
        kvr = self.spec.kv_lora_rank
        w = rng.standard_normal(t.shape) * (NOISE / np.sqrt(t.shape[1]))
        nt = self.sub.t.stop - self.sub.t.start
        nc = self.sub.c.stop - self.sub.c.start
        w[:kvr, self.sub.t] += rng.standard_normal((kvr, nt)) / np.sqrt(nt)
        w[kvr:, self.sub.c] += self.pattern[:, None] * (self._mla_amplitude() / (nc * C_LEVEL))
        return w

    def _mla_k_b(self, t: TensorSpec, rng: np.random.Generator) -> np.ndarray:
        """Per head (kv_lora_rank, nope): the key's nope part from the normed latent (the query's
        nope part is small noise, so these scores stay small)."""
        return rng.standard_normal(t.shape) / np.sqrt(t.shape[1])

    def _mla_v_b(self, t: TensorSpec, rng: np.random.Generator) -> np.ndarray:
        """Per head (v_head_dim, kv_lora_rank): values from the normed latent, unit scale."""
        return rng.standard_normal(t.shape) / np.sqrt(t.shape[-1])


def _unit_rows(m: np.ndarray) -> np.ndarray:
    return (m / np.linalg.norm(m, axis=1, keepdims=True)).astype(np.float32)
