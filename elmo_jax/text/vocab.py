"""Building a word vocabulary from training text.

``count_tokens`` reads every shard once; ``build_vocab`` turns the counts into an LM word list
(``<S>``, ``</S>``, ``<UNK>`` first, then words by descending count); ``write_vocab`` writes it one
token per line, next to a JSON sidecar ``<path>.json`` with the corpus size::

    {"n_train_tokens": ...,  # tokens + sentences: training (input, target) pairs per direction
     "n_tokens": ...,        # whitespace tokens in the text
     "n_sentences": ...,     # non-blank lines
     "n_words": ...,         # lines of the vocabulary file
     "files": [...],         # the shards that were counted
     "vocab_sha256": ...}    # of the vocabulary file, to notice a sidecar that no longer matches it

``n_train_tokens`` is what bilm-tf's ``n_train_tokens`` option means for this data pipeline
(``elmo_jax.training.batches``): a sentence of n words gives n + 1 (input, target) pairs per direction
(inputs ``<S> w1 .. wn``, targets ``w1 .. wn </S>``), so one epoch is ``n_tokens + n_sentences``
pairs per direction.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import json
import numbers
import os
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import cast

from elmo_jax._util.arguments import about
from elmo_jax._util.atomic import is_local, open_binary, write_bytes_atomic
from elmo_jax._util.paths import replaced_input, same_path
from elmo_jax.model.vocabulary import BOS_TOKEN, EOS_TOKEN, UNK_TOKEN, VocabError, Vocabulary
from elmo_jax.text.sources import DataError, NoSentences, Source, TextFiles, as_source

SPECIALS = (BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)


def _describe(files: Source) -> str:
    names = [files.name(i) for i in range(min(len(files), 5))]
    return ", ".join(names) + (f" ... ({len(files)} files)" if len(files) > 5 else "")


def count_tokens(
    files: TextFiles | Source | Sequence[str], on_shard: Callable[[int], None] | None = None
) -> tuple[collections.Counter, int, int]:
    """Word counts, number of tokens and number of sentences, in one pass over all shards
    (``on_shard(i)``: called as shard ``i`` is read, a sign of progress over a large corpus).
    ``files``: a ``Source``, or a list of str (one sentence each) as ``pretrain`` and ``evaluate``
    take them.

    Sentences are the non-blank lines ``files.read`` returns (non-UTF-8 lines are skipped there
    with a warning); tokens are ``line.split()``. ``<S>``, ``</S>`` and ``<UNK>`` occurring in the
    text are counted like any other word. Raises ``DataError`` if there is no token at all.
    """
    files = as_source(files, "files")
    counts: collections.Counter = collections.Counter()
    n_sentences = 0
    for shard in range(len(files)):
        if on_shard is not None:
            on_shard(shard)
        lines = files.read(shard)
        n_sentences += len(lines)
        # One C-level update per shard: much faster than an update per line.
        counts.update(itertools.chain.from_iterable(map(str.split, lines)))
    n_tokens = sum(counts.values())
    if n_tokens == 0:
        raise NoSentences(f"no tokens in {_describe(files)}")
    return counts, n_tokens, n_sentences


MIN_COUNT = 1  # build_vocab's default: every word the text has


def check_vocab_arguments(min_count: int = MIN_COUNT, max_size: int | None = None) -> None:
    """``build_vocab``'s checks of its numbers, which a caller may make before the count."""
    if isinstance(min_count, bool) or not isinstance(min_count, numbers.Integral) or min_count < 1:
        raise about(VocabError(f"min_count must be an integer >= 1; got {min_count!r}"), "min_count")
    if max_size is not None and (
        isinstance(max_size, bool) or not isinstance(max_size, numbers.Integral) or max_size < 4
    ):
        raise about(
            VocabError(
                f"max_size must be an integer >= 4 (the 3 specials {list(SPECIALS)} and at least one word); "
                f"got {max_size!r}"
            ),
            "max_size",
        )


def build_vocab(
    counts: Mapping[str, int],
    min_count: int = MIN_COUNT,
    max_size: int | None = None,
    extend: Sequence[str] | None = None,
) -> list[str]:
    """``['<S>', '</S>', '<UNK>', *words]``: words with ``count >= min_count``, most frequent first.

    Ties are broken by the word itself (Python string order), so the result is deterministic.
    Specials found in ``counts`` are not repeated. ``max_size`` caps the total length, specials
    included; with ``extend`` it caps the new words, the old ones all kept.

    ``extend``: an existing vocabulary (continued pretraining) whose words are all kept, whatever
    their count here, so that their softmax rows carry over. The merged list is still sorted by
    the counts of this corpus, because the log-uniform sampler assumes ids in frequency order;
    words of ``extend`` that do not occur here come last, in their old order.
    """
    if not isinstance(counts, Mapping):  # a source of text, say (unchecked: "... has no attribute 'items'")
        raise TypeError(
            f"counts is a {type(counts).__name__}; expected a mapping of word to count: elmo_jax.count_tokens(source)[0] "
            "gives one"
        )
    check_vocab_arguments(min_count, max_size)
    found = {w for w, c in counts.items() if c >= min_count and w not in SPECIALS}
    if not found and not extend and any(w not in SPECIALS for w in counts):  # a vocabulary of the markers alone
        most = max(c for w, c in counts.items() if w not in SPECIALS)
        raise about(
            VocabError(f"min_count {min_count}: no word is counted that often (the most frequent, {most} times)"),
            "min_count",
        )
    old_rank: dict[str, int] = {}
    for w in extend or ():
        if w not in SPECIALS:
            old_rank.setdefault(w, len(old_rank))
            found.add(w)
    words = sorted(found, key=lambda w: (-counts.get(w, 0), old_rank.get(w, 0) if not counts.get(w) else 0, w))
    if max_size is not None:
        room = max_size - len(SPECIALS) - len(old_rank)  # every word of extend is kept: the cap is on the new ones
        if room < 0:
            raise about(
                VocabError(
                    f"max_size {max_size} is smaller than extend's {len(old_rank)} words and the "
                    f"{len(SPECIALS)} specials, all of which are kept"
                ),
                "max_size",
                "extend",
            )
        kept: list[str] = []
        for w in words:  # in frequency order: the most frequent new words fill the room
            if w in old_rank or room > 0:
                room -= w not in old_rank
                kept.append(w)
        words = kept
    return [*SPECIALS, *words]


def _file_names(files: Source | Iterable[str]) -> list[str]:
    if hasattr(files, "name") and hasattr(files, "__len__"):
        source = cast(Source, files)
        return [source.name(i) for i in range(len(source))]
    return [os.fspath(f) for f in files]


def check_vocab_path(path: str | os.PathLike, files: Source | Iterable[str]) -> None:
    """``write_vocab``'s check, which a caller may make before the count: ``path`` is none of the
    counted files (``--out`` named like ``--train-files``: the corpus became its vocabulary)."""
    if counted := replaced_input(path, _file_names(files)):
        also = "" if same_path(counted, os.fspath(path)) else f" ({counted})"
        raise about(DataError(f"{os.fspath(path)}: is a text file counted{also}; give another path"), "path")


def write_vocab(
    words: Sequence[str],
    path: str | os.PathLike,
    n_tokens: int,
    n_sentences: int,
    files: Source | Iterable[str],
    *,
    min_count: int | None = None,
) -> None:
    """Writes ``words`` one per line (UTF-8) to ``path`` and the sidecar ``<path>.json``, each
    atomically. ``files`` is the counted ``TextFiles`` (or a list of file names); ``min_count``, the
    count ``build_vocab`` kept words from, is recorded when given.

    The vocabulary is written first: a failure between the two writes leaves an old sidecar whose
    ``vocab_sha256`` no longer matches, which ``read_vocab_meta`` notices.
    """
    path = os.fspath(path)
    check_vocab_path(path, files)
    words = list(words)
    for i, w in enumerate(words):
        if not isinstance(w, str) or w.split() != [w]:
            raise VocabError(f"{path}: word {i} ({w!r}) is not a single whitespace-free token")
    Vocabulary(words, lm=True, source=path)  # duplicates and missing specials
    data = "".join(w + "\n" for w in words).encode("utf-8")
    meta = {
        "n_train_tokens": int(n_tokens) + int(n_sentences),
        "n_tokens": int(n_tokens),
        "n_sentences": int(n_sentences),
        "n_words": len(words),
        "files": _file_names(files),
        "vocab_sha256": hashlib.sha256(data).hexdigest(),
        **({} if min_count is None else {"min_count": int(min_count)}),
    }
    if is_local(path):  # an object store (gs://) has no directories to make
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    write_bytes_atomic(path, data)
    write_bytes_atomic(path + ".json", (json.dumps(meta, indent=1, ensure_ascii=False) + "\n").encode("utf-8"))


def read_vocab_meta(path: str | os.PathLike) -> dict | None:
    """The sidecar ``<path>.json`` written by ``write_vocab``, or None if there is none.

    A sidecar whose ``vocab_sha256`` does not match the vocabulary file (the vocabulary was
    rewritten or edited since) is ignored with a warning: its numbers may describe other data.
    """
    path = os.fspath(path)
    sidecar = path + ".json"
    try:
        with open_binary(sidecar) as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    try:
        meta = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise VocabError(f"{sidecar}: not a valid vocabulary sidecar (JSON): {e}") from None
    if not isinstance(meta, dict):
        raise VocabError(
            f"{sidecar}: not a valid vocabulary sidecar: expected a JSON object, got {type(meta).__name__}"
        )
    expected = meta.get("vocab_sha256")
    if expected is not None:
        try:
            with open_binary(path) as f:
                actual = hashlib.sha256(f.read()).hexdigest()
        except FileNotFoundError:
            actual = None
        if actual != expected:
            warnings.warn(
                f"{sidecar}: ignored, it does not match {path} (the vocabulary was changed after it "
                f"was written); rebuild the vocabulary or give n_train_tokens explicitly",
                stacklevel=2,
            )
            return None
    return meta
