"""An exclusive lock on a file, for one process at a time: a model's download into the cache, a
training run's directory.

It is ``flock``, not the lock file's existence: the kernel drops the lock when its process ends,
however it ends (``kill -9``, the out-of-memory killer), so no lock outlives its holder and there
is never a stale one to remove by hand. The file stays; a holder may write a note in it (a
training run's: its process, host and start), which a process refused the lock is told. Where the
platform has no ``flock`` (Windows), or the file system refuses it (some network mounts:
``ENOLCK``), nothing is locked.
"""

from __future__ import annotations

import errno
import os
from typing import IO

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]  # the optional module's stand-in


class Held(RuntimeError):
    """The lock is another process's. ``note``: what its holder wrote in the file ("" if nothing)."""

    def __init__(self, path: str, note: str):
        super().__init__(f"{path}: locked by another process ({note or 'no note'})")
        self.path, self.note = path, note


class FileLock:
    """``acquire()`` (or ``with``) takes the lock on ``path``, made if missing; ``release()`` lets it
    go. ``wait=False``: raise ``Held`` at once when another process has it, instead of waiting.
    The lock lives as long as this object's open file: keep the object while it is needed (a
    ``FileLock(...).acquire()`` whose object nothing keeps is let go when it is collected)."""

    def __init__(self, path: str | os.PathLike, wait: bool = True):
        self.path, self.wait = os.fspath(path), wait
        self._file: IO[bytes] | None = None

    def acquire(self, note: str = "") -> None:
        """Takes the lock, then writes ``note`` in the file for the next process that asks for it."""
        # Made if missing, and held open for reading only: flock needs no write access, and a file
        # open for writing would keep its file system from being remounted read-only (EBUSY).
        f = os.fdopen(os.open(self.path, os.O_RDONLY | os.O_CREAT, 0o644), "rb")
        try:
            if fcntl is not None:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | (0 if self.wait else fcntl.LOCK_NB))
        except BlockingIOError:
            f.seek(0)
            held = f.read(500).decode("utf-8", "replace").strip()
            f.close()
            raise Held(self.path, held) from None
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                f.close()
                raise
        if note:
            try:
                with open(self.path, "wb") as w:
                    w.write(note.encode())
            except BaseException:  # a full or read-only disk: let the lock go now, not when f is collected
                f.close()
                raise
        self._file = f

    def release(self) -> None:
        """Lets the lock go (closing the file does); a lock not held is left alone."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> FileLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
