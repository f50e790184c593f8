"""SIGTERM and SIGHUP for the command line: an interrupt, as Ctrl-C is.

By default either ends the process at once: ``elmo-jax embed`` then leaves its partial output
behind (a hidden temporary file next to ``--output``, as large as what it had written), and no
word of why it stopped. As an interrupt, the command cleans up as it does on Ctrl-C and says so.
Training's loop takes them over while it runs (``training.hooks.SignalStop``: save, then stop).
"""

from __future__ import annotations

import contextlib
import signal

from elmo_jax._util.signals import HANGUP, handling


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised in the main thread (``signum``: which)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise(signum: int, frame) -> None:
    raise Terminated(signum)


def interrupting_signals() -> contextlib.AbstractContextManager:
    """SIGTERM and SIGHUP raise ``Terminated`` while the command runs; the handlers before are
    restored after, and an ignored one stays ignored (SIGHUP under ``nohup``: the command outlives
    its terminal, as asked)."""
    return handling(_raise, (signal.SIGTERM, HANGUP))
