"""TensorBoard scalars of a run: written live by the scheduler (--tensorboard DIR) or from a
finished run's metrics.jsonl (`omnips export tensorboard RUN_DIR`), by the same rules, so
both give the same curves. Needs the tensorboard package (pip install 'omnips[tensorboard]').

Per worker w, at the step the worker reported: batch/worker_w, compute_ms/worker_w,
loss/worker_w (its minibatch's training loss) and staleness/worker_w (ASP/SSP: server
versions between its pull and its push). For the cluster: samples_per_s over a sliding
window of whole steps (WINDOW_STEPS per worker), and test/accuracy, test/loss at each
evaluation, at the furthest step reported by then."""

import json
import os
from collections import deque
from pathlib import Path

from .metrics import read_events

WINDOW_STEPS = 10  # steps per worker in the samples/s window


class ScalarsError(RuntimeError):
    pass


class Scalars:
    """Events in, (tag, value, step, t) out: the rules, without a writer."""

    def __init__(self, num_workers: int):
        self._window: deque = deque(maxlen=WINDOW_STEPS * max(1, num_workers) + 1)  # (t, batch) of recent steps
        self._furthest = 0

    def of(self, event: dict) -> list[tuple[str, float, int, float]]:
        kind, t = event.get("event"), event.get("t", 0.0)
        if kind == "step":
            w, step = event["worker"], event["step"]
            self._furthest = max(self._furthest, step)
            out = [(f"batch/worker_{w}", event["batch"], step, t),
                   (f"compute_ms/worker_{w}", 1000.0 * event["compute_s"], step, t)]
            out += [(f"{key}/worker_{w}", event[key], step, t) for key in ("loss", "staleness")
                    if isinstance(event.get(key), (int, float))]
            self._window.append((t, event["batch"]))
            if len(self._window) == self._window.maxlen and t > self._window[0][0]:
                samples = sum(b for _, b in list(self._window)[1:])  # those since the window's first report
                out.append(("samples_per_s", samples / (t - self._window[0][0]), step, t))
            return out
        if kind == "eval":
            return [(f"test/{key}", event[f"test_{key}"], self._furthest, t) for key in ("accuracy", "loss")
                    if isinstance(event.get(f"test_{key}"), (int, float))]
        return []


def _summary_writer(log_dir: Path, flush_secs: int):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ScalarsError("TensorBoard output needs the tensorboard package: pip install 'omnips[tensorboard]'") \
            from None
    return SummaryWriter(log_dir=str(log_dir), flush_secs=flush_secs)


class TensorBoard:
    """A run's scalars into a TensorBoard log directory. `wall0`: the wall-clock time of the
    run's t = 0, so that TensorBoard's time axes show when each step happened."""

    def __init__(self, log_dir, num_workers: int, wall0: float, flush_secs: int = 5):
        self.writer = _summary_writer(Path(log_dir), flush_secs)
        self.rules = Scalars(num_workers)
        self.wall0 = wall0

    def add(self, event: dict) -> None:
        for tag, value, step, t in self.rules.of(event):
            self.writer.add_scalar(tag, value, global_step=step, walltime=self.wall0 + t)

    def close(self) -> None:
        self.writer.close()


def export(run_dir, log_dir=None) -> Path:
    """Write a finished (or running) run's scalars to `log_dir` (default RUN_DIR/tensorboard)."""
    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").exists():
        raise ScalarsError(f"{run_dir} is not a run directory (no metrics.jsonl)")
    try:
        events = read_events(run_dir)
        config = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ScalarsError(f"cannot read {run_dir}: {exc}") from None
    log_dir = Path(log_dir) if log_dir is not None else run_dir / "tensorboard"
    wall0 = os.path.getmtime(run_dir / "config.json")  # written as the run started
    board = TensorBoard(log_dir, int(config.get("num_workers", 1)), wall0, flush_secs=120)
    try:
        for event in events:
            board.add(event)
    finally:
        board.close()
    return log_dir
