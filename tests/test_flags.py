"""Command lines: timeouts must be positive and finite (NaN or inf would disable them), sizes
take binary suffixes, and the scheduler's defaults are the ones docs/operations.md's table gives."""

import re
from pathlib import Path

import pytest

from omnips.scheduler.__main__ import parser as scheduler_parser
from omnips.server.__main__ import parse as server_parse
from omnips.worker.__main__ import parse as worker_parse


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "1e9", "soon"])
def test_every_role_refuses_a_timeout_that_is_not_a_positive_finite_number(value, capsys):
    for parse in (lambda v: scheduler_parser().parse_args(["--stall-timeout", v]),
                  lambda v: server_parse(["--scheduler", "tcp://127.0.0.1:1", "--welcome-timeout", v]),
                  lambda v: worker_parse(["--scheduler", "tcp://127.0.0.1:1", "--server-timeout", v])):
        with pytest.raises(SystemExit) as exit_:
            parse(value)
        assert exit_.value.code == 2
        assert "seconds" in capsys.readouterr().err


def test_every_job_setting_has_its_scheduler_flag():
    from dataclasses import fields

    from omnips.job import JobSpec
    args = scheduler_parser().parse_args([])
    assert all(hasattr(args, f.name) for f in fields(JobSpec))


@pytest.mark.parametrize("text,want", [("1000", 1000), ("300K", 300 * 1024), ("2G", 2 * 2**30), ("1.5g", 3 * 2**29),
                                       ("4GiB", 4 * 2**30), ("512MB", 512 * 2**20)])
def test_sizes_take_binary_suffixes(text, want):
    assert worker_parse(["--scheduler", "tcp://127.0.0.1:1", "--memory-limit", text]).memory_limit == want


@pytest.mark.parametrize("text", ["", "G", "lots", "0", "-1G", "nan", "inf", "2X"])
def test_a_size_that_is_not_a_positive_byte_count_is_refused(text, capsys):
    with pytest.raises(SystemExit) as exit_:
        worker_parse(["--scheduler", "tcp://127.0.0.1:1", f"--memory-limit={text}"])
    assert exit_.value.code == 2 and "size" in capsys.readouterr().err


@pytest.mark.parametrize("text, ok", [("0", True), (str(2 ** 31), True), (str(2 ** 31 + 1), False), ("-1", False)])
def test_a_workers_max_batch_is_one_a_report_can_carry(text, ok, capsys):
    """(omnips.protocol.MAX_BATCH: a report of a larger one is refused, which would end the worker)"""
    args = ["--scheduler", "tcp://127.0.0.1:1", "--max-batch", text]
    if ok:
        assert worker_parse(args).max_batch == int(text)
        return
    with pytest.raises(SystemExit) as exit_:
        worker_parse(args)
    assert exit_.value.code == 2 and "--max-batch must be from 0 to 2147483648" in capsys.readouterr().err


@pytest.mark.parametrize("role, argv, text", [
    ("scheduler", ["--port", "70000"], "70000 is not a port"), ("scheduler", ["--port", "-1"], "-1 is not a port"),
    ("server", ["--port", "65536"], "65536 is not a port"), ("scheduler", ["--log-level", "loud"], "invalid choice"),
    ("server", ["--log-level", "loud"], "invalid choice"), ("worker", ["--log-level", "loud"], "invalid choice"),
    ("scheduler", ["--model-args", '{"width": NaN}'], "NaN is not a JSON value"),
    ("scheduler", ["--dataset-args", '{"noise": Infinity}'], "Infinity is not a JSON value"),
    ("scheduler", ["--status-port", "70000"], "70000 is not a port: use 0 to 65535 (0: any free one), or 'off'"),
    ("scheduler", ["--run-dir", ""], "must not be empty"), ("scheduler", ["--resume", ""], "must not be empty"),
])
def test_a_value_no_process_could_use_is_refused_not_wrapped_or_replaced(role, argv, text, capsys):
    with pytest.raises(SystemExit) as exit_:
        _parse(role, argv)
    assert exit_.value.code == 2 and text in capsys.readouterr().err


def test_ports_and_log_levels_in_range_are_taken():
    assert _parse("scheduler", ["--port", "65535", "--log-level", "debug"]).log_level == "DEBUG"
    assert _parse("server", ["--port", "0"]).port == 0


def _parse(role, argv):
    if role == "scheduler":
        return scheduler_parser().parse_args(argv)
    parse = server_parse if role == "server" else worker_parse
    return parse(["--scheduler", "tcp://127.0.0.1:1", *argv])


# rows whose default is prose rather than a value per flag
PROSE_DEFAULTS = {"--no-probe": "probe on", "--run-dir": "runs/YYYYmmdd-HHMMSS", "--resume": "",
                  "--token": "`$OMNIPS_TOKEN`, else none", "--transport": "`$OMNIPS_TRANSPORT`, else auto"}


def _documented(text: str):
    """A documented default of a flag whose value is no string: "0 (off)" is 0, "none" and "all"
    (workers) are None, "off" False."""
    text = re.sub(r"\s*\(.*\)$", "", text).strip("`")
    words = {"none": None, "all": None, "off": False, "{}": {}}
    if text in words:
        return words[text]
    try:
        return float(text)
    except ValueError:
        return text


def test_the_manual_gives_the_schedulers_defaults():
    actions = {a.option_strings[0]: a for a in scheduler_parser()._actions if a.option_strings}
    readme = (Path(__file__).resolve().parents[1] / "docs" / "operations.md").read_text()
    rows = [re.split(r"(?<!\\)\|", line.strip())[1:3] for line in readme.splitlines() if line.startswith("| `--")]
    checked = set()
    for flags_cell, default_cell in rows:
        flags = re.findall(r"`(--[a-z-]+)", flags_cell)
        if flags[0] not in actions:
            continue  # another table (the benchmarks')
        if flags[0] in PROSE_DEFAULTS:
            assert default_cell.strip() == PROSE_DEFAULTS[flags[0]]
            checked.add(flags[0])
            continue
        defaults = [d.strip() for d in default_cell.split(", ")]
        assert len(defaults) == len(flags), flags_cell
        for flag, text in zip(flags, defaults):
            default = actions[flag].default
            got = text.strip("`") if isinstance(default, str) else _documented(text)
            assert got == default, (flag, text, default)
            checked.add(flag)
    assert {"--staleness", "--adjust-every", "--deadband", "--heartbeat", "--dead-after", "--stall-timeout",
            "--lr", "--momentum", "--global-batch", "--epochs"} <= checked
