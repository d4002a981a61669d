#!/usr/bin/env bash
# The quick start's two commands:
#   ./dev.sh app    set up (once) and start MoE Studio on its demo model
#   ./dev.sh test   set up (once) and run the whole test suite in a process a core, at most 4 (pytest-xdist;
#                   extra args go to pytest: -n 0 for one process, -n 8 for eight)
# Setup makes .venv beside this file; it is skipped when pyproject.toml and this script
# are unchanged since the last successful setup.
set -euo pipefail
cd "$(dirname "$0")"

VENV=${MOESTUDIO_VENV:-.venv}
PYTHON=${PYTHON:-python3}
# The ggml CPU kernels and llama.cpp reference come from this exact release (see pyproject.toml).
LLAMA_CPP_SPEC="llama-cpp-python==0.3.36"

has_nvidia_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

torch_spec() {
    if [ -n "${MOESTUDIO_TORCH_SPEC:-}" ]; then echo "$MOESTUDIO_TORCH_SPEC"
    elif has_nvidia_gpu; then echo "torch>=2.4"        # PyPI's default Linux wheel is the CUDA build
    else echo "torch==2.13.0"                          # a CPU-only machine: the smallest wheel we test with
    fi
}

setup() {
    "$PYTHON" - <<'PY' || { echo "MoE Studio needs Python 3.11 or newer (set PYTHON=/path/to/python3.11)" >&2; exit 1; }
import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)
PY
    local stamp
    stamp=$(cat pyproject.toml dev.sh | sha256sum | cut -c1-16)-$(has_nvidia_gpu && echo gpu || echo cpu)
    if [ -f "$VENV/.setup-stamp" ] && [ "$(cat "$VENV/.setup-stamp")" = "$stamp" ]; then
        return 0
    fi
    echo "==> Setting up $VENV (first time: ~6 min on 2 cores, most of it compiling llama.cpp)" >&2
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
    local pip=("$VENV/bin/python" -m pip --disable-pip-version-check)
    "${pip[@]}" install -q --upgrade pip
    echo "==> torch: $(torch_spec)" >&2
    "${pip[@]}" install -q "$(torch_spec)"
    # Built from source (CPU backend); pip caches the wheel, so later setups take seconds.
    # For a CUDA build of the llama.cpp baseline: CMAKE_ARGS="-DGGML_CUDA=on" ./dev.sh ...
    echo "==> $LLAMA_CPP_SPEC (compiles llama.cpp the first time)" >&2
    "${pip[@]}" install -q "$LLAMA_CPP_SPEC"
    "${pip[@]}" install -q -e ".[test]"
    echo "$stamp" > "$VENV/.setup-stamp"
}

case "${1:-}" in
    app)
        shift; setup
        exec "$VENV/bin/moestudio" "$@" ;;
    test)
        shift; setup
        export QT_QPA_PLATFORM=${QT_QPA_PLATFORM:-offscreen}
        # worksteal: an idle process takes queued tests from a busy one (the interpreted kernel
        # tests take up to a minute each, the rest seconds)
        exec "$VENV/bin/python" -m pytest -n auto --maxprocesses 4 --dist worksteal "$@" ;;
    setup)
        setup ;;
    *)
        echo "usage: ./dev.sh app|test|setup [args...]" >&2; exit 2 ;;
esac
