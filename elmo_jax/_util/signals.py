"""Signal handlers installed for a while: one rule for the training loop and the command line."""

from __future__ import annotations

import _thread
import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator

HANGUP = getattr(signal, "SIGHUP", None)  # none on Windows


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised in the main thread as an interrupt (``signum``: which)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def as_interrupt(signum: int) -> KeyboardInterrupt:
    """The exception that stops a command for ``signum``: Ctrl-C's own, else ``Terminated``."""
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)


@contextlib.contextmanager
def handling(handler: Callable, signals: Iterable[int | None]) -> Iterator[None]:
    """``handler`` for each of ``signals`` while the block runs (None entries are skipped: SIGHUP
    on Windows); the handlers before are restored after.

    SIGTERM or SIGHUP ignored when the block starts stays ignored: SIGHUP under ``nohup``, so that
    the process outlives its terminal, as asked. SIGINT is taken even so (a background job inherits
    it ignored, and Ctrl-C must still stop a run). Outside the main thread, where ``signal.signal``
    refuses, the caller's handling stays (a notebook's worker).

    A handler that raises (an interrupt) can run inside code whose exceptions Python swallows
    after printing them: a ``__del__``, a weak reference's callback, a ``gc`` callback (jax
    registers one). The signal was then lost, and ``elmo-jax train`` ran on to its end as if never
    stopped: 2 runs in 80 of ``python tests/probe_signals.py train 80 --from 0.5 --to 2.5 --seed 1``,
    each signal landing in jax's gc callback at start-up. While the block runs,
    ``sys.unraisablehook`` sends such a signal again instead, and its handler runs once that code
    has returned."""
    old = {}
    for sig in signals:
        if sig is None or (sig != signal.SIGINT and signal.getsignal(sig) == signal.SIG_IGN):
            continue
        try:
            old[sig] = signal.signal(sig, handler)
        except ValueError:
            pass
    hook = sys.unraisablehook

    def send_again(unraisable) -> None:
        e = unraisable.exc_value
        if isinstance(e, KeyboardInterrupt) and threading.current_thread() is threading.main_thread():
            # A moment later, from another thread: sent from here (signal.raise_signal, os.kill, or
            # even interrupt_main, which only marks it as arrived), the handler would run at once,
            # inside this hook, whose exceptions are dropped too.
            again = threading.Timer(0.05, _thread.interrupt_main, (getattr(e, "signum", signal.SIGINT),))
            again.daemon = True
            again.start()
        else:
            hook(unraisable)

    if old:
        sys.unraisablehook = send_again
    try:
        yield
    finally:
        if sys.unraisablehook is send_again:
            sys.unraisablehook = hook
        for sig, before in old.items():
            signal.signal(sig, before)
