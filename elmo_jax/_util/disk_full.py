"""A write that fails for want of space, or in the file system otherwise: recognised in one
place, reported in one line.

``is_out_of_space(exc)`` says whether an exception means the disk (or quota) is full or the file
system is read-only: ``ENOSPC``, ``EDQUOT`` or ``EROFS``, given as ``exc.errno``, or in the
message as h5py words its write failures (``errno = 28``) and as tensorstore words Orbax's
(``No space left on device [os_error_code='28']``, raised as a ``ValueError`` and often chained
under other exceptions, which are followed). ``reported(path)`` turns such an
error inside its block into one ``OutOfSpaceError`` that names ``path``, the space left on its
file system and what to do, and another failure of the file system (an I/O error) into a
``WriteFailed`` in its words; errors about the path itself (not found, not allowed, a directory)
pass unchanged, as do errors that are not the OS's. Pair it with ``atomic.atomic_path``
(outside it, so the partial file is gone before the free space is measured)::

    with reported(output), atomic_path(output) as tmp:
        write(tmp)
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from collections.abc import Iterator

from elmo_jax._util.paths import PATH_ERRORS, READ_ONLY

OUT_OF_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})
# h5py's OSError, or its RuntimeError from a flush or a close: "... file write failed: ..., errno = 28, ..."
_H5PY_ERRNO = re.compile(r"errno = (\d+)")
_TENSORSTORE_ERRNO = re.compile(r"os_error_code='(\d+)'")  # any type: "... [os_error_code='28']"


class WriteFailed(OSError):
    """A write failed in the file system; ``str()`` is the one line to show, ``errno`` the
    original's, ``path`` the file (or run dir) that was being written."""

    def __init__(self, message: str, path: str, code: int | None):
        super().__init__(message)
        self.path = path
        self.errno = code


class OutOfSpaceError(WriteFailed):
    """A write stopped for want of space (or on a read-only file system)."""


def innermost_message(e: BaseException) -> str:
    """The first line of the innermost exception ``e`` was raised from, with its type: for a
    damaged checkpoint, tensorstore's words (``OUT_OF_RANGE: Error reading "params.x/0" ...``), not
    Orbax's wrapper with its ~60-line spec."""
    # json's scanner raises StopIteration(index) inside, the context of every JSONDecodeError.
    last = next((x for x in reversed(list(exception_chain(e))) if str(x) and not isinstance(x, StopIteration)), e)
    return f"{type(last).__name__}: {str(last).splitlines()[0][:300]}" if str(last) else type(last).__name__


def exception_chain(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc``, then each exception it was raised from (``__cause__``, else ``__context__``),
    outermost first; a cycle is followed once."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _errnos(x: BaseException) -> Iterator[int]:
    """The OS error codes one exception carries: an ``OSError``'s own, then those tensorstore (any
    type) and h5py (an ``OSError``, or a ``RuntimeError`` of HDF5's cache flush) write in their messages."""
    if isinstance(x, OSError) and x.errno:
        yield x.errno
    yield from map(int, _TENSORSTORE_ERRNO.findall(str(x)))
    if isinstance(x, (OSError, RuntimeError)):
        yield from map(int, _H5PY_ERRNO.findall(str(x)))


def out_of_space_errno(exc: BaseException | None) -> int | None:
    """The ENOSPC/EDQUOT/EROFS code of ``exc`` or of an exception it was raised from, else None."""
    return next((c for x in exception_chain(exc) for c in _errnos(x) if c in OUT_OF_SPACE_ERRNOS), None)


def os_errno(exc: BaseException | None) -> int | None:
    """The first OS error code (any errno) of ``exc`` or of an exception it was raised from, else
    None: whether a failure came from the file system rather than from the program."""
    return next((c for x in exception_chain(exc) for c in _errnos(x)), None)


def reason(code: int | None) -> str:
    """What ``code`` means, in words for a message."""
    return (
        "the file system is read-only"
        if code == errno.EROFS
        else "the disk quota is exceeded"
        if code == errno.EDQUOT
        else "the disk is full"
    )


def remedy(code: int | None, free: str = "free space and") -> str:
    """What to do before the rerun, for a write refused with ``code`` (one of
    ``OUT_OF_SPACE_ERRNOS``): ``free`` for a full disk or quota. A file system remounted read-only
    under a run (as ext4 does after an I/O error) has room; it needs to be writable again."""
    return "once the file system is writable again," if code == errno.EROFS else free


def is_out_of_space(exc: BaseException) -> bool:
    """Whether ``exc`` means a full disk, a full quota or a read-only file system."""
    return out_of_space_errno(exc) is not None


def free_space(path: str | os.PathLike) -> int | None:
    """Bytes free to this user on the file system of ``path`` (or of its nearest existing parent);
    None where that cannot be known (an object store such as ``gs://``)."""
    if "://" in os.fspath(path):
        return None
    directory = os.path.dirname(os.path.abspath(path))
    while not os.path.isdir(directory) and os.path.dirname(directory) != directory:
        directory = os.path.dirname(directory)
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def out_of_space_message(path: str | os.PathLike, code: int | None = errno.ENOSPC) -> str:
    """``path: not written: <reason> (N bytes free in DIR); free space or choose another output path and rerun``
    (a read-only file system: ``path: not written: DIR is on a read-only file system; choose ...``)."""
    path = os.fspath(path)
    if code == errno.EROFS:  # free space is beside the point
        return f"{path}: not written: {os.path.dirname(os.path.abspath(path))} {READ_ONLY}; choose another output path and rerun"
    free = free_space(path)
    left = f"{size(free)} free" if free is not None else "free space unknown"
    return (
        f"{path}: not written: {reason(code)} ({left} in {os.path.dirname(os.path.abspath(path))}); "
        f"free space or choose another output path and rerun"
    )


@contextlib.contextmanager
def reported(path: str | os.PathLike, space_only: bool = False) -> Iterator[None]:
    """Re-raises an out-of-space ``OSError`` of the block as ``OutOfSpaceError`` naming ``path``,
    and another failure of the file system as ``WriteFailed`` (``space_only``: passes it unchanged,
    for a block whose other OSErrors are not the file system's, such as a download's)."""
    try:
        yield
    except WriteFailed:
        raise
    except OSError as e:
        code = out_of_space_errno(e)
        if code is not None:
            raise OutOfSpaceError(out_of_space_message(path, code), os.fspath(path), code) from e
        if space_only:
            raise
        code = os_errno(e)
        if code is None or isinstance(e, PATH_ERRORS):
            raise
        raise WriteFailed(
            f"{path}: not written: {innermost_message(e)}; once the cause is fixed, rerun", os.fspath(path), code
        ) from e


def size(n: int | None) -> str:
    """``n`` bytes for a message: ``12.3 MB``, ``1.4 GB``."""
    if n is None:
        return "unknown"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} bytes"
