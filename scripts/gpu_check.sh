#!/usr/bin/env bash
# A mixed job on this machine: one CUDA worker beside two CPU workers, dynamic batching,
# mlp on digits, one server. It checks the plan (the CUDA worker holds the largest batch;
# the batches sum to the global batch), the accuracy (at least 0.90) and the memory bound
# (every worker's, measured and at least its batch). Minutes on any GPU machine.
# GPU_CHECK_DEVICE=cpu runs the same job and checks with three CPU workers (the tests do).
# RUN_DIR=DIR keeps the run there (default: a fresh temporary directory).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
if [ "$DEVICE" = cuda ] && ! "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    echo "gpu_check: no CUDA device here (torch.cuda.is_available() is False): nothing checked" >&2
    exit 2
fi
RUN=${RUN_DIR:-$(mktemp -d)/run}
"$PY" -m omnips.cli launch --run-dir "$RUN" --num-workers 3 --num-servers 1 --device "$DEVICE" cpu cpu \
    --batching dynamic --dataset digits --model mlp --epochs 8 --global-batch 96 --lr 0.1 --momentum 0.9 \
    --seed 0 --timeout 300 --no-progress --no-plots
"$PY" - "$RUN" "$DEVICE" <<'CHECK'
import json
import sys
from pathlib import Path

run, device = Path(sys.argv[1]), sys.argv[2]
summary = json.loads((run / "summary.json").read_text())
events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
devices = {e["rank"]: e["device"] for e in events if e["event"] == "membership" and e["role"] == "worker"}
planned = [e for e in events if e["event"] == "assign" and e.get("max_batch")]
failures = []
if summary["status"] != "completed":
    failures.append(f"status {summary['status']}")
if (summary["final_test_accuracy"] or 0) < 0.90:
    failures.append(f"final test accuracy {summary['final_test_accuracy']} < 0.90")
if not devices.get(0, "").startswith(device):
    failures.append(f"worker 0 ran on {devices.get(0)}, not {device}")
if not planned:
    failures.append("the controller made no plan")
else:
    last = planned[-1]
    batches, bounds = last["batches"], last["max_batch"]
    if sum(batches) != summary["global_batch"]:
        failures.append(f"plan {batches} does not sum to the global batch {summary['global_batch']}")
    if device == "cuda" and batches[0] != max(batches):
        failures.append(f"plan {batches}: the CUDA worker does not hold the largest batch")
    if any(not 0 < b <= m for b, m in zip(batches, bounds)):
        failures.append(f"plan {batches} outside the memory bounds {bounds}")
    print(f"gpu_check: devices {[devices[r] for r in sorted(devices)]}, plan {batches}, memory bounds {bounds}, "
          f"final test accuracy {summary['final_test_accuracy']:.4f}, run {run}")
for f in failures:
    print(f"gpu_check: FAILED: {f}", file=sys.stderr)
sys.exit(1 if failures else 0)
CHECK
