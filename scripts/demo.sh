#!/usr/bin/env bash
# Install everything, then train the default job: a local BSP cluster (2 servers,
# 3 workers on virtual devices of 1, 2 and 4 ms per sample: speeds 4:2:1) on the
# digits data set, with dynamic batching. At step 100 the fastest worker turns 4x slower
# (a neighbour's job): the plan follows, and RUN_DIR/plots/uniform.png shows what equal
# batches would have cost. Extra arguments go to the launcher (they win over these);
# OMNIPS_NO_SETUP=1 skips the install (a second run).
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${OMNIPS_NO_SETUP:-0}" = 1 ] || bash scripts/setup.sh
exec "${PYTHON:-python3}" scripts/launch_local.py --num-servers 2 --num-workers 3 \
    --emulate-ms-per-step 3 --emulate-ms-per-sample 1 2 4 --slowdown 0:1,100:4 1 1 \
    --mode bsp --batching dynamic --epochs 10 "$@"
