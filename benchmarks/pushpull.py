#!/usr/bin/env python
"""Fused push-pull round trip through omnips vs raw ZeroMQ, raw sockets and gloo, same bytes.

One invocation measures, for one float32 vector of --params values (default 11 M, 44 MB):

* raw ZeroMQ: this process (DEALER) sends a small header + the vector zero-copy to a
  child process (ROUTER, bound on tcp loopback and on a unix socket) that answers with
  a vector of the same size from a preallocated buffer, zero-copy. Communication
  only: the floor omnips is compared against, per transport.
* omnips: a real scheduler and 1 or 2 servers (ASP, and BSP with 1 server), started
  as processes; this process registers as the only worker, initialises and pulls the
  shards, then times `ServerGroup.push_pull` (push every shard's gradient, receive
  every updated shard into the flat parameter buffer), as worker/service.py does.
  Each configuration over tcp and over ipc (the servers' unix sockets, which workers
  on their host take by default), raw ZeroMQ round trips of the same transport
  interleaved (alternating order) while the cluster is up, so each ratio compares
  figures taken in the same seconds on this noisy machine.
* omnips with CURVE: each tcp configuration again, right after it, with every process
  on --keys (encrypted and authenticated connections), for the on/off ratio.
* raw sockets: a Python socket echo of the page-aligned vector (sendall, recv_into a
  preallocated page-aligned buffer, the same bytes back) over tcp loopback and over a
  unix socket, interleaved with raw ZeroMQ round trips of the same transport.
* gloo: torch.distributed all_reduce of the same float32 vector between 2 processes
  (1 torch thread each, 127.0.0.1, ephemeral ports), warm-ups, then the median of
  the timed all_reduces on rank 0.

Afterwards the pieces of an omnips round trip are timed in-process (worker copy of the
reply, server finiteness check, optimizer step, ShardCore.handle) to show where the
time over raw goes.

Every process runs with the glibc settings of transport.MALLOC_ENV (docs/performance.md,
point 1): children through their environment, this process through tune_malloc().

    python benchmarks/pushpull.py [--params 11000000] [--repeats 20]

Prints the tables and writes them to benchmarks/results/pushpull.md.
"""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # omnips, run from a clone without installing
sys.path.insert(0, str(HERE))  # benchmarks/report.py

from omnips import transport  # noqa: E402

transport.tune_malloc()  # before the first large allocation (and before torch starts threads)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import selectors  # noqa: E402
import shutil  # noqa: E402
import socket as pysocket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import msgpack  # noqa: E402
import numpy as np  # noqa: E402
import zmq  # noqa: E402

FEATURES = 1089  # synthetic inputs; mlp with one hidden layer of H: H * (FEATURES + 11) + 10 values
TARGET_RATIO = 1.15
REPLY_TIMEOUT_S = 30.0


# -- raw ZeroMQ peer ---------------------------------------------------------------
TRANSPORTS = ("tcp", "ipc")


def raw_child(n: int, host: str) -> int:
    """The raw baseline's server: answer every [header, data] with a preallocated vector,
    on tcp and on a unix socket."""
    from omnips.flat import aligned_zeros

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.bind(f"tcp://{host}:*")
    tcp = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    ipc, ipc_dir = transport.bind_ipc(sock)
    reply = aligned_zeros(n)
    reply.fill(0.5)
    header = msgpack.packb({"op": "echo", "len": n})
    print(f"raw peer listening on {tcp} {ipc}", flush=True)
    try:
        while sock.poll(300_000):  # parent gone for 5 minutes: give up
            ident, head, data = sock.recv_multipart(copy=False)
            if head.bytes == b"stop":
                return 0
            if data.buffer.nbytes != 4 * n:
                print(f"raw peer: got {data.buffer.nbytes} bytes, expected {4 * n}", file=sys.stderr)
                return 1
            sock.send(ident, zmq.SNDMORE)
            sock.send(header, zmq.SNDMORE)
            sock.send(memoryview(reply), copy=False)
        return 1
    finally:
        ctx.destroy(linger=0)
        shutil.rmtree(ipc_dir, ignore_errors=True)


def _read_line(proc: subprocess.Popen, pattern: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                break
            line = proc.stdout.readline().decode(errors="replace")
            if not line:
                break
            if pattern in line:
                return line.split(pattern, 1)[1].strip()
    raise RuntimeError(f"child {proc.args} did not print {pattern!r} within {timeout_s:g} s")


def _child(args: list[str], env: dict | None = None) -> subprocess.Popen:
    """This script again as a helper process, with MALLOC_ENV."""
    env = {**os.environ, **transport.MALLOC_ENV, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *args],
                            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)


class RawPeer:
    """This process's end of the raw baseline: a DEALER per transport, zero-copy both ways."""

    def __init__(self, n: int, host: str):
        from omnips.flat import aligned_zeros

        self.proc = _child(["--raw-child", "--params", str(n), "--host", host])
        self.n = n
        self.ctx = zmq.Context()
        self.buf = aligned_zeros(n)
        self.buf.fill(1e-4)
        self.header = msgpack.packb({"op": "echo", "len": n})
        self.socks = {}
        try:
            endpoints = _read_line(self.proc, "raw peer listening on ", 60.0).split()
            for kind, endpoint in zip(TRANSPORTS, endpoints):
                self.socks[kind] = self.ctx.socket(zmq.DEALER)
                self.socks[kind].setsockopt(zmq.LINGER, 0)
                self.socks[kind].connect(endpoint)
        except BaseException:
            self.close()
            raise

    def round_trip(self, kind: str) -> float:
        sock = self.socks[kind]
        start = time.perf_counter()
        sock.send(self.header, zmq.SNDMORE)
        sock.send(memoryview(self.buf), copy=False)
        if not sock.poll(int(REPLY_TIMEOUT_S * 1000)):
            raise RuntimeError("the raw peer did not answer")
        frames = sock.recv_multipart(copy=False)
        elapsed = time.perf_counter() - start
        if len(frames) != 2 or frames[1].buffer.nbytes != 4 * self.n:
            raise RuntimeError("the raw peer sent a malformed reply")
        return elapsed

    def close(self) -> None:
        if self.proc.poll() is None and self.socks:
            try:
                self.socks["tcp"].send_multipart([b"stop", b""])
            except zmq.ZMQError:
                pass
        self.ctx.destroy(linger=0)
        _reap(self.proc, 5.0)
        self.proc.stdout.close()


# -- raw socket echo ---------------------------------------------------------------
def _recv_exact(conn: pysocket.socket, view: memoryview) -> bool:
    """Fill `view` from `conn`; False on a clean end before the first byte."""
    got = 0
    while got < len(view):
        k = conn.recv_into(view[got:])
        if not k:
            if got:
                raise RuntimeError(f"connection closed after {got} of {len(view)} bytes")
            return False
        got += k
    return True


def socket_child(n: int, kind: str) -> int:
    """The raw socket baseline's server: echo every 4n bytes from a preallocated buffer."""
    from omnips.flat import aligned_zeros

    buf = memoryview(aligned_zeros(n)).cast("B")
    directory = tempfile.mkdtemp(prefix="omnips-echo-")
    try:
        if kind == "tcp":
            listener = pysocket.create_server(("127.0.0.1", 0))
            address = "%s:%d" % listener.getsockname()
        else:
            address = os.path.join(directory, "sock")
            listener = pysocket.socket(pysocket.AF_UNIX)
            listener.bind(address)
            listener.listen(1)
        listener.settimeout(60)
        print(f"socket peer listening on {address}", flush=True)
        conn, _ = listener.accept()
        conn.settimeout(300)
        while _recv_exact(conn, buf):
            conn.sendall(buf)
        return 0
    finally:
        shutil.rmtree(directory, ignore_errors=True)


class SocketPeer:
    """This process's end of the raw socket baseline (sendall, recv_into), tcp or unix."""

    def __init__(self, n: int, kind: str, send: np.ndarray):
        from omnips.flat import aligned_zeros

        self.proc = _child(["--socket-child", kind, "--params", str(n)])
        self.send, self.recv = memoryview(send).cast("B"), memoryview(aligned_zeros(n)).cast("B")
        self.sock = None
        try:
            address = _read_line(self.proc, "socket peer listening on ", 60.0)
            if kind == "tcp":
                host, port = address.rsplit(":", 1)
                self.sock = pysocket.create_connection((host, int(port)), timeout=REPLY_TIMEOUT_S)
            else:
                self.sock = pysocket.socket(pysocket.AF_UNIX)
                self.sock.settimeout(REPLY_TIMEOUT_S)
                self.sock.connect(address)
        except BaseException:
            self.close()
            raise

    def round_trip(self) -> float:
        start = time.perf_counter()
        self.sock.sendall(self.send)
        if not _recv_exact(self.sock, self.recv):
            raise RuntimeError("the socket peer closed the connection")
        return time.perf_counter() - start

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()  # the child's recv sees the end and exits
        _reap(self.proc, 5.0)
        self.proc.stdout.close()


def floors(n: int, raw: RawPeer, warmup: int, repeats: int) -> list[dict]:
    """Raw socket echoes, each transport's interleaved with raw ZeroMQ round trips."""
    rows = []
    for kind in TRANSPORTS:
        peer = SocketPeer(n, kind, raw.buf)
        try:
            sock_t, zmq_t = [], []
            for i in range(warmup + repeats):
                if i % 2:
                    s_dt, z_dt = peer.round_trip(), raw.round_trip(kind)
                else:
                    z_dt = raw.round_trip(kind)
                    s_dt = peer.round_trip()
                if i >= warmup:
                    sock_t.append(s_dt)
                    zmq_t.append(z_dt)
        finally:
            peer.close()
        rows.append({"name": f"raw socket echo, {'tcp loopback' if kind == 'tcp' else 'unix socket'}",
                     "kind": kind, "times": sock_t, "zmq": zmq_t})
    return rows


# -- gloo all_reduce ---------------------------------------------------------------
GLOO_WAIT = datetime.timedelta(seconds=60)  # every store and collective wait is bounded by this


def gloo_child(rank: int, port: int, n: int, rounds: int) -> int:
    """One of 2 gloo ranks: all_reduce the vector `rounds` times, each when the parent
    says go (it times raw ZeroMQ round trips in between) and after a barrier, so both
    ranks start together; rank 0 hands each time back through the store."""
    import torch
    import torch.distributed as dist

    from omnips.flat import aligned_zeros

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=GLOO_WAIT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=GLOO_WAIT)
    vec = torch.from_numpy(aligned_zeros(n))  # page-aligned, as omnips' buffers
    for i in range(rounds):
        vec.fill_(1e-4)
        store.wait([f"go{i}"])
        dist.barrier()
        t = time.perf_counter()
        dist.all_reduce(vec)
        if rank == 0:
            store.set(f"done{i}", repr(time.perf_counter() - t))
    ok = torch.allclose(vec[:1000], torch.full((1000,), 2e-4))
    dist.destroy_process_group()
    if not ok:
        print("gloo: wrong all_reduce result", file=sys.stderr)
    return 0 if ok else 1


def gloo(n: int, raw: RawPeer, warmup: int, repeats: int) -> dict:
    """Two gloo ranks as child processes around a TCPStore this process hosts; raw ZeroMQ
    round trips of both transports alternate with the all_reduces (same window)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=GLOO_WAIT)
    env = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}  # loopback, as every other figure here
    procs = [_child(["--gloo-rank", str(r), "--gloo-port", str(store.port), "--params", str(n),
                     "--repeats", str(warmup + repeats)], env) for r in range(2)]
    out = {"times": [], **{kind: [] for kind in TRANSPORTS}}
    try:
        for i in range(warmup + repeats):
            raws = {}
            if i % 2:
                raws = {kind: raw.round_trip(kind) for kind in TRANSPORTS}
            store.set(f"go{i}", "1")
            t = float(store.get(f"done{i}"))  # bounded by GLOO_WAIT
            if i % 2 == 0:
                raws = {kind: raw.round_trip(kind) for kind in TRANSPORTS}
            if i >= warmup:
                out["times"].append(t)
                for kind in TRANSPORTS:
                    out[kind].append(raws[kind])
    finally:
        for proc in procs:
            _reap(proc, 30.0)
            proc.stdout.close()
    if any(proc.returncode != 0 for proc in procs):
        raise RuntimeError(f"gloo ranks exited with {[proc.returncode for proc in procs]}")
    return out


def _reap(proc: subprocess.Popen, grace_s: float) -> None:
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


# -- CPU accounting ----------------------------------------------------------------
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids) -> np.ndarray:
    """User + system CPU seconds these processes have used so far (Linux /proc):
    [ZeroMQ's I/O threads, every other thread]. The total is the process's own count, which
    keeps the time of threads that have ended; the I/O threads live as long as the process."""
    split = np.zeros(2)
    for pid in pids:
        total = _ticks(f"/proc/{pid}/stat")
        io = 0
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                if _name(f"/proc/{pid}/task/{tid}/comm").startswith("ZMQbg/IO"):
                    io += _ticks(f"/proc/{pid}/task/{tid}/stat")
            except FileNotFoundError:  # a thread that ended meanwhile (not an I/O thread)
                continue
        split += io, total - io
    return split / CLOCK_TICKS


def _name(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def _ticks(path: str) -> int:
    """utime + stime from a /proc stat file."""
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()  # the name may hold spaces; state is field 3
    return int(fields[11]) + int(fields[12])  # fields 14 and 15


def cpu_per_call(fn, calls: int, pids) -> tuple[np.ndarray, float]:
    """(CPU seconds of `pids` together, [ZeroMQ I/O threads, others], and wall seconds) per
    call of `fn()`, over `calls` calls."""
    cpu, start = cpu_seconds(pids), time.perf_counter()
    for _ in range(calls):
        fn()
    return (cpu_seconds(pids) - cpu) / calls, (time.perf_counter() - start) / calls


# -- omnips cluster with this process as worker 0 ---------------------------------
def cluster_steps(warmup: int, repeats: int) -> int:
    """The steps a configuration's cluster runs: the warm-ups, the timed round trips, as many for
    the CPU accounting, then one more: BSP's last step is the one the scheduler evaluates at (a
    snapshot and a test pass: not a round trip's work)."""
    return warmup + 2 * repeats + 1


def job_args(n_target: int, steps: int) -> tuple[dict, dict]:
    hidden = max(1, round((n_target - 10) / (FEATURES + 11)))
    # enough samples that the 1-sample reports of the run never cross an ASP epoch
    # (an epoch would make the scheduler pull every shard for an evaluation mid-run)
    n = max(512, 2 * steps + 64)
    return {"hidden": [hidden]}, {"n": n, "features": FEATURES}


def scheduler_args(mode: str, model_args: dict, dataset_args: dict, max_steps: int, host: str) -> list[str]:
    """The scheduler's flags for a job of job_args' model, a global batch of 1 sample."""
    return ["--mode", mode, "--model", "mlp", "--model-args", json.dumps(model_args),
            "--dataset", "synthetic", "--dataset-args", json.dumps(dataset_args),
            "--global-batch", "1", "--max-steps", str(max_steps), "--host", host]


def model_size(model_args: dict, dataset_args: dict) -> int:
    from omnips import data, models
    from omnips.flat import FlatModel

    train, _ = data.load("synthetic", dataset_args)
    return FlatModel(models.build("mlp", model_args, train, 0)).size


def exchange(group, step: int, grads: np.ndarray, params: np.ndarray, part_values: int):
    """One round trip as a worker makes it: with `part_values`, the gradient leaves in
    buckets of that many values, the last ones first, and the reply comes back in parts
    of the same size (worker/pushing.py, without the backward pass it overlaps); with 0,
    one push per shard."""
    from omnips.protocol import Push

    if not part_values:
        return group.push_pull(0, step, grads, 1, 0, params)
    head = Push(rank=0, step=step, version=0, batch=1, gen=0, data=grads, reply_part=part_values)
    for s in reversed(range(len(group.ranges))):
        lo, hi = group.ranges[s]
        for top in range(hi, lo, -part_values):
            group.push(s, max(lo, top - part_values), top, head)
    return group.collect(step, params)


def run_cluster(mode: str, num_servers: int, kind: str, model_args: dict, dataset_args: dict, warmup: int,
                repeats: int, params: np.ndarray, grads: np.ndarray, raw: RawPeer, run_root: Path, host: str,
                server_threads: int, key_dir: Path | None, part_values: int) -> dict:
    """One configuration, this process reaching the servers over `kind` (tcp or ipc); with
    `key_dir` every process (this one too) uses CURVE."""
    from solo import SoloWorker

    from omnips.worker.buckets import floored

    steps = cluster_steps(warmup, repeats)
    name = f"{mode}-{num_servers}s-{kind}" + ("-curve" if key_dir else "")
    run_dir = run_root / name
    # ASP: a sample budget far beyond the run, so the scheduler never asks to stop.
    # BSP: exactly `steps` steps of global batch 1; the final evaluation is at version `steps`.
    max_steps = steps if mode == "bsp" else 10 ** 9
    ctx = zmq.Context()
    job = SoloWorker(ctx, run_dir, scheduler_args(mode, model_args, dataset_args, max_steps, host),
        num_servers, ["--host", host, "--threads", str(server_threads)], keys=key_dir,
        transport="auto" if kind == "ipc" else "tcp")
    plain = f"omnips {mode.upper()}, {num_servers} server{'s' if num_servers > 1 else ''}, {kind}"
    result = {"config": plain + (", CURVE" if key_dir else ""), "plain": plain, "kind": kind,
              "curve": key_dir is not None}
    try:
        group = job.start(params.size)
        if not all(e.startswith(f"{kind}://") for e in group.endpoints):
            raise RuntimeError(f"asked for {kind}, the servers are reached at {group.endpoints}")

        copy_s = [0.0]  # time copying replies into `params`: ServerGroup._take, for whole replies and parts
        take = group._take

        def timed_take(*args):
            t = time.perf_counter()
            take(*args)
            copy_s[0] += time.perf_counter() - t

        group._take = timed_take

        group.init(params)
        group.pull(params)
        part_values = floored(part_values, group.ranges)  # as a worker's plan: no shard in too many parts
        omni, raw_t, copies = [], [], []
        for step in range(warmup + repeats):
            if step % 2:
                raw_dt = raw.round_trip(kind)
            copy_s[0] = 0.0
            t = time.perf_counter()
            ex = exchange(group, step, grads, params, part_values)
            dt = time.perf_counter() - t
            if step % 2 == 0:
                raw_dt = raw.round_trip(kind)
            job.report(ex)
            if step >= warmup:
                omni.append(dt)
                raw_t.append(raw_dt)
                copies.append(copy_s[0])
        # not interleaved: each side's processes alone, all of them (the scheduler too)
        next_step = iter(range(warmup + repeats, steps))
        result["cpu"] = cpu_per_call(lambda: job.report(exchange(group, next(next_step), grads, params, part_values)),
                                     repeats, [os.getpid(), *(proc.pid for proc in job.cluster.procs.values())])
        result["raw_cpu"] = cpu_per_call(lambda: raw.round_trip(kind), repeats, [os.getpid(), raw.proc.pid])
        job.report(exchange(group, next(next_step), grads, params, part_values))
        if not np.isfinite(params[:1000]).all():
            raise RuntimeError("parameters went non-finite")
        job.finish()
        result.update(omni=omni, raw=raw_t, copy=copies)
        return result
    except BaseException:
        print(f"{name} failed; logs in {run_dir / 'logs'}", file=sys.stderr)
        for proc_name in job.cluster.procs:
            print(f"  {proc_name}: {job.cluster.tail(proc_name)}", file=sys.stderr)
        raise
    finally:
        job.stop()
        ctx.destroy(linger=0)


# -- in-process pieces of one round trip ------------------------------------------
def median_time(fn, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` calls."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def pieces(params: np.ndarray, grads: np.ndarray, repeats: int, server_threads: int) -> dict:
    """Median seconds of what a round trip does besides moving bytes; server pieces run
    with the servers' torch thread count."""
    import torch

    from omnips import codec
    from omnips.flat import aligned_zeros
    from omnips.job import JobSpec
    from omnips.protocol import Init, Push
    from omnips.flat import all_finite
    from omnips.server.shard import ShardCore

    n = params.size
    out = {}
    dst = aligned_zeros(n)
    out["worker: np.copyto of the reply into params"] = median_time(lambda: np.copyto(dst, params), repeats)
    out["server: finiteness check (np.dot)"] = median_time(lambda: all_finite(grads), repeats)
    out["protocol: encode + decode of a Push"] = median_time(
        lambda: codec.decode(codec.encode(Push(rank=0, step=0, version=0, batch=1, gen=0, data=grads))), repeats)

    threads = torch.get_num_threads()
    torch.set_num_threads(server_threads)
    other = 2 if server_threads == 1 else 1
    for mode in ("asp", "bsp"):
        job = JobSpec(mode=mode, num_workers=1, global_batch=1, dataset="synthetic", max_steps=1)
        core = ShardCore(job, 0, n, n)
        core.handle(b"w", Init(rank=0, data=params), 0.0)
        step = [0]

        def push():
            core.handle(b"w", Push(rank=0, step=step[0], version=core.version, batch=1, gen=0, data=grads), 0.0)
            step[0] += 1

        push()  # starts the momentum buffer
        out[f"server: ShardCore.handle(Push), {mode.upper()} (check + update)"] = median_time(push, repeats)
        if mode == "asp":
            def step():
                core.store.take([(1.0, [(0, grads)])], core.version, job.lr)
                core.ready(n)

            out[f"server: optimizer step alone (ShardValues.take and ready, {job.optimizer} momentum "
                f"{job.momentum}, {server_threads} torch thread(s) as the servers)"] = median_time(step, repeats)
            torch.set_num_threads(other)
            out[f"what-if: the same step with {other} torch thread(s)"] = median_time(step, repeats)
            torch.set_num_threads(server_threads)
    # the floor of any update: one in-place pass reading g and read-writing p
    p, g = torch.from_numpy(dst), torch.from_numpy(grads)
    out["reference: in-place p.add_(g, alpha=-lr) (SGD without momentum)"] = median_time(
        lambda: p.add_(g, alpha=-1e-3), repeats)
    torch.set_num_threads(threads)
    return out


# -- report ------------------------------------------------------------------------
def ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


def summarize(results: list[dict], gl: dict) -> list[dict]:
    gloo_med = statistics.median(gl["times"])
    rows = []
    for r in results:
        om, raw = statistics.median(r["omni"]), statistics.median(r["raw"])
        rows.append({
            "config": r["config"], "plain": r["plain"], "kind": r["kind"], "curve": r["curve"], "median": om,
            "p10": float(np.percentile(r["omni"], 10)), "p90": float(np.percentile(r["omni"], 90)), "raw": raw,
            "ratio": om / raw, "copy": statistics.median(r["copy"]),
            # per-pair ratio: each omnips round trip over the raw one taken next to it
            "pair_ratio": statistics.median(o / w for o, w in zip(r["omni"], r["raw"])),
            # fastest over fastest: the least disturbed by other load on the machine
            "min_ratio": min(r["omni"]) / min(r["raw"]),
            "gloo_ratio": om / gloo_med,
            # each over the raw ZeroMQ round trips of its own window: cancels load drift between the two
            "gloo_adjusted": (om / raw) / (gloo_med / statistics.median(gl[r["kind"]])),
            "cpu": r["cpu"], "raw_cpu": r["raw_cpu"],
        })
    return rows


def cpu_section(rows: list[dict]) -> list[str]:
    """CPU time per round trip, omnips against raw ZeroMQ: on a machine whose cores the raw
    round trip already keeps busy, omnips's extra work adds to the wall time instead of
    overlapping the transfer."""
    cores = os.cpu_count()
    lines = ["", "## CPU per round trip (every process of each side, every thread)", "",
             "| configuration | omnips CPU ms | its ZeroMQ I/O threads | its other threads | omnips cores busy "
             "| raw ZeroMQ CPU ms | its ZeroMQ I/O threads | raw cores busy | omnips CPU over raw's, ms "
             f"| omnips CPU / {cores} cores, over raw's wall |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        (split, wall), (raw_split, raw_wall) = r["cpu"], r["raw_cpu"]
        cpu, raw_cpu = split.sum(), raw_split.sum()
        lines.append(f"| {r['config']} | {ms(cpu)} | {ms(split[0])} | {ms(split[1])} | {cpu / wall:.2f} "
                     f"| {ms(raw_cpu)} | {ms(raw_split[0])} | {raw_cpu / raw_wall:.2f} "
                     f"| {ms(cpu - raw_cpu)} | {cpu / cores / raw_wall:.2f}x |")
    lines += ["", "Each configuration measured over as many round trips as it timed, right after them, first "
              "omnips's (this process, the scheduler and the servers: utime + stime from /proc) and then raw "
              "ZeroMQ's (this process and its peer), not interleaved. ZeroMQ's I/O threads move the bytes "
              "(the raw round trip's whole work); the other threads are the processes' own: omnips's main "
              "threads check, update and copy. Cores busy: CPU "
              "time over wall time. The last column is a floor: a round trip can not take less wall time than "
              f"its CPU time spread over all {cores} cores, so it is the least omnips / raw ratio this much work "
              "allows on this machine, however well it overlaps the transfer."]
    return lines


def curve_section(rows: list[dict], nbytes: int) -> list[str]:
    """CURVE on vs off for each configuration measured both ways (each run right after the other)."""
    plain = {r["config"]: r for r in rows if not r["curve"]}
    pairs = [(plain[r["plain"]], r) for r in rows if r["curve"] and r["plain"] in plain]
    if not pairs:
        return []
    lines = ["", "## CURVE on vs off (every process on --keys: encrypted, authenticated connections)", "",
             "| configuration | off ms | on ms | on / off | on / off, each over its raw | off GB/s | on GB/s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for off, on in pairs:
        lines.append(f"| {off['config']} | {ms(off['median'])} | {ms(on['median'])} "
                     f"| {on['median'] / off['median']:.2f}x | {on['ratio'] / off['ratio']:.2f}x "
                     f"| {2 * nbytes / off['median'] / 1e9:.2f} | {2 * nbytes / on['median'] / 1e9:.2f} |")
    lines += ["", "GB/s: bytes pushed plus bytes pulled per second of round trip. The second ratio divides each "
              "configuration by the raw round trips interleaved with it, cancelling drift between the two runs."]
    return lines


def _spread(times: list[float]) -> str:
    return f"{ms(statistics.median(times))} | {ms(np.percentile(times, 10))} | {ms(np.percentile(times, 90))}"


def _faster(*ratios: float) -> str:
    return "yes" if all(x < 1 for x in ratios) else "no" if all(x >= 1 for x in ratios) else "within noise"


def render(rows, raw_by_kind, floor_rows, gl, piece_times, args, n, total_s) -> list[str]:
    from report import machine_lines

    from omnips.protocol import MAX_PARTS

    nbytes = 4 * n
    gloo_t = gl["times"]
    gloo_med = statistics.median(gloo_t)
    lines = [
        "# omnips fused push-pull vs raw ZeroMQ, raw sockets and gloo all_reduce",
        "",
        *machine_lines(),
        f"- pyzmq {zmq.__version__} / libzmq {zmq.zmq_version()}, numpy {np.__version__}, "
        f"torch {__import__('torch').__version__}",
        f"- vector: {n:,} float32 = {nbytes:,} bytes ({nbytes / 2**20:.1f} MiB) each way; {args.repeats} timed "
        f"round trips after {args.warmup} warm-ups per configuration ({args.curve_repeats} with CURVE); loopback",
        "- raw ZeroMQ: DEALER -> ROUTER in a child process, header + zero-copy vector frame each way, preallocated "
        "page-aligned buffers, MALLOC_ENV in both processes; no computation; tcp and ipc (unix socket)",
        "- omnips: real scheduler + server processes, this process as the only worker "
        + (f"(pushes in buckets of {args.bucket_size:,} bytes (more where a shard would be in more than "
           f"{MAX_PARTS} parts, as a worker's plan raises them), last values first, and the reply in parts of the same "
           "size, as a worker sends while backward runs; server checks each part as it comes, joins them, takes the "
           "SGD-momentum step range by range, sending each reply part once its range is updated; each reply part "
           "copied into params as it arrives), " if args.bucket_size else
           "(ServerGroup.push_pull: push gradients, server checks + SGD-momentum step, reply copied into params), ")
        + f"servers with --threads {args.server_threads}; raw ZeroMQ round trips of the same transport interleaved "
        "with omnips ones while each cluster runs",
        *(["- CURVE: each tcp configuration again right after it, every process (this one too) on --keys"]
          if any(r["curve"] for r in rows) else []),
        "- raw socket: Python socket echo (sendall, recv_into a preallocated page-aligned buffer, the same bytes "
        "back), interleaved with raw ZeroMQ round trips of the same transport",
        "- gloo: torch.distributed all_reduce of the same float32 vector, 2 processes, 1 torch thread each, "
        "127.0.0.1 (GLOO_SOCKET_IFNAME=lo), a barrier before each; rank 0's times; raw ZeroMQ round trips "
        "(tcp, ipc) alternate with the all_reduces",
        f"- targets: omnips / raw ZeroMQ <= {TARGET_RATIO} (median ratio, tcp and ipc apart; plain, not CURVE), "
        "and omnips faster than gloo all_reduce of the same bytes (judged on the medians as measured and on "
        "each over the raw ZeroMQ round trips of its own window; \"within noise\" when the two disagree)",
        f"- load average at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}; the 2 cores are shared with "
        "other users' processes, which inflate omnips (which computes) more than the raw baselines",
        "",
        "## Baselines (communication only)",
        "",
        "| baseline | median ms | p10 ms | p90 ms | GB/s both ways | raw ZeroMQ alongside, median ms |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for kind in TRANSPORTS:
        t = raw_by_kind[kind]
        lines.append(f"| raw ZeroMQ request-reply, {kind} (every omnips window) | {_spread(t)} "
                     f"| {2 * nbytes / statistics.median(t) / 1e9:.2f} | |")
    for f in floor_rows:
        lines.append(f"| {f['name']} | {_spread(f['times'])} | {2 * nbytes / statistics.median(f['times']) / 1e9:.2f} "
                     f"| {ms(statistics.median(f['zmq']))} |")
    lines.append(f"| gloo all_reduce, 2 ranks | {_spread(gloo_t)} | {2 * nbytes / gloo_med / 1e9:.2f} | "
                 + ", ".join(f"{kind} {ms(statistics.median(gl[kind]))}" for kind in TRANSPORTS) + " |")
    lines += ["", "GB/s for gloo: the vector's bytes in and out of a rank per second, as for a round trip "
              "(a 2-rank ring moves half the vector each way twice).", "",
              "## omnips", "",
              "| configuration | median ms | p10 ms | p90 ms | raw ZeroMQ median ms (same window, same transport) "
              "| omnips / raw | median of per-pair ratios | min / min | worker reply copy ms "
              f"| <= {TARGET_RATIO}x raw | omnips / gloo | the same, each over its raw | faster than gloo |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|"]
    for r in rows:
        verdict = "-" if r["curve"] else "yes" if r["ratio"] <= TARGET_RATIO else "no"
        lines.append(f"| {r['config']} | {ms(r['median'])} | {ms(r['p10'])} | {ms(r['p90'])} | {ms(r['raw'])} "
                     f"| {r['ratio']:.2f}x | {r['pair_ratio']:.2f}x | {r['min_ratio']:.2f}x | {ms(r['copy'])} "
                     f"| {verdict} | {r['gloo_ratio']:.2f}x | {r['gloo_adjusted']:.2f}x "
                     f"| {'-' if r['curve'] else _faster(r['gloo_ratio'], r['gloo_adjusted'])} |")
    lines += cpu_section(rows)
    lines += curve_section(rows, nbytes)
    lines += ["", "## Where the time goes (in-process pieces, medians, run after the clusters)", "",
              "| piece | ms |", "|---|---:|"]
    for name, t in piece_times.items():
        lines.append(f"| {name} | {ms(t)} |")
    copy = piece_times["worker: np.copyto of the reply into params"]
    for kind in TRANSPORTS:
        raw_med = statistics.median(raw_by_kind[kind])
        for mode in ("ASP", "BSP"):
            handle = piece_times[f"server: ShardCore.handle(Push), {mode} (check + update)"]
            est = raw_med + copy + handle
            measured = [r["median"] for r in rows if r["config"] == f"omnips {mode}, 1 server, {kind}"]
            tail = f"; measured {ms(measured[0])} ms" if measured else ""
            lines += ["", f"{mode} 1 server over {kind}, sum of the pieces if nothing overlapped: raw {ms(raw_med)} "
                      f"+ reply copy {ms(copy)} + server handle {ms(handle)} = {ms(est)} ms ({est / raw_med:.2f}x raw)"
                      f"{tail}. Within {TARGET_RATIO}x the worker copy and the server's check and update together "
                      f"would have to fit in {ms((TARGET_RATIO - 1) * raw_med)} ms."]
    lines += ["", "(Pieces timed in this process at another moment: a rough guide only.)", "",
              f"Total benchmark time: {total_s:.0f} s."]
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=int, default=11_000_000, help="float32 values per round trip (approximate "
                   "for omnips: the mlp's size; the baselines use the same count)")
    p.add_argument("--repeats", type=int, default=20, help="timed round trips per configuration")
    p.add_argument("--curve-repeats", type=int, default=10, help="timed round trips per CURVE configuration")
    p.add_argument("--warmup", type=int, default=3, help="untimed round trips first")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--no-bsp", action="store_true", help="skip the BSP 1-server configurations")
    p.add_argument("--no-curve", action="store_true", help="skip the CURVE (--keys) twin of each tcp configuration")
    p.add_argument("--server-threads", type=int, default=1, help="torch threads per server (server --threads)")
    p.add_argument("--bucket-size", type=int, default=4 << 20, metavar="BYTES",
                   help="omnips pushes in buckets of this size and takes the reply in parts of it, as a worker does "
                        "by default (0: one push per shard, the reply whole)")
    p.add_argument("--out", default=str(HERE / "results" / "pushpull.md"))
    p.add_argument("--keep-runs", action="store_true", help="keep the clusters' run directories and logs")
    p.add_argument("--raw-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--socket-child", choices=TRANSPORTS, help=argparse.SUPPRESS)
    p.add_argument("--gloo-rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--gloo-port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.raw_child:
        return raw_child(args.params, args.host)
    if args.socket_child:
        return socket_child(args.params, args.socket_child)
    if args.gloo_rank is not None:
        return gloo_child(args.gloo_rank, args.gloo_port, args.params, args.repeats)
    if args.repeats < 1 or args.curve_repeats < 1 or args.warmup < 0 or args.params < 1000:
        p.error("need --repeats >= 1, --curve-repeats >= 1, --warmup >= 0, --params >= 1000")

    from report import publish, runs_dir

    from omnips import security
    from omnips.flat import aligned_zeros

    t_start = time.monotonic()
    model_args, dataset_args = job_args(args.params, cluster_steps(args.warmup, max(args.repeats, args.curve_repeats)))
    n = model_size(model_args, dataset_args)
    print(f"{n:,} float32 values ({4 * n / 1e6:.1f} MB); mlp {model_args}, synthetic {dataset_args}", flush=True)

    params = aligned_zeros(n)
    params[:] = np.random.default_rng(0).standard_normal(n, dtype=np.float32) * 0.01
    grads = aligned_zeros(n)
    grads.fill(1e-4)

    shapes = [("asp", 1), ("asp", 2)] + ([] if args.no_bsp else [("bsp", 1)])
    results = []
    with runs_dir("omnips-pushpull-", args.keep_runs) as run_root, contextlib.closing(RawPeer(n, args.host)) as raw:
        key_dir = run_root / "keys"
        security.keygen(key_dir)
        configs = [(mode, servers, "tcp", k) for mode, servers in shapes
                   for k in [None] + ([] if args.no_curve else [key_dir])]
        configs += [(mode, servers, "ipc", None) for mode, servers in shapes]
        for kind in TRANSPORTS:
            for _ in range(args.warmup):
                raw.round_trip(kind)
        floor_rows = floors(n, raw, args.warmup, args.repeats)
        for f in floor_rows:
            print(f"  {f['name']}: median {ms(statistics.median(f['times']))} ms, raw ZeroMQ alongside "
                  f"{ms(statistics.median(f['zmq']))} ms", flush=True)
        for mode, servers, kind, keys in configs:
            r = run_cluster(mode, servers, kind, model_args, dataset_args, args.warmup,
                            args.curve_repeats if keys else args.repeats, params, grads, raw, run_root, args.host,
                            args.server_threads, keys, args.bucket_size // 4)
            print(f"  {r['config']}: median {ms(statistics.median(r['omni']))} ms, raw alongside "
                  f"{ms(statistics.median(r['raw']))} ms", flush=True)
            results.append(r)
        gl = gloo(n, raw, args.warmup, args.repeats)
        print(f"  gloo all_reduce: median {ms(statistics.median(gl['times']))} ms, raw alongside "
              + ", ".join(f"{kind} {ms(statistics.median(gl[kind]))} ms" for kind in TRANSPORTS), flush=True)

    piece_times = pieces(params, grads, max(5, min(args.repeats, 11)), args.server_threads)
    rows = summarize(results, gl)
    raw_by_kind = {kind: [t for r in results if r["kind"] == kind for t in r["raw"]] for kind in TRANSPORTS}
    publish(render(rows, raw_by_kind, floor_rows, gl, piece_times, args, n, time.monotonic() - t_start),
            Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
