"""The biLM forward pass: token encoder, sentence markers, biLSTM, ELMo layers.

Params: ``{"char_cnn": char_cnn params, "lstm": lstm params}`` (see those modules); the
softmax lives with the training state, not here.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from elmo_jax.config import ModelConfig
from elmo_jax.model import char_cnn, lstm
from elmo_jax.model.compute import Compute
from elmo_jax.model.vocabulary import sentence_markers


def init(key: jax.Array, config: ModelConfig) -> dict:
    """Fresh biLM params from ``key``, a PRNG key (``jax.random.key(0)`` or
    ``jax.random.PRNGKey(0)``); a ``TypeError`` (one line) for arguments that are not those."""
    if not isinstance(config, ModelConfig):
        swapped = " (the arguments are key, then config)" if isinstance(key, ModelConfig) else ""
        raise TypeError(f"config is a {type(config).__name__}; expected a ModelConfig{swapped}")
    dtype, shape = getattr(key, "dtype", None), getattr(key, "shape", None)
    typed = dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) and shape == ()
    # A raw key is uint32 key data: [2] for threefry, [4] for rbg (jax_default_prng_impl).
    raw = dtype == jnp.uint32 and shape is not None and len(shape) == 1
    if not (typed or raw):
        raise TypeError(f"key is {_described(key)}; expected one PRNG key: jax.random.key(0) or jax.random.PRNGKey(0)")
    return _init(key, config)


def _described(value) -> str:
    shape = getattr(value, "shape", None)
    if shape is not None:
        return f"an array of shape {tuple(shape)} and dtype {value.dtype}"
    return f"a {type(value).__name__} ({value!r:.40})"


@functools.partial(jax.jit, static_argnames="config")
def _init(key: jax.Array, config: ModelConfig) -> dict:
    # Jitted: run eagerly, the weights' ~30 slices and scalings would each compile a program.
    k1, k2 = jax.random.split(key)
    return {"char_cnn": char_cnn.init(k1, config), "lstm": lstm.init(k2, config)}


def marker_vectors(params: dict, config: ModelConfig, *, compute: Compute = Compute()) -> jax.Array:
    """``[2, P]`` float32: the token vectors of ``<S>`` and ``</S>``."""
    bos_ids, eos_ids = sentence_markers(config.char_cnn.max_characters_per_token)
    return char_cnn.apply(params["char_cnn"], config, jnp.stack([bos_ids, eos_ids]), compute=compute)


def add_sentence_markers(
    params: dict,
    config: ModelConfig,
    tokens: jax.Array,
    lengths: jax.Array,
    *,
    compute: Compute = Compute(),
    markers: jax.Array | None = None,
) -> jax.Array:
    """``[B, T, P]`` token vectors and ``lengths [B]`` int32 -> ``[B, T+2, P]``: ``<S>`` at 0,
    ``</S>`` right after each row's tokens.

    The two marker vectors are encoded once, not once per row; ``markers`` (``marker_vectors``)
    skips even that, for callers that compile many shapes.
    """
    bos, eos = marker_vectors(params, config, compute=compute) if markers is None else markers
    batch, time = tokens.shape[:2]
    x = jnp.concatenate(
        [
            jnp.broadcast_to(bos, (batch, 1, bos.shape[-1])),
            tokens,
            jnp.zeros((batch, 1, tokens.shape[-1]), tokens.dtype),
        ],
        axis=1,
    )
    t = jnp.arange(time + 2)[None, :, None]
    x = jnp.where(t == lengths[:, None, None] + 1, eos, x)
    return jnp.where(t <= lengths[:, None, None] + 1, x, 0.0)


def bilm_apply(
    params: dict,
    config: ModelConfig,
    char_ids: ArrayLike,
    state: dict | None = None,
    *,
    keep_sentence_markers: bool = False,
    compute: Compute = Compute(),
) -> tuple[jax.Array, jax.Array, dict]:
    """The ELMo layers of a batch of sentences.

    Args:
      params: biLM params (``load_hdf5`` or ``init``).
      config: the model config (static: one compile per config and input shape).
      char_ids: ``[batch, time, chars] int32`` from ``batch_to_ids``: the sentence tokens, without
        ``<S>``/``</S>``, left-aligned; an all-zero row is an empty sentence. ``chars`` may be
        cut below ``max_characters_per_token`` by ``char_cnn.trim_char_ids`` (same result).
      state: ``{"c": [2, n_layers, batch, dim], "h": [2, n_layers, batch, P]}`` to continue from
        (bilm-tf's stateful mode), or None for zeros (stateless: a sentence's vectors then do not
        depend on the rest of the batch).
      keep_sentence_markers: keep the ``<S>``/``</S>`` positions (time axis ``time + 2``).
      compute: ``elmo_jax.model.compute.Compute`` (static): matmul precision, compute dtype and
        layout. The default, full float32, matches the references; ``Compute.from_policy("bfloat16")``
        moves results about 1e-2 (state and outputs stay float32).

    Returns:
      ``layers [n_layers + 1, batch, time, 2P]`` float32 (layer 0 is ``[e; e]``; exactly 0 at
      padding), ``mask [batch, time]`` bool, and the new state (per row: forward after ``</S>``,
      backward after ``<S>``).

    Raises ``TypeError`` or ``ValueError`` (one line, before anything runs) for params that are
    not this config's biLM (another model's, a training state's) or a config that is not a
    ``ModelConfig`` (``check_params``), char ids of the wrong shape or type, or out of range
    (``char_cnn.check_char_ids``), a ``state`` of other shapes than the model's, and a
    ``compute`` that is not a ``Compute``.
    """
    check_params(params, config, shapes=True)
    if not isinstance(compute, Compute):
        raise TypeError(
            f"compute is a {type(compute).__name__} ({compute!r}); expected a Compute: "
            "elmo_jax.model.compute.Compute.from_policy('bfloat16'), say"
        )
    ids = char_cnn.check_char_ids(params["char_cnn"], config, char_ids, ndim=3)
    if isinstance(ids, np.ndarray):  # a traced array has no values to check
        _check_left_aligned(ids)
    if state is not None:
        _check_state(config, state, ids.shape[0])
    return _bilm_apply(params, config, ids, state, keep_sentence_markers=keep_sentence_markers, compute=compute)


def _check_left_aligned(char_ids: np.ndarray) -> None:
    """One line for a row whose padding (an all-zero token) comes before one of its tokens: a
    sentence's length is its count of tokens, so left padding or a gap would run the LSTM over the
    padding and drop the last tokens, silently."""
    present = (char_ids != 0).any(axis=-1)  # [batch, time]
    aligned = present == (np.arange(present.shape[1])[None, :] < present.sum(axis=1)[:, None])
    if not aligned.all():
        row = int(np.flatnonzero(~aligned.all(axis=1))[0])
        gap = int(np.flatnonzero(~present[row])[0])
        raise ValueError(
            f"char_ids row {row} has padding (an all-zero token) at {gap} before a token at "
            f"{gap + int(np.flatnonzero(present[row, gap:])[0])}; each row holds its tokens first, then "
            "padding (batch_to_ids makes them so)"
        )


def check_params(params, config, *, shapes: bool = False, name: str = "params") -> None:
    """``TypeError`` or ``ValueError`` (one line) for ``params`` that are not ``config``'s biLM:
    the two swapped, a training state's ``{"bilm": ..., "softmax": ...}``, or with ``shapes``
    another model's weights (each would fail later as a missing key, or a shape deep in the char
    CNN or the LSTM). ``shapes`` traces ``init`` once per config, making no arrays; then a check
    only compares the leaves' shapes. Keys beside the biLM's are left alone. ``name``: the
    argument, as the caller calls it."""
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config is a {type(config).__name__}; expected a ModelConfig")
    check_params_tree(params, name)
    if not shapes:
        return
    want, got = _init_shapes(config), leaf_shapes(params)
    embed = "['char_cnn']['char_embed']"
    # The ids are shifted by one: a table without the padding row would read the wrong rows.
    if got.get(embed, (0,))[0] == 261:
        raise ValueError(
            f"{name}{embed} has bilm-tf's 261 rows; the model reads 262, row 0 for padding: load the "
            "weights with load_hdf5 (or load_tf_checkpoint), which add it"
        )
    if any(got.get(k) != shape for k, shape in want.items()):
        key = next(k for k in want if got.get(k) != want[k])
        raise ValueError(
            f"{name} are not this config's biLM: {name}{key} is {got.get(key, 'missing')} where the config's is "
            f"{want.get(key, 'absent')} (another model's weights?)"
        )


def is_params_tree(tree) -> bool:
    """Whether ``tree`` has a biLM's top level, ``{"char_cnn": ..., "lstm": ...}`` (keys beside them allowed)."""
    return isinstance(tree, Mapping) and {"char_cnn", "lstm"} <= tree.keys()


def check_params_tree(params, name: str = "params") -> None:
    """``TypeError`` (one line) for ``params`` that are not a biLM's tree at all: a config, an
    array, a training state's ``{"bilm": ..., "softmax": ...}`` (``check_params`` without a config)."""
    hint = (
        f": a training state's params hold the biLM's as {name}['bilm']"
        if isinstance(params, Mapping) and "bilm" in params
        else ""
    )
    if not is_params_tree(params):
        keys = sorted(params) if isinstance(params, Mapping) else type(params).__name__
        raise TypeError(
            f"{name} must be the biLM's {{'char_cnn': ..., 'lstm': ...}} (load_hdf5, init_bilm); got {keys}{hint}"
        )


@functools.cache
def _init_shapes(config: ModelConfig) -> dict[str, tuple]:
    """``init``'s leaf shapes by path (traced once per config: no arrays are made)."""
    return leaf_shapes(jax.eval_shape(lambda: init(jax.random.PRNGKey(0), config)))


def leaf_shapes(tree) -> dict[str, tuple]:
    """Leaf shapes by path, so that a FrozenDict or tuples compare as dicts and lists do (the leaves:
    arrays, or abstract ones such as ``jax.ShapeDtypeStruct``)."""
    return {jax.tree_util.keystr(k): tuple(jnp.shape(x)) for k, x in jax.tree_util.tree_leaves_with_path(tree)}


def _check_state(config: ModelConfig, state, batch: int) -> None:
    want = lstm.state_shapes(config, batch)
    got = {k: tuple(getattr(state.get(k), "shape", ())) for k in want} if isinstance(state, Mapping) else None
    if got != want:
        raise ValueError(
            f"state must be {{'c': [2, n_layers, batch, dim], 'h': [2, n_layers, batch, P]}}, here {want} "
            f"(a state that bilm_apply returned for the same batch size); got {got or type(state).__name__}"
        )


# Jitted apart from its checks: they read a host array's values, which a traced one has none of.
@functools.partial(jax.jit, static_argnames=("config", "keep_sentence_markers", "compute"))
def _bilm_apply(
    params: dict,
    config: ModelConfig,
    char_ids: jax.Array,
    state: dict | None,
    *,
    keep_sentence_markers: bool,
    compute: Compute,
) -> tuple[jax.Array, jax.Array, dict]:
    lengths = jnp.any(char_ids > 0, axis=-1).sum(axis=-1).astype(jnp.int32)
    tokens = char_cnn.apply(params["char_cnn"], config, char_ids, compute=compute)
    return bilm_from_tokens(
        params, config, tokens, lengths, state, keep_sentence_markers=keep_sentence_markers, compute=compute
    )


def bilm_from_tokens(
    params: dict,
    config: ModelConfig,
    tokens: jax.Array,
    lengths: jax.Array,
    state: dict | None = None,
    *,
    keep_sentence_markers: bool = False,
    compute: Compute = Compute(),
    markers: jax.Array | None = None,
    active: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, dict]:
    """``bilm_apply`` from token vectors ``[batch, time, P]`` (rows left-aligned, ``lengths [batch]``).

    For callers that encode tokens their own way: each distinct word once, or from a cache.
    ``markers``: ``marker_vectors``, when the caller already has them. ``active``: ``[batch]``
    bool; a False row runs no step, not even its sentence markers, so its ``state`` passes
    through unchanged (rows that pad a stateful batch to a compiled size).
    """
    mask = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]
    tokens = jnp.where(mask[:, :, None], tokens, 0.0)
    x = add_sentence_markers(params, config, tokens, lengths, compute=compute, markers=markers)
    seq_lengths = lengths + 2 if active is None else jnp.where(active, lengths + 2, 0)
    layers, new_state = lstm.apply(params["lstm"], config, x, seq_lengths, state, compute=compute)
    layers = jnp.concatenate([jnp.concatenate([x, x], axis=-1)[None], layers])
    if keep_sentence_markers:
        return layers, jnp.arange(x.shape[1])[None, :] < seq_lengths[:, None], new_state
    # Dropping position 0 shifts each row's </S> to index `length`, which the mask zeroes.
    layers = jnp.where(mask[None, :, :, None], layers[:, :, 1:-1], 0.0)
    return layers, mask, new_state
