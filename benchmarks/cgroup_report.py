"""The cgroup benchmark's table and verdicts (benchmarks/cgroup.py, whose docstring says what
each column and target means), from the runs it measured: three jobs a case and repeat, in
VARIANTS' order, the dynamic job's run alone (where it ran) inside the dynamic job's."""

from collections import defaultdict
from statistics import mean

from omnips.job import JobSpec
from worse_windows import longest_worse

VARIANTS = ("uniform", "affine", "static")
TARGET_RATIO = 1.02  # dynamic time over uniform time, at most
TARGET_WORSE_WINDOWS = 2  # windows running a plan slower than the uniform job's beside it, at most
TARGET_EFF = 0.90  # the controller's efficiency at HL2-HL8
TARGET_NEIGHBOUR_EFF = 0.85


def groups(results: list[dict]) -> list[dict]:
    """Each case's runs of one repeat, by variant."""
    k = len(VARIANTS)
    return [{r["variant"]: r for r in results[g:g + k]} for g in range(0, len(results), k)]


def table(results: list[dict], repeats: int) -> list[str]:
    lines = ["| case | repeat | uniform s | dynamic s | static s | dynamic / uniform | efficiency uniform "
             "| efficiency dynamic | efficiency static | dynamic / static efficiency | efficiency dynamic alone "
             "| from step 1: dynamic, static, dynamic alone "
             "| balance dynamic | final plan | adjustments | slowest throttled (periods) "
             "| overhead ms, slowest / fastest |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for g, runs in enumerate(groups(results)):
        u, d, st = runs["uniform"], runs["affine"], runs["static"]
        alone = f"{d['alone']['efficiency']:.3f}" if "alone" in d else "-"
        later = ", ".join(f"{r['steps_efficiency']:.3f}" for r in (d, st, d.get("alone")) if r is not None)
        lines.append(f"| {u['case']} | {g % repeats + 1} | {u['wall_s']:.2f} | {d['wall_s']:.2f} | {st['wall_s']:.2f} "
                     f"| {d['wall_s'] / u['wall_s']:.3f} | {u['efficiency']:.3f} | {d['efficiency']:.3f} "
                     f"| {st['efficiency']:.3f} | {d['efficiency'] / st['efficiency']:.3f} | {alone} | {later} "
                     f"| {d['balance']:.3f} "
                     f"| {d['final']} | {d['adjustments']} | {d['throttled']} "
                     f"| {d['overhead_ms'][0]:.0f} / {d['overhead_ms'][1]:.0f} |")
    return lines


def by_case(chosen: list[dict]) -> dict[str, list[dict]]:
    cases = defaultdict(list)
    for g in chosen:
        cases[g["affine"]["case"]].append(g)
    return cases


def judged(chosen: list[dict], run_of, target: float) -> str:
    """The efficiency of `run_of` each repeat against `target`: each case's mean over its repeats
    (see the docstring), the lowest case's, and the lowest single run beside it."""
    means = {c: mean(run_of(g)["efficiency"] for g in gs) for c, gs in by_case(chosen).items()}
    worst = min(means, key=means.get)
    single = min(run_of(g)["efficiency"] for g in chosen)
    return (f"mean over repeats, lowest case {worst} {means[worst]:.3f} (target >= {target}): "
            f"{'met' if means[worst] >= target else 'missed'} (lowest single run {single:.3f})")


def verdicts(results: list[dict]) -> list[str]:
    runs = groups(results)
    worst = max(g["affine"]["wall_s"] / g["uniform"]["wall_s"] for g in runs)
    levels = [g for g in runs if g["affine"]["case"] in ("HL2", "HL4", "HL8")]
    neighbour = [g for g in runs if g["affine"]["case"] == "neighbour"]
    out = [f"- dynamic / uniform, worst run: {worst:.3f} (target <= {TARGET_RATIO}): "
           f"{'met' if worst <= TARGET_RATIO else 'missed'}"]
    # (the jobs' windows: the default --adjust-every, which the benchmark leaves as it is)
    windows = [longest_worse(g["affine"]["timeline"], g["uniform"]["timeline"], JobSpec.adjust_every,
                             TARGET_RATIO - 1) for g in runs if "timeline" in g["affine"]]
    if windows:
        longest = max(w[0] for w in windows)
        out.append(f"- windows of {JobSpec.adjust_every} steps in which the dynamic job ran a plan other than the "
                   f"uniform split more than {TARGET_RATIO - 1:.0%} slower than the uniform job at the same moment, "
                   f"longest run in any job: {longest} (target <= {TARGET_WORSE_WINDOWS}; "
                   f"{sum(w[1] for w in windows)} windows compared): "
                   f"{'met' if longest <= TARGET_WORSE_WINDOWS else 'missed'}")
    for name, chosen, target in (("the controller's efficiency at HL2-HL8", levels, TARGET_EFF),
                                 ("with a noisy neighbour", neighbour, TARGET_NEIGHBOUR_EFF)):
        if chosen:
            share = min(mean(g["affine"]["efficiency"] / g["static"]["efficiency"] for g in gs)
                        for gs in by_case(chosen).values())
            out.append(f"- {name}: {judged(chosen, lambda g: g['affine'], target)}; of the static plan's on the "
                       f"same host, min {share:.3f}")
            if all("alone" in g["affine"] for g in chosen):
                out.append(f"- {name}, its job alone on the host: "
                           f"{judged(chosen, lambda g: g['affine']['alone'], target)}")
    # at HL1 the uniform and the static run have one plan, the ideal one: how far two runs of
    # the same plan differ here, and what efficiency this host allows any plan
    same = [g for g in runs if g["affine"]["case"] == "HL1"]
    if same:
        walls = [(g["static"]["wall_s"], g["uniform"]["wall_s"]) for g in same]
        noise = max(max(w) / min(w) for w in walls)
        ceiling = max(max(g["static"]["efficiency"], g["uniform"]["efficiency"]) for g in same)
        out.append(f"- at HL1 the uniform and the static runs have the same plan, the ideal one: their times differ "
                   f"by up to {noise:.3f}x (run-to-run noise), and their efficiency, what this host allows any "
                   f"plan, is at most {ceiling:.3f}")
    return out
