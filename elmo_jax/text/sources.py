"""Where training and evaluation sentences come from: text files, lines in memory, or a tfds dataset.

A ``Source`` is a sequence of shards (files, or ranges of a tfds data source); each shard reads as a
list of sentences, one whitespace-tokenized sentence per string. ``shard_for_process`` gives each
process of a multi-process run its own shards.
"""

from __future__ import annotations

import codecs
import glob as globlib
import hashlib
import os
import re
import warnings
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from elmo_jax._util.paths import NOT_OPEN, closed_above, not_a_file, special_kind
from elmo_jax._util.runtime import absl_errors_only


class DataError(ValueError):
    """Training or evaluation data is missing or unusable."""


class Source(Protocol):
    """Sentences in shards: text files, or ranges of a tfds data source."""

    def __len__(self) -> int: ...
    def name(self, shard: int) -> str: ...
    def read(self, shard: int) -> list[str]: ...


class TextFiles:
    """Text shards, one whitespace-tokenized sentence per line (lm1b's layout).

    Lines that are not UTF-8 are skipped with a warning naming the file, how many and the first;
    blank lines are skipped silently. A file that is not text at all (a NUL byte in its first
    64 KiB: compressed, binary, UTF-16) is a ``DataError``, at the start of a run where
    ``fingerprint`` reads it: skipping its every line would bury the cause in warnings.
    """

    def __init__(self, pattern: str | os.PathLike | Sequence[str | os.PathLike]):
        # A pathlib.Path is a pattern as its str is (glob.glob alone: "'PosixPath' object is not iterable").
        patterns = [os.fspath(p) for p in ([pattern] if isinstance(pattern, (str, os.PathLike)) else pattern)]
        found = {f for p in patterns for f in globlib.glob(os.path.expanduser(p), recursive=True)}
        files = sorted(f for f in found if os.path.isfile(f))
        special = next(((f, kind) for f in sorted(found) if (kind := special_kind(f)) is not None), None)
        if special is not None:  # (unchecked: "no files match /dev/fd/63", a path that is there)
            raise DataError(f"{special[0]}: {not_a_file(special[1])}")
        if not files:
            folder = next((p for p in patterns if os.path.isdir(os.path.expanduser(p))), None)
            # A directory this user may not enter globs to nothing, silently: said, with where.
            closed = next(filter(None, (closed_above(_literal_dir(os.path.expanduser(p))) for p in patterns)), None)
            hint = (
                f" ({folder} is a directory: give a pattern of its files, '{os.path.join(folder, '*.txt')}')"
                if folder is not None
                else f" ({closed} {NOT_OPEN})"
                if closed is not None
                else ""
            )
            raise DataError(f"no files match {' '.join(patterns)!s}{hint}")
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def name(self, shard: int) -> str:
        return self.files[shard]

    def fingerprint(self) -> list[dict]:
        """Per file: its name, size and a hash of its first and last 64 KiB (cheap for GBs of text;
        a regenerated file almost always changes its size or its ends)."""
        out, blank = [], 0
        for path in self.files:
            try:
                size = os.path.getsize(path)
                h = hashlib.sha256()
                with open(path, "rb") as f:
                    head = f.read(_ENDS)
                    h.update(head)
                    if size > _ENDS:
                        f.seek(max(_ENDS, size - _ENDS))
                        h.update(f.read(_ENDS))
            except OSError as e:
                raise _unreadable(path, e) from None
            _check_text(path, head)
            blank += size <= _ENDS and not head.strip()  # read whole: empty, or blank lines only
            out.append({"name": os.path.basename(path), "size": size, "sha256_ends": h.hexdigest()[:16]})
        if blank == len(out):  # said before a run dir is made for it
            raise no_sentences(self.files)
        return out

    def read(self, shard: int) -> list[str]:
        path = self.files[shard]
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:  # gone since the glob, a failing disk or mount, no longer readable
            raise _unreadable(path, e) from None
        _check_text(path, data[:_ENDS])
        data = data.removeprefix(codecs.BOM_UTF8)  # no part of the first word (_util.utf8)
        # Lines are str.splitlines()'s, as tokenize.split_sentences splits. A file with a line that
        # is not UTF-8 is split alike (at \n, numbered as `sed -n` numbers them, then at each
        # line's other breaks: \r, U+2028, \x0c, ...), so that one bad byte changes no other sentence.
        try:
            lines = data.decode("utf-8").splitlines()
        except UnicodeDecodeError:
            lines, skipped = [], []
            for lineno, raw in enumerate(data.split(b"\n"), 1):
                try:
                    lines.extend(raw.decode("utf-8").splitlines())
                except UnicodeDecodeError as e:
                    skipped.append(f"line {lineno}: skipped, not UTF-8 ({e.reason} at byte {e.start})")
            more = f"; and {len(skipped) - 1} more line(s) so" if len(skipped) > 1 else ""
            warnings.warn(f"{path}: {skipped[0]}{more}", stacklevel=2)
        return [line for line in lines if line.strip()]


def _literal_dir(pattern: str) -> str:
    """The directory of ``pattern`` above its first wildcard: what must be entered to glob it."""
    head = re.split(r"[*?[]", pattern, maxsplit=1)[0]
    return head if head.endswith(os.sep) or head == pattern else os.path.dirname(head) or "."


class NoSentences(DataError):
    """Text files that hold no sentence, said by a reader that does not know what the text is for:
    a caller that does (training, held-out) says it in its own words."""


def no_sentences(names: Sequence[str]) -> DataError:
    """The error for text files that hold no sentence (names: the first five are said)."""
    return NoSentences(f"no sentences in {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}")


def _check_text(path: str, head: bytes) -> None:
    """A ``DataError`` if ``head``, the start of the file ``path``, holds a NUL byte: no UTF-8
    text does, and most compressed and binary files (and UTF-16 text) do at once."""
    at = head.find(b"\0")
    if at >= 0:
        raise DataError(
            f"{path}: not UTF-8 text (a NUL byte at byte {at}: a compressed, binary or UTF-16 file?); text "
            "files are UTF-8, one sentence per line: decompress or convert it, or leave it out of the file pattern"
        )


def _unreadable(path: str, e: OSError) -> DataError:
    return DataError(
        f"{path}: cannot be read ({type(e).__name__}: {e.strerror or e}); once it can, rerun the same command "
        "(a training run resumes from its newest checkpoint)"
    )


class Lines:
    """Sentences already in memory as one shard (e.g. a notebook's held-out slice)."""

    def __init__(self, lines: Sequence[str], name: str = "<lines>"):
        # A str is a sequence too: its letters would be the sentences, one character each.
        if isinstance(lines, (str, bytes)):
            raise TypeError(
                f"lines is a {type(lines).__name__}; expected a list of str, one sentence each (Lines([text]) "
                "for one sentence, Lines(text.splitlines()) for one sentence a line)"
            )
        lines = list(lines)
        bad = [line for line in lines if not isinstance(line, str)]
        if bad:
            raise TypeError(f"lines holds a {type(bad[0]).__name__} ({bad[0]!r:.40}); expected str sentences")
        self.lines, self.label = [l for l in lines if l.strip()], name

    def __len__(self) -> int:
        return 1

    def name(self, shard: int) -> str:
        return self.label

    def fingerprint(self) -> list[dict]:
        if not self.lines:  # said before a run dir is made for it, as TextFiles says it
            raise no_sentences([self.label])
        text = "\n".join(self.lines).encode("utf-8")
        return [{"name": self.label, "size": len(text), "sha256_ends": hashlib.sha256(text).hexdigest()[:16]}]

    def read(self, shard: int) -> list[str]:
        return list(self.lines)


class TfdsSource:
    """A tfds dataset read through ``tfds.data_source`` (ArrayRecord, no TensorFlow needed).

    The records are split into ``n_shards`` contiguous ranges that play the role of files. The
    dataset must already be prepared in ArrayRecord format; see docs/pretraining.md ("lm1b with tfds").
    """

    def __init__(
        self, name: str, split: str = "train", data_dir: str | None = None, n_shards: int = 100, feature: str = "text"
    ):
        import tensorflow_datasets as tfds

        try:
            # Never a download: one run's first call would otherwise fetch and prepare the whole
            # dataset (tfds's default), and absl's warnings about the missing files are said below.
            with absl_errors_only():
                self.source = tfds.data_source(name, split=split, data_dir=data_dir, download=False)
        except Exception as e:  # noqa: BLE001 - tfds raises many types for "not prepared"; name the fix.
            raise _not_available(name, split, data_dir, e) from None
        n = len(self.source)
        if n == 0:
            raise DataError(f"tfds dataset {name!r} split {split!r} is empty")
        self.bounds = np.linspace(0, n, min(n_shards, n) + 1).astype(np.int64)
        self.label, self.feature = f"tfds:{name}/{split}", feature

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def name(self, shard: int) -> str:
        return f"{self.label}[{self.bounds[shard]}:{self.bounds[shard + 1]}]"

    def fingerprint(self) -> list[dict]:
        """The dataset and its record count (tfds's prepared files are versioned by tfds itself)."""
        return [{"name": self.label, "size": int(self.bounds[-1]), "sha256_ends": ""}]

    def read(self, shard: int) -> list[str]:
        lo, hi = int(self.bounds[shard]), int(self.bounds[shard + 1])
        try:
            try:  # one batched read of the shard's records
                records = self.source.__getitems__(list(range(lo, hi)))
            except (AttributeError, TypeError):  # sources without batched reads (tfds's mock data)
                records = [self.source[i] for i in range(lo, hi)]
        except OSError as e:  # its ArrayRecord files gone or failing since the run started
            raise _unreadable(self.name(shard), e) from None
        out = []
        for r in records:
            text = r[self.feature]
            if isinstance(text, bytes):
                text = text.decode("utf-8", "replace")
            if text.strip():
                out.append(text)
        return out


def _not_available(name: str, split: str, data_dir: str | None, e: Exception) -> DataError:
    """Why tfds gave no data source: no such dataset, none prepared, or not as ArrayRecord."""
    import tensorflow_datasets as tfds

    prepare = "prepare it once with file_format='array_record' (see docs/pretraining.md, \"lm1b with tfds\")"
    if isinstance(e, tfds.core.registered.DatasetNotFoundError):
        return DataError(f"tfds has no dataset named {name!r} (tfds:NAME/SPLIT, as in tfds:lm1b/train)")
    try:
        with absl_errors_only():
            builder = tfds.builder(name, data_dir=data_dir)
            prepared = builder.is_prepared()
    except Exception:  # noqa: BLE001 - the first error is the one to say
        prepared = True
    if not prepared:
        return DataError(f"tfds dataset {name!r} is not prepared in {builder.data_dir}; {prepare}")
    why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return DataError(f"tfds dataset {name!r} split {split!r} is not available as ArrayRecord ({why}); {prepare}")


_ENDS = 1 << 16


def as_source(source: Any, name: str = "source") -> Source:
    """``source`` as sentences: a ``Source`` as it is, a list (or tuple) of str as ``Lines``; a
    path given as a str, or anything else, is a one-line ``TypeError`` naming argument ``name``
    (a str would be read as its letters, each a sentence)."""
    if isinstance(source, (list, tuple)) and all(isinstance(s, str) for s in source):
        return Lines(list(source))
    if isinstance(source, (str, bytes, os.PathLike)) or not all(hasattr(source, a) for a in ("read", "name")):
        raise TypeError(
            f"{name} is a {type(source).__name__}; expected sentences: TextFiles(glob) for files, "
            "Lines([...]) or a list of str for text in memory"
        )
    return source


def fingerprint(source: Source) -> list[dict] | None:
    """What a run records of its training data, to know it again on resume (None: a source type
    that cannot say)."""
    fp = getattr(source, "fingerprint", None)
    return fp() if fp is not None else None


def data_changes(saved: list[dict], now: list[dict]) -> list[str]:
    """How ``now`` differs from ``saved`` (both from ``fingerprint``), by file name: a file moved
    to another directory is the same file, a regenerated one is not."""
    before, after = {f["name"]: f for f in saved}, {f["name"]: f for f in now}
    # One entry for all the files gone and one for all the new ones, the gone first: a caller that
    # shows the first few must not hide a file gone behind a glob's many new ones.
    changes = [
        _listed(names, what)
        for names, what in (
            ([n for n in before if n not in after], "gone"),
            ([n for n in after if n not in before], "new"),
        )
        if names
    ]
    for name in sorted(before.keys() & after.keys()):
        b, a = before[name], after[name]
        if b["size"] != a["size"]:
            changes.append(f"{name} changed size ({b['size']:,} -> {a['size']:,} bytes)")
        elif b["sha256_ends"] != a["sha256_ends"]:
            changes.append(f"{name} changed content")
    return changes


def _listed(names: list[str], what: str) -> str:
    """``a.txt is new``, or ``a.txt, b.txt, c.txt and 2 more are new``."""
    if len(names) == 1:
        return f"{names[0]} is {what}"
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return f"{', '.join(names[:3])}{more} are {what}"


def open_source(spec: str, data_dir: str | None = None) -> Source:
    """``tfds:NAME[/SPLIT]`` (e.g. ``tfds:lm1b/train``) or a glob of text files."""
    if spec.startswith("tfds:"):
        name, _, split = spec[len("tfds:") :].partition("/")
        return TfdsSource(name, split or "train", data_dir=data_dir)
    return TextFiles(spec)


def shard_for_process(source: Source, process_index: int, process_count: int) -> list[int]:
    """The shards this process reads: every ``process_count``-th, so processes never overlap.

    Too few shards is refused on every process, not only on those left without one: a process
    that stopped alone would leave the others to abort in jax.distributed's coordination service."""
    if len(source) < process_count:
        raise DataError(
            f"{len(source)} shard(s) for {process_count} processes: each process needs at least one; "
            f"use at least as many shards as processes"
        )
    return list(range(process_index, len(source), process_count))
