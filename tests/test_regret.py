"""Dynamic batching on noisy machines: the regret guard (scheduler/regret.py) and the rules that
keep one bad measurement from locking a bad plan in (scheduler/control.py), driven with crafted
measurements: workers whose step takes a_i + c_i * b, and a noise schedule on top."""

import numpy as np
import pytest

from omnips.batching import BatchPlan, equal_time, integerize
from omnips.job import JobSpec
from omnips.scheduler.control import BatchControl
from omnips.scheduler.regret import BACK_WINDOWS, FORGET_WINDOWS, REGRET, PlanMemory
from omnips.scheduler.windows import CHANGE_STEPS, host_pace

ADJUST_EVERY = 10


def drive(a, c, total, noise, steps=200, probe_c=None):
    """A job of workers with lines (a_i, c_i), started from exact probe passes (or passes at
    slopes `probe_c`); `noise(step, batches, times)` gives the times the workers report. Each
    step's plan and the decisions' (window, reason, rule)."""
    n = len(a)
    a, c = np.asarray(a), np.asarray(c)
    pc = c if probe_c is None else np.asarray(probe_c)
    job = JobSpec(num_workers=n, global_batch=total, batching="dynamic", adjust_every=ADJUST_EVERY, max_steps=steps)
    ctl = BatchControl(job, BatchPlan(0, tuple(integerize(np.full(n, total / n), total, 1, total))))
    ctl.probed({r: ([2, 4], [a[r] + 2 * pc[r], a[r] + 4 * pc[r]]) for r in range(n)}, {})
    plans, decisions = [], []
    for step in range(steps):
        plans.append(ctl.plan.batches)
        b = np.asarray(ctl.plan.batches, dtype=np.float64)
        t = noise(step, b, a + c * b)
        for rank in range(n):
            ctl.on_step(rank, ctl.plan.batches[rank], float(t[rank]))
        if ctl.ready:
            adj = ctl.replan()
            decisions.append((step, adj.reason, adj.rule))
    return plans, decisions


def uniform(n, total):
    return np.asarray(integerize(np.full(n, total / n), total, 1, total), dtype=np.float64)


def oracle(a, c, total):
    lines = list(zip(a, c))
    return tuple(integerize(equal_time(lines, total, 1, total), total, 1, total, lines))


def starved(who, seconds, start, end):
    """Worker `who`, starved of CPU from step `start` to `end`: each of its steps takes at
    least `seconds`, whatever its batch (an emulated device pads real compute to its time)."""
    def noise(step, b, t):
        t = t.copy()
        if start <= step <= end:
            t[who] = max(t[who], seconds)
        return t
    return noise


def slowed(who, factor, start, end):
    def noise(step, b, t):
        t = t.copy()
        if start <= step <= end:
            t[who] *= factor
        return t
    return noise


# -- the plans' measured times ------------------------------------------------------------

def test_the_newest_window_counts_and_two_that_agree_make_a_plan_worse():
    ran = PlanMemory()
    a, b = (21, 20, 19), (20, 20, 20)
    assert not ran.ran_slower(a, b, 0.01) and ran.best() is None  # neither ran
    ran.record(a, 0.0300)
    ran.record(b, 0.0302)
    assert ran.ran_slower(a, b, 0.01)  # not 1 % faster: no reason to go back to it
    ran.record(b, 0.0310)  # the newest measurement counts
    assert not ran.ran_slower(a, b, 0.01) and ran.ran_slower(b, a, 0.01)
    assert ran.best() == (a, 0.0300)
    assert ran.best(lambda plan: plan != a) == (b, 0.0310)
    slow = (30, 20, 10)
    ran.record(slow, 0.05)
    assert not ran.worse(slow, 0.03)  # one window: it may have fallen in a noise that passed
    ran.record(slow, 0.051)
    assert ran.worse(slow, 0.03) and not ran.worse(slow, 0.051 / (1 + REGRET))
    ran.record(slow, 0.03)  # a window that disagrees starts the count again
    assert ran.step_s(slow) == 0.03 and not ran.worse(slow, 0.01)


def test_a_plan_measured_again_change_apart_makes_every_plan_s_time_old_news():
    """A plan gone back to measured 20 % off its remembered time: the speeds changed since
    (under CPU quotas a neighbour's hog sent the plan back to one measured before it, measured
    it 2.2x slower, and went back to another measured before it), so no plan measured then is
    one to go back to."""
    ran = PlanMemory()
    a, b = (21, 24, 17, 66), (26, 20, 15, 67)
    ran.record(a, 1.25)
    ran.record(b, 1.60)
    ran.record(a, 1.25 * (1 + REGRET))  # noise: both kept, the newest counts
    assert b in ran and ran.step_s(a) == 1.25 * (1 + REGRET)
    ran.record(a, 2.81)
    assert b not in ran and ran.best() == (a, 2.81)


def test_measurements_are_forgotten_after_forget_windows():
    ran = PlanMemory()
    ran.record((1, 2), 0.5)
    for _ in range(FORGET_WINDOWS - 1):
        ran.record((2, 1), 0.1)
    assert (1, 2) in ran
    ran.record((2, 1), 0.1)
    assert (1, 2) not in ran and ran.step_s((2, 1)) == 0.1 and len(ran) == 1
    ran.clear()
    assert len(ran) == 0


def test_the_plan_to_go_back_to_is_one_measured_lately():
    ran = PlanMemory()
    ran.record((1, 2), 0.1)
    for _ in range(BACK_WINDOWS - 1):
        ran.record((2, 1), 0.5)
    assert ran.best(within=BACK_WINDOWS) == ((1, 2), 0.1)
    ran.record((2, 1), 0.5)
    assert ran.best(within=BACK_WINDOWS) == ((2, 1), 0.5) and ran.best() == ((1, 2), 0.1)


def test_a_change_of_workers_forgets_the_plans_measured():
    job = JobSpec(num_workers=3, global_batch=60, batching="dynamic", adjust_every=4)
    ctl = BatchControl(job, BatchPlan(0, (20, 20, 20)))
    ctl.ran.record((20, 20, 20), 1.0)
    ctl.resize([0, 1])
    assert len(ctl.ran) == 0


# -- the lock-ins, reproduced ---------------------------------------------------------------

A, C = [0.001] * 3, [0.001, 0.002, 0.004]  # 1, 2 and 4 ms a sample


def test_a_worker_starved_for_a_while_is_not_left_at_one_sample():
    """The 2 ms worker starved (60 ms a step whatever its batch) for 36 steps: its batch falls,
    as it should, to a sample or two. Its line then rests on points measured while it was starved,
    far from the one sample it is measured at from then on: before, nothing corrected them and
    it stayed there for good ([38, 1, 25] for 112 steps was seen on a busy host)."""
    plans, decisions = drive(A, C, 64, starved(1, 0.060, 5, 40))
    assert min(p[1] for p in plans[5:41]) <= 2  # the plan follows the starved worker
    best = oracle(A, C, 64)
    assert all(p == best for p in plans[41 + 3 * ADJUST_EVERY:]), plans[41:]


def test_one_window_of_noise_does_not_put_a_worker_at_the_minimum_batch():
    """Worker 1 reports 20x its time for the steps of one window: its batch halves, and no
    more, on that one window's word; the next window, back to normal, undoes the move."""
    plans, decisions = drive(A, C, 64, slowed(1, 20.0, 5, 14))
    start = plans[0]
    assert min(p[1] for p in plans) >= start[1] // 2, sorted({p for p in plans})
    assert any("not put at the minimum batch" in rule for _, _, rule in decisions), decisions
    assert plans[-1] == oracle(A, C, 64)


def test_one_slow_step_does_not_move_the_start_plan():
    """The issue's first lock-in began with one step of the fast worker 6x slow right after the
    probe: the first window (FIRST_WINDOW steps, a median) outvotes it."""
    a, c = [0.001, 0.001], [0.002, 0.001]
    plans, _ = drive(a, c, 64, slowed(1, 6.0, 1, 1), steps=60)
    assert set(plans) == {oracle(a, c, 64)}


def test_a_plan_measured_on_one_first_step_is_not_gone_back_to():
    """Under CPU quotas at HL1 the probe planned [27, 31, 38, 32] for four equal workers, its first
    step missed the probe's guesses and re-planned at once, and the next plan's window ran while one
    worker was slow: the regret guard went back to the probe's plan on its one step (a warm-up's
    measurement) and held it 18 steps. A plan measured only on first steps is no plan to go back to.
    (Here the probe is further off, its guesses for workers 0 and 2 beyond FIRST_MISS of their first
    steps: those nearer no longer re-plan on first steps.)"""
    a, c = [0.1] * 4, [0.04] * 4
    probe_plan = (18, 30, 48, 32)
    plans, decisions = drive(a, c, 128, slowed(0, 1.3, 2, 12), steps=60, probe_c=[0.065, 0.04, 0.025, 0.038])
    assert plans[:3] == [probe_plan] * 3 and decisions[0][0] == 2  # decided on its first two measured steps
    assert probe_plan not in plans[3:] and not any(reason == "regret" for _, reason, _ in decisions)
    assert plans[-1] == oracle(a, c, 128)


def test_a_worker_s_change_of_speed_makes_the_plans_measured_before_it_old_news():
    """The cgroup benchmark's neighbour, alone: worker 3 ran 1.4x slower for four steps and a
    decision moved 12 samples off it, then the hog tripled worker 0's time under the new plan. The
    change was seen, but the regret guard went back to the plan measured before the hog (1.16 s,
    against 2.29 s measured under it) and held it 12 steps with worker 0 at 2.1-2.9 s where the
    others took 0.8. A worker's change of speed seen in its window makes every plan's time old news,
    as one seen from window to window does (regret.Seen)."""
    a, c = [0.05] * 4, [0.033, 0.034, 0.055, 0.011]

    def noise(step, b, t):
        t = t.copy()
        if 25 <= step <= 28:
            t[3] *= 1.45
        if step >= 33:
            t[0] *= 3
        return t

    plans, decisions = drive(a, c, 128, noise, steps=60)
    assert plans[30] != plans[20]  # worker 3's slow steps moved the plan
    hog = [reason for step, reason, _ in decisions if step >= 33]
    assert hog and "regret" not in hog, decisions
    hogged = (3 * a[0], 3 * c[0]), *zip(a[1:], c[1:])
    best = max(ai + ci * bi for (ai, ci), bi in zip(hogged, oracle(*zip(*hogged), 128)))
    first = next(step for step, _, _ in decisions if step >= 33) + 2  # a decision is used from the step after next
    assert all(max(ai + ci * bi for (ai, ci), bi in zip(hogged, p)) < 1.2 * best for p in plans[first:])


def test_a_worker_whose_time_jumps_at_a_batch_does_not_make_the_plan_go_back_and_forth():
    """Worker 2 takes 40 ms more from 16 samples on (a CPU quota running out mid-step: no line
    fits it). The models keep proposing an even split that crosses the jump; once measured
    slower twice it is not taken again until forgotten, and the plan stays near the best."""
    a, c = [0.001] * 3, [0.001] * 3

    def quota(step, b, t):
        return t + 0.040 * (np.arange(3) == 2) * (b >= 16)

    plans, decisions = drive(a, c, 64, quota, steps=400)
    true = [max(a[i] + c[i] * p[i] + 0.040 * (i == 2 and p[i] >= 16) for i in range(3)) for p in plans]
    best = min(true)
    assert np.mean(true[100:]) < 1.25 * best, (np.mean(true[100:]), best)
    assert any(reason == "regret" for _, reason, _ in decisions)


def test_steps_noisy_by_a_quota_still_fill_windows_and_the_plan_follows():
    """Under a CPU quota a worker's steps at one batch took 23 to 70 ms, with no change of speed
    (the cgroup benchmark, 10 ms periods). With a fixed 20 % tolerance most steps were outliers
    or, three to one side, a "change" that restarted the window: after the first window no
    window filled, and a plan with the slowest worker 3x slower than the others held for 55
    steps. Here the probe (short passes that fit in the quota) takes worker 2 for fast; every
    step is off its line by up to -40 %/+50 %. The controller keeps deciding, and settles near
    the best plan: over 30 noise draws, its plans' steps from step 100 on average under 1.2x
    the best plan's (one draw's average lies anywhere in 1.09-1.30x: over six, the mean of
    a rule as good moved 0.03 with the draws)."""
    a, c = [0.0] * 4, [0.0027, 0.0026, 0.0037, 0.0010]
    best = max(ci * bi for ci, bi in zip(c, oracle(a, c, 128)))
    settled = []
    for seed in range(30):
        factors = np.random.default_rng(seed).uniform(0.6, 1.5, size=(300, 4))
        plans, decisions = drive(a, c, 128, lambda step, b, t: t * factors[step], steps=300,
                                 probe_c=[0.0027, 0.0026, 0.0015, 0.0010])
        steps = [step for step, _, _ in decisions]
        # decisions go on (before: 5, then 113), a window's outliers left out of it (the longest gap
        # over the 30 draws: 22 steps while a suspect widened the tolerance that judged the next step,
        # 39 since it does not: windows/StepNoise; over 100 draws 44, and 46 once a change past FAR
        # left out its partial steps: each rule moves every decision after its first, and the longest
        # gap with them; this noise, 1 step in 9 more than 1.4x off, is far wider than the cgroup
        # runs' now, 78 of 55,907 steps 1.5x off their last 9)
        assert max(np.diff(steps)) <= 5 * ADJUST_EVERY, steps
        true = [max(ci * bi for ci, bi in zip(c, p)) for p in plans]
        assert true[0] > 1.4 * best  # the probe's plan is far off (it overloads worker 2)
        settled.append(np.mean(true[100:]) / best)
    assert np.mean(settled) < 1.2, settled


def test_a_noisy_worker_twice_as_fast_at_once_re_plans_within_change_steps():
    """Under CPU quotas a neighbour's hog halved worker 0's share: at 13 samples its steps took
    0.85-1.98 s, the others' about 1.3 s. The hog gone, its steps took 0.53-0.70 s. Its spread
    read as differences made a tolerance of 54 %, and 0.64 s near 1.27 (50 % less): the plan
    waited for a full window, 8 steps at 1.3 s where the new speeds allow about 1.15. Read
    as factors (a tolerance of 1.67x), 1.27 over 0.64 is 1.98x: a change."""
    ran = [1.975, 1.313, 1.268, 1.271, 1.12, 1.577, 1.046, 1.027, 0.849, 1.421, 1.432, 1.335, 1.335,
           1.35, 1.207, 1.165, 1.534, 1.27, 1.272]  # worker 0's steps under the hog, as they ran
    after = [0.642, 0.525, 0.627, 0.61, 0.559, 0.696, 0.599, 0.677, 0.671]  # and once it was gone
    others = [1.3 / 26, 1.3 / 18, 1.3 / 71]  # seconds per sample: 1.3 s at their batches
    job = JobSpec(num_workers=4, global_batch=128, batching="dynamic", adjust_every=ADJUST_EVERY)
    ctl = BatchControl(job, BatchPlan(0, (13, 26, 18, 71)))
    for k, t in enumerate(ran + after):
        for rank, b in enumerate(ctl.plan.batches):
            ctl.on_step(rank, b, t if rank == 0 else others[rank - 1] * b)
        if ctl.ready:
            ctl.replan()
            if k < len(ran):
                ctl.plan = BatchPlan(ctl.plan.gen + 1, (13, 26, 18, 71))  # held, as it was in the run
            else:
                break
    assert k - len(ran) + 1 == CHANGE_STEPS and ctl.plan.batches[0] > 20, (k, ctl.plan)


SCHEDULES = [(cs, kind, who, size, start, end)
             for cs in ([0.002, 0.001], [0.001, 0.002, 0.004], [0.001, 0.001, 0.001])
             for kind in ("slowed", "starved") for who in range(len(cs))
             for size in ((3.0, 20.0) if kind == "slowed" else (0.03, 0.12))
             for start, end in ((1, 3), (5, 40), (1, 100))]


@pytest.mark.parametrize("cs, kind, who, size, start, end", SCHEDULES)
def test_no_plan_slower_than_uniform_batches_holds_for_more_than_two_windows(cs, kind, who, size, start, end):
    """Against equal batches under the same noise at the same step: a plan more than 2 % slower
    holds for two windows at most (plus the steps that show a change of speed)."""
    n = len(cs)
    a = [0.001] * n
    noise = (slowed if kind == "slowed" else starved)(who, size, start, end)
    plans, _ = drive(a, cs, 64, noise)
    even = uniform(n, 64)
    run = longest = 0
    for step, p in enumerate(plans):
        b = np.asarray(p, dtype=np.float64)
        slower = noise(step, b, np.asarray(a) + np.asarray(cs) * b).max() > 1.02 * noise(
            step, even, np.asarray(a) + np.asarray(cs) * even).max()
        run = run + 1 if slower else 0
        longest = max(longest, run)
    assert longest <= 2 * ADJUST_EVERY + CHANGE_STEPS, (longest, plans)


def window(ctl, times, pattern=(1.0,)):
    """A full window of every worker at its batch in the plan (its first step unmeasured), each
    step's time off `times` by `pattern` in turn."""
    for rank, t in enumerate(times):
        for i in range(ADJUST_EVERY):
            ctl.on_step(rank, ctl.plan.batches[rank], t * pattern[i % len(pattern)])
    assert ctl.ready
    return ctl.replan()


def test_two_steps_a_little_off_the_model_re_plan_nothing_and_a_third_does():
    """Under CPU quotas at HL8 (benchmarks/cgroup.py) a worker's steps in a new window ran 0.76,
    0.97 and 0.96 s on its model's 0.66 (the window's own noise let them in): two steps 1.46x the
    model were taken for a change of speed, and the plan cut the worker from 9 samples to 6 for
    a window, then went back. Below SMALL_CHANGE a third step decides."""
    job = JobSpec(num_workers=4, global_batch=128, batching="dynamic", adjust_every=ADJUST_EVERY)
    plan = (15, 14, 9, 90)
    ctl = BatchControl(job, BatchPlan(0, plan))
    for _ in range(3):
        window(ctl, [0.66] * 4, pattern=(1.0, 1.08, 0.92))  # noisy workers, settled
    assert ctl.plan.batches == plan
    for t in (0.66, 0.76):
        step(ctl, [0.66, 0.66, t, 0.66])
    for k in range(2):
        step(ctl, [0.66, 0.66, 0.965, 0.66])
        assert not ctl.ready
    step(ctl, [0.66, 0.66, 0.965, 0.66])
    assert ctl.ready  # the third step 1.46x: a change
    ctl.replan()
    assert ctl.plan.batches[2] < 9


def step(ctl, times):
    for rank, t in enumerate(times):
        ctl.on_step(rank, ctl.plan.batches[rank], t)


def test_a_worker_slower_at_a_smaller_batch_changed_speed_and_the_plans_before_are_forgotten():
    """Under CPU quotas 9/9/6/24, as a neighbour's hog took half of worker 0's share, the plan cut
    its batch from 25 to 22 samples (12 %, too far to compare the two windows scaled) and its
    window took 2.58 s where 25 samples had taken 1.36. Its model, not trusted at 22, saw no
    change either, and the plan went back to [25, 26, 16, 61], measured before the hog, then to
    another plan measured before it: 24 steps at about 2.6 s. Fewer samples in more time is a
    change of speed, whatever the distance."""
    job = JobSpec(num_workers=4, global_batch=128, batching="dynamic", adjust_every=ADJUST_EVERY)
    ctl = BatchControl(job, BatchPlan(0, (24, 20, 15, 69)))
    for plan, times in [((24, 20, 15, 69), [1.398, 1.158, 1.332, 1.496]),
                        ((25, 26, 16, 61), [1.361, 1.364, 1.317, 1.163]),
                        ((22, 24, 15, 67), [2.582, 1.286, 1.236, 1.305])]:
        ctl.plan = BatchPlan(ctl.plan.gen + 1, plan)  # (as the models set it in the run)
        adj = window(ctl, times)
    assert adj.reason != "regret" and len(ctl.ran) == 1, adj  # only the window after the change
    assert ctl.plan.batches[0] <= 12, ctl.plan  # half its batch, or less: it runs at half its speed


def test_a_change_of_speed_seen_across_a_small_move_forgets_the_plans_measured_before_it():
    """Worker 1 moved from 34 to 32 samples as its CPU quota was cut (the cgroup test saw
    it): 48 ms where 34 samples took 8.7. Measured against its window at 34, scaled, that is
    a change of speed, and the plans measured before it are no guide: no going back to one."""
    job = JobSpec(num_workers=2, global_batch=64, batching="dynamic", adjust_every=ADJUST_EVERY)
    ctl = BatchControl(job, BatchPlan(0, (30, 34)))
    window(ctl, [0.0077, 0.0087])
    ctl.plan = BatchPlan(1, (32, 32))  # (as if the models had moved it)
    adj = window(ctl, [0.0079, 0.048])
    assert adj.reason != "regret" and len(ctl.ran) == 1, adj  # only the window after the change
    assert ctl.plan.batches[0] > 50  # the new equal-time plan


@pytest.mark.parametrize("slow_steps", [2, 100])
def test_slow_steps_just_after_a_worker_s_batch_grew_begin_no_change_of_speed(slow_steps):
    """Under CPU quotas worker 3's batch went from 44 to 45 samples; its first two measured steps
    there took 1.75 and 1.71 s, 1.3x its model's time, and the next 1.41. Read as a change of
    speed, they moved the plan to [37, 37, 21, 33] for the 16 steps its next window took. The
    first measured step at a new size may still warm up: it begins no change. A worker slower
    for good is still seen, two steps later: on the three far-off steps after it (1.3x is a
    small change, windows.SMALL_CHANGE)."""
    job = JobSpec(num_workers=4, global_batch=128, batching="dynamic", adjust_every=ADJUST_EVERY)
    per_sample = np.array([1.3 / 32, 1.3 / 32, 1.3 / 21, 1.3 / 43])  # 1.3 s a step at [32, 32, 21, 43]
    ctl = BatchControl(job, BatchPlan(0, (34, 28, 22, 44)))
    window(ctl, per_sample * (34, 28, 22, 44))
    ctl.plan = BatchPlan(ctl.plan.gen + 1, (31, 31, 21, 45))  # (as the models set it in the run)
    moved = np.asarray(ctl.plan.batches, dtype=np.float64)
    for k in range(3 * ADJUST_EVERY):  # k: the step at the new size (0: its warm-up, unmeasured)
        times = per_sample * moved
        times[3] *= 1.3 if 1 <= k <= slow_steps else 1.0
        for rank, t in enumerate(times):
            ctl.on_step(rank, int(moved[rank]), float(t))
        if ctl.ready:
            break
    assert ctl.ready, k
    ctl.replan()
    if slow_steps == 2:  # a full window decides, on its median: worker 3 keeps its share
        assert k >= ADJUST_EVERY - 1 and ctl.plan.batches[3] >= 43, (k, ctl.plan)
    else:  # its second to fourth measured steps at 45 are a change of speed
        assert k == 4 and ctl.plan.batches[3] < 40, (k, ctl.plan)


def test_a_lasting_change_of_speed_forgets_the_plans_measured_before_it():
    """Worker 1 turns 6x slower for good at step 30 (a quota cut, a neighbour that stays): the
    plans measured before are no guide any more. Going back to one (it measured fast, then)
    costs a window each; the plan goes to the new equal-time one instead."""
    a, c = [0.001, 0.001], [0.001, 0.001]
    plans, decisions = drive(a, c, 64, slowed(1, 6.0, 30, 10_000), steps=120)
    after = [(step, reason, rule) for step, reason, rule in decisions if step >= 30]
    assert not any("back to it" in rule for _, _, rule in after), after
    slower = [a[0], a[1] * 6], [c[0], c[1] * 6]
    assert plans[-1] == oracle(*slower, 64) and all(p == plans[-1] for p in plans[30 + 4 * ADJUST_EVERY:])


def test_a_worker_s_tolerance_is_its_own_noise_and_twenty_percent_at_least():
    from omnips.scheduler.windows import MIN_REPORTS, StepNoise
    from omnips.timemodel import CHANGE
    noise = StepNoise(2)
    rng = np.random.default_rng(1)
    for t in 0.050 * rng.uniform(0.98, 1.02, 16):
        noise.add(0, float(t))  # steady: the fixed tolerance
    for t in 0.050 * rng.uniform(0.6, 1.5, 16):
        noise.add(1, float(t))  # a quota's noise: its own, wider
    assert noise.tolerance(0) == CHANGE
    wide = noise.tolerance(1)
    assert wide > 2 * CHANGE
    noise.restart(1, [0.1] * (MIN_REPORTS - 1))  # a move: too few reports since to say, the last estimate stands
    assert noise.tolerance(1) == wide
    noise.forget(1)  # a new worker at the rank
    assert noise.tolerance(1) == CHANGE


def test_a_slow_drift_does_not_send_the_plan_back_to_plans_measured_before_it():
    """A quarter of 16 workers slows down by 2 % a window from step 100, compounding, each step
    within 5 % noise (the simulator's drift, benchmarks/simulate.py). No window-to-window check
    sees such a change, so every plan measured before it looks faster than the plan in force:
    going back to such plans (from up to 24 windows back) cost a window each, 4 times over the
    last 50 steps, whose plans were then 25 % slower than the oracle's (9 % now); only a plan
    measured lately is gone back to."""
    n, start, per_step = 16, 100, 1.02 ** (1 / ADJUST_EVERY)
    rng = np.random.default_rng(3)
    a, c = rng.uniform(0.0005, 0.0025, n), rng.uniform(0.0005, 0.002, n) / rng.uniform(1, 8, n)
    slow = rng.choice(n, n // 4, replace=False)
    jitter = rng.uniform(-0.05, 0.05, (300, n))

    def speed(step):
        f = np.ones(n)
        f[slow] = per_step ** max(0, step - start)
        return f

    plans, decisions = drive(a, c, 32 * n, lambda step, b, t: t * (1 + jitter[step]) * speed(step), steps=300)
    back = [(step, rule) for step, reason, rule in decisions if step >= start and "back to it" in rule]
    assert len(back) <= 1, back
    late = []
    for step in range(250, 300):
        f = speed(step)
        true = np.max(f * (a + c * np.asarray(plans[step])))
        late.append(true / np.max(f * (a + c * np.asarray(oracle(f * a, f * c, 32 * n)))))
    assert np.mean(late) < 1.15, np.mean(late)


def test_a_slow_first_step_at_a_new_batch_moves_no_samples_off_the_worker():
    """Workers with HL8's speeds under the exact plan; a plan moves worker 0 by a sample, and its
    first measured steps there run 1.66x, 0.99x and 1.4x its model's time (the cold start of a
    new size, the host's noise), as in the cgroup benchmark: taken as it was, the first made the
    second the outlier, two steps 1.53x at the median were a change, and the plan moved 5 of
    its 14 samples off it. Judged by the model, they change nothing until the window is full,
    and the plan stays within a sample."""
    a, c = np.array([0.04, 0.04, 0.065, 0.02]), np.array([0.047, 0.047, 0.07, 0.00787])
    job = JobSpec(num_workers=4, global_batch=128, batching="dynamic", adjust_every=ADJUST_EVERY, max_steps=1000)
    ctl = BatchControl(job, BatchPlan(0, (32,) * 4))
    ctl.probed({r: ([2, 4], [a[r] + 2 * c[r], a[r] + 4 * c[r]]) for r in range(4)}, {})
    for _ in range(2):  # exact windows: the models trusted at the plan's batches
        window(ctl, a + c * np.array(ctl.plan.batches))
    b = list(ctl.plan.batches)
    b[0], b[3] = b[0] + 1, b[3] - 1
    ctl.plan = BatchPlan(ctl.plan.gen + 1, tuple(b))
    noise = [1.0, 1.66, 0.99, 1.4] + [1.0] * (ADJUST_EVERY - 2)  # (the first: the warm-up; two suspects)
    for k, factor in enumerate(noise):
        step(ctl, (a + c * np.array(b)) * [factor, 1.0, 1.0, 1.0])
        assert not ctl.ready or k == len(noise) - 1, k
    assert ctl.ready
    ctl.replan()
    assert abs(ctl.plan.batches[0] - b[0]) <= 1, ctl.plan.batches


def equal_workers() -> BatchControl:
    """Four workers probed alike, at 32 samples each of 128."""
    job = JobSpec(num_workers=4, global_batch=128, batching="dynamic", adjust_every=ADJUST_EVERY, max_steps=1000)
    ctl = BatchControl(job, BatchPlan(0, (32,) * 4))
    ctl.probed({r: ([2, 4], [0.1, 0.165]) for r in range(4)}, {})
    return ctl


def test_a_slowdown_of_the_whole_host_seen_a_step_later_on_one_worker_moves_no_samples():
    """Four equal workers at 32 samples under CPU quotas (benchmarks/cgroup.py, HL1): the host
    slowed from about 1.08 s a step to 1.45. Workers 0, 1 and 3 crossed their tolerance two steps
    running, worker 2 only on the second (1.19 s, then 1.48): its window, measured before the
    slowdown, made it look 30 % faster than the others, and the plan gave it their samples. At
    the host's pace no worker's speed changed: nothing is decided at once, and the window the
    slower host fills leaves the plan."""
    ctl = equal_workers()
    assert ctl.plan.batches == (32,) * 4
    rng = np.random.default_rng(0)
    for _ in range(3 * ADJUST_EVERY):  # steady windows: the models learn 1.08 s at 32 samples
        for rank, t in enumerate(1.08 * (1 + rng.uniform(-0.02, 0.02, 4))):
            ctl.on_step(rank, 32, float(t))
        if ctl.ready:
            ctl.replan()
    assert ctl.plan.batches == (32,) * 4 and not ctl.ready
    for times in ([1.32, 1.47, 1.19, 1.36], [1.44, 1.43, 1.48, 1.46]):
        for rank in range(4):
            ctl.on_step(rank, 32, times[rank])
    assert not ctl.ready
    for step in range(ADJUST_EVERY):
        for rank, t in enumerate(1.45 * (1 + rng.uniform(-0.02, 0.02, 4))):
            ctl.on_step(rank, 32, float(t))
        if ctl.ready:
            break
    assert ctl.ready and step < ADJUST_EVERY - 1, step  # the window restarted from the slower steps
    ctl.replan()
    assert max(abs(b - 32) for b in ctl.plan.batches) <= 1, ctl.plan.batches


@pytest.mark.parametrize("ratios, change", [
    ([[0.74, 0.81], [0.77, 0.81], [0.71, 0.76], [0.84, 0.86]], False),  # the host ran faster (beside other jobs)
    ([[1.30, 1.27], [0.98, 1.05], [1.21, 1.24], [1.17, 1.14]], False),  # and slower
    ([[2.17, 2.12], [1.02, 1.08], [1.08, 1.07], [1.08, 1.17]], True),  # a neighbour's hog in worker 0's cgroup
    ([[1.04, 0.91], [0.96, 0.89], [1.06, 0.93], [1.98, 1.83]], True),  # worker 3's quota halved
])
def test_a_change_of_speed_is_a_worker_s_own_not_the_host_s(ratios, change):
    """Two steps of every worker, as times over its model's, from cgroup runs with three jobs
    on the host: a worker whose steps crossed its tolerance while the others' moved with it
    did not change speed (two such re-planned on partial windows); one that moved alone did."""
    ctl = equal_workers()
    for _ in range(3):
        window(ctl, [1.08] * 4)
    assert ctl.plan.batches == (32,) * 4 and not ctl.ready
    for step in range(2):
        for rank in range(4):
            ctl.on_step(rank, 32, 1.08 * ratios[rank][step])
    assert ctl.ready == change


def test_a_window_the_whole_host_ran_slower_leaves_the_plan_of_equal_workers():
    """Four equal workers, and a window in which the host ran 19-25 % slower: worker 0's time
    stays just under the 20 % that rescales a model, the others' just over it (their steps
    far off only every other step, so no change of speed is seen). Read as the workers' own
    speeds, worker 0 looked faster and was given the others' samples; it is the host's pace."""
    ctl = equal_workers()
    for _ in range(3):
        window(ctl, [1.08] * 4)
    assert ctl.plan.batches == (32,) * 4
    for step in range(ADJUST_EVERY):
        for rank in range(4):
            ctl.on_step(rank, 32, 1.08 * (1.19 if rank == 0 else 1.25 if step % 2 else 1.18))
    assert ctl.ready
    ctl.replan()
    assert max(abs(b - 32) for b in ctl.plan.batches) <= 1, ctl.plan.batches


@pytest.mark.parametrize("ratios, pace", [
    ([1.2, 1.31, 1.27, 1.24], 1.255),  # the whole host slower
    ([0.8, 0.85, 0.82, 0.88], 0.835),  # and faster again
    ([1.3, 1.0, 1.02, 0.98], 1.0),  # one worker's own change
    ([1.3, 1.3, 1.0, 1.0], 1.0),  # two workers' own
    ([1.3, 1.3], 1.0),  # too few to tell
])
def test_the_host_s_pace_is_the_median_only_where_the_workers_moved_together(ratios, pace):
    assert host_pace(np.asarray(ratios)) == pytest.approx(pace)

# steps about 7 % apart (a robust standard deviation of their logarithms), as under CPU quotas
NOISY = (0.95, 1.0, 1.05)


def test_two_windows_a_few_samples_apart_give_a_noisy_worker_no_slope():
    """Under CPU quotas 9/9/6/24 worker 2's windows at 13 and 15 samples took 1.442 and 1.463 s
    (medians of steps several % apart): a line through them has a fixed cost of 1.3 s and 0.01 s a
    sample, and the next plan gave the worker 19 samples of 128 (steps of 1.61 s where the plan
    before measured 1.18; 12 steps until the plan went back). Two sizes 13 % apart are no slope
    for steps that noisy: the worker keeps its throughput's share."""
    job = JobSpec(num_workers=4, global_batch=128, batching="dynamic", adjust_every=ADJUST_EVERY)
    ctl = BatchControl(job, BatchPlan(0, (23, 22, 13, 70)))
    window(ctl, [1.66, 1.569, 1.442, 1.748], NOISY)
    ctl.plan = BatchPlan(ctl.plan.gen + 1, (23, 23, 15, 67))  # (as in the run)
    adj = window(ctl, [1.383, 1.504, 1.463, 1.453], NOISY)
    assert 14 <= ctl.plan.batches[2] <= 16, (ctl.plan, adj)
    assert adj.decision.targets[2] == pytest.approx(15 * 1.453 / 1.463, abs=1.0)


def test_the_same_two_sizes_give_a_quiet_worker_its_slope():
    """Steps within a fraction of a % of each other: 13 and 15 samples are enough for a line."""
    job = JobSpec(num_workers=2, global_batch=28, batching="dynamic", adjust_every=ADJUST_EVERY)
    ctl = BatchControl(job, BatchPlan(0, (13, 15)))
    window(ctl, [1.0 + 0.1 * 13, 0.1 * 15], (0.999, 1.0, 1.001))
    ctl.plan = BatchPlan(ctl.plan.gen + 1, (15, 13))
    window(ctl, [1.0 + 0.1 * 15, 0.1 * 13], (0.999, 1.0, 1.001))
    a, c = ctl.models.lines(np.array([0]))[0]
    assert (a, c) == (pytest.approx(1.0, rel=0.05), pytest.approx(0.1, rel=0.05))
    assert 0 < ctl._windows.noise.spreads([0])[0] < 0.01  # its noise measured, and small
