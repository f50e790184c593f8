"""Atomic file writes: write a temporary file in the same directory, then ``os.replace`` it.

A crash, a full disk or a Ctrl-C never leaves a half-written file under the final name: the
file there is either the old one (or none) or the complete new one, and the temporary file is
removed on failure.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Iterator


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """Yields a temporary path next to ``path``; on normal exit it replaces ``path``.

    The temporary name keeps ``path``'s extension (``.x.npz`` -> ``.x.npz.abc123.tmp.npz``)
    because some writers look at it: ``np.savez`` appends ``.npz`` when it is missing, and
    matplotlib picks the format from it. Same directory, so ``os.replace`` is a rename on one
    file system.
    """
    path = os.fspath(path)
    directory, name = os.path.split(path)
    fd, tmp = tempfile.mkstemp(dir=directory or ".", prefix=f".{name}.",
                               suffix=".tmp" + os.path.splitext(name)[1])
    os.close(fd)  # writers open the path themselves (h5py, np.save, savefig)
    try:
        yield tmp
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; the final file should read like any other
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())  # the data is on disk before the rename makes it visible


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """UTF-8 with ``\\n`` line ends on every platform."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
