"""A new domain for continued pretraining (issue 14): the prose of Python's documentation.

Debian's ``python3.11-doc`` ships the reST sources of docs.python.org (``html/_sources/**/*.rst.txt``,
fetched and unpacked by ``fetch_data.sh``). This keeps their prose and drops the rest: code
(literal blocks after ``::``, code and doctest directives, ``>>>`` sessions), signatures and
other directive arguments, tables, comments, headings' underlines. Inline markup keeps its text
(``:func:`~os.path.join``` -> ``join``, ````literal```` -> ``literal``). Sentences are split and
tokenized with ``elmo_jax.text.tokenize``, as the experiments' other text. Train and held-out are split by
document: every document whose index (sorted paths) ends in 5 is held out.

    python experiments/prep_domain.py     # experiments/data/raw/pydoc -> experiments/data/domain/
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys

from make_sample import dedupe, tokenized

from elmo_jax._util.atomic import write_text_atomic

HERE = pathlib.Path(__file__).resolve().parent
SOURCES = "usr/share/doc/python3.11/html/_sources"
HELDOUT_LAST_DIGIT = 5
# Directives whose body is prose (kept, unindented); any other directive's body is dropped.
PROSE_DIRECTIVES = {
    "note",
    "seealso",
    "warning",
    "versionadded",
    "versionchanged",
    "deprecated",
    "deprecated-removed",
    "impl-detail",
    "important",
    "tip",
    "caution",
    "attention",
    "hint",
    "admonition",
    "topic",
    "sidebar",
    "rubric",
    "centered",
}
# Directives of API entries: their argument (a signature) goes, their body (the description) stays.
ENTRY_DIRECTIVES = {
    "function",
    "method",
    "class",
    "exception",
    "attribute",
    "data",
    "decorator",
    "decoratormethod",
    "classmethod",
    "staticmethod",
    "module",
    "currentmodule",
    "opcode",
    "describe",
    "envvar",
    "cmdoption",
    "option",
    "pdbcommand",
    "2to3fixer",
    "c:function",
    "c:type",
    "c:member",
    "c:macro",
    "c:var",
    "c:struct",
    "c:enum",
    "c:enumerator",
    "index",
    "audit-event",
    "program",
    "abstractmethod",
    "coroutinefunction",
    "coroutinemethod",
    "awaitablefunction",
    "awaitablemethod",
}

_DIRECTIVE = re.compile(r"^(\s*)\.\.\s+([\w:-]+)::(.*)$")
_COMMENT = re.compile(r"^(\s*)\.\.(\s|$)")
_UNDERLINE = re.compile(r"^\s*([=\-~^\"'`#*+<>_.:])\1{2,}\s*$")
_TABLE = re.compile(r"^\s*(\+[-=+]+\+|\|.*\||=+(\s+=+)+)\s*$")
_FIELD = re.compile(r"^\s*:[\w -]+:(\s|$)")
_ROLE = re.compile(r":[\w:-]+:`([^`]*)`")
_LINK = re.compile(r"`([^`<]*?)\s*<[^`>]*>`_{1,2}")
_LITERAL = re.compile(r"``(.+?)``")
_EMPHASIS = re.compile(r"\*\*?([^*\s][^*]*?)\*\*?")
_REF_TAIL = re.compile(r"`([^`]+)`_{1,2}")
_FOOTNOTE = re.compile(r"\s*\[(#\w*|\d+|\*)\]_")
_BULLET = re.compile(r"^([*+-]|#\.|\d+\.|\(?[a-z]\))\s+")


def _role_text(match: re.Match) -> str:
    text = match.group(1)
    if "<" in text and text.rstrip().endswith(">"):
        text = text[: text.index("<")].strip()  # :ref:`the title <target>` -> the title
    if text.startswith("~"):
        text = text[1:].split(".")[-1]  # :func:`~os.path.join` shows as "join"
    return text.lstrip("!")


def inline(text: str) -> str:
    """reST inline markup -> its text."""
    text = _ROLE.sub(_role_text, text)
    text = _LINK.sub(r"\1", text)
    text = _LITERAL.sub(r"\1", text)
    text = _REF_TAIL.sub(r"\1", text)
    text = _FOOTNOTE.sub("", text)
    return _EMPHASIS.sub(r"\1", text)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def prose(rst: str) -> list[str]:
    """The paragraphs of a reST document's prose, each one string (see the module doc)."""
    lines = rst.expandtabs(8).splitlines()
    paragraphs, current = [], []
    skip_deeper_than = None  # drop lines indented deeper than this (a dropped block's body)
    literal_next = False  # the paragraph ended in "::": the next indented block is code

    def flush():
        if current:
            paragraphs.append(inline(" ".join(current)))
            current.clear()

    for i, line in enumerate(lines):
        stripped = line.strip()
        if skip_deeper_than is not None:
            if not stripped or _indent(line) > skip_deeper_than:
                continue
            skip_deeper_than = None
        if not stripped:
            if current and current[-1].endswith("::"):
                current[-1] = current[-1][:-1].rstrip(":") + (":" if current[-1][:-2].strip() else "")
                literal_next = True
            flush()
            continue
        if literal_next:
            literal_next = False
            prev = next((l for l in reversed(lines[:i]) if l.strip()), "")
            if _indent(line) > _indent(prev):
                skip_deeper_than = _indent(prev)
                continue
        directive = _DIRECTIVE.match(line)
        if directive:
            flush()
            name = directive.group(2).lower()
            if name not in PROSE_DIRECTIVES and name not in ENTRY_DIRECTIVES:
                skip_deeper_than = _indent(line)  # code, tables, toctrees, includes...: the whole block
            continue
        if _COMMENT.match(line) or stripped.startswith((">>>", "... ")):
            flush()
            if _COMMENT.match(line):
                skip_deeper_than = _indent(line)
            continue
        if _UNDERLINE.match(line) or _TABLE.match(line) or _FIELD.match(line):
            flush()  # a heading's title line stays a paragraph of its own; tables and options go
            continue
        bullet = _BULLET.match(stripped)
        if bullet:  # a list item is a paragraph of its own
            flush()
            stripped = stripped[bullet.end() :]
        current.append(stripped)
    flush()
    return [p for p in paragraphs if p]


def document_sentences(rst: str) -> list[str]:
    """Tokenized sentences (``elmo_jax.text.tokenize``) of a document's prose; headings and debris dropped."""
    out = []
    for paragraph in prose(rst):
        out.extend(s for s in tokenized(paragraph) if len(s.split()) >= 4)  # titles and fragments go
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--raw", default=str(HERE / "data" / "raw" / "pydoc"), help="the unpacked python3.11-doc")
    p.add_argument("--out", default=str(HERE / "data" / "domain"))
    args = p.parse_args(argv)
    root = pathlib.Path(args.raw) / SOURCES
    files = sorted(root.rglob("*.rst.txt"))
    if not files:
        sys.exit(f"prep_domain: no *.rst.txt under {root}; run experiments/fetch_data.sh first")
    train, heldout = [], []
    for i, path in enumerate(files):
        (heldout if i % 10 == HELDOUT_LAST_DIGIT else train).extend(
            document_sentences(path.read_text(encoding="utf-8", errors="replace"))
        )
    heldout = dedupe(heldout)
    train = dedupe(train, exclude=frozenset(heldout))  # no held-out sentence in the training text
    out = pathlib.Path(args.out)
    (out / "train").mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "train" / "pydoc.txt", "\n".join(train) + "\n")
    write_text_atomic(out / "heldout.txt", "\n".join(heldout) + "\n")
    stats = {
        "documents": len(files),
        "heldout_documents": sum(i % 10 == HELDOUT_LAST_DIGIT for i in range(len(files))),
        "train_sentences": len(train),
        "train_tokens": sum(len(s.split()) for s in train),
        "heldout_sentences": len(heldout),
        "heldout_tokens": sum(len(s.split()) for s in heldout),
    }
    write_text_atomic(out / "stats.json", json.dumps(stats, indent=1) + "\n")
    print(json.dumps(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
