#!/usr/bin/env python
"""Fused push-pull round trip through omnips vs a raw ZeroMQ request-reply of the same bytes.

One invocation measures, for one float32 vector of --params values (default 11 M, 44 MB):

* raw: this process (DEALER) sends a small header + the vector zero-copy to a child
  process (ROUTER) that answers with a vector of the same size from a preallocated
  buffer, zero-copy. Communication only: the floor omnips is compared against.
* omnips: a real scheduler and 1 or 2 servers (ASP, and BSP with 1 server), started
  as processes; this process registers as the only worker, initialises and pulls the
  shards, then times `ServerGroup.push_pull` (push every shard's gradient, receive
  every updated shard into the flat parameter buffer), as worker/service.py does.
* omnips with CURVE: each of those configurations again, right after it, with every
  process on --keys (encrypted and authenticated connections), for the on/off ratio.

Raw and omnips round trips are interleaved (alternating order) while a cluster is up,
so each ratio compares figures taken in the same seconds on this noisy machine.
Afterwards the pieces of an omnips round trip are timed in-process (worker copy of the
reply, server finiteness check, optimizer step, ShardCore.handle) to show where the
time over raw goes.

Every process runs with the glibc settings of transport.MALLOC_ENV (ZMQ_NOTES.md,
point 1): children through their environment, this process through tune_malloc().

    python benchmarks/pushpull.py [--params 11000000] [--repeats 20]

Prints a table and writes it to benchmarks/results/pushpull.md.
"""

from omnips import transport

transport.tune_malloc()  # before the first large allocation (and before torch starts threads)

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import selectors  # noqa: E402
import shutil  # noqa: E402
import socket as pysocket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import msgpack  # noqa: E402
import numpy as np  # noqa: E402
import zmq  # noqa: E402

HERE = Path(__file__).resolve().parent
FEATURES = 1089  # synthetic inputs; mlp with one hidden layer of H: H * (FEATURES + 11) + 10 values
TARGET_RATIO = 1.5
REPLY_TIMEOUT_S = 30.0


# -- raw ZeroMQ peer ---------------------------------------------------------------
def raw_child(n: int, host: str) -> int:
    """The raw baseline's server: answer every [header, data] with a preallocated vector."""
    from omnips.flat import aligned_zeros

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.bind(f"tcp://{host}:*")
    reply = aligned_zeros(n)
    reply.fill(0.5)
    header = msgpack.packb({"op": "echo", "len": n})
    print(f"raw peer listening on {sock.getsockopt_string(zmq.LAST_ENDPOINT)}", flush=True)
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


class RawPeer:
    """This process's end of the raw baseline: DEALER, zero-copy send, zero-copy receive."""

    def __init__(self, n: int, host: str):
        from omnips.flat import aligned_zeros

        env = {**os.environ, **transport.MALLOC_ENV, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--raw-child",
                                      "--params", str(n), "--host", host],
                                     env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
        self.n = n
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.buf = aligned_zeros(n)
        self.buf.fill(1e-4)
        self.header = msgpack.packb({"op": "echo", "len": n})
        try:
            self.endpoint = _read_line(self.proc, "raw peer listening on ", 60.0)
            self.sock.connect(self.endpoint)
        except BaseException:
            self.close()
            raise

    def round_trip(self) -> float:
        start = time.perf_counter()
        self.sock.send(self.header, zmq.SNDMORE)
        self.sock.send(memoryview(self.buf), copy=False)
        if not self.sock.poll(int(REPLY_TIMEOUT_S * 1000)):
            raise RuntimeError("the raw peer did not answer")
        frames = self.sock.recv_multipart(copy=False)
        elapsed = time.perf_counter() - start
        if len(frames) != 2 or frames[1].buffer.nbytes != 4 * self.n:
            raise RuntimeError("the raw peer sent a malformed reply")
        return elapsed

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.sock.send_multipart([b"stop", b""])
            except zmq.ZMQError:
                pass
        self.ctx.destroy(linger=0)
        _reap(self.proc, 5.0)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


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


# -- omnips cluster with this process as worker 0 ---------------------------------
def job_args(n_target: int, steps: int) -> tuple[dict, dict]:
    hidden = max(1, round((n_target - 10) / (FEATURES + 11)))
    # enough samples that the 1-sample reports of the run never cross an ASP epoch
    # (an epoch would make the scheduler pull every shard for an evaluation mid-run)
    n = max(512, 2 * steps + 64)
    return {"hidden": [hidden]}, {"n": n, "features": FEATURES}


def model_size(model_args: dict, dataset_args: dict) -> int:
    from omnips import data, models

    train, _ = data.load("synthetic", dataset_args)
    module = models.build("mlp", model_args, train, 0)
    return sum(p.numel() for p in module.parameters()) + sum(
        b.numel() for b in module.buffers() if b.is_floating_point())


def run_cluster(mode: str, num_servers: int, model_args: dict, dataset_args: dict, warmup: int, repeats: int,
                params: np.ndarray, grads: np.ndarray, raw: RawPeer, run_root: Path, host: str,
                server_threads: int, key_dir: Path | None) -> dict:
    """One configuration; with `key_dir` every process (this one too) uses CURVE."""
    from omnips.launch import LocalCluster
    from omnips.link import SchedulerLink
    from omnips.protocol import Register, Report, Shutdown
    from omnips.security import Keys
    from omnips.servers import ServerGroup

    steps = warmup + repeats
    name = f"{mode}-{num_servers}s" + ("-curve" if key_dir else "")
    run_dir = run_root / name
    # ASP: a sample budget far beyond the run, so the scheduler never asks to stop.
    # BSP: exactly `steps` steps of global batch 1; the final evaluation is at version `steps`.
    max_steps = steps if mode == "bsp" else 10 ** 9
    keys = Keys.load(key_dir, listens=False) if key_dir else None
    key_args = ["--keys", str(key_dir)] if key_dir else []
    cluster = LocalCluster(run_dir, [], num_servers, [])
    ctx = zmq.Context()
    result = {"config": f"omnips {mode.upper()}, {num_servers} server{'s' if num_servers > 1 else ''}"
                        + (", CURVE" if key_dir else ""),
              "plain": f"omnips {mode.upper()}, {num_servers} server{'s' if num_servers > 1 else ''}",
              "curve": key_dir is not None, "mode": mode, "servers": num_servers, "logs": str(run_dir / "logs")}
    try:
        # LocalCluster.start always starts its own workers; start the scheduler and the
        # servers through its _spawn (which applies MALLOC_ENV) and be the worker here.
        sched = cluster._spawn("scheduler", "scheduler", [
            "--mode", mode, "--model", "mlp", "--model-args", json.dumps(model_args),
            "--dataset", "synthetic", "--dataset-args", json.dumps(dataset_args),
            "--global-batch", "1", "--max-steps", str(max_steps), "--num-servers", str(num_servers),
            "--num-workers", "1", "--host", host, "--port", "0", "--run-dir", str(run_dir), *key_args],
            stdout=subprocess.PIPE)
        cluster.endpoint = cluster._read_endpoint(sched, 60.0)
        for s in range(num_servers):
            cluster._spawn(f"server{s}", "server", ["--scheduler", cluster.endpoint, "--host", host,
                                                    "--threads", str(server_threads), *key_args])

        def check_children():  # called while waiting for servers: fail fast if one died
            dead = {name: code for name, code in cluster.exit_codes().items() if code is not None}
            if dead:
                raise RuntimeError(f"cluster process(es) exited early: {dead}")

        link = SchedulerLink(ctx, cluster.endpoint, keys=keys)
        welcome = link.register(Register(role="worker", host=pysocket.gethostname(), capacity=1.0, device="cpu",
                                         threads=1, pid=os.getpid()), ack_timeout_s=10.0, welcome_timeout_s=60.0)
        info = welcome.cluster
        link.dead_after_s = info["dead_after_s"]
        if info["num_params"] != params.size:
            raise RuntimeError(f"the scheduler's model has {info['num_params']} values, expected {params.size}")
        group = ServerGroup(ctx, info["servers"], info["ranges"], REPLY_TIMEOUT_S, on_wait=check_children, keys=keys)

        copy_s = [0.0]  # time in ServerGroup.accept: the np.copyto of each reply into `params`
        accept = group.accept

        def timed_accept(s, msg, into):
            t = time.perf_counter()
            accept(s, msg, into)
            copy_s[0] += time.perf_counter() - t

        group.accept = timed_accept

        group.init(params)
        group.pull(params)
        omni, raw_t, copies, elapsed = [], [], [], []
        for step in range(steps):
            if step % 2:
                raw_dt = raw.round_trip()
            copy_s[0] = 0.0
            t = time.perf_counter()
            ex = group.push_pull(0, step, grads, 1, 0, params)
            dt = time.perf_counter() - t
            if step % 2 == 0:
                raw_dt = raw.round_trip()
            if ex.plan is not None and ex.plan.get("stop"):
                raise RuntimeError("the scheduler stopped the job early")
            link.send(Report(rank=0, step=step, batch=1, compute_s=0.0, network_s=max(0.0, ex.elapsed_s - ex.held_s),
                             wait_s=ex.held_s, loss=0.0))
            while link.sock.poll(0):  # heartbeats; a failed shutdown raises
                if isinstance(link.receive(), Shutdown):
                    raise RuntimeError("the scheduler ended the job early")
            if step >= warmup:
                omni.append(dt)
                raw_t.append(raw_dt)
                copies.append(copy_s[0])
                elapsed.append(ex.elapsed_s)
        if not np.isfinite(params[:1000]).all():
            raise RuntimeError("parameters went non-finite")

        link.send(Report(rank=0, step=steps, batch=0, compute_s=0.0, network_s=0.0, wait_s=0.0, loss=0.0, done=True))
        deadline = time.monotonic() + 60.0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError("the scheduler did not shut the job down")
            if link.sock.poll(int(left * 1000)) and isinstance(link.receive(), Shutdown):
                break
        cluster.stop(grace_s=15.0)
        codes = cluster.exit_codes()
        if any(code != 0 for code in codes.values()):
            raise RuntimeError(f"cluster processes exited with {codes}")
        result.update(omni=omni, raw=raw_t, copy=copies, elapsed=elapsed)
        return result
    except BaseException:
        print(f"{name} failed; logs in {run_dir / 'logs'}", file=sys.stderr)
        for proc_name in cluster.procs:
            print(f"  {proc_name}: {cluster.tail(proc_name)}", file=sys.stderr)
        raise
    finally:
        cluster.stop(grace_s=0.0)  # no-op when everything already exited
        ctx.destroy(linger=0)


# -- in-process pieces of one round trip ------------------------------------------
def _median_time(fn, repeats: int) -> float:
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

    from omnips import protocol
    from omnips.flat import aligned_zeros
    from omnips.job import JobSpec
    from omnips.protocol import Init, Push
    from server.shard import ShardCore, _finite

    n = params.size
    out = {}
    dst = aligned_zeros(n)
    out["worker: np.copyto of the reply into params"] = _median_time(lambda: np.copyto(dst, params), repeats)
    out["server: finiteness check (np.dot)"] = _median_time(lambda: _finite(grads), repeats)
    out["protocol: encode + decode of a Push"] = _median_time(
        lambda: protocol.decode(protocol.encode(Push(rank=0, step=0, ver=0, batch=1, gen=0, data=grads))), repeats)

    threads = torch.get_num_threads()
    torch.set_num_threads(server_threads)
    other = 2 if server_threads == 1 else 1
    for mode in ("asp", "bsp"):
        job = JobSpec(mode=mode, num_workers=1, global_batch=1, dataset="synthetic", max_steps=1)
        core = ShardCore(job, 0, n, n)
        core.handle(b"w", Init(rank=0, data=params), 0.0)
        step = [0]

        def push():
            core.handle(b"w", Push(rank=0, step=step[0], ver=core.version, batch=1, gen=0, data=grads), 0.0)
            step[0] += 1

        push()  # starts the momentum buffer
        out[f"server: ShardCore.handle(Push), {mode.upper()} (check + update)"] = _median_time(push, repeats)
        if mode == "asp":
            out[f"server: optimizer step alone (ShardCore._step, {job.optimizer} momentum {job.momentum}, "
                f"{server_threads} torch thread(s) as the servers)"] = _median_time(
                lambda: core._step(grads, job.lr), repeats)
            torch.set_num_threads(other)
            out[f"what-if: the same step with {other} torch thread(s)"] = _median_time(
                lambda: core._step(grads, job.lr), repeats)
            torch.set_num_threads(server_threads)
        del core
    # the floor of any update: one in-place pass reading g and read-writing p
    p, g = torch.from_numpy(dst), torch.from_numpy(grads)
    out["reference: in-place p.add_(g, alpha=-lr) (SGD without momentum)"] = _median_time(
        lambda: p.add_(g, alpha=-1e-3), repeats)
    torch.set_num_threads(threads)
    return out


# -- report ------------------------------------------------------------------------
def ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


def summarize(results: list[dict]) -> list[dict]:
    rows = []
    for r in results:
        om, raw = statistics.median(r["omni"]), statistics.median(r["raw"])
        rows.append({
            "config": r["config"], "plain": r["plain"], "curve": r["curve"], "median": om,
            "p10": float(np.percentile(r["omni"], 10)), "p90": float(np.percentile(r["omni"], 90)), "raw": raw, "ratio": om / raw,
            "copy": statistics.median(r["copy"]),
            # per-pair ratio: each omnips round trip over the raw one taken next to it
            "pair_ratio": statistics.median(o / w for o, w in zip(r["omni"], r["raw"])),
            # fastest over fastest: the least disturbed by other load on the machine
            "min_ratio": min(r["omni"]) / min(r["raw"]),
        })
    return rows


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
                     f"| {on['median'] / off['median']:.2f}x | {on['ratio'] / off['ratio']:.2f}x | {2 * nbytes / off['median'] / 1e9:.2f} "
                     f"| {2 * nbytes / on['median'] / 1e9:.2f} |")
    lines += ["", "GB/s: bytes pushed plus bytes pulled per second of round trip. The second ratio divides each "
              "configuration by the raw round trips interleaved with it, cancelling drift between the two runs."]
    return lines


def render(rows, all_raw, piece_times, args, n, total_s) -> str:
    nbytes = 4 * n
    lines = [
        "# omnips fused push-pull vs raw ZeroMQ request-reply",
        "",
        f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"- nproc: {len(os.sched_getaffinity(0))} (cpu_count {os.cpu_count()}), {platform.machine()}, "
        f"Python {platform.python_version()}, pyzmq {zmq.__version__} / libzmq {zmq.zmq_version()}, "
        f"numpy {np.__version__}",
        f"- vector: {n:,} float32 = {nbytes:,} bytes ({nbytes / 2**20:.1f} MiB) each way; "
        f"{args.repeats} timed round trips after {args.warmup} warm-ups per configuration; tcp loopback",
        "- raw: DEALER -> ROUTER in a child process, header + zero-copy 44 MB frame each way, "
        "preallocated page-aligned buffers, MALLOC_ENV in both processes; no computation",
        "- omnips: real scheduler + server processes, this process as the only worker "
        "(ServerGroup.push_pull: push gradients, server checks + SGD-momentum step, reply copied into params), "
        f"servers with --threads {args.server_threads}; "
        "raw round trips interleaved with omnips ones while each cluster runs",
        *(["- CURVE: each configuration again right after it, every process (this one too) on --keys"]
          if any(r["curve"] for r in rows) else []),
        f"- raw median over all configurations: {ms(statistics.median(all_raw))} ms "
        f"({nbytes * 2 / statistics.median(all_raw) / 1e9:.2f} GB/s both ways)",
        f"- target: omnips / raw <= {TARGET_RATIO} (judged on the median ratio; plain TCP, not CURVE)",
        f"- load average at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())} "
        "(other processes on these cores inflate omnips, which computes, more than raw)",
        "",
        "| configuration | median ms | p10 ms | p90 ms | raw median ms (same window) | omnips / raw "
        "| median of per-pair ratios | min / min | worker reply copy ms | within target |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(f"| {r['config']} | {ms(r['median'])} | {ms(r['p10'])} | {ms(r['p90'])} | {ms(r['raw'])} "
                     f"| {r['ratio']:.2f}x | {r['pair_ratio']:.2f}x | {r['min_ratio']:.2f}x | {ms(r['copy'])} "
                     f"| {'-' if r['curve'] else 'yes' if r['ratio'] <= TARGET_RATIO else 'no'} |")
    lines += curve_section(rows, nbytes)
    lines += ["", "## Where the time goes (in-process pieces, medians, run after the clusters)", "",
              "| piece | ms |", "|---|---:|"]
    for name, t in piece_times.items():
        lines.append(f"| {name} | {ms(t)} |")
    raw_med = statistics.median(all_raw)
    copy = piece_times["worker: np.copyto of the reply into params"]
    for mode in ("ASP", "BSP"):
        handle = piece_times[f"server: ShardCore.handle(Push), {mode} (check + update)"]
        est = raw_med + copy + handle
        measured = [r["median"] for r in rows if r["config"] == f"omnips {mode}, 1 server"]
        tail = f"; measured {ms(measured[0])} ms" if measured else ""
        lines.append("")
        lines.append(f"{mode} 1 server, sum of the pieces if nothing overlapped: raw {ms(raw_med)} + reply copy "
                     f"{ms(copy)} + server handle {ms(handle)} = {ms(est)} ms ({est / raw_med:.2f}x raw){tail} "
                     "(pieces timed in this process at another moment: a rough guide only).")
    lines += ["", f"Total benchmark time: {total_s:.0f} s.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=int, default=11_000_000, help="float32 values per round trip (approximate "
                   "for omnips: the mlp's size; the raw baseline uses the same count)")
    p.add_argument("--repeats", type=int, default=20, help="timed round trips per configuration")
    p.add_argument("--warmup", type=int, default=3, help="untimed round trips first")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--no-bsp", action="store_true", help="skip the BSP 1-server configuration")
    p.add_argument("--no-curve", action="store_true", help="skip the CURVE (--keys) twin of each configuration")
    p.add_argument("--server-threads", type=int, default=1, help="torch threads per server (server --threads)")
    p.add_argument("--out", default=str(HERE / "results" / "pushpull.md"))
    p.add_argument("--keep-runs", action="store_true", help="keep the clusters' run directories and logs")
    p.add_argument("--raw-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.raw_child:
        return raw_child(args.params, args.host)
    if args.repeats < 1 or args.warmup < 0 or args.params < 1000:
        p.error("need --repeats >= 1, --warmup >= 0, --params >= 1000")

    from omnips import security
    from omnips.flat import aligned_zeros

    t_start = time.monotonic()
    steps = args.warmup + args.repeats
    model_args, dataset_args = job_args(args.params, steps)
    n = model_size(model_args, dataset_args)
    print(f"{n:,} float32 values ({4 * n / 1e6:.1f} MB); mlp {model_args}, synthetic {dataset_args}", flush=True)

    params = aligned_zeros(n)
    params[:] = np.random.default_rng(0).standard_normal(n, dtype=np.float32) * 0.01
    grads = aligned_zeros(n)
    grads.fill(1e-4)

    run_root = Path(tempfile.mkdtemp(prefix="omnips-pushpull-"))
    key_dir = run_root / "keys"
    security.keygen(key_dir)
    configs = [(mode, servers, k) for mode, servers in [("asp", 1), ("asp", 2)] + ([] if args.no_bsp else [("bsp", 1)])
               for k in [None] + ([] if args.no_curve else [key_dir])]
    results = []
    raw = RawPeer(n, args.host)
    ok = False
    try:
        for _ in range(args.warmup):
            raw.round_trip()
        for mode, servers, keys in configs:
            r = run_cluster(mode, servers, model_args, dataset_args, args.warmup, args.repeats, params, grads,
                            raw, run_root, args.host, args.server_threads, keys)
            print(f"  {r['config']}: median {ms(statistics.median(r['omni']))} ms, raw alongside "
                  f"{ms(statistics.median(r['raw']))} ms", flush=True)
            results.append(r)
        ok = True
    finally:
        raw.close()
        if ok and not args.keep_runs:
            shutil.rmtree(run_root, ignore_errors=True)
        else:
            print(f"run directories kept in {run_root}", file=sys.stderr)

    piece_times = pieces(params, grads, max(5, min(args.repeats, 11)), args.server_threads)
    rows = summarize(results)
    all_raw = [t for r in results for t in r["raw"]]
    text = render(rows, all_raw, piece_times, args, n, time.monotonic() - t_start)
    print()
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
