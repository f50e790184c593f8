"""Tokens to character ids (bilm-tf's ``UnicodeCharsVocabulary``, AllenNLP's
``ELMoCharacterMapper``) and the word vocabulary.

A token is its UTF-8 bytes framed by begin/end-of-word ids and padded to a fixed width. Ids are
returned with bilm-tf's inference shift (+1) so that an all-zero row means "no token here".
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import numpy as np

from elmo_jax._util import utf8

BOS_CHAR = 256  # beginning of sentence
EOS_CHAR = 257  # end of sentence
BOW_CHAR = 258  # beginning of word
EOW_CHAR = 259  # end of word
PAD_CHAR = 260  # in-token padding: a learned embedding, never masked

BOS_TOKEN = "<S>"
EOS_TOKEN = "</S>"
UNK_TOKEN = "<UNK>"


class VocabError(ValueError):
    """A vocabulary file is not what elmo_jax expects."""


def _marker_ids(char: int, max_chars: int) -> np.ndarray:
    ids = np.full(max_chars, PAD_CHAR, dtype=np.int32)
    ids[:3] = (BOW_CHAR, char, EOW_CHAR)
    return ids + 1


def token_to_ids(token: str, max_chars: int = 50) -> np.ndarray:
    """One token -> ``[max_chars] int32`` char ids, shifted by +1.

    ``<S>`` and ``</S>`` are the sentence markers, not their letters (bilm-tf and AllenNLP agree).
    Bytes are cut at ``max_chars - 2``, possibly inside a multi-byte character: the ids are bytes,
    so a cut character is just its leading bytes.
    """
    if not isinstance(token, str):  # bytes or a number would fail in .encode, or be taken
        raise TypeError(f"token {token!r:.40} has type {type(token).__name__}; expected str")
    _check_max_chars(max_chars)
    return _token_ids(token, max_chars)


def _check_max_chars(max_chars: int) -> None:
    if isinstance(max_chars, bool) or not isinstance(max_chars, int) or max_chars < 3:
        raise ValueError(f"max_chars must be an integer >= 3 (begin and end of word, and a byte); got {max_chars!r}")


def _token_ids(token: str, max_chars: int) -> np.ndarray:
    """``token_to_ids`` without its checks, for loops over words already checked."""
    if token == BOS_TOKEN:
        return _marker_ids(BOS_CHAR, max_chars)
    if token == EOS_TOKEN:
        return _marker_ids(EOS_CHAR, max_chars)
    # 'ignore' only matters for lone surrogates (e.g. from a bad surrogateescape decode).
    data = token.encode("utf-8", "ignore")[: max_chars - 2]
    ids = np.full(max_chars, PAD_CHAR, dtype=np.int32)
    ids[0] = BOW_CHAR
    ids[1 : len(data) + 1] = np.frombuffer(data, dtype=np.uint8)
    ids[len(data) + 1] = EOW_CHAR
    return ids + 1


def sentence_markers(max_chars: int = 50) -> tuple[np.ndarray, np.ndarray]:
    """The ``<S>`` and ``</S>`` char ids, ``[max_chars] int32`` each (shifted)."""
    return _marker_ids(BOS_CHAR, max_chars), _marker_ids(EOS_CHAR, max_chars)


def words_to_ids(words: Sequence[str], max_chars: int = 50) -> np.ndarray:
    """``[len(words), max_chars] int32``, row i ``token_to_ids(words[i])``. The words are str
    already (a tokenized batch, a vocabulary: each checked where it was made), so only
    ``max_chars`` is checked, once, not per word.

    A vocabulary of 793k words comes through here at every run's start (once per batcher), so
    the words go through numpy as one fixed-width byte array, not a row at a time."""
    _check_max_chars(max_chars)
    width = max_chars - 2
    data = [w.encode("utf-8", "ignore")[:width] for w in words]
    n = len(data)
    lengths = np.fromiter(map(len, data), np.int64, n)
    # Fixed-width bytes, NUL-padded: a word's own NUL bytes are kept apart from padding by its length.
    fixed = np.array(data, dtype=f"S{width}")
    out = np.empty((n, max_chars), dtype=np.int32)
    out[:, 0] = BOW_CHAR + 1
    out[:, 1 : width + 1] = fixed.view(np.uint8).reshape(n, width) + 1
    out[np.arange(max_chars) > lengths[:, None]] = PAD_CHAR + 1
    out[np.arange(n), lengths + 1] = EOW_CHAR + 1
    for i in [i for i, w in enumerate(words) if w in (BOS_TOKEN, EOS_TOKEN)]:  # one id each, not their letters
        out[i] = _token_ids(words[i], max_chars)
    return out


def check_many(value, name: str, expected: str) -> None:
    """A ``TypeError`` when the argument ``name``, a collection, is one str (a sequence of its
    letters, so it would pass for one) or no collection."""
    if isinstance(value, str) or not isinstance(value, Iterable):
        what = f"one str ({value[:40]!r})" if isinstance(value, str) else f"a {type(value).__name__}"
        raise TypeError(f"{name} is {what}; expected {expected}")


def check_tokenized(
    sentences: Sequence[Sequence[str]],
    hint: str = "split it into tokens first (elmo_jax.text.tokenize.tokenize or str.split)",
) -> None:
    """Raises ``TypeError`` (one line) for a sentence that is a ``str`` or holds a non-``str`` token.

    A ``str`` is a sequence of 1-character strings, so without this check ``"The cat"`` would be
    embedded as 7 one-letter tokens. One ``isinstance`` per token: cheap next to the rest.
    """
    check_many(sentences, "sentences", "a list of sentences, each a list of tokens")
    for i, sentence in enumerate(sentences):
        if isinstance(sentence, str):
            raise TypeError(f"sentence {i} is a str ({sentence[:40]!r}); expected a list of tokens: {hint}")
        for j, token in enumerate(sentence):
            if not isinstance(token, str):
                raise TypeError(
                    f"sentence {i}, token {j} has type {type(token).__name__} ({token!r:.40}); expected str"
                )


def batch_to_ids(sentences: Sequence[Sequence[str]], max_chars: int = 50, min_length: int = 0) -> np.ndarray:
    """Tokenized sentences -> ``[batch, max_len, max_chars] int32`` (shifted; zero rows pad).

    ``max_len`` is the longest sentence (at least ``min_length``, at least 1 so that an all-empty
    batch keeps a time axis). Each distinct word's ids are computed once per call. A sentence
    that is a ``str`` instead of a list of tokens raises ``TypeError`` (see ``check_tokenized``).
    """
    check_many(sentences, "sentences", "a list of sentences, each a list of tokens")
    if not isinstance(sentences, Sequence):  # a generator: read once, here
        sentences = list(sentences)
    check_tokenized(sentences)
    lengths = [len(s) for s in sentences]
    max_len = max([min_length, 1, *lengths])
    vocab: dict[str, int] = {}
    index = np.zeros((len(sentences), max_len), dtype=np.int64)  # 0: padding row below
    for b, sent in enumerate(sentences):
        for t, w in enumerate(sent):
            index[b, t] = vocab.setdefault(w, len(vocab) + 1)
    table = np.zeros((len(vocab) + 1, max_chars), dtype=np.int32)
    if vocab:
        table[1:] = words_to_ids(list(vocab), max_chars)
    return table[index]


class Vocabulary:
    """A word list, one token per line, with id lookup.

    For a language model (``lm=True``) the file must contain ``<S>``, ``</S>`` and ``<UNK>``
    somewhere (the public fixtures place them at different lines) and out-of-vocabulary words map
    to ``<UNK>``. A plain word list (``lm=False``, e.g. for a token cache) needs none of them and
    maps unknown words to -1.
    """

    def __init__(self, words: Sequence[str], lm: bool = True, source: str = "vocabulary"):
        if isinstance(words, str):  # a str is a sequence of its letters
            raise VocabError(f"{source}: words is one str ({words[:40]!r}); expected a list of tokens, one per line")
        self.words = list(words)
        for i, w in enumerate(self.words):
            if not isinstance(w, str):
                raise VocabError(f"{source}: line {i + 1}: token {w!r:.40} has type {type(w).__name__}; expected str")

        if " ".join(self.words).split() != self.words:  # one pass in C; the token is looked for after
            i, w = next((i, w) for i, w in enumerate(self.words) if w.split() != [w])
            # Text is split on whitespace, and a vocabulary file keeps one token a line.
            raise VocabError(
                f"{source}: line {i + 1}: token {w!r:.40} is empty or holds whitespace; no token of "
                "whitespace-split text can match it, and a vocabulary file could not keep it"
            )
        self.source = source
        self.lm = lm
        self._index: dict[str, int] = {}
        for i, w in enumerate(self.words):
            if w in self._index:
                raise VocabError(f"{source}: line {i + 1}: duplicate token {w!r} (first at line {self._index[w] + 1})")
            self._index[w] = i
        if lm:
            missing = [t for t in (BOS_TOKEN, EOS_TOKEN, UNK_TOKEN) if t not in self._index]
            if missing:
                raise VocabError(
                    f"{source}: a language-model vocabulary must contain {missing} "
                    f"(one token per line); found {len(self.words)} tokens without them"
                )
            self.bos, self.eos, self.unk = (self._index[t] for t in (BOS_TOKEN, EOS_TOKEN, UNK_TOKEN))
        else:
            self.bos = self._index.get(BOS_TOKEN, -1)
            self.eos = self._index.get(EOS_TOKEN, -1)
            self.unk = self._index.get(UNK_TOKEN, -1)

    @classmethod
    def load(cls, path: str | os.PathLike, lm: bool = True, max_size: int | None = None) -> Vocabulary:
        """Reads one token per line (bilm-tf also allows ``token count`` lines: the first field counts)."""
        path = os.fspath(path)
        words = []
        try:
            for lineno, line in utf8.lines(path, VocabError):
                fields = line.split()
                if not fields:
                    raise VocabError(f"{path}: line {lineno}: empty line; expected one token per line")
                words.append(fields[0])
                if max_size is not None and len(words) >= max_size:
                    break
        except FileNotFoundError:
            raise VocabError(f"{path}: vocabulary file not found") from None
        if not words:
            raise VocabError(f"{path}: vocabulary file is empty")
        return cls(words, lm=lm, source=path)

    def __len__(self) -> int:
        return len(self.words)

    def __contains__(self, word: str) -> bool:
        return word in self._index

    def word_to_id(self, word: str) -> int:
        return self._index.get(word, self.unk)

    def encode(self, words: Iterable[str]) -> np.ndarray:
        """Words -> ``[n] int32`` ids (OOV: ``<UNK>`` for an LM vocabulary, -1 otherwise)."""
        check_many(words, "words", "a list of words")  # one str would be encoded letter by letter
        get, unk = self._index.get, self.unk
        return np.fromiter((get(w, unk) for w in words), dtype=np.int32)

    def char_ids(self, max_chars: int = 50) -> np.ndarray:
        """``[len(self), max_chars] int32``: every word's char ids (shifted)."""
        return words_to_ids(self.words, max_chars)
