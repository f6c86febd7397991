"""ASP staleness damping, SSP holding and releasing replies, ASP buffer slots: ShardCore directly."""

import numpy as np
from omnips.batching import BatchPlan
from omnips.job import JobSpec
from omnips.protocol import Init, Params, Plan, Push
from omnips.server.shard import ShardCore

from shard_helpers import PEERS


def core_for(mode, staleness=1, staleness_lr="none", n=4, num_trained=None):
    job = JobSpec(mode=mode, num_workers=3, global_batch=12, lr=0.5, momentum=0.0, staleness=staleness,
                  staleness_lr=staleness_lr, async_correction="none")
    job.check()
    core = ShardCore(job, 0, n, n if num_trained is None else num_trained)
    core.handle(PEERS[0], Init(rank=0, data=np.zeros(n, dtype=np.float32)), 0.0)
    return core


def push(rank, step, version, value=1.0, batch=4, n=4):
    return Push(rank=rank, step=step, version=version, batch=batch, gen=0, data=np.full(n, value, dtype=np.float32))


def test_inverse_staleness_divides_the_learning_rate():
    plain, damped = core_for("asp"), core_for("asp", staleness_lr="inverse")
    for core in (plain, damped):
        core.handle(PEERS[0], push(0, 0, version=0), 0.0)  # staleness 0: lr 0.5 * 4/4
        core.handle(PEERS[1], push(1, 0, version=0), 0.0)  # computed on version 0, shard at 1: staleness 1
    np.testing.assert_allclose(plain.values, -0.5 - 0.5)
    np.testing.assert_allclose(damped.values, -0.5 - 0.5 / 2)
    assert damped.staleness_max == 1


def test_ssp_holds_a_worker_that_runs_ahead_and_releases_it():
    core = core_for("ssp", staleness=1)
    t = 0.0
    for step in range(2):  # worker 0 pushes steps 0 and 1 while the others pushed nothing
        out = core.handle(PEERS[0], push(0, step, version=core.version), t)
    assert out == []  # step 1 - slowest (-1) = 2 > 1: held
    out = core.handle(PEERS[1], push(1, 0, version=core.version), 1.0)
    assert [o.to for o in out] == [PEERS[1]]  # worker 2 still at -1: worker 0 stays held
    out = core.handle(PEERS[2], push(2, 0, version=core.version), 2.0)
    released = {o.to: o.msg for o in out}
    assert set(released) == {PEERS[0], PEERS[2]}
    assert isinstance(released[PEERS[0]], Params) and released[PEERS[0]].step == 1
    assert released[PEERS[0]].held_s == 2.0


def test_ssp_stop_releases_everything_held():
    core = core_for("ssp", staleness=0)
    assert core.handle(PEERS[0], push(0, 0, version=0), 0.0) == []  # 0 - (-1) = 1 > 0: held
    out = core.set_plan(Plan(plan=BatchPlan(1, (4, 4, 4), stop=True)), 5.0)
    assert [o.to for o in out] == [PEERS[0]] and out[0].msg.plan.stop is True


def test_asp_buffer_slots_take_the_latest_pushed_values():
    core = core_for("asp", n=4, num_trained=2)
    core.handle(PEERS[0], push(0, 0, version=0, value=3.0), 0.0)
    core.handle(PEERS[1], push(1, 0, version=1, value=7.0), 0.0)
    np.testing.assert_allclose(core.values[2:], 7.0)  # buffers: the latest worker's values
    np.testing.assert_allclose(core.values[:2], -0.5 * 3 - 0.5 * 7)  # parameters: both SGD steps
