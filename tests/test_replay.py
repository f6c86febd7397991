"""benchmarks/replay.py's ceiling: the best fixed plan in hindsight on recorded step times."""

import itertools
import sys
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from replay import best_fixed, ideal_s  # noqa: E402


def exhaustive(per_sample: np.ndarray, total: int) -> float:
    n = per_sample.shape[1]
    return min(float((per_sample * np.array(p)).max(axis=1).sum())
               for p in itertools.product(range(1, total), repeat=n) if sum(p) == total)


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 3), st.integers(6, 14), st.integers(1, 6), st.integers(0, 2**32 - 1))
def test_the_best_fixed_plan_is_the_best_of_all_plans(n, total, steps, seed):
    """Against every plan of the job: noisy steps (each worker's time per sample moving by up to
    2x from one step to the next, speeds up to 8x apart)."""
    rng = np.random.default_rng(seed)
    per_sample = rng.uniform(1, 8, n) * rng.uniform(0.5, 1.0, (steps, n))
    plan, took = best_fixed(per_sample, total)
    assert sum(plan) == total and min(plan) >= 1
    assert took == float((per_sample * np.array(plan)).max(axis=1).sum())
    assert took == exhaustive(per_sample, total)
    assert ideal_s(per_sample, total) <= took  # no plan beats each step's own balance


def test_where_moving_one_sample_at_a_time_stops_short_the_search_goes_on():
    """Two steps of four workers: from (3, 6, 1, 2), 21.81 s, no single sample moved shortens the
    job, yet (4, 4, 1, 3) takes 21.19 s (the best of all plans)."""
    per_sample = np.array([[3.23, 1.33, 6.44, 4.37], [1.88, 2.02, 5.52, 2.59]])
    plan, took = best_fixed(per_sample, 12)
    assert plan == (4, 4, 1, 3) and took == exhaustive(per_sample, 12)


def test_steady_speeds_make_the_equal_time_plan_and_reach_the_ideal():
    per_sample = np.tile([0.01, 0.02, 0.04], (5, 1))  # 4:2:1, 70 samples: 40/20/10 take 0.4 s each
    plan, took = best_fixed(per_sample, 70)
    assert plan == (40, 20, 10) and took == ideal_s(per_sample, 70) == 5 * 0.4
