"""PNG plots of a run directory: batch sizes, compute times, cluster throughput, accuracy,
and what equal batches would have cost."""

import json
import math
from collections import defaultdict
from pathlib import Path

from .metrics import read_events


class PlotError(RuntimeError):
    pass


# what the plots read of each kind of event: all finite numbers
PLOTTED = {"step": ("t", "worker", "batch", "compute_s"), "eval": ("t", "test_accuracy")}


def read_plotted(run_dir: Path) -> list[dict]:
    """The run's events, each checked for what the plots read of it, so that a damaged
    metrics.jsonl is refused by file and line before any plot is drawn."""
    path = run_dir / "metrics.jsonl"
    try:
        events = read_events(run_dir)
    except OSError as exc:
        raise PlotError(f"cannot read {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise PlotError(str(exc)) from None
    for number, event in enumerate(events, 1):  # (read_events: line i+1 in place i)
        problem = _unplottable(event)
        if problem:
            raise PlotError(f"{path} line {number}: {problem}")
    return events


def _unplottable(event: dict) -> str | None:
    for key in PLOTTED.get(event["event"], ()):
        value = event.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return f"{event['event']} event without a finite number {key!r} (has {value!r})"
    return None


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PlotError("plots need matplotlib: pip install 'omnips[plot]'") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    return plt


def plot_run(run_dir) -> list[Path]:
    """Write batch.png, compute.png, throughput.png, accuracy.png and, for a BSP run with
    more than one worker, uniform.png under RUN_DIR/plots."""
    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").exists():
        raise PlotError(f"{run_dir} is not a run directory (no metrics.jsonl)")
    events = read_plotted(run_dir)
    plt = _pyplot()
    steps = [e for e in events if e["event"] == "step"]
    if not steps:
        raise PlotError(f"{run_dir} has no training steps to plot")
    by_worker = defaultdict(list)
    for e in steps:
        by_worker[e["worker"]].append(e)
    out = run_dir / "plots"
    out.mkdir(exist_ok=True)
    written = []

    def figure(name, title, ylabel, draw):
        fig, ax = plt.subplots(figsize=(7, 3.6))
        draw(ax)
        ax.set_title(title)
        ax.set_xlabel("time since the scheduler started (s)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(out / name)

    figure("batch.png", "batch size per worker", "samples per step",
           lambda ax: per_worker(ax, by_worker, "batch", steps_post=True))
    figure("compute.png", "compute time per step", "ms", lambda ax: per_worker(ax, by_worker, "compute_s", 1000.0))

    def throughput(ax):
        t, rate = throughput_series(steps, len(by_worker))
        ax.plot(t, rate, lw=1.2, label="over the last steps")
        span = steps[-1]["t"] - steps[0]["t"]
        if span > 0:  # the whole run's mean, the figure the summary gives
            ax.axhline(sum(e["batch"] for e in steps[1:]) / span, ls=":", lw=1, color="gray", label="mean")
        from_zero(ax)
    figure("throughput.png", "cluster throughput", "samples/s", throughput)

    evals = [e for e in events if e["event"] == "eval"]

    def accuracy(ax):
        ax.plot([e["t"] for e in evals], [e["test_accuracy"] for e in evals], marker="o", lw=1.2)
        ax.set_ylim(0, 1)
    figure("accuracy.png", "test accuracy", "accuracy", accuracy)
    rows = uniform_estimate(steps) if _mode(run_dir) == "bsp" else []
    if rows and len(by_worker) > 1:
        written.append(_uniform_figure(plt, rows, out / "uniform.png"))
    return written


STYLES = ("-", "--", ":", "-.")


def per_worker(ax, by_worker: dict, key: str, scale: float = 1.0, steps_post: bool = False) -> None:
    """One line per worker, every one visible where they overlap: each drawn thinner than
    the one before it, in its own dash pattern, over an axis from zero (a 2.5 % difference
    between workers looks like one)."""
    workers = sorted(by_worker)
    for i, w in enumerate(workers):
        ax.plot([e["t"] for e in by_worker[w]], [e[key] * scale for e in by_worker[w]], label=f"worker {w}",
                drawstyle="steps-post" if steps_post else "default", ls=STYLES[i % len(STYLES)],
                lw=1.2 + 2.4 * (len(workers) - 1 - i) / max(1, len(workers) - 1))
    from_zero(ax)


def from_zero(ax) -> None:
    """The y axis from 0 to a tenth above the highest value (a flat line at the top edge hides)."""
    top = max((max(ln.get_ydata(), default=0) for ln in ax.get_lines()), default=0)
    ax.set_ylim(0, 1.1 * top if top > 0 else 1)


def throughput_series(steps: list[dict], workers: int) -> tuple[list[float], list[float]]:
    """Samples per second over a window of whole steps ending at each step event: the samples
    of the window's events over the time since the event before it. A window of `workers`
    events times k holds whole BSP steps; k makes about 40 windows in the run. Fixed time bins
    instead hold whole steps unevenly, which drew a sawtooth and a last, partial bin's drop."""
    steps = sorted(steps, key=lambda e: e["t"])
    window = workers * max(1, len(steps) // workers // 40)
    t, rate = [], []
    samples = 0
    for i, e in enumerate(steps):
        samples += e["batch"]
        if i >= window:
            samples -= steps[i - window]["batch"]
            span = e["t"] - steps[i - window]["t"]
            if span > 0:
                t.append(e["t"])
                rate.append(samples / span)
    return t, rate


def _mode(run_dir: Path) -> str | None:
    """The job's mode from RUN_DIR/config.json (None where it cannot be read)."""
    try:
        return json.loads((run_dir / "config.json").read_text()).get("mode")
    except (OSError, ValueError, AttributeError):
        return None


def uniform_estimate(steps: list[dict]) -> list[dict]:
    """For each BSP step every worker reported (`step` events with a `step` number): its
    compute time as run (the slowest worker's) and each worker's idle time (waiting for the
    slowest); and the same with equal batches, each worker's time estimated from its
    throughput at the batch it had. Steps without a full set of reports are left out."""
    by_step = defaultdict(dict)
    for e in steps:
        if "step" in e and e["batch"] > 0 and e["compute_s"] > 0:
            by_step[e["step"]][e["worker"]] = e
    workers = {e["worker"] for e in steps}
    rows = []
    for step in sorted(by_step):
        reports = by_step[step]
        if set(reports) != workers:
            continue
        total = sum(e["batch"] for e in reports.values())
        ran = {w: e["compute_s"] for w, e in reports.items()}
        even = {w: e["compute_s"] * (total / len(reports)) / e["batch"] for w, e in reports.items()}
        rows.append({"step": step, "ran_s": max(ran.values()), "uniform_s": max(even.values()),
                     "ran_idle": {w: max(ran.values()) - t for w, t in ran.items()},
                     "uniform_idle": {w: max(even.values()) - t for w, t in even.items()}})
    return rows


def _uniform_figure(plt, rows: list[dict], path: Path) -> Path:
    """Step compute time as run against equal batches, and each worker's idle share of a step."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6.4))
    x = [r["step"] for r in rows]
    top.plot(x, [1000 * r["ran_s"] for r in rows], lw=1.2, label="as run (slowest worker)")
    top.plot(x, [1000 * r["uniform_s"] for r in rows], lw=1.2, ls="--", label="equal batches (estimated)")
    top.set_title("compute time per step: as run and with equal batches")
    top.set_xlabel("step")
    top.set_ylabel("ms")
    top.set_ylim(bottom=0)
    top.legend(fontsize=8)
    top.grid(alpha=0.3)
    workers = sorted(rows[0]["ran_idle"])
    ran_total, even_total = sum(r["ran_s"] for r in rows), sum(r["uniform_s"] for r in rows)
    idle = {key: [100 * sum(r[key][w] for r in rows) / total for w in workers]
            for key, total in (("ran_idle", ran_total), ("uniform_idle", even_total))}
    width = 0.38
    positions = range(len(workers))
    bottom.bar([p - width / 2 for p in positions], idle["ran_idle"], width, label="as run")
    bottom.bar([p + width / 2 for p in positions], idle["uniform_idle"], width, label="equal batches (estimated)")
    bottom.set_xticks(list(positions), [f"worker {w}" for w in workers])
    bottom.set_title(f"idle, waiting for the slowest (equal batches: {even_total / ran_total:.2f}x the time)")
    bottom.set_ylabel("% of the steps' time")
    bottom.legend(fontsize=8)
    bottom.grid(alpha=0.3, axis="y")
    fig.text(0.01, 0.005, "equal batches: each worker's time from its throughput at the batch it had",
             fontsize=7, alpha=0.7)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
