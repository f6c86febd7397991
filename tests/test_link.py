"""omnips.link judging the scheduler's silence: a ROUTER in this process stands in for the
scheduler (the `linked` fixture, conftest.py), and the link's clock is the test's."""

import threading
import time

import pytest
from helpers import stand_in
from shard_helpers import make_core

import omnips.link
from omnips.link import LinkError
from omnips.protocol import Failed, Heartbeat, Shutdown
from omnips.server import checkpointer, service
from omnips.server.outbox import Outbox


def test_a_process_that_was_frozen_reads_what_came_meanwhile_before_it_judges_the_silence(linked):
    link, send, clock, _ = linked
    send(Shutdown(ok=False, reason="removed from the job: silent for 4 s"))  # sent while this process slept
    clock[0] = 10.0  # it wakes: the last word it read seems 10 s old, and the shutdown is not read yet
    link.check_alive()  # no verdict while a message comes in
    with pytest.raises(LinkError, match="^scheduler ended the job: removed from the job: silent for 4 s$"):
        link.receive()


def test_a_scheduler_silent_for_dead_after_is_given_up_on(linked):
    link, _, clock, _ = linked
    clock[0] = 2.9
    link.check_alive()
    clock[0] = 3.6
    with pytest.raises(LinkError, match=r"^no word from the scheduler at tcp://127\.0\.0\.1:\d+ for 4 s: giving up$"):
        link.check_alive()


def test_a_server_silent_for_nearly_dead_after_serves_nobody_before_the_verdict_can_arrive(linked, tmp_path):
    """A server woken after a silence the scheduler may have taken for its loss finds only
    what was sent while it slept; the Shutdown of a verdict taken just before its own
    heartbeat got through comes a little later. It must read that Shutdown before it serves
    a worker: server.service._from_scheduler ends with it, rather than return to serve."""
    link, send, clock, _ = linked
    core = make_core(n=4, init=[0.0] * 4)
    writer = checkpointer.ShardWriter(tmp_path, 0, 0, 4)
    send(Heartbeat())  # sent while it slept: read on waking
    clock[0] = 3.5  # its last heartbeat was 3.5 s ago, past --dead-after (3 s)
    late = threading.Timer(0.1, send, [Shutdown(ok=False, reason="removed from the job: server 0 has been silent "
                                                                  "for 3 s")])
    late.start()
    try:
        with pytest.raises(LinkError, match="^scheduler ended the job: removed from the job: server 0 has been"):
            service._from_scheduler(link, core, None, Outbox(grace_s=1.0), writer, None)
    finally:
        late.join()
    assert link.silent_s() == 0.0  # it broke its silence meanwhile


def _echo_later(recv, send, delay_s: float, sent: list):
    """The stand-in scheduler: reads heartbeats until one asks for an echo, then answers it
    after `delay_s` (noting in `sent` that it did, before it sends)."""
    def run():
        while True:
            msg = recv()
            if isinstance(msg, Heartbeat) and msg.echo:
                time.sleep(delay_s)  # the scheduler busy elsewhere: the server must wait, not guess
                sent.append(msg.echo)
                send(Heartbeat(echo=msg.echo))
                return
    return threading.Thread(target=run)


def test_a_server_woken_from_a_long_silence_serves_again_once_the_scheduler_echoes_its_heartbeat(linked, tmp_path):
    link, send, clock, recv = linked
    core = make_core(n=4, init=[0.0] * 4)
    writer = checkpointer.ShardWriter(tmp_path, 0, 0, 4)
    send(Heartbeat())  # sent while it slept
    clock[0] = 3.5
    sent = []
    echo = _echo_later(recv, send, 0.3, sent)
    echo.start()
    try:
        served = service._from_scheduler(link, core, None, Outbox(grace_s=1.0), writer, None)
        answered = list(sent)
    finally:
        echo.join(10)
    assert served is False and answered == [1] and link.echoed()  # it went on once the echo was read


def test_a_server_whose_heartbeat_is_never_echoed_gives_up_after_dead_after(linked, tmp_path):
    link, send, clock, _ = linked
    link.dead_after_s = 1.0  # (to keep the test short)
    core = make_core(n=4, init=[0.0] * 4)
    writer = checkpointer.ShardWriter(tmp_path, 0, 0, 4)
    send(Heartbeat())
    clock[0] = 1.5  # (the scheduler's own heartbeat, read at 1.5, keeps its silence short on this clock)
    with pytest.raises(LinkError, match="^the scheduler did not answer a heartbeat within 1 s after this server's"):
        service._from_scheduler(link, core, None, Outbox(grace_s=1.0), writer, None)


def test_an_echo_still_awaited_is_asked_again_with_the_next_heartbeat(linked):
    link, _, clock, recv = linked
    link.ask_echo()
    clock[0] = 0.5  # a heartbeat later
    link.check_alive()
    assert [recv(), recv()] == [Heartbeat(echo=1), Heartbeat(echo=1)] and not link.echoed()


def test_before_its_welcome_a_process_gives_up_on_a_silent_scheduler_after_30_s():
    """The roles make their link without --dead-after (the scheduler sends it in the welcome):
    while the cluster forms, 30 s of silence end the wait."""
    with stand_in() as (link, _, clock, _):
        clock[0] = 29.9
        link.check_alive()
        clock[0] = 30.6
        with pytest.raises(LinkError, match=r"^no word from the scheduler at tcp://127\.0\.0\.1:\d+ for 31 s: giving up$"):
            link.check_alive()


def _until(recv, msg):
    """Read what the link sent until `msg` (heartbeats the thread sent before it are skipped)."""
    for _ in range(100):
        got = recv()
        if got == msg:
            return got
        assert isinstance(got, Heartbeat), got
    raise AssertionError(f"no {msg} among 100 messages")


def test_from_its_thread_heartbeats_flow_while_the_process_is_busy_and_say_its_phase(linked):
    link, _, _, recv = linked
    link.start_thread()
    assert recv() == Heartbeat()  # the first at once
    link.state = {"phase": "computing", "step": 7}
    # (the stand-in echoes nothing: the phase goes on after PHASE_ECHO_S, and our heartbeats ask
    # for the echo until the process reads one)
    with link.in_phase("building the model"):  # the caller is busy here: it reads nothing from the link
        _until(recv, Heartbeat(phase="building the model", echo=1))  # at once, then every interval
        assert [recv(), recv()] == [Heartbeat(phase="building the model", echo=1)] * 2
    assert link.state == {"phase": "computing", "step": 7}  # what the heartbeats say again
    _until(recv, Heartbeat(phase="computing", step=7, echo=1))


def test_a_phase_is_said_at_once_and_begins_once_the_scheduler_has_heard_it(linked, monkeypatch):
    """A process that stops at the start of a phase (frozen while it builds its model) is
    lost with that phase, not the one before: the phase's heartbeat has left it. Under load
    it had not (the thread had yet to send it when the process stopped itself)."""
    link, send, _, recv = linked
    link.heartbeat_s = 60.0  # the thread's next heartbeat is a minute away
    # the wait for the echo is bounded; here by more than a loaded host takes to answer (at 1 s
    # the phase once began unechoed while the tier's other tests ran)
    monkeypatch.setattr(omnips.link, "PHASE_ECHO_S", 30.0)
    link.start_thread()
    assert recv() == Heartbeat()
    said, echoed = [], threading.Event()

    def scheduler():  # the stand-in hears the phase, and echoes it
        said.append(recv())
        echoed.set()  # (before the echo leaves: once it is back, this is set)
        send(Heartbeat(echo=said[-1].echo))

    hearing = threading.Thread(target=scheduler)
    hearing.start()  # (the router is the thread's alone until it ends)
    with link.in_phase("building the model"):
        assert echoed.is_set() and said == [Heartbeat(phase="building the model", echo=1)]
    hearing.join()
    assert link.sock.poll(10_000) and link.receive() is None and link.echoed()  # the echo, read later


def test_through_its_thread_messages_go_both_ways_in_order_and_the_last_leaves_before_it_ends(linked):
    link, send, _, recv = linked
    link.start_thread()
    send(Heartbeat(echo=5))  # (a heartbeat is read, never returned: counted as an echo)
    send(Shutdown(ok=True, reason="done"))
    assert link.sock.poll(10_000) and link.receive() is None and link.echoed()
    assert link.sock.poll(10_000) and link.receive() == Shutdown(ok=True, reason="done")
    link.send(Failed(reason="one"))
    link.send(Failed(reason="two"))
    link.close()  # at once: what was sent still leaves, then the thread ends
    said = [m for m in iter(recv, Failed(reason="two")) if not isinstance(m, Heartbeat)]
    assert said == [Failed(reason="one")]
    assert not [t for t in threading.enumerate() if t.name == "scheduler-link"]


def test_a_silence_of_the_whole_process_stays_known_after_its_thread_broke_it_until_an_echo_is_asked(linked):
    link, _, clock, recv = linked
    link.start_thread()
    assert recv() == Heartbeat()
    clock[0] = 3.5  # the process, thread and all, was frozen for 3.5 s (--dead-after 3)
    link.state = {"phase": "woken"}
    _until(recv, Heartbeat(phase="woken"))
    assert recv() == Heartbeat(phase="woken")  # the thread beat at 3.5: it broke the silence
    assert link.silent_s() == 3.5  # still known: the server asks for an echo before it serves
    link.ask_echo()
    assert link.silent_s() == 0.0
    # the echo awaited is asked again with the thread's next heartbeat, as from the process
    _until(recv, Heartbeat(echo=1))
    assert recv() == Heartbeat(echo=1, phase="woken")


def test_a_scheduler_silent_for_dead_after_is_given_up_on_naming_the_phase(linked):
    link, _, clock, _ = linked
    link.state = {"phase": "waiting for servers", "step": 3, "waited_s": 1.0, "servers": [0]}
    clock[0] = 3.6
    with pytest.raises(LinkError, match=r"for 4 s \(while waiting for servers\): giving up$"):
        link.check_alive()
