"""SIGTERM to a server or a worker (a node drained, a pod deleted, a spot instance
reclaimed): a graceful leave, not a crash. The handler only records the signal; the
process's loop acts on it where that is safe (a worker between steps, a server between
messages). A second signal ends the process at once."""

import signal


class Leaving:
    def __init__(self):
        self.why: str | None = None  # the signal's name, once one came
        self._told = False

    def install(self, *signums: int) -> "Leaving":
        for signum in signums:
            signal.signal(signum, self._on_signal)
        return self

    def _on_signal(self, signum, frame) -> None:
        if self.why is not None:
            raise KeyboardInterrupt  # asked twice: do not wait for the graceful way
        self.why = signal.Signals(signum).name

    def due(self) -> bool:
        """True once, the first time it is asked after a signal: act on it now."""
        if self.why is None or self._told:
            return False
        self._told = True
        return True
