#!/usr/bin/env bash
# Install omnips and what it needs into the current Python (use a venv if you prefer).
# torch is pinned to 2.13.0 unless a torch is already installed (the package index this
# project is tested with serves its CPU build): a bare "torch" requirement could pull a
# newer, multi-GB CUDA build instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install --quiet torch==2.13.0
fi
"$PY" -m pip install --quiet -e ".[dev,plot]"
