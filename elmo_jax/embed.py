"""Embedding extraction: ELMo layers for many sentences, fast and deterministic.

``Embedder.embed(sentences)`` returns, in input order, one ``[n_layers + 1, n_tokens, 2P]``
float32 array per sentence. By default it is stateless, so a sentence gets the same vectors
whatever else is in the call. Under it:

- each distinct word of a call is encoded by the char CNN once (``dedup``), in blocks of words of
  similar length, each block over only the char columns it needs (``char_cnn.trim_char_ids``);
- words of an optional token cache skip the char CNN altogether; other words fall back to it;
- sentences are sorted by length and cut into batches by a token budget, the time axis padded to
  a few bucket lengths (little padding, few compiles); the biLSTM runs per batch;
- blocks and batches are spread over the local devices, one per device, several at a time: a
  group of up to n of them is stacked into ``[n, ...]``, split over a ``Mesh`` of the devices
  and run by ``shard_map`` (the params live replicated on every device).

A batch's token vectors are looked up on the host, between the two device programs: as a device
program the lookup compiled once per (words, rows, time) shape, more programs than the other two
together, for a copy of a few MB.

``embed_tokens`` composes the same pure functions for use inside ``jit``. ``stateful=True`` keeps
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
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

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


def _pad_group(arrays: list[np.ndarray], n: int, fill=0) -> np.ndarray:
    """Stacks up to ``n`` arrays of one rank into ``[n, ...]``, padding every axis to the largest.

    For char ids ``fill`` is in-token padding (``PAD_CHAR + 1``), which is how a trimmed char
    axis continues, so a word's vector does not change.
    """
    shape = tuple(max(a.shape[i] for a in arrays) for i in range(arrays[0].ndim))
    out = np.full((n,) + shape, fill, arrays[0].dtype)
    for k, a in enumerate(arrays):
        out[(k,) + tuple(slice(0, d) for d in a.shape)] = a
    return out


ENCODE_ROWS = 128  # words per char-CNN block: large enough for efficient matmuls, small enough to waste little


class Embedder:
    """Holds a biLM's params and its compiled functions; see the module doc.

    Args:
      batch_tokens: the token budget of one batch (rows x padded length).
      dtype: ``"float32"`` or ``"bfloat16"`` matmuls (outputs are float32 either way).
      token_cache: words whose token vectors are computed once, up front (e.g. a vocabulary).
      dedup: encode each distinct word of a call once (off: every token, like AllenNLP).
      devices: how many local devices to spread blocks and batches over (default: all).
      stateful: bilm-tf's stateful mode (see module doc).
    """

    def __init__(self, config: ModelConfig, params: dict, *, batch_tokens: int = 4096, dtype: str = "float32",
                 precision: Precision = "highest", token_cache: Sequence[str] | None = None, dedup: bool = True,
                 devices: int | None = None, stateful: bool = False):
        self.config = config
        # device_put, not jnp.asarray: that would compile a small program per leaf shape.
        self.params = jax.device_put(params)
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

        def encode(p, chars):
            return char_cnn.apply(p["char_cnn"], config, chars, precision, self.dtype)

        def contextualize(p, tokens, lengths, markers, state=None):
            return bilm_from_tokens(p, config, tokens, lengths, state, False, precision, self.dtype, markers)[0::2]

        # Two programs, not one: the char CNN compiles per (block rows, char columns) and the
        # biLSTM per (rows, time), so a job compiles the sum of those shape sets, not their product.
        self._encode, self._contextualize = jax.jit(encode), jax.jit(contextualize)
        # The marker vectors are an input of the biLSTM program: encoding them inside it would add
        # the char CNN to each of its compiles.
        self._markers = jax.jit(marker_vectors, static_argnums=(1, 2, 3))(self.params, config, precision, self.dtype)
        if self.n_devices > 1:
            # A group of up to n blocks (or batches) is stacked into [n, ...] and split over the
            # mesh's "data" axis, so each device runs the single-device function on its own one.
            mesh = Mesh(np.array(jax.local_devices()[:self.n_devices]), ("data",))
            replicated = NamedSharding(mesh, P())
            self._group_sharding = NamedSharding(mesh, P("data"))
            # The params (and marker vectors) go to every device once, here, not on every call.
            self._params_multi = jax.device_put(self.params, replicated)
            self._markers_multi = jax.device_put(self._markers, replicated)

            def per_device(fn, in_specs):
                # check_vma off: the functions have no collectives, and the LSTM's scan starts from a
                # zero state that does not vary over devices while its carry does, which the check rejects.
                return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=P("data"), check_vma=False))

            # Each device sees [1, ...] of the group's inputs: squeezed in, restored out.
            self._encode_multi = per_device(lambda p, c: encode(p, c[0])[None], (P(), P("data")))
            self._contextualize_multi = per_device(lambda p, t, l, m: contextualize(p, t[0], l[0], m)[0][None],
                                                   (P(), P("data"), P("data"), P()))
        self.cache_words: dict[str, int] = {}
        self.cache: np.ndarray | None = None  # [W, P] float32, row cache_words[w] for word w
        if token_cache is not None:
            self._build_cache(list(token_cache))

    @classmethod
    def from_hdf5(cls, options_path: str | os.PathLike, weights_path: str | os.PathLike, **kw) -> "Embedder":
        config, params = load_hdf5(options_path, weights_path)
        return cls(config, params, **kw)

    @classmethod
    def from_checkpoint(cls, run_dir: str, step: int | None = None, **kw) -> "Embedder":
        from elmo_jax.export import load_run

        options, _, params, _ = load_run(run_dir, step)
        return cls(options.model, params["bilm"], **kw)

    # -- token vectors ---------------------------------------------------------------------------
    def _chars(self, word: str) -> np.ndarray:
        ids = self._char_cache.get(word)
        if ids is None:
            if len(self._char_cache) >= 200_000:  # bounded: a long stream of new words must not grow memory
                self._char_cache.clear()
            ids = self._char_cache[word] = token_to_ids(word, self.max_chars)
        return ids

    def _encode_words(self, words: Sequence[str]) -> np.ndarray:
        """``[len(words), P]`` float32 token vectors from the char CNN.

        Words are sorted by length into blocks of ``ENCODE_ROWS`` (fewer for a short list, a
        power of 2), so each block's char axis is trimmed to what its longest word needs.
        """
        out = np.zeros((len(words), self.config.lstm.projection_dim), np.float32)
        if not words:
            return out
        ids = np.stack([self._chars(w) for w in words])
        order = np.argsort((ids != PAD_CHAR + 1).sum(axis=1), kind="stable")
        rows = ENCODE_ROWS if len(words) > ENCODE_ROWS else bucket_size(len(words), 8)
        blocks = []
        for lo in range(0, len(words), rows):
            chars = np.zeros((rows, self.max_chars), np.int32)
            chars[:len(order[lo:lo + rows])] = ids[order[lo:lo + rows]]
            blocks.append(char_cnn.trim_char_ids(chars, self.config))
        if self.n_devices == 1:
            results = [self._encode(self.params, b) for b in blocks]  # all dispatched before the first wait
        else:
            groups = []
            for lo in range(0, len(blocks), self.n_devices):
                group = blocks[lo:lo + self.n_devices]
                stacked = jax.device_put(_pad_group(group, self.n_devices, PAD_CHAR + 1), self._group_sharding)
                groups.append((self._encode_multi(self._params_multi, stacked), len(group)))
            # All groups are dispatched before the first wait.
            results = [v for vectors, k in groups for v in np.asarray(vectors)[:k]]
        for lo, vectors in zip(range(0, len(words), rows), results):
            sel = order[lo:lo + rows]
            out[sel] = np.asarray(vectors)[:len(sel)]
        return out

    def _build_cache(self, words: list[str]) -> None:
        words = list(dict.fromkeys(words))
        # In slices, so that the char ids of a large vocabulary never exist all at once.
        self.cache = np.concatenate([self._encode_words(words[lo:lo + 32768]) for lo in range(0, len(words), 32768)]
                                    or [np.zeros((0, self.config.lstm.projection_dim), np.float32)])
        self.cache_words = {w: i for i, w in enumerate(words)}

    def _token_table(self, sentences: Sequence[Sequence[str]]) -> tuple[np.ndarray, list[np.ndarray]]:
        """The call's token vectors ``[n, P]`` and, per sentence, its tokens' rows in them.

        With ``dedup`` a row per distinct word, else a row per token; cached words come from the
        cache, the rest from the char CNN.
        """
        slot: dict[str, int] = {}
        entries: list[str] = []
        rows = []
        for s in sentences:
            if self.dedup:
                rows.append(np.array([slot.setdefault(w, len(slot)) for w in s], np.int64))
            else:
                rows.append(np.arange(len(entries), len(entries) + len(s)))
                entries.extend(s)
        if self.dedup:
            entries = list(slot)
        table = np.zeros((max(len(entries), 1), self.config.lstm.projection_dim), np.float32)
        cached = [i for i, w in enumerate(entries) if w in self.cache_words]
        fresh = [i for i, w in enumerate(entries) if w not in self.cache_words]
        if cached:
            table[cached] = self.cache[[self.cache_words[entries[i]] for i in cached]]
        if fresh:
            table[fresh] = self._encode_words([entries[i] for i in fresh])
        return table, rows

    # -- batching --------------------------------------------------------------------------------
    def _plan(self, lengths: Sequence[int]) -> list[tuple[list[int], int, int]]:
        """``(sentence indices, rows, time)`` per batch, sentences sorted by length.

        Each batch takes as many sentences as the largest row bucket that keeps
        ``rows x (time + 2)`` (the LSTM's steps) within the token budget, so only a batch cut
        short (the last, or one whose time bucket grew) has padding rows (rounding each batch's
        count up to a power of 2 instead made padding a large share of the LSTM's work).
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

    @staticmethod
    def _batch(table: np.ndarray, token_rows: list[np.ndarray], rows: int, time: int) -> dict:
        """Token vectors ``[rows, time, P]`` and lengths ``[rows]`` of these sentences (left-aligned)."""
        index = np.zeros((rows, time), np.int64)  # padding looks up row 0; the biLM masks it
        lengths = np.zeros(rows, np.int32)
        for r, ids in enumerate(token_rows):
            index[r, :len(ids)] = ids
            lengths[r] = len(ids)
        return {"tokens": table[index], "lengths": lengths}

    def _run(self, batches: list[dict]) -> list[np.ndarray]:
        if len(batches) == 1 or self.n_devices == 1:
            out = [self._contextualize(self.params, b["tokens"], b["lengths"], self._markers)[0] for b in batches]
            return [np.asarray(x) for x in out]
        # One program for the group needs one shape: pad every batch of the group to the largest.
        stacked = jax.device_put({k: _pad_group([b[k] for b in batches], self.n_devices) for k in batches[0]},
                                 self._group_sharding)
        layers = np.asarray(self._contextualize_multi(self._params_multi, stacked["tokens"], stacked["lengths"],
                                                      self._markers_multi))
        return [layers[i] for i in range(len(batches))]

    def embed(self, sentences: Sequence[Sequence[str]]) -> list[np.ndarray]:
        """``[n_layers + 1, len(sentence), 2P]`` float32 per sentence, in input order."""
        sentences = [list(s) for s in sentences]
        if self.stateful:
            return self._embed_stateful(sentences)
        table, token_rows = self._token_table(sentences)
        out: list[np.ndarray | None] = [None] * len(sentences)
        plan = self._plan([len(s) for s in sentences])
        for lo in range(0, len(plan), self.n_devices):
            group = plan[lo:lo + self.n_devices]
            batches = [self._batch(table, [token_rows[i] for i in ids], rows, time) for ids, rows, time in group]
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
        table, token_rows = self._token_table(sentences)
        b = self._batch(table, token_rows, rows, _length_bucket(max(len(s) for s in sentences)))
        # A batch smaller than the stored state continues (and updates) only its first rows.
        state = {k: v[:, :, :rows] for k, v in self.state.items()}
        layers, new_state = self._contextualize(self.params, b["tokens"], b["lengths"], self._markers, state)
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
