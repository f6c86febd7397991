#!/usr/bin/env python
"""The baselines benchmarks/pushpull.py holds an omnips round trip against, same bytes: a raw
ZeroMQ peer, a raw socket echo and a gloo all_reduce. Each peer is a child process running
this module (main below; benchmarks/pushpull.py's docstring says how each is measured).
"""

import argparse
import datetime
import os
import selectors
import shutil
import socket as pysocket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgpack
import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # omnips, run from a clone without installing

from omnips import transport  # noqa: E402

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
    """This module as a helper process (main below), with MALLOC_ENV."""
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


def main(argv=None) -> int:
    """A child: the raw ZeroMQ peer, a socket echo's peer, or a gloo rank."""
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--repeats", type=int, default=0, help="a gloo rank's all_reduces")
    role = p.add_mutually_exclusive_group(required=True)
    role.add_argument("--raw-child", action="store_true")
    role.add_argument("--socket-child", choices=TRANSPORTS)
    role.add_argument("--gloo-rank", type=int)
    p.add_argument("--gloo-port", type=int)
    args = p.parse_args(argv)
    if args.raw_child:
        return raw_child(args.params, args.host)
    if args.socket_child:
        return socket_child(args.params, args.socket_child)
    return gloo_child(args.gloo_rank, args.gloo_port, args.params, args.repeats)


if __name__ == "__main__":
    sys.exit(main())
