"""The DDP side of benchmarks/vs_ddp.py: gloo ranks on 127.0.0.1 that train a job's model on
its BSP sample stream at a hand-set plan, each rank's compute phase padded to its virtual
device in a DDP communication hook (vs_ddp.py's docstring says how and why)."""

import datetime
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from omnips import data, models
from omnips.optim import SGD
from omnips.transport import tune_malloc
from omnips.worker.emulation import Emulation


class Pad:
    """What `pad_then_allreduce` needs about the step in progress."""

    def __init__(self, emulation: Emulation):
        self.emulation = emulation
        self.started, self.step, self.batch, self.compute_s = 0.0, 0, 0, 0.0

    def begin(self, step: int, batch: int) -> None:
        self.started, self.step, self.batch = time.perf_counter(), step, batch


def pad_then_allreduce(pad: Pad, bucket):
    """A DDP communication hook: end the compute phase where the virtual device would,
    then allreduce as DDP's default hook does (sum, then divide by the ranks)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    if not bucket.is_last():  # a second bucket would run backward after the padding
        raise RuntimeError("the model's gradients span several DDP buckets: the emulation needs one")
    real = time.perf_counter() - pad.started
    target = pad.emulation.target_s(pad.step, pad.batch, real)
    if target > real:
        time.sleep(target - real)  # the emulated slower device: the delay is the feature
    pad.compute_s = max(target, real)
    return allreduce_hook(None, bucket)


def ddp_rank(rank: int, spec: dict, port: int, out_dir: str) -> None:
    """One DDP rank: train spec["steps"] steps at each plan of spec["plans"] in turn (the model
    and optimizer built anew for each), write its timings."""
    tune_malloc()  # the allocator settings omnips processes get
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = spec["loopback"]
    n = len(spec["slowdowns"])
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=n, timeout=datetime.timedelta(seconds=120))
    try:
        train, test = data.load(spec["dataset"], spec["dataset_args"])
        emulation = Emulation(((0, spec["slowdowns"][rank]),), spec["ms_per_step"], spec["ms_per_sample"])
        out = [train_plan(rank, plan, spec, train, test, emulation) for plan in spec["plans"]]
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
        # every rank done (rank 0 evaluates last) before any tears its connections down: gloo
        # aborted a rank whose peers had gone while it still held pairs to them
        dist.barrier()
    finally:
        dist.destroy_process_group()


def train_plan(rank: int, batches: list[int], spec: dict, train, test, emulation: Emulation) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    total, n = spec["global_batch"], len(batches)
    module = models.build("mlp", spec["model_args"], train, spec["seed"])
    model_mb = sum(p.numel() * p.element_size() for p in module.parameters()) / 2**20
    ddp = DistributedDataParallel(module, bucket_cap_mb=model_mb + 1)
    pad = Pad(emulation)
    ddp.register_comm_hook(pad, pad_then_allreduce)
    # omnips's server update, which is torch.optim.SGD bit for bit (tests/test_optim.py)
    opts = [(SGD(p.data.view(-1), spec["momentum"], False, 0.0), p) for p in module.parameters()]  # flat, as a shard
    stream, batcher = data.SampleStream(len(train), spec["seed"]), data.Batcher(train)
    b, offset = batches[rank], sum(batches[:rank])
    scale = b * n / total  # DDP averages over ranks: this makes it the global batch's mean
    compute = []
    dist.barrier()
    start = time.monotonic()
    for step in range(spec["steps"]):
        pad.begin(step, b)
        x, y = batcher(stream.take(step * total + offset, b))
        ddp.zero_grad()
        (models.loss_fn(ddp(x), y) * scale).backward()
        for opt, param in opts:
            opt.begin(spec["lr"])
            opt.apply([(0, param.grad.view(-1))])
        compute.append(pad.compute_s)
    end = time.monotonic()
    acc, loss = models.evaluate(module, data.Batcher(test), len(test)) if rank == 0 else (None, None)
    return {"start": start, "end": end, "compute_s": compute, "test_accuracy": acc, "test_loss": loss}


def loopback_interface() -> str:
    for _, name in socket.if_nameindex():
        if name == "lo":
            return name
    raise SystemExit("no loopback interface 'lo' for gloo")


def run_ddp(w, slowdowns: list[float], plans: list[list[int]], steps: int, out: Path, timeout_s: float) -> list[dict]:
    """Each plan trained by one set of DDP rank processes, one plan after the other: `w` a
    vs_ddp.Workload (its job's model, data and recipe, its virtual device), a rank per slowdown."""
    out.mkdir(parents=True)
    job = w.job()
    spec = {"plans": plans, "global_batch": job.global_batch, "steps": steps, "slowdowns": slowdowns,
            "ms_per_step": w.ms_per_step, "ms_per_sample": w.ms_per_sample, "dataset": job.dataset,
            "dataset_args": job.dataset_args, "model_args": job.model_args, "lr": job.lr, "momentum": job.momentum,
            "seed": job.seed, "loopback": loopback_interface()}
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    ctx = mp.start_processes(ddp_rank, args=(spec, store.port, str(out)), nprocs=len(slowdowns), join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout_s * len(plans)
    try:
        while not ctx.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                raise SystemExit(f"{out.name}: DDP did not finish within {timeout_s * len(plans):g} s")
    except mp.ProcessExitedException as exc:
        # gloo now and then aborts a rank as the group is torn down, after every rank wrote its
        # results ("terminate called without an active exception"): those results stand, said so
        if not all((out / f"rank{r}.json").exists() for r in range(len(slowdowns))):
            raise
        print(f"{out.name}: a DDP rank ended badly after every rank wrote its results ({exc}); they are used",
              file=sys.stderr)
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
                p.join(5)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(len(slowdowns))]
    results = []
    for k, batches in enumerate(plans):
        runs = [r[k] for r in ranks]
        slowest = [max(r["compute_s"][t] for r in runs) for t in range(steps)]
        results.append({"wall_s": max(r["end"] for r in runs) - min(r["start"] for r in runs), "steps": steps,
                        "batches": batches, "compute_s": sum(slowest),
                        "accuracy": runs[0]["test_accuracy"], "loss": runs[0]["test_loss"]})
    return results
