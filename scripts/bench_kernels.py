"""Micro-benchmark: the Triton decode expert kernels vs the torch dequant+matmul path, on a GPU.

    python scripts/bench_kernels.py --out kernels.json            # default scenarios, small sweep
    python scripts/bench_kernels.py --quick --out kernels.json    # default tile configs only

One "step" is one MoE layer's experts for a decode batch (1 or 8 tokens x top-k), read from
slot buffers laid out as engine/moe/slots.LayerSlots holds them (GGUF bytes, [slots, rows,
row_bytes]); each timed step picks other experts at random from many slots (hundreds of MB),
so weights come from HBM, not L2. Reported per scenario and batch:
- triton.gpu_us: GPU time of a step (round x; gate/up + activation + round h; down), from a
  CUDA graph of many steps replayed (no launch gaps), and GB/s = bytes of the distinct experts
  read / time, also as a fraction of the H200's 4.8 TB/s and of the copy bandwidth measured here;
- triton.eager_us / host_us: the same step launched from Python (what the engine pays today)
  and the host's share of it (enqueue time);
- torch.eager_us: the current torch path (dequantize each expert, then matmul), for scale;
- sweep: gate/up and down kernels alone over tile configs (GPU time each), and the best.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.layers.moe import SILU, SWIGLU_OAI, ExpertTensor, ExpertWeights, expert_ffn  # noqa: E402
from engine.quant import triton_kernels as tk  # noqa: E402
from engine.quant.dequant import dequantize  # noqa: E402
from engine.synth.randblocks import random_blocks  # noqa: E402

H200_PEAK_GBPS = 4800.0

SCENARIOS = {
    # name: ((gate, up, down), n_embd, n_ff, top_k, activation, biases, slots)
    "qwen3-30b-a3b-Q4_K": ((QT.Q4_K,) * 3, 2048, 768, 8, SILU, False, 128),
    "qwen3-30b-a3b-Q4_K_M": ((QT.Q4_K, QT.Q4_K, QT.Q6_K), 2048, 768, 8, SILU, False, 128),
    "gpt-oss-120b-MXFP4": ((QT.MXFP4,) * 3, 2880, 2880, 4, SWIGLU_OAI, True, 32),
}
EXTRA = {f"qwen3-30b-a3b-{t.name}": ((t,) * 3, 2048, 768, 8, SILU, False, 64 if t in (QT.F16, QT.BF16) else 128)
         for t in (QT.Q5_K, QT.Q6_K, QT.Q8_0, QT.F16, QT.BF16)}  # F16 experts: 9.4 MB each, so fewer slots

# BLOCK_N = 16 x warps (a row per lane pair) or 32 x warps (two), loop or unrolled K steps.
SWEEP = [tk.TileConfig(16, 1), tk.TileConfig(32, 2), tk.TileConfig(64, 4), tk.TileConfig(32, 1),
         tk.TileConfig(64, 2), tk.TileConfig(128, 4), tk.TileConfig(32, 2, unroll=True),
         tk.TileConfig(64, 2, unroll=True)]


def _one_expert(rng, qtype: QT, rows: int, cols: int) -> np.ndarray:
    std = cols ** -0.5
    if qtype == QT.F16:
        return (rng.standard_normal((rows, cols)) * std).astype(np.float16).view(np.uint8)
    if qtype == QT.BF16:
        bits = (rng.standard_normal((rows, cols)) * std).astype(np.float32).view(np.uint32) >> 16
        return bits.astype(np.uint16).view(np.uint8)
    return random_blocks(rng, qtype, (rows, cols), std)


class Layer:
    """Slot buffers (every slot a copy of one random expert: valid blocks, distinct addresses)."""

    def __init__(self, qtypes, n_embd: int, n_ff: int, activation: str, bias: bool, n_slots: int, dev):
        rng = np.random.default_rng(0)
        shapes = ((n_ff, n_embd), (n_ff, n_embd), (n_embd, n_ff))
        self.buffers, tensors = [], []
        for qtype, (rows, cols) in zip(qtypes, shapes):
            one = torch.from_numpy(np.ascontiguousarray(_one_expert(rng, qtype, rows, cols))).to(dev)
            self.buffers.append(one.unsqueeze(0).expand(n_slots, *one.shape).contiguous())
            b = torch.randn(n_slots, rows, device=dev) * 0.1 if bias else None
            tensors.append(ExpertTensor(self.buffers[-1], qtype, (n_slots, rows, cols), b))
        self.w = ExpertWeights(*tensors, activation=activation)
        self.expert_bytes = sum(b[0].numel() for b in self.buffers)
        self.n_slots = n_slots


class Step:
    """One decode step's routing: x, ids, weights, the sorted pairs, and the bytes it reads."""

    def __init__(self, layer: Layer, n_tok: int, k: int, g: torch.Generator, dev):
        n_embd = layer.w.gate.shape[2]
        self.x = torch.randn(n_tok, n_embd, generator=g).to(dev)
        ids = torch.stack([torch.randperm(layer.n_slots, generator=g)[:k] for _ in range(n_tok)])
        self.weights = torch.rand(n_tok, k, generator=g).to(dev)
        tok, pos = np.nonzero(np.ones(ids.shape, dtype=bool))
        slot = ids.numpy()[tok, pos]
        order = np.argsort(slot, kind="stable")
        meta = torch.from_numpy(np.stack([tok[order], pos[order], slot[order], slot[order]]).astype(np.int32)).to(dev)
        self.tok, self.pos, self.slot, self.exp = meta
        self.out = torch.zeros(k, n_tok, n_embd, device=dev)
        self.distinct = sorted(set(slot.tolist()))
        self.bytes = len(self.distinct) * layer.expert_bytes
        self.rows = {s: ([int(t) for t, p in zip(tok, pos) if ids[t, p] == s],
                         [int(p) for t, p in zip(tok, pos) if ids[t, p] == s]) for s in self.distinct}
        self.rows = {s: (torch.tensor(t, device=dev), torch.tensor(p, device=dev)) for s, (t, p) in self.rows.items()}


def triton_step(layer: Layer, s: Step, gu=None, dn=None) -> None:
    tk.experts_forward(s.x, layer.buffers, layer.w, s.tok, s.pos, s.slot, s.exp, s.weights, s.out, gu, dn)


def torch_step(layer: Layer, s: Step) -> None:
    """The torch path of engine/moe/hybrid._run_on_accelerator, expert by expert."""
    w = layer.w
    for slot in s.distinct:
        mats = [dequantize(b[slot], t.qtype, t.shape[1:]) for b, t in zip(layer.buffers, (w.gate, w.up, w.down))]
        tok, pos = s.rows[slot]
        s.out[pos, tok] = expert_ffn(s.x[tok], *mats, w, slot) * s.weights[tok, pos, None]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def graph_us(fn, steps: list[Step], replays: int = 5) -> float | None:
    """GPU microseconds per step: a CUDA graph of fn over all steps, replayed."""
    if steps[0].x.device.type != "cuda":
        return None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            for s in steps[:2]:
                fn(s)  # warm-up (compiles) outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for s in steps:
                fn(s)
    except Exception as e:  # noqa: BLE001 - report and fall back to eager timing
        print(f"  (no CUDA graph: {type(e).__name__}: {e}; timing eagerly)", file=sys.stderr)
        return None
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / len(steps))
    return best


def eager_us(fn, steps: list[Step], rounds: int = 3) -> tuple[float, float]:
    """(wall microseconds per step with the GPU finished, host microseconds per step enqueueing)."""
    for s in steps[:2]:
        fn(s)
    _sync()
    wall, host = float("inf"), float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for s in steps:
            fn(s)
        t1 = time.perf_counter()
        _sync()
        t2 = time.perf_counter()
        wall = min(wall, (t2 - t0) * 1e6 / len(steps))
        host = min(host, (t1 - t0) * 1e6 / len(steps))
    return wall, host


def copy_gbps(dev) -> float:
    n = 1 << 31
    a = torch.empty(n, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        b.copy_(a)
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n / best / 1e9  # bytes read + written


def rate(nbytes: float, us: float | None, copy: float) -> dict:
    if not us:
        return {"us": us}
    gbps = nbytes / us / 1e3
    return {"us": round(us, 2), "GBps": round(gbps, 1), "of_h200_peak": round(gbps / H200_PEAK_GBPS, 3),
            "of_copy_bw": round(gbps / copy, 3)}


def sweep(layer: Layer, steps: list[Step], copy: float) -> dict:
    """gate/up and down alone over SWEEP (GPU time from graphs); the best config of each."""
    w = layer.w
    xg = [tk.round_rows(s.x, w.gate.qtype) for s in steps]
    xu = [x if tk._vt(w.up.qtype) == tk._vt(w.gate.qtype) else tk.round_rows(s.x, w.up.qtype)
          for x, s in zip(xg, steps)]
    hr = [tk.gate_up(a, b, layer.buffers[0], layer.buffers[1], w, s.tok, s.slot, s.exp)[1]
          for a, b, s in zip(xg, xu, steps)]
    idx = {id(s): i for i, s in enumerate(steps)}
    gu_bytes = sum(len(s.distinct) for s in steps) / len(steps) * (layer.buffers[0][0].numel() * 2)
    dn_bytes = sum(len(s.distinct) for s in steps) / len(steps) * layer.buffers[2][0].numel()
    out = {"gate_up": [], "down": []}
    for cfg in SWEEP:
        name = f"bn{cfg.block_n}w{cfg.num_warps}{'u' if cfg.unroll else ''}"
        runs = {
            "gate_up": (gu_bytes, lambda s, c=cfg: tk.gate_up(xg[idx[id(s)]], xu[idx[id(s)]], layer.buffers[0],
                                                              layer.buffers[1], w, s.tok, s.slot, s.exp, c)),
            "down": (dn_bytes, lambda s, c=cfg: tk.down(hr[idx[id(s)]], layer.buffers[2], w, s.tok, s.pos, s.slot,
                                                        s.exp, s.weights, s.out, c)),
        }
        for key, (nbytes, fn) in runs.items():
            try:
                us = graph_us(fn, steps)
                if us is None:  # no CUDA (the smoke test): eager wall time
                    us = eager_us(fn, steps, rounds=1)[0]
                out[key].append({"config": name, **rate(nbytes, us, copy)})
            except Exception as e:  # noqa: BLE001 - a config that fails is reported, not fatal
                out[key].append({"config": name, "error": f"{type(e).__name__}: {e}"[:300]})
    for key in ("gate_up", "down"):
        ok = [r for r in out[key] if r.get("us")]
        out[f"best_{key}"] = min(ok, key=lambda r: r["us"])["config"] if ok else None
    return out


def parse_cfg(name: str | None) -> tk.TileConfig | None:
    if not name:
        return None
    unroll = name.endswith("u")
    bn, nw = name.rstrip("u")[2:].split("w")
    return tk.TileConfig(int(bn), int(nw), unroll)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON results path")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma list of {list(SCENARIOS) + list(EXTRA)}")
    ap.add_argument("--all", action="store_true", help="also Q5_K, Q6_K, Q8_0, F16, BF16 at Qwen3 geometry")
    ap.add_argument("--tokens", default="1,8", help="decode batch sizes")
    ap.add_argument("--steps", type=int, default=24, help="distinct routing draws per measurement")
    ap.add_argument("--quick", action="store_true", help="default tile configs only (no sweep)")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch path")
    ap.add_argument("--smoke-cpu", action="store_true", help=argparse.SUPPRESS)  # the script's own test
    args = ap.parse_args()
    global SWEEP
    if args.smoke_cpu:  # a tiny scenario through Triton's interpreter: checks this script, times nothing real
        SCENARIOS["tiny"] = ((QT.Q4_K, QT.Q4_K, QT.Q6_K), 256, 256, 2, SILU, True, 6)
        args.scenarios, args.tokens, args.steps = "tiny", "1,2", 2
        SWEEP = [tk.TileConfig(128, 4), tk.TileConfig(256, 4)]
        for table in (tk.GATE_UP_CONFIG, tk.DOWN_CONFIG):
            table.update({q: tk.TileConfig(256, 4) for q in table})
        dev = torch.device("cpu")
    elif not torch.cuda.is_available() or tk.INTERPRETED or not tk.available():
        raise SystemExit("needs a CUDA GPU and Triton (and TRITON_INTERPRET unset)")
    else:
        dev = torch.device("cuda")
    import triton

    names = args.scenarios.split(",") + (list(EXTRA) if args.all else [])
    result = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (interpreter smoke test)",
              "torch": torch.__version__, "triton": triton.__version__, "h200_peak_GBps": H200_PEAK_GBPS,
              "copy_GBps": round(copy_gbps(dev), 1) if dev.type == "cuda" else 1.0, "scenarios": []}
    copy = result["copy_GBps"]
    print(f"{result['device']}  torch {result['torch']}  triton {result['triton']}  copy {copy} GB/s (read+write)")
    for name in names:
        qtypes, n_embd, n_ff, k, act, bias, n_slots = {**SCENARIOS, **EXTRA}[name]
        layer = Layer(qtypes, n_embd, n_ff, act, bias, n_slots, dev)
        for n_tok in (int(t) for t in args.tokens.split(",")):
            g = torch.Generator().manual_seed(n_tok)
            steps = [Step(layer, n_tok, k, g, dev) for _ in range(args.steps)]
            nbytes = sum(s.bytes for s in steps) / len(steps)
            row = {"scenario": name, "types": [q.name for q in qtypes], "n_embd": n_embd, "n_ff": n_ff, "top_k": k,
                   "tokens": n_tok, "MB_per_step": round(nbytes / 1e6, 2)}
            if not args.quick:
                row["sweep"] = sweep(layer, steps, copy)
            gu = parse_cfg(row.get("sweep", {}).get("best_gate_up"))
            dn = parse_cfg(row.get("sweep", {}).get("best_down"))
            for label, (g_cfg, d_cfg) in {"triton_default": (None, None), "triton_best": (gu, dn)}.items():
                if label == "triton_best" and args.quick:
                    continue
                us = graph_us(lambda s: triton_step(layer, s, g_cfg, d_cfg), steps)
                replayed = steps[0].out.clone()
                wall, host = eager_us(lambda s: triton_step(layer, s, g_cfg, d_cfg), steps)
                if us is not None:  # what the graph computed is what an eager launch computes
                    assert torch.equal(replayed, steps[0].out), "graph replay and eager launch differ"
                row[label] = {"gpu": rate(nbytes, us, copy), "eager_us": round(wall, 1), "host_us": round(host, 1)}
            if not args.no_torch:
                wall, host = eager_us(lambda s: torch_step(layer, s), steps[:6], rounds=2)
                row["torch"] = {"eager": rate(nbytes, wall, copy), "host_us": round(host, 1)}
                s0 = steps[0]  # the two paths agree (float32 order and rounding ties aside)
                s0.out.zero_()
                triton_step(layer, s0)
                got = s0.out.clone()
                s0.out.zero_()
                torch_step(layer, s0)
                row["max_rel_err_vs_torch"] = float((got - s0.out).abs().max() / s0.out.abs().max())
            result["scenarios"].append(row)
            t = row["triton_default"]
            best = row.get("triton_best", {}).get("gpu", {})
            print(f"{name:24s} T={n_tok}  {row['MB_per_step']:7.1f} MB  triton gpu {t['gpu'].get('us')} us "
                  f"{t['gpu'].get('GBps')} GB/s ({t['gpu'].get('of_h200_peak')} of peak)"
                  + (f"  best {best.get('us')} us {best.get('GBps')} GB/s [{row['sweep']['best_gate_up']} / "
                     f"{row['sweep']['best_down']}]" if best else "")
                  + f"  eager {t['eager_us']} us (host {t['host_us']} us)"
                  + (f"  torch {row['torch']['eager']['us']} us (rel err {row['max_rel_err_vs_torch']:.1e})"
                     if "torch" in row else ""))
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
