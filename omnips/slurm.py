"""`omnips slurm`: an sbatch script for a heterogeneous Slurm job. Component 0 holds the
scheduler (run by the batch shell, on the component's first node) and the servers; GPU
workers and CPU workers are further components, each worker its own job step.

The scheduler binds a free port and prints it into its log in the run directory; the
batch shell reads it there and hands `tcp://NODE_ADDR:PORT` (the NodeAddr of component
0's first node) to every step in OMNIPS_SCHEDULER. Slurm's warning signal before the
time limit (USR1) and a preemption's TERM reach the batch shell, which passes TERM to the
scheduler: it checkpoints and stops the job. A scheduler that exits with PREEMPTED_EXIT
gets the job requeued; a run directory holding a complete checkpoint is resumed."""

import argparse
import shlex
import sys

from .clusterjob import ClusterJob, parse
from .job import PREEMPTED_EXIT
from .transport import MALLOC_ENV

WARNING_S = 90  # the time-limit warning: enough for a checkpoint and the model's write


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--partition", default=None, help="partition of the scheduler, servers and CPU workers "
                   "(default: the cluster's default)")
    p.add_argument("--gpu-partition", default=None, help="partition of the GPU workers (default: --partition)")
    p.add_argument("--gpus-per-worker", type=int, default=1, help="GPUs per worker with --device cuda (default 1)")
    p.add_argument("--time", default="1:00:00", help="the job's time limit, as sbatch --time takes it")
    p.add_argument("--job-name", default="omnips", help="sbatch --job-name")


_SCHEDULER = object()  # stands for "$OMNIPS_SCHEDULER" in a command line, which the shell expands


def _q(words: list) -> str:
    return " ".join('"$OMNIPS_SCHEDULER"' if w is _SCHEDULER else shlex.quote(w) for w in words)


def render(job: ClusterJob, partition: str | None, gpu_partition: str | None, gpus_per_worker: int,
           time_limit: str, job_name: str = "omnips") -> str:
    gpu, cpu = job.gpu_ranks(), job.cpu_ranks()
    components = [(partition, [f"--ntasks={1 + job.num_servers}"])]  # the scheduler and the servers
    group = {}  # worker rank -> its component
    if gpu:
        components.append((gpu_partition or partition, [f"--ntasks={len(gpu)}",
                                                        f"--gpus-per-task={gpus_per_worker}"]))
        group.update({r: len(components) - 1 for r in gpu})
    if cpu:
        cpus = max(max(job.workers[r].threads for r in cpu), 1)
        components.append((partition, [f"--ntasks={len(cpu)}", f"--cpus-per-task={cpus}"]))
        group.update({r: len(components) - 1 for r in cpu})
    head = [
        "#!/bin/bash",
        "# An omnips job (made by `omnips slurm`): submit with sbatch.",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --time={time_limit}",
        f"#SBATCH --output={job_name}-%j.out",  # in the directory sbatch ran in: Slurm opens it before the script runs
        "#SBATCH --open-mode=append",
        "#SBATCH --requeue",
        f"#SBATCH --signal=B:USR1@{WARNING_S}",
    ]
    for i, (part, opts) in enumerate(components):
        if i:
            head.append("#SBATCH hetjob")
        head.append("#SBATCH " + " ".join(([f"--partition={part}"] if part else []) + opts))
    env = {**MALLOC_ENV, **job.env()}
    steps = [f'srun --het-group=0 --ntasks={job.num_servers} --exact --kill-on-bad-exit=0 '
             f'--output="$RUN_DIR/logs/server%t.$attempt.log" {_q(job.server_cmd(_SCHEDULER))} & steps+=($!)']
    for rank in range(len(job.workers)):
        gpus = f" --gpus-per-task={gpus_per_worker}" if rank in gpu else ""
        cpus = max(job.workers[rank].threads, 1)
        steps.append(f"srun --het-group={group[rank]} --ntasks=1 --cpus-per-task={cpus}{gpus} --exact "
                     f'--kill-on-bad-exit=0 --output="$RUN_DIR/logs/worker{rank}.$attempt.log" '
                     f"{_q(job.worker_cmd(rank, _SCHEDULER))} & steps+=($!)")
    token = [f"export OMNIPS_TOKEN={shlex.quote(job.token)}  # the job token (readable by whoever reads this file)"] \
        if job.token else []
    body = BODY.format(
        python=shlex.quote(job.python), run_dir=shlex.quote(job.run_dir), preempted=PREEMPTED_EXIT,
        env=" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), token="\n".join(token),
        scheduler=_q(job.scheduler_cmd(0)[1:]), steps="\n".join(steps))
    return "\n".join(head) + "\n" + body


BODY = r"""
set -uo pipefail
PYTHON={python}
RUN_DIR={run_dir}
PREEMPTED_EXIT={preempted}  # the scheduler stopped for a preemption, with a checkpoint: requeue
export {env}
{token}
say() {{ echo "omnips $(date -u +%FT%TZ): $*"; }}
attempt=${{SLURM_RESTART_COUNT:-0}}
mkdir -p "$RUN_DIR/logs"
resume=()
if compgen -G "$RUN_DIR/checkpoints/step-*/manifest.json" >/dev/null; then
    resume=(--resume "$RUN_DIR")
elif [ "$attempt" != 0 ]; then  # stopped before its first checkpoint: start afresh, the last try set aside
    aside="$RUN_DIR/attempt-$((attempt - 1))"
    mkdir -p "$aside"
    for f in config.json metrics.jsonl summary.json model.pt; do
        if [ -e "$RUN_DIR/$f" ]; then mv "$RUN_DIR/$f" "$aside/"; fi
    done
    say "no complete checkpoint to resume from: starting afresh, the last try's outputs in $aside"
fi

log="$RUN_DIR/logs/scheduler.$attempt.log"
"$PYTHON" {scheduler} "${{resume[@]}}" >"$log" 2>&1 &
scheduler=$!
stopping=0
# the time-limit warning (USR1) and a preemption (TERM): the scheduler checkpoints and stops
trap 'stopping=1; kill -TERM $scheduler 2>/dev/null' USR1 TERM

port=""
for _ in $(seq 1200); do  # up to 120 s for the scheduler to bind
    port=$(sed -n 's|.*listening on tcp://[^ ]*:\([0-9][0-9]*\).*|\1|p' "$log" | head -n 1)
    if [ -n "$port" ] || ! kill -0 $scheduler 2>/dev/null; then break; fi
    sleep 0.1
done
if [ -z "$port" ]; then
    say "the scheduler did not start, see $log" >&2
    kill -TERM $scheduler 2>/dev/null; wait $scheduler; exit 1
fi
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_0" | head -n 1)
addr=$(scontrol show node "$head_node" -o | sed -n 's/.* NodeAddr=\([^ ]*\).*/\1/p')
export OMNIPS_SCHEDULER="tcp://${{addr:-$head_node}}:$port"
echo "$OMNIPS_SCHEDULER" >"$RUN_DIR/scheduler.address"
say "scheduler at $OMNIPS_SCHEDULER (attempt $attempt${{resume:+, resumed}})"

steps=()
{steps}

while :; do  # a trapped signal interrupts wait: wait again for the scheduler's own exit code
    stopping=0
    wait $scheduler
    code=$?
    [ $stopping = 1 ] || break
done
say "the scheduler exited with $code"
for _ in $(seq 60); do  # the servers and workers exit when the scheduler tells them: up to 60 s
    alive=0
    for pid in "${{steps[@]}}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break
    sleep 1
done
if [ "$code" = "$PREEMPTED_EXIT" ]; then
    say "preempted; requeueing job $SLURM_JOB_ID to resume from $RUN_DIR"
    scontrol requeue "$SLURM_JOB_ID"
fi
exit $code
"""


def main(argv) -> int:
    job, args = parse("omnips slurm", argv, add_flags)
    if args.gpus_per_worker < 1:
        print("omnips slurm: --gpus-per-worker must be >= 1", file=sys.stderr)
        return 2
    sys.stdout.write(render(job, args.partition, args.gpu_partition, args.gpus_per_worker, args.time,
                            args.job_name))
    return 0
