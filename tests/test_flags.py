"""Timeouts on every command line must be positive and finite: NaN or inf would disable them."""

import pytest

from scheduler.__main__ import parser as scheduler_parser
from server.__main__ import parse as server_parse
from worker.__main__ import parse as worker_parse


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
