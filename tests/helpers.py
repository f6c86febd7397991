"""Helpers for end-to-end tests (real processes over ZeroMQ on loopback) and for checkpoint files."""

import json
import os
import signal
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import zmq

from omnips import checkpoint, codec, data, models, transport
from omnips.checkpoint import FileInfo
from omnips.job import JobSpec
from omnips.launch import LocalCluster
from omnips.link import SchedulerLink
from omnips.metrics import read_events
from omnips.protocol import Heartbeat

# Every wait for what other processes do (here, and each test's waits for a process to end) is a
# bound, never a measure of speed: on a loaded host (CI, a busy laptop) OMNIPS_TEST_WAIT_FACTOR
# stretches them all (scripts/test.sh sets 2). A failing test then takes that much longer to say so.
WAIT_FACTOR = float(os.environ.get("OMNIPS_TEST_WAIT_FACTOR", "1"))
JOB_TIMEOUT_S = 150 * WAIT_FACTOR


@contextmanager
def stopped(proc):
    """proc frozen by SIGSTOP (a process that is slow, not dead: a GC, a stalled VM), and
    woken on the way out whatever happens, so that no stopped process outlives the test."""
    proc.send_signal(signal.SIGSTOP)
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGCONT)  # a no-op once it has been reaped


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
    held = open_under(cluster.run_dir)
    assert not held, f"a finished job's files still open here: {held}"  # its disk could not be unmounted
    if expect_ok:
        codes = cluster.exit_codes()
        assert code == 0 and all(c == 0 for c in codes.values()), f"exit codes {codes}\n{run.logs()}"
    return run


def open_under(directory) -> list[str]:
    """The files under `directory` that this process holds open."""
    inside, held = str(Path(directory).resolve()) + os.sep, []
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile (the listing's own descriptor, too)
            continue
        if target.startswith(inside):
            held.append(target)
    return held


def poll_until(found, timeout_s: float, missing: str):
    """found(), once it is not None: what files other processes write say (polled, since
    nothing signals their writes; bounded by the deadline, timeout_s * WAIT_FACTOR).
    AssertionError with `missing`."""
    timeout_s *= WAIT_FACTOR
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = found()
        if got is not None:
            return got
        time.sleep(0.1)
    raise AssertionError(f"{missing} within {timeout_s:g} s")


def in_log(path, text: str, timeout_s: float = 60.0) -> None:
    """Return once the log file at `path` holds `text`."""
    poll_until(lambda: path.exists() and text in path.read_text(errors="replace") or None, timeout_s,
               f"{text!r} not in {path}")


def _poll_events(run_dir, found, timeout_s: float, missing: str):
    """found(events) of a running job's metrics.jsonl, once it is not None."""
    path = Path(run_dir) / "metrics.jsonl"
    return poll_until(lambda: found(read_events(run_dir)) if path.exists() else None, timeout_s,
                      f"{missing} in {run_dir}")


def wait_for_event(run_dir, match, timeout_s: float = 60.0) -> dict:
    """The first event of a running job's metrics.jsonl for which match(event) holds."""
    return _poll_events(run_dir, lambda events: next((e for e in events if match(e)), None), timeout_s,
                        "no matching event")


def wait_for_steps(run_dir, n, timeout_s: float = 60.0) -> None:
    """Return once a running job's metrics.jsonl holds n step events."""
    _poll_events(run_dir, lambda events: sum(e["event"] == "step" for e in events) >= n or None, timeout_s,
                 f"fewer than {n} steps")


def server_endpoint(run_dir, timeout_s: float = 60.0) -> str:
    """Server 0's address, once it has registered with the scheduler."""
    joined = wait_for_event(run_dir, lambda e: e["event"] == "membership" and e["role"] == "server", timeout_s)
    return joined["endpoint"]


def single_process_model(steps: int, global_batch: int, lr: float, momentum: float = 0.9,
                         weight_decay: float = 0.0, seed: int = 0, optimizer: str = "sgd") -> dict:
    """The state_dict that torch's SGD (or Adam, its default betas and eps) in one process
    reaches on the global batches of a BSP job (mlp on digits): what any BSP run of that job
    must end with."""
    train, _ = data.load("digits", {})
    model = models.build("mlp", {}, train, seed=seed)
    if optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    stream, batcher = data.SampleStream(len(train), seed=seed), data.Batcher(train)
    for t in range(steps):
        x, y = batcher(stream.take(t * global_batch, global_batch))
        opt.zero_grad()
        models.loss_fn(model(x), y).backward()
        opt.step()
    return model.state_dict()


def assert_trained_as_one_process(run_dir, steps: int, global_batch: int, lr: float, **settings) -> dict:
    """The run's model.pt is, within 1e-5, single_process_model(steps, global_batch, lr, **settings):
    every step learned once, none lost. Returns that one-process state_dict."""
    want = single_process_model(steps, global_batch, lr, **settings)
    got = torch.load(Path(run_dir) / "model.pt")
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-5)
    return want


def error_lines(log: str) -> list[str]:
    """What a process logged at ERROR level, each line from the message on."""
    return [line.split(" ERROR ", 1)[1] for line in log.splitlines() if " ERROR " in line]


# -- checkpoint files, written without processes ---------------------------------------


def written(tmp, meta=None, arrs=None, name="shard-0.ckpt") -> tuple[Path, FileInfo]:
    """A shard file under tmp/step-5 (ten float32 values and rank 0 unless told): its path and FileInfo."""
    path = Path(tmp) / "step-5" / name
    arrs = {"values": np.arange(10, dtype=np.float32)} if arrs is None else arrs
    return path, checkpoint.write_shard(path, {"rank": 0} if meta is None else meta, arrs)


CHECKPOINT_JOB = JobSpec(num_workers=2, num_servers=2)


def make_checkpoint(root, step, complete=True, servers=2):
    """Checkpoint `step` under root: a shard file per server and, if complete, a manifest for CHECKPOINT_JOB."""
    directory = checkpoint.step_dir(root, step)
    shards = []
    for s in range(servers):
        info = checkpoint.write_shard(directory / checkpoint.shard_name(s), {"rank": s},
                                      {"values": np.full(4, step + s, np.float32)})
        shards.append({"range": [4 * s, 4 * s + 4], "version": step, "size": info.size, "sha256": info.sha256})
    if complete:
        checkpoint.write_manifest(directory, step, CHECKPOINT_JOB.to_dict(), shards, [step, step],
                                  [64 * step, 64 * step])
    return directory


@contextmanager
def stand_in(**link_kw):
    """(link, send, clock, recv): a link made with `link_kw`, heartbeats every 0.2 s, connected
    to a stand-in scheduler; send(msg) sends it a message from there, recv() reads the next
    one it sent (10 s at most); clock[0] is its time."""
    ctx = zmq.Context()
    try:
        router = transport.socket(ctx, zmq.ROUTER)
        endpoint = transport.bind(router, "127.0.0.1", 0)
        clock = [0.0]
        link = SchedulerLink(ctx, endpoint, clock=lambda: clock[0], **link_kw)
        link.heartbeat_s = 0.2
        link.send(Heartbeat())  # the stand-in learns whom to answer
        assert router.poll(10_000), "the link did not connect"
        peer = transport.recv_frames(router)[0].bytes

        def recv():
            assert router.poll(10_000), "nothing came from the link"
            return codec.decode(transport.recv_frames(router)[1:])

        try:
            yield link, lambda msg: transport.send(router, msg, to=peer), clock, recv
        finally:
            link.close()  # (a test may have started its thread)
    finally:
        ctx.destroy(linger=0)
