"""A worker's CPU quota, read from its cgroups (v1 or v2, its own and those above it), and
the pace it sets for the probe's passes (worker/quota.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from omnips.worker.quota import cgroup_dirs, cpu_quota, paced, pacing

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import quota as benchmark_quota  # noqa: E402

V1_MOUNT = "32 31 0:29 {root} {point} rw,relatime - cgroup cgroup rw,cpu,cpuacct"
V2_MOUNT = "41 31 0:38 {root} {point} rw,relatime - cgroup2 cgroup2 rw"
OTHER_V1 = "33 31 0:30 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory"


def test_the_cpu_cgroup_and_those_above_it_up_to_its_mount():
    mounts = "\n".join([OTHER_V1, V1_MOUNT.format(root="/", point="/sys/fs/cgroup/cpu,cpuacct"),
                        V2_MOUNT.format(root="/", point="/sys/fs/cgroup/unified")])
    assert cgroup_dirs("4:memory:/mem\n2:cpu,cpuacct:/jobs/w0\n0::/", mounts) == [
        Path("/sys/fs/cgroup/cpu,cpuacct/jobs/w0"), Path("/sys/fs/cgroup/cpu,cpuacct/jobs"),
        Path("/sys/fs/cgroup/cpu,cpuacct")]


def test_a_container_sees_its_own_cgroup_at_the_mount_point():
    """Without a cgroup namespace a container's mount shows its own cgroup at the mount point
    (mountinfo's root field), not the host's whole tree."""
    mounts = V1_MOUNT.format(root="/docker/abc", point="/sys/fs/cgroup/cpu")
    assert cgroup_dirs("2:cpu,cpuacct:/docker/abc", mounts) == [Path("/sys/fs/cgroup/cpu")]
    assert cgroup_dirs("2:cpu,cpuacct:/docker/other", mounts) == []  # a part of the tree this mount does not show


def test_v2_alone_and_no_cpu_hierarchy():
    mounts = V2_MOUNT.format(root="/", point="/sys/fs/cgroup")
    assert cgroup_dirs("0::/user.slice/job", mounts) == [
        Path("/sys/fs/cgroup/user.slice/job"), Path("/sys/fs/cgroup/user.slice"), Path("/sys/fs/cgroup")]
    assert cgroup_dirs("4:memory:/mem", OTHER_V1) == []


def _fake_proc(tmp_path, cgroup: str, mount: str, files: dict[str, str]) -> Path:
    """A /proc/self whose cgroup mount is under `tmp_path`, holding `files` (path -> text)."""
    point = tmp_path / "cg"
    for name, text in files.items():
        (point / name).parent.mkdir(parents=True, exist_ok=True)
        (point / name).write_text(text)
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(cgroup)
    (proc / "mountinfo").write_text(mount.format(root="/", point=point))
    return proc


def test_the_quota_is_the_least_over_the_cgroup_and_those_above_it(tmp_path):
    v1 = _fake_proc(tmp_path / "v1", "2:cpu,cpuacct:/job/w0\n", V1_MOUNT, {
        "cpu.cfs_quota_us": "-1\n", "cpu.cfs_period_us": "100000\n",
        "job/cpu.cfs_quota_us": "50000\n", "job/cpu.cfs_period_us": "100000\n",  # the container: half a core
        "job/w0/cpu.cfs_quota_us": "200000\n", "job/w0/cpu.cfs_period_us": "100000\n"})
    assert cpu_quota(v1) == 0.5
    v2 = _fake_proc(tmp_path / "v2", "0::/job/w0\n", V2_MOUNT, {
        "job/cpu.max": "max 100000\n", "job/w0/cpu.max": "2500 10000\n"})
    assert cpu_quota(v2) == 0.25


def test_no_quota_where_none_is_set_or_nothing_can_be_read(tmp_path):
    unlimited = _fake_proc(tmp_path / "a", "0::/job\n", V2_MOUNT, {"job/cpu.max": "max 100000\n"})
    assert cpu_quota(unlimited) is None
    garbled = _fake_proc(tmp_path / "b", "0::/job\n", V2_MOUNT, {"job/cpu.max": "lots\n"})
    assert cpu_quota(garbled) is None
    assert cpu_quota(tmp_path / "no-proc") is None


def test_a_pass_is_taken_at_the_quota_s_pace_only_where_that_is_longer():
    assert paced(0.145, 0.025, 0.125) == pytest.approx(0.2)  # ran on a period's unspent budget
    assert paced(0.30, 0.025, 0.125) == 0.30  # slowed by others besides: its wall time
    assert paced(0.145, 0.025, None) == 0.145  # no quota
    assert paced(0.05, 0.09, 1.5) == pytest.approx(0.06)  # two threads under one and a half cores


def test_only_a_cpu_device_s_probe_passes_are_paced_by_the_quota():
    assert pacing("cpu", 0.5) == 0.5
    assert pacing("cpu", None) is None
    # a GPU's passes run on the device: its waits' CPU time at 0.5 cores would double them
    assert pacing("cuda", 0.5) is None and pacing("mps", 0.5) is None


WHY = benchmark_quota.available()


@pytest.mark.cluster
@pytest.mark.skipif(WHY is not None, reason=f"CPU quotas cannot be set here: {WHY}")
def test_a_process_in_a_real_cgroup_reads_its_quota():
    code = ("import os, sys; open(sys.argv[1], 'w').write(str(os.getpid())); "
            "from omnips.worker.quota import cpu_quota; print(cpu_quota())")
    with benchmark_quota.CpuQuota(f"omnips-test-{os.getpid()}-read", 0.25) as q:
        procs = q.path / "cgroup.procs"
        # the child joins the group itself (its own pid into cgroup.procs), then reads its quota
        out = subprocess.run([sys.executable, "-c", code, str(procs)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) == 0.25
