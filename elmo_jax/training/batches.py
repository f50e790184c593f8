"""The training input pipeline: bilm-tf's stream batcher, deterministic and resumable.

Each batch row is an independent, continuous stream of sentences. A sentence ``w1 .. wn``
contributes n + 1 (input, target) pairs: inputs ``<S> w1 .. wn``, targets ``w1 .. wn </S>``
(``</S>`` is never an input; the next sentence starts with its own ``<S>``). The backward stream is
each sentence reversed with the markers swapped (``</S> wn .. w1`` -> ``wn .. w1 <S>``) and is
shuffled independently. Windows are ``unroll_steps`` pairs; a row's next window continues where its
last one stopped (the LSTM state is carried over by the train step).

Per epoch, each direction visits every shard once in a fresh seeded order, and every sentence of a
shard once in a fresh seeded order. Rows take whole sentences from that one sequence, in row order,
whenever their buffer runs short, so an epoch is a real epoch and the stream is a pure function of
(seed, data). Its position (epoch, shard, sentence, and the rows' buffered pairs) is a small dict
of numpy arrays that goes into the checkpoint, so a resumed run sees exactly the batches it would
have seen.

Inputs are words, encoded as characters by the model; targets are vocabulary ids (OOV: ``<UNK>``).
A batch holds each distinct input word once (``chars``) and indices into it (``inputs``), so the
char CNN encodes a word once per batch, not once per occurrence.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import multiprocessing
import os
import signal
import warnings
import weakref
from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from elmo_jax.model.vocabulary import Vocabulary, words_to_ids
from elmo_jax.text.sources import DataError, Source, no_sentences


class WordTable:
    """Input words -> ids into a char-id table: vocabulary ids first, other words after them.

    Out-of-vocabulary words keep their own characters (the model's inputs are characters); only
    targets map them to ``<UNK>``.
    """

    def __init__(self, vocab: Vocabulary, max_chars: int):
        self.vocab, self.max_chars = vocab, max_chars
        self.index = dict(vocab._index)
        self.words = list(vocab.words)
        # uint16 halves the table (793,471 words x 50 chars); ids are at most 262.
        self.chars = words_to_ids(self.words, max_chars).astype(np.uint16)

    def input_ids(self, words: Sequence[str]) -> np.ndarray:
        """``[n] int64`` ids, a new one for each word not met before (numbered as met). A word of
        the vocabulary has its vocabulary id, every other word an id of ``len(vocab)`` or more."""
        ids = _lookup(self.index, words)
        index = self.index
        for i in np.flatnonzero(ids < 0).tolist():
            w = words[i]
            j = index.get(w)
            if j is None:
                j = index[w] = len(self.words)
                self.words.append(w)
            ids[i] = j
        return ids

    def targets(self, ids: np.ndarray) -> np.ndarray:
        """``input_ids``'s ids -> the vocabulary's ids (``<UNK>`` for the words outside it)."""
        return np.where(ids < len(self.vocab), ids, self.vocab.unk)

    def char_ids(self, ids: np.ndarray) -> np.ndarray:
        """``[n] -> [n, max_chars] int32``."""
        if len(self.words) > len(self.chars):
            new = words_to_ids(self.words[len(self.chars) :], self.max_chars).astype(np.uint16)
            self.chars = np.concatenate([self.chars, new])
        return self.chars[ids].astype(np.int32)


def _lookup(index: Mapping[str, int], words: Sequence[str]) -> np.ndarray:
    """``[n] int64``: each word's id in ``index``, -1 where it has none."""
    # One lookup per word, in C (map over dict.get): the lookups are most of a shard's parse,
    # which used to loop in Python and look every word up twice (inputs, then targets).
    return np.fromiter(map(index.get, words, itertools.repeat(-1)), np.int64, count=len(words))


def _parse_shard(
    lines: Sequence[str], order, reverse: bool, marks: tuple[int, int], vocab_index: Mapping[str, int], unk: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]:
    """One direction's pairs of a shard's ``lines``, its sentences in ``order`` (reversed when
    ``reverse``), by the vocabulary alone: ``(pair_in, pair_tgt, offsets, oov)``, sentence i's
    pairs at ``[offsets[i], offsets[i+1])``, ``marks`` (start, end) around each. The inputs of
    the words outside the vocabulary are -1, to be numbered by a ``WordTable`` in the order of
    ``oov`` (their spellings, as met); their targets are ``unk``. Pure: a loader process runs it."""
    words: list[str] = []
    lengths = np.empty(len(lines), np.int64)
    for k, i in enumerate(order):
        sentence = lines[i].split()
        if reverse:
            sentence.reverse()
        words.extend(sentence)
        lengths[k] = len(sentence)
    ids = _lookup(vocab_index, words)
    oov = [words[i] for i in np.flatnonzero(ids < 0).tolist()]
    # Sentence i becomes inputs [start, w1..wn] and targets [w1..wn, end].
    offsets = np.concatenate([[0], np.cumsum(lengths + 1)])
    first, last = offsets[:-1], offsets[1:] - 1
    pair_in = np.empty(offsets[-1], np.int64)
    pair_tgt = np.empty(offsets[-1], np.int64)
    word_slots = np.ones(offsets[-1], bool)
    word_slots[first] = False
    pair_in[first], pair_in[word_slots] = marks[0], ids
    tgt_slots = np.ones(offsets[-1], bool)
    tgt_slots[last] = False
    pair_tgt[last], pair_tgt[tgt_slots] = marks[1], np.where(ids >= 0, ids, unk)
    return pair_in, pair_tgt, offsets, oov


# -- shards parsed ahead, in a process ---------------------------------------------------------

# Shards of at least this many words are parsed ahead in a loader process once met: about 0.4 s
# to parse in-line on the development CPU. A smaller shard, or a small run's one shard, costs
# less than the process's start (a second or two of a core).
AHEAD_WORDS = 1_000_000
_LOADER_VOCAB: dict[str, int] = {}  # in a loader process: the vocabulary's word -> id


def _loader_started(words: list[str]) -> None:
    """In a loader process, at its start: the vocabulary. Ctrl-C is the parent's to handle (it
    stops the process)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The loader computes nothing with jax and does not import it: that took about half a second
    # of its start and 120 MB it held for the run. Should a source's own library import jax all
    # the same and start a backend, let it be the CPU's, not a second claim on the GPU: jax reads
    # this variable at its import.
    os.environ["JAX_PLATFORMS"] = "cpu"
    _LOADER_VOCAB.update((w, i) for i, w in enumerate(words))


def _read_and_parse(
    source: Source, shard: int, order_seed, reverse: bool, marks: tuple[int, int], vocab_index, unk: int
) -> tuple:
    """``_parse_shard`` of ``source``'s ``shard``, its sentences shuffled by ``order_seed`` (None:
    in file order)."""
    lines = source.read(shard)
    order = range(len(lines)) if order_seed is None else np.random.default_rng(order_seed).permutation(len(lines))
    return _parse_shard(lines, order, reverse, marks, vocab_index, unk)


def _parse_in_loader(source: Source, shard: int, order_seed, reverse: bool, marks, unk: int):
    """In a loader process: ``_read_and_parse``, the int64 arrays sent as int32 (half the bytes
    through the pipe), and the warnings the read gave (to be given again in the parent, where the
    command line formats them)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pair_in, pair_tgt, offsets, oov = _read_and_parse(source, shard, order_seed, reverse, marks, _LOADER_VOCAB, unk)
    sent = [(str(w.message), w.category) for w in caught]
    return (pair_in.astype(np.int32), pair_tgt.astype(np.int32), offsets, oov), sent


class ShardLoader:
    """One process that parses shards ahead for both directions of an ``LMBatcher``, started
    with the first shard it is given ("spawn": forking a process that has imported jax is
    unsafe). Should it fail (it died, the source cannot be pickled), the shards are parsed
    in-line again, as before; a shard that cannot be read fails as it would in-line.
    ``min_words``: a stream has the next shard parsed here once it meets a shard this large."""

    def __init__(self, vocab: Vocabulary, min_words: int = AHEAD_WORDS):
        self.vocab_words, self.min_words = list(vocab.words), min_words
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self.failed = False

    def submit(self, *args) -> concurrent.futures.Future | None:
        if self.failed:
            return None
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                1,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_loader_started,
                initargs=(self.vocab_words,),
            )
        try:
            return self._pool.submit(_parse_in_loader, *args)
        except Exception:  # noqa: BLE001 - a broken pool: parse in-line from now on
            self.failed = True
            return None

    def take(self, future: concurrent.futures.Future):
        """The parsed shard, or None when the loader failed (then parse it in-line)."""
        try:
            (pair_in, pair_tgt, offsets, oov), sent = future.result()
        except DataError:
            raise
        except Exception:  # noqa: BLE001 - the process, not the data: parse in-line (which raises if the data fails)
            self.failed = True
            return None
        for message, category in sent:
            warnings.warn(message, category, stacklevel=4)
        return pair_in.astype(np.int64), pair_tgt.astype(np.int64), offsets, oov

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


class _Stream:
    """One direction's rows.

    A loaded shard is two flat arrays of (input id, target id) pairs, its sentences one after the
    other in this epoch's order, plus their offsets. A row's buffer is a list of
    ``[inputs, targets, start, end]`` slices of such arrays: serving a window copies slices, with
    no per-sentence arrays made.

    ``loader``: once a shard of at least its ``min_words`` words is met (None: never), the one
    after it is read and parsed ahead in the loader's process. A shard parses at about 0.4 s per million
    words on the development CPU, so a 1B Word shard (7.7 M words) takes about 3 s, and a GPU
    trains through it in under 30 s: parsed when needed, it held up every step behind it (14-16 %
    over a 26.5 ms step at 384 rows, against 1 % parsed ahead), and in a thread it held the GIL
    from the threads that feed the device (``benchmarks/bench_train.py --pipeline-only --shards``,
    ``benchmarks/results/cpu/shard_boundaries.txt``). A shard parses to the same pairs
    wherever it is parsed; only its out-of-vocabulary words are numbered here, as met, and no
    batch depends on that numbering (``_spelling_order``).
    """

    def __init__(
        self,
        source: Source,
        shards: list[int],
        table: WordTable,
        rows: int,
        seed: int,
        reverse: bool,
        max_epochs: int | None,
        shuffle: bool = True,
        loader: ShardLoader | None = None,
    ):
        self.source, self.shards, self.table, self.shuffle = source, shards, table, shuffle
        self.rows, self.seed, self.reverse, self.max_epochs = rows, seed, reverse, max_epochs
        self.loader = loader
        self.epoch, self.shard_pos, self.sentence_pos = 0, 0, 0
        self.buffers: list[list[list]] = [[] for _ in range(rows)]
        self._loaded: tuple[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None
        self._ahead: tuple[tuple[int, int], concurrent.futures.Future] | None = None
        self.loaded_ahead = 0  # shards parsed by the loader (a count, for tests and benchmarks)

    # -- the epoch's sequence of sentences ----------------------------------------------------
    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(self.shards)
        rng = np.random.default_rng([self.seed, epoch])
        return [self.shards[i] for i in rng.permutation(len(self.shards))]

    def _encoded_shard(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(inputs, targets, offsets): sentence i's pairs are ``[offsets[i], offsets[i+1])``."""
        key = (self.epoch, self.shard_pos)
        if self._loaded is None or self._loaded[0] != key:
            ahead, self._ahead = self._ahead, None
            parsed = None
            if ahead is not None and ahead[0] == key and self.loader is not None:
                parsed = self.loader.take(ahead[1])
                self.loaded_ahead += parsed is not None
            if parsed is None:
                parsed = self._parse_here(key)
            pair_in, pair_tgt, offsets, oov = parsed
            if oov:
                pair_in[pair_in < 0] = self.table.input_ids(oov)
            self._loaded = (key, (pair_in, pair_tgt, offsets))
            following = self._following(key)
            if following is not None and self.loader is not None and len(pair_in) >= self.loader.min_words:
                future = self.loader.submit(self.source, *self._parse_args(following))
                self._ahead = None if future is None else (following, future)
        return self._loaded[1]

    def _following(self, key: tuple[int, int]) -> tuple[int, int] | None:
        """The (epoch, shard position) after ``key``; None after the last epoch."""
        epoch, pos = (key[0], key[1] + 1) if key[1] + 1 < len(self.shards) else (key[0] + 1, 0)
        return None if self.max_epochs is not None and epoch >= self.max_epochs else (epoch, pos)

    def _parse_args(self, key: tuple[int, int]) -> tuple:
        """(shard, its sentences' order's seed or None, reverse, marks, unk) at (epoch, position)."""
        epoch, pos = key
        shard = self._order(epoch)[pos]
        vocab = self.table.vocab
        marks = (vocab.eos, vocab.bos) if self.reverse else (vocab.bos, vocab.eos)
        return shard, ([self.seed, epoch, shard] if self.shuffle else None), self.reverse, marks, vocab.unk

    def _parse_here(self, key: tuple[int, int]) -> tuple:
        shard, order_seed, reverse, marks, unk = self._parse_args(key)
        return _read_and_parse(self.source, shard, order_seed, reverse, marks, self.table.vocab._index, unk)

    def _next_sentence(self) -> list:
        # Blank shards are allowed beside others with text, and each epoch has its own order: the
        # blank ones can close one epoch and open the next. Text is missing only when a whole
        # epoch, its first shard to its last, passed without a sentence.
        began = self.epoch
        while True:
            if self.max_epochs is not None and self.epoch >= self.max_epochs:
                raise StopIteration
            pair_in, pair_tgt, offsets = self._encoded_shard()
            if self.sentence_pos < len(offsets) - 1:
                i = self.sentence_pos
                self.sentence_pos += 1
                return [pair_in, pair_tgt, int(offsets[i]), int(offsets[i + 1])]
            self.shard_pos, self.sentence_pos = self.shard_pos + 1, 0
            if self.shard_pos == len(self.shards):
                self.epoch, self.shard_pos = self.epoch + 1, 0
                if self.epoch > began + 1:
                    raise no_sentences([self.source.name(s) for s in self.shards])

    def window(self, steps: int) -> tuple[np.ndarray, np.ndarray]:
        """``[rows, steps]`` input ids and target ids; StopIteration after the last epoch.

        Rows are served in order; a row takes the next whole sentence of the stream whenever its
        buffer runs dry. A row that cannot be filled ends the stream (its pairs are not served).
        """
        out_in = np.empty((self.rows, steps), np.int64)
        out_tgt = np.empty((self.rows, steps), np.int64)
        for r, buf in enumerate(self.buffers):
            pos = 0
            while pos < steps:
                if not buf:
                    buf.append(self._next_sentence())
                item = buf[0]
                pair_in, pair_tgt, lo, hi = item
                k = min(hi - lo, steps - pos)
                out_in[r, pos : pos + k] = pair_in[lo : lo + k]
                out_tgt[r, pos : pos + k] = pair_tgt[lo : lo + k]
                pos += k
                if lo + k == hi:
                    buf.pop(0)
                else:
                    item[2] = lo + k
        return out_in, out_tgt

    # -- checkpointing ----------------------------------------------------------------------
    def snapshot(self) -> tuple:
        """The position and the rows' buffered slices as they are now: cheap enough for every
        step (references to the shard's arrays, no copies); ``state(snapshot)`` makes it a dict."""
        return (
            (self.epoch, self.shard_pos, self.sentence_pos),
            [[(a, b, lo, hi) for a, b, lo, hi in buf] for buf in self.buffers],
        )

    def state(self, snapshot: tuple | None = None) -> dict:
        position, buffers = snapshot if snapshot is not None else self.snapshot()
        pairs = [
            np.concatenate([np.stack([a[lo:hi], b[lo:hi]]) for a, b, lo, hi in buf], axis=1)
            if buf
            else np.zeros((2, 0), np.int64)
            for buf in buffers
        ]
        flat = np.concatenate(pairs, axis=1)
        # Buffered OOV words are saved by spelling: their ids are only meaningful in this process.
        oov = np.unique(flat[0][flat[0] >= len(self.table.vocab)]).tolist()
        return {
            "position": np.array(position, np.int64),
            "buffer_lengths": np.array([p.shape[1] for p in pairs], np.int64),
            "buffer_inputs": flat[0],
            "buffer_targets": flat[1],
            "oov_ids": np.array(oov, np.int64),
            "oov_words": np.array([self.table.words[i] for i in oov], dtype=object),
        }

    def restore(self, state: dict) -> None:
        self.epoch, self.shard_pos, self.sentence_pos = (int(x) for x in state["position"])
        lengths = np.asarray(state["buffer_lengths"])
        self._loaded = self._ahead = None
        if len(lengths) != self.rows:  # another row count: keep the position, drop what rows held
            self.buffers = [[] for _ in range(self.rows)]
            return
        saved = np.asarray(state["buffer_inputs"], np.int64)
        inputs = saved.copy()
        new_ids = self.table.input_ids([str(w) for w in state["oov_words"]])
        for old, new in zip(np.asarray(state["oov_ids"]), new_ids):
            inputs[saved == old] = new
        targets = np.asarray(state["buffer_targets"], np.int64)
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        self.buffers = [
            [[inputs, targets, int(lo), int(hi)]] if hi > lo else [] for lo, hi in zip(bounds[:-1], bounds[1:])
        ]


def bucket_size(n: int, minimum: int = 64) -> int:
    """Rounds a distinct-word count up to a few sizes (powers of 2, then multiples of 256),
    so that batches compile to a handful of shapes.

    Every padding row costs a full char-CNN encoding. A 128 x 20 window of natural text has about
    1,500 distinct words: multiples of 1,024 padded it to 2,048 (a quarter of the char CNN's rows
    wasted); multiples of 256 leave it at 1,536 or 1,792, one more program to compile per run.
    """
    size = minimum
    while size < n and size < 1024:
        size *= 2
    return size if size >= n else -(-n // 256) * 256


def _spelling_order(table: WordTable, u: np.ndarray, inv: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique``'s (sorted ids, inverse) with the out-of-vocabulary ids reordered by spelling.

    Those ids are numbered as this process meets the words, so a resumed process numbers them
    otherwise than the unbroken run did. Sorted by id, a batch's char-CNN rows would then come in
    another order, and the float sums of its gradients over them would differ in the last bits:
    resuming would not continue the run exactly."""
    first = int(np.searchsorted(u, len(table.vocab)))
    if len(u) - first < 2:
        return u, inv
    perm = np.concatenate([np.arange(first), first + np.argsort([table.words[i] for i in u[first:]])])
    rank = np.empty_like(perm)
    rank[perm] = np.arange(len(perm))
    return u[perm], rank[inv]


def split_over_devices(table: WordTable, inputs: np.ndarray, targets: np.ndarray, n_devices: int) -> dict:
    """``inputs`` (ids into ``table``), ``targets [2, R, T]`` -> ``chars [D, U, max_chars]``, each
    device's distinct words (``U`` from ``bucket_size``; extra rows are padding, never indexed),
    ``inputs [D, 2, R/D, T]`` (indices into that device's ``chars``) and ``targets [D, 2, R/D, T]``,
    int32; device k takes rows ``[k R/D, (k+1) R/D)``. Each distinct word is encoded once."""
    _, r, t = inputs.shape
    d, b = n_devices, r // n_devices
    inputs = inputs.reshape(2, d, b, t).transpose(1, 0, 2, 3)
    targets = targets.reshape(2, d, b, t).transpose(1, 0, 2, 3)
    uniques, local = [], np.empty(inputs.shape, np.int32)
    for k in range(d):
        u, inv = _spelling_order(table, *np.unique(inputs[k], return_inverse=True))
        uniques.append(u)
        local[k] = inv.reshape(inputs[k].shape)
    chars = np.zeros((d, bucket_size(max(len(u) for u in uniques)), table.max_chars), np.int32)
    for k, u in enumerate(uniques):
        chars[k, : len(u)] = table.char_ids(u)
    return {"chars": chars, "inputs": local, "targets": targets.astype(np.int32)}


class LMBatcher:
    """Training (or evaluation) batches for the devices of this process.

    Each call of ``next()`` returns a dict of numpy arrays with a leading device axis ``[D, ...]``:

    - ``chars [D, U, max_chars] int32``: the distinct input words of that device's batch
      (``U`` from ``bucket_size``; extra rows are padding, never indexed)
    - ``inputs [D, 2, B, T] int32``: indices into ``chars`` (direction 0 forward, 1 backward)
    - ``targets [D, 2, B, T] int32``: vocabulary ids
    - ``rows [D, B] int32``: global row index (for dropout keys that ignore device layout)
    - ``starts [D, 2, B, T] bool``: where a sentence starts (the input is ``<S>``, or ``</S>``
      backward)

    ``rows_per_device`` is bilm-tf's ``batch_size``. ``first_row`` is this process's first global
    row (multi-host: process_index x local devices x rows).

    ``load_ahead_words``: a direction that meets a shard of at least this many words (training
    passes ``AHEAD_WORDS``) has the next one parsed ahead in a loader process while it serves the
    current one (``_Stream``; None, the default: never). The process is started with "spawn",
    which runs the calling script's main module again in it: a script needs the
    ``if __name__ == "__main__":`` guard (notebooks and ``elmo-jax`` have it). ``close()`` stops
    the process; so does dropping the batcher.
    """

    def __init__(
        self,
        source: Source,
        vocab: Vocabulary,
        *,
        rows_per_device: int,
        unroll_steps: int,
        max_chars: int,
        n_devices: int = 1,
        seed: int = 0,
        shards: list[int] | None = None,
        first_row: int = 0,
        max_epochs: int | None = None,
        shuffle: bool = True,
        load_ahead_words: int | None = None,
    ):
        self.table = WordTable(vocab, max_chars)
        self.loader = ShardLoader(vocab, load_ahead_words) if load_ahead_words is not None else None
        if self.loader is not None:
            weakref.finalize(self, self.loader.close)
        self.n_devices, self.rows_per_device, self.steps = n_devices, rows_per_device, unroll_steps
        self.first_row = first_row
        shards = list(range(len(source))) if shards is None else shards
        rows = n_devices * rows_per_device
        self.streams = [
            _Stream(
                source,
                shards,
                self.table,
                rows,
                seed * 2 + d,
                reverse=bool(d),
                max_epochs=max_epochs,
                shuffle=shuffle,
                loader=self.loader,
            )
            for d in range(2)
        ]

    @property
    def epoch(self) -> int:
        return min(s.epoch for s in self.streams)

    def __iter__(self) -> Iterator[dict]:
        while True:
            try:
                yield self.next()
            except StopIteration:
                return

    def window(self) -> tuple[np.ndarray, np.ndarray]:
        """The next window of all rows, before the split over devices: ``inputs [2, R, T]`` (ids
        into ``table``) and ``targets [2, R, T]`` (vocabulary ids); StopIteration at the end."""
        fwd_in, fwd_tgt = self.streams[0].window(self.steps)
        bwd_in, bwd_tgt = self.streams[1].window(self.steps)
        return np.stack([fwd_in, bwd_in]), np.stack([fwd_tgt, bwd_tgt])

    def close(self) -> None:
        """Stops the loader process, if one started (what it was parsing is dropped)."""
        if self.loader is not None:
            self.loader.close()

    def next(self) -> dict:
        inputs, targets = self.window()
        batch = split_over_devices(self.table, inputs, targets, self.n_devices)
        d, b = self.n_devices, self.rows_per_device
        vocab = self.table.vocab
        starts = inputs == np.array([vocab.bos, vocab.eos])[:, None, None]  # each direction's start marker
        return {
            **batch,
            "rows": self.first_row + np.arange(d * b, dtype=np.int32).reshape(d, b),
            "starts": starts.reshape(2, d, b, -1).transpose(1, 0, 2, 3),
        }

    def snapshot(self) -> list:
        """Where the batcher is now, cheaply (~0.1 ms; ``state()`` costs ~2 ms at 128 rows): turn
        it into a checkpointable state with ``state(snapshot)``, even after more batches."""
        return [s.snapshot() for s in self.streams]

    def state(self, snapshot: list | None = None) -> dict:
        """The checkpointable position: now, or at ``snapshot``."""
        snapshot = snapshot if snapshot is not None else [None] * len(self.streams)
        return {f"dir{d}": s.state(snap) for d, (s, snap) in enumerate(zip(self.streams, snapshot))}

    @staticmethod
    def epoch_of(snapshot: list) -> int:
        """``epoch`` as it was at ``snapshot``."""
        return min(position[0] for position, _ in snapshot)

    def restore(self, state: dict) -> None:
        for d, s in enumerate(self.streams):
            s.restore(state[f"dir{d}"])
