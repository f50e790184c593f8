"""Reading UTF-8 text files line by line, as vocabularies, options and ``embed``'s input are read.

Windows editors start UTF-8 files with the mark U+FEFF. It is no part of the text: kept, it would
join the first word (U+FEFF then ``The``: another word, another vocabulary entry, other character
ids). Python's ``open(..., encoding="utf-8")`` keeps it; only ``utf-8-sig`` drops it.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Iterator

from elmo_jax._util.atomic import open_binary


def utf16_hint(raw: bytes) -> str:
    """The clause a "not UTF-8" message adds for a file whose first bytes ``raw`` are UTF-16's
    byte-order mark; "" for any other."""
    utf16 = raw[:2] in (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)
    return "; it starts as UTF-16 text does: convert it to UTF-8" if utf16 else ""


def lines(path: str, error: type[Exception]) -> Iterator[tuple[int, str]]:
    """Yields (line number, line) of a UTF-8 file, less a byte-order mark at its start; a line
    that is not UTF-8 raises ``error`` naming the file and line (and UTF-16, where its mark says so)."""
    with open_binary(path) as f:  # a local file, or e.g. gs:// through etils.epath
        yield from decoded(f, path, error)


def decoded(raw_lines: Iterable[bytes], name: str, error: type[Exception]) -> Iterator[tuple[int, str]]:
    """``lines`` of any source of byte lines (a file, standard input's buffer); ``name`` is what an
    error calls it."""
    for lineno, raw in enumerate(raw_lines, 1):
        if lineno == 1:
            raw = raw.removeprefix(codecs.BOM_UTF8)
        try:
            yield lineno, raw.decode("utf-8")
        except UnicodeDecodeError as e:
            hint = utf16_hint(raw) if lineno == 1 else ""
            raise error(f"{name}: line {lineno}: not UTF-8 ({e.reason} at byte {e.start}){hint}") from None
