#!/usr/bin/env bash
# Install omnips and what it needs into the current Python (use a venv if you prefer).
# torch is pinned to the CPU build 2.13.0 unless a torch is already installed: a bare
# "torch" requirement would otherwise pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install --quiet torch==2.13.0
fi
"$PY" -m pip install --quiet -e ".[dev,plot]"
