"""Embedding extraction: ELMo layers for many sentences, fast and deterministic.

``Embedder.embed(sentences)`` returns, in input order, one ``[n_layers + 1, n_tokens, 2P]``
float32 array per sentence. By default it is stateless, so a sentence gets the same vectors
whatever else is in the call. Under it:

- sentences are sorted by length and cut into batches by a token budget, the time axis padded to
  a few bucket lengths (little padding, few compiles);
- each distinct word of a batch is encoded by the char CNN once (``dedup``), over only the char
  columns it needs (``char_cnn.trim_char_ids``);
- words of an optional token cache skip the char CNN altogether; other words fall back to it;
- batches are spread over the local devices (``jax.pmap``), several at a time.

``embed_tokens`` is the pure function under it, for use inside ``jit``. ``stateful=True`` keeps
bilm-tf/AllenNLP's behaviour instead: row i of each call continues from row i's state of the
previous call (no reordering, splitting or device spreading), until ``reset()``.
"""

from __future__ import annotations

import math
import os
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from elmo_jax import char_cnn
from elmo_jax.bilm import bilm_from_tokens, marker_vectors
from elmo_jax.chars import PAD_CHAR, token_to_ids
from elmo_jax.config import ModelConfig
from elmo_jax.data import bucket_size
from elmo_jax.weights import load_hdf5

Precision = jax.lax.Precision | str | None


def embed_tokens(params: dict, config: ModelConfig, chars: jax.Array, token_index: jax.Array, lengths: jax.Array,
                 cache: jax.Array | None = None, cache_index: jax.Array | None = None, state: dict | None = None,
                 precision: Precision = "highest", dtype=jnp.float32) -> tuple[jax.Array, dict]:
    """ELMo layers from a batch's distinct words.

    Args:
      chars: ``[U, C] int32`` char ids of the words to encode with the char CNN.
      token_index: ``[B, T] int32`` each token's row in ``concat(cache[cache_index], cnn(chars))``.
      lengths: ``[B] int32`` tokens per row (left-aligned; the rest is padding).
      cache, cache_index: optional ``[W, P]`` precomputed token vectors and ``[K]`` rows of it
        used by this batch (placed before the CNN-encoded words).
      state: bilm-tf state to continue from, or None (stateless).

    Returns:
      (``[n_layers + 1, B, T, 2P]`` float32, exactly 0 at padding; the new state).
    """
    vectors = char_cnn.apply(params["char_cnn"], config, chars, precision, dtype)
    if cache is not None:
        vectors = jnp.concatenate([cache[cache_index], vectors])
    tokens = vectors[token_index]
    layers, _, new_state = bilm_from_tokens(params, config, tokens, lengths, state, False, precision, dtype)
    return layers, new_state


def _length_bucket(n: int) -> int:
    """The padded time axis for sentences of up to ``n`` tokens (markers not counted).

    The biLSTM runs ``time + 2`` steps (``<S>``, ``</S>``), so it is that count that is
    rounded: to multiples of 4 up to 32, of 8 up to 64, then steps of about 1.25x. Every padded
    step is a full step of the sequential LSTM, so short sentences get fine buckets.
    """
    steps = n + 2
    if steps <= 32:
        steps = max(4, -(-steps // 4) * 4)
    elif steps <= 64:
        steps = -(-steps // 8) * 8
    else:
        steps = int(64 * 1.25 ** math.ceil(math.log(steps / 64, 1.25)) // 8 * 8 + 8)
    return steps - 2


def _rows_bucket(n: int) -> int:
    """Word-row buckets: powers of 2 to 256, then steps of about 1.125x (multiples of 64).

    The char CNN encodes every row, padding included, so waste stays under 12.5 %."""
    if n <= 256:
        return bucket_size(n, 8)
    size = 256
    while size < n:
        size = -(-int(size * 1.125) // 64) * 64
    return size


def _batch_rows(n: int) -> int:
    """Sentence rows of a batch: 1, 2, 4, 8, then powers of 2 and 1.5x powers of 2 (12, 16, 24, ...)."""
    if n <= 8:
        return 1 << max(n - 1, 0).bit_length()
    p = 1 << (n - 1).bit_length()
    return 3 * p // 4 if 3 * p // 4 >= n else p


def _rows_within(n: int) -> int:
    """The largest ``_batch_rows`` value not above ``n`` (at least 1)."""
    if n < 12:
        return 1 << max(n.bit_length() - 1, 0)
    p = 1 << (n.bit_length() - 1)
    return 3 * p // 2 if 3 * p // 2 <= n else p


class Embedder:
    """Holds a biLM's params and its compiled functions; see the module doc.

    Args:
      batch_tokens: the token budget of one batch (rows x padded length).
      dtype: ``"float32"`` or ``"bfloat16"`` matmuls (outputs are float32 either way).
      token_cache: words whose token vectors are computed once, up front (e.g. a vocabulary).
      dedup: encode each distinct word of a batch once (off: every token, like AllenNLP).
      devices: how many local devices to spread batches over (default: all).
      stateful: bilm-tf's stateful mode (see module doc).
    """

    def __init__(self, config: ModelConfig, params: dict, *, batch_tokens: int = 4096, dtype: str = "float32",
                 precision: Precision = "highest", token_cache: Sequence[str] | None = None, dedup: bool = True,
                 devices: int | None = None, stateful: bool = False):
        self.config = config
        self.params = jax.tree_util.tree_map(jnp.asarray, params)
        self.batch_tokens = max(1, int(batch_tokens))
        self.dtype = jnp.bfloat16 if dtype == "bfloat16" else jnp.float32
        self.precision = precision
        self.dedup = dedup
        self.stateful = stateful
        self.state: dict | None = None
        self.max_chars = config.char_cnn.max_characters_per_token
        self._char_cache: dict[str, np.ndarray] = {}
        n_local = jax.local_device_count()
        self.n_devices = 1 if stateful else min(devices or n_local, n_local)
        def fn(p, chars, index, lengths, cache, cache_index, state=None):
            return embed_tokens(p, config, chars, index, lengths, cache, cache_index, state, precision, self.dtype)

        # On one device embed_tokens runs as three programs, not one: the char CNN compiles per
        # (distinct words, char columns) and the biLSTM per (rows, time), so a long job compiles
        # the sum of those shape sets instead of their product (each compile costs seconds; the
        # whole-job figure of experiments/bench_embed.py, cold, went from 1,018 to about 1,270 tokens/s).
        def encode(p, chars):
            return char_cnn.apply(p["char_cnn"], config, chars, precision, self.dtype)

        def gather(vectors, index, cache, cache_index):
            return jnp.concatenate([cache[cache_index], vectors])[index]

        def contextualize(p, tokens, lengths, state):
            # The marker vectors come in as an input: encoding them inside would add the char
            # CNN to every (rows, time) compile of this program, about a third of its compile time.
            return bilm_from_tokens(p, config, tokens, lengths, state, False, precision, self.dtype,
                                    self._markers)[0::2]

        self._encode, self._gather = jax.jit(encode), jax.jit(gather)
        self._markers = jax.jit(marker_vectors, static_argnums=(1, 2, 3))(self.params, config, precision, self.dtype)
        self._contextualize = jax.jit(contextualize)
        self._multi = jax.pmap(lambda *a: fn(*a)[0], in_axes=(None, 0, 0, 0, None, 0),
                               devices=jax.local_devices()[:self.n_devices]) if self.n_devices > 1 else None
        self.cache_words: dict[str, int] = {}
        self.cache: jax.Array | None = None
        if token_cache is not None:
            self._build_cache(list(token_cache))

    @classmethod
    def from_hdf5(cls, options_path: str | os.PathLike, weights_path: str | os.PathLike, **kw) -> "Embedder":
        config, params = load_hdf5(options_path, weights_path)
        return cls(config, params, **kw)

    @classmethod
    def from_checkpoint(cls, run_dir: str, step: int | None = None, **kw) -> "Embedder":
        from elmo_jax.checkpoint import load_run

        options, _, params, _ = load_run(run_dir, step)
        return cls(options.model, params["bilm"], **kw)

    def _single(self, p, chars, index, lengths, cache, cache_index, state=None):
        """``embed_tokens`` on the default device, as the three programs above."""
        tokens = self._gather(self._encode(p, chars), index, cache, cache_index)
        return self._contextualize(p, tokens, lengths, state)

    # -- token vectors ---------------------------------------------------------------------------
    def _chars(self, word: str) -> np.ndarray:
        ids = self._char_cache.get(word)
        if ids is None:
            if len(self._char_cache) >= 200_000:  # bounded: a long stream of new words must not grow memory
                self._char_cache.clear()
            ids = self._char_cache[word] = token_to_ids(word, self.max_chars)
        return ids

    def _build_cache(self, words: list[str]) -> None:
        words = list(dict.fromkeys(words))
        vectors = []
        for lo in range(0, len(words), 4096):
            chunk = words[lo:lo + 4096]
            ids = np.stack([self._chars(w) for w in chunk])
            ids = np.pad(ids, ((0, bucket_size(len(chunk)) - len(chunk)), (0, 0)))
            vectors.append(np.asarray(self._encode(self.params, jnp.asarray(ids)))[:len(chunk)])
        self.cache = jnp.asarray(np.concatenate(vectors)) if vectors else None
        self.cache_words = {w: i for i, w in enumerate(words)}

    # -- batching --------------------------------------------------------------------------------
    def _plan(self, lengths: Sequence[int]) -> list[tuple[list[int], int, int]]:
        """``(sentence indices, rows, time)`` per batch, sentences sorted by length.

        Each batch takes as many sentences as the largest row bucket that keeps
        ``rows x (time + 2)`` (the LSTM's steps) within the token budget, so only a batch cut
        short (the last, or one whose time bucket grew) has padding rows; with power-of-2 rows
        filled up to the budget, a third of a typical job's LSTM work was padding.
        """
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        batches, current, time = [], [], 0
        for i in order:
            t = max(time, _length_bucket(lengths[i]))
            if current and len(current) + 1 > _rows_within(self.batch_tokens // (t + 2)):
                batches.append((current, time))
                current, t = [], _length_bucket(lengths[i])
            current.append(i)
            time = t
        if current:
            batches.append((current, time))
        return [(ids, _batch_rows(len(ids)), time) for ids, time in batches]

    def _host_batch(self, sentences: Sequence[Sequence[str]], rows: int, time: int) -> dict:
        """Numpy inputs of ``embed_tokens`` for these sentences, padded to ``rows x time``."""
        index = np.zeros((rows, time), np.int64)
        lengths = np.zeros(rows, np.int32)
        entries: list[str] = []  # one per vector to produce: distinct words, or every token
        slot: dict[str, int] = {}
        for r, s in enumerate(sentences):
            lengths[r] = len(s)
            for t, w in enumerate(s):
                if self.dedup:
                    index[r, t] = slot.setdefault(w, len(slot))
                else:
                    index[r, t] = len(entries)
                    entries.append(w)
        if self.dedup:
            entries = list(slot)
        cached = [i for i, w in enumerate(entries) if w in self.cache_words]
        fresh = [i for i, w in enumerate(entries) if w not in self.cache_words] if cached else list(range(len(entries)))
        # Rows of concat(cache[cache_index], cnn(chars)): cached first, each part padded to a bucket.
        k = _rows_bucket(len(cached)) if self.cache is not None else 0
        u = _rows_bucket(len(fresh))
        remap = np.zeros(max(len(entries), 1), np.int64)
        remap[cached] = np.arange(len(cached))
        remap[fresh] = k + np.arange(len(fresh))
        index = np.where(np.arange(time)[None, :] < lengths[:, None], remap[index], 0).astype(np.int32)
        chars = np.zeros((u, self.max_chars), np.int32)
        if fresh:
            chars[:len(fresh)] = np.stack([self._chars(entries[i]) for i in fresh])
        chars = char_cnn.trim_char_ids(chars, self.config)
        cache_index = np.zeros(k, np.int32)
        cache_index[:len(cached)] = [self.cache_words[entries[i]] for i in cached]
        return {"chars": chars, "index": index, "lengths": lengths, "cache_index": cache_index}

    def _run(self, group: list[dict]) -> list[np.ndarray]:
        cache = self.cache if self.cache is not None else jnp.zeros((1, self.config.lstm.projection_dim))
        if len(group) == 1 or self._multi is None:
            out = []
            for b in group:
                layers, _ = self._single(self.params, b["chars"], b["index"], b["lengths"], cache, b["cache_index"])
                out.append(layers)
            return [np.asarray(x) for x in out]
        # pmap needs one shape: pad every batch of the group to the largest.
        shape = {k: tuple(max(b[k].shape[i] for b in group) for i in range(group[0][k].ndim)) for k in group[0]}
        def pad(b, k):
            widths = [(0, s - d) for s, d in zip(shape[k], b[k].shape)]
            if k == "chars":  # extra char columns are in-token padding (a trimmed prefix stays one)
                b = np.pad(b[k], [(0, 0), widths[1]], constant_values=PAD_CHAR + 1)
                return np.pad(b, [widths[0], (0, 0)])
            return np.pad(b[k], widths)
        stacked = {k: np.stack([pad(b, k) for b in group]) for k in group[0]}
        layers = self._multi(self.params, stacked["chars"], stacked["index"], stacked["lengths"], cache,
                             stacked["cache_index"])
        layers = np.asarray(layers)
        return [layers[i] for i in range(len(group))]

    def embed(self, sentences: Sequence[Sequence[str]]) -> list[np.ndarray]:
        """``[n_layers + 1, len(sentence), 2P]`` float32 per sentence, in input order."""
        sentences = [list(s) for s in sentences]
        if self.stateful:
            return self._embed_stateful(sentences)
        out: list[np.ndarray | None] = [None] * len(sentences)
        plan = self._plan([len(s) for s in sentences])
        for lo in range(0, len(plan), self.n_devices):
            group = plan[lo:lo + self.n_devices]
            batches = [self._host_batch([sentences[i] for i in ids], rows, time) for ids, rows, time in group]
            for (ids, _, _), layers in zip(group, self._run(batches)):
                for r, i in enumerate(ids):
                    out[i] = np.ascontiguousarray(layers[:, r, :len(sentences[i])])
        return out  # type: ignore[return-value]

    def _embed_stateful(self, sentences: list[list[str]]) -> list[np.ndarray]:
        rows = len(sentences)
        if rows == 0:
            return []
        l = self.config.lstm
        if self.state is None or self.state["c"].shape[2] < rows:
            grown = {"c": np.zeros((2, l.n_layers, rows, l.dim), np.float32),
                     "h": np.zeros((2, l.n_layers, rows, l.projection_dim), np.float32)}
            if self.state is not None:
                n = self.state["c"].shape[2]
                for k in grown:
                    grown[k][:, :, :n] = self.state[k]
            self.state = grown
        time = _length_bucket(max([len(s) for s in sentences] + [1]))
        b = self._host_batch(sentences, rows, time)
        cache = self.cache if self.cache is not None else jnp.zeros((1, l.projection_dim))
        # A batch smaller than the stored state continues (and updates) only its first rows.
        state = {k: jnp.asarray(v[:, :, :rows]) for k, v in self.state.items()}
        layers, new_state = self._single(self.params, b["chars"], b["index"], b["lengths"], cache, b["cache_index"],
                                         state=state)
        for k in self.state:
            self.state[k][:, :, :rows] = np.asarray(new_state[k])
        layers = np.asarray(layers)
        return [np.ascontiguousarray(layers[:, r, :len(s)]) for r, s in enumerate(sentences)]

    def reset(self) -> None:
        """Stateful mode: back to zero state for every row."""
        self.state = None

    def embed_stream(self, sentences: Iterable[Sequence[str]], window: int = 2048
                     ) -> Iterable[tuple[int, np.ndarray]]:
        """``(index, layers)`` for an iterable of sentences, ``window`` at a time (bounded memory)."""
        buf: list[Sequence[str]] = []
        base = 0
        for s in sentences:
            buf.append(s)
            if len(buf) == window:
                yield from zip(range(base, base + len(buf)), self.embed(buf))
                base += len(buf)
                buf = []
        if buf:
            yield from zip(range(base, base + len(buf)), self.embed(buf))
