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
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import zmq  # noqa: E402
from baselines import TRANSPORTS, RawPeer, floors, gloo  # noqa: E402
from pushpull_report import ms, render, summarize  # noqa: E402

FEATURES = 1089  # synthetic inputs; mlp with one hidden layer of H: H * (FEATURES + 11) + 10 values


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
            def update():
                core.store.take([(1.0, [(0, grads)])], core.version, job.lr)
                core.ready(n)

            out[f"server: optimizer step alone (ShardValues.take and ready, {job.optimizer} momentum "
                f"{job.momentum}, {server_threads} torch thread(s) as the servers)"] = median_time(update, repeats)
            torch.set_num_threads(other)
            out[f"what-if: the same step with {other} torch thread(s)"] = median_time(update, repeats)
            torch.set_num_threads(server_threads)
    # the floor of any update: one in-place pass reading g and read-writing p
    p, g = torch.from_numpy(dst), torch.from_numpy(grads)
    out["reference: in-place p.add_(g, alpha=-lr) (SGD without momentum)"] = median_time(
        lambda: p.add_(g, alpha=-1e-3), repeats)
    torch.set_num_threads(threads)
    return out


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
    args = p.parse_args(argv)
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
