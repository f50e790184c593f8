"""Embedding extraction: ELMo layers for many sentences, fast and deterministic.

``Embedder.embed(sentences)`` returns, in input order, one ``[n_layers + 1, n_tokens, 2P]``
float32 array per sentence. By default it is stateless, so a sentence gets the same vectors
whatever else is in the call, up to float32 rounding: the call's rows and steps pick the
compiled program, whose sums may round otherwise. Under it:

- each distinct word of a call is encoded by the char CNN once (``dedup``), in blocks of words of
  similar length, each block over only the char columns it needs (``char_cnn.trim_char_ids``);
- words of an optional token cache skip the char CNN altogether; other words fall back to it;
- sentences are packed end to end into rows (``Packing``: longest first, each into the row
  that is shortest so far), each starting from zero state, and the biLSTM runs over the rows a
  fixed number of steps per call (``elmo_jax.model.layout``: ``extract_steps``), its state carried from
  call to call. A large job thus compiles one biLSTM program, pads only the ends of its rows,
  and takes about ``total steps / rows`` sequential steps (or its longest sentence's), however its
  lengths are spread;
- char-CNN blocks are spread over the local devices, a group of up to n of them stacked into
  ``[n, ...]`` and split over a ``Mesh`` of the devices by ``shard_map``; the packed rows are
  split the same way (the params live replicated on every device).

The call's token vectors go to the device once, as a table padded to a row bucket; each biLSTM
call's steps' vectors are gathered from it on the device, by a small program of its own, so the
table's size never recompiles the biLSTM.

``embed_tokens`` composes the same pure functions for use inside ``jit``. ``stateful=True`` keeps
bilm-tf/AllenNLP's behaviour instead: row i of each call continues from row i's state of the
previous call (no reordering, splitting or device spreading), until ``reset()``.

``embed_texts`` takes raw strings, ``layers`` and ``pool`` pick and pool layers (``select_layers``,
``pool_tokens``: pure functions; stateless, a mix of layers is computed on the device, so the
host receives and keeps only that layer, and so is a pool, so it receives one sum or max per piece
of a sentence that a call runs, ``Packing.pieces``), ``hub_outputs`` gives TF-Hub's ELMo
outputs.

The host's side of packing (the plan, the per-sentence output arrays, the copies into them) is
``elmo_jax.extract.packing``; the hdf5 output files and their reader, ``elmo_jax.extract.to_file``.
"""

from __future__ import annotations

import collections
import functools
import numbers
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from elmo_jax import policy
from elmo_jax._util.arguments import about
from elmo_jax.compat.hdf5 import load_hdf5
from elmo_jax.config import ConfigError, ModelConfig, check_counts
from elmo_jax.extract.packing import (
    Packing,
    batch_rows,
    copy_thread_count,
    copy_threads,
    length_bucket,
    new_outputs,
    pack_sentences,
)
from elmo_jax.model import char_cnn, lstm
from elmo_jax.model.bilm import bilm_from_tokens, check_params, marker_vectors
from elmo_jax.model.compute import Compute
from elmo_jax.model.layout import Layout, for_backend
from elmo_jax.model.vocabulary import PAD_CHAR, check_many, check_tokenized, token_to_ids
from elmo_jax.training.batches import bucket_size

Layers = str | Sequence[float] | np.ndarray  # "all", "top", "average", or one weight per ELMo layer
Tokenizer = Callable[[str], Sequence[str]]

_EMBED_HINT = "use embed_texts() for raw text, or str.split()"


# -- layer choice, pooling, raw text: pure functions, shared by Embedder and the CLI -------------
def check_layers(layers: Layers, n_output_layers: int) -> str | np.ndarray:
    """``layers`` validated: the name, or the weights as ``[n_output_layers] float32``."""
    if isinstance(layers, str):
        if layers not in ("all", "top", "average"):
            raise ValueError(f"layers={layers!r}: expected 'all', 'top', 'average' or {n_output_layers} weights")
        return layers
    weights = np.asarray(layers, np.float32)
    if weights.shape != (n_output_layers,):
        raise ValueError(
            f"layers: expected {n_output_layers} weights (one per ELMo layer), got shape {list(weights.shape)}"
        )
    if not np.isfinite(weights).all():  # one NaN or inf weight makes every vector NaN or inf
        raise ValueError(f"layers: the weights must be finite float32 numbers, got {np.asarray(layers).tolist()}")
    return weights


def select_layers(x: np.ndarray, layers: Layers = "all") -> np.ndarray:
    """One sentence's ``[n_layers + 1, n_tokens, 2P]`` float32 ->

    - ``"all"``: unchanged;
    - ``"top"``: ``[n_tokens, 2P]``, the last layer;
    - ``"average"``: ``[n_tokens, 2P]``, the mean of the layers;
    - weights ``w`` (``n_layers + 1`` floats): ``[n_tokens, 2P]``, ``sum_k w[k] * x[k]``. The
      weights are used as given: not normalised, no softmax, no gamma (``[1/3] * 3`` is
      ``"average"``; for AllenNLP's scalar mix pass ``gamma * softmax(s)``).
    """
    if isinstance(layers, str):
        if layers == "all":
            return x
        return x[-1].copy() if layers == "top" else x.mean(axis=0)  # a view would keep every layer alive
    return np.tensordot(np.asarray(layers, np.float32), x, axes=1)


def mix_weights(layers: str | np.ndarray, n_output_layers: int) -> np.ndarray | None:
    """``check_layers``' result as the weights ``select_layers`` applies (None: ``"all"``)."""
    if isinstance(layers, str):
        if layers == "all":
            return None
        return (
            np.eye(n_output_layers, dtype=np.float32)[-1]
            if layers == "top"
            else np.full(n_output_layers, 1 / n_output_layers, np.float32)
        )
    return layers


def check_pool(pool: str | None) -> None:
    if pool not in (None, "mean", "max"):
        raise ValueError(f"pool={pool!r}: expected None, 'mean' or 'max'")


def pool_tokens(x: np.ndarray, pool: str | None = None) -> np.ndarray:
    """Pools the token axis (the second last) of one sentence: ``[..., n_tokens, D]`` -> ``[..., D]``.

    ``"mean"`` or ``"max"`` over the sentence's tokens (the arrays have no padding); an empty
    sentence gives zeros. ``None``: unchanged.
    """
    check_pool(pool)
    if pool is None:
        return x
    if x.shape[-2] == 0:
        return np.zeros(x.shape[:-2] + x.shape[-1:], x.dtype)
    return x.mean(axis=-2) if pool == "mean" else x.max(axis=-2)


def _warn_empty(n: int) -> None:
    if n:
        warnings.warn(f"{n} empty sentence(s) pooled to zero vectors", stacklevel=3)


def tokenize_texts(texts: Sequence[str], tokenizer: Tokenizer | None = None) -> list[list[str]]:
    """Raw strings, one sentence each -> token lists, by ``tokenizer`` (default
    ``elmo_jax.text.tokenize.tokenize``, the rules of the bundled sample; ``str.split`` splits on spaces)."""
    check_many(texts, "texts", "a list of strings (one sentence each)")
    if tokenizer is None:
        from elmo_jax.text.tokenize import tokenize

        tokenizer = tokenize
    elif not callable(tokenizer):
        raise about(
            TypeError(
                f"tokenizer is a {type(tokenizer).__name__}; expected a function str -> list of tokens (str.split)"
            ),
            "tokenizer",
        )
    out = []
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(
                f"text {i} has type {type(text).__name__}; expected a str (for tokenized sentences use embed())"
            )
        tokens = tokenizer(text)
        if isinstance(tokens, str):
            raise TypeError(f"the tokenizer returned a str for text {i}; it must return a list of tokens")
        out.append(list(tokens))
    return out


def embed_tokens(
    params: dict,
    config: ModelConfig,
    chars: jax.Array,
    token_index: jax.Array,
    lengths: jax.Array,
    *,
    cache: jax.Array | None = None,
    cache_index: jax.Array | None = None,
    state: dict | None = None,
    compute: Compute = Compute(),
) -> tuple[jax.Array, dict]:
    """ELMo layers from a batch's distinct words.

    Args:
      chars: ``[U, C] int32`` char ids of the words to encode with the char CNN.
      token_index: ``[B, T] int32`` each token's row in ``concat(cache[cache_index], cnn(chars))``.
      lengths: ``[B] int32`` tokens per row (left-aligned; the rest is padding).
      cache, cache_index: optional ``[W, P]`` precomputed token vectors and ``[K]`` rows of it
        used by this batch (placed before the CNN-encoded words).
      state: bilm-tf state to continue from, or None (stateless).
      compute: matmul precision, compute dtype and layout (``elmo_jax.model.compute``).

    Returns:
      (``[n_layers + 1, B, T, 2P]`` float32, exactly 0 at padding; the new state).
    """
    vectors = char_cnn.apply(params["char_cnn"], config, chars, compute=compute)
    if cache is not None:
        vectors = jnp.concatenate([cache[cache_index], vectors])
    tokens = vectors[token_index]
    layers, _, new_state = bilm_from_tokens(params, config, tokens, lengths, state, compute=compute)
    return layers, new_state


# -- the device functions of an Embedder (config and compute fixed by functools.partial) ---------
def _encode(p: dict, chars: jax.Array, *, config: ModelConfig, compute: Compute) -> jax.Array:
    return char_cnn.apply(p["char_cnn"], config, chars, compute=compute)


def _contextualize(
    p: dict,
    tokens: jax.Array,
    lengths: jax.Array,
    markers: jax.Array,
    state: dict | None = None,
    active: jax.Array | None = None,
    *,
    config: ModelConfig,
    compute: Compute,
) -> tuple[jax.Array, dict]:
    return bilm_from_tokens(p, config, tokens, lengths, state, compute=compute, markers=markers, active=active)[0::2]


def _gather(table: jax.Array, index: jax.Array) -> jax.Array:
    return table[index]


def _contextualize_packed(
    p: dict,
    x: jax.Array,
    mask: jax.Array,
    starts: jax.Array,
    state: dict,
    *,
    weights: jax.Array | None = None,
    segment: jax.Array | None = None,
    pieces: int = 1,
    pool: str = "mean",
    config: ModelConfig,
    compute: Compute,
) -> tuple[jax.Array, dict]:
    """The biLSTM over packed rows (``Packing``): every layer, or their mix by ``weights``; with
    ``segment``, the sum (``pool="mean"``) or max of each of ``pieces`` sentence pieces."""
    # Both streams restart from zero state at each sentence's first step (its <S>, or its
    # </S> going backward): packed sentences never see each other.
    resets = jnp.broadcast_to(starts, (2,) + starts.shape)
    ys, state = lstm.run(p["lstm"], config, x, mask, state, compute=compute, resets=resets)
    if weights is not None:
        # The layer mix here, not on the host: a third of the bytes cross to it and are kept
        # (layer 0 is each step's token vector, in both streams).
        ys = (weights[0] * x + jnp.tensordot(weights[1:], ys, axes=1))[None]
    if segment is None:
        return ys, state
    if weights is None:
        ys = jnp.concatenate([x[None], ys])  # layer 0 is pooled too
    # Pooled here too: the host receives a sum (or max) per sentence piece, not per token.
    # Sum and max do not depend on order, so the backward stream needs no un-reversing.
    n, r, k = ys.shape[0], ys.shape[2], ys.shape[3]
    steps = jnp.moveaxis(ys.reshape(n, 2, r * k, -1), 2, 0)  # [rows x steps, layers, 2, P]
    op = jax.ops.segment_sum if pool == "mean" else jax.ops.segment_max
    return op(steps, segment.reshape(-1), pieces), state  # [pieces, layers, 2, P]; -1 dropped


_markers_jit = jax.jit(marker_vectors, static_argnums=1, static_argnames="compute")


# Bounded: each entry holds its compiled programs (jax.clear_caches() frees them all).
@functools.lru_cache(maxsize=8)
def _one_device_programs(config: ModelConfig, compute: Compute) -> tuple[Callable, Callable, Callable, Callable]:
    """``(encode, contextualize, packed, gather)``: one device's jitted functions, made once per
    config and precision (a ``jax.jit`` of a new partial is a new cache: it would compile again)."""
    # Separate programs: the char CNN compiles per (block rows, char columns) and the biLSTM
    # per shape, so a job compiles the sum of those shape sets, not their product.
    encode = jax.jit(functools.partial(_encode, config=config, compute=compute))
    contextualize = jax.jit(functools.partial(_contextualize, config=config, compute=compute))
    packed = jax.jit(
        functools.partial(_contextualize_packed, config=config, compute=compute), static_argnames=("pieces", "pool")
    )
    # A call's token vectors are looked up by a program of their own: the table's size (a
    # bucket of the call's word count) then keys the compiles of that small program only, not
    # the biLSTM's, whose shapes depend on the rows and steps alone.
    return encode, contextualize, packed, jax.jit(_gather)


@functools.lru_cache(maxsize=8)
def _mesh_programs(config: ModelConfig, compute: Compute, mesh: Mesh) -> tuple[Callable, Callable, Callable]:
    """``(encode, gather, packed)`` over ``mesh`` (axis ``"data"``), made once per config,
    precision and mesh."""
    rows, state_rows = P(None, "data"), P(None, None, "data")

    def per_device(fn, in_specs):
        # check_vma off (here and for the packed biLSTM below): the functions have no
        # collectives, and a scan whose carry starts from values that do not vary over
        # devices but then does is rejected by the check.
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=P("data"), check_vma=False))

    # Each device sees [1, ...] of the group's inputs: squeezed in, restored out.
    encode = per_device(lambda p, c: _encode(p, c[0], config=config, compute=compute)[None], (P(), P("data")))
    # Packed streams: each device runs its own rows (axis 2 of the state, the row axis of the rest).
    gather = jax.jit(jax.shard_map(_gather, mesh=mesh, in_specs=(P(), rows), out_specs=rows))

    def packed_multi(p, x, mask, starts, state, *, weights=None, segment=None, pieces=1, pool="mean"):
        # Pooled, each device numbers its own pieces: their sums come back one device after another.
        extra = () if segment is None else (segment,)
        out = P(None, None, "data") if segment is None else P("data")

        def fn(p, x, mask, starts, state, weights, *segment):  # shard_map passes positionals only
            return _contextualize_packed(
                p,
                x,
                mask,
                starts,
                state,
                weights=weights,
                segment=segment[0] if segment else None,
                pieces=pieces,
                pool=pool,
                config=config,
                compute=compute,
            )

        return jax.shard_map(
            fn,
            mesh=mesh,
            in_specs=(P(), rows, P("data"), P("data"), state_rows, P()) + (P("data"),) * len(extra),
            out_specs=(out, state_rows),
            check_vma=False,
        )(p, x, mask, starts, state, weights, *extra)

    return encode, gather, jax.jit(packed_multi, static_argnames=("pieces", "pool"))


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


IN_FLIGHT = 2  # biLSTM calls dispatched ahead of the one whose outputs the host copies out
ENCODE_ROWS = 128  # words per char-CNN block: large enough for efficient matmuls, small enough to waste little


class Embedder:
    """Holds a biLM's params and its compiled functions; see the module doc.

    Args:
      batch_tokens: token-steps of one biLSTM call on one device (rows x steps, at least one
        row); default: the backend's ``elmo_jax.model.layout`` entry (``extract_tokens``).
      precision: ``"float32"`` (default: bilm-tf's numbers), ``"tf32"`` (GPUs) or ``"bfloat16"``
        matmuls; outputs are float32 either way (``elmo_jax.policy``).
      token_cache: words whose token vectors are computed once, up front (e.g. a vocabulary).
      dedup: encode each distinct word of a call once (off: every token, like AllenNLP).
      devices: how many local devices to spread char-CNN blocks and packed rows over (default: all).
      stateful: bilm-tf's stateful mode (see module doc).
      layout: ``elmo_jax.model.layout.Layout`` (default: the backend's); a speed choice, never a result.
    """

    def __init__(
        self,
        config: ModelConfig,
        params: dict,
        *,
        batch_tokens: int | None = None,
        precision: str = "float32",
        token_cache: Sequence[str] | None = None,
        dedup: bool = True,
        devices: int | None = None,
        stateful: bool = False,
        layout: Layout | None = None,
    ):
        check_params(params, config, shapes=True)
        self.config = config
        # device_put, not jnp.asarray: that would compile a small program per leaf shape.
        self.params = jax.device_put(params)
        self.layout = layout or for_backend()
        for name, value in (("batch_tokens", batch_tokens), ("devices", devices)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
                # (unchecked: "'<' not supported between 'str' and 'int'"; 64.7 would be taken as 64)
                raise about(TypeError(f"{name} must be an int; got {value!r}"), name)
        if batch_tokens is not None and batch_tokens < 1:
            raise about(ConfigError(f"batch_tokens must be 1 or more; got {batch_tokens}"), "batch_tokens")
        if devices is not None and devices < 1:
            raise about(ConfigError(f"devices must be 1 or more (None: every local device); got {devices}"), "devices")
        if token_cache is not None:  # before the compiles: "The apple" would cache 7 letters
            check_many(token_cache, "token_cache", "a list of words (a vocabulary's, say)")
            token_cache = list(token_cache)
            bad = next((j for j, w in enumerate(token_cache) if not isinstance(w, str)), None)
            if bad is not None:
                w = token_cache[bad]
                raise TypeError(f"token_cache[{bad}] has type {type(w).__name__} ({w!r:.40}); expected str")
        self.batch_tokens = max(1, int(batch_tokens or self.layout.extract_tokens))
        self.policy = policy.check(precision)
        self.compute = Compute.from_policy(self.policy, layout=self.layout)
        self.dedup = dedup
        self.stateful = stateful
        self.state: dict | None = None
        self.max_chars = config.char_cnn.max_characters_per_token
        self._char_cache: dict[str, np.ndarray] = {}
        n_local = jax.local_device_count()
        if devices is not None and devices > n_local:
            warnings.warn(
                f"devices={devices}, but this process has {n_local} local device(s): embedding on {n_local}",
                stacklevel=2,
            )
        self.n_devices = 1 if stateful else min(devices or n_local, n_local)
        self._compile_one_device()
        if self.n_devices > 1:
            self._compile_devices()
        self.cache_words: dict[str, int] = {}
        self.cache: np.ndarray | None = None  # [W, P] float32, row cache_words[w] for word w
        if token_cache is not None:
            self._build_cache(token_cache)

    def _compile_one_device(self) -> None:
        """The jitted device functions of one device, and the marker vectors."""
        # Shared by every Embedder of this config and precision: a second one (a notebook's, a
        # server's) runs the programs the first one compiled.
        self._encode, self._contextualize, self._packed, self._gather = _one_device_programs(self.config, self.compute)
        # The marker vectors are an input of the biLSTM program: encoding them inside it would add
        # the char CNN to each of its compiles.
        self._markers = _markers_jit(self.params, self.config, compute=self.compute)

    def _compile_devices(self) -> None:
        """The same functions over a ``Mesh`` of ``n_devices`` local devices (axis ``"data"``)."""
        mesh = Mesh(np.array(jax.local_devices()[: self.n_devices]), ("data",))
        replicated = NamedSharding(mesh, P())
        # A group of up to n char-CNN blocks is stacked into [n, ...] and split over the mesh's
        # "data" axis, so each device runs the single-device function on its own one.
        self._group_sharding = NamedSharding(mesh, P("data"))
        # The params go to every device once, here, not on every call. The markers are made, so
        # the one-device copy is let go: device 0 would otherwise hold the params twice.
        self.params = jax.device_put(self.params, replicated)
        rows, state_rows = P(None, "data"), P(None, None, "data")
        self._replicated, self._state_sharding = replicated, NamedSharding(mesh, state_rows)
        self._packed_shardings = tuple(NamedSharding(mesh, spec) for spec in (rows,) + (P("data"),) * 3)
        self._encode_multi, self._gather_multi, self._packed_multi = _mesh_programs(self.config, self.compute, mesh)

    @classmethod
    def from_hdf5(cls, options_path: str | os.PathLike, weights_path: str | os.PathLike, **kw) -> Embedder:
        config, params = load_hdf5(options_path, weights_path)
        return cls(config, params, **kw)

    @classmethod
    def from_pretrained(cls, name: str, *, cache_dir=None, sha256: dict | None = None, **kw) -> Embedder:
        """A released model by name (``"small"``, ``"medium"``, ``"original"``, ``"original_5.5b"``,
        ``"pubmed"``): its options and weights are downloaded once into the cache
        (``elmo_jax.pretrained``; ``cache_dir`` and ``sha256`` pins as for ``registry.fetch``),
        then read from there."""
        from elmo_jax.pretrained.registry import load_pretrained

        config, params = load_pretrained(name, cache_dir=cache_dir, sha256=sha256)
        return cls(config, params, **kw)

    @classmethod
    def from_checkpoint(cls, run_dir: str, step: int | None = None, **kw) -> Embedder:
        from elmo_jax.training.run_dir import read_bilm

        options, params, _ = read_bilm(run_dir, step)
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
            chars[: len(order[lo : lo + rows])] = ids[order[lo : lo + rows]]
            blocks.append(char_cnn.trim_char_ids(chars, self.config))
        if self.n_devices == 1:
            results = [self._encode(self.params, b) for b in blocks]  # all dispatched before the first wait
        else:
            groups = []
            for lo in range(0, len(blocks), self.n_devices):
                group = blocks[lo : lo + self.n_devices]
                stacked = jax.device_put(_pad_group(group, self.n_devices, PAD_CHAR + 1), self._group_sharding)
                groups.append((self._encode_multi(self.params, stacked), len(group)))
            # All groups are dispatched before the first wait.
            results = [v for vectors, k in groups for v in np.asarray(vectors)[:k]]
        for lo, vectors in zip(range(0, len(words), rows), results):
            sel = order[lo : lo + rows]
            out[sel] = np.asarray(vectors)[: len(sel)]
        return out

    def _build_cache(self, words: list[str]) -> None:
        words = list(dict.fromkeys(words))
        # In slices, so that the char ids of a large vocabulary never exist all at once.
        self.cache = np.concatenate(
            [self._encode_words(words[lo : lo + 32768]) for lo in range(0, len(words), 32768)]
            or [np.zeros((0, self.config.lstm.projection_dim), np.float32)]
        )
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
            assert self.cache is not None  # cache_words is non-empty only once _build_cache has set it
            table[cached] = self.cache[[self.cache_words[entries[i]] for i in cached]]
        if fresh:
            table[fresh] = self._encode_words([entries[i] for i in fresh])
        return table, rows

    # -- batching --------------------------------------------------------------------------------
    def _packing(self, lengths: Sequence[int]) -> Packing:
        return pack_sentences(lengths, self.n_devices, self.batch_tokens, self.layout.extract_steps)

    @staticmethod
    def _batch(table: np.ndarray, token_rows: list[np.ndarray], rows: int, time: int) -> dict:
        """Token vectors ``[rows, time, P]`` and lengths ``[rows]`` of these sentences (left-aligned)."""
        index = np.zeros((rows, time), np.int64)  # padding looks up row 0; the biLM masks it
        lengths = np.zeros(rows, np.int32)
        for r, ids in enumerate(token_rows):
            index[r, : len(ids)] = ids
            lengths[r] = len(ids)
        return {"tokens": table[index], "lengths": lengths}

    def embed(
        self, sentences: Sequence[Sequence[str]], *, layers: Layers = "all", pool: str | None = None
    ) -> list[np.ndarray]:
        """One float32 array per tokenized sentence, in input order.

        By default ``[n_layers + 1, n_tokens, 2P]``. ``layers`` (``"top"``, ``"average"`` or
        ``n_layers + 1`` weights, see ``select_layers``) makes it ``[n_tokens, 2P]``; ``pool``
        (``"mean"`` or ``"max"`` over the tokens, see ``pool_tokens``) then drops the token axis:
        ``[2P]``, or ``[n_layers + 1, 2P]`` with ``layers="all"``. Empty sentences pool to zeros,
        with one warning per call. A sentence that is a ``str`` raises ``TypeError`` (raw text:
        ``embed_texts``).
        """
        check_many(sentences, "sentences", f"a list of token lists: {_EMBED_HINT}")
        sentences = list(sentences)
        check_tokenized(sentences, _EMBED_HINT)
        sentences = [list(s) for s in sentences]
        chosen = check_layers(layers, self.config.n_output_layers)
        check_pool(pool)
        if not sentences:  # (the pooled path would reshape an empty array of unknown width)
            return []
        if self.stateful:
            out = [select_layers(x, chosen) for x in self._embed_stateful(sentences)]
        else:
            out = self._embed_stateless(sentences, mix_weights(chosen, self.config.n_output_layers), pool)
        if pool is None:
            return out
        _warn_empty(sum(len(s) == 0 for s in sentences))
        return [pool_tokens(x, pool) for x in out] if self.stateful else out

    def embed_texts(
        self,
        texts: Sequence[str],
        *,
        tokenizer: Tokenizer | None = None,
        layers: Layers = "all",
        pool: str | None = None,
    ) -> list[np.ndarray]:
        """``embed`` of raw strings, one sentence each, tokenized by ``tokenizer`` (``str -> list[str]``;
        default ``elmo_jax.text.tokenize.tokenize``). Same outputs and options as ``embed``."""
        return self.embed(tokenize_texts(texts, tokenizer), layers=layers, pool=pool)

    def hub_outputs(
        self,
        inputs: Sequence[str] | Sequence[Sequence[str]],
        *,
        weights: Sequence[float] | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> dict[str, np.ndarray]:
        """The outputs of TF-Hub's ELMo module (``google/elmo``, ``as_dict=True``), for one batch.

        ``inputs``: raw strings, tokenized by ``tokenizer`` (default ``str.split``, as the hub's
        ``default`` signature splits on spaces), or token lists (its ``tokens`` signature). Batch
        arrays are padded with zeros to ``T``, the longest sentence:

        - ``word_emb`` ``[B, T, P]`` float32: the char-CNN token vectors (AllenNLP's layer 0 is
          this twice, side by side);
        - ``lstm_outputs1`` .. ``lstm_outputs{n_layers}`` ``[B, T, 2P]``: each biLSTM layer,
          forward and backward side by side;
        - ``elmo`` ``[B, T, 2P]``: ``sum_k weights[k] * layer_k`` (layer 0 = ``[word_emb, word_emb]``),
          by default equal weights, the hub's aggregation before any training (the weights are
          used as given, see ``select_layers``);
        - ``default`` ``[B, 2P]``: the mean of ``elmo`` over each sentence's tokens (zeros, and
          a warning, for an empty one);
        - ``sequence_len`` ``[B]`` int32.
        """
        check_many(inputs, "inputs", "a list of strings or of token lists (one sentence each)")
        inputs = list(inputs)
        kinds = {isinstance(x, str) for x in inputs}
        if kinds == {True, False}:
            raise TypeError("inputs mixes raw strings and token lists; give one kind")
        # kinds == {True}: every input is a str.
        sentences = tokenize_texts(cast(list[str], inputs), tokenizer or str.split) if kinds == {True} else inputs
        n_out = self.config.n_output_layers
        if isinstance(weights, str):
            raise TypeError(f"weights={weights!r}: expected {n_out} numbers (use embed() for 'top' or 'average')")
        mix = check_layers(np.full(n_out, 1 / n_out) if weights is None else weights, n_out)
        assert isinstance(mix, np.ndarray)  # weights is not a str (checked above), so check_layers gave weights
        out = self.embed(sentences)
        lengths = np.array([x.shape[1] for x in out], np.int32)
        p = self.config.lstm.projection_dim
        padded = np.zeros((n_out, len(out), int(lengths.max(initial=0)), 2 * p), np.float32)
        for b, x in enumerate(out):
            padded[:, b, : x.shape[1]] = x
        elmo = np.tensordot(mix, padded, axes=1)
        _warn_empty(int((lengths == 0).sum()))
        result: dict[str, np.ndarray] = {"word_emb": np.ascontiguousarray(padded[0, :, :, :p])}
        result.update({f"lstm_outputs{k}": padded[k] for k in range(1, n_out)})
        default = elmo.sum(axis=1) / np.maximum(lengths, 1).astype(np.float32)[:, None]  # padding is 0
        result.update(elmo=elmo, default=default, sequence_len=lengths)
        return result

    def _embed_stateless(
        self, sentences: Sequence[Sequence[str]], weights: np.ndarray | None = None, pool: str | None = None
    ) -> list[np.ndarray]:
        """Every layer ``[n_layers + 1, n, 2P]`` per sentence, or with ``weights`` (``mix_weights``)
        their mix ``[n, 2P]``; ``pool`` then drops the token axis. Mixes and pools are computed on
        the device."""
        table, token_rows = self._token_table(sentences)
        pack = self._packing([len(s) for s in sentences])
        layers = 1 if weights is not None else self.config.n_output_layers
        if pool is not None:
            pooled = self._pool_packed(pack, table, token_rows, layers, weights, pool)
            return [x[0].copy() if weights is not None else x.copy() for x in pooled]
        outputs: list[list[np.ndarray]] = []
        block = self.layout.extract_block_mib << 20
        with copy_threads(copy_thread_count(self.layout)) as run:

            def take(c: int, ys: np.ndarray) -> None:
                if not outputs:  # made only now, while the device runs the first calls
                    outputs.append(new_outputs(table, token_rows, layers, run, block))
                pack.scatter(outputs[0], c, ys, run)

            self._run_packed(pack, table, token_rows, take, weights)
            out = outputs[0] if outputs else new_outputs(table, token_rows, layers, run, block)
        return out if weights is None else [x[0] for x in out]

    def _pool_packed(
        self,
        pack: Packing,
        table: np.ndarray,
        token_rows: list[np.ndarray],
        layers: int,
        weights: np.ndarray | None,
        pool: str,
    ) -> np.ndarray:
        """``[sentences, layers, 2P]`` float32: each sentence's mean or max over its tokens, from
        the sums (or maxima) of its pieces that each call computes on the device."""
        segment, owner = pack.pieces(self.n_devices)
        acc = np.full((len(token_rows), layers, 2, table.shape[1]), 0.0 if pool == "mean" else -np.inf, np.float32)

        def take(c: int, pooled: np.ndarray) -> None:
            ids = owner[c]
            ok = ids >= 0
            # A sentence lies in one row, so it has at most one piece a call: no repeated ids.
            if pool == "mean":
                acc[ids[ok]] += pooled[ok]
            else:
                acc[ids[ok]] = np.maximum(acc[ids[ok]], pooled[ok])

        self._run_packed(pack, table, token_rows, take, weights, segment, owner.shape[1] // self.n_devices, pool)
        if pool == "mean":
            acc /= np.maximum(pack.length, 1).astype(np.float32)[:, None, None, None]
        acc[pack.length == 0] = 0.0
        return acc.reshape(len(token_rows), layers, -1)  # forward and backward side by side: 2P

    def _run_packed(
        self,
        pack: Packing,
        table: np.ndarray,
        token_rows: list[np.ndarray],
        take: Callable[[int, np.ndarray], None],
        weights: np.ndarray | None = None,
        segment: np.ndarray | None = None,
        pieces: int = 1,
        pool: str = "mean",
    ) -> None:
        """Runs ``pack``'s calls and hands each call's outputs to ``take(call, array)`` on the host:
        ``[L, 2, rows, steps, P]`` (every biLSTM layer, or the mix of all), or with ``segment``
        (``Packing.pieces``) the sum or max of each piece, ``[n_devices x pieces, L, 2, P]``."""
        if pack.calls == 0:
            return
        p = self.config.lstm.projection_dim
        # The device's table: the call's words, then <S> and </S>, padded to a bucket (a compile
        # of the lookup per bucket, not per word count); the lookup runs on the device, so only
        # indices cross to it per call.
        bos, eos = len(table), len(table) + 1
        device_table = np.zeros((batch_rows(len(table) + 2), p), np.float32)
        device_table[: len(table)], device_table[bos : eos + 1] = table, np.asarray(self._markers)
        index, mask, starts = pack.streams(token_rows, bos, eos)
        state = lstm.zero_state(self.config, pack.rows, on_host=True)
        params = self.params  # on device 0, or on every device (``_compile_devices``)
        if self.n_devices == 1:
            run, lookup, device_table = self._packed, self._gather, jax.device_put(device_table)
            place = lambda *arrays: arrays  # noqa: E731  (jit moves host arrays itself)
        else:
            run, lookup = self._packed_multi, self._gather_multi
            device_table = jax.device_put(device_table, self._replicated)
            state = jax.device_put(state, self._state_sharding)
            place = lambda *arrays: jax.device_put(arrays, self._packed_shardings)  # noqa: E731
        k = pack.steps
        pending: collections.deque = collections.deque()
        for c in range(pack.calls + IN_FLIGHT):
            if c < pack.calls:  # each call carries the state on
                at = slice(c * k, (c + 1) * k)
                ids, *inputs, seg = place(
                    index[:, :, at], mask[:, at], starts[:, at], None if segment is None else segment[:, at]
                )
                ys, state = run(
                    params,
                    lookup(device_table, ids),
                    *inputs,
                    state,
                    weights=weights,
                    segment=seg,
                    pieces=pieces,
                    pool=pool,
                )
                ys.copy_to_host_async()  # its copy to the host starts when it is done, not when asked for
                pending.append((c, ys))
            # The host takes a call's outputs while the device runs the next ones, and holds no
            # more than IN_FLIGHT calls' outputs on the device, however long the job.
            if len(pending) > IN_FLIGHT or (c >= pack.calls and pending):
                done, ys = pending.popleft()
                take(done, np.asarray(ys))

    def _embed_stateful(self, sentences: Sequence[Sequence[str]]) -> list[np.ndarray]:
        rows = len(sentences)
        if rows == 0:
            return []
        # The call's rows are rounded up to a bucket (powers of two, then multiples of 256), so that
        # batch sizes compile a few programs, not one each (a batch of 1 stays 1: a stream of
        # single sentences pays no padding): the rows past the batch's are inactive, and their
        # state (a longer earlier batch's rows, or zeros) passes through unchanged.
        width = bucket_size(rows, 1)
        if self.state is None or self.state["c"].shape[2] < width:
            grown = lstm.zero_state(self.config, width, on_host=True)
            if self.state is not None:
                n = self.state["c"].shape[2]
                for k in grown:
                    grown[k][:, :, :n] = self.state[k]
            self.state = grown
        table, token_rows = self._token_table(sentences)
        b = self._batch(table, token_rows, width, length_bucket(max(len(s) for s in sentences)))
        # A batch smaller than the stored state continues (and updates) only its first rows.
        state = {k: v[:, :, :width] for k, v in self.state.items()}
        active = np.arange(width) < rows
        layers, new_state = self._contextualize(self.params, b["tokens"], b["lengths"], self._markers, state, active)
        for k in self.state:
            self.state[k][:, :, :width] = np.asarray(new_state[k])
        layers = np.asarray(layers)
        return [np.ascontiguousarray(layers[:, r, : len(s)]) for r, s in enumerate(sentences)]

    def reset(self) -> None:
        """Stateful mode: back to zero state for every row."""
        self.state = None

    def embed_stream(
        self, sentences: Iterable[Sequence[str]], window: int = 2048, *, layers: Layers = "all", pool: str | None = None
    ) -> Iterable[tuple[int, np.ndarray]]:
        """``(index, array)`` for an iterable of tokenized sentences, ``window`` at a time (bounded
        memory); ``layers`` and ``pool`` as for ``embed`` (a warning per window with empty sentences).

        The arguments are checked here, not at the first window: a generator's body would wait
        until a window's sentences had been read, and ``window`` 0 never fills one (the whole
        input was held, then embedded at once)."""
        check_counts(1, window=window)
        check_layers(layers, self.config.n_output_layers)
        check_pool(pool)
        return self._stream(sentences, window, layers, pool)

    def _stream(
        self, sentences: Iterable[Sequence[str]], window: int, layers: Layers, pool: str | None
    ) -> Iterator[tuple[int, np.ndarray]]:
        buf: list[Sequence[str]] = []
        base = 0
        for s in sentences:
            buf.append(s)
            if len(buf) == window:
                yield from zip(range(base, base + len(buf)), self.embed(buf, layers=layers, pool=pool))
                base += len(buf)
                buf = []
        if buf:
            yield from zip(range(base, base + len(buf)), self.embed(buf, layers=layers, pool=pool))
