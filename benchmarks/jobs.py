"""Running one omnips job to its end from a benchmark script."""

import json
from pathlib import Path

from omnips.launch import LaunchError, LocalCluster, WorkerSpec
from omnips.metrics import read_events


def run_job(run_dir: Path, scheduler_args: list[str], num_servers: int, workers: list[WorkerSpec], label: str,
            timeout_s: float) -> tuple[dict, list[dict]]:
    """Start the job's processes, wait for them, and return its summary and events; a job
    that fails or does not complete stops the benchmark (SystemExit naming `label`)."""
    cluster = LocalCluster(run_dir, scheduler_args, num_servers, workers)
    try:
        cluster.start()
        code = cluster.wait(timeout_s)
    except LaunchError as exc:
        raise SystemExit(f"{label}: {exc}") from None
    codes = cluster.exit_codes()
    if code != 0 or any(c != 0 for c in codes.values()):
        logs = "\n".join(f"  {name}: {cluster.tail(name)}" for name in codes)
        raise SystemExit(f"{label}: exit codes {codes} (run dir {run_dir})\n{logs}")
    summary = json.loads((run_dir / "summary.json").read_text())
    if summary.get("status") != "completed":
        raise SystemExit(f"{label}: status {summary.get('status')!r}")
    return summary, read_events(run_dir)
