#!/usr/bin/env bash
# The GPU machine (the device tool): build llama-cpp-python with CUDA from the carried source,
# run the GPU tests, write the benchmark models and run the docs/BENCHMARKS.md sweep.
# Results go to $OUT. Carry: .whl (gguf, platformdirs, diskcache wheels), .src (the slimmed
# llama-cpp-python sdist) and, when an earlier run packed it, .builds/site_cpu.tar.xz (the CPU
# build, unpacked instead of compiled).
# Usage: bash scripts/device_run.sh STAGES   (comma-separated, in this order:
#   cudabuild  CUDA build into /tmp/site_cuda in the background (for the llama.cpp baseline)
#   build      CPU build (or unpack) into /tmp/site
#   tests      the GPU tests ($GPU_TESTS, default: the folders holding tests marked gpu; the app's and the
#              server's cannot be collected there, without PySide6 and fastapi) in $TEST_WORKERS processes
#              (pytest-xdist, in the device's image; default 10: they compile Triton's kernels side by side;
#              H100, session 44: on a fresh machine 421 of 422 passed in 6.4 min, bench kernels' own test
#              still running, which takes 3.6 min warm; all in 4.7 min warm); where a call still cannot
#              hold them, in parts: MOESTUDIO_TEST_PART=I/N, one a call (tests/conftest.py)
#   write      the scenario models (engine/bench/scenarios.py) into /tmp/sc
#   wait       wait for the CUDA build
#   engine     the scenarios' runs of this engine;  llama: llama.cpp's;  report: the table
#   chunks     scripts/prompt_chunks.py on the qwen3-30b routing model at 8 (profiled) and 16 GiB (chunks.tgz)
#   prompt     scripts/time_prompt.py on that model, every expert resident, 512 and 4,096 tokens, graphs on and
#              off interleaved in one process (prompt.log; before the CUDA build or after it: the build's
#              compilers slow the host the prompt is timed on)
#   profile    scripts/profile_decode.py on that model, every expert resident, profiled: a token's and a
#              warm 512-token prompt's GPU kernels and host calls (profile.tgz)
#   pack       the CPU build into $OUT for later runs)
# SC_ONLY="label ..." limits the scenarios (engine/bench/scenarios.py labels).
# The carried folders, made on the development machine (ignored by git; a new checkout lacks them):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl gguf platformdirs diskcache
#   pip download --no-deps --no-binary=:all: llama-cpp-python==0.3.36 -d /tmp/sd && cd /tmp/sd \
#     && tar xzf llama_cpp_python-0.3.36.tar.gz && cd llama_cpp_python-0.3.36 && rm -rf .git .github examples \
#     docker docs && cd vendor/llama.cpp && rm -rf models docs media benches .github gguf-py examples conversion \
#     skills pocs .devops scripts && find tests -type f ! -name test-backend-ops.cpp -delete \
#     && (cd tools && ls | grep -v '^mtmd$' | xargs rm -rf) && (cd ggml/src && ls -d ggml-* | grep -v \
#     -e '^ggml-cpu$' -e '^ggml-cuda$' -e '\.' | xargs rm -rf) && cd /tmp/sd && mkdir -p <repo>/.src \
#     && tar czf <repo>/.src/llama_cpp_python-0.3.36.tar.gz llama_cpp_python-0.3.36     (~5 MB)
# A call's processes end with it, but the machine stays warm 30 s: the next call finds /tmp as
# this one left it (the builds, the models, Triton's cache in $TRITON_CACHE_DIR).
set -u
REPO=$PWD
STAGES=${1:-cudabuild,build,tests,write,wait,engine,llama,report}
OUT=${OUT:-/tmp/out}
SC=/tmp/sc
mkdir -p "$OUT" "$SC"
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/steps.log"; }
has() { [[ ",$STAGES," == *",$1,"* ]]; }

python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$REPO PYTHONUNBUFFERED=1 MOESTUDIO_LLAMA_SITE=/tmp/site_cuda
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; lscpu | grep -E "Model name|^CPU\(s\)"; } \
  >> "$OUT/steps.log" 2>&1

if has cudabuild; then
  # The CUDA build of llama.cpp for the baseline, in the background (it runs in its own
  # torch-free process: llama.cpp's CUDA build and torch's CUDA libraries crash when loaded
  # into one process). In a session of its own (setsid): the device ends a call's other
  # processes when the call returns, and a later call's `wait` stage waits for this build.
  mkdir -p /tmp/llcuda && tar xzf .src/llama_cpp_python-*.tar.gz -C /tmp/llcuda
  rm -f /tmp/build_cuda.rc
  (cd /tmp/llcuda/llama_cpp_python-* && CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAVA_BUILD=OFF" \
     CMAKE_BUILD_PARALLEL_LEVEL=12 setsid bash -c 'timeout 540 python3 -m pip install -q --no-build-isolation \
     --no-deps --target /tmp/site_cuda . > /tmp/build_cuda.log 2>&1; echo $? > /tmp/build_cuda.rc' < /dev/null &)
  log "CUDA build started"
fi
if has build; then
  # The CPU build for this engine's process (ggml CPU pool, tokenizer): unpacked when an
  # earlier run packed it, else compiled.
  if [ -f .builds/site_cpu.tar.xz ]; then
    tar xJf .builds/site_cpu.tar.xz -C /tmp/site || exit 1
    log "CPU build unpacked"
  else
    mkdir -p /tmp/llcpu && tar xzf .src/llama_cpp_python-*.tar.gz -C /tmp/llcpu
    (cd /tmp/llcpu/llama_cpp_python-* && CMAKE_ARGS="-DLLAVA_BUILD=OFF" CMAKE_BUILD_PARALLEL_LEVEL=${CPU_JOBS:-4} timeout 420 \
       python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/site . > /tmp/build_cpu.log 2>&1) \
       || { log "CPU build failed"; tail -30 /tmp/build_cpu.log >> "$OUT/steps.log"; exit 1; }
    log "CPU build done"
  fi
fi
python3 -c "import torch, llama_cpp; print(llama_cpp.__version__, torch.__version__, torch.cuda.get_device_name())" \
  2>&1 | tee -a "$OUT/steps.log"

if has write; then
  log "writing the scenario models"
  (python3 -m engine.cli bench scenarios $SC --phase write ${SC_ONLY:+--only $SC_ONLY} > /tmp/write.log 2>&1; echo $? > /tmp/write.rc) &
  write_pid=$!
fi

if has tests; then
  log "GPU tests"
  # -v: a part cut off by the timeout still says which tests passed and failed
  timeout ${TESTS_TIMEOUT:-480} python3 -m pytest -v -p no:cacheprovider -m gpu -n ${TEST_WORKERS:-10} \
    ${GPU_TESTS:-tests/quant tests/kernels tests/engine tests/moe tests/bench tests/reliability/test_gpu_memory.py} \
    > "$OUT/gpu_tests.log" 2>&1
  log "GPU tests rc=$? $(tail -1 "$OUT/gpu_tests.log")"
fi

if has write; then
  wait $write_pid
  log "models written rc=$(cat /tmp/write.rc)"; tail -3 /tmp/write.log >> "$OUT/steps.log"; df -h /tmp | tail -1 >> "$OUT/steps.log"
fi

if has wait; then
  [ -f /tmp/build_cuda.rc ] || pgrep -f "target /tmp/site_cuda" > /dev/null \
    || { log "no CUDA build has run or runs on this machine (stage cudabuild)"; exit 1; }
  while [ ! -f /tmp/build_cuda.rc ]; do sleep 2; done
  log "CUDA build rc=$(cat /tmp/build_cuda.rc)"
  [ "$(cat /tmp/build_cuda.rc)" = 0 ] || tail -20 /tmp/build_cuda.log >> "$OUT/steps.log"
fi

if has engine && [ ! -f /tmp/build_cuda.rc ] && pgrep -f "target /tmp/site_cuda" > /dev/null; then
  # The CUDA build's compilers take the cores the CPU pool decodes on: an engine run beside it
  # decoded at 1 tok/s instead of ~130 (session 15).
  log "the engine's runs wait for the CUDA build"
  while [ ! -f /tmp/build_cuda.rc ]; do sleep 2; done
fi
for phase in engine llama report; do
  if has $phase; then
    log "scenarios: $phase"
    timeout ${PHASE_TIMEOUT:-400} python3 -m engine.cli bench scenarios $SC --phase $phase ${SC_ONLY:+--only $SC_ONLY} >> "$OUT/scenarios.log" 2>&1
    log "$phase rc=$?"
    cp $SC/results.json $SC/results.md "$OUT/" 2>/dev/null
  fi
done

if has chunks; then
  mkdir -p /tmp/chunks
  for gib in 8 16; do
    log "prompt chunks at $gib GiB"
    timeout ${PHASE_TIMEOUT:-400} python3 scripts/prompt_chunks.py $SC/qwen3-30b-a3b-qwen3-30b.gguf --budget-gib $gib \
      $([ $gib = 8 ] && echo --profile) --out /tmp/chunks/$gib >> /tmp/chunks/log 2>&1
    log "chunks rc=$?"
  done
  tar czf "$OUT/chunks.tgz" -C /tmp chunks  # one file: $OUT brings back eight at most
fi

if has prompt; then
  for n in 512 4096; do
    log "resident prompt of $n tokens, graphs on and off"
    timeout ${PHASE_TIMEOUT:-400} python3 scripts/time_prompt.py $SC/qwen3-30b-a3b-qwen3-30b.gguf prompt$n --prompt $n \
      --repeats $([ $n = 512 ] && echo 15 || echo 5) --graphs on,off >> "$OUT/prompt.log" 2>&1
    log "prompt rc=$?"
  done
fi

if has profile; then
  log "resident profile"
  mkdir -p /tmp/profile
  timeout ${PHASE_TIMEOUT:-400} python3 scripts/profile_decode.py $SC/qwen3-30b-a3b-qwen3-30b.gguf --tokens 16 --profile \
    --out /tmp/profile > /tmp/profile/log 2>&1
  log "profile rc=$?"
  tar czf "$OUT/profile.tgz" -C /tmp profile
fi

if has pack; then
  (cd /tmp/site && tar cf - llama_cpp | xz -T16 -6 > "$OUT/site_cpu.tar.xz")
fi
