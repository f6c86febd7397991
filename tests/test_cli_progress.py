"""The launcher's one-line progress view, read from a run's metrics.jsonl as it grows."""

import io
import json

from omnips.cli import Progress


def test_the_progress_line_follows_the_events_and_says_when_the_budget_is_not_known_yet(tmp_path):
    out = io.StringIO()
    view = Progress(tmp_path, out=out)

    def shown(*records, tail=""):
        with open(tmp_path / "metrics.jsonl", "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
            f.write(tail)
        view.update(final=True)  # not a terminal: one line each time
        return out.getvalue().splitlines()[-1]

    assert shown() == f"[{'':30}] epoch   0.00/?         0 samples/s  ETA      -  test acc -"  # before the start event
    assert shown({"event": "start", "t": 0.0, "budget_epochs": 4.5}).endswith(
        "epoch   0.00/4.5         0 samples/s  ETA      -  test acc -")
    # samples/s over the last 5 s of steps: the first step's batch only opens the window
    line = shown({"event": "step", "t": 1.0, "batch": 64, "epoch": 0.5},
                 {"event": "step", "t": 2.0, "batch": 64, "epoch": 1.5},
                 {"event": "eval", "t": 2.5, "test_accuracy": 0.8125})
    # the ETA: the epochs left at the rate of the last 30 s of steps (1 epoch/s)
    assert line == f"[{'#' * 10:<30}] epoch   1.50/4.5        64 samples/s  ETA     3s  test acc 0.812"
    assert shown(tail='{"event": "step", "t": 3.0, "ba') == line  # a line written half waits to be whole
    assert shown(tail='tch": 64, "epoch": 2.5}\n').startswith(f"[{'#' * 16:<30}] epoch   2.50/4.5        64 ")
    hint = "try --async-correction momentum (the default), or a lower --lr"
    assert shown({"event": "diverged", "t": 3.5, "reason": "stuck", "hint": hint}).endswith(
        f"test acc 0.812  DIVERGED: {hint}")


def test_the_launchers_timeout_stays_a_number_of_seconds_beside_the_etas_readable_durations():
    from omnips.cli import launch_parser
    assert launch_parser().parse_args(["--timeout", "90"]).timeout == 90.0


def test_the_progress_line_says_what_a_stalled_step_waits_for_until_it_goes_on(tmp_path):
    out = io.StringIO()
    view = Progress(tmp_path, out=out)

    def shown(*records):
        with open(tmp_path / "metrics.jsonl", "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        view.update(final=True)
        return out.getvalue().splitlines()[-1]

    wait = {"event": "wait", "t": 3.0, "change": "waits", "step": 812, "role": "worker", "rank": 2, "host": "h",
            "device": "cuda:0", "seconds": 4.14}
    assert shown({"event": "start", "t": 0.0, "budget_epochs": 4}, wait).endswith(
        "test acc -  step 812 waits for worker 2 (h, cuda:0) for 4.1 s")
    assert shown({**wait, "role": "server", "rank": 1, "device": "", "seconds": 9.0}).endswith(
        "step 812 waits for server 1 (h) for 9.0 s")
    assert shown({**wait, "change": "went on"}).endswith("test acc -")
