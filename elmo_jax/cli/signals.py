"""SIGTERM and SIGHUP for the command line: an interrupt, as Ctrl-C is.

By default either ends the process at once: ``elmo-jax embed`` then leaves its partial output
behind (a hidden temporary file next to ``--output``, as large as what it had written), and no
word of why it stopped. As an interrupt, the command cleans up as it does on Ctrl-C and says so.
Training's loop takes them over while it runs (``training.hooks.SignalStop``: save, then stop).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator

from elmo_jax._util.signals import HANGUP, Terminated, as_interrupt, handling

__all__ = ["Terminated", "as_interrupt", "held_signals", "interrupting_signals", "say_interrupted"]


def _raise(signum: int, frame) -> None:
    raise as_interrupt(signum)


def interrupting_signals() -> contextlib.AbstractContextManager:
    """SIGTERM and SIGHUP raise ``Terminated`` while the command runs; the handlers before are
    restored after, and an ignored one stays ignored (SIGHUP under ``nohup``: the command outlives
    its terminal, as asked)."""
    return handling(_raise, (signal.SIGTERM, HANGUP))


def say_interrupted(command: str | None, exc: KeyboardInterrupt) -> int:
    """Says on stderr that ``command`` (None: not known yet) was interrupted, and by which signal
    for all but Ctrl-C; returns the shell's exit code for it, 128 + the signal's number (SIGINT 2,
    SIGHUP 1, SIGTERM 15)."""
    signum = exc.signum if isinstance(exc, Terminated) else signal.SIGINT
    by = "" if signum == signal.SIGINT else f" ({signal.Signals(signum).name})"
    print(f"elmo-jax{f' {command}' if command else ''}: interrupted{by}", file=sys.stderr)
    return 128 + signum


@contextlib.contextmanager
def held_signals(command: str | None) -> Iterator[list[int]]:
    """SIGINT, SIGTERM and SIGHUP are noted, not raised, while the block runs: the list it gives
    holds the signal that came. For the program's imports: an exception raised inside the import
    of a C extension (jaxlib's, while it makes its Python types) can abort the interpreter, exit
    -6 or -11, where the caller would have said one line (found by ``tests/probe_signals.py``).

    A second signal ends the process at once, saying so for ``command``: an import that hangs (a
    stalled network file system) still stops at the second Ctrl-C, and the imports have written
    nothing to lose. (Raised instead, it met the same crash: 1 run in 40 of ``probe_signals.py
    train 40 --from 0 --to 0.8 --twice 0.5 --seed 14`` ended -11.)"""
    came: list[int] = []

    def note(signum: int, frame) -> None:
        if came:
            code = say_interrupted(command, as_interrupt(signum))
            sys.stderr.flush()
            os._exit(code)
        came.append(signum)

    with handling(note, (signal.SIGINT, signal.SIGTERM, HANGUP)):
        yield came
