"""Batch plans and the integer split of the global batch."""

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from omnips.batching import BatchPlan, initial_batches, largest_remainder

FAST = settings(max_examples=40, deadline=None)

# weights as a user or the controller would give them: capacities, throughputs (no ulp-level ties)
WEIGHT = st.one_of(st.integers(0, 1000).map(float), st.floats(0.001, 1000.0).map(lambda x: round(x, 3)))
WEIGHTS = st.lists(WEIGHT, min_size=1, max_size=12).filter(lambda w: sum(w) > 0)


def exact_shares(weights, total):
    w = np.asarray(weights, dtype=np.float64)
    return w / w.sum() * total


@FAST
@given(weights=WEIGHTS, total=st.integers(0, 10_000), minimum=st.integers(0, 50))
def test_sums_exactly_and_respects_the_minimum(weights, total, minimum):
    assume(minimum * len(weights) <= total)
    out = largest_remainder(weights, total, minimum)
    assert len(out) == len(weights)
    assert all(type(x) is int for x in out)
    assert sum(out) == total
    assert min(out) >= minimum


@FAST
@given(weights=WEIGHTS, total=st.integers(0, 10_000))
def test_within_one_of_the_exact_share(weights, total):
    exact = exact_shares(weights, total)
    out = largest_remainder(weights, total)
    assert np.all(np.abs(np.array(out) - exact) < 1), (out, exact)
    # and it rounds: each is the floor or the ceiling of its share
    assert all(math.floor(e - 1e-9) <= o <= math.ceil(e + 1e-9) for o, e in zip(out, exact))


@FAST
@given(weights=WEIGHTS, total=st.integers(0, 10_000), data=st.data())
def test_minimum_that_does_not_bind_changes_nothing(weights, total, data):
    smallest = min(exact_shares(weights, total))
    minimum = data.draw(st.integers(0, max(0, math.floor(smallest - 1e-6))))
    assume(minimum <= smallest - 1e-6 or minimum == 0)
    assert largest_remainder(weights, total, minimum) == largest_remainder(weights, total)


@FAST
@given(weights=WEIGHTS, total=st.integers(0, 10_000), minimum=st.integers(0, 20))
def test_monotone_in_weight(weights, total, minimum):
    assume(minimum * len(weights) <= total)
    out = largest_remainder(weights, total, minimum)
    for i, wi in enumerate(weights):
        for j, wj in enumerate(weights):
            if wi > wj:
                assert out[i] >= out[j], (weights, out)
            if wi == wj:
                assert abs(out[i] - out[j]) <= 1


@FAST
@given(weights=WEIGHTS, total=st.integers(1, 10_000), minimum=st.integers(1, 20))
def test_pinned_workers_get_exactly_the_minimum(weights, total, minimum):
    """Water-filling: a worker whose share falls below the minimum is held at it, no more."""
    assume(minimum * len(weights) <= total)
    out = largest_remainder(weights, total, minimum)
    for w, o in zip(weights, out):
        if w == 0:
            assert o == minimum


def test_known_splits():
    assert largest_remainder([1, 1, 1], 10) == [4, 3, 3]  # ties go to the lower index
    assert largest_remainder([1, 2, 3], 12) == [2, 4, 6]
    assert largest_remainder([0.5, 0.25, 0.25], 7) == [3, 2, 2]  # 3.5, 1.75, 1.75
    assert largest_remainder([100, 1, 1], 12, minimum=2) == [8, 2, 2]
    assert largest_remainder([0, 0, 5], 9, minimum=1) == [1, 1, 7]
    assert largest_remainder(np.array([3.0, 1.0]), 4) == [3, 1]


@pytest.mark.parametrize("weights", [[], [0, 0], [-1, 2], [1, float("nan")], [1, float("inf")], [[1, 2], [3, 4]],
                                     [0.0]])
def test_bad_weights_are_refused(weights):
    with pytest.raises(ValueError, match="weights"):
        largest_remainder(weights, 10)


def test_impossible_minimum_is_refused():
    with pytest.raises(ValueError, match="at least 4"):
        largest_remainder([1, 1, 1], 11, minimum=4)
    with pytest.raises(ValueError):
        largest_remainder([1, 1], -1)


def test_scalar_weights_are_refused_with_value_error():
    with pytest.raises(ValueError, match="weights"):
        largest_remainder(5.0, 10)


@FAST
@given(num_workers=st.integers(1, 16), extra=st.integers(0, 2000))
def test_uniform_start_is_equal(num_workers, extra):
    global_batch = num_workers + extra
    capacities = [float(i + 1) for i in range(num_workers)]  # ignored by uniform
    out = initial_batches("uniform", global_batch, capacities)
    assert sum(out) == global_batch and min(out) >= 1
    assert max(out) - min(out) <= 1
    assert out == sorted(out, reverse=True)


@FAST
@given(capacities=st.lists(st.integers(1, 64).map(float), min_size=1, max_size=8), extra=st.integers(0, 2000))
def test_static_start_follows_capacity(capacities, extra):
    global_batch = len(capacities) + extra
    out = initial_batches("static", global_batch, capacities)
    assert sum(out) == global_batch and min(out) >= 1
    assert out == largest_remainder(capacities, global_batch, minimum=1)


def test_static_vs_uniform_example():
    assert initial_batches("uniform", 64, [1, 3]) == [32, 32]
    assert initial_batches("static", 64, [1, 3]) == [16, 48]
    assert initial_batches("static", 4, [1, 1000, 1, 1]) == [1, 1, 1, 1]


# -- plans on the wire ---------------------------------------------------------------

PLANS = st.builds(BatchPlan, gen=st.integers(0, 2**40),
                  batches=st.lists(st.integers(1, 10**6), min_size=1, max_size=8).map(tuple), stop=st.booleans())


@FAST
@given(plan=PLANS)
def test_plan_round_trips_through_wire_form(plan):
    wire = plan.to_wire()
    assert wire == {"gen": plan.gen, "batches": list(plan.batches), "stop": plan.stop}
    assert BatchPlan.from_wire(wire, len(plan.batches)) == plan


def test_stop_defaults_to_false():
    assert BatchPlan.from_wire({"gen": 3, "batches": [1, 2]}, 2) == BatchPlan(3, (1, 2), False)


GOOD = {"gen": 1, "batches": [3, 5], "stop": False}


@pytest.mark.parametrize("bad", [
    None, [1, [3, 5]], "plan", 5,
    {**GOOD, "gen": -1}, {**GOOD, "gen": None}, {**GOOD, "gen": True}, {**GOOD, "gen": 1.0}, {**GOOD, "gen": "1"},
    {"batches": [3, 5]},
    {**GOOD, "batches": [3]}, {**GOOD, "batches": [3, 5, 1]}, {**GOOD, "batches": [3, 0]},
    {**GOOD, "batches": [3, -5]}, {**GOOD, "batches": [3, 5.0]}, {**GOOD, "batches": [True, 5]},
    {**GOOD, "batches": (3, 5)}, {**GOOD, "batches": None}, {**GOOD, "batches": [3, "5"]},
    {**GOOD, "stop": 1}, {**GOOD, "stop": "yes"}, {**GOOD, "stop": None},
])
def test_malformed_plans_are_refused(bad):
    with pytest.raises(ValueError):
        BatchPlan.from_wire(bad, 2)


@settings(max_examples=60, deadline=None)
@given(d=st.dictionaries(st.sampled_from(["gen", "batches", "stop", "other"]),
                         st.one_of(st.none(), st.booleans(), st.integers(-3, 5), st.floats(allow_nan=False),
                                   st.text(max_size=2),
                                   st.lists(st.one_of(st.integers(-2, 5), st.booleans(), st.floats(0, 5)),
                                            max_size=3))))
def test_from_wire_fuzz(d):
    """Either a valid plan or ValueError, nothing else."""
    try:
        plan = BatchPlan.from_wire(d, 2)
    except ValueError:
        return
    assert isinstance(plan.gen, int) and not isinstance(plan.gen, bool) and plan.gen >= 0
    assert len(plan.batches) == 2 and all(type(b) is int and b >= 1 for b in plan.batches)
    assert type(plan.stop) is bool
