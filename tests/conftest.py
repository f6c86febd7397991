"""Fixtures for end-to-end tests (helpers.py holds the cluster plumbing)."""

import subprocess
from pathlib import Path

import pytest
from helpers import finish, stand_in, start_cluster
from slurm_cluster import SlurmCluster, SlurmUnavailable
from hosts import Hosts, HostsRefused

from omnips.launch import WorkerSpec

try:  # its first import builds a font cache by running fc-list: here, before tests refuse processes
    import matplotlib.font_manager  # noqa: F401
except ImportError:  # (the plot extra is optional)
    pass


@pytest.fixture
def run_job(tmp_path):
    """run_job(scheduler_args, workers, num_servers=1) -> Run, after the job ended cleanly."""
    def run(scheduler_args, workers=(WorkerSpec(), WorkerSpec()), num_servers=1, name="run", **kw):
        return finish(start_cluster(tmp_path / name, scheduler_args, workers, num_servers, **kw))
    return run


@pytest.fixture
def linked():
    """helpers.stand_in's link with --dead-after 3."""
    with stand_in(dead_after_s=3.0) as linked:
        yield linked


@pytest.fixture(autouse=True)
def _processes_only_in_the_cluster_tier(request, monkeypatch):
    """`pytest -m "not cluster"` runs the in-process tier: a test that starts a process
    must say so with the `cluster` mark, or it fails here."""
    if request.node.get_closest_marker("cluster") is None:
        def refused(*args, **kwargs):
            raise AssertionError("this test starts a process: mark it pytest.mark.cluster")
        monkeypatch.setattr(subprocess, "Popen", refused)


@pytest.fixture
def slurm_cluster(tmp_path_factory):
    """A real Slurm on loopback (tests/slurm_cluster.py), stopped after the test; the test is
    skipped, saying why, where Debian's Slurm packages cannot be had."""
    try:
        cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    except SlurmUnavailable as exc:
        pytest.skip(f"NO SLURM TEST: Debian's Slurm packages cannot be had here: {exc}")
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture
def hosts(tmp_path):
    """hosts(*names) -> hosts.Hosts: emulated machines joined by a switch (tests/hosts.py),
    all torn down after the test, pass or fail. Skipped, saying why, where this machine
    refuses namespaces."""
    made = []

    def make(*names):
        h = Hosts(list(names), tmp_path)
        made.append(h)
        try:
            return h.create()
        except HostsRefused as exc:
            pytest.skip(f"EMULATED HOSTS REFUSED HERE, multi-host tests not run: {exc}")
    yield make
    for h in made:
        h.close()


@pytest.fixture
def ipv6_loopback():
    """Skips the test, saying so loudly, where this kernel has IPv6 off: then nothing binds ::1."""
    flag = Path("/proc/sys/net/ipv6/conf/lo/disable_ipv6")
    if not flag.exists():
        pytest.skip(f"NO IPv6 TEST: this kernel has no IPv6 ({flag} is missing)")
    if flag.read_text().strip() != "0":
        pytest.skip(f"NO IPv6 TEST: IPv6 is disabled on loopback ({flag} is {flag.read_text().strip()})")
