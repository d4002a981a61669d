#!/usr/bin/env bash
# One session on the GPU machine (the device tool): build llama-cpp-python with CUDA from the
# carried source, run the GPU tests, then the side-by-side benchmark. Results go to $OUT.
# Carry: .whl (gguf, platformdirs, diskcache wheels) and .src (slimmed llama-cpp-python sdist).
# Usage: bash scripts/device_run.sh [layers] [budget_mib] [stages: build,tests,bench]
set -u
REPO=$PWD
LAYERS=${1:-8}
BUDGET=${2:-1365}
STAGES=${3:-build,tests,bench}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/steps.log"; }
has() { [[ ",$STAGES," == *",$1,"* ]]; }

python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$REPO PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
lscpu | grep -E "Model name|^CPU\(s\)|Flags" | cut -c1-300 > "$OUT/cpu.txt"

if has build; then
  # Two builds: a CPU one for this engine's process (ggml CPU pool, reference, tokenizer) and a
  # CUDA one for the llama.cpp baseline, which runs in its own torch-free process: llama.cpp's
  # CUDA build and torch's CUDA libraries crash when loaded into one process.
  log "build llama-cpp-python: CPU into /tmp/site, CUDA sm_90 into /tmp/site_cuda (in parallel)"
  mkdir -p /tmp/llcpu /tmp/llcuda && tar xzf .src/llama_cpp_python-*.tar.gz -C /tmp/llcpu && tar xzf .src/llama_cpp_python-*.tar.gz -C /tmp/llcuda
  (cd /tmp/llcpu/llama_cpp_python-* && CMAKE_ARGS="-DLLAVA_BUILD=OFF" CMAKE_BUILD_PARALLEL_LEVEL=5 timeout 420 \
     python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/site . > "$OUT/build_cpu.log" 2>&1) &
  cpu_pid=$!
  (cd /tmp/llcuda/llama_cpp_python-* && CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAVA_BUILD=OFF" \
     CMAKE_BUILD_PARALLEL_LEVEL=11 timeout 420 python3 -m pip install -q --no-build-isolation --no-deps \
     --target /tmp/site_cuda . > "$OUT/build_cuda.log" 2>&1) &
  cuda_pid=$!
  wait $cpu_pid || { log "CPU build failed"; tail -30 "$OUT/build_cpu.log"; exit 1; }
  log "CPU build done"
  wait $cuda_pid || log "CUDA build failed (baseline runs will fail)"
  log "builds done"
fi
export MOESTUDIO_LLAMA_SITE=/tmp/site_cuda
python3 -c "import torch, llama_cpp; print(llama_cpp.__version__, torch.__version__, torch.cuda.get_device_name())" 2>&1 | tee -a "$OUT/steps.log"

if has tests; then
  log "GPU tests"
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_dequant.py tests/moe/test_hybrid.py \
     $(ls tests/quant/test_*.py 2>/dev/null) > "$OUT/gpu_tests.log" 2>&1
  log "GPU tests rc=$? $(tail -1 "$OUT/gpu_tests.log")"
fi

if has bench; then
  log "bench model: qwen3-30b-a3b geometry, $LAYERS layers"
  python3 - <<PY >> "$OUT/steps.log" 2>&1
from engine.synth.spec import preset
from engine.synth.routing import routing
from engine.synth.writer import write_model
import time
t = time.time()
write_model("/tmp/q3.gguf", preset("qwen3-30b-a3b").with_(n_layer=$LAYERS), routing("qwen3-30b"), seed=0)
print("model written in", round(time.time() - t, 1), "s")
PY
  log "bench speed at $BUDGET MiB"
  timeout 300 python3 - <<PY > "$OUT/bench.log" 2>&1
import json
from pathlib import Path
from engine.bench.speed import bench
r = bench(Path("/tmp/q3.gguf"), $BUDGET, device="cuda", threads=16, n_prompt=512, n_decode=64)
Path("$OUT/bench.json").write_text(json.dumps(r, indent=2, default=float))
for name, run in r["runs"].items():
    print(name, {k: round(v, 3) if isinstance(v, float) else v for k, v in run.items()})
PY
  log "bench rc=$?"
fi
