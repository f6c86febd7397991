#!/usr/bin/env bash
# Start one omnips server on this machine; flags are passed on (python -m omnips.server --help).
# Environment: OMNIPS_PYTHON (default python3), OMNIPS_SCHEDULER (tcp://HOST:PORT, else --scheduler).
set -euo pipefail
# glibc allocator settings that keep large ZeroMQ buffers from being mapped and
# unmapped per message (2.5-4x faster push+pull; see docs/performance.md).
export MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=4294967295 MALLOC_ARENA_MAX=1 PYTHONUNBUFFERED=1
args=("$@")
if [ -n "${OMNIPS_SCHEDULER:-}" ]; then args=(--scheduler "$OMNIPS_SCHEDULER" "${args[@]}"); fi
exec "${OMNIPS_PYTHON:-python3}" -m omnips.server "${args[@]}"
