#!/usr/bin/env bash
# The GPU kernels on the GPU machine (the device tool), from the repository root: the kernel
# tests marked gpu (tests/quant, tests/kernels, the bench's own), then `moestudio bench kernels`.
# Results in $OUT: gpu_kernel_tests.log, kernels.json, kernels.md (the table), bench_kernels.log.
# Needs CUDA torch and triton; gguf from the carried .whl/ wheels when that folder is there.
# Usage: bash scripts/kernels_run.sh [STAGES] [bench kernels options]
#   STAGES: any of llamaops,tests,bench (default tests,bench; one alone when a call's time limit
#   is short: Triton's compile cache and the llamaops build stay while the machine stays warm)
#   llamaops  build llama.cpp's test-backend-ops with CUDA into /tmp/llamaops (once per machine;
#             seconds when device_run.sh's CUDA build is in /tmp/site_cuda, else a ggml build);
#             the bench stage then runs its MUL_MAT / MUL_MAT_ID perf cases of our shapes and
#             prints llama.cpp's figures beside ours (MOESTUDIO_LLAMA_OPS), llama_ops.txt in $OUT
#   e.g. bash scripts/kernels_run.sh bench --only dense --rows 1,8 --sweep
#        bash scripts/kernels_run.sh llamaops,bench --only dense,experts --rows 1,8
# llamaops builds from the carried .src/llama_cpp_python-0.3.36.tar.gz, which must keep
# vendor/llama.cpp/tests/test-backend-ops.cpp (the rest of tests/ may go: this stage writes its own
# tests/CMakeLists.txt, test-backend-ops needs ggml alone). Make it from the full sdist, keeping
# the files of the slimmed one that .src holds now plus that one file (5.2 MB instead of 5.1):
#   pip download --no-deps --no-binary=:all: llama-cpp-python==0.3.36 -d /tmp/sd && cd /tmp/sd
#   tar xzf llama_cpp_python-0.3.36.tar.gz
#   tar tzf <repo>/.src/llama_cpp_python-0.3.36.tar.gz > keep.lst
#   echo llama_cpp_python-0.3.36/vendor/llama.cpp/tests/test-backend-ops.cpp >> keep.lst
#   tar czf slim.tar.gz --no-recursion -T keep.lst && mv slim.tar.gz <repo>/.src/llama_cpp_python-0.3.36.tar.gz
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
LLAMA_OPS_BIN=/tmp/llamaops/bin/test-backend-ops
CUDA_LIB=${MOESTUDIO_LLAMA_SITE:-/tmp/site_cuda}/llama_cpp/lib
if [[ ",$STAGES," == *",llamaops,"* && ! -x $LLAMA_OPS_BIN ]]; then
  echo "[$(date +%T)] building llama.cpp's test-backend-ops (CUDA)"
  rm -rf /tmp/llamaops-src && mkdir -p /tmp/llamaops-src && tar xzf .src/llama_cpp_python-*.tar.gz -C /tmp/llamaops-src
  SRC=$(echo /tmp/llamaops-src/llama_cpp_python-*/vendor/llama.cpp)
  if [ ! -f "$SRC/tests/test-backend-ops.cpp" ]; then
    echo "llamaops: .src's sdist has no vendor/llama.cpp/tests/test-backend-ops.cpp; remake .src as this script's header says"
    exit 1
  fi
  if [ -f "$CUDA_LIB/libggml-cuda.so" ]; then
    # device_run.sh's CUDA build of llama-cpp-python is at hand: test-backend-ops needs ggml's
    # public headers alone, so it compiles in seconds against that build's libraries.
    mkdir -p "$(dirname $LLAMA_OPS_BIN)"
    g++ -O2 -std=c++17 -pthread -I "$SRC/ggml/include" "$SRC/tests/test-backend-ops.cpp" -L "$CUDA_LIB" \
      -lggml -lggml-base -Wl,-rpath,"$CUDA_LIB" -o $LLAMA_OPS_BIN > "$OUT/llamaops_build.log" 2>&1
  else
    # Only test-backend-ops, linked to ggml alone (upstream's list also links llama and llama-common
    # and names ~60 other test sources); FlashAttention kernels off: the products do not use them
    # and they are most of the CUDA compile time.
    printf '%s\n' 'add_executable(test-backend-ops test-backend-ops.cpp)' \
      'target_link_libraries(test-backend-ops PRIVATE ggml)' > "$SRC/tests/CMakeLists.txt"
    { cmake -S "$SRC" -B /tmp/llamaops -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
        -DGGML_CUDA_FA=OFF -DLLAMA_BUILD_TESTS=ON -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TOOLS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF \
      && timeout "${LLAMAOPS_TIMEOUT:-540}" cmake --build /tmp/llamaops --target test-backend-ops -j "$(nproc)"; } \
      > "$OUT/llamaops_build.log" 2>&1
  fi
  echo "[$(date +%T)] test-backend-ops build rc=$? $(tail -1 "$OUT/llamaops_build.log")"
fi
if [ -z "${MOESTUDIO_LLAMA_OPS:-}" ] && [ -x $LLAMA_OPS_BIN ]; then
  export MOESTUDIO_LLAMA_OPS=$LLAMA_OPS_BIN  # the bench stage runs it beside ours
fi
if [[ ",$STAGES," == *",tests,"* ]]; then
  echo "[$(date +%T)] GPU kernel tests"
  timeout "${TESTS_TIMEOUT:-270}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/quant tests/kernels \
    tests/bench/test_kernels_bench.py > "$OUT/gpu_kernel_tests.log" 2>&1
  echo "[$(date +%T)] GPU kernel tests rc=$? $(tail -1 "$OUT/gpu_kernel_tests.log")"
fi
if [[ ",$STAGES," == *",bench,"* ]]; then
  # 540 s: within a device call's 600 s; at 290 a whole-table run (every type, 1 and 8 rows) was cut off
  # before llama.cpp's cases ran (they run after ours)
  timeout "${BENCH_TIMEOUT:-540}" python3 -m engine.cli bench kernels --out "$OUT" "$@" 2>&1 \
    | tee "$OUT/bench_kernels.log"
  echo "[$(date +%T)] bench kernels rc=${PIPESTATUS[0]}"
fi
