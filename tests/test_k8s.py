"""`omnips k8s`'s manifests: against golden files (tests/golden/), and read by the
`kubernetes` client's models, which must know every field (no cluster runs here).
OMNIPS_UPDATE_GOLDEN=1 rewrites the golden files."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from omnips import security

from helpers import WAIT_FACTOR

kubernetes = pytest.importorskip("kubernetes", reason="NO KUBERNETES MODEL CHECK: pip install -e .[clusters]")
yaml = pytest.importorskip("yaml")

pytestmark = pytest.mark.cluster  # every test here starts processes

GOLDEN = Path(__file__).resolve().parent / "golden"
MODELS = {"Service": "V1Service", "Job": "V1Job", "PersistentVolumeClaim": "V1PersistentVolumeClaim"}
CASES = {
    # the docs' command (docs/clusters.md, "Kubernetes")
    "k8s-cpu.yaml": ["--image", "registry.example.com/omnips:0.1", "--num-servers", "1", "--num-workers", "2",
                     "--model", "mlp", "--epochs", "2"],
    "k8s-gpu.yaml": ["--image", "registry.example.com/omnips:0.1", "--name", "big", "--namespace", "ml",
                     "--num-servers", "2", "--num-workers", "3", "--device", "cuda", "cuda", "cpu",
                     "--threads", "0", "0", "4", "--gpus-per-worker", "2", "--keys", "keys", "--token", "t",
                     "--model", "cnn", "--checkpoint-every", "100", "--storage-class", "nfs"],
}


def k8s(cwd, *argv) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OMNIPS_TOKEN"}
    return subprocess.run([sys.executable, "-m", "omnips.cli", "k8s", *argv], capture_output=True, text=True,
                          timeout=60 * WAIT_FACTOR, cwd=cwd, env=env)


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("k8s")
    security.keygen(cwd / "keys")
    out = {}
    for name, argv in CASES.items():
        run = k8s(cwd, *argv)
        assert run.returncode == 0, run.stderr
        out[name] = run.stdout
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_manifests_match_the_golden_files(generated, name):
    if os.environ.get("OMNIPS_UPDATE_GOLDEN"):
        (GOLDEN / name).write_text(generated[name])
    assert generated[name] == (GOLDEN / name).read_text()


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_field_is_known_to_the_kubernetes_models(generated, name):
    client = kubernetes.client.ApiClient()
    docs = list(yaml.safe_load_all(generated[name]))
    assert [d["kind"] for d in docs[:4]] == ["PersistentVolumeClaim", "Service", "Job", "Job"]
    for doc in docs:
        model = client.deserialize(json.dumps(doc), MODELS[doc["kind"]], "application/json")
        # a field the model does not know would be dropped here
        assert client.sanitize_for_serialization(model) == doc


def test_roles_find_each_other_through_the_headless_service(generated):
    docs = {d["metadata"]["name"]: d for d in yaml.safe_load_all(generated["k8s-gpu.yaml"])}
    assert docs["big"]["spec"]["clusterIP"] == "None"
    for job in ("big-scheduler", "big-server", "big-worker-gpu", "big-worker-cpu"):
        spec = docs[job]["spec"]
        assert spec["completionMode"] == "Indexed" and spec["template"]["spec"]["subdomain"] == "big"
        assert docs[job]["metadata"]["namespace"] == "ml"
    assert docs["big-server"]["spec"]["completions"] == 2
    gpu, cpu = docs["big-worker-gpu"]["spec"], docs["big-worker-cpu"]["spec"]
    assert (gpu["completions"], cpu["completions"]) == (2, 1)
    assert gpu["template"]["spec"]["containers"][0]["resources"] == {"limits": {"nvidia.com/gpu": "2"}}
    assert "resources" not in cpu["template"]["spec"]["containers"][0]
    worker = cpu["template"]["spec"]["containers"][0]["command"]
    assert worker[worker.index("--scheduler") + 1] == "tcp://big-scheduler-0.big:5555"
    assert docs["big-runs"]["spec"]["accessModes"] == ["ReadWriteMany"]
    volumes = {v["name"]: v for v in cpu["template"]["spec"]["volumes"]}
    assert volumes["keys"]["secret"]["secretName"] == "big-keys"
    assert "authorized/client.key" in [i["path"] for i in volumes["keys"]["secret"]["items"]]
    assert generated["k8s-gpu.yaml"].splitlines()[1] == \
        '# first, the Secret: kubectl create secret generic big-keys --from-file=keys/ --from-literal=token="$OMNIPS_TOKEN"'



def test_workers_of_one_kind_must_share_their_flags(tmp_path):
    run = k8s(tmp_path, "--image", "x", "--num-workers", "2", "--threads", "1", "2")
    assert run.returncode == 2 and "CPU workers differ in threads" in run.stderr
    run = k8s(tmp_path, "--image", "x", "--run-dir", "r")
    assert run.returncode == 2 and "--run-dir" in run.stderr

