"""The OmniLearn controller in closed loop, simulated: time models (omnips/timemodel.py)
fed exact or noisy step times and `decide` (omnips/batching.py), converging on the
equal-time plan and held there by the deadband."""

import random

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from omnips.batching import decide, initial_batches

from controller_helpers import DEADBAND, SEARCH, TimeModel, exact_plan, off_by


# the brief's strong-overhead cluster: two workers with a big fixed cost per step, two without
STRONG = ([50.0, 50.0, 1.0, 1.0], [0.5, 1.0, 2.0, 4.0], 128)


class Cluster:
    """Workers whose step takes t_i(b) = a_i + c_i*b; each window feeds every worker's time
    into its TimeModel and asks `decide` for the next plan (bounds [1, total])."""

    def __init__(self, a, c, total, affine=True, deadband=DEADBAND):
        self.a, self.c, self.total, self.deadband = list(a), list(c), total, deadband
        self.models = [TimeModel(affine=affine) for _ in a]
        self.batches = initial_batches("uniform", total, [1] * len(a))
        self.changes = 0

    def window(self, noise=None) -> bool:
        """One measurement window and decision; True when the plan changed."""
        for i, model in enumerate(self.models):
            t = self.a[i] + self.c[i] * self.batches[i]
            model.observe(self.batches[i], t * (noise() if noise else 1.0))
        d = decide(self.batches, [m.line() for m in self.models], self.total, 1, self.total, self.deadband)
        if d.batches is None or list(d.batches) == self.batches:
            return False
        assert sum(d.batches) == self.total and min(d.batches) >= 1
        self.batches = list(d.batches)
        self.changes += 1
        return True


def adjustments_to_settle(a, c, total, affine=True, limit=30):
    """Plan changes until a fixed point: `decide` keeps the plan, or the plan is within one
    sample of the exact equal-time plan. None if neither happens within `limit` windows."""
    cluster, target = Cluster(a, c, total, affine), exact_plan(a, c, total)
    if off_by(cluster.batches, target) <= 1:
        return 0
    for _ in range(limit):
        if not cluster.window():
            return cluster.changes
        if off_by(cluster.batches, target) <= 1:
            return cluster.changes
    return None


def adjustments_to_reach(a, c, total, affine=True, limit=30):
    """Plan changes until the plan is within one sample of the exact equal-time plan (None: never)."""
    cluster, target = Cluster(a, c, total, affine), exact_plan(a, c, total)
    for _ in range(limit + 1):
        if off_by(cluster.batches, target) <= 1:
            return cluster.changes
        cluster.window()
    return None


@st.composite
def clusters(draw):
    """2..8 workers, overheads 1..50 ms, 0.1..5 ms a sample, a global batch of 8n..512."""
    n = draw(st.integers(2, 8))
    a = draw(st.lists(st.floats(1.0, 50.0), min_size=n, max_size=n))
    c = draw(st.lists(st.floats(0.1, 5.0), min_size=n, max_size=n))
    total = draw(st.integers(8 * n, 512))
    return a, c, total


# -- convergence -------------------------------------------------------------------------

def test_affine_controller_reaches_the_equal_time_plan_where_the_proportional_one_stops_short():
    a, c, total = [40.0, 2.0, 2.0], [0.5, 1.0, 2.0], 96
    # real plan 22.3, 49.1, 24.6 (51.1 ms each): the spare sample goes where it adds least,
    # 23 (51.5 ms), not to the largest remainder, 25 (52 ms)
    assert exact_plan(a, c, total) == [23, 49, 24]
    assert adjustments_to_reach(a, c, total, affine=True) == 2
    # the proportional rule under-shoots, and the deadband stops it 3 samples short
    assert adjustments_to_reach(a, c, total, affine=False) is None
    cluster = Cluster(a, c, total, affine=False)
    for _ in range(20):
        cluster.window()
    assert cluster.batches == [25, 47, 24]


def test_strong_overheads_affine_beats_proportional():
    a, c, total = STRONG
    target = exact_plan(a, c, total)
    assert target == [49, 24, 37, 18]
    affine = adjustments_to_reach(a, c, total, affine=True)
    proportional = adjustments_to_reach(a, c, total, affine=False)
    # three, not two: worker 1 moves 32 -> 31 first, too little (< 10 %) for a fit
    assert affine is not None and affine <= 3
    assert proportional is None or proportional > affine
    assert proportional is None  # it never gets there: the deadband freezes it
    # and the affine plan, once there, stays there
    cluster = Cluster(a, c, total)
    for _ in range(20):
        cluster.window()
    assert cluster.batches == target
    stuck = Cluster(a, c, total, affine=False)
    for _ in range(20):
        stuck.window()
    assert off_by(stuck.batches, target) > 1


@pytest.mark.slow  # 200 clusters searched
@SEARCH
@given(cluster=clusters())
def test_affine_converges_in_two_adjustments_when_first_moves_allow_a_fit(cluster):
    """With every worker's first move spanning >= 10 % (so that every model can fit a
    line at the second decision), the second adjustment lands on the equal-time plan."""
    a, c, total = cluster
    first = Cluster(a, c, total)
    start = list(first.batches)
    first.window()
    assume(all(abs(x - y) >= 0.1 * max(x, y) for x, y in zip(start, first.batches)))
    settled = adjustments_to_settle(a, c, total)
    assert settled is not None and settled <= 2, (settled, exact_plan(a, c, total))


@pytest.mark.slow  # 200 clusters searched
@SEARCH
@given(cluster=clusters())
def test_affine_converges_in_at_most_four_adjustments(cluster):
    """Two when the first move gives every worker a fit (next test); a worker that
    first moves by under 10 % is still on its proportional line at the second, and one
    that moves by under 10 % twice at the third (of 10,000 random clusters: 2 or fewer
    in 93 %, 3 in 7 %, 4 in 0.1 %)."""
    a, c, total = cluster
    settled = adjustments_to_settle(a, c, total)
    assert settled is not None and settled <= 4, (settled, exact_plan(a, c, total))


def test_no_rebalancing_behind_a_worker_held_at_its_lower_bound():
    # worker 0's fixed cost alone (48.8 ms) exceeds the others' equal time: at one sample it
    # is the slowest whatever the plan, so moving samples among the others buys nothing
    a = [48.84, 22.31, 34.11, 22.77, 35.30]
    c = [0.357, 2.477, 3.135, 0.239, 0.311]
    cluster = Cluster(a, c, 51)
    while cluster.window():
        assert cluster.changes <= 2
    assert cluster.batches[0] == 1 and cluster.changes == 2


@settings(max_examples=25, deadline=None)
@given(cluster=clusters())
def test_every_plan_on_the_way_is_valid(cluster):
    a, c, total = cluster
    for affine in (True, False):
        sim = Cluster(a, c, total, affine)
        for _ in range(8):
            sim.window()
            assert sum(sim.batches) == total and all(1 <= b <= total for b in sim.batches)


# -- the deadband ----------------------------------------------------------------------

def noisy_windows(a, c, total, seed, deadband, windows=50, amplitude=0.03):
    """Converge on exact times, then `windows` windows with +-`amplitude` multiplicative noise:
    (plan changes, the furthest any worker got from the converged plan)."""
    cluster = Cluster(a, c, total)
    for _ in range(12):
        cluster.window()
    converged = list(cluster.batches)
    cluster.deadband, cluster.changes, drift = deadband, 0, 0
    rng = random.Random(seed)
    for _ in range(windows):
        cluster.window(lambda: 1.0 + rng.uniform(-amplitude, amplitude))
        drift = max(drift, off_by(cluster.batches, converged))
    return cluster.changes, drift


@pytest.mark.slow  # 20 noisy runs of 2 controllers
@pytest.mark.parametrize("a, c, total", [([20.0, 5.0], [1.0, 3.0], 64), ([5.0, 5.0, 5.0], [1.0, 2.0, 3.0], 120)])
def test_deadband_holds_a_converged_plan_under_noise(a, c, total):
    with_band = [noisy_windows(a, c, total, seed, DEADBAND) for seed in range(10)]
    without = [noisy_windows(a, c, total, seed, 0.0)[0] for seed in range(10)]
    # typically no change at all; never more than two, never more than a sample away
    assert sum(ch for ch, _ in with_band) <= 5, with_band
    assert all(ch <= 2 and drift <= 1 for ch, drift in with_band), with_band
    # without the deadband, the same noise moves the plan again and again (less often than
    # each window: a size measured again is averaged over windows)
    assert sum(without) >= 30, without


@pytest.mark.slow  # 10 noisy runs of 2 controllers
def test_deadband_limits_churn_with_strong_overheads():
    """With big overheads a fitted line turns 3 % of time noise into ~9 % of batch (a/(c*b)
    amplifies it), so the deadband cannot hold every window; it still bounds the churn
    (measurements averaged over windows at one size damp it either way)."""
    a, c, total = STRONG
    with_band = [noisy_windows(a, c, total, seed, DEADBAND) for seed in range(5)]
    without = [noisy_windows(a, c, total, seed, 0.0)[0] for seed in range(5)]
    assert all(ch <= 8 and drift <= 2 for ch, drift in with_band), with_band
    assert min(without) >= 8, without
    assert sum(ch for ch, _ in with_band) * 4 < sum(without)


def test_exact_times_settle_for_good():
    cluster = Cluster([1.0, 0.0], [5.0, 1.0], 16)
    for _ in range(10):
        cluster.window()
    before = cluster.changes
    for _ in range(20):
        cluster.window()
    assert cluster.changes == before, cluster.batches


def test_deadband_holds_a_small_batch_worker_under_noise():
    a, c, total = [0.0] * 4, [0.5, 1.0, 2.0, 4.0], 128  # plan [68, 34, 17, 9]
    # +-6 %: at +-3 % the long averages mostly hold its target within half a sample even
    # without the deadband
    with_band = [noisy_windows(a, c, total, seed, DEADBAND, amplitude=0.06) for seed in range(3)]
    without = [noisy_windows(a, c, total, seed, 0.0, amplitude=0.06)[0] for seed in range(3)]
    # the 9-sample worker's target wanders by about half a sample: at most 3 one-sample
    # moves in 50 windows, where without the deadband the plan keeps changing (less than each
    # window: a model too close to its sizes for a fit averages them)
    assert all(ch <= 3 and drift <= 1 for ch, drift in with_band), with_band
    assert sum(without) >= 15, without
