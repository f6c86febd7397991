#!/usr/bin/env bash
# Install omnips and what it needs into the current Python (use a venv if you prefer).
# torch is pinned to 2.13.0, the version tested, unless a torch is already installed. Which
# build that is depends on the package index: the one this project is tested with serves
# the CPU build (a bare "torch" requirement could pull a newer, multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install --quiet torch==2.13.0
fi
"$PY" -m pip install --quiet -e ".[dev,plot,tensorboard,clusters]"
