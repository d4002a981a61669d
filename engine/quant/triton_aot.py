"""Ahead-of-time compilation of the GPU kernels (decode experts; dense products; the prefill
grouped GEMM, a prompt's dense products and the layout of its steps with --grouped) for a GPU
that is not here.

Triton compiles for a named target without a driver (ptxas and cuobjdump ship inside the
triton wheel), so a CPU-only machine can check that every kernel variant compiles for
Hopper (sm_90) and read its registers, spills and load widths off the cubin. The tests use
this where there is no GPU; `python -m engine.quant.triton_aot` prints the table.
"""
from __future__ import annotations

import multiprocessing
import os
import re
import subprocess
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

from gguf import GGMLQuantizationType as QT

from engine.quant import triton_kernels as tk
from engine.quant.layout import Q6_K_PADDED_BLOCK

_PTR = {"x": "*fp32", "xg": "*fp32", "xu": "*fp32", "out": "*fp32", "gb": "*fp32", "ub": "*fp32", "h": "*fp32",
        "hr": "*fp32", "db": "*fp32", "wt": "*fp32", "g": "*u8", "u": "*u8", "d": "*u8", "count": "*i32",
        "xr": "*fp32", "xq": "*i8", "xd": "*fp32", "w": "*u8", "part": "*fp32",
        # the grouped GEMM (grouped_gemm.py): rounded rows as int8 quants, scales and values
        "xgq": "*i8", "xuq": "*i8", "hq": "*i8", "xgd": "*fp32", "xud": "*fp32", "hd": "*fp32",
        "xgv": "*fp32", "xuv": "*fp32", "hv": "*fp32", "s": "*i32", "xgs": "*i32", "xus": "*i32", "hs": "*i32"}
_ALIGNED_INTS = {"g_slot_bytes", "g_row_bytes", "u_slot_bytes", "u_row_bytes", "d_slot_bytes", "d_row_bytes",
                 "x_stride", "out_stride_pos", "out_stride_tok", "w_row_bytes"}


def compile_kernel(fn, constexprs: dict, num_warps: int = 4, num_stages: int = 1, arch: int = 90,
                   aligned: set[str] = _ALIGNED_INTS, maxnreg: int | None = None):
    """A quantized-product kernel, its argument types read off its argument names (_PTR; the
    pair tables int32 pointers, slot strides int64)."""
    types, pointers = {}, set()
    for name in fn.arg_names:
        if name.endswith("_ptr") or name.startswith("pair_"):
            types[name] = _PTR.get(name[:-4] if name.endswith("_ptr") else "pair", "*i32")
            pointers.add(name)
        elif name.endswith("slot_bytes"):
            types[name] = "i64"
    return compile_for(fn, types, constexprs, aligned | pointers, num_warps, num_stages, arch, maxnreg)


def compile_for(fn, types: dict[str, str], constexprs: dict, aligned: set[str] = frozenset(), num_warps: int = 4,
                num_stages: int = 1, arch: int = 90, maxnreg: int | None = None):
    """`fn` compiled for CUDA sm_`arch` without a GPU. `types`: its runtime arguments' Triton
    types (the others i32); pointers (names ending in _ptr) and the `aligned` arguments are taken
    as multiples of 16, as Triton specializes them at a launch on torch's allocations."""
    import triton
    from triton.compiler import ASTSource

    sig = {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if name not in constexprs and (name.endswith("_ptr") or name in aligned)}
    src = ASTSource(fn, sig, constexprs, attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages, **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(src, target=_target(arch), options=options)


def _loops(sass: str) -> list[list[str]]:
    """The instructions of each loop (a backward branch and what it jumps over)."""
    lines = [ln for ln in sass.splitlines() if re.search(r"/\*[0-9a-f]{4,6}\*/", ln)]
    addr = [int(re.search(r"/\*([0-9a-f]{4,6})\*/", ln).group(1), 16) for ln in lines]
    loops = []
    for ln, a in zip(lines, addr):
        m = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))", ln)
        if m and m.group(1) and int(m.group(1), 16) < a:
            start = int(m.group(1), 16)
            loops.append([x for x, b in zip(lines, addr) if start <= b <= a])
    return loops


def _opcode(line: str) -> str | None:
    m = re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*)", line)
    return m.group(1) if m else None


def resource_usage(compiled) -> dict:
    """Registers, stack, spills, barriers and load widths of a compiled kernel, and for its
    loops (the K loops) their length and any shared-memory traffic or barriers in them."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([str(tool), "--dump-sass", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage)
    loads: dict[str, int] = {}
    for op in re.findall(r"\b(LDG\.[A-Z0-9.]+)", sass):
        loads[op] = loads.get(op, 0) + 1
    loops = _loops(sass)
    loop_ops = [op for body in loops for op in map(_opcode, body)]
    return {"regs": int(m.group(1)), "stack": int(m.group(2)), "shared": int(m.group(3)), "local": int(m.group(4)),
            "bar_sync": len(re.findall(r"\bBAR\.SYNC", sass)),
            "spill_ops": len(re.findall(r"\b(?:LDL|STL)\b", sass)),
            "instructions": len(re.findall(r"/\*[0-9a-f]{4,6}\*/", sass)),
            "loop_instructions": [len(body) for body in loops],
            "loop_smem_or_barrier": sum(op in ("BAR", "LDS", "STS") for op in loop_ops),
            "loop_spill_ops": sum(op in ("LDL", "STL") for op in loop_ops),
            "loop_dp4a": sum(op == "IDP" for op in loop_ops),
            "ffma": len(re.findall(r"\bFFMA\b", sass)),  # every one a multiply-add fused (no tl.fma here)
            "loads": loads}


_JOBS: list[Callable[[], dict]] = []  # in_parallel's jobs, inherited by its forked workers


def _run_job(i: int) -> dict:
    return _JOBS[i]()


def in_parallel(jobs: list[Callable[[], dict]]) -> list[dict]:
    """Runs compile jobs (each returns one report row) in forked processes, one per core, rows
    in job order: a compile is single-threaded (LLVM, ptxas) and the tests wait for hundreds of
    them on machines of two cores."""
    global _JOBS
    n = min(os.cpu_count() or 1, len(jobs))
    if n <= 1:
        return [job() for job in jobs]
    _JOBS = jobs  # forked workers inherit the closures: nothing to pickle but an index and a row
    try:
        with multiprocessing.get_context("fork").Pool(n) as pool:
            return pool.map(_run_job, range(len(jobs)), chunksize=1)
    finally:
        _JOBS = []


def _target(arch: int = 90):
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", arch, 32)


H200_SMS = 132  # the variants are compiled with the splits they take on an H200
ONE_TOKEN_PAIRS = 8  # a decode token's expert pairs (Qwen3-30B's top-8)
# the run programs compiled: runs of RUN_GROUP pairs a program (the default), of 4 and whole
RUN_GROUPS = tuple(dict.fromkeys((tk.RUN_GROUP, 4, tk.RUN_MAX_TOKENS)))


def _dependent_launches(arch: int) -> bool:
    """The kernels' PDL constexpr on sm_`arch`, as tk.dependent_launches gives it there."""
    return arch >= 90


def slot_type(q: QT) -> int:
    """The kernels' type id of rows in layout.kernel_layout's layout, as engine/moe/slots.LayerSlots
    and the dense layers hold them (Q6_K padded, MXFP4 and Q8_0 planar)."""
    return tk.LAID_OUT_TYPES.get(q, int(q))


def decode_variants(gate: QT, up: QT, down: QT, n_embd: int, n_ff: int, activation: int = 0, bias: bool = False,
                    arch: int = 90):
    """(label, kernel, constexprs, config) of every launch experts_forward makes for this geometry,
    over slot buffers as engine/moe/slots.LayerSlots lays them out (Q6_K padded, MXFP4 and Q8_0
    planar)."""
    vt = tk._vt
    rev = tk.reversed_ties(_target(arch))
    pdl = _dependent_launches(arch)
    qg, qu = slot_type(gate), slot_type(up)
    gate_up = {"N": n_ff, "K": n_embd, "QG": qg, "QU": qu, "SAME_X": vt(gate) == vt(up), "VT_DOWN": vt(down),
               "ACT": activation, "HAS_BIAS": bias, "INTERP": False, "REV": rev, "PDL": pdl}
    out = [("round_x", tk._round_rows_kernel,
            {"K": n_embd, "VT": vt(gate), "INTERP": False, "SUMS": False, "PDL": pdl}, tk.TileConfig(0, 4))]
    # gate/up unsplit (many tokens' pairs: Triton specializes the split of 1 as a constant), and for
    # one token's top-8 on an H200 in its own tile, split over K where that tile takes a split (the
    # split a runtime argument)
    many = tk.gate_up_config("tile", qg, qu, n_ff)
    out.append(("gate_up s1", tk._gate_up_kernel, {**gate_up, "BLOCK_N": many.block_n, "UNROLL": many.unroll,
                                                   "PASSES": 1, "split": 1}, many))
    tile = tk.expert_tile(qg, qu, 1)
    one = tk.gate_up_config(tile, qg, qu, n_ff)
    split = tk.SplitK.choose(ONE_TOKEN_PAIRS * -(-n_ff // one.block_n) * one.block_n, n_embd, H200_SMS, one)
    if tile == "row":
        turns = f" t{one.passes}" if one.passes > 1 else ""  # a K loop a turn
        out.append((f"gate_up row{turns} s{split.split}", tk._gate_up_k4_kernel,
                    {**gate_up, "BLOCK_N": one.block_n, "UNROLL": False, "PASSES": one.passes, "GROUP": 1,
                     **({"split": 1} if split.split == 1 else {})}, one))
        # over 2-8 tokens gate/up in runs of pairs of one slot, a run a program: no default takes them (the
        # row tile's gate/up takes turns), `bench kernels --sweep` does
        row = tk.GATE_UP_CONFIG["row"]
        out += [(f"gate_up row g{group}", tk._gate_up_k4_kernel,
                 {**gate_up, "BLOCK_N": row.block_n, "UNROLL": False, "PASSES": 1, "GROUP": group, "split": 1}, row)
                for group in RUN_GROUPS]
    elif split.split > 1 and not one.unroll:
        out.append((f"gate_up s{split.split}", tk._gate_up_kernel,
                    {**gate_up, "BLOCK_N": one.block_n, "UNROLL": one.unroll, "PASSES": 1}, one))
    # down in the quantized tile (over several tokens) and in the row tile (one token's, where it reads the type)
    qd = slot_type(down)
    down_tiles = list(dict.fromkeys(("tile", tk.expert_down_tile(qd, 1))))
    for down_tile, group in [(t, g) for t in down_tiles for g in ((1, *RUN_GROUPS) if t == "row" else (None,))]:
        dn = tk.down_config(down_tile, qd)
        out.append(("down" if down_tile == "tile" else f"down {down_tile}" + (f" g{group}" if group > 1 else ""),
                    tk._down_k4_kernel if down_tile == "row" else tk._down_kernel,
                    {"K": n_ff, "QD": qd, "HAS_BIAS": bias, "WEIGHTED": True, "BLOCK_N": dn.block_n,
                     "UNROLL": dn.unroll, "INTERP": False, "REV": rev, "PDL": pdl,
                     **({} if group is None else {"GROUP": group})}, dn))
    # the one-launch step (experts_forward(one_launch=True)) of one token, with one token's down tile
    step_down = tk.step_down_config(down_tiles[-1], qd, one.num_warps)
    out.append((f"step {tile} down {down_tiles[-1]}", tk._expert_step_kernel,
                {"N": n_ff, "K": n_embd, "QG": qg, "QU": qu, "QD": qd,
                 "SAME_X": vt(gate) == vt(up), "VT_G": vt(gate), "VT_U": vt(up), "VT_DOWN": vt(down),
                 "ACT": activation, "HAS_BIAS": bias, "HAS_DOWN_BIAS": bias, "WEIGHTED": True,
                 "ROW": tile == "row", "DOWN_ROW": down_tiles[-1] == "row", "BLOCK_G": one.block_n,
                 "BLOCK_D": step_down.block_n, "PASSES_G": one.passes, "UNROLL": one.unroll,
                 "UNROLL_DOWN": step_down.unroll, "ROUND_X": True, "INTERP": False, "REV": rev}, one))
    return out


STANDARD_GEOMETRIES = {
    **{t.name: ((t,) * 3, 2048, 768, 0, False) for t in sorted(tk.KERNEL_TYPES, key=lambda t: t.name)},
    "Q4_K_M": ((QT.Q4_K, QT.Q4_K, QT.Q6_K), 2048, 768, 0, False),
    "gpt-oss": ((QT.MXFP4,) * 3, 2880, 2880, 1, True),
}


# Dense products compiled for the report: (name, n_out, K) at the SM count of an H200, so the
# split each gets is the one it runs with there (the output head: none; the rest: split-K); Mixtral's
# ffn_down, one row of long rows (tk.LONG_ROW_K: warps side by side along K).
DENSE_GEOMETRIES = [("attn_q", 4096, 2048), ("output", 151936, 2048), ("ffn_down", 4096, 14336)]
DENSE_ROWS = (1, tk.DENSE_MAX_ROWS)


def dense_variants(qtype: QT, n_out: int, K: int, rows: int, cfg: tk.TileConfig | None = None,
                   sm_count: int = H200_SMS, arch: int = 90, laid_out: bool = False):
    """(label, kernel, constexprs, config) of the product tk.dense launches for this shape
    (the rounding launch is round_x of the expert geometries); `laid_out`: rows as
    layout.kernel_layout lays them out (Q6_K padded, MXFP4 and Q8_0 planar), else the GGUF rows."""
    qw = slot_type(qtype) if laid_out else int(qtype)
    cfg = cfg or tk.dense_config(qw, rows, K)
    split = tk.SplitK.choose(n_out, K, sm_count, cfg)
    kernel, extra = tk.dense_kernel(qw, rows, cfg, _target(arch))
    pdl = _dependent_launches(arch) and tk.dense_tile(qw, rows) not in tk.ROUNDING_TILES  # as tk.dense launches it
    return [(f"dense r{rows} s{split.split}", kernel,
             {"K": K, "QW": qw, "ROWS": rows, "SPLIT": split.split, "STEPS": split.steps, "BLOCK_N": cfg.block_n,
              "INTERP": False, "PDL": pdl, **extra}, cfg)]


def grouped_variants(gate: QT, up: QT, down: QT, n_embd: int, n_ff: int, activation: int = 0, bias: bool = False):
    """(label, kernel, constexprs, config) of the two grouped-GEMM launches (grouped_gemm.py) of
    a geometry at their default tiles over slot buffers as LayerSlots lays them out (its roundings
    are round_x's kernel)."""
    from engine.quant import grouped_gemm as gg

    gu, dn = gg.GATE_UP_CONFIG[gate], gg.DOWN_CONFIG[down]
    return [("grouped gate_up", gg._gate_up_kernel,
             {"N": n_ff, "K": n_embd, "QG": slot_type(gate), "QU": slot_type(up), "ACT": activation, "HAS_BIAS": bias,
              "BLOCK_M": gu.block_m, "BLOCK_N": gu.block_n, "INTERP": False}, gu),
            ("grouped down", gg._down_kernel,
             {"K": n_ff, "QD": slot_type(down), "HAS_BIAS": bias, "WEIGHTED": True, "BLOCK_M": dn.block_m,
              "BLOCK_N": dn.block_n, "INTERP": False}, dn)]


def _compiled_row(geometry: str, label: str, fn, const: dict, cfg, arch: int) -> dict:
    # (the grouped GEMM's GroupedConfig has no register cap)
    compiled = compile_kernel(fn, const, cfg.num_warps, cfg.num_stages, arch, maxnreg=getattr(cfg, "maxnreg", None))
    return {"geometry": geometry, "kernel": label, "block_n": cfg.block_n, "num_warps": cfg.num_warps,
            "convert_layout": compiled.asm["ttgir"].count("ttg.convert_layout"),
            "mma": _tensor_core_instruction(compiled.asm["ptx"]), **resource_usage(compiled)}


def _tensor_core_instruction(ptx: str) -> str | None:
    """The tensor-core product a kernel compiled to: Hopper's wgmma (tiles of 64 rows and more
    per warp group), else the warp-level mma.sync; None if it multiplies without them."""
    return "wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else None


def report(names: list[str], arch: int = 90) -> list[dict]:
    """Compiles every launch of the named expert geometries; one dict per kernel."""
    jobs = []
    for name in names:
        (g, u, d), n_embd, n_ff, act, bias = STANDARD_GEOMETRIES[name]
        for label, fn, const, cfg in decode_variants(g, u, d, n_embd, n_ff, act, bias, arch=arch):
            jobs.append(partial(_compiled_row, name, label, fn, const, cfg, arch))
    return in_parallel(jobs)


def grouped_report(names: list[str], arch: int = 90) -> list[dict]:
    """Compiles the grouped GEMM's kernels of the named expert geometries; one dict per kernel."""
    jobs = []
    for name in names:
        (g, u, d), n_embd, n_ff, act, bias = STANDARD_GEOMETRIES[name]
        for label, fn, const, cfg in grouped_variants(g, u, d, n_embd, n_ff, act, bias):
            jobs.append(partial(_compiled_row, name, label, fn, const, cfg, arch))
    return in_parallel(jobs)


def prompt_dense_report(arch: int = 90) -> list[dict]:
    """Compiles the prompt's dense product (grouped_gemm.dense: the down kernel, one weight for
    every row) for each type whose tile differs from the expert down kernel's (K = 2048)."""
    from engine.quant import grouped_gemm as gg

    jobs = []
    for qtype, cfg in sorted(gg.DENSE_CONFIG.items(), key=lambda item: item[0].name):
        if cfg != gg.DOWN_CONFIG[qtype]:
            const = {"K": 2048, "QD": slot_type(qtype), "HAS_BIAS": False, "WEIGHTED": False, "BLOCK_M": cfg.block_m,
                     "BLOCK_N": cfg.block_n, "INTERP": False}
            jobs.append(partial(_compiled_row, qtype.name, "prompt dense", gg._down_kernel, const, cfg, arch))
    return in_parallel(jobs)


LAYOUT_SLOTS = (16, 128, 256, 512)  # slots per layer the layout kernels are compiled for (their NS)


def layout_report(arch: int = 90) -> list[dict]:
    """Compiles the three kernels that lay a resident step out on the device (grouped_gemm's
    Groups.on_device) at LAYOUT_SLOTS; one dict per kernel."""
    from engine.quant import grouped_gemm as gg

    def row(n_slots: int, label: str, fn, const: dict) -> dict:
        types = {name: "*i64" if name == "ids_ptr" else "*i32" for name in fn.arg_names if name.endswith("_ptr")}
        compiled = compile_for(fn, types, const, arch=arch)
        return {"geometry": f"{n_slots} slots", "kernel": label, "block_n": 0, "num_warps": 4,
                "convert_layout": compiled.asm["ttgir"].count("ttg.convert_layout"), "mma": None,
                **resource_usage(compiled)}

    jobs = []
    for n_slots in LAYOUT_SLOTS:
        ns, block, rb = gg.layout_tiles(n_slots)
        for label, fn, const in [
                ("layout rank", gg._layout_rank_kernel, {"NS": ns, "BLOCK": block}),
                ("layout plan", gg._layout_plan_kernel,
                 {"NS": ns, "BLOCK_M": gg.GROUPED_BLOCK_M, "RB": rb, "CHUNK": gg.LAYOUT_TILE}),
                ("layout scatter", gg._layout_scatter_kernel, {"NS": ns, "BLOCK": block, "K": 8})]:
            jobs.append(partial(row, n_slots, label, fn, const))
    return in_parallel(jobs)


def dense_report(arch: int = 90) -> list[dict]:
    """Compiles the dense product for every kernel type in its GGUF layout and in kernel_layout's
    (padded Q6_K, named Q6_K/224; planar MXFP4 and Q8_0, MXFP4/planar and Q8_0/planar),
    DENSE_GEOMETRIES and DENSE_ROWS."""
    layouts = [(t.name, t, False) for t in sorted(tk.KERNEL_TYPES, key=lambda t: t.name)]
    layouts += [(f"Q6_K/{Q6_K_PADDED_BLOCK}", QT.Q6_K, True), ("MXFP4/planar", QT.MXFP4, True),
                ("Q8_0/planar", QT.Q8_0, True)]
    jobs = []
    for type_name, qtype, laid_out in layouts:
        for name, n_out, K in DENSE_GEOMETRIES:
            for n_rows in DENSE_ROWS:
                for label, fn, const, cfg in dense_variants(qtype, n_out, K, n_rows, arch=arch, laid_out=laid_out):
                    jobs.append(partial(_compiled_row, f"{type_name} {name}", label, fn, const, cfg, arch))
    return in_parallel(jobs)


def main() -> None:  # pragma: no cover - a report, run by hand or by the tests in a subprocess
    import argparse
    import json

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--json", action="store_true", help="print one JSON list instead of a table")
    ap.add_argument("--no-dense", action="store_true", help="only the expert kernels")
    ap.add_argument("--grouped", action="store_true", help="only the grouped GEMM (prefill) kernels")
    ap.add_argument("names", nargs="*", default=list(STANDARD_GEOMETRIES))
    args = ap.parse_args()
    if tk.INTERPRETED:
        raise SystemExit("unset TRITON_INTERPRET: kernels imported for the interpreter cannot be compiled")
    if args.grouped:
        rows = grouped_report(args.names, args.arch) + prompt_dense_report(args.arch) + layout_report(args.arch)
    else:
        rows = report(args.names, args.arch) + ([] if args.no_dense else dense_report(args.arch))
    if args.json:
        print(json.dumps(rows))
        return
    for r in rows:
        print(f"{r['geometry']:13s} {r['kernel']:15s} bn={r['block_n']:<3d} w={r['num_warps']} regs={r['regs']} "
              f"local={r['local']} stack={r['stack']} shared={r['shared']} bar={r['bar_sync']} "
              f"cvt={r['convert_layout']} instr={r['instructions']} loop={r['loop_instructions']} "
              f"loop_smem={r['loop_smem_or_barrier']} loop_spills={r['loop_spill_ops']} dp4a={r['loop_dp4a']} "
              f"ffma={r['ffma']} loads={r['loads']}")


if __name__ == "__main__":  # pragma: no cover
    main()
