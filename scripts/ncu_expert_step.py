"""One decode expert step of `bench kernels`' scenarios under Nsight Compute, its launches alone.

    ncu --clock-control none --profile-from-start off --kernel-name regex:"gate_up|down|round" \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        --section MemoryWorkloadAnalysis python3 scripts/ncu_expert_step.py "gpt-oss-120b MXFP4:1,8" "qwen3-30b-a3b Q8_0:1"

Each argument is a scenario (engine/bench/kernels.py's names) and its token counts; a count written
"8/runs2" takes both row tiles in runs of 2 pairs of a slot (the sweep's "gate/up row, down row, runs
of 2"), "8/runs2/bn8" with gate/up's row tile at 8 rows a program (4 warps). The step runs twice
outside the profiled range (Triton's compiles, then a warm run) and once inside, on weights laid out
as the engine's slots are and spread past the L2 as the bench spreads them; ncu flushes the caches
before each profiled kernel by default.
"""
from __future__ import annotations

import sys

import torch

from engine.bench.kernels import ExpertLayer, ExpertStep, expert_scenarios, row_runs
from engine.quant import triton_kernels as tk

L2_BYTES = 50 << 20  # the H100's and the H200's


def profile(name: str, count: str, dev: torch.device) -> None:
    sc = expert_scenarios()[name]
    layer = ExpertLayer(sc, dev, L2_BYTES)
    tokens, *form = count.split("/")
    s = ExpertStep(layer, int(tokens), sc.top_k, torch.Generator().manual_seed(int(tokens)), dev)
    tiles = {}
    if form:
        block_n = int(form[1].removeprefix("bn")) if len(form) > 1 else None
        qd = tk.kernel_type(layer.w.down.qtype, layer.buffers[2], sc.n_ff)
        tiles = row_runs(qd, int(form[0].removeprefix("runs")), block_n)

    def run() -> None:
        tk.experts_forward(s.x, layer.buffers, layer.w, s.tok, s.pos, s.slot, s.exp, s.weights, s.out, **tiles)

    run()
    run()
    torch.cuda.synchronize()
    print(f"== {name}, {count} tokens", file=sys.stderr, flush=True)
    torch.cuda.cudart().cudaProfilerStart()
    run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit(__doc__)
    dev = torch.device("cuda")
    for arg in argv:
        name, _, counts = arg.partition(":")
        for count in (counts or "1").split(","):
            profile(name, count, dev)


if __name__ == "__main__":
    main(sys.argv[1:])
