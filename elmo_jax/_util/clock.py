"""The clock of ``elmo-jax train``'s watches: monotonic time less what the watch could not see pass."""

from __future__ import annotations

import threading
import time


class WatchClock:
    """``time.monotonic()`` less the time in which a watch's thread could not run: the process
    stopped (Ctrl-Z, SIGSTOP, a scheduler's suspend such as SLURM's) or the thread kept waiting for
    the GIL. The monotonic clock runs on through a stopped process, so a watch that measured
    silence on it would wake after a long suspend and take its own process (or a peer, which was
    stopped with it) for hung before anything had had a chance to run again.

    The watch's thread waits with ``wait``, once a period; ``now`` may be read from any thread
    (a stamp taken after a pause but before the watch has seen it is too late, never too early,
    so the pause can delay a verdict but not cause one)."""

    def __init__(self, period: float):
        self.period = period
        self.unseen = 0.0
        # Later than this past its period, a wait was not the scheduler's jitter but a pause.
        self.slack = max(1.0, period)

    def now(self) -> float:
        return time.monotonic() - self.unseen

    def wait(self, quit: threading.Event) -> bool:
        """``quit.wait(period)``: whether ``quit`` is set. Time past the period that the wait took
        (it returns only once the thread runs again) is left out of ``now`` from then on."""
        start = time.monotonic()
        if quit.wait(self.period):
            return True
        late = time.monotonic() - start - self.period
        if late > self.slack:
            self.unseen += late
        return False
