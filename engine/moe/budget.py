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
    if vram_budget_mib is not None:
        free = min(free, int(vram_budget_mib * 2**20) - used_bytes)
    per_layer = (free - headroom_bytes(vram_budget_mib)) // (expert_bytes * n_layers) - staging_per_layer
    return max(0, min(n_expert, per_layer))


def headroom_bytes(vram_budget_mib: float | None) -> int:
    """What auto-sizing leaves free: 1 GiB, or on an emulated small GPU a proportionate eighth."""
    return HEADROOM_BYTES if vram_budget_mib is None else min(HEADROOM_BYTES, int(vram_budget_mib * 2**20) // 8)


def free_after_allocation(device: torch.device, vram_budget_mib: float | None, pending_bytes: int) -> int | None:
    """GPU bytes still free for the engine (under --vram-budget-mib, if set), measured now, once
    `pending_bytes` more are taken (the KV cache, allocated later); None without a GPU."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    if vram_budget_mib is not None:
        free = min(free, int(vram_budget_mib * 2**20) - torch.cuda.memory_allocated(device))
    return free - pending_bytes
