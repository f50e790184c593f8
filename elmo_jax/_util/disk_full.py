"""A write that fails for want of space: recognised in one place, reported in one line.

``is_out_of_space(exc)`` says whether an exception means the disk (or quota) is full or the file
system is read-only: ``ENOSPC``, ``EDQUOT`` or ``EROFS``, given as ``exc.errno`` or, as h5py
words its write failures, as ``errno = 28`` in the message. ``reported(path)`` turns such an
error inside its block into one ``OutOfSpaceError`` that names ``path``, the space left on its
file system and what to do; other errors pass unchanged. Pair it with ``atomic.atomic_path``
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
from typing import Iterator

OUT_OF_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})
_MESSAGE_ERRNO = re.compile(r"errno = (\d+)")  # h5py: "... file write failed: ..., errno = 28, ..."


class OutOfSpaceError(OSError):
    """A write stopped for want of space (or on a read-only file system); ``str()`` is the one line
    to show, ``errno`` the original's, ``path`` the file that was being written."""

    def __init__(self, message: str, path: str, code: int | None):
        super().__init__(message)
        self.path = path
        self.errno = code


def out_of_space_errno(exc: BaseException) -> int | None:
    """The ENOSPC/EDQUOT/EROFS code of ``exc`` (an ``OSError``), else None."""
    if not isinstance(exc, OSError):
        return None
    if exc.errno in OUT_OF_SPACE_ERRNOS:
        return exc.errno
    codes = (int(m) for m in _MESSAGE_ERRNO.findall(str(exc)))
    return next((c for c in codes if c in OUT_OF_SPACE_ERRNOS), None)


def is_out_of_space(exc: BaseException) -> bool:
    """Whether ``exc`` is an ``OSError`` for a full disk, a full quota or a read-only file system."""
    return out_of_space_errno(exc) is not None


def free_space(path: str | os.PathLike) -> int | None:
    """Bytes free to this user on the file system of ``path`` (or of its nearest existing parent)."""
    directory = os.path.dirname(os.path.abspath(path))
    while not os.path.isdir(directory) and os.path.dirname(directory) != directory:
        directory = os.path.dirname(directory)
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def out_of_space_message(path: str | os.PathLike, code: int | None = errno.ENOSPC) -> str:
    """``path: not written: <reason> (N bytes free in DIR); free space or choose another output path and rerun``."""
    path = os.fspath(path)
    reason = "the file system is read-only" if code == errno.EROFS else \
        "the disk quota is exceeded" if code == errno.EDQUOT else "the disk is full"
    free = free_space(path)
    left = f"{free:,} bytes free" if free is not None else "free space unknown"
    return (f"{path}: not written: {reason} ({left} in {os.path.dirname(os.path.abspath(path))}); "
            f"free space or choose another output path and rerun")


@contextlib.contextmanager
def reported(path: str | os.PathLike) -> Iterator[None]:
    """Re-raises an out-of-space ``OSError`` of the block as ``OutOfSpaceError`` naming ``path``."""
    try:
        yield
    except OutOfSpaceError:
        raise
    except OSError as e:
        code = out_of_space_errno(e)
        if code is None:
            raise
        raise OutOfSpaceError(out_of_space_message(path, code), os.fspath(path), code) from e
