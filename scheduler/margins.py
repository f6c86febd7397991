"""Noisy workers planned short of their mean time: a BSP step lasts as long as its slowest worker.

Equal time, on each worker's mean time, is the best plan where no worker's steps vary more than
the others'. Where one's vary far more (a neighbour's CPU hog in its container: its steps at one
batch ran 0.54 to 1.11 s while the others' kept within a few %), it is the slowest in about
half the steps, and each of those steps waits for it. Moving a sample off worker i saves its
slope c_i in the steps where it is the slowest and costs the others' slope together, c_R =
1 / sum_j 1/c_j (they share the sample), in the steps where they are: the expected step is
least where c_i P(i slowest) = c_R P(others slowest). With its time normal about its mean and
theirs taken as fixed, its mean then lies z of its standard deviations below their time,
Phi(z) = c_i / (c_i + c_R): its line is planned at exp(z * spread) times its mean. Under that hog
(the cgroup benchmark's neighbour case) margins of 1.1-1.3 took 1-4 samples of 128 off the worker's
7-10; drawn at such a spread (tests/test_margins.py), the mean step runs several % shorter.

Its spread counts only beyond NOISIER times the typical worker's: the others vary too, which the
rule above leaves out, and a spread estimated from a dozen steps is off by a third either way (at
64 workers of equal noise, margins on the spread beyond the typical alone tilted plans by that
error, and they settled 0.2 % further from the best). And only as measured at its batch now
(StepNoise.current): a spread from before a change of speed says nothing of the steps since.
Two workers of equal slopes get none (z = 0: each is the slowest half the time either way); one
slow worker among many fast ones the most (z up to Z_MAX).
"""

from statistics import NormalDist

import numpy as np

from .windows import StepNoise

NOISIER = 2.0
Z_MAX = 3.0  # (Phi(3) = 0.9987: thousands of fast workers beside one slow one)
TOP = NormalDist().cdf(Z_MAX)
# at most: a spread from a dozen steps can be half again the worker's, and the normal's tail is not
# a step time's (drawn at a spread of 0.25 beside quiet workers, estimates made margins of 1.7-2.2,
# which left the worker at 2-3 samples, idle most of each step)
MAX_MARGIN = 1.5
TYPICAL_OF = 64


def margins(slopes: np.ndarray, spreads: np.ndarray, typical: float) -> np.ndarray:
    """Each worker's factor on its line (1: none) from its line's `slopes`, its steps' `spreads`
    (robust standard deviations of their log times at its batch now; 0: not known) and the
    `typical` worker's spread (NOISIER; 0, not known yet: no margins)."""
    slopes, spreads = np.asarray(slopes, dtype=np.float64), np.asarray(spreads, dtype=np.float64)
    factors = np.ones(len(slopes))
    excess = spreads - NOISIER * typical
    noisy = np.flatnonzero((excess > 0) & (slopes > 0))
    if not typical > 0 or not len(noisy):
        return factors
    rates = np.where(slopes > 0, 1.0 / np.where(slopes > 0, slopes, 1.0), 0.0)  # each worker's samples per second
    others = rates.sum() - rates[noisy]  # (no other worker with a slope: none to take the samples)
    c_rest = np.where(others > 0, 1.0 / np.where(others > 0, others, 1.0), np.inf)
    share = np.minimum(slopes[noisy] / (slopes[noisy] + c_rest), TOP)
    z = np.array([NormalDist().inv_cdf(s) if s > 0.5 else 0.0 for s in share.tolist()])
    factors[noisy] = np.minimum(np.exp(z * excess[noisy]), MAX_MARGIN)
    return factors


def noise_margins(noise: StepNoise, ranks: np.ndarray, slopes: np.ndarray, changing: set[int]) -> np.ndarray:
    """The factors of `ranks` (their lines' `slopes`) from their spreads at their batches now, or the last
    estimate where lower (from a dozen steps a spread is off by a third either way, and a margin too
    wide costs less than none, but still costs); none for a worker whose speed just changed
    (`changing`: its steps since are too few to say)."""
    # the typical spread: the median over up to TYPICAL_OF workers' now (thousands' would cost a decision 3x)
    typical = float(np.median([noise.current(int(r)) for r in ranks[::-(-len(ranks) // TYPICAL_OF)]] or [0.0]))
    known = noise.spreads(ranks)  # (the last estimates, cheap: only a worker above the typical can have a margin)
    spreads = np.zeros(len(ranks))
    for i in np.flatnonzero(known > NOISIER * typical).tolist():
        if int(ranks[i]) not in changing:
            spreads[i] = min(known[i], noise.current(int(ranks[i])))
    return margins(slopes, spreads, typical)


def described(ranks: np.ndarray, factors: np.ndarray) -> str:
    """The rule of an equal-time plan that gave workers margins, in words ("" for none)."""
    noisy = np.flatnonzero(np.round(factors, 2) > 1)  # (1.00x says nothing)
    if not len(noisy):
        return ""
    return (f"equal time, worker(s) {ranks[noisy].tolist()} planned at "
            f"{', '.join(f'{f:.2f}' for f in factors[noisy])}x their mean time (their steps' spread)")
