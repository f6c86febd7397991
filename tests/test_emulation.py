"""Heterogeneity emulation: slowdown schedules and the virtual device's target times."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnips.worker.emulation import Emulation, parse_schedule

FAST = settings(max_examples=30, deadline=None)


@pytest.mark.parametrize("text, expected", [
    ("3", [(0, 3.0)]),
    (" 2.5 ", [(0, 2.5)]),
    ("1", [(0, 1.0)]),
    ("0.5", [(0, 0.5)]),
    ("0:1,200:4,400:2", [(0, 1.0), (200, 4.0), (400, 2.0)]),
    ("400:2,0:1,200:4", [(0, 1.0), (200, 4.0), (400, 2.0)]),  # sorted by step
    ("10:3", [(0, 1.0), (10, 3.0)]),  # full speed until the first named step
    ("5:2,1:4", [(0, 1.0), (1, 4.0), (5, 2.0)]),
    ("0:1e1", [(0, 10.0)]),
])
def test_parse_schedule_forms(text, expected):
    assert parse_schedule(text) == expected


@pytest.mark.parametrize("text, match", [
    ("", "empty"), ("   ", "empty"),
    ("abc", "not a number"), ("0", "positive"), ("-2", "positive"), ("nan", "positive"), ("inf", "positive"),
    ("0:1,x", "STEP:FACTOR"), ("0:1,", "STEP:FACTOR"),
    ("a:2", "not an integer"), ("1.5:2", "not an integer"), (":2", "not an integer"),
    ("-5:2", "negative"), ("0:1,3:0", "positive"), ("0:1,3:", "not a number"), ("3:-1", "positive"),
    ("0:1,0:2", "twice"), ("10:2,10:3", "twice"), ("1e20", "up to 10000"), ("0:1,5:10001", "up to 10000"),
])
def test_parse_schedule_errors(text, match):
    with pytest.raises(ValueError, match=match):
        parse_schedule(text)


@FAST
@given(points=st.dictionaries(st.integers(0, 10**6), st.floats(0.01, 100.0), min_size=1, max_size=6))
def test_parse_schedule_round_trip(points):
    text = ",".join(f"{s}:{f!r}" for s, f in points.items())
    got = parse_schedule(text)
    assert [s for s, _ in got] == sorted({0, *points})
    assert dict(got) == {0: 1.0, **points}  # step 0 runs at full speed unless named


@FAST
@given(factor=st.floats(1.0, 50.0), real=st.floats(0.0, 10.0), step=st.integers(0, 10**6), batch=st.integers(1, 4096))
def test_slowdown_alone_stretches_real_time(factor, real, step, batch):
    emu = Emulation(((0, factor),))
    assert not emu.virtual
    assert emu.target_s(step, batch, real) == pytest.approx(factor * real, rel=1e-12, abs=0)


@FAST
@given(factor=st.floats(0.05, 20.0), a=st.floats(0.0, 500.0), c=st.floats(0.0, 50.0),
       real=st.floats(0.0, 5.0), batch=st.integers(1, 4096))
def test_virtual_device_pads_to_f_times_a_plus_cb(factor, a, c, real, batch):
    if a == 0 and c == 0:
        c = 1.0
    emu = Emulation(((0, factor),), ms_per_step=a, ms_per_sample=c)
    assert emu.virtual
    target = emu.target_s(7, batch, real)
    virtual_s = factor * (a + c * batch) / 1000.0
    assert target == pytest.approx(max(real, virtual_s), rel=1e-12, abs=1e-15)
    assert target >= real  # never faster than the real compute


def test_virtual_device_examples():
    emu = Emulation(((0, 2.0),), ms_per_step=10.0, ms_per_sample=0.5)
    assert emu.target_s(0, 20, 0.001) == pytest.approx(2 * (10 + 0.5 * 20) / 1000)  # 40 ms
    assert emu.target_s(0, 20, 0.1) == pytest.approx(0.1)  # slower for real: the real time stands
    fast = Emulation(((0, 0.5),), ms_per_step=100.0)  # F < 1 is fine on a virtual device
    assert fast.target_s(0, 1, 0.01) == pytest.approx(0.05)
    per_sample = Emulation(ms_per_sample=2.0)
    assert per_sample.target_s(0, 8, 0.0) == pytest.approx(0.016)
    assert per_sample.target_s(0, 16, 0.0) == pytest.approx(0.032)


@pytest.mark.parametrize("schedule", [((0, 0.5),), ((0, 1.0), (10, 0.9))])
def test_speed_up_without_virtual_device_is_refused(schedule):
    with pytest.raises(ValueError, match="below 1"):
        Emulation(schedule)
    Emulation(schedule, ms_per_step=1.0)  # allowed with one


def test_negative_emulated_times_are_refused():
    with pytest.raises(ValueError):
        Emulation(ms_per_step=-1.0)
    with pytest.raises(ValueError):
        Emulation(ms_per_sample=-0.1)


def test_default_is_no_emulation():
    emu = Emulation()
    assert emu.target_s(123, 64, 0.25) == 0.25


def test_schedule_switches_by_step():
    emu = Emulation(tuple(parse_schedule("0:1,200:4,400:2")))
    real = 0.01
    for step, factor in [(0, 1), (199, 1), (200, 4), (399, 4), (400, 2), (10**9, 2)]:
        assert emu.factor(step) == factor
        assert emu.target_s(step, 32, real) == pytest.approx(factor * real)
    late = Emulation(tuple(parse_schedule("50:3")))
    assert [late.factor(s) for s in (0, 49, 50, 51)] == [1.0, 1.0, 3.0, 3.0]


def test_schedule_switches_by_step_on_a_virtual_device():
    emu = Emulation(tuple(parse_schedule("0:1,5:8,10:1")), ms_per_step=5.0)
    assert [round(emu.target_s(s, 16, 0.0) * 1000, 9) for s in (4, 5, 9, 10)] == [5.0, 40.0, 40.0, 5.0]


@FAST
@given(points=st.dictionaries(st.integers(0, 1000), st.floats(1.0, 10.0), min_size=1, max_size=5),
       step=st.integers(0, 2000))
def test_factor_is_that_of_the_latest_start_at_or_before_step(points, step):
    schedule = parse_schedule(",".join(f"{s}:{f!r}" for s, f in points.items()))
    emu = Emulation(tuple(schedule))
    starts = [s for s, _ in schedule if s <= step]
    assert emu.factor(step) == dict(schedule)[max(starts)]
    assert math.isclose(emu.target_s(step, 1, 0.5), 0.5 * dict(schedule)[max(starts)])
