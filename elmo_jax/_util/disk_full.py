"""Telling a full disk (or a quota, or a read-only file system) from other write failures.

Orbax writes through tensorstore, which reports a full disk as a ``ValueError`` whose text carries
the OS error (``... No space left on device [os_error_code='28']``), often chained under other
exceptions; Python's own writes raise ``OSError`` with an errno. Both are recognised here, so
that every writer of the project can stop with one line that says what to do.
"""

from __future__ import annotations

import errno
import os
import shutil

# errno -> the words the OS uses, which is also what tensorstore's messages carry.
REASONS = {
    errno.ENOSPC: "No space left on device",
    errno.EDQUOT: "Disk quota exceeded",
    errno.EROFS: "Read-only file system",
}


def out_of_space(exc: BaseException | None) -> str | None:
    """The OS's words for a full disk, a quota or a read-only file system if ``exc`` or anything
    it was raised from is one, else None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in REASONS:
            return REASONS[exc.errno]
        text = str(exc)
        for code, words in REASONS.items():
            if words in text or f"os_error_code='{code}'" in text:
                return words
        for inner in getattr(exc, "exceptions", ()):  # an ExceptionGroup
            found = out_of_space(inner)
            if found is not None:
                return found
        exc = exc.__cause__ or exc.__context__
    return None


def free_bytes(path: str | os.PathLike) -> int | None:
    """Free bytes on the file system of ``path`` (or of its nearest existing parent); None where
    that cannot be known (an object store such as ``gs://``)."""
    path = os.fspath(path)
    if "://" in path:
        return None
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent
    return shutil.disk_usage(path).free


def size(n: int | None) -> str:
    """``n`` bytes for a message: ``12 MB``, ``1.4 GB``."""
    if n is None:
        return "unknown"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} bytes"
