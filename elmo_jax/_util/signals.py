"""Signal handlers installed for a while: one rule for the training loop and the command line."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterable, Iterator

HANGUP = getattr(signal, "SIGHUP", None)  # none on Windows


@contextlib.contextmanager
def handling(handler: Callable, signals: Iterable[int | None]) -> Iterator[None]:
    """``handler`` for each of ``signals`` while the block runs (None entries are skipped: SIGHUP
    on Windows); the handlers before are restored after.

    SIGTERM or SIGHUP ignored when the block starts stays ignored: SIGHUP under ``nohup``, so that
    the process outlives its terminal, as asked. SIGINT is taken even so (a background job inherits
    it ignored, and Ctrl-C must still stop a run). Outside the main thread, where ``signal.signal``
    refuses, the caller's handling stays (a notebook's worker)."""
    old = {}
    for sig in signals:
        if sig is None or (sig != signal.SIGINT and signal.getsignal(sig) == signal.SIG_IGN):
            continue
        try:
            old[sig] = signal.signal(sig, handler)
        except ValueError:
            pass
    try:
        yield
    finally:
        for sig, before in old.items():
            signal.signal(sig, before)
