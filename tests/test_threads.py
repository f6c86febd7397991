"""Workers started by hand (scripts/start-worker.sh, no --threads) share their host's cores
among the job's workers on it, as the scheduler's welcome counts them, and say so."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from omnips.launch import LocalCluster
from omnips.worker.threads import share, usable_cores

from helpers import WAIT_FACTOR

ROOT = Path(__file__).resolve().parent.parent


def test_share_gives_each_worker_an_equal_part_and_at_least_one_thread():
    assert [share(16, n) for n in (1, 2, 3, 16, 40)] == [16, 8, 5, 1, 1]
    assert share(2, 3) == 1 and share(2, 0) == 2


@pytest.mark.cluster
def test_workers_started_by_hand_take_an_equal_share_of_the_cores_and_log_it(tmp_path):
    run_dir = tmp_path / "run"
    with LocalCluster(run_dir, ["--max-steps", "5", "--global-batch", "30", "--heartbeat", "0.3"], 1, [],
                      ranks=3) as cluster:
        cluster.start_scheduler()
        cluster.start_servers()
        workers = []
        try:
            for rank in range(3):
                with open(run_dir / "logs" / f"worker{rank}.log", "w") as log:
                    workers.append(subprocess.Popen(
                        ["bash", str(ROOT / "scripts" / "start-worker.sh"), "--scheduler", cluster.endpoint],
                        stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                        env={**os.environ, "OMNIPS_PYTHON": sys.executable}))
            codes = [w.wait(timeout=120 * WAIT_FACTOR) for w in workers]
            assert cluster.procs["scheduler"].wait(timeout=60 * WAIT_FACTOR) == 0
        finally:
            for w in workers:
                if w.poll() is None:
                    w.kill()
                    w.wait(timeout=10 * WAIT_FACTOR)
    logs = [(run_dir / "logs" / f"worker{r}.log").read_text() for r in range(3)]
    assert codes == [0, 0, 0], logs
    cores = usable_cores()
    chosen = [re.search(r"worker \d: (\d+) torch thread\(s\): (\d+) core\(s\) shared by (\d+) worker\(s\)", log)
              for log in logs]
    assert all(chosen), logs
    assert {m.groups() for m in chosen} == {(str(share(cores, 3)), str(cores), "3")}
