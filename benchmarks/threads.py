"""Three workers started by hand on one host: torch's default threads (one per core, here
forced with --threads NPROC) against the worker's own choice (--threads 0: the cores
shared among the job's workers on the host). Prints each run's compute time per step.

    python benchmarks/threads.py [--steps 60]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from omnips.launch import LocalCluster  # noqa: E402


def run(threads: str, steps: int) -> dict:
    run_dir = Path(tempfile.mkdtemp()) / "run"
    job = ["--max-steps", str(steps), "--global-batch", "384", "--model", "cnn"]
    with LocalCluster(run_dir, job, 1, [], ranks=3) as cluster:
        cluster.start_scheduler()
        cluster.start_servers()
        workers = [subprocess.Popen([sys.executable, "-m", "omnips.worker", "--scheduler", cluster.endpoint,
                                     "--threads", threads], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                   for _ in range(3)]
        for w in workers:
            w.wait(timeout=1800)
        cluster.procs["scheduler"].wait(timeout=120)
    return json.loads((run_dir / "summary.json").read_text())


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    args = p.parse_args()
    for threads in (str(os.cpu_count()), "0"):
        s = run(threads, args.steps)
        print(f"--threads {threads}: compute s/step {[round(t, 4) for t in s['worker_compute_s_per_step']]}, "
              f"{s['samples_per_s']:.0f} samples/s", flush=True)


if __name__ == "__main__":
    main()
