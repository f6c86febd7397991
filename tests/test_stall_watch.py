"""scheduler/stalls.py without processes: which rank a stalled step waits for."""

import pytest

from omnips.scheduler.stalls import NOTICE_S, StallWatch, Wait

HB = 1.0
STEP = 0.1  # the step time of the reports below


def bsp_job(n=3, mode="bsp", steps=10) -> StallWatch:
    """n workers that reported steps 0..steps-1 every STEP s; now = steps * STEP."""
    w = StallWatch(mode, HB)
    for r in range(n):
        w.seat(r, f"host{r}", "cpu", 0.0)
    w.servers = {0: "shost0", 1: "shost1"}
    for step in range(steps):
        for r in range(n):
            w.on_report(r, step, (step + 1) * STEP)
    return w


def test_nothing_waits_while_steps_flow():
    w = bsp_job()
    t = 10 * STEP
    w.on_beat(0, 10, 0.05, [0, 1], t)  # worker 0 waits a little for the others: the usual spread
    assert w.waiting(t) is None and w.waiting(t + 0.9) is None and w.notice(t + 0.9) is None


def test_a_bsp_step_waits_for_the_worker_that_is_not_waiting():
    w = bsp_job()
    t = 10 * STEP
    w.on_beat(0, 10, 0.5, [0, 1], t + 0.5)
    w.on_beat(2, 10, 0.4, [0, 1], t + 0.5)
    assert w.waiting(t + 0.5) is None  # not yet a heartbeat interval
    assert w.waiting(t + 1.6) == Wait(10, 1, "host1", "cpu", pytest.approx(1.6), "worker")
    assert str(w.waiting(t + 1.6)) == "step 10 waits for worker 1 (host1, cpu) for 1.6 s"


def test_every_worker_waiting_names_the_server_none_has_heard_from():
    w = bsp_job()
    t = 10 * STEP
    for r in range(3):
        w.on_beat(r, 10, 1.0 + r / 10, [1] if r else [0, 1], t + 1.5)
    assert w.waiting(t + 1.5) == Wait(10, 1, "shost1", "", pytest.approx(1.2), "server")
    assert str(w.waiting(t + 1.5)) == "step 10 waits for server 1 (shost1) for 1.2 s"


def test_the_threshold_is_a_few_step_times_when_those_are_longer_than_a_heartbeat():
    w = StallWatch("bsp", HB)
    w.seat(0, "a", "cpu", 0.0)
    w.seat(1, "b", "cuda:0", 0.0)
    for step in range(5):
        for r in (0, 1):
            w.on_report(r, step, 2.0 * (step + 1))
    assert w.threshold_s() == pytest.approx(6.0)
    w.on_beat(0, 5, 5.0, [0], 15.0)
    assert w.waiting(15.0) is None
    assert w.waiting(16.5).rank == 1 and w.waiting(16.5).device == "cuda:0"


def test_a_worker_heard_from_lately_is_not_blamed_its_heartbeat_saying_it_waits_may_be_on_its_way():
    w = bsp_job()
    t = 10 * STEP
    w.on_beat(0, 10, 1.2, [0], t + 1.2)
    w.on_beat(2, 10, 1.2, [0], t + 1.2)
    w.on_beat(1, -1, 0.0, [], t + 1.0)  # "training": it may be computing, or its push on its way
    assert w.waiting(t + 1.2) is None
    assert w.waiting(t + 2.6).rank == 1  # silent since: stopped, or computing for long


def test_a_worker_whose_heartbeats_say_it_computes_is_named_as_if_silent():
    w = bsp_job()
    t = 10 * STEP
    w.on_beat(0, 10, 1.2, [0], t + 1.2)
    w.on_beat(2, 10, 1.2, [0], t + 1.2)
    w.on_beat(1, -1, 0.0, [], t + 1.0)
    for beat in (1.2, 1.6, 2.0, 2.4):
        w.on_beat(1, 10, 0.0, [], t + beat)  # computing step 10 for long: the step waits for it
    assert w.waiting(t + 2.6).rank == 1


def test_a_server_is_named_only_when_it_is_silent():
    w = bsp_job()
    t = 10 * STEP
    for r in range(3):
        w.on_beat(r, 10, 2.0, [1], t + 2.0)
    w.on_server_beat(1, t + 1.9)
    assert w.waiting(t + 2.0) is None  # it beats: busy, not stopped (the others' answers may be on their way)
    assert w.waiting(t + 3.5).role == "server"


def test_a_report_or_a_beat_that_is_not_waiting_ends_the_wait():
    w = bsp_job()
    t = 10 * STEP
    w.on_beat(0, 10, 2.0, [0], t + 2.0)
    w.on_beat(2, 10, 2.0, [0], t + 2.0)
    assert w.waiting(t + 2.0).rank == 1
    w.on_report(0, 10, t + 2.1)
    w.on_beat(2, -1, 0.0, [], t + 2.1)
    assert w.waiting(t + 2.1) is None


def test_a_worker_gone_is_not_waited_for():
    w = bsp_job()
    t = 10 * STEP
    w.on_beat(0, 10, 2.0, [0], t + 2.0)
    w.on_beat(2, 10, 2.0, [0], t + 2.0)
    assert w.waiting(t + 2.0).rank == 1
    w.leave(1)  # the servers stop waiting for it: if the others still wait, it is for a server
    assert w.waiting(t + 2.0) == Wait(10, 0, "shost0", "", pytest.approx(2.0), "server")


def test_asp_names_the_worker_furthest_behind():
    w = bsp_job(mode="asp")
    t = 10 * STEP
    for step in range(10, 20):  # workers 0 and 2 go on; worker 1 stops after step 9
        w.on_report(0, step, (step + 1) * STEP)
        w.on_report(2, step, (step + 1) * STEP)
    assert w.waiting(t + 0.5) is None
    assert w.waiting(2.6) == Wait(10, 1, "host1", "cpu", pytest.approx(1.6), "worker")


def test_notices_name_a_wait_once_then_every_few_seconds_then_its_end():
    w = bsp_job()
    t = 10 * STEP
    w.on_beat(0, 10, 0.0, [0], t)
    w.on_beat(2, 10, 0.0, [0], t)
    told = [(now, w.notice(now)) for now in [t + 0.5, t + 1.7, t + 2.0, t + 1.7 + NOTICE_S]]
    assert [n and n[0] for _, n in told] == [None, "waits", None, "waits"]
    assert told[3][1][1].seconds == pytest.approx(1.7 + NOTICE_S)
    w.on_report(1, 10, t + 8.0)
    w.on_report(0, 10, t + 8.0)
    w.on_report(2, 10, t + 8.0)
    change, wait = w.notice(t + 8.0)
    assert change == "went on" and (wait.step, wait.rank) == (10, 1) and wait.seconds == pytest.approx(8.0)
    assert w.notice(t + 8.1) is None


def test_asp_judges_each_worker_by_its_own_pace():
    w = StallWatch("asp", HB)
    w.seat(0, "a", "cpu", 0.0)
    w.seat(1, "b", "cpu", 0.0)
    for step in range(40):
        w.on_report(0, step, 0.1 * (step + 1))  # 100 ms a step
    for step in range(2):
        w.on_report(1, step, 2.0 * (step + 1))  # 2 s a step: behind, but at its own pace
    assert w.waiting(5.9) is None
    assert w.waiting(10.1) == Wait(2, 1, "b", "cpu", pytest.approx(6.1), "worker")
