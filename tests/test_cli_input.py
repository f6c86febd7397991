"""`omnips` refuses bad input with one error line before it creates or starts anything.
No cluster starts here: the launcher's LocalCluster is replaced by one that fails the test."""

import json
import logging

import pytest

from omnips import cli, plot


class Started(Exception):
    pass


@pytest.fixture
def no_cluster(monkeypatch):
    """Fail with Started where the launcher would make the run directory and start processes."""
    def refuse(*args, **kwargs):
        raise Started
    monkeypatch.setattr(cli, "LocalCluster", refuse)


def refused(argv, capsys) -> str:
    """The error line `omnips ARGV` exits with (argparse's exit 2)."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1, errors
    return errors[0]


# -- launch --resume -------------------------------------------------------------------------------

@pytest.mark.parametrize("config", [b"[]", b'{"num_workers": "2"}', b"\xff\xfe", b"{",
                                    pytest.param(b"[" * 100_000, id="nested-too-deep")])
def test_launch_refuses_a_resumed_job_it_cannot_read(tmp_path, capsys, no_cluster, config):
    (tmp_path / "config.json").write_bytes(config)
    assert "config.json" in refused(["launch", "--resume", str(tmp_path)], capsys)
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]


def test_launch_refuses_an_empty_resume(tmp_path, capsys, monkeypatch, no_cluster):
    monkeypatch.chdir(tmp_path)
    assert "argument --resume" in refused(["launch", "--resume", ""], capsys)
    assert not any(tmp_path.iterdir())


# -- launch: every value checked before anything starts --------------------------------------------

@pytest.mark.parametrize("argv, named", [
    (["--lr", "-1"], "--lr"),
    (["--global-batch", "1"], "--global-batch"),
    (["--capacity", "nan"], "--capacity"),
    (["--num-workers", "2", "--capacity", "1", "inf"], "worker 1: --capacity"),
    (["--device", "foo"], "--device"),
    (["--emulate-ms-per-step", "-5"], "--emulate-ms-per-step"),
    (["--timeout", "nan"], "--timeout"),
    (["--timeout", "-1"], "--timeout"),
    (["--dead-after", "1.5"], "--dead-after"),  # the scheduler's own checks beyond its parser
    (["--checkpoint-every", "-1"], "--checkpoint-every"),
])
def test_launch_refuses_bad_values_before_starting_anything(tmp_path, capsys, no_cluster, argv, named):
    run_dir = tmp_path / "run"
    line = refused(["launch", "--run-dir", str(run_dir), *argv], capsys)
    assert line.startswith("omnips launch: error: ") and named in line
    assert not run_dir.exists()


def test_launch_starts_good_values_and_keeps_its_logging(tmp_path, no_cluster):
    root = logging.getLogger()
    before = root.handlers[:], root.level
    with pytest.raises(Started):  # past every check, to the cluster
        cli.main(["launch", "--run-dir", str(tmp_path / "run"), "--num-workers", "2", "--capacity", "1", "2",
                  "--lr", "0.1", "--timeout", str(14 * 24 * 3600)])  # a two-week job's limit
    assert (root.handlers, root.level) == before  # checking the workers' flags leaves the launcher's logging be


# -- keygen ----------------------------------------------------------------------------------------

def test_keygen_refuses_an_empty_dir(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    mode = tmp_path.stat().st_mode
    assert "dir" in refused(["keygen", ""], capsys)
    assert not any(tmp_path.iterdir()) and tmp_path.stat().st_mode == mode


def test_keygen_refuses_an_empty_client_name(tmp_path, capsys):
    assert "--client" in refused(["keygen", str(tmp_path / "keys"), "--client", ""], capsys)
    assert not (tmp_path / "keys").exists()


# -- plot ------------------------------------------------------------------------------------------

STEP = {"event": "step", "t": 1.0, "worker": 0, "batch": 8, "compute_s": 0.01, "epoch": 0.1}


@pytest.mark.parametrize("bad_line", [
    json.dumps({"event": "step", "t": 1}).encode(),  # no worker
    b"[1, 2]",
    json.dumps({"event": "eval", "t": 2.0, "epoch": 1}).encode(),  # no accuracy
    json.dumps({**STEP, "batch": "8"}).encode(),
    b'{"event": "step", "t": Infinity, "worker": 0, "batch": 8, "compute_s": 0.01}',
    b"\xff\xfe",
    b"{",
    pytest.param(b"[" * 100_000, id="nested-too-deep"),
])
def test_plot_refuses_a_bad_event_by_file_and_line_before_drawing(tmp_path, capsys, bad_line):
    (tmp_path / "metrics.jsonl").write_bytes(json.dumps(STEP).encode() + b"\n" + bad_line + b"\n")
    assert cli.main(["plot", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("omnips plot: ") and "\n" not in err
    assert f"{tmp_path / 'metrics.jsonl'} line 2" in err
    assert not (tmp_path / "plots").exists()


def test_plot_refuses_an_unreadable_metrics_file(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").mkdir()
    assert cli.main(["plot", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("omnips plot: ") and "metrics.jsonl" in err and "\n" not in err


def test_plot_reads_past_a_last_line_torn_by_a_crash(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps(STEP) + "\n" + '{"event": "st')
    assert plot.read_plotted(tmp_path) == [STEP]
