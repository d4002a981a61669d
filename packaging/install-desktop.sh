#!/usr/bin/env bash
# Adds MoE Studio (this clone's venv) to the desktop's application launcher for the current user;
# `--uninstall` removes it. The same as `moestudio install-desktop`, without loading the engine's
# command-line parser (which imports torch). Set up the venv first: ./dev.sh setup
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MOESTUDIO_VENV:-.venv}
[ -x "$VENV/bin/python" ] || { echo "no venv at $VENV: run ./dev.sh setup first" >&2; exit 1; }
exec "$VENV/bin/python" -m app.desktop_entry "$@"
