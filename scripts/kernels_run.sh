#!/usr/bin/env bash
# The GPU kernels on the GPU machine (the device tool), from the repository root: the kernel
# tests marked gpu (tests/quant, tests/kernels, the bench's own), then `moestudio bench kernels`.
# Results in $OUT: gpu_kernel_tests.log, kernels.json, kernels.md (the table), bench_kernels.log.
# Needs CUDA torch and triton; gguf from the carried .whl/ wheels when that folder is there.
# Usage: bash scripts/kernels_run.sh [STAGES] [bench kernels options]
#   STAGES: tests,bench (default both; one of them alone when a call's time limit is short:
#   Triton's compile cache carries over to the next call while the machine stays warm)
#   e.g. bash scripts/kernels_run.sh bench --only dense --rows 1,8 --sweep
set -u
STAGES=${1:-tests,bench}
shift $(( $# > 0 ? 1 : 0 ))
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
if [[ ",$STAGES," == *",tests,"* ]]; then
  echo "[$(date +%T)] GPU kernel tests"
  timeout "${TESTS_TIMEOUT:-270}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/quant tests/kernels \
    tests/bench/test_kernels_bench.py > "$OUT/gpu_kernel_tests.log" 2>&1
  echo "[$(date +%T)] GPU kernel tests rc=$? $(tail -1 "$OUT/gpu_kernel_tests.log")"
fi
if [[ ",$STAGES," == *",bench,"* ]]; then
  timeout "${BENCH_TIMEOUT:-290}" python3 -m engine.cli bench kernels --out "$OUT" "$@" 2>&1 \
    | tee "$OUT/bench_kernels.log"
  echo "[$(date +%T)] bench kernels rc=${PIPESTATUS[0]}"
fi
