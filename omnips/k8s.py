"""`omnips k8s`: Kubernetes manifests for a job. One headless Service gives every pod a DNS
name (the scheduler at NAME-scheduler-0.NAME, on a fixed port since no pod can learn
another's chosen one); an Indexed Job per role: the scheduler, the servers, GPU workers
(with nvidia.com/gpu limits) and CPU workers apart. Keys come from a Secret, the run
directory is on a PersistentVolumeClaim every pod mounts. A scheduler whose run directory
holds a complete checkpoint resumes from it."""

import argparse
import dataclasses
import shlex
import sys

from .clusterjob import SCHEDULER_PORT, ClusterJob, parse
from .job import PREEMPTED_EXIT
from .transport import MALLOC_ENV
from .yamltext import dump_all

RUNS = "/omnips/runs"  # where the PersistentVolumeClaim is mounted
KEYS = "/omnips/keys"  # where the Secret's files are
PER_WORKER = ("capacity", "slowdown", "ms_per_step", "ms_per_sample", "threads", "device", "extra")


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", default="omnips", help="the job's name: prefix of every object (default omnips)")
    p.add_argument("--image", required=True, help="the container image, with omnips and its Python installed")
    p.add_argument("--namespace", default=None, help="the namespace of every object (default: kubectl's)")
    p.add_argument("--storage", default="10Gi", help="size of the run directory's volume claim (default 10Gi)")
    p.add_argument("--storage-class", default=None, help="its storage class (one with ReadWriteMany access)")
    p.add_argument("--keys-secret", default=None, help="the Secret holding --keys (default NAME-keys)")
    p.add_argument("--gpus-per-worker", type=int, default=1, help="nvidia.com/gpu per worker with --device cuda")


# The Secret holds the files of `omnips keygen DIR` (kubectl create secret generic NAME
# --from-file=DIR/ takes its plain files only); every pod's allow-list is its client key.
SECRET_ITEMS = [("server.key", "server.key"), ("server.key_secret", "server.key_secret"),
                ("client.key", "client.key"), ("client.key_secret", "client.key_secret"),
                ("client.key", "authorized/client.key")]


def secret_command(name: str, keys_dir: str | None, token: bool) -> str:
    """The command that makes the Secret: the keys' files, and the job token from $OMNIPS_TOKEN."""
    cmd = f"kubectl create secret generic {shlex.quote(name)}"
    if keys_dir:
        cmd += f" --from-file={shlex.quote(keys_dir.rstrip('/') + '/')}"
    return cmd + (' --from-literal=token="$OMNIPS_TOKEN"' if token else "")


def manifests(job: ClusterJob, name: str, image: str, namespace: str | None, storage: str,
              storage_class: str | None, keys_secret: str, gpus_per_worker: int) -> list[dict]:
    meta = lambda suffix, **kw: {"name": f"{name}{suffix}", **({"namespace": namespace} if namespace else {}), **kw}
    labels = {"app.kubernetes.io/name": "omnips", "app.kubernetes.io/instance": name}
    scheduler = f"tcp://{name}-scheduler-0.{name}:{SCHEDULER_PORT}"
    env = [{"name": k, "value": v} for k, v in {**MALLOC_ENV, **job.env()}.items()]
    if job.token:
        env.append({"name": "OMNIPS_TOKEN", "valueFrom": {"secretKeyRef": {"name": keys_secret, "key": "token"}}})
    mounts = [{"name": "runs", "mountPath": RUNS}]
    volumes = [{"name": "runs", "persistentVolumeClaim": {"claimName": f"{name}-runs"}}]
    if job.keys:
        mounts.append({"name": "keys", "mountPath": KEYS, "readOnly": True})
        volumes.append({"name": "keys", "secret": {"secretName": keys_secret, "defaultMode": 0o400,
                                                   "items": [{"key": k, "path": p} for k, p in SECRET_ITEMS]}})

    def indexed_job(role: str, count: int, command: list[str], resources: dict | None = None, ports=None,
                    extra_env=(), retry_codes=()) -> dict:
        container = {"name": role, "image": image, "command": command, "env": [*env, *extra_env],
                     "volumeMounts": mounts}
        if ports:
            container["ports"] = ports
        if resources:
            container["resources"] = resources
        return {
            "apiVersion": "batch/v1", "kind": "Job", "metadata": meta(f"-{role}", labels={**labels, "omnips/role": role}),
            "spec": {
                "completionMode": "Indexed", "completions": count, "parallelism": count, "backoffLimit": 0,
                # a pod evicted (a node drained, a preemption) is started again: a scheduler resumes from the
                # newest checkpoint, a server takes its shard back from it, a worker joins the vacant rank
                "podFailurePolicy": {"rules": [
                    {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
                    *([{"action": "Ignore", "onExitCodes": {"operator": "In", "values": list(retry_codes)}}]
                      if retry_codes else [])]},
                "template": {
                    "metadata": {"labels": {**labels, "omnips/role": role}},
                    "spec": {"subdomain": name, "restartPolicy": "Never", "containers": [container],
                             "volumes": volumes},
                },
            },
        }

    sched_cmd = shlex.join(job.scheduler_cmd(SCHEDULER_PORT))
    resume = (f'if ls {job.run_dir}/checkpoints/step-*/manifest.json >/dev/null 2>&1; '
              f'then exec {sched_cmd} --resume {job.run_dir}; else exec {sched_cmd}; fi')
    pod_ip = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    docs = [
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta("-runs", labels=labels),
         "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": storage}},
                  **({"storageClassName": storage_class} if storage_class else {})}},
        {"apiVersion": "v1", "kind": "Service", "metadata": meta("", labels=labels),
         "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": labels,
                  "ports": [{"name": "scheduler", "port": SCHEDULER_PORT}]}},
        indexed_job("scheduler", 1, ["/bin/sh", "-c", resume],
                    ports=[{"name": "scheduler", "containerPort": SCHEDULER_PORT}], retry_codes=[PREEMPTED_EXIT]),
        # a server's shard is reached at its pod's address (--advertise), on a port it picks
        indexed_job("server", job.num_servers, job.server_cmd(scheduler, "$(POD_IP)"), extra_env=[pod_ip]),
    ]
    for role, ranks, resources in (
            ("worker-gpu", job.gpu_ranks(), {"limits": {"nvidia.com/gpu": str(gpus_per_worker)}}),
            ("worker-cpu", job.cpu_ranks(), None)):
        if ranks:
            docs.append(indexed_job(role, len(ranks), job.worker_cmd(ranks[0], scheduler, ask_rank=False), resources))
    return docs


def uniform_kinds(job: ClusterJob) -> str | None:
    """Why the workers cannot be Indexed Jobs (one pod template per kind), or None."""
    for kind, ranks in (("GPU", job.gpu_ranks()), ("CPU", job.cpu_ranks())):
        for f in PER_WORKER:
            values = {repr(getattr(job.workers[r], f)) for r in ranks}
            if len(values) > 1:
                return f"{kind} workers differ in {f} ({', '.join(sorted(values))}): give them one value each"
    return None


def main(argv) -> int:
    job, args = parse("omnips k8s", argv, add_flags, python="python")
    if args.run_dir is not None:
        print(f"omnips k8s: --run-dir: the run directory is {RUNS}/NAME on the volume claim", file=sys.stderr)
        return 2
    why = uniform_kinds(job) or (None if args.gpus_per_worker >= 1 else "--gpus-per-worker must be >= 1")
    if why:
        print(f"omnips k8s: {why}", file=sys.stderr)
        return 2
    secret = args.keys_secret or f"{args.name}-keys"
    job = dataclasses.replace(job, run_dir=f"{RUNS}/{args.name}", keys=KEYS if job.keys else None)
    docs = manifests(job, args.name, args.image, args.namespace, args.storage, args.storage_class, secret,
                     args.gpus_per_worker)
    head = ["# omnips job: apply with kubectl apply -f FILE"]
    if job.keys or job.token:
        keys_dir = str(args.keys.path) if args.keys else None
        head.append(f"# first, the Secret: {secret_command(secret, keys_dir, bool(job.token))}")
    sys.stdout.write("\n".join(head) + "\n" + dump_all(docs))
    return 0
