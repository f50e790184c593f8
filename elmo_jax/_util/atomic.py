"""Atomic file writes: write a temporary file in the same directory, then ``os.replace`` it.

A crash, a full disk or a Ctrl-C never leaves a half-written file under the final name: the
file there is either the old one (or none) or the complete new one, and the temporary file is
removed on failure.

A path with a URI scheme (``gs://bucket/run``, ``s3://...``) goes through ``etils.epath``
instead: object stores have no rename (nor append), but a single object write is atomic (the
object appears only when the upload completes), so the bytes are written once, directly.
``is_local`` is the one place that decides; ``open_binary`` reads either kind.

A process killed outright while it writes (SIGKILL, the kernel's out-of-memory killer) cannot
remove its temporary file: the next write of the same path removes it instead. The temporary name
records the writer's host and process id for that, so that only a file whose writer is gone is
removed, never one that a live process (on this host or another sharing the file system) writes.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shutil
import socket
import tempfile
import warnings
from collections.abc import Iterator
from typing import IO

_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_local(path: str | os.PathLike) -> bool:
    """False for a URI (``gs://...``): a file ``etils.epath`` reaches through another file system.

    Decided from the name, not from epath's backend: under ``etils.epath.testing.mock_epath``
    every backend is a local one, yet a ``gs://`` path must still be written as for GCS.
    """
    return not _URI.match(os.fspath(path))


def open_binary(path: str | os.PathLike, mode: str = "rb") -> IO[bytes]:
    """``open(path, mode)`` for a local path, ``epath.Path(path).open(mode)`` for a URI."""
    if is_local(path):
        return open(path, mode)
    from etils import epath  # imported on demand: ~0.15 s, and the model core never needs it locally

    return epath.Path(path).open(mode)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """Yields a temporary path next to ``path``; on normal exit it replaces ``path``. (For a URI:
    a temporary local path, uploaded to ``path`` on normal exit.)

    The temporary name keeps ``path``'s extension (``x.npz`` -> ``.x.npz.HOST-PID.abc123.tmp.npz``)
    because some writers look at it: ``np.savez`` appends ``.npz`` when it is missing, and
    matplotlib picks the format from it. Same directory, so ``os.replace`` is a rename on one
    file system.
    """
    path = os.fspath(path)
    directory, name = os.path.split(path)
    local = is_local(path)
    if local:
        if os.path.isdir(path):  # said now, not by the rename after all the writing
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        remove_orphans(path)
    # For a URI the writers (h5py, np.savez) still need a local file: it goes in the temp dir and
    # is uploaded as one object write, which the store makes visible all at once (it has no rename).
    prefix, suffix = _temporary(name)
    try:
        fd, tmp = tempfile.mkstemp(
            dir=(directory or ".") if local else None, prefix=f"{prefix}{os.getpid()}.", suffix=suffix
        )
        refused = None
    except OSError as e:
        # The directory refused a new file (not this user's, read-only, missing): name it, not the
        # temporary name tried; a name too long is the name given. Raised outside the handler, so
        # that no chain leads back to the temporary name (disk_full.innermost_message follows it).
        # The path asked for is its second file name: the command line names the flag that gave
        # it (embed's --output RUN/x.hdf5), not another that names the directory (--run-dir RUN).
        at = path if e.errno == errno.ENAMETOOLONG else (directory or ".") if local else e.filename
        refused = OSError(e.errno, e.strerror, at, None, path) if at != path else OSError(e.errno, e.strerror, at)
    if refused is not None:
        raise refused
    os.close(fd)  # writers open the path themselves (h5py, np.save, savefig)
    try:
        yield tmp
        if not local:
            with open(tmp, "rb") as src, open_binary(path, "wb") as dst:
                shutil.copyfileobj(src, dst, 16 << 20)
            os.unlink(tmp)
        else:
            os.chmod(tmp, 0o644)  # mkstemp makes it 0600; the final file should read like any other
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


# A file name's most bytes on the common file systems (ext4, xfs, tmpfs; NAME_MAX), and the most
# the temporary name adds besides the host and the suffix: its dots, a process id of 7 digits and
# mkstemp's 8 letters.
_NAME_MAX = 255
_ADDED = len(".." + "-" + "1234567" + "." + "abcdefgh")


def _temporary(name: str) -> tuple[str, str]:
    """How the temporary files of ``name`` written on this host begin and end: ``.NAME.HOST-``,
    the writer's process id, a dot, ``mkstemp``'s letters, then ``.tmp`` and ``name``'s extension.

    A name near the file system's limit is cut in the temporary name, with a hash of the whole
    kept, so that every name that can be written can be written atomically (before, a name of
    about 220 bytes or more failed as "File name too long", of a name the user never gave)."""
    host = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:64]
    suffix = ".tmp" + os.path.splitext(name)[1]
    room = _NAME_MAX - _ADDED - len(host) - len(suffix)
    if len(name.encode()) > room:
        digest = hashlib.sha1(name.encode()).hexdigest()[:12]
        name = name.encode()[: max(room - len(digest) - 1, 0)].decode(errors="ignore") + "~" + digest
    return f".{name}.{host}-", suffix


def _gone(pid: int) -> bool:
    """Whether process ``pid`` of this host has ended (a reused id reads as alive: kept)."""
    if os.name == "nt":  # there os.kill ends the process rather than asking about it
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # PermissionError: alive, another user's
        return False
    return False


def remove_orphans(path: str | os.PathLike) -> list[str]:
    """Removes the temporary files of ``atomic_path(path)`` whose writer, a process of this host,
    is gone (killed outright mid-write), each with a warning that names it and its size; returns
    their paths. Files of live processes, and of other hosts, are left alone."""
    directory, name = os.path.split(os.fspath(path))
    prefix, suffix = _temporary(name)
    removed: list[str] = []
    try:
        entries = list(os.scandir(directory or "."))
    except OSError:  # the directory is missing or unreadable: the write itself will say so
        return removed
    for entry in entries:
        if not (entry.name.startswith(prefix) and entry.name.endswith(suffix)):
            continue
        pid = entry.name[len(prefix) : -len(suffix)].partition(".")[0]
        if not pid.isdigit() or not _gone(int(pid)):
            continue
        shown = os.path.join(directory, entry.name)  # as the caller named the directory
        try:
            size = entry.stat().st_size
            os.unlink(entry.path)
        except FileNotFoundError:  # another writer of the same path removed it first
            continue
        removed.append(shown)
        warnings.warn(
            f"{shown}: removed, {size / 2**20:.1f} MiB: the partial file of an earlier write of "
            f"{name} whose process ({pid}, on this host) was killed before it could finish",
            stacklevel=2,
        )
    return removed


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """``data`` as the file ``path``, all or nothing. A full disk, a quota or a read-only file
    system raises ``disk_full.OutOfSpaceError`` naming ``path`` (another failure of the file system,
    ``disk_full.WriteFailed``): a write's own OSError names no file."""
    # Imported here: disk_full's import of paths imports this module.
    from elmo_jax._util.disk_full import reported

    with reported(path):
        if not is_local(path):
            with open_binary(path, "wb") as f:  # one object write: atomic, no temp object, no rename
                f.write(data)
            return
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # the data is on disk before the rename makes it visible


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """``write_bytes_atomic`` of ``text`` in UTF-8, with ``\\n`` line ends on every platform."""
    write_bytes_atomic(path, text.encode("utf-8"))
