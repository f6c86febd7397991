"""The scheduler's driver (scheduler/service.py) carrying out its core's instructions on a
router without peers: what it cannot deliver is named by role, rank and host."""

import time

from omnips.job import JobSpec
from omnips.protocol import Failed, Register
from omnips.scheduler.instructions import AskEval, ConnectServers
from omnips.scheduler.service import Scheduler, SchedulerOptions


def test_a_dropped_message_names_its_peer_by_role_rank_and_host(tmp_path, caplog):
    job = JobSpec(num_servers=1, num_workers=2, global_batch=60, batching="uniform")
    job.check()
    s = Scheduler(job, SchedulerOptions(run_dir=str(tmp_path / "run")), announce=lambda *a: None)
    try:
        def handle(peer, msg):  # no server runs: the scheduler's pulls have nobody to go to
            s.execute([i for i in s.core.handle(peer, msg, time.monotonic())
                       if not isinstance(i, (ConnectServers, AskEval))])

        handle(b"S", Register(role="server", host="h", endpoint="tcp://127.0.0.1:1"))
        for r in range(2):
            handle(b"W%d" % r, Register(role="worker", host="h", rank=r))
        caplog.clear()
        s.execute(s.core.tick(time.monotonic()))  # nobody is connected: every heartbeat is dropped
        dropped = sorted(r.getMessage() for r in caplog.records if r.getMessage().startswith("dropped heartbeat"))
        assert dropped == [f"dropped heartbeat to {who} on h (pid 0): Host unreachable"
                           for who in ("server 0", "worker 0", "worker 1")], dropped
        handle(b"W1", Failed(reason="it broke"))  # and one it no longer counts as a member
        assert "dropped shutdown to worker 1 on h (pid 0): Host unreachable" in caplog.text
    finally:
        s.router.close(0)
        s.ctx.term()
