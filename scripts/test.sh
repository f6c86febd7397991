#!/usr/bin/env bash
# Install everything, then run a tier of the test suite (other arguments go to pytest):
#   --tier default (the default): the in-process tests but those marked slow, and the
#       end-to-end tests marked core; about 5 minutes on 2 cores
#   --tier rest: what the default tier leaves out (the other end-to-end tests, the slow ones)
#   --tier all: the whole suite (CI runs default, then rest)
# Two test processes: most end-to-end tests wait on emulated devices, so two share
# two cores well (OMNIPS_TEST_WORKERS=0 runs them one after another).
# OMNIPS_NO_SETUP=1 skips the install (a second run).
set -euo pipefail
cd "$(dirname "$0")/.."
DEFAULT='not slow and (not cluster or core)'  # (the markers: pyproject.toml)
tier=default
args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --tier) [ $# -ge 2 ] || { echo "scripts/test.sh: --tier needs default, rest or all" >&2; exit 2; }
                tier=$2; shift 2 ;;
        --tier=*) tier=${1#--tier=}; shift ;;
        *) args+=("$1"); shift ;;
    esac
done
case "$tier" in
    default) select=(-m "$DEFAULT") ;;
    rest) select=(-m "not ($DEFAULT)") ;;
    all) select=() ;;
    *) echo "scripts/test.sh: unknown tier '$tier': use default, rest or all" >&2; exit 2 ;;
esac
[ "${OMNIPS_NO_SETUP:-0}" = 1 ] || bash scripts/setup.sh
# waits for other processes stretched 2x (tests/helpers.py): a busy host is slow, not wrong
export OMNIPS_TEST_WAIT_FACTOR="${OMNIPS_TEST_WAIT_FACTOR:-2}"
exec "${PYTHON:-python3}" -m pytest -q -n "${OMNIPS_TEST_WORKERS:-2}" ${select[@]+"${select[@]}"} ${args[@]+"${args[@]}"}
