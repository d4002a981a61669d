"""Where a model's parts go on the GPU: the one sizing rule of the wizard, `moestudio plan` and
the engine.

`place` is pure arithmetic over a model's geometry, the GPU memory the machine has free for
this engine, and the user's settings: dense weights, the KV cache at the resolved context,
the compute workspace, the upload staging slots, a headroom, and what is left becomes expert
slots (the same number in every MoE layer). The planner prints it; the engine allocates
exactly that many slots and then only measures free memory again, shrinking the cache with a
warning if another program took some in the meantime (engine/moe/hybrid.attach_hybrid).
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.plan.geometry import Geometry

MIB = 1 << 20
HEADROOM_BYTES = 1 << 30  # left free for the CUDA context, allocator, graphs and other programs
FRACTION_STEPS = 256  # the miss fraction's resolution (the executor counts uploads in these steps)


def resolve_ctx(ctx: int, n_ctx_train: int) -> int:
    """The context the engine runs: 0 is the model's training length; more than that is capped to it."""
    return n_ctx_train if ctx <= 0 else min(ctx, n_ctx_train)


def quantized_fraction(fraction: float) -> float:
    return round(fraction * FRACTION_STEPS) / FRACTION_STEPS


def balanced_fraction(upload_s: float, cpu_s: float) -> float:
    """The share of misses to upload when uploads and the CPU pool run side by side: a step of m
    misses takes max(u * upload_s, (m - u) * cpu_s), least at u / m = cpu_s / (upload_s + cpu_s)."""
    return quantized_fraction(cpu_s / (upload_s + cpu_s))


STAGING_TURN_BYTES = 64 * MIB  # a prompt's upload turn: the experts that fit (at least one)


def staging_slots(miss_fraction: float, n_expert: int, top_k: int, expert_bytes: int,
                  turn_bytes: int = STAGING_TURN_BYTES) -> int:
    """Staging slots for a step's uploads, shared by the MoE layers (they run one after another,
    and a copy into the slots waits for the kernels already enqueued): a decode step's uploads,
    the fraction of its top-k rounded up (top_k 0: of every expert), and two of a prompt's
    turns, each the experts that fit in `turn_bytes`, so that one turn's copy overlaps the
    previous turn's compute. None when the fraction is 0: nothing is uploaded."""
    step_fraction = round(miss_fraction * FRACTION_STEPS)
    if not step_fraction:
        return 0
    decode = -(-step_fraction * (top_k or n_expert) // FRACTION_STEPS)
    return min(n_expert, max(decode, 2 * max(1, turn_bytes // expert_bytes)))


# Rows of one expert per tile of the grouped expert GEMM (engine/quant/grouped_gemm.py's
# default configs take it): each expert's run of rows is padded to a multiple, so a step has at
# most chunk x top-k + experts x (block - 1) rows.
GROUPED_BLOCK_M = 32
LOGIT_ROWS = 64  # the most rows a forward gives logits for: a prompt its last, validation chunks of this many
ATTENTION_MASK_BYTES = 64 * MIB  # the largest mask of one fused prompt-attention launch (layers/attention.py)


def workspace_bytes(g: Geometry, ctx: int, prefill_chunk: int) -> int:
    """Scratch memory of one prefill chunk: logits (of LOGIT_ROWS rows at most: a prompt needs
    its last row's), activations, attention (the fused prompt attention of
    layers/attention.prompt_attention: its mask, at most ATTENTION_MASK_BYTES, copies of q and
    of the output, and float16 copies of one layer's keys and values; no [heads, chunk, ctx]
    scores), and the grouped expert GEMM's padded h (float32)
    with its rounding for the down weights (float32 values, int8 quants, a scale per 32: 13
    bytes a value)."""
    logits = g.n_vocab * min(LOGIT_ROWS, prefill_chunk) * 4
    activations = prefill_chunk * (6 * g.n_embd + 3 * g.n_expert_used * g.n_ff_exp) * 4
    head_dim = g.head_dim_k or g.n_embd // g.n_head
    mask = min(ATTENTION_MASK_BYTES, g.n_head * prefill_chunk * ctx * 4)
    attention = mask + 4 * prefill_chunk * g.n_head * head_dim * 4  # q, its stacked copy, the output twice
    attention += ctx * g.kv_values_per_token // max(1, g.n_layer) * 2
    grouped_rows = prefill_chunk * g.n_expert_used + g.n_expert * (GROUPED_BLOCK_M - 1)
    grouped = grouped_rows * g.n_ff_exp * 13
    return logits + activations + attention + grouped


@dataclass(frozen=True)
class Placement:
    ctx: int  # resolved: 0 became the training length
    budget_bytes: int  # GPU memory this engine may use: the free memory, capped by vram_budget_mib
    dense_bytes: int
    kv_bytes: int
    workspace_bytes: int
    staging_slots: int  # upload slots, shared by the MoE layers
    staging_bytes: int
    headroom_bytes: int
    slots_per_layer: int
    cache_bytes: int
    free_for_experts: int  # budget less everything but the expert cache (negative: it does not fit)

    @property
    def fits(self) -> bool:
        return self.free_for_experts >= 0 and self.cache_bytes <= self.free_for_experts


def place(g: Geometry, gpu_free_bytes: int | None, *, ctx: int, prefill_chunk: int,
          moe_expert_cache_size: str | int, moe_expert_cache_mib: int | None,
          vram_budget_mib: int | None, miss_fraction: float, kv_type: str = "f32") -> Placement:
    """`gpu_free_bytes` is what the GPU has free before this engine allocates anything (None: no
    GPU, so no auto-sized slots: every expert then runs in ggml's CPU pool). `miss_fraction` is
    resolved (given, or measured/estimated for auto): it sizes the staging slots. The settings
    come checked from engine/config.Config (an EngineConfig passes through it too)."""
    ctx = resolve_ctx(ctx, g.n_ctx_train)
    layers = len(g.moe_layers)
    per_slot = g.expert_slot_bytes * layers  # one slot in every MoE layer, in the slots' layout
    if gpu_free_bytes is None:
        budget = 0
    else:
        budget = gpu_free_bytes if vram_budget_mib is None else min(gpu_free_bytes, vram_budget_mib * MIB)
    kv, work = g.kv_bytes(ctx, kv_type), workspace_bytes(g, ctx, prefill_chunk)
    headroom = min(HEADROOM_BYTES, budget // 8)  # an emulated small GPU keeps a proportionate eighth
    room = budget - g.dense_bytes - kv - work - headroom  # for experts: cached and staging
    staging = staging_slots(miss_fraction, g.n_expert, g.n_expert_used, g.expert_slot_bytes)
    if moe_expert_cache_mib is not None:
        slots = min(g.n_expert, moe_expert_cache_mib * MIB // per_slot)
    elif moe_expert_cache_size == "all":
        slots = g.n_expert
    elif moe_expert_cache_size != "auto":
        slots = min(int(moe_expert_cache_size), g.n_expert)
    elif gpu_free_bytes is None:
        slots = 0
    elif room // per_slot >= g.n_expert:
        slots = g.n_expert
    else:
        slots = max(0, (room - staging * g.expert_slot_bytes) // per_slot)
    if slots == g.n_expert or gpu_free_bytes is None:
        staging = 0  # every expert resident: nothing to upload (without a GPU: nothing to upload to)
    staging_bytes = staging * g.expert_slot_bytes
    return Placement(ctx=ctx, budget_bytes=budget, dense_bytes=g.dense_bytes, kv_bytes=kv, workspace_bytes=work,
                     staging_slots=staging, staging_bytes=staging_bytes, headroom_bytes=headroom,
                     slots_per_layer=slots, cache_bytes=slots * per_slot, free_for_experts=room - staging_bytes)
