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
