"""End to end: a scheduler, servers and workers as real processes over loopback ZeroMQ."""

import math
import time

import pytest
import torch

from omnips import data, models
from omnips.launch import WorkerSpec

from helpers import assert_trained_as_one_process, single_process_model

DIGITS_FAST = ["--dataset", "digits", "--model", "mlp", "--global-batch", "64", "--lr", "0.05",
               "--momentum", "0.9", "--seed", "3"]
HETERO = [WorkerSpec(slowdown="1"), WorkerSpec(slowdown="2"), WorkerSpec(slowdown="3")]


@pytest.mark.cluster
@pytest.mark.core
def test_bsp_trains_digits_to_90_percent(run_job):
    before = time.monotonic()
    run = run_job(["--mode", "bsp", "--epochs", "8", *DIGITS_FAST], HETERO, num_servers=2)
    after = time.monotonic()
    s = run.summary
    assert s["status"] == "completed"
    assert s["final_test_accuracy"] >= 0.90, s
    assert s["mode"] == "bsp" and s["num_workers"] == 3 and s["num_servers"] == 2
    assert s["worker_steps"] == [s["steps"]] * 3
    assert s["samples"] == s["steps"] * 64 and s["epochs"] >= 8
    evals = [e for e in run.events if e["event"] == "eval"]
    assert len(evals) == 8 and evals[-1]["final"]
    # BSP evaluations read every shard at the same version: the step that ends the epoch
    assert all(len(set(e["versions"])) == 1 for e in evals)
    assert evals[-1]["versions"][0] == s["steps"]
    assert all(math.isfinite(e["test_loss"]) and e["test_loss"] > 0 for e in evals)
    assert s["final_test_loss"] == evals[-1]["test_loss"]
    assert s["batching"] == "uniform" and s["global_batch"] == 64
    # every report's fields, as the outputs list them
    steps = [e for e in run.events if e["event"] == "step"]
    assert len(steps) == 3 * s["steps"]
    for e in steps:
        assert e["batch"] in (21, 22) and e["mem_batch"] == 0  # no memory limit known
        assert e["network_s"] >= 0 and e["wait_s"] >= 0 and math.isfinite(e["loss"]) and e["loss"] > 0
    assert [e["epoch"] for e in steps] == sorted(e["epoch"] for e in steps) and steps[-1]["epoch"] == s["epochs"]
    assert (run.dir / "config.json").exists() and (run.dir / "model.pt").exists()
    # event times count from the start event's clock_t0, a reading of the host's monotonic clock
    t0 = run.events[0]["clock_t0"]
    assert run.events[0]["event"] == "start" and before < t0 and t0 + run.events[-1]["t"] < after
    assert run.events[-1]["event"] == "end" and run.events[-1]["status"] == "completed"


@pytest.mark.cluster
@pytest.mark.core
def test_asp_trains_digits_with_the_bsp_recipe(run_job):
    run = run_job(["--mode", "asp", "--epochs", "20", *DIGITS_FAST], HETERO, num_servers=2)
    s = run.summary
    assert s["status"] == "completed" and not s["diverged"] and s["diverged_reason"] is None
    assert s["final_test_accuracy"] >= 0.93, s
    assert s["samples"] >= 20 * 1438
    assert sum(s["worker_steps"]) == s["steps"]
    assert s["staleness_max"] >= 1  # three asynchronous workers do see stale parameters
    steps = [e for e in run.events if e["event"] == "step"]
    assert all("staleness" in e for e in steps)
    # ASP evaluates as the samples all workers consumed cross each epoch, then the final model
    evals = [e for e in run.events if e["event"] == "eval"]
    assert sorted(e["epoch"] for e in evals if not e["final"]) == [float(k) for k in range(1, 20)], evals
    assert sum(e["final"] for e in evals) == 1 and s["final_test_loss"] == next(e for e in evals if e["final"])["test_loss"]


@pytest.mark.cluster
def test_bsp_equals_single_process_training(run_job):
    """S=2, N=3, unequal batches 10/20/34, SGD with momentum and weight decay, 20 steps;
    gradients sent in 2 KiB buckets while backward runs and replies read in parts of that
    size by the next forward pass; the third worker holds at most 8 samples in a pass
    (--max-batch), so it computes its 34 in chunks."""
    args = ["--mode", "bsp", "--batching", "static", "--max-steps", "20", "--global-batch", "64",
            "--lr", "0.1", "--momentum", "0.9", "--weight-decay", "0.01", "--seed", "7"]
    workers = [WorkerSpec(capacity=c, extra=("--bucket-size", "2K", *more))
               for c, more in ((10, ()), (20, ()), (34, ("--max-batch", "8")))]
    run = run_job(args, workers, num_servers=2)
    # the launcher asks for ranks in its order; static batching keeps its split whatever a worker holds
    assert run.summary["final_batches"] == [10, 20, 34]
    assert {e["mem_batch"] for e in run.events if e["event"] == "step" and e["worker"] == 2} == {8}
    for s in range(2):  # every push and every reply of every step came in parts
        assert "60 pushes came in parts, 60 replies went in parts" in (run.dir / "logs" / f"server{s}.log").read_text()
    want = assert_trained_as_one_process(run.dir, steps=20, global_batch=64, lr=0.1, weight_decay=0.01, seed=7)
    train, _ = data.load("digits", {})
    initial = models.build("mlp", {}, train, seed=7).state_dict()
    assert not any(torch.equal(want[k], initial[k]) for k in want)  # it trained


@pytest.mark.cluster
def test_bsp_with_adam_equals_single_process_adam(run_job):
    """--optimizer adam: the servers step with Adam (weight decay too), as torch.optim.Adam
    in one process does on the global batches."""
    args = ["--mode", "bsp", "--max-steps", "15", "--global-batch", "48", "--optimizer", "adam",
            "--lr", "0.01", "--weight-decay", "0.01", "--seed", "4"]
    run = run_job(args, [WorkerSpec(), WorkerSpec()], num_servers=2)
    want = assert_trained_as_one_process(run.dir, steps=15, global_batch=48, lr=0.01, weight_decay=0.01, seed=4,
                                         optimizer="adam")
    sgd = single_process_model(steps=15, global_batch=48, lr=0.01, weight_decay=0.01, seed=4)
    assert not any(torch.allclose(want[k], sgd[k], rtol=0, atol=1e-3) for k in want)  # the two rules part ways


USER_CODE = '''
import torch
from torch import nn
from torch.utils.data import Dataset


class Blobs(Dataset):
    """Not a TensorDataset: exercises the generic collate path."""

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, 3, (n,), generator=g)
        self.x = torch.randn(n, 2, 4, 4, generator=g) * 0.3 + self.y.view(-1, 1, 1, 1).float()

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def load(n=300):
    return Blobs(n, 0), Blobs(90, 1)


def net(width=8):
    return nn.Sequential(nn.Conv2d(2, width, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(width * 16, 3))
'''


@pytest.mark.cluster
def test_user_model_and_dataset_factories(run_job, tmp_path):
    (tmp_path / "userjob").mkdir()
    (tmp_path / "userjob" / "__init__.py").write_text("")
    (tmp_path / "userjob" / "parts.py").write_text(USER_CODE)
    args = ["--model", "userjob.parts:net", "--model-args", '{"width": 6}', "--dataset", "userjob.parts:load",
            "--dataset-args", '{"n": 240}', "--epochs", "3", "--global-batch", "24", "--lr", "0.05"]
    run = run_job(args, env={"PYTHONPATH": str(tmp_path)})
    s = run.summary
    assert s["num_params"] == 6 * 2 * 9 + 6 + 6 * 16 * 3 + 3
    assert s["samples"] == 30 * 24 and s["final_test_accuracy"] >= 0.9


def test_console_scripts_point_at_the_roles():
    from importlib.metadata import entry_points

    import omnips.scheduler.__main__
    import omnips.server.__main__
    import omnips.worker.__main__
    from omnips import cli

    scripts = {e.name: e.load() for e in entry_points(group="console_scripts") if e.name.startswith("omnips")}
    assert scripts == {"omnips": cli.main, "omnips-scheduler": omnips.scheduler.__main__.main,
                       "omnips-server": omnips.server.__main__.main, "omnips-worker": omnips.worker.__main__.main}
