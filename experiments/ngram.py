"""Interpolated modified Kneser-Ney n-gram LM: the held-out perplexity baseline a biLM must beat.

    python experiments/ngram.py --vocab V --train 'GLOB' --heldout 'GLOB' [--order 3 4]
                                [--out experiments/results/ngram.json]

Pure Python + numpy. The events are exactly those the biLM is scored on:

* closed vocabulary: every word not in the LM vocabulary is ``<UNK>``;
* forward: sentence ``w1 .. wn`` predicts ``w1 .. wn </S>``, its context padded on the left with
  ``<S>``; backward: the reversed sentence ``wn .. w1`` predicts ``wn .. w1 <S>`` padded with
  ``</S>`` (bilm-tf's backward LM reads ``</S> wn .. w1``). Sentences are independent;
* the distribution's support is the vocabulary minus that direction's padding marker, which is
  never predicted. A literal ``<S>`` or ``</S>`` word in the text is read as ``<UNK>`` (it would
  otherwise be an event outside the support, or pass for the end of the sentence).

The model (Chen & Goodman 1998, "An empirical study of smoothing techniques", section 3), for an
n-gram level ``k`` = 1..N with context ``h`` (``k - 1`` tokens) and word ``w``::

    P_k(w | h) = (c_k(h w) - D_k(c_k(h w))) / T_k(h)  +  gamma_k(h) * P_{k-1}(w | h')
    T_k(h) = sum_w c_k(h w),   gamma_k(h) = sum_w D_k(c_k(h w)) / T_k(h)
    P_0(w) = 1 / |support|

``h'`` is ``h`` without its first token and ``D_k(0) = 0``. A context never seen at level ``k``
(``T_k(h) = 0``) backs off fully: ``P_k(w | h) = P_{k-1}(w | h')``. The counts ``c_k``:

* level N: raw counts of the training events;
* level k < N: continuation counts, the number of distinct tokens ``v`` with ``c_{k+1}(v h w) > 0``;
  except a k-gram that starts with the padding marker, which has no left extension but more
  padding: it keeps the count of that one extension, so its raw count (as KenLM does with
  ``<s>``).

Discounts per level, from that level's count-of-counts ``n_r`` (number of k-grams with ``c_k = r``):
``Y = n1 / (n1 + 2 n2)``, ``D1 = 1 - 2 Y n2 / n1``, ``D2 = 2 - 3 Y n3 / n2``, ``D3+ = 3 - 4 Y n4 / n3``.

Each level sums to 1 over the support (the discounted mass of a context is exactly what ``gamma``
hands to the level below), and every token in the support has probability > 0 as long as the
discounts are > 0 (the uniform ``P_0`` reaches it through the unigram level's ``gamma``).

Held-out report: forward, backward and combined perplexity, combined = ``exp(0.5 * (mean NLL_fwd
+ mean NLL_bwd))`` with the means over all events (words and end markers), as
:func:`elmo_jax.training.evaluate.evaluate` defines it for the biLM.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import pathlib
import sys
import time
from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from elmo_jax._util import utf8  # noqa: E402
from elmo_jax._util.atomic import write_text_atomic  # noqa: E402
from elmo_jax.model.vocabulary import VocabError, Vocabulary  # noqa: E402

# KenLM's --discount_fallback defaults, for a discount the count-of-counts cannot give.
FALLBACK_DISCOUNTS = (0.5, 1.0, 1.5)


def estimate_discounts(n1: int, n2: int, n3: int, n4: int) -> tuple[float, float, float]:
    """``(D1, D2, D3+)`` from the count-of-counts (Chen & Goodman 1998, eq. 26).

    Fallback: a ``D_c`` whose denominator is 0 or whose value is not strictly between 0 and ``c``
    is ``FALLBACK_DISCOUNTS[c - 1]``. Tiny corpora do this (e.g. no n-gram seen 3 times gives
    ``D2 = 2``, which would leave n-grams seen twice nothing of their own). Strictly inside
    ``(0, c)``, every seen n-gram keeps some mass and every seen context passes some down.
    """
    y = n1 / (n1 + 2 * n2) if n1 + 2 * n2 else None
    raw = (
        1 - 2 * y * n2 / n1 if y is not None and n1 else None,
        2 - 3 * y * n3 / n2 if y is not None and n2 else None,
        3 - 4 * y * n4 / n3 if y is not None and n3 else None,
    )
    return tuple(
        d if d is not None and 0 < d < c else fallback
        for c, (d, fallback) in enumerate(zip(raw, FALLBACK_DISCOUNTS), 1)
    )


class KneserNey:
    """One direction's interpolated modified Kneser-Ney model over token ids ``0 .. vocab_size-1``.

    ``backward=False``: sentences predict ``w1 .. wn eos_id`` from contexts padded with ``bos_id``.
    ``backward=True``: the same on the reversed sentence, with the markers' roles swapped (padding
    ``eos_id``, end ``bos_id``). ``self.pad`` and ``self.end`` are the direction's markers.

    ``discounts``: ``None`` to estimate them (:func:`estimate_discounts`), or fixed values, either
    one ``(D1, D2, D3+)`` for every level or ``order`` of them, unigram level first, each
    ``0 <= D_c <= c``. After :meth:`fit`, ``self.discounts[k - 1]`` is level k's triple.
    """

    def __init__(
        self,
        order: int,
        vocab_size: int,
        bos_id: int,
        eos_id: int,
        backward: bool = False,
        discounts: Sequence | None = None,
    ):
        if order < 1:
            raise ValueError(f"order must be >= 1, got {order}")
        if bos_id == eos_id or not (0 <= bos_id < vocab_size and 0 <= eos_id < vocab_size):
            raise ValueError(f"bos_id {bos_id} and eos_id {eos_id} must be distinct ids below {vocab_size}")
        self.order, self.vocab_size, self.backward = order, vocab_size, backward
        self.pad, self.end = (eos_id, bos_id) if backward else (bos_id, eos_id)
        self.fixed_discounts = None
        if discounts is not None:
            if np.ndim(discounts) == 1:
                discounts = [discounts] * order
            fixed = [tuple(float(x) for x in d) for d in discounts]
            if len(fixed) != order or any(
                len(d) != 3 or not all(0 <= x <= c for c, x in enumerate(d, 1)) for d in fixed
            ):
                raise ValueError(
                    f"discounts: one (D1, D2, D3+) or {order} of them, each 0 <= D_c <= c; got {discounts}"
                )
            self.fixed_discounts = fixed

    # -- the events -------------------------------------------------------------------------------
    def _sequence(self, sentence) -> list[int]:
        """``order - 1`` paddings, the sentence in reading order, the end marker."""
        words = sentence.tolist() if isinstance(sentence, np.ndarray) else list(sentence)
        if self.backward:
            words.reverse()
        return [self.pad] * (self.order - 1) + words + [self.end]

    def _check(self, flat: list[int], n_sentences: int) -> None:
        ids = np.asarray(flat, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}); found {ids.min()} .. {ids.max()}")
        if np.count_nonzero(ids == self.pad) != (self.order - 1) * n_sentences:
            raise ValueError(f"a sentence contains the padding marker (id {self.pad}), which is never predicted")

    def events(self, sentence) -> list[tuple[tuple[int, ...], int]]:
        """``(context, token)`` pairs, the context the ``order - 1`` tokens before, in reading order."""
        seq = self._sequence(sentence)
        self._check(seq, 1)
        n = self.order - 1
        return [(tuple(seq[i - n : i]), seq[i]) for i in range(n, len(seq))]

    # -- training ---------------------------------------------------------------------------------
    def fit(self, sentences: Iterable[Sequence[int]]) -> KneserNey:
        """Counts every level from sentences of token ids (natural order, no markers)."""
        N, pad = self.order, self.pad
        flat: list[int] = []
        n_sentences = 0
        for s in sentences:
            flat += self._sequence(s)
            n_sentences += 1
        self._check(flat, n_sentences)
        # Each sentence brings its own N-1 paddings, so every N-gram window that ends on a non-pad
        # token is exactly one event with its padded context; windows ending on a pad are not events.
        counts: list = [None] * N
        counts[N - 1] = Counter(g for g in zip(*(flat[i:] for i in range(N))) if g[-1] != pad)
        del flat
        for k in range(N - 1, 0, -1):
            # Level k from the distinct (k+1)-grams: one per distinct left extension; a (k+1)-gram
            # (pad, pad, ..) is the only extension of its pad-led suffix, which takes its count.
            lower: dict[tuple, int] = {}
            for g, c in counts[k].items():
                key = g[1:]
                lower[key] = lower.get(key, 0) + (c if g[1] == pad else 1)
            counts[k - 1] = lower
        self.counts = counts
        self.count_of_counts = []
        self.discounts = []
        self.totals, self.masses, self._tables = [], [], []
        for k, level in enumerate(counts):
            coc = Counter(level.values())
            self.count_of_counts.append(tuple(coc.get(r, 0) for r in (1, 2, 3, 4)))
            d = self.fixed_discounts[k] if self.fixed_discounts else estimate_discounts(*self.count_of_counts[-1])
            self.discounts.append(d)
            table = (0.0, *d)  # D(c) = table[min(c, 3)], D(0) = 0
            self._tables.append(table)
            total: dict[tuple, int] = {}
            mass: dict[tuple, float] = {}
            for g, c in level.items():
                h = g[:-1]
                total[h] = total.get(h, 0) + c
                mass[h] = mass.get(h, 0.0) + table[min(c, 3)]
            self.totals.append(total)
            self.masses.append(mass)
        return self

    # -- probabilities ----------------------------------------------------------------------------
    @property
    def support(self) -> np.ndarray:
        """The ids that can be predicted: all but the padding marker."""
        return np.delete(np.arange(self.vocab_size), self.pad)

    def prob(self, token: int, context: Sequence[int] = ()) -> float:
        """``P(token | context)``; ``context`` is the preceding tokens in reading order, the
        nearest last (for the backward model: the words after the token, from the far end of the
        sentence inwards). Only its last ``order - 1`` tokens count; a shorter one is left-padded
        with the padding marker, i.e. it starts the sentence. The padding marker has probability 0."""
        token = int(token)
        if not 0 <= token < self.vocab_size:
            raise ValueError(f"token id {token} not in [0, {self.vocab_size})")
        if token == self.pad:
            return 0.0
        n = self.order - 1
        h = tuple(int(t) for t in context)[-n:] if n else ()
        h = (self.pad,) * (n - len(h)) + h
        return self._prob(token, h)

    def _prob(self, w: int, h: tuple) -> float:
        """Bottom-up: ``p`` is ``P_{k-1}(w | ..)`` when level k is reached."""
        p = 1.0 / (self.vocab_size - 1)
        for k in range(self.order):  # level k + 1: context = the last k tokens of h
            ctx = h[len(h) - k :] if k else ()
            t = self.totals[k].get(ctx)
            if t is not None:
                c = self.counts[k].get(ctx + (w,), 0)
                p = (c - self._tables[k][min(c, 3)] + self.masses[k][ctx] * p) / t
        return p

    def nll(self, sentences: Iterable[Sequence[int]]) -> tuple[float, int]:
        """``(sum of -log P over all events, number of events)``; a sentence of n words has n + 1."""
        total, n_events = 0.0, 0
        for s in sentences:
            for h, w in self.events(s):
                total -= math.log(self._prob(w, h))
                n_events += 1
        return total, n_events

    def perplexity(self, sentences: Iterable[Sequence[int]]) -> float:
        """``exp(mean NLL)`` over all events."""
        total, n = self.nll(sentences)
        return math.exp(total / n)


# -- data -------------------------------------------------------------------------------------------


class InputError(ValueError):
    """Bad command-line input; the message names the file."""


def expand(pattern: str, flag: str) -> list[str]:
    """The files a glob names, sorted; none is an error."""
    files = sorted(p for p in glob.glob(pattern) if not os.path.isdir(p))
    if not files:
        raise InputError(f"{flag} {pattern!r}: no files match")
    return files


def encode_sentence(words: Sequence[str], vocab: Vocabulary) -> list[int]:
    """Word ids, out-of-vocabulary words and literal ``<S>`` / ``</S>`` words as ``<UNK>``."""
    ids = vocab.encode(words)
    ids[(ids == vocab.bos) | (ids == vocab.eos)] = vocab.unk
    return ids.tolist()


def read_sentences(files: Sequence[str], vocab: Vocabulary) -> tuple[list[list[int]], dict]:
    """UTF-8 files, one sentence per line (blank lines skipped) -> id lists and their counts."""
    sentences: list[list[int]] = []
    n_words = n_unk = 0
    for path in files:
        before = len(sentences)
        for _, line in utf8.lines(path, InputError):
            words = line.split()
            if words:
                ids = encode_sentence(words, vocab)
                sentences.append(ids)
                n_words += len(ids)
                n_unk += ids.count(vocab.unk)
        if len(sentences) == before:
            raise InputError(f"{path}: no sentences (the file is empty or blank)")
    stats = {
        "files": list(files),
        "sentences": len(sentences),
        "words": n_words,
        "events": n_words + len(sentences),
        "oov_rate": n_unk / n_words,
    }
    return sentences, stats


# -- command line -----------------------------------------------------------------------------------


def evaluate(order: int, vocab: Vocabulary, train: list, heldout: list) -> dict:
    """Fits and scores one direction at a time (only one model in memory)."""
    t0 = time.perf_counter()
    out: dict = {"order": order}
    nll = {}
    for name, backward in (("fwd", False), ("bwd", True)):
        model = KneserNey(order, len(vocab), vocab.bos, vocab.eos, backward=backward).fit(train)
        total, n_events = model.nll(heldout)
        nll[name] = total / n_events
        out[f"perplexity_{name}"] = math.exp(nll[name])
        out[f"nll_{name}"] = nll[name]
        out[f"discounts_{name}"] = [list(d) for d in model.discounts]
        del model
    out["perplexity"] = math.exp(0.5 * (nll["fwd"] + nll["bwd"]))
    out["events"] = n_events
    out["seconds"] = time.perf_counter() - t0
    return out


def write_json(path: str, data: dict) -> None:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(data, indent=1) + "\n")


def print_table(train_stats: dict, heldout_stats: dict, results: list[dict]) -> None:
    print(
        f"train: {train_stats['sentences']:,} sentences, {train_stats['words']:,} words "
        f"({len(train_stats['files'])} files); held-out: {heldout_stats['sentences']:,} sentences, "
        f"{heldout_stats['events']:,} events, OOV {100 * heldout_stats['oov_rate']:.2f}%"
    )
    print(f"{'order':>5} {'ppl fwd':>10} {'ppl bwd':>10} {'ppl':>10} {'events':>10} {'seconds':>8}")
    for r in results:
        print(
            f"{r['order']:>5} {r['perplexity_fwd']:>10.2f} {r['perplexity_bwd']:>10.2f} "
            f"{r['perplexity']:>10.2f} {r['events']:>10,} {r['seconds']:>8.1f}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", required=True, help="LM vocabulary, one token per line")
    parser.add_argument("--train", required=True, help="glob of training text (quote it)")
    parser.add_argument("--heldout", required=True, help="glob of held-out text (quote it)")
    parser.add_argument("--order", type=int, nargs="+", default=[3], help="n-gram orders (default 3)")
    parser.add_argument(
        "--out",
        default=str(ROOT / "experiments" / "results" / "ngram.json"),
        help="JSON results (default experiments/results/ngram.json)",
    )
    args = parser.parse_args(argv)
    if min(args.order) < 1:
        parser.error(f"--order must be >= 1, got {args.order}")
    try:
        train_files = expand(args.train, "--train")
        heldout_files = expand(args.heldout, "--heldout")
        vocab = Vocabulary.load(args.vocab)
        train, train_stats = read_sentences(train_files, vocab)
        heldout, heldout_stats = read_sentences(heldout_files, vocab)
        results = [evaluate(order, vocab, train, heldout) for order in args.order]
        print_table(train_stats, heldout_stats, results)
        write_json(
            args.out,
            {
                "vocab": args.vocab,
                "vocab_size": len(vocab),
                "train": {"pattern": args.train, **train_stats},
                "heldout": {"pattern": args.heldout, **heldout_stats},
                "results": results,
            },
        )
    except (InputError, VocabError) as e:
        print(f"ngram: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"ngram: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
