"""Orbax's noise kept off the terminal: ``orbax_log(path)`` sends it to a file for a block.

A failed save or a damaged checkpoint's restore ends in one exception that the run reports in
one line, but Orbax and tensorstore also print around it, hundreds of lines in all:
- Orbax's own log (absl) and asyncio's "exception was never retrieved", one traceback for each
  write or read that failed after the first one was reported;
- the traceback of each of Orbax's writer threads that a failed write ended ("Exception in thread
  array_type_handler"), the exception its save then raises to the run;
- "Event loop is closed", printed by tensorstore's threads (which Python did not start) as the
  reads and writes still in flight find Orbax's event loop gone;
- "Exception ignored in: <coroutine ...>", each with a tensorstore spec of ~60 lines, from
  Orbax's coroutines finalized after their loop closed (``sys.unraisablehook``), and
  "coroutine ... was never awaited" (a ``RuntimeWarning``) for those that never started: this
  package has no coroutines of its own, so every such warning is Orbax's.

Futures and coroutines say theirs when they are collected, so a block in which a read or write
failed ends by collecting until the Orbax coroutines it made are gone, while their lines still
come here. Python's own threads (the batch prefetcher's warnings) and everything else print as
before.
"""

from __future__ import annotations

import contextlib
import gc
import io
import logging
import os
import sys
import threading
import time
import traceback
import types
import warnings
import weakref
from collections.abc import Callable, Iterator

# Where a finalizer's traceback must run through for its "Exception ignored" to be Orbax's.
_ORBAX_FRAMES = (f"{os.sep}orbax{os.sep}", f"{os.sep}tensorstore{os.sep}", f"{os.sep}asyncio{os.sep}")


@contextlib.contextmanager
def orbax_log(path: str | None, failed: Callable[[], bool] | None = None) -> Iterator[None]:
    """Orbax's log, tensorstore's threads' prints, and Orbax's finalizers' tracebacks and
    unawaited-coroutine warnings go to the file ``path`` (created at the first line; None:
    dropped) during the block.

    ``failed``: asked as the block ends whether any of Orbax's reads or writes failed in it
    (``Checkpointer.orbax_failed``). Only a failed one leaves coroutines to collect, and looking
    for them scans every object of the process (in a test suite's or a notebook's, a third of a
    second a run), so a block that raised nothing and where nothing failed skips it. None: always
    look."""
    handler = _LogFile(path or os.devnull, delay=True)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    loggers = [logging.getLogger(name) for name in ("absl", "asyncio")]
    propagate, stderr, unraisable = [logger.propagate for logger in loggers], sys.stderr, sys.unraisablehook
    for logger in loggers:
        logger.addHandler(handler)
        logger.propagate = False
    showwarning, excepthook = warnings.showwarning, threading.excepthook
    sys.stderr = _ForeignThreadsTo(handler, stderr)
    sys.unraisablehook = _OrbaxFinalizersTo(handler, unraisable)
    warnings.showwarning = _UnawaitedTo(handler, showwarning)
    threading.excepthook = _OrbaxThreadsTo(handler, excepthook)
    raised = True
    try:
        yield
        raised = False
    finally:
        if raised or failed is None or failed():
            _settle()
        sys.stderr, sys.unraisablehook, warnings.showwarning = stderr, unraisable, showwarning
        threading.excepthook = excepthook
        for logger, p in zip(loggers, propagate):
            logger.removeHandler(handler)
            logger.propagate = p
        handler.close()


def _orbax_coroutines() -> list[types.CoroutineType]:
    return [
        o
        for o in gc.get_objects()
        if isinstance(o, types.CoroutineType) and f"{os.sep}orbax{os.sep}" in o.cr_code.co_filename
    ]


# Orbax's coroutines that a block waited for in vain (a write that never ends: a disk that stays
# full). They live as long as the process, whose later blocks must not wait for them again.
_STRANDED: weakref.WeakSet = weakref.WeakSet()


def _settle(timeout: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
    """Collects garbage until no coroutine of Orbax's is left but those of ``_STRANDED``, or for
    ``timeout`` seconds (of ``clock``).

    After a failed read or write, tensorstore still holds the coroutines of the reads and writes it
    had in flight (their callbacks), for as long as those take; they are finalized, and print,
    when it lets go. A write that never ends keeps its coroutine for the life of the process: the
    block that made it waits out the timeout once, and leaves it to ``_STRANDED``, so that later
    blocks (a notebook's next run) do not each wait the timeout again."""
    deadline = clock() + timeout
    while True:
        gc.collect()
        alive = [o for o in _orbax_coroutines() if o not in _STRANDED]
        if not alive:
            return
        if clock() > deadline:
            _STRANDED.update(alive)
            return
        del alive
        time.sleep(0.05)


class _LogFile(logging.FileHandler):
    """A log file that drops what it cannot write: a full disk may be what it is logging."""

    def handleError(self, record: logging.LogRecord) -> None:
        pass

    def emit(self, record: logging.LogRecord) -> None:
        # FileHandler opens its file (delay=True) outside the try that routes errors to
        # handleError: on a read-only file system the open's OSError would reach Orbax's logging
        # call, and print as "During handling of the above exception" under its own.
        try:
            super().emit(record)
        except OSError:
            pass

    def write(self, text: str) -> int:
        try:
            if self.stream is None:
                self.stream = self._open()
            return self.stream.write(text)
        except OSError:
            return len(text)

    def flush(self) -> None:
        try:
            super().flush()
        except OSError:
            pass

    def close(self) -> None:
        try:
            super().close()  # flushes: the disk may be full
        except OSError:
            pass


class _ForeignThreadsTo(io.TextIOBase):
    """``sys.stderr`` that sends what threads started outside Python write to a log file."""

    def __init__(self, log: _LogFile, stderr):
        self.log, self.stderr = log, stderr

    def write(self, text: str) -> int:
        if isinstance(threading.current_thread(), threading._DummyThread):
            return self.log.write(text)
        return self.stderr.write(text)

    def flush(self) -> None:
        self.stderr.flush()

    def fileno(self) -> int:
        return self.stderr.fileno()

    def isatty(self) -> bool:
        return self.stderr.isatty()


class _OrbaxFinalizersTo:
    """``sys.unraisablehook`` that sends the ones raised in Orbax's code to a log file."""

    def __init__(self, log: _LogFile, hook):
        self.log, self.hook = log, hook

    def __call__(self, unraisable) -> None:
        frames = traceback.extract_tb(unraisable.exc_traceback) if unraisable.exc_traceback else []
        if not any(part in frame.filename for frame in frames for part in _ORBAX_FRAMES):
            self.hook(unraisable)
            return
        head = f"{unraisable.err_msg or 'Exception ignored in'}: {unraisable.object!r}\n"
        self.log.write(head + "".join(traceback.format_exception(unraisable.exc_value)))


class _OrbaxThreadsTo:
    """``threading.excepthook`` that sends an exception that ended one of Orbax's own threads (its
    ``array_type_handler`` writers: each failed write of a save made on a read-only file system)
    to a log file. Orbax hands the exception on to the caller waiting for the save, which reports
    it; the thread's traceback would print it once more, at length."""

    def __init__(self, log: _LogFile, hook):
        self.log, self.hook = log, hook

    def __call__(self, args) -> None:
        # Orbax's own thread class (its futures' ``run``), not any thread whose stack passes
        # through Orbax's code: a thread of ours that calls Orbax keeps its traceback.
        run = getattr(type(args.thread), "run", None)
        if f"{os.sep}orbax{os.sep}" not in getattr(getattr(run, "__code__", None), "co_filename", ""):
            self.hook(args)
            return
        name = args.thread.name if args.thread is not None else "?"
        self.log.write(f"Exception in thread {name}:\n" + "".join(traceback.format_exception(args.exc_value)))


class _UnawaitedTo:
    """``warnings.showwarning`` that sends "coroutine ... was never awaited" to a log file; the
    others go to ``show`` (which, under ``warnings.catch_warnings(record=True)``, records them)."""

    def __init__(self, log: _LogFile, show):
        self.log, self.show = log, show

    def __call__(self, message, category, filename, lineno, file=None, line=None) -> None:
        if issubclass(category, RuntimeWarning) and "was never awaited" in str(message):
            self.log.write(f"{filename}:{lineno}: {category.__name__}: {message}\n")
            return
        self.show(message, category, filename, lineno, file, line)
