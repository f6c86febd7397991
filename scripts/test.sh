#!/usr/bin/env bash
# Install everything, then run the whole test suite (extra arguments go to pytest).
# Two test processes: most end-to-end tests wait on emulated devices, so two share
# two cores well (OMNIPS_TEST_WORKERS=0 runs them one after another).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# waits for other processes stretched 2x (tests/helpers.py): a busy host is slow, not wrong
export OMNIPS_TEST_WAIT_FACTOR="${OMNIPS_TEST_WAIT_FACTOR:-2}"
exec "${PYTHON:-python3}" -m pytest -q -n "${OMNIPS_TEST_WORKERS:-2}" "$@"
