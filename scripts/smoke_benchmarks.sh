#!/usr/bin/env bash
# Runs every benchmark that has no test of its own at a toy size (each says how long it
# took), so that a change that breaks one fails here rather than on the next real run.
# The figures mean nothing at these sizes; the tables go to a temporary directory.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
run() {
    local name=$1; shift
    local start=$SECONDS
    if ! "$PY" "benchmarks/$name.py" "$@" --out "$OUT/$name.md" > "$OUT/$name.log" 2>&1; then
        echo "benchmarks/$name.py failed; its output:" >&2
        cat "$OUT/$name.log" >&2
        exit 1
    fi
    test -s "$OUT/$name.md" || { echo "benchmarks/$name.py wrote no table" >&2; exit 1; }
    echo "benchmarks/$name.py ran in $((SECONDS - start)) s"
}
run pushpull --params 100000 --repeats 3 --curve-repeats 2 --warmup 1 --bucket-size 16384  # 25 parts a push
run overlap --sizes 0,64K --rounds 1 --steps 8 --skip 2 --features 256 --hidden 256 --batch 16
run wire_dtype --epochs 1 --seeds 0 --params 100000 --repeats 3 --warmup 1
run failures --dead-after 1 --checkpoint-every 5 --repeats 1
run heterogeneity --only HL8 --epochs 0.5 --ms-per-step 5 --ms-per-sample 0.5
run unread --params 100000 --pulls 5 --steps 2
run status_overhead --workers 8 --steps 5 --rounds 3 --rows uniform:0.5
run asp_accuracy --quick --sections corrections,cost --cost-values 100000
run replay --limit 1
run malloc --batches 16 --repeats 1
# CPU quotas need root and a kernel that offers them (benchmarks/quota.py): where they are refused, say why and go on
refused=$("$PY" -c "import sys; sys.path.insert(0, 'benchmarks'); import quota; print(quota.available() or '')")
if [ -z "$refused" ]; then run cgroup --quick; else echo "benchmarks/cgroup.py SKIPPED: $refused" >&2; fi
# emulated hosts need root (network namespaces): where they are refused, say why and go on
refused=$("$PY" -c "import sys; sys.path.insert(0, 'benchmarks'); import multihost; print(multihost.available() or '')")
if [ -z "$refused" ]; then run multihost --steps 20 --repeats 1 --dead-after 3; else echo "benchmarks/multihost.py SKIPPED: $refused" >&2; fi
