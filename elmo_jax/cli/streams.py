"""The command line's standard output and error when their reader goes away: ``elmo-jax train |
head``, a ``tee`` that was killed, a terminal that was closed. The command goes on without them.

Python ignores SIGPIPE, so a write to a pipe whose reader has gone raises ``BrokenPipeError``
(EIO for a terminal that hung up) from whichever ``print`` comes next: a traceback out of the
training loop, and a run stopped for its log. What a run writes there is also in its files
(``metrics.jsonl``, the checkpoints), so losing the stream is not worth the run."""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import tempfile
from collections.abc import Iterator
from typing import Any, TextIO

_GONE = (errno.EPIPE, errno.EIO)


class _Outliving:
    """``stream`` (a file on a real file descriptor), whose writes and flushes, once its reader
    has gone, go to /dev/null instead of raising; ``said(name)`` is called once when it goes."""

    def __init__(self, stream: TextIO, name: str, said):
        self._stream, self._name, self._said, self.gone = stream, name, said, False

    def write(self, text: str) -> int:
        return self._outlive(self._stream.write, text) or len(text)

    def flush(self) -> None:
        self._outlive(self._stream.flush)

    def _outlive(self, call, *args: Any):
        try:
            return call(*args)
        except OSError as e:
            if e.errno not in _GONE:
                raise
        # The descriptor itself now points to /dev/null: the stream's buffered text, the flush at
        # exit and whatever C++ (XLA's logs) writes there all go nowhere, without an error.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self._stream.fileno())
        os.close(devnull)
        if not self.gone:
            self.gone = True
            self._said(self._name)
        return None

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _has_descriptor(stream: TextIO) -> bool:
    try:
        stream.fileno()
    except (AttributeError, OSError, ValueError):  # a caller's StringIO, pytest's capture
        return False
    return True


@contextlib.contextmanager
def outliving_reader(command: str) -> Iterator[None]:
    """``sys.stdout`` and ``sys.stderr`` that outlive their readers while the command runs; the
    first to go is said in one line on the other, if it is still there."""
    wrapped: dict[str, _Outliving] = {}

    def said(name: str) -> None:
        other = wrapped.get("stderr" if name == "stdout" else "stdout")
        if other is not None and not other.gone:
            what = {"stdout": "output", "stderr": "error"}[name]
            other.write(
                f"warning: elmo-jax {command}: its standard {what} is gone (its reader closed it); going on without it\n"
            )
            other.flush()

    original = {"stdout": sys.stdout, "stderr": sys.stderr}
    for name, stream in original.items():
        if _has_descriptor(stream):
            wrapped[name] = _Outliving(stream, name, said)
    sys.stdout = wrapped.get("stdout", sys.stdout)
    sys.stderr = wrapped.get("stderr", sys.stderr)
    try:
        yield
    finally:
        for stream in wrapped.values():
            stream.flush()  # what is still buffered meets a gone reader here, not at exit
        sys.stdout, sys.stderr = original["stdout"], original["stderr"]


STDIN = "standard input (--input -)"


@contextlib.contextmanager
def spooled_stdin(error: type[Exception]) -> Iterator[str]:
    """The path of a temporary file (in ``$TMPDIR``, removed after the block) holding standard
    input's lines, read to its end and checked as UTF-8 (``error`` names the line that is not).

    For ``embed --input -``, as AllenNLP's ``elmo`` command reads ``-``: ``embed`` reads its input
    twice (the lines are counted first, for the progress bar and the shards' manifests), which a
    pipe cannot give."""
    from elmo_jax._util import disk_full, utf8

    source = getattr(sys.stdin, "buffer", None)  # sys.stdin is None where it was closed (<&-)
    if source is None:
        raise error(f"{STDIN}: this process has none to read; give a file")
    if sys.stdin.isatty():
        print("reading sentences from the terminal, one a line; end with Ctrl-D", file=sys.stderr)
    fd, path = tempfile.mkstemp(prefix="elmo-jax-stdin-", suffix=".txt")
    try:
        with disk_full.reported(path), os.fdopen(fd, "wb") as f:
            for _, line in utf8.decoded(source, STDIN, error):
                f.write(line.encode("utf-8"))
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
