#!/usr/bin/env bash
# Builds the one-folder MoE Studio bundle into dist/moestudio/ (packaging/README.md):
#   packaging/build_bundle.sh            build (installs PyInstaller into the venv if missing)
#   packaging/build_bundle.sh --check    build, then start the bundle offscreen and time it
# The venv must be set up first (./dev.sh setup); the bundle takes torch, llama-cpp-python and
# PySide6 from it as they are installed there.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${MOESTUDIO_VENV:-.venv}
PY="$VENV/bin/python"
[ -x "$PY" ] || { echo "no venv at $VENV: run ./dev.sh setup first" >&2; exit 1; }
if ! "$PY" -c "import PyInstaller" 2>/dev/null; then
    echo "==> installing PyInstaller (the 'bundle' extra)" >&2
    "$PY" -m pip install -q --disable-pip-version-check -e ".[bundle]"
fi

start=$(date +%s)
# PyInstaller imports every torch submodule to list them; hundreds of torch's own deprecation
# notices would bury the warnings that matter (missing libraries).
PYTHONWARNINGS=ignore::DeprecationWarning "$PY" -m PyInstaller --noconfirm --clean --log-level WARN \
    --distpath dist --workpath build/pyinstaller packaging/moestudio.spec
echo "==> built dist/moestudio in $(( $(date +%s) - start )) s, $(du -sh dist/moestudio | cut -f1)" >&2

if [ "${1:-}" = "--check" ]; then
    # An empty environment (no venv, no PYTHONPATH) and a throwaway home, so the check
    # neither reads nor writes the user's settings.
    home=$(mktemp -d)
    trap 'rm -rf "$home"' EXIT
    ms() { echo $(( ($(date +%s%N) - t0) / 1000000 )); }
    t0=$(date +%s%N)
    env -i HOME="$home" PATH=/usr/bin:/bin TMPDIR="$home" QT_QPA_PLATFORM=offscreen \
        MOESTUDIO_EXIT_AFTER_SHOW=1 dist/moestudio/moestudio 2>&1 | {
        shown=0
        while IFS= read -r line; do
            echo "$line"
            case $line in *"main window shown"*) shown=1; echo "==> main window shown $(ms) ms after launch" >&2 ;; esac
        done
        [ $shown = 1 ] || { echo "==> the bundle exited without showing its window" >&2; exit 1; }
    }
    echo "==> quit after $(ms) ms" >&2
fi
