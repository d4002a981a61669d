"""The GPU memory figures the engine measures; how they become expert slots is
engine/plan/sizing.place, the rule the planner uses too."""
from __future__ import annotations

import torch


def gpu_free_bytes(device: torch.device) -> int | None:
    """GPU memory free for this engine before it allocated anything (what the planner calls the
    machine's free VRAM): free now plus what this process holds; None without a GPU. Tests
    inject a figure here to size slots on CPU tensors."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_allocated(device)


def free_after_allocation(device: torch.device, budget_bytes: int, pending_bytes: int) -> int | None:
    """GPU bytes still free for the engine within `budget_bytes`, measured now, once
    `pending_bytes` more are taken (the KV cache and workspace, allocated later); None without a GPU."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return min(free, budget_bytes - torch.cuda.memory_allocated(device)) - pending_bytes
