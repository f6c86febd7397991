"""Every command of docs/clusters.md, run as the page shows it: the bash blocks of each
section, with the settings block's values replaced by this host's (loopback, free ports,
a temporary run directory). `omnips` is this checkout's (a shim on PATH); the Slurm section
runs on a real Slurm (tests/slurm_cluster.py); `kubectl` is a stand-in that checks the
Secret's files and reads every manifest with the Kubernetes client's models."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from slurm_cluster import free_ports

from helpers import WAIT_FACTOR

pytestmark = pytest.mark.cluster  # every test here starts processes

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "clusters.md"
JOB_TIMEOUT_S = 300
SETTINGS = ["HEAD", "PORT", "SERVER_PORT", "RUN_DIR"]


def blocks(section: str) -> list[str]:
    """The bash blocks under the `## section` heading, in order."""
    text = DOC.read_text().split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)```", text, re.S)


def test_the_page_is_what_the_tests_run():
    assert len(blocks("Several hosts by hand")) == 5 and len(blocks("Slurm")) == 1
    assert len(blocks("Kubernetes")) == 1 and "## What every cluster needs" in DOC.read_text()
    assert re.findall(r"^(\w+)=", blocks("Several hosts by hand")[0], re.M) == SETTINGS
    assert "[clusters](docs/clusters.md)" in (ROOT / "README.md").read_text()


@pytest.fixture
def shell(tmp_path):
    """bash -c BLOCK in tmp_path, after the settings for this host, with `omnips` and
    scripts/ from this checkout."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "omnips"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m omnips.cli "$@"\n')
    shim.chmod(0o755)
    (tmp_path / "scripts").symlink_to(ROOT / "scripts")
    ports = free_ports(2)  # the page's fixed ports (a firewall needs them fixed)
    settings = {"HEAD": "127.0.0.1", "PORT": ports[0], "SERVER_PORT": ports[1], "RUN_DIR": tmp_path / "run"}
    prelude = "".join(f"{k}={v}\n" for k, v in settings.items())
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OMNIPS_PYTHON": sys.executable,
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("OMNIPS_TOKEN", None)

    class Shell:
        dir = tmp_path
        run_dir = tmp_path / "run"

        def start(self, block: str, name: str, extra_env=None) -> subprocess.Popen:
            log = open(tmp_path / f"{name}.log", "w")
            proc = subprocess.Popen(["bash", "-euc", prelude + block], cwd=tmp_path, env={**env, **(extra_env or {})},
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            log.close()
            procs.append(proc)
            return proc

        def run(self, block: str, name: str, extra_env=None) -> str:
            proc = self.start(block, name, extra_env)
            assert proc.wait(timeout=120 * WAIT_FACTOR) == 0, self.log(name)
            return self.log(name)

        def log(self, name: str) -> str:
            return (tmp_path / f"{name}.log").read_text(errors="replace")

    procs: list[subprocess.Popen] = []
    yield Shell()
    for proc in procs:  # nothing outlives the test
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10 * WAIT_FACTOR)


def test_several_hosts_by_hand(shell):
    """Section 'Several hosts by hand', every host being this one: the keys, a scheduler,
    a server and two workers, each started with its block."""
    _settings, keygen, scheduler, server, worker = blocks("Several hosts by hand")
    shell.run(keygen, "keygen")
    sched = shell.start(scheduler, "scheduler")
    shell.start(server, "server")
    workers = [shell.start(worker, f"worker{i}") for i in range(2)]
    assert sched.wait(timeout=JOB_TIMEOUT_S) == 0, shell.log("scheduler") + shell.log("server")
    for w in workers:
        assert w.wait(timeout=60 * WAIT_FACTOR) == 0, shell.log("worker0")
    summary = json.loads((shell.run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["num_workers"] == 2 and summary["checkpoints"] >= 1
    assert "connections: CURVE" in shell.log("scheduler") and "CURVE" in shell.log("server")


def test_slurm(shell, slurm_cluster):
    """Section 'Slurm': its block, after the keys, submitted to a real Slurm."""
    shell.run(blocks("Several hosts by hand")[1], "keygen")
    out = shell.run(blocks("Slurm")[0], "slurm", extra_env=_slurm_env(slurm_cluster, shell.dir / "bin"))
    job_id = re.search(r"Submitted batch job (\d+)", out).group(1)
    state = slurm_cluster.wait_job(job_id, JOB_TIMEOUT_S)
    assert state["JobState"] == "COMPLETED", (state, (shell.dir / f"omnips-{job_id}.out").read_text())
    summary = json.loads((shell.run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["num_workers"] == 2
    assert "connections: CURVE" in (shell.run_dir / "logs" / "scheduler.0.log").read_text()


KUBECTL = '''#!{python}
"""A stand-in for kubectl: `create secret generic NAME --from-file=DIR/` checks DIR holds
what the manifests mount; `apply -f FILE` reads each manifest with the client's models."""
import json, sys
from pathlib import Path
import kubernetes, yaml
from omnips.k8s import SECRET_ITEMS
args = sys.argv[1:]
if args[:3] == ["create", "secret", "generic"]:
    keys = Path(args[4].removeprefix("--from-file="))
    missing = sorted({{k for k, _ in SECRET_ITEMS}} - {{p.name for p in keys.iterdir() if p.is_file()}})
    sys.exit(f"missing from {{keys}}: {{missing}}" if missing else 0)
assert args[:2] == ["apply", "-f"], args
client = kubernetes.client.ApiClient()
models = {{"Service": "V1Service", "Job": "V1Job", "PersistentVolumeClaim": "V1PersistentVolumeClaim"}}
for doc in yaml.safe_load_all(Path(args[2]).read_text()):
    model = client.deserialize(json.dumps(doc), models[doc["kind"]], "application/json")
    assert client.sanitize_for_serialization(model) == doc, doc["metadata"]["name"]
    print(f"{{doc['kind'].lower()}}/{{doc['metadata']['name']}} created")
'''


def test_kubernetes(shell):
    """Section 'Kubernetes': its block, after the keys, with the stand-in kubectl."""
    pytest.importorskip("kubernetes", reason="NO KUBERNETES MODEL CHECK: pip install -e .[clusters]")
    kubectl = shell.dir / "bin" / "kubectl"
    kubectl.write_text(KUBECTL.format(python=sys.executable))
    kubectl.chmod(0o755)
    shell.run(blocks("Several hosts by hand")[1], "keygen")
    out = shell.run(blocks("Kubernetes")[0], "k8s")
    assert out.splitlines() == ["persistentvolumeclaim/omnips-runs created", "service/omnips created",
                                "job/omnips-scheduler created", "job/omnips-server created",
                                "job/omnips-worker-cpu created"], out
    assert "--from-file=" in (shell.dir / "omnips.yaml").read_text().splitlines()[1]


def _slurm_env(cluster, shim_dir: Path) -> dict:
    """Slurm's commands and configuration, and the omnips shim still first on PATH."""
    return {"SLURM_CONF": cluster.env["SLURM_CONF"], "LD_LIBRARY_PATH": cluster.env["LD_LIBRARY_PATH"],
            "PATH": f"{shim_dir}:{cluster.env['PATH']}"}
