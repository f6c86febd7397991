"""ZeroMQ plumbing shared by the roles: sockets with safe options, typed send/receive.

Sockets never block without a bound: ROUTERs report unroutable peers
(ROUTER_MANDATORY) instead of dropping silently, sends to a ROUTER peer are
non-blocking, and every receive goes through `poll` with a timeout.
"""

import ctypes
import ctypes.util
import logging
import os
import shutil
import socket as pysocket
import stat
import tempfile
import time

import zmq

from . import access, codec, protocol, security

log = logging.getLogger(__name__)

LINGER_MS = 1000  # long enough for a final reply to leave, short enough not to hang exit
# glibc settings that stop large ZeroMQ buffers from being mmap'ed and unmapped per
# message (docs/performance.md: several times faster push+pull). Launchers put these in the child's
# environment; `tune_malloc` applies the same in-process for roles started by hand.
MALLOC_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "4294967295",
              "MALLOC_ARENA_MAX": "1"}


class TransportError(RuntimeError):
    """A socket problem the caller cannot fix by retrying (address in use, bad endpoint)."""


def tune_malloc() -> bool:
    """Apply MALLOC_ENV through mallopt; must run before the first large allocation."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False  # not glibc: nothing to tune
    M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
    return all(mallopt(opt, val) == 1 for opt, val in
               ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1), (M_ARENA_MAX, 1)))


def socket(ctx: zmq.Context, kind: int, identity: bytes | None = None) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    return sock


def bind(sock: zmq.Socket, host: str, port: int, keys: security.Keys | None = None) -> str:
    """Bind to host:port (0 = any free port) and return the endpoint peers should use.
    With `keys` the socket is a CURVE server (its process must run a security.Gate);
    without, a warning is logged when the address is reachable from other machines.

    Every listener names the job's ZAP domain, so that libzmq refuses peers greeting in
    ZMTP 1.0 or 2.0 (no omnips peer does). Without it, a peer whose first byte is not 0xff
    (any garbage) is taken for ZMTP 1.0, and libzmq 4.3.5 aborts the whole process
    (errno_assert in process_routing_id_msg) when such a peer's identity arrives while
    the socket is closing. Without keys no ZAP handler runs and the domain is not
    enforced, so ZMTP 3 peers are let in as before; with keys, `Keys.listen` enforces it."""
    sock.zap_domain = security.ZAP_DOMAIN.encode()
    if keys is not None:
        keys.listen(sock)
    try:
        sock.bind(f"tcp://{host}:{port if port else '*'}")
    except zmq.ZMQError as exc:
        if exc.errno == zmq.EADDRINUSE:
            raise TransportError(f"cannot bind {host}:{port}: the port is in use") from None
        raise TransportError(f"cannot bind {host}:{port}: {exc}") from None
    endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    if keys is None and access.exposed(endpoint.removeprefix("tcp://").rsplit(":", 1)[0]):
        log.warning(security.EXPOSED_WARNING, endpoint)
    return endpoint


IPC_PREFIX = "omnips-"
SWEEP_AFTER_S = 60.0  # a socket younger than this may be a starting server's, bound but not listening yet


def bind_ipc(sock: zmq.Socket) -> tuple[str, str]:
    """Also bind `sock` to a unix socket, in a new directory only this user may enter
    (mkdtemp: mode 0700), for clients on this host: 44 MB moves ~30 % faster than over
    tcp loopback (docs/performance.md). Returns the endpoint and the directory, which the
    caller removes at exit (a killed server cannot: the next one sweeps it away). A
    socket that `bind` made a CURVE server is one here too: its options hold for every
    endpoint it binds."""
    sweep_stale_ipc(tempfile.gettempdir())
    directory = tempfile.mkdtemp(prefix=IPC_PREFIX)
    path = os.path.join(directory, "sock")
    try:
        if len(os.fsencode(path)) > zmq.IPC_PATH_MAX_LEN:
            raise TransportError(f"cannot bind ipc://{path}: longer than the {zmq.IPC_PATH_MAX_LEN} bytes a unix "
                                 "socket path may have (set TMPDIR to a shorter directory)")
        try:
            sock.bind(f"ipc://{path}")
        except zmq.ZMQError as exc:
            raise TransportError(f"cannot bind ipc://{path}: {exc}") from None
    except TransportError:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return f"ipc://{path}", directory


def sweep_stale_ipc(root: str) -> list[str]:
    """Remove this user's socket directories under `root` left by servers that were killed:
    those holding nothing but a socket, made over SWEEP_AFTER_S ago, that refuses
    connections (nobody listens). An empty one may be a server's between mkdtemp and
    bind, and a young one a server's between bind and listen (its socket refuses then
    too): both are left alone. Returns the directories removed."""
    removed = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        try:
            if not (entry.name.startswith(IPC_PREFIX) and entry.is_dir(follow_symlinks=False)
                    and entry.stat(follow_symlinks=False).st_uid == os.getuid()
                    and os.listdir(entry.path) == ["sock"]):
                continue
            sock = os.lstat(os.path.join(entry.path, "sock"))
            # (a file or directory named sock refuses a connection as well: not ours to judge)
            if not stat.S_ISSOCK(sock.st_mode) or time.time() - sock.st_mtime < SWEEP_AFTER_S:
                continue
        except OSError:
            continue
        probe = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
        probe.settimeout(1.0)  # a listener with a full backlog would block the connect
        try:
            probe.connect(os.path.join(entry.path, "sock"))
        except ConnectionRefusedError:
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
        except OSError:
            pass  # not ours to judge
        finally:
            probe.close()
    return removed


def connect(sock: zmq.Socket, endpoint: str, keys: security.Keys | None = None) -> None:
    """Connect to `endpoint`; with `keys` as a CURVE client of the job's listeners."""
    if keys is not None:
        keys.connect(sock)
    try:
        sock.connect(endpoint)
    except zmq.ZMQError as exc:
        raise TransportError(f"cannot connect to {endpoint!r}: {exc} "
                             "(expected tcp://HOST:PORT or ipc://PATH)") from None


def send(sock: zmq.Socket, msg: protocol.Message, to: bytes | None = None,
         track: bool = False) -> zmq.MessageTracker | None:
    """Send `msg` (to ROUTER peer `to`) without blocking; a full queue raises ZMQError(EAGAIN).

    A data frame goes zero-copy: the caller must not change the array until the
    returned tracker (track=True) is done, or until the peer has answered.
    """
    frames = codec.encode(msg)
    parts = ([to] if to is not None else []) + frames
    for part in parts[:-1]:
        sock.send(part, flags=zmq.NOBLOCK | zmq.SNDMORE)
    zero_copy = len(frames) > 1
    return sock.send(parts[-1], flags=zmq.NOBLOCK, copy=not zero_copy, track=track and zero_copy)


def reply(sock: zmq.Socket, to: bytes, msg: protocol.Message, track: bool = False, name=None):
    """Send to a ROUTER peer; a vanished or flooded peer is logged, never raised. `name()`
    says who the peer is (role, rank, host): a ZeroMQ identity says nothing to a reader."""
    try:
        return send(sock, msg, to=to, track=track)
    except zmq.ZMQError as exc:
        log.warning("dropped %s to %s: %s", msg.OP, name() if name else f"peer {to!r}", exc.strerror)
        return None


def recv_frames(sock: zmq.Socket) -> list:
    return sock.recv_multipart(copy=False)
