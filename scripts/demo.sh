#!/usr/bin/env bash
# Install everything, then train the default job: a local BSP cluster (2 servers,
# 3 workers of emulated speeds 4:2:1) on the digits data set.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" scripts/launch_local.py --num-servers 2 --num-workers 3 --slowdown 1 2 4 \
    --mode bsp --epochs 10 "$@"
