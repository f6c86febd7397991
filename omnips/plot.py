"""PNG plots of a run directory: batch sizes, compute times, cluster throughput, accuracy."""

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
    """Write batch.png, compute.png, throughput.png and accuracy.png under RUN_DIR/plots."""
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

    def per_worker(key, scale=1.0):
        def draw(ax):
            for w in sorted(by_worker):
                ax.plot([e["t"] for e in by_worker[w]], [e[key] * scale for e in by_worker[w]],
                        label=f"worker {w}", drawstyle="steps-post" if key == "batch" else "default", lw=1.2)
        return draw

    figure("batch.png", "batch size per worker", "samples per step", per_worker("batch"))
    figure("compute.png", "compute time per step", "ms", per_worker("compute_s", 1000.0))

    def throughput(ax):
        t0, t1 = steps[0]["t"], steps[-1]["t"]
        width = max(0.25, (t1 - t0) / 40)
        bins = defaultdict(int)
        for e in steps:
            bins[int((e["t"] - t0) / width)] += e["batch"]
        keys = sorted(bins)
        ax.plot([t0 + (k + 0.5) * width for k in keys], [bins[k] / width for k in keys], lw=1.2)
    figure("throughput.png", "cluster throughput", "samples/s", throughput)

    evals = [e for e in events if e["event"] == "eval"]

    def accuracy(ax):
        ax.plot([e["t"] for e in evals], [e["test_accuracy"] for e in evals], marker="o", lw=1.2)
        ax.set_ylim(0, 1)
    figure("accuracy.png", "test accuracy", "accuracy", accuracy)
    return written
