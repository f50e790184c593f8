"""SIGTERM and SIGHUP for the command line: an interrupt, as Ctrl-C is.

By default either ends the process at once: ``elmo-jax embed`` then leaves its partial output
behind (a hidden temporary file next to ``--output``, as large as what it had written), and no
word of why it stopped. As an interrupt, the command cleans up as it does on Ctrl-C and says so.
Training's loop takes them over while it runs (``training.hooks.SignalStop``: save, then stop).
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised in the main thread (``signum``: which)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise(signum: int, frame) -> None:
    raise Terminated(signum)


@contextlib.contextmanager
def interrupting_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP raise ``Terminated`` while the command runs; the handlers before are
    restored after. A signal ignored when the command starts stays ignored (SIGHUP under
    ``nohup``: the command outlives its terminal, as asked)."""
    old = {}
    for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):  # no SIGHUP on Windows
        if sig is None or signal.getsignal(sig) == signal.SIG_IGN:
            continue
        try:
            old[sig] = signal.signal(sig, _raise)
        except ValueError:  # not the main thread: a caller's, which keeps its own handling
            pass
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
