"""Routing statistics of a token stream: skew, temporal locality and what an LRU cache would hit.

The same figures describe published traces of real models, so a synthetic model's routing
can be compared with them (engine/synth/routing.py holds the calibrated settings).
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

LRU_SHARES = (0.10, 0.25, 0.40, 0.50)
WARMUP = 64  # tokens before LRU hits count: the cache starts empty


def lru_hit_rate(ids: np.ndarray, capacity: int, warmup: int = WARMUP) -> float:
    """Share of selections found in a per-layer LRU cache of `capacity` experts.

    `ids` is [n_tokens, k]; a token's experts are looked up, then all become most recent.
    """
    cache: OrderedDict[int, None] = OrderedDict()
    hits = total = 0
    for t, row in enumerate(ids):
        for e in row:
            e = int(e)
            if t >= warmup:
                total += 1
                hits += e in cache
            if e in cache:
                cache.move_to_end(e)
            else:
                cache[e] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return hits / total if total else float("nan")


def layer_stats(ids: np.ndarray, n_expert: int) -> dict[str, float]:
    """Statistics of one layer's selections `ids` [n_tokens, k]."""
    n_tokens, k = ids.shape
    counts = np.bincount(ids.ravel(), minlength=n_expert).astype(np.float64)
    share = counts / counts.sum()
    top = np.sort(share)[::-1]
    n_top10 = max(1, round(n_expert * 0.10))
    nz = share[share > 0]

    last_seen = np.full(n_expert, -1)
    distances = []
    for t, row in enumerate(ids):
        for e in row:
            if last_seen[e] >= 0:
                distances.append(t - last_seen[e])
        last_seen[row] = t
    distances = np.asarray(distances)
    picks = n_tokens * k
    stats = {
        "top10pct_share": float(top[:n_top10].sum()),
        "entropy": float(-(nz * np.log(nz)).sum() / np.log(n_expert)),
        "experts_touched": int((counts > 0).sum()),
        "next_token_repeat": float((distances == 1).sum() / (picks - k)) if n_tokens > 1 else 0.0,
        "repeat_within_8": float((distances <= 8).sum() / (picks - k)) if n_tokens > 1 else 0.0,
        "median_reuse_distance": float(np.median(distances)) if distances.size else float("nan"),
    }
    for s in LRU_SHARES:
        stats[f"lru_hit_{int(s * 100)}pct"] = lru_hit_rate(ids, max(k, round(n_expert * s)))
    return stats


def routing_stats(experts: np.ndarray, n_expert: int) -> dict:
    """Per-layer and mean statistics of `experts` [n_tokens, n_layers, k] (MoE layers only)."""
    layers = [layer_stats(experts[:, i, :], n_expert) for i in range(experts.shape[1])]
    mean = {key: float(np.mean([layer[key] for layer in layers])) for key in layers[0]}
    return {"tokens": int(experts.shape[0]), "n_expert": n_expert, "k": int(experts.shape[2]),
            "mean": mean, "layers": layers}
