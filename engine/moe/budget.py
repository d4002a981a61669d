"""How many expert slots each MoE layer gets, from the user's budget or the free memory."""
from __future__ import annotations

import torch

from engine.errors import UserError

HEADROOM_BYTES = 1 << 30  # left free on the GPU for the allocator, graphs and other programs


def slots_per_layer(*, cache_size: str | int | None, cache_mib: float | None, expert_bytes: int,
                    n_expert: int, n_layers: int, device: torch.device, vram_budget_mib: float | None = None,
                    used_bytes: int = 0, staging_per_layer: int = 0) -> int:
    """`cache_size` is N, "all" or "auto" (default); `cache_mib` splits M MiB across the layers.

    auto: on CUDA, what is free (or what --vram-budget-mib leaves after `used_bytes` of dense
    weights and KV cache) minus headroom and the layers' staging slots. Without a GPU, no
    slots: every expert then runs in ggml's CPU pool straight from the quantized bytes, which
    beats decoding them for torch.
    """
    if cache_size not in (None, "auto") and cache_mib is not None:
        raise UserError("give the expert cache as a slot count or as MiB, not both")
    if cache_mib is not None:
        if cache_mib < 0:
            raise UserError("--moe-expert-cache-mib must not be negative")
        return min(n_expert, int(cache_mib * 2**20 // (expert_bytes * n_layers)))
    if cache_size == "all":
        return n_expert
    if cache_size not in (None, "auto"):
        n = int(cache_size)
        if n < 0:
            raise UserError("--moe-expert-cache-size must not be negative")
        return min(n, n_expert)
    if device.type != "cuda":
        return 0
    free, _total = torch.cuda.mem_get_info(device)
    headroom = HEADROOM_BYTES
    if vram_budget_mib is not None:
        budget = int(vram_budget_mib * 2**20)
        free = min(free, budget - used_bytes)
        headroom = min(headroom, budget // 8)  # an emulated small GPU keeps a proportionate reserve
    per_layer = (free - headroom) // (expert_bytes * n_layers) - staging_per_layer
    return max(0, min(n_expert, per_layer))
