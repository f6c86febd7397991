"""Helpers for end-to-end tests: real processes over ZeroMQ on loopback."""

import json
from pathlib import Path

from omnips.launch import LocalCluster, WorkerSpec
from omnips.metrics import read_events

JOB_TIMEOUT_S = 150


class Run:
    def __init__(self, cluster: LocalCluster, code: int):
        self.cluster, self.code = cluster, code
        self.dir = Path(cluster.run_dir)

    @property
    def summary(self) -> dict:
        return json.loads((self.dir / "summary.json").read_text())

    @property
    def events(self) -> list[dict]:
        return read_events(self.dir)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted((self.dir / "logs").glob("*.log")))


def start_cluster(run_dir, scheduler_args, workers, num_servers=1, **kw) -> LocalCluster:
    return LocalCluster(run_dir, list(scheduler_args), num_servers, list(workers), **kw).start()


def finish(cluster: LocalCluster, expect_ok: bool = True) -> Run:
    code = cluster.wait(JOB_TIMEOUT_S)
    run = Run(cluster, code)
    if expect_ok:
        codes = cluster.exit_codes()
        assert code == 0 and all(c == 0 for c in codes.values()), f"exit codes {codes}\n{run.logs()}"
    return run

