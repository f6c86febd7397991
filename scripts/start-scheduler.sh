#!/usr/bin/env bash
# Start one omnips scheduler on this machine; flags are passed on (python -m omnips.scheduler --help).
# Environment: OMNIPS_PYTHON (default python3).
set -euo pipefail
# glibc allocator settings that keep large ZeroMQ buffers from being mapped and
# unmapped per message (2.5-4x faster push+pull; see docs/performance.md).
export MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=4294967295 MALLOC_ARENA_MAX=1 PYTHONUNBUFFERED=1
args=("$@")
exec "${OMNIPS_PYTHON:-python3}" -m omnips.scheduler "${args[@]}"
