#!/usr/bin/env bash
# The GPU kernels on the GPU machine (the device tool), from the repository root, in one call:
# the kernel tests marked gpu (tests/quant, the bench's own), then `moestudio bench kernels`.
# Results in $OUT: gpu_kernel_tests.log, kernels.json, kernels.md (the table), bench_kernels.log.
# Needs CUDA torch and triton; gguf from the carried .whl/ wheels when that folder is there.
# Usage: bash scripts/kernels_run.sh [bench kernels options]     e.g. --only dense --rows 1,8
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
echo "[$(date +%T)] GPU kernel tests"
timeout "${TESTS_TIMEOUT:-270}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/quant \
  tests/bench/test_kernels_bench.py > "$OUT/gpu_kernel_tests.log" 2>&1
echo "[$(date +%T)] GPU kernel tests rc=$? $(tail -1 "$OUT/gpu_kernel_tests.log")"
timeout "${BENCH_TIMEOUT:-290}" python3 -m engine.cli bench kernels --out "$OUT" "$@" 2>&1 | tee "$OUT/bench_kernels.log"
echo "[$(date +%T)] bench kernels rc=${PIPESTATUS[0]}"
