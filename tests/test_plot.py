"""omnips/plot.py: what equal batches would have cost, estimated from a BSP run's step events."""

import pytest

from omnips.plot import per_worker, plot_run, throughput_series, uniform_estimate


def step(worker, number, batch, compute_s):
    return {"event": "step", "t": float(number), "worker": worker, "step": number, "batch": batch,
            "compute_s": compute_s}


def test_equal_batches_are_estimated_from_each_workers_throughput_at_its_batch():
    # worker 0 at 1 ms a sample with 30 samples, worker 1 at 3 ms a sample with 10: both 30 ms;
    # with 20 each, worker 0 would take 20 ms and worker 1 60 ms
    events = [step(0, 0, 30, 0.030), step(1, 0, 10, 0.030), step(0, 1, 30, 0.030)]  # step 1 lacks worker 1
    (row,) = uniform_estimate(events)
    assert row["step"] == 0 and row["ran_s"] == pytest.approx(0.030) and row["uniform_s"] == pytest.approx(0.060)
    assert row["ran_idle"] == {0: 0.0, 1: 0.0}
    assert row["uniform_idle"] == {0: pytest.approx(0.040), 1: pytest.approx(0.0)}


def test_steps_without_a_time_or_a_batch_are_left_out():
    events = [step(0, 0, 30, 0.030), step(1, 0, 0, 0.0), step(0, 1, 30, 0.03), step(1, 1, 10, 0.05)]
    rows = uniform_estimate(events)
    assert [r["step"] for r in rows] == [1] and rows[0]["ran_idle"][0] == pytest.approx(0.02)


def bsp_steps(workers: int, steps: int, period_s: float, batch: int) -> list[dict]:
    """A steady BSP run: every step takes period_s, its workers report in turn within it."""
    return [step(w, n, batch, period_s * 0.8) | {"t": n * period_s + w * period_s / (2 * workers)}
            for n in range(steps) for w in range(workers)]


def test_throughput_of_a_steady_run_is_flat_to_its_last_step():
    # 3 workers x 10 samples every 0.1 s: 300 samples/s throughout; fixed time bins drew a
    # sawtooth (bins holding 2 or 3 steps' reports) and a drop at the last, partial bin
    t, rate = throughput_series(bsp_steps(3, 200, 0.1, 10), 3)
    assert len(rate) > 150 and t[-1] == pytest.approx(199 * 0.1 + 2 * 0.1 / 6)
    assert rate == pytest.approx([300.0] * len(rate), rel=1e-9)


def test_throughput_follows_a_change_of_speed():
    steps = bsp_steps(2, 100, 0.1, 10) + [e | {"t": 10.0 + e["t"] * 2} for e in bsp_steps(2, 100, 0.1, 10)]
    _, rate = throughput_series(steps, 2)
    assert rate[0] == pytest.approx(200.0) and rate[-1] == pytest.approx(100.0)
    assert all(r >= 100.0 - 1e-9 for r in rate)


def test_per_worker_lines_start_at_zero_and_none_hides_another():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    # two workers 2.5 % apart and a third identical to the first: all three must show
    by_worker = {0: [step(0, n, 10, 0.039) for n in range(5)], 1: [step(1, n, 10, 0.040) for n in range(5)],
                 2: [step(2, n, 10, 0.039) for n in range(5)]}
    fig, ax = plt.subplots()
    try:
        per_worker(ax, by_worker, "compute_s", 1000.0)
        assert ax.get_ylim()[0] == 0 and ax.get_ylim()[1] >= 40
        lines = ax.get_lines()
        assert [ln.get_label() for ln in lines] == ["worker 0", "worker 1", "worker 2"]
        assert len({ln.get_linestyle() for ln in lines}) == 3  # each its own dash pattern
        widths = [ln.get_linewidth() for ln in lines]
        assert widths == sorted(widths, reverse=True) and len(set(widths)) == 3  # a later line lies inside an earlier
    finally:
        plt.close(fig)


def test_plot_run_draws_every_figure_of_a_run_directory(tmp_path):
    import json
    events = [{"event": "start", "t": 0.0}] + bsp_steps(2, 30, 0.1, 10) + [
        {"event": "eval", "t": 3.0, "test_accuracy": 0.9}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (tmp_path / "config.json").write_text(json.dumps({"mode": "bsp"}))
    names = [p.name for p in plot_run(tmp_path)]
    assert names == ["batch.png", "compute.png", "throughput.png", "accuracy.png", "uniform.png"]
    assert all((tmp_path / "plots" / name).stat().st_size > 0 for name in names)
