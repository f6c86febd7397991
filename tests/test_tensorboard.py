"""TensorBoard scalars: written live by a real scheduler (--tensorboard DIR) and by
`omnips export tensorboard RUN_DIR` from the finished run, read back with tensorboard's
own event reader, agree with metrics.jsonl and with each other."""

import subprocess
import sys

import pytest

from omnips.launch import WorkerSpec
from omnips.scalars import WINDOW_STEPS

from helpers import WAIT_FACTOR, finish, start_cluster

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402


def scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0: keep every value
    acc.Reload()
    return {tag: [(s.step, s.value) for s in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def expected(events: list[dict], workers: int) -> dict[str, list[tuple[int, float]]]:
    """What metrics.jsonl says each tag must hold, computed here from its events."""
    want: dict[str, list] = {}
    steps = [e for e in events if e["event"] == "step"]
    for e in steps:
        w = e["worker"]
        for tag, value in ((f"batch/worker_{w}", e["batch"]), (f"compute_ms/worker_{w}", 1000 * e["compute_s"]),
                           (f"loss/worker_{w}", e["loss"]), (f"staleness/worker_{w}", e["staleness"])):
            want.setdefault(tag, []).append((e["step"], value))
    window = WINDOW_STEPS * workers
    for i in range(window, len(steps)):
        span = steps[i]["t"] - steps[i - window]["t"]
        rate = sum(e["batch"] for e in steps[i - window + 1:i + 1]) / span
        want.setdefault("samples_per_s", []).append((steps[i]["step"], rate))
    for e in (e for e in events if e["event"] == "eval"):
        furthest = max(s["step"] for s in steps if s["t"] <= e["t"])
        want.setdefault("test/accuracy", []).append((furthest, e["test_accuracy"]))
        want.setdefault("test/loss", []).append((furthest, e["test_loss"]))
    return want


def agree(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for tag in want:
        assert [s for s, _ in got[tag]] == [s for s, _ in want[tag]], tag
        assert [v for _, v in got[tag]] == pytest.approx([v for _, v in want[tag]], rel=1e-6, abs=1e-6), tag


@pytest.mark.cluster
def test_live_and_exported_scalars_agree_with_metrics_jsonl(tmp_path):
    live = tmp_path / "live"
    job = ["--mode", "bsp", "--max-steps", "40", "--global-batch", "32", "--seed", "3", "--epochs", "1",
           "--tensorboard", str(live)]
    run = finish(start_cluster(tmp_path / "run", job, [WorkerSpec(), WorkerSpec()]))
    events = run.events
    want = expected(events, 2)
    assert len(want["samples_per_s"]) == 2 * 40 - WINDOW_STEPS * 2 and want["test/accuracy"]
    agree(scalars(live), want)
    out = subprocess.run([sys.executable, "-m", "omnips.cli", "export", "tensorboard", str(run.dir),
                          "--out", str(tmp_path / "exported")], capture_output=True, text=True, timeout=120 * WAIT_FACTOR)
    assert out.returncode == 0 and out.stdout.strip() == str(tmp_path / "exported"), out.stderr
    agree(scalars(tmp_path / "exported"), want)


@pytest.mark.cluster
def test_export_refuses_a_directory_without_a_run(tmp_path):
    out = subprocess.run([sys.executable, "-m", "omnips.cli", "export", "tensorboard", str(tmp_path)],
                         capture_output=True, text=True, timeout=120 * WAIT_FACTOR)
    assert out.returncode == 1 and out.stderr.strip() == (f"omnips export: {tmp_path} is not a run directory "
                                                          "(no metrics.jsonl)")
