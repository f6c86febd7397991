"""The worker's pure core (worker/core.py), driven with events and the clock passed in:
its states and the instructions it gives, without sockets or a model."""

import pytest

from omnips.batching import BatchPlan
from omnips.protocol import Plan, Rewind, Shutdown
from omnips.worker.core import (REWIND_PHASE, Exit, Fail, Finish, GoBack, Join, Limits, Listen, SendProbe, State,
                                Step, WorkerCore, rewind_explains)

LIMITS = Limits(start_plan_s=300.0, rewind_s=120.0, close_s=60.0)
REFUSAL = "server 1 at tcp://h:1 refused: bad_version: push computed on version 15, shard is at 10"


def core(bsp=True, probes=False, total_steps=20, start_step=0) -> WorkerCore:
    c = WorkerCore("h", LIMITS)
    c.welcomed(1, 2, bsp, total_steps, BatchPlan(0, [8, 8]), start_step, 0, probes)
    return c


def training(**kw) -> WorkerCore:
    c = core(**kw)
    assert c.next(0.0) == Join() and c.state is State.REGISTERING
    c.joined(c.step, None, 0.0)
    return c


def rewind(step=10, batches=(4, 12)) -> Rewind:
    return Rewind(steps=[step, step], positions=[80, 96], plan=BatchPlan(3, tuple(batches)),
                  servers=["tcp://a:1", "tcp://b:2"])


def test_it_registers_joins_and_trains_its_steps_then_waits_for_the_close():
    c = training(total_steps=2)
    assert c.state is State.TRAINING and c.next(1.0) == Step(0, 8, 0)
    c.stepped(8, None)
    assert c.next(2.0) == Step(1, 8, 0)
    c.stepped(8, BatchPlan(1, [6, 10]))  # a server's reply brought a newer plan
    assert c.next(3.0) == Finish(2) and c.state is State.FINISHED
    assert c.next(4.0) == Listen() and not c.interrupted()
    c.heard(Shutdown(ok=True), 5.0)
    assert c.state is State.DONE and c.next(6.0) == Exit() and c.interrupted()


def test_asp_steps_walk_their_sample_stream_and_a_plan_that_stops_finishes():
    c = training(bsp=False)
    assert c.next(0.0) == Step(0, 8, 0)
    c.stepped(8, BatchPlan(1, [5, 11]))
    assert c.next(0.0) == Step(1, 11, 8)
    c.stepped(11, BatchPlan(2, [5, 11], stop=True))
    assert c.next(1.0) == Finish(2)


def test_a_probing_worker_waits_for_the_start_plan_and_takes_it():
    c = core(probes=True)
    c.next(0.0)
    c.joined(0, None, 0.0)
    assert c.state is State.PROBING and c.next(0.0) == SendProbe()
    c.probed(1.0)
    assert c.next(2.0) == Listen()
    c.heard(Plan(plan=BatchPlan(1, (3, 13))), 3.0)
    assert c.next(3.0) == Step(0, 13, 0) and c.state is State.TRAINING


def test_no_start_plan_within_the_welcome_timeout_ends_it_about_the_scheduler():
    c = core(probes=True)
    c.next(0.0)
    c.joined(0, None, 0.0)
    c.next(0.0)
    c.probed(10.0)
    c.tick(310.0)
    assert c.state is State.PROBING
    c.tick(310.1)
    assert c.next(311.0) == Fail("no start plan from the scheduler within 300 s (it waits for every worker's probe)",
                                 "scheduler")


def test_a_rewind_during_training_interrupts_the_step_and_goes_back_to_its_step_and_plan():
    c = training()
    c.next(0.0)
    c.stepped(8, None)
    assert c.next(1.0) == Step(1, 8, 0)  # in flight, say waiting for the servers, when the rewind comes
    c.heard(rewind(), 2.0)
    assert c.state is State.REWINDING and c.interrupted()  # the wait on the servers ends
    assert c.next(2.0) == GoBack(rewind())
    assert not c.interrupted()  # the rewind's own pull waits
    c.stepped(8, None)  # (an interrupted step reports nothing: stepped is not called; if it were, no harm)
    c.rewound(3.0)
    assert c.state is State.TRAINING and c.next(3.0) == Step(10, 12, 96)


def test_a_second_rewind_during_the_first_ones_pull_is_the_one_applied():
    c = training()
    c.heard(rewind(10), 1.0)
    assert c.next(1.0) == GoBack(rewind(10))
    c.heard(rewind(5), 2.0)  # another server lost while the first rewind's pull waits
    assert c.interrupted()
    c.rewound(2.5)  # (a pull that finished anyway is not the newest rewind's)
    assert c.next(3.0) == GoBack(rewind(5))
    c.rewound(4.0)
    assert c.next(4.0) == Step(5, 12, 96)


def test_a_rewind_during_the_join_or_while_waiting_for_the_start_plan_goes_to_training():
    c = core(probes=True)
    assert c.next(0.0) == Join()
    c.heard(rewind(), 1.0)  # while the first pull waits
    assert c.interrupted() and c.next(1.0) == GoBack(rewind())
    c.rewound(2.0)
    assert c.next(2.0) == Step(10, 12, 96)
    c = core(probes=True)
    c.next(0.0)
    c.joined(0, None, 0.0)
    c.next(0.0)
    c.probed(1.0)
    c.heard(rewind(), 2.0)
    assert c.next(2.0) == GoBack(rewind())


def test_the_end_of_the_job_during_a_wait_on_the_servers_ends_it():
    c = training()
    assert c.next(0.0) == Step(0, 8, 0)
    assert not c.interrupted()
    c.heard(Shutdown(ok=True), 1.0)
    assert c.interrupted() and c.state is State.DONE and c.next(1.0) == Exit()
    c.heard(rewind(), 2.0)  # nothing moves it on
    assert c.next(2.0) == Exit()


def test_a_refusal_by_a_restored_shard_before_the_rewind_waits_for_the_rewind():
    c = training()
    assert c.next(0.0) == Step(0, 8, 0)
    assert c.refused(REFUSAL, "bad_version", 1.0) is True
    assert c.state is State.REWINDING and c.interrupted() and c.awaiting_rewind()
    assert c.next(1.0) == Listen(REWIND_PHASE)
    c.tick(100.0)
    assert c.next(100.0) == Listen(REWIND_PHASE)
    c.heard(rewind(), 101.0)
    assert c.next(101.0) == GoBack(rewind()) and not c.awaiting_rewind()
    c.rewound(102.0)
    assert c.next(102.0) == Step(10, 12, 96)


def test_no_rewind_within_the_server_timeout_after_such_a_refusal_ends_it_saying_so():
    c = training()
    c.next(0.0)
    c.refused(REFUSAL, "bad_version", 1.0)
    c.tick(121.0)
    assert c.next(121.0) == Listen(REWIND_PHASE)
    c.tick(121.5)
    assert c.next(122.0) == Fail(f"worker 1 on h: {REFUSAL}, but no rewind came from the scheduler within 120 s",
                                 "servers")


def test_the_wait_for_a_rewind_is_said_every_few_seconds(caplog):
    c = training()
    c.next(0.0)
    c.refused(REFUSAL, "bad_version", 0.0)
    for t in range(1, 12):
        c.tick(float(t))
    said = [r.getMessage() for r in caplog.records if "still" in r.getMessage()]
    assert said == [f"worker 1 on h: still {REWIND_PHASE} (5 s, 120 s at most)",
                    f"worker 1 on h: still {REWIND_PHASE} (10 s, 120 s at most)"]


def test_any_other_refusal_is_left_to_end_the_worker_and_changes_nothing():
    c = training()
    assert c.next(0.0) == Step(0, 8, 0)
    assert c.refused("server 0 refused: bad_rank: ...", "bad_rank", 1.0) is False
    assert c.state is State.TRAINING and not c.interrupted() and c.next(1.0) == Step(0, 8, 0)


@pytest.mark.parametrize("code, explained", [("bad_version", True), ("bad_rank", False), ("timeout", False),
                                             ("not_ready", False), ("protocol", False)])
def test_only_a_shard_behind_our_version_is_explained_by_a_rewind_on_its_way(code, explained):
    assert rewind_explains(code) is explained


def test_a_finished_worker_not_closed_within_the_server_timeout_ends_about_the_scheduler():
    c = training(total_steps=0)
    assert c.next(5.0) == Finish(0)
    c.tick(65.0)
    assert c.state is State.FINISHED
    c.tick(65.5)
    assert c.next(66.0) == Fail("finished, but the scheduler did not close the job within 60 s", "scheduler")


def test_a_worker_removed_from_the_plan_or_sent_a_bad_rewind_ends_about_the_scheduler():
    c = training()
    c.stepped(8, BatchPlan(1, [16, 0]))
    assert c.next(0.0) == Fail("worker 1 is no longer in the batch plan: the scheduler removed it", "scheduler")
    c = training()
    c.heard(Rewind(steps=[1], positions=[0], plan=BatchPlan(3, (4, 12)), servers=["tcp://a:1"]), 1.0)
    assert c.next(1.0) == Fail("a rewind for 1 workers, the job has 2", "scheduler")


def test_a_start_plan_that_comes_before_our_probe_left_is_kept_and_the_probe_still_sent():
    c = core(probes=True)
    c.next(0.0)
    c.heard(Plan(plan=BatchPlan(1, (3, 13))), 0.5)  # during the first pull: the scheduler dropped us as late
    c.joined(0, None, 1.0)
    assert c.next(1.0) == SendProbe()
    c.probed(2.0)
    c.tick(400.0)  # the start plan is in: nothing waits for it
    assert c.next(400.0) == Step(0, 13, 0) and c.state is State.TRAINING
