"""End to end: a scheduler, servers and workers as real processes over loopback ZeroMQ."""

import torch

from omnips import data, models
from omnips.launch import WorkerSpec

DIGITS_FAST = ["--dataset", "digits", "--model", "mlp", "--global-batch", "64", "--lr", "0.05",
               "--momentum", "0.9", "--seed", "3"]
HETERO = [WorkerSpec(slowdown="1"), WorkerSpec(slowdown="2"), WorkerSpec(slowdown="3")]


def test_bsp_trains_digits_to_90_percent(run_job):
    run = run_job(["--mode", "bsp", "--epochs", "8", *DIGITS_FAST], HETERO, num_servers=2)
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
    assert (run.dir / "config.json").exists() and (run.dir / "model.pt").exists()


def test_asp_trains_digits_to_90_percent(run_job):
    run = run_job(["--mode", "asp", "--epochs", "10", *DIGITS_FAST, "--lr", "0.02"], HETERO, num_servers=2)
    s = run.summary
    assert s["status"] == "completed"
    assert s["final_test_accuracy"] >= 0.90, s
    assert s["samples"] >= 10 * 1438
    assert sum(s["worker_steps"]) == s["steps"]
    assert s["staleness_max"] >= 1  # three asynchronous workers do see stale parameters
    steps = [e for e in run.events if e["event"] == "step"]
    assert all("staleness" in e for e in steps)


def test_bsp_equals_single_process_training(run_job):
    """S=2, N=3, unequal batches 10/20/34, SGD with momentum and weight decay, 20 steps."""
    args = ["--mode", "bsp", "--batching", "static", "--max-steps", "20", "--global-batch", "64",
            "--lr", "0.1", "--momentum", "0.9", "--weight-decay", "0.01", "--seed", "7"]
    workers = [WorkerSpec(capacity=c) for c in (10, 20, 34)]
    run = run_job(args, workers, num_servers=2)
    assert run.summary["final_batches"] == [10, 20, 34]  # the launcher asks for ranks in its order
    got = torch.load(run.dir / "model.pt")

    train, _ = data.load("digits", {})
    model = models.build("mlp", {}, train, seed=7)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    stream, batcher = data.SampleStream(len(train), seed=7), data.Batcher(train)
    for t in range(20):
        x, y = batcher(stream.take(t * 64, 64))
        opt.zero_grad()
        models.loss_fn(model(x), y).backward()
        opt.step()
    want = model.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert not torch.equal(want[k], models.build("mlp", {}, train, seed=7).state_dict()[k])  # it trained
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-5)
