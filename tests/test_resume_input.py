"""Input a job cannot run on is refused in one clear line, before anything changes: job
values too large for the messages, the batch or the evaluation schedule, and a resumed
run's config.json, metrics.jsonl or checkpoint manifest that is damaged or edited."""

import json

import pytest

from omnips import checkpoint
from omnips.job import MAX_EPOCHS, JobSpec
from omnips.metrics import RunDir
from omnips.scheduler import __main__ as scheduler_main
from omnips.scheduler.checkpoints import resume_point
from omnips.scheduler.progress import Progress

from helpers import CHECKPOINT_JOB, make_checkpoint

INT64 = 2**63 - 1

# -- job values too large ---------------------------------------------------------------------

TOO_LARGE = [
    ({"global_batch": 10**14, "max_steps": 2}, "--global-batch must be at most 2147483648"),
    ({"global_batch": 5_000_000_000}, "--global-batch must be at most 2147483648"),
    ({"max_batch": 2**31 + 1}, "--max-batch 2147483649 must be from --min-batch to 2147483648"),
    ({"epochs": 1e300}, f"--epochs must be > 0 and at most {MAX_EPOCHS}"),
    ({"mode": "ssp", "staleness": 10**23}, f"--staleness must be at most {INT64}"),
    ({"seed": 10**23}, f"--seed must be at most {INT64}"),
    ({"max_steps": INT64 + 1}, f"--max-steps must be at most {INT64}"),
    ({"num_servers": 100_000_000}, "--num-servers must be from 1 to 4096"),
    ({"num_workers": 4097, "global_batch": 8192}, "--num-workers must be from 1 to 4096"),
]


@pytest.mark.parametrize("settings, text", TOO_LARGE)
def test_a_job_value_too_large_is_refused(settings, text):
    with pytest.raises(ValueError, match=text):
        JobSpec(**settings).check()


def test_the_largest_job_values_are_taken():
    JobSpec(num_servers=4096, num_workers=4096, global_batch=2**31, max_batch=2**31, seed=INT64,
            staleness=INT64, adjust_every=INT64, max_steps=INT64).check()
    JobSpec(epochs=MAX_EPOCHS).check()


def test_the_scheduler_refuses_a_job_value_too_large_as_a_flag_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(scheduler_main.logs, "setup", lambda *args: None)  # not this process's logging
    with pytest.raises(SystemExit) as exit_:
        scheduler_main.main(["--seed", str(10**23), "--run-dir", str(tmp_path / "run")])
    assert exit_.value.code == 2 and f"--seed must be at most {INT64}" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_steps_of_a_batch_that_make_too_many_epochs_are_refused_once_the_dataset_is_known():
    with pytest.raises(ValueError, match=f"1.49e\\+06 epochs of its 1438 training samples, more than {MAX_EPOCHS}"):
        Progress(JobSpec(global_batch=2**31, max_steps=1), 1438)
    assert len(Progress(JobSpec(epochs=MAX_EPOCHS), 1000).bsp_eval_points()) == MAX_EPOCHS
    # asp lists no evaluations ahead: a job kept running by a huge --max-steps (benchmarks do) is fine
    assert Progress(JobSpec(mode="asp", global_batch=1, max_steps=10**9), 410).budget == 10**9

# -- a damaged config.json --------------------------------------------------------------------


@pytest.mark.parametrize("config, text", [
    (None, "job settings must be a JSON object, not NoneType"), (42, "not int"), ("abc", "not str"),
    ({"num_workers": 2.0}, "job setting num_workers must be int, not float"),
    ({"num_workers": True}, "job setting num_workers must be int, not bool"),
    ({"model_args": []}, "job setting model_args must be dict, not list"),
    ({"max_steps": "5"}, "job setting max_steps must be int or null, not str"),
    ({"lr": 10**400}, "job setting lr is beyond a float's range"),
])
def test_job_settings_of_the_wrong_type_are_refused(config, text):
    with pytest.raises(ValueError, match=text):
        JobSpec.from_dict(config)


def test_an_int_stands_for_a_float_setting():
    spec = JobSpec.from_dict({"epochs": 3, "max_steps": None})
    assert spec == JobSpec(epochs=3.0) and type(spec.epochs) is float


@pytest.mark.parametrize("text", ["null", "42", '"abc"', '{"num_workers": 2.0}', '{"model_args": []}'])
def test_resume_refuses_a_damaged_config(tmp_path, text):  # (one reader: saved_job, the launcher's too)
    run_dir = resumable(tmp_path / "run")
    (run_dir / "config.json").write_text(text)
    with pytest.raises(ValueError, match="config.json: job setting"):
        resume_point(run_dir)


def test_resume_refuses_a_config_nested_deeper_than_the_parser_recurses(tmp_path):
    run_dir = resumable(tmp_path / "run")
    (run_dir / "config.json").write_text("[" * 100_000)
    with pytest.raises(ValueError, match="config.json: maximum recursion depth"):
        resume_point(run_dir)

# -- a damaged metrics.jsonl ------------------------------------------------------------------


@pytest.mark.parametrize("last, text", [
    ('{"event": "x"}', "not an event with a time"), ("[1]", "not an event with a time"),
    ('"t"', "not an event with a time"), ('{"t": NaN}', "not an event with a time"),
    ('{"t": -1}', "not an event with a time"), ('{"t": true}', "not an event with a time"),
    ("garbage", "not JSON"), pytest.param("[" * 100_000, "not JSON", id="nested-too-deep"),
])
def test_a_resumed_run_dir_refuses_a_last_event_it_did_not_write(tmp_path, last, text):
    events = tmp_path / "metrics.jsonl"
    before = '{"event": "start", "t": 0.5}\n' + last + '\n{"event": "st'  # the end torn by a crash
    events.write_text(before)
    with pytest.raises(ValueError, match=f"cannot continue {events}: its last line is {text}"):
        RunDir(tmp_path, resume=True)
    assert events.read_text() == before  # not even the torn line is cut


def test_a_resumed_run_dir_continues_after_an_event_with_an_integer_time(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"event": "start", "t": 2}\n')
    assert RunDir(tmp_path, clock=lambda: 10.0, resume=True).t0 == 8.0


def test_an_event_writes_nan_and_infinities_as_null(tmp_path):
    """JSON has no words for them: an event carrying one is still one valid line."""
    run = RunDir(tmp_path / "run", clock=lambda: 1.0)
    run.event("assign", predicted_step_s=float("nan"), times=(0.5, float("inf")), nested={"x": [float("-inf")]})
    run.event("step", loss=2.5)
    run.flush()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"event": "assign", "t": 0.0, "predicted_step_s": None, "times": [0.5, None], "nested": {"x": [None]}},
        {"event": "step", "t": 0.0, "loss": 2.5}]


# -- a checkpoint whose restart point does not fit its step -----------------------------------


def resumable(run_dir, job=CHECKPOINT_JOB, step=15):
    """A run directory with config.json for `job`, one event, and a checkpoint at `step` made for it."""
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps(job.to_dict()))
    (run_dir / "metrics.jsonl").write_text('{"event": "start", "t": 0.5}\n')
    edit_manifest(make_checkpoint(run_dir / "checkpoints", step), job=job.to_dict())
    return run_dir


def edit_manifest(directory, **values):
    path = directory / checkpoint.MANIFEST
    path.write_text(json.dumps({**json.loads(path.read_text()), **values}))


ASP_JOB = JobSpec(mode="asp", num_workers=2, num_servers=2)


@pytest.mark.parametrize("job, steps, positions", [
    (CHECKPOINT_JOB, [999, 999], [7992, 7992]), (CHECKPOINT_JOB, [15, 15], [960, 0]),
    (CHECKPOINT_JOB, [15, 14], [960, 960]), (ASP_JOB, [999, 999], [640, 320]), (ASP_JOB, [10, 5], [0, 2**63]),
])
def test_resume_refuses_a_checkpoint_whose_workers_do_not_fit_its_step(tmp_path, job, steps, positions):
    run_dir = resumable(tmp_path / "run", job)
    edit_manifest(checkpoint.step_dir(run_dir / "checkpoints", 15), worker_steps=steps, positions=positions)
    with pytest.raises(ValueError, match="lists worker steps and positions that do not fit its step 15"):
        resume_point(run_dir)


def test_resume_takes_a_checkpoint_whose_workers_fit_its_step(tmp_path):
    assert resume_point(resumable(tmp_path / "bsp"))[1].positions == [960, 960]
    run_dir = resumable(tmp_path / "asp", ASP_JOB)
    edit_manifest(checkpoint.step_dir(run_dir / "checkpoints", 15), worker_steps=[10, 5], positions=[640, 320])
    assert resume_point(run_dir)[1].worker_steps == [10, 5]


def test_a_bsp_checkpoint_at_or_past_the_jobs_last_step_is_refused():
    job = JobSpec(max_steps=15)
    with pytest.raises(ValueError, match="a checkpoint at step 15 is past the job's 15 steps"):
        Progress(job, 1000).resume([15, 15], [960, 960])
    Progress(job, 1000).resume([14, 14], [896, 896])
