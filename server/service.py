"""The server process: moves bytes between sockets and the shard core (server/shard.py)."""

import dataclasses
import functools
import itertools
import logging
import os
import shutil
import socket as pysocket
import time
from pathlib import Path

import torch
import zmq

from omnips import codec, protocol, security, transport
from omnips.leaving import Leaving
from omnips.link import LinkError, Preempted, SchedulerLink
from omnips.protocol import (Ack, Error, Init, Leave, Params, Plan, ProtocolError, Push, Register, Restore,
                             Shutdown)

from . import checkpointer
from .outbox import Outbox
from .shard import Outgoing, ShardCore
from .shard_state import Snapshot

log = logging.getLogger("omnips.server")

POLL_MS = 200
LAST_WRITE_S = 60.0  # at shutdown, how long a checkpoint file still being written may take


def advertised_host(host: str, advertise: str | None) -> str:
    if advertise:
        return advertise
    return pysocket.gethostname() if host in ("0.0.0.0", "*", "") else host


def serve(scheduler: str, host: str, port: int, advertise: str | None,
          ack_timeout_s: float, welcome_timeout_s: float, keys: security.Keys | None = None, token: str = "",
          rank: int = -1, leaving: Leaving | None = None) -> int:
    ctx = zmq.Context()
    gate = security.Gate(ctx, keys) if keys else None  # before binding: it admits the clients
    ipc_dir = link = None
    try:
        router = transport.socket(ctx, zmq.ROUTER)
        bound = transport.bind(router, host, port, keys)
        endpoint = f"tcp://{advertised_host(host, advertise)}:{bound.rsplit(':', 1)[1]}"
        try:
            ipc, ipc_dir = transport.bind_ipc(router)
        except transport.TransportError as exc:
            ipc = ""
            log.warning("%s: clients on this host connect over tcp", exc)
        link = SchedulerLink(ctx, scheduler, keys=keys)
        me = Register(role="server", host=pysocket.gethostname(), endpoint=endpoint, ipc=ipc,
                      threads=torch.get_num_threads(), pid=os.getpid(), token=token, rank=rank)
        welcome = link.register(me, ack_timeout_s, welcome_timeout_s)
        job, cluster, start = welcome.job, welcome.cluster, welcome.server
        lo, hi = cluster.ranges[welcome.rank]
        link.dead_after_s, link.heartbeat_s = cluster.dead_after_s, cluster.heartbeat_s
        core = ShardCore(job, lo, hi, start.num_trained)
        restore = functools.partial(_restore, core, welcome.rank, lo, hi, link)
        if start.restore:  # a resumed job, or a lost server's shard: continue from a checkpoint
            restore(start.restore)
        writer = checkpointer.ShardWriter(Path(start.checkpoint_dir), welcome.rank, lo, hi)
        # the largest message a worker sends is a push of this shard: refuse anything bigger
        router.setsockopt(zmq.MAXMSGSIZE, (hi - lo) * 4 + protocol.MAX_HEADER_BYTES)
        log.info("server %d serves [%d, %d) of %d values on %s%s (%s, %s on the wire; %s)", welcome.rank, lo, hi,
                 cluster.num_params, endpoint, f" and {ipc}" if ipc else "", job.mode, job.wire_dtype,
                 security.describe(keys))
        return _loop(router, link, core, writer, restore, leaving or Leaving(),
                     f"server {welcome.rank} on {pysocket.gethostname()}")
    finally:
        if link is not None:
            link.close()  # the thread sends what is left (a Leave, an Error) before the context ends
        if gate is not None:
            gate.stop()
        ctx.destroy(linger=transport.LINGER_MS)
        if ipc_dir is not None:
            shutil.rmtree(ipc_dir, ignore_errors=True)


def _restore(core: ShardCore, rank: int, lo: int, hi: int, link: SchedulerLink, path: str) -> None:
    """Go back to the checkpoint in `path` and tell the scheduler (ack); when the shard cannot
    be restored, tell it why (the job cannot go on without it) and end (ValueError)."""
    try:
        with link.in_phase("restoring its shard"):  # a large shard takes a while to read and check
            version = checkpointer.load(core, path, rank, lo, hi)
    except ValueError as exc:
        link.send(Error(code="restore_failed", text=f"server {rank} cannot restore its shard: {exc}"))
        raise
    log.info("server %d restored version %d from %s", rank, version, path)
    link.send(Ack())


def _loop(router, link: SchedulerLink, core: ShardCore, writer: checkpointer.ShardWriter, restore,
          leaving: Leaving, me: str) -> int:
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    poller.register(link.sock, zmq.POLLIN)
    outbox = Outbox(grace_s=link.heartbeat_s)  # waits for queued replies last a heartbeat interval at most
    while True:
        events = dict(poller.poll(POLL_MS))
        if leaving.due():  # the job cannot go on without this shard: it is preempted, and this server
            # serves until the checkpoint of the step the workers stop at is written
            log.warning("%s: %s: asking the scheduler to preempt the job", me, leaving.why)
            link.send(Leave(why=leaving.why))
        try:
            if _from_scheduler(link, core, router, outbox, writer, restore):
                return 0
        except Preempted:
            writer.finished(wait_s=LAST_WRITE_S)  # a file being written ends whole
            raise
        if router in events:
            _serve(router, core, outbox, writer)
        _send(router, core, writer.finished(), outbox, writer)


def _serve(router, core: ShardCore, outbox: Outbox, writer: checkpointer.ShardWriter) -> None:
    """One message from a worker (or anyone on the port), answered."""
    peer, *frames = transport.recv_frames(router)
    try:
        msg = codec.decode(frames)
    except ProtocolError as exc:
        log.warning("refused a message: %s", exc)
        transport.reply(router, peer.bytes, protocol.Error(code=exc.code, text=exc.text),
                        name=lambda: core.describe(peer.bytes))
        return
    if isinstance(msg, (Push, Init)):
        if _unread(router, outbox, peer.bytes, msg.OP):
            return
        _settle(outbox, core)  # replies still queued alias the values about to change
    replies = core.handle(peer.bytes, msg, time.monotonic(), lazy=True)
    for out in replies:
        if isinstance(out, Outgoing) and isinstance(out.msg, protocol.Error):
            log.warning("refused %s: %s: %s", msg.OP, out.msg.code, out.msg.text)
    _send(router, core, replies, outbox, writer)


def _unread(router, outbox: Outbox, peer: bytes, op: str) -> bool:
    """Whether to refuse a push (or init) from `peer`: a reply to it is still queued here.
    The peer is told once, when found out; told again, it would only queue errors behind
    the replies it does not read, as many as the parts of its pushes."""
    known = outbox.suspected(peer)
    if not outbox.unread(peer):
        return False
    if known:
        log.debug("refused %s: its sender still has not read its last reply", op)
        return True
    log.warning("refused %s: its sender has not read its last reply in %g s", op, outbox.grace_s)
    transport.reply(router, peer, protocol.Error(
        code="unread", text=f"your last reply is still queued after {outbox.grace_s:g} s: a worker reads each "
                            "reply before it pushes again; pushes are refused until it has left"))
    return True


def _from_scheduler(link: SchedulerLink, core: ShardCore, router, outbox: Outbox,
                    writer: checkpointer.ShardWriter, restore) -> bool:
    """All that the scheduler sent, before any worker is served (True: the job is over). A
    server woken from a freeze may have been taken for lost meanwhile (the others gone back
    to a checkpoint), and must not complete the step its workers' pushes wait for. Then,
    nothing unread, check_alive judges the scheduler's silence (after such a freeze it waits
    a heartbeat for what is on its way: that is read too) and sends our heartbeat when due,
    every turn however busy the scheduler's socket. A server that itself sent nothing for
    nearly --dead-after serves nobody until the scheduler has echoed a heartbeat sent after
    the silence: the messages it finds on waking were sent while it slept, and the Shutdown
    of a verdict taken just before its heartbeat got through may still be on its way; one
    connection keeps the order, so that Shutdown comes before the echo."""
    _ask_after_silence(link)
    give_up_at = time.monotonic() + link.dead_after_s  # for the echo, if one was asked
    while True:
        while link.sock.poll(0):
            msg = link.receive()
            if isinstance(msg, Shutdown):
                log.info("shutdown: %s (%d updates applied, %d pushes came in parts, %d replies went in parts, "
                         "%d shard copies for replies still queued, staleness mean %.2f max %d)",
                         msg.reason or "job done", core.updates, core.parts_joined, core.replies_in_parts,
                         core.detached, core.staleness_sum / max(1, core.updates), core.staleness_max)
                writer.finished(wait_s=LAST_WRITE_S)  # let a file being written end whole
                return True
            if isinstance(msg, (Plan, Restore)):  # a plan can complete a BSP step: the values change
                _settle(outbox, core)
            if isinstance(msg, Plan):
                _send(router, core, core.set_plan(msg, time.monotonic(), lazy=True), outbox, writer)
            if isinstance(msg, Restore):  # another server died: the job goes back to a checkpoint
                core.rewind()
                restore(msg.path)
        link.check_alive()
        if link.sock.poll(0):
            continue
        if link.echoed():
            return False
        if time.monotonic() > give_up_at:
            raise LinkError(f"the scheduler did not answer a heartbeat within {link.dead_after_s:g} s after this "
                            "server's silence")
        link.sock.poll(int(1000 * link.heartbeat_s) + 1)


def _ask_after_silence(link: SchedulerLink) -> None:
    """After a silence of our own that the scheduler may have taken for our loss, ask it
    to echo a heartbeat."""
    silent = link.silent_s()
    if silent > link.dead_after_s - link.heartbeat_s:
        log.warning("server sent nothing for %.1f s (it was stalled: stopped, or starved of CPU): it serves no "
                    "worker until the scheduler has answered a heartbeat", silent)
        link.ask_echo()


def _send(router, core: ShardCore, replies, outbox: Outbox, writer: checkpointer.ShardWriter) -> None:
    """Sends `replies`; their Params go part k of every reply, then part k + 1, each once the
    core has written the values it carries (ready): the first parts are on their way while
    the core writes the rest of the step. Checkpoints go to the writer after the messages:
    it may wait for the previous file, and the workers need not wait with it."""
    queues = [[(out, msg) for msg in _parts(out)] for out in replies if isinstance(out, Outgoing)]
    for turn in itertools.zip_longest(*queues):
        for out, msg in filter(None, turn):
            if isinstance(msg, Params):
                core.ready(msg.offset + msg.data.size)
            # (a snapshot is a copy that nothing changes: not waited for)
            tracker = transport.reply(router, out.to, msg, track=isinstance(msg, Params) and not out.snapshot,
                                      name=lambda: core.describe(out.to))
            if tracker is not None:
                outbox.add(out.to, tracker)
    core.ready(core.n)  # a step whose replies wait (SSP) or were refused a send is still written now
    for out in replies:
        if isinstance(out, Snapshot):
            _send(router, core, writer.submit(out), outbox, writer)


def _parts(out: Outgoing) -> list:
    """The messages `out` goes as: Params in parts of `out.part` values when asked (the
    worker starts its next forward pass on the first ones while the rest arrive)."""
    msg = out.msg
    if not out.part or not isinstance(msg, Params) or msg.data.size <= out.part:
        return [msg]
    n = msg.data.size
    return [dataclasses.replace(msg, data=msg.data[lo:lo + out.part], offset=lo, whole=n)
            for lo in range(0, n, out.part)]


def _settle(outbox: Outbox, core: ShardCore) -> None:
    """Before the shard changes: the replies still queued alias it (zero-copy). Those that
    leave within a heartbeat interval are waited for; when one does not (its receiver is
    frozen, or slow to read), the shard moves to fresh buffers instead. Waiting on would
    hold up every other worker and the server's heartbeats with it: the scheduler would
    take the server for dead after --dead-after, and fail the job."""
    if outbox.settle(core.detach):
        log.debug("a reply is still queued: the shard moved to fresh buffers")
