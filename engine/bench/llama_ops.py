"""llama.cpp's own matrix kernels timed by its `test-backend-ops perf`, for `bench kernels`.

`test-backend-ops perf -o MUL_MAT -b CUDA0` (and `-o MUL_MAT_ID`) times llama.cpp's built-in
perf cases (tests/test-backend-ops.cpp `make_test_cases_perf`), one console line a case (this
one from its CPU backend here, tests/bench/data/test-backend-ops-perf-cpu.txt):

    MUL_MAT(type_a=q4_K,type_b=f32,m=4096,n=1,k=14336,bs=[1,1],nr=[1,1],per=[0,1,2,3],k_v=0,o=1,
    src_overlap=0,m_v=0,pad=0):      276 runs -  3662.12 us/run - 117.44 MFLOP/run -  32.07 GFLOPS

Matrix products print FLOP/s, not GB/s (only ops without a FLOP count print `kB/run - GB/s`),
so the GB/s here is computed as ours is: the bytes of weights read (`type_a` rows; for
MUL_MAT_ID the experts drawn, in expectation: each token draws `n_used` distinct of `n_mats`
uniformly, tests/test-backend-ops.cpp `init_mul_mat_id_ids`) over the time per run. Each
case repeats one weight tensor, so where it fits in the L2 cache part of it is read from there.

The binary comes from scripts/kernels_run.sh's `llamaops` stage (a CUDA build on the device);
`--llama-ops PATH` or MOESTUDIO_LLAMA_OPS names it.
"""
from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

from engine.errors import UserError

ENV = "MOESTUDIO_LLAMA_OPS"
OPS = ("MUL_MAT", "MUL_MAT_ID")
# A whole perf run of both ops on the H200 takes ~5 minutes (every case runs >= 1 s); the
# bench limits it with a params regex to the cases it compares, well under this.
TIMEOUT_S = 1200

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_BACKEND = re.compile(r"^Backend \d+/\d+: (\S+)")
# A timed product: `OP(params):  N runs - T us/run - F xFLOP/run - R xFLOPS` (print_perf_console).
_CASE = re.compile(
    r"^\s*(?P<op>[A-Z0-9_]+)\((?P<params>.*)\):\s+(?P<runs>\d+) runs - +(?P<us>[\d.]+) us/run - +"
    r"[\d.]+ [kMGT]FLOP/run - +(?P<rate>[\d.]+ [kMGT]FLOPS)\s*$")


def split_params(text: str) -> dict[str, str]:
    """`type_a=q4_K,m=4096,bs=[1,1],...` -> {'type_a': 'q4_K', 'm': '4096', 'bs': '[1,1]', ...}
    (commas inside brackets belong to the value)."""
    out, depth, start = {}, 0, 0
    for i, ch in enumerate(text + ","):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            key, _, value = text[start:i].partition("=")
            out[key.strip()] = value.strip()
            start = i + 1
    return out


@dataclass(frozen=True)
class OpPerf:
    """One perf case as test-backend-ops printed it."""

    op: str  # MUL_MAT or MUL_MAT_ID
    backend: str  # e.g. CUDA0, CPU
    type_a: str  # ggml's type name of the weights: q4_K, q8_0, f16, mxfp4, ...
    m: int  # weight rows (outputs)
    n: int  # activation rows (tokens)
    k: int  # the reduction length
    runs: int
    us: float  # microseconds per run
    printed: str  # the rate it printed, e.g. "7.39 TFLOPS"
    n_mats: int | None = None  # MUL_MAT_ID: experts in the tensor ...
    n_used: int | None = None  # ... and drawn per token
    params: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def case(self) -> str:
        """The case as test-backend-ops names it (a `-o` filter entry that selects it alone)."""
        return f"{self.op}({','.join(f'{k}={v}' for k, v in self.params.items())})"

    @property
    def qtype(self) -> QT | None:
        """The weight type as gguf names it (None for a type gguf does not know)."""
        try:
            return QT[self.type_a.upper()]
        except KeyError:
            return None

    @property
    def experts_read(self) -> float:
        """Distinct weight matrices one run reads: 1 for MUL_MAT (per batch); for MUL_MAT_ID the
        expectation over `n` tokens each drawing `n_used` distinct of `n_mats` uniformly."""
        if self.op != "MUL_MAT_ID":
            batch = [int(v) for v in self.params.get("bs", "[1,1]").strip("[]").split(",")]
            return float(batch[0] * batch[1])
        assert self.n_mats and self.n_used
        return self.n_mats * (1.0 - (1.0 - self.n_used / self.n_mats) ** self.n)

    @property
    def weight_bytes(self) -> float | None:
        """Bytes of weights one run reads (see experts_read); None for an unknown type."""
        if self.qtype is None or self.qtype not in GGML_QUANT_SIZES:
            return None
        block, size = GGML_QUANT_SIZES[self.qtype]
        return self.m * self.k // block * size * self.experts_read

    @property
    def gbps(self) -> float | None:
        """GB/s of weights read (1e9 bytes), as `bench kernels` counts its own."""
        nbytes = self.weight_bytes
        return None if nbytes is None else nbytes / self.us / 1e3


def parse(text: str) -> list[OpPerf]:
    """Every timed MUL_MAT / MUL_MAT_ID line of a `test-backend-ops perf` console output
    (colour codes allowed); `not supported` lines and other ops are left out."""
    records, backend = [], ""
    for raw in text.splitlines():
        line = _ANSI.sub("", raw)
        if m := _BACKEND.match(line):
            backend = m.group(1)
            continue
        m = _CASE.match(line)
        if not m or m.group("op") not in OPS:
            continue
        p = split_params(m.group("params"))
        try:
            is_id = m.group("op") == "MUL_MAT_ID"
            rec = OpPerf(op=m.group("op"), backend=backend, type_a=p["type_a"], m=int(p["m"]), n=int(p["n"]),
                         k=int(p["k"]), runs=int(m.group("runs")), us=float(m.group("us")),
                         printed=m.group("rate"),
                         n_mats=int(p["n_mats"]) if is_id else None, n_used=int(p["n_used"]) if is_id else None,
                         params=p)
        except (KeyError, ValueError):
            continue  # a case whose parameters are not a product's (a changed format): not comparable
        records.append(rec)
    return records


def resolve(path: str | os.PathLike | None) -> Path | None:
    """The binary named by the option, else by MOESTUDIO_LLAMA_OPS; None when neither is set."""
    chosen = path or os.environ.get(ENV)
    return Path(chosen) if chosen else None


def require(binary: Path) -> None:
    """UserError unless `binary` is an executable file."""
    if not binary.is_file() or not os.access(binary, os.X_OK):
        raise UserError(f"llama.cpp's test-backend-ops not found at {binary} (build it with "
                        f"`bash scripts/kernels_run.sh llamaops`, or set {ENV} / --llama-ops to its path)")


def run_perf(binary: Path, backend: str = "CUDA0", ops: tuple[str, ...] = OPS, params_regex: str | None = None,
             timeout: float = TIMEOUT_S) -> tuple[list[OpPerf], str]:
    """Run `binary perf -o OP -b BACKEND [-p REGEX]` for each op; the parsed records and the raw
    output (kept beside the results). UserError when the binary is missing or fails, or when
    nothing it printed is a timed product line."""
    require(binary)
    outputs = []
    for op in ops:
        cmd = [str(binary), "perf", "-o", op, "-b", backend] + (["-p", params_regex] if params_regex else [])
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, errors="replace")
        except subprocess.TimeoutExpired as e:
            raise UserError(f"{' '.join(cmd)} ran past {timeout:.0f} s") from e
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-5:])
            raise UserError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{tail}")
        outputs.append(proc.stdout)
    text = "".join(outputs)
    records = parse(text)
    if not records:
        tail = "\n".join(_ANSI.sub("", text).strip().splitlines()[-5:]) or "(no output)"
        raise UserError(f"{binary} printed no timed {'/'.join(ops)} line for backend {backend} "
                        f"(wrong backend name, or a params filter that matched nothing?); its last lines:\n{tail}")
    return records, text
