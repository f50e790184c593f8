"""A path of the wrong kind, said in words: the one place that decides what is wrong with a path a
user gave (missing, a directory where a file is read, a file where a directory is made).

``fault(path, "file")`` checks a path before any work is done with it; ``describe(exc)`` words an
``OSError`` that the OS raised about one. Both give the path at fault (a parent, where that is
where the fault lies: ``corpus.txt/x`` fails because ``corpus.txt`` is a file) and a phrase that
follows it, ``"is a directory, not a file"``. The command line puts the flag that gave the path in
front (``elmo_jax.cli.commands``); a library error puts the path.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Literal

from elmo_jax._util.atomic import is_local

# The path's own faults: the user's to fix (the command line's input errors, exit 2).
# FileExistsError: a directory to make where a file is.
PATH_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)

IS_A_FILE = "is a file, not a directory"
IS_A_DIR = "is a directory, not a file"
MISSING = "does not exist"
NOT_OPEN = "is not open to this user (permission denied)"
NOT_WRITABLE = "is not writable by this user (permission denied)"
READ_ONLY = "is on a read-only file system"


def fault(path: str | os.PathLike, want: Literal["file", "dir", "output"]) -> tuple[str, str] | None:
    """None when ``path`` is a ``want`` (a file, a directory; for an output file, not a directory
    and in one that exists) or cannot be checked here (a URI); else the path at fault and what is
    wrong with it: ``(path, "is a directory, not a file")``, ``(path, "does not exist")``, or for
    ``a.txt/x``, ``("a.txt", "is a file, not a directory")``."""
    p = os.fspath(path)
    if not is_local(p):
        return None
    if want == "output":
        if os.path.isdir(p):
            return p, IS_A_DIR
        return fault(os.path.dirname(p) or ".", "dir")
    # One stat: asked twice (is it a directory? does it exist?), a directory another process makes
    # in between (each process of a run makes the run dir) was said to be a file.
    try:
        mode = os.stat(p).st_mode
    except OSError:  # missing, or out of this user's reach: as os.path.exists says
        return _missing(p)
    if stat.S_ISREG(mode) if want == "file" else stat.S_ISDIR(mode):
        return None
    if want == "file" and (kind := special_kind(p)) is not None:
        return p, not_a_file(kind)
    return p, IS_A_DIR if want == "file" else IS_A_FILE


def check_dir_to_make(path: str | os.PathLike) -> None:
    """The OS's ``NotADirectoryError`` for ``path``, or the file on the way to it, when a file is
    where a directory is to be made (before the work that writes there; ``mkdir`` would say
    "File exists" of it)."""
    if (bad := fault(path, "dir")) and bad[1] == IS_A_FILE:
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), bad[0])


def special_kind(p: str) -> str | None:
    """What ``p`` is when it is there but neither a regular file nor a directory ("a pipe", "a
    character device", ...), else None. A pipe (``<(cmd)``, ``/dev/stdin`` from a pipe) can be read
    once only, and every reader here reads its file more than once (counts its lines, then reads
    them; trains on it for epochs)."""
    try:
        mode = os.stat(p).st_mode
    except OSError:
        return None
    for test, kind in (
        (stat.S_ISFIFO, "a pipe"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return None


def not_a_file(kind: str) -> str:
    """The phrase for a path that is ``kind`` (``special_kind``) where a file is read."""
    if kind == "a pipe":
        return (
            "is a pipe, not a file: it can be read only once, and this reads it more than once; save it to a file first"
        )
    return f"is {kind}, not a file; give a file"


def _missing(p: str) -> tuple[str, str]:
    """What is at fault for the missing path ``p``: the highest missing directory above it, or a
    file that stands where a directory of its path should be."""
    at = p
    while True:
        up = os.path.dirname(at)
        if not up or up == at:
            return at, MISSING
        if os.path.exists(up):
            return (at, MISSING) if os.path.isdir(up) else (up, IS_A_FILE)
        at = up


def describe(exc: OSError) -> tuple[str, str]:
    """The path at fault and what is wrong with it, for one of ``PATH_ERRORS`` or a read-only file
    system's ``EROFS`` (any other ``OSError`` with a file name: its own words)."""
    p = os.fspath(exc.filename) if exc.filename is not None else ""
    if not is_local(p):  # its own file system's words; there is no parent to look at here
        return p, exc.strerror or str(exc)
    if isinstance(exc, IsADirectoryError):
        return p, IS_A_DIR
    if isinstance(exc, NotADirectoryError):
        return fault(p, "dir") or (p, IS_A_FILE)
    if isinstance(exc, FileExistsError):
        return p, IS_A_FILE if os.path.isfile(p) else "already exists"
    if isinstance(exc, FileNotFoundError):
        return _missing(p)
    if isinstance(exc, PermissionError) or exc.errno == errno.EROFS:
        # Refused a file that does not exist yet (a new file, a temporary one, a directory to
        # make): the fault is its directory's, and that is the path to name.
        at = p if os.path.lexists(p) else os.path.dirname(p) or "."
        if exc.errno == errno.EROFS:
            return at, READ_ONLY
        # Searchable but not writable: a file cannot be made there. (Not searchable: nothing in it
        # can be reached, to read or write; said of the path as the OS refused it.)
        if os.path.isdir(at) and os.access(at, os.X_OK) and not os.access(at, os.W_OK):
            return at, NOT_WRITABLE
        return p, NOT_OPEN
    return p, exc.strerror or str(exc)


def closed_above(path: str | os.PathLike) -> str | None:
    """The directory at or above ``path`` that exists but that this user may not list or enter,
    where a lookup or a glob of ``path`` finds nothing though its files may be there (None: no
    such directory, or a URI)."""
    p = os.fspath(path)
    if not is_local(p):
        return None
    p = os.path.abspath(p)
    while not os.path.isdir(p):
        up = os.path.dirname(p)
        if up == p:
            return None
        p = up
    return None if os.access(p, os.R_OK | os.X_OK) else p


def check_writable(*paths: str | os.PathLike) -> None:
    """Raises the OS's error for the first of ``paths`` that exists and this user cannot write
    (``PermissionError``, or ``EROFS`` on a file system mounted read-only), as a write there would,
    but before any work: a run resumed in another owner's run dir would otherwise train up to its
    first save. Missing paths and URIs pass."""
    for path in paths:
        p = os.fspath(path)
        if is_local(p) and os.path.lexists(p) and not os.access(p, os.W_OK):
            code = errno.EROFS if read_only(p) else errno.EACCES
            raise OSError(code, os.strerror(code), p)


def read_only(path: str | os.PathLike) -> bool:
    """Whether ``path`` lies on a file system mounted read-only."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):  # no statvfs (Windows)
        return False


def said(culprit: str, phrase: str, given: str | None = None) -> str:
    """``"given: phrase"`` when the fault is the given path itself, else ``"given: culprit phrase"``
    (``"runs/x/y: runs/x is a file, not a directory"``); without ``given``, ``"culprit: phrase"``."""
    if given is None or same_path(culprit, given):
        return f"{given or culprit}: {phrase}"
    return f"{given}: {culprit} {phrase}"


def same_path(a: str, b: str) -> bool:
    return os.path.normpath(os.path.abspath(a)) == os.path.normpath(os.path.abspath(b))


def replaced_input(output: str | os.PathLike, inputs) -> str | None:
    """The one of ``inputs`` that writing ``output`` would replace (the same file, by any path or
    link), or None: an output named like an input must not cost the input."""
    out = os.fspath(output)
    if not is_local(out) or not os.path.isfile(out):
        return None
    for given in map(os.fspath, inputs):
        if is_local(given) and os.path.isfile(given) and os.path.samefile(given, out):
            return given
    return None


def under(a: str, b: str) -> bool:
    """Whether the path ``a`` lies below the path ``b``."""
    a, b = (os.path.normpath(os.path.abspath(x)) for x in (a, b))
    return a.startswith(b.rstrip(os.sep) + os.sep)
