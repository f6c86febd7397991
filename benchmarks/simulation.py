"""The modelled workers that benchmarks/simulate.py drives the scheduler's controller with:
N workers whose compute takes F_i * (a_i + c_i * b) seconds, BSP, the speed change, drift,
transient and warm-up variants, the oracle plan, and the figures a run is summarised by
(simulate.py's docstring says what each table measures)."""

import contextlib
import math
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from omnips.batching import PROBE_BATCHES, BatchPlan, equal_time, initial_batches, integerize
from omnips import codec, protocol, timemodel
from omnips.job import JobSpec
from omnips.metrics import RunDir
from omnips.scheduler import control
from omnips.scheduler.control import BatchControl

COMM_S = 0.005
KINDS = ("jitter", "timer")
# (fixed costs a_i in ms, samples per worker in the global batch): up to 10 ms holds the
# slowest workers at one sample above everyone's equal time (no plan can balance them); up to
# 2.5 ms leaves the plan to the controller, and 128 samples a worker leave whole samples
# (rounding) no say in it either: what remains is the controller's own error
SCENARIOS = (((2.0, 10.0), 32), ((0.5, 2.5), 32), ((0.5, 2.5), 128))
# slowdowns a window for the drift table: the long averages trail 0.2 % by about four windows'
# drift without restarting; 1 % parts the two averages by about 3 % (DRIFT), at the edge
DRIFTS = (0.002, 0.01)
# a transient slowdown for the small-cluster table: long enough for the plan to follow it, small
# enough that the plan it leaves behind is within the deadband of the best one
TRANSIENT_SLOWDOWN, TRANSIENT_WINDOWS = 1.3, 3
TRANSIENT_WORKERS = (3, 4, 8, 16)
WIDE_WORKERS = (8, 16, 64, 256)  # held-back plans that differ from one decision to the next (up to the largest N)
TILED_CASES = 1000
SEEDS = 4  # runs averaged in a row of the transient, mid-size and warm-up tables
# a worker's first step on a new batch size, charged in the warm-up table: above what a first
# step after a change cost here (warm_up_cost: -4..+5 % on the CPU, within its noise); a GPU
# that tunes its kernels for each new shape can take far longer
WARMUP = 0.05
WARMUP_WORKERS = (64,)  # and the largest N


def oracle_plan(lines: np.ndarray, total: int) -> np.ndarray:
    """The best integer plan for the true lines: equal time, the spare samples where they
    slow a worker least."""
    return np.asarray(integerize(equal_time(lines, total, 1, total), total, 1, total, lines), dtype=np.float64)


def simulate(n: int, steps: int, noise: float, kind: str, adjust_every: int, seed: int,
             fixed_ms: tuple[float, float], per_worker: int, probe: bool = True, drift: float = 0.0,
             transient: int = 0, warmup: float = 0.0) -> dict:
    """One run. `drift` > 0: from mid-run the quarter of the workers slows down by that
    fraction every step (compounding) instead of becoming 3x slower at once. `transient` > 0:
    they are TRANSIENT_SLOWDOWN slower for that many steps only, then as fast as before.
    `warmup` > 0: a worker's first step on a new batch size takes that fraction longer (the
    oracle's too, when its plan changes)."""
    rng = np.random.default_rng(seed)
    total = per_worker * n
    a = rng.uniform(fixed_ms[0] / 1000, fixed_ms[1] / 1000, n)  # fixed cost per step, s
    c = rng.uniform(0.0005, 0.002, n)  # per sample at speed 1, s
    speed = rng.uniform(1.0, 8.0, n)
    job = JobSpec(num_workers=n, global_batch=total, batching="dynamic", adjust_every=adjust_every,
                  max_steps=steps)
    plan = BatchPlan(0, tuple(initial_batches("uniform", total, [1.0] * n, 1, total)))
    control = BatchControl(job, plan)
    if probe:  # a pass of each size, timed through the same noise; the workers wait for its plan
        # (its own draws: with and without the probe the same workers slow down, through the same noise)
        probe_rng = np.random.default_rng([seed, 1])
        f = 1.0 / speed
        told = [f * (a + c * size) * (1.0 + probe_rng.uniform(-noise, noise, n)) for size in PROBE_BATCHES]
        control.probed({rank: (list(PROBE_BATCHES), [t[rank] for t in told]) for rank in range(n)}, {})
        plan = control.plan
    change_at = steps // 2
    slowed = rng.choice(n, max(1, n // 4), replace=False)
    pending: list[tuple[int, BatchPlan]] = []
    decisions_s, changes_at, moved, report_s = [], [], [], 0.0
    ran = oracle_ran = None  # the batches of the step before: a worker whose batch changed warms up
    rec = {k: [] for k in ("step", "oracle", "ideal", "oracle_ideal", "clean", "oracle_clean")}
    for step in range(steps):
        while pending and pending[0][0] <= step:
            moved.append(sum(x != y for x, y in zip(plan.batches, pending[0][1].batches)))
            plan = pending.pop(0)[1]  # the workers switch; the controller has had it since it decided
        if step in (0, change_at, change_at + transient) or (drift and step > change_at):
            f = 1.0 / speed
            if transient:
                f[slowed] *= TRANSIENT_SLOWDOWN if change_at <= step < change_at + transient else 1.0
            elif step >= change_at:
                f[slowed] *= (1.0 + drift) ** (step - change_at) if drift else 3.0
            lines = np.stack([f * a, f * c], axis=1)
            best = oracle_plan(lines, total)
            best_s = lines[:, 0] + lines[:, 1] * best
        b = np.asarray(plan.batches, dtype=np.float64)
        true_s = lines[:, 0] + lines[:, 1] * b
        factor = 1.0 + rng.uniform(-noise, noise, n)
        jitter = factor if kind == "jitter" else 1.0
        device, oracle_device = true_s * jitter, best_s * jitter
        if warmup and ran is not None:
            device *= 1.0 + warmup * (b != ran)
            oracle_device *= 1.0 + warmup * (best != oracle_ran)
        ran, oracle_ran = b, best
        rec["step"].append(device.max() + COMM_S)
        rec["oracle"].append(oracle_device.max() + COMM_S)
        rec["ideal"].append(total / np.sum(b / device) + COMM_S)  # every worker at its own throughput
        rec["oracle_ideal"].append(total / np.sum(best / oracle_device) + COMM_S)
        rec["clean"].append(true_s.max())
        rec["oracle_clean"].append(best_s.max())
        told = (device if kind == "jitter" else device * factor).tolist()
        start = time.process_time()
        for rank in range(n):
            control.on_step(rank, plan.batches[rank], told[rank])
            ready = control.ready
        report_s += time.process_time() - start
        if ready:
            before = control.plan
            start = time.process_time()
            control.replan()
            decisions_s.append(time.process_time() - start)
            if control.plan != before:
                pending.append((step + 2, control.plan))
                changes_at.append(step)
    return {"n": n, "kind": kind, "steps": steps, "changes": changes_at, "moved": moved, "decisions_s": decisions_s,
            "report_s": report_s / (n * steps), "change_at": change_at, **{k: np.array(v) for k, v in rec.items()}}


def warm_up_cost(reps: int = 15) -> list[tuple[str, float]]:
    """How much longer a forward and backward pass takes on its first step at a new batch size
    than on the steps after it, on this machine's CPU (one torch thread): (case, fraction) for
    the digits MLP and a 6.3 M-parameter MLP, each at a batch moved by one sample and by a
    quarter. Medians over `reps` changes each way."""
    import torch

    from omnips import data, models

    torch.set_num_threads(1)
    cases = []
    for name, dataset, ds_args, model_args, b in (
            ("digits MLP", "digits", {}, {}, 36),
            ("6.3 M MLP", "synthetic", {"n": 256, "features": 1024}, {"hidden": [2048, 2048]}, 80)):
        train, _ = data.load(dataset, ds_args)
        model, (x, y) = models.build("mlp", model_args, train, 0), train.tensors

        def step(size):
            start = time.perf_counter()
            model.zero_grad(set_to_none=False)
            torch.nn.functional.cross_entropy(model(x[:size]), y[:size]).backward()
            return time.perf_counter() - start

        for _ in range(10):
            step(b)
        for other in (b + 1, b + b // 4):
            first, steady = [], []
            for _ in range(reps):
                for size in (other, b):  # after the warm-up at b: each timed first step is a change
                    first.append(step(size))
                    steady.append(statistics.median(step(size) for _ in range(5)))
            cases.append((f"{name}, {b} and {other} samples", statistics.median(first) / statistics.median(steady) - 1))
    return cases


def converged_after(r: dict, start: int, end: int) -> tuple[int | None, int]:
    """(adjustments made from `start` until the plan's noise-free step time is within 5 % of
    the oracle plan's, or None if never before `end`; the step where that happened)."""
    for s in range(start, end):
        if r["clean"][s] <= 1.05 * r["oracle_clean"][s]:
            return sum(1 for c in r["changes"] if start <= c < s), s
    return None, end


def summarise(r: dict) -> dict:
    first, settled = converged_after(r, 0, r["change_at"])
    second, _ = converged_after(r, r["change_at"], r["steps"])
    steady = slice(settled, r["steps"])
    calm = slice(settled, r["change_at"])  # noise alone: from the first convergence to the change
    d = r["decisions_s"]
    # settled: the plan's noise-free step time over the oracle plan's in the last fifth of each phase
    tail = r["change_at"] // 5
    settled_gap = np.concatenate([(r["clean"] / r["oracle_clean"])[end - tail:end]
                                  for end in (r["change_at"], r["steps"])])
    replanned = [c for c in r["changes"] if c >= r["change_at"]]
    return {"n": r["n"], "kind": r["kind"], "first": first, "after_change": second,
            "settled": float(np.median(settled_gap)),
            "old_plan_steps": replanned[0] + 2 - r["change_at"] if replanned else None,
            "vs_ideal": r["ideal"][steady].sum() / r["step"][steady].sum(),
            "vs_oracle": r["oracle"][steady].sum() / r["step"][steady].sum(),
            "calm_vs_oracle": r["oracle"][calm].sum() / r["step"][calm].sum(),
            "oracle_vs_ideal": r["oracle_ideal"][steady].sum() / r["oracle"][steady].sum(),
            "decision_ms": 1000 * statistics.median(d) if d else 0.0,
            "decision_max_ms": 1000 * max(d) if d else 0.0, "report_us": 1e6 * r["report_s"]}


def seed_means(runs: list[dict], keys: tuple) -> dict:
    """Over the seeds' runs: the mean of each of summarise's `keys` (each run summarised
    once), and of the plan changes."""
    summaries = [summarise(r) for r in runs]
    means = {k: float(np.mean([s[k] for s in summaries])) for k in keys}
    means["changes"] = float(np.mean([len(r["changes"]) for r in runs]))
    return means


def since_change(r: dict) -> dict:
    """A drift or transient run from its start on: efficiency against the oracle plan (which
    follows the speeds at once), the plan's noise-free step time over the oracle's in its last
    fifth, and the plan changes."""
    since = slice(r["change_at"], r["steps"])
    tail = (r["steps"] - r["change_at"]) // 5
    return {"vs_oracle": r["oracle"][since].sum() / r["step"][since].sum(),
            "settled": float(np.median((r["clean"] / r["oracle_clean"])[r["steps"] - tail:])),
            "changes": sum(1 for c in r["changes"] if c >= r["change_at"])}


def tiled_run(times, n: int, total: int, windows: int) -> tuple[list, list]:
    """`windows` decisions of a controller fed exact times `times(rank, batch)`: the plans it
    ran, in order, and the reasons of its changes."""
    job = JobSpec(num_workers=n, global_batch=total, batching="dynamic", adjust_every=4)
    control = BatchControl(job, BatchPlan(0, tuple(initial_batches("uniform", total, [1.0] * n, 1, total))))
    plans, reasons = [control.plan.batches], []
    for _ in range(windows):
        while not control.ready:
            for rank, b in enumerate(control.plan.batches):
                control.on_step(rank, b, times(rank, b))
        adjustment = control.replan()
        if control.plan.batches != plans[-1]:
            plans.append(control.plan.batches)
            reasons.append(adjustment.reason)
    return plans, reasons


def tiled(cases: int, seed: int, windows: int = 50) -> dict:
    """Small clusters (2-5 workers) whose time steps up every 4, 8 or 16 samples, as a GPU's
    tiles make it (no line fits them), without noise: how often plans go back and forth
    (at least 3 held-back plans taken and 2 returns to a plan run before), and the final
    plan's step time against the deadband alone's."""
    rng = np.random.default_rng(seed)
    back_and_forth, ratios = 0, []
    while len(ratios) < cases:
        n = int(rng.integers(2, 6))
        total = int(rng.integers(16, 64)) * n
        a, c = rng.uniform(0.002, 0.02, n), rng.uniform(0.0002, 0.002, n)
        tile, share = int(rng.choice([4, 8, 16])), rng.uniform(0.3, 0.9)  # share of a sample's cost paid by the tile

        def times(rank, b):
            return a[rank] + c[rank] * ((1 - share) * b + share * tile * math.ceil(b / tile))
        runs = []
        for _, context in as_it_is_and(deadband_only):
            with context():
                runs.append(tiled_run(times, n, total, windows))
        (plans, reasons), (alone, _) = runs
        returns = sum(1 for i, plan in enumerate(plans) if plan in plans[:i])
        back_and_forth += reasons.count("held") >= 3 and returns >= 2
        ratios.append(max(map(times, range(n), plans[-1])) / max(map(times, range(n), alone[-1])))
    r = np.array(ratios)
    return {"cases": cases, "back_and_forth": back_and_forth, "faster": int(np.sum(r < 0.999)),
            "slower": int(np.sum(r > 1.001)), "mean": float(r.mean())}


def report_path(n: int, steps: int = 10) -> dict:
    """CPU a worker report costs the scheduler besides the controller, per report over `steps`
    steps of `n` workers: decoding it (codec.decode, every check included) and writing its
    `step` line to metrics.jsonl, as the scheduler does with each."""
    frames = [codec.encode(protocol.Report(rank=r, step=0, batch=32, compute_s=0.1, network_s=0.01,
                                              wait_s=0.001, loss=2.3, mem_free=1 << 30, sample_bytes=1000))
              for r in range(n)] * steps
    start = time.process_time()
    reports = [codec.decode(f) for f in frames]
    decode_s = time.process_time() - start
    with tempfile.TemporaryDirectory() as tmp:
        run = RunDir(Path(tmp))
        start = time.process_time()
        for r in reports:
            run.step(r, 1.5)
        run.close()
        event_s = time.process_time() - start
    return {"n": n, "decode_us": 1e6 * decode_s / len(frames), "event_us": 1e6 * event_s / len(frames)}


def as_it_is_and(baseline) -> tuple:
    """The controller as it is, then with `baseline` in force: (whether the baseline, a
    context for the runs) each, for the tables that set one against the other."""
    return (False, contextlib.nullcontext), (True, baseline)


@contextlib.contextmanager
def _constant(module, name: str, value):
    """`module.name` set to `value` for the block: the baselines are the controller with one
    of its constants changed, in the same process."""
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


def same_plan_only():
    """Held-back plans taken only when the same one persists, never several each WIDE_GAIN
    faster: the baseline for the table of mid-size clusters."""
    return _constant(control, "WIDE_GAIN", math.inf)


def deadband_only():
    """A plan the deadband holds back is never taken, however long it is proposed: the
    controller before it took lasting gains, the baseline for the transient table."""
    return _constant(control, "PERSIST", math.inf)


def short_averages_only():
    """The time models with their long averages kept as the short ones are (REPEAT = FORGET):
    as they fitted before they had long ones, the baseline for the drift table."""
    return _constant(timemodel, "REPEAT", timemodel.FORGET)
