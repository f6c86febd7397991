"""A dynamic job's plans against the uniform job run beside it, window by window: the longest run
of windows in which a plan other than the uniform split ran measurably slower than uniform batches
did at the same moment, which dynamic batching must not hold for more than two windows.

A window is `window` steps of the dynamic job (its --adjust-every), from step 1 (step 0 has no
start); its time a step is the median of its steps' times, each from the end of the step before
to its own end (a step lasts as long as its slowest worker; an evaluation's pause is one step's
outlier). The uniform job's time a step over the same span is the median of its steps that
overlap the span, on the host's monotonic clock (the `start` event's clock_t0). A window the
uniform job ran no step across (it had ended) is not compared, and ends a run.
"""

from statistics import median

from efficiency import complete_steps


def timeline(events: list[dict], workers: int) -> list[tuple[int, float, tuple[int, ...]]]:
    """Each step every one of the job's `workers` reported: (step, its end on the host's
    monotonic clock, the workers' batches)."""
    t0 = next(e["clock_t0"] for e in events if e["event"] == "start")
    return [(s, t0 + max(e["t"] for e in ws.values()), tuple(ws[w]["batch"] for w in range(workers)))
            for s, ws in complete_steps(events, workers).items()]


def longest_worse(dynamic: list, uniform: list, window: int, margin: float) -> tuple[int, int]:
    """The longest run of consecutive windows of the `dynamic` timeline that ran a plan other than
    the uniform split (the `uniform` timeline's batches) in one of their steps, and a step more than
    `margin` slower than the `uniform` job's over the same span; and how many windows were compared."""
    if not uniform:
        return 0, 0
    split = uniform[0][2]
    spans = [(before[1], step[1]) for before, step in zip(uniform, uniform[1:]) if step[0] == before[0] + 1]
    ends = {s: (end, batches) for s, end, batches in dynamic}
    longest = run = compared = 0
    for first in range(1, max(ends, default=0) - window + 2, window):
        steps = range(first, first + window)
        theirs = []
        if all(s in ends and s - 1 in ends for s in steps):
            start, end = ends[first - 1][0], ends[steps[-1]][0]
            theirs = [b - a for a, b in spans if a < end and b > start]
        if not theirs:
            run = 0
            continue
        compared += 1
        mine = median(ends[s][0] - ends[s - 1][0] for s in steps)
        worse = any(ends[s][1] != split for s in steps) and mine > (1 + margin) * median(theirs)
        run = run + 1 if worse else 0
        longest = max(longest, run)
    return longest, compared
