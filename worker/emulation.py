"""Heterogeneity on purpose: make a worker's compute phase slower, deterministically.

`--slowdown F` (or a schedule `STEP:F,STEP:F`) stretches the real compute time F
times. `--emulate-ms-per-step A` and `--emulate-ms-per-sample C` pad the compute
phase to F * (A + C*b) ms, a virtual device whose speed does not depend on a noisy
host; a step never takes less than its real compute time.
"""

from dataclasses import dataclass

MAX_FACTOR = 1e4  # slower than that is no device to emulate (and 1e20 overflowed the padding's sleep)


def parse_schedule(text: str) -> list[tuple[int, float]]:
    """'3' -> [(0, 3.0)]; '0:1,200:4,400:2' -> factor by starting step, sorted."""
    text = text.strip()
    if not text:
        raise ValueError("empty slowdown")
    if ":" not in text:
        return [(0, _factor(text))]
    points = []
    for part in text.split(","):
        step, sep, factor = part.partition(":")
        if not sep:
            raise ValueError(f"slowdown schedule entry {part!r} is not STEP:FACTOR")
        try:
            s = int(step)
        except ValueError:
            raise ValueError(f"slowdown schedule step {step!r} is not an integer") from None
        if s < 0:
            raise ValueError(f"slowdown schedule step {s} is negative")
        points.append((s, _factor(factor)))
    points.sort()
    if points[0][0] != 0:
        points.insert(0, (0, 1.0))
    if len({s for s, _ in points}) != len(points):
        raise ValueError(f"slowdown schedule {text!r} names a step twice")
    return points


def _factor(text: str) -> float:
    try:
        f = float(text)
    except ValueError:
        raise ValueError(f"slowdown factor {text!r} is not a number") from None
    if not 0 < f <= MAX_FACTOR:
        raise ValueError(f"slowdown factor {f} must be a positive number up to {MAX_FACTOR:g}")
    return f


@dataclass(frozen=True)
class Emulation:
    schedule: tuple[tuple[int, float], ...] = ((0, 1.0),)
    ms_per_step: float = 0.0
    ms_per_sample: float = 0.0

    def __post_init__(self):
        if self.ms_per_step < 0 or self.ms_per_sample < 0:
            raise ValueError("emulated milliseconds must be >= 0")
        if not self.virtual and any(f < 1 for _, f in self.schedule):
            raise ValueError("a slowdown below 1 needs --emulate-ms-per-step/--emulate-ms-per-sample "
                             "(real compute cannot be made faster)")

    @property
    def active(self) -> bool:
        """Whether compute phases are stretched at all."""
        return self.virtual or any(f != 1 for _, f in self.schedule)

    @property
    def virtual(self) -> bool:
        return self.ms_per_step > 0 or self.ms_per_sample > 0

    def factor(self, step: int) -> float:
        current = self.schedule[0][1]
        for start, f in self.schedule:
            if step >= start:
                current = f
        return current

    def target_s(self, step: int, batch: int, real_s: float) -> float:
        """How long the compute phase of `step` should last, in seconds."""
        f = self.factor(step)
        if self.virtual:
            return max(real_s, f * (self.ms_per_step + self.ms_per_sample * batch) / 1000.0)
        return f * real_s
