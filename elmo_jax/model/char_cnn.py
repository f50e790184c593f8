"""The character-CNN token encoder (bilm-tf's ``_build_word_char_embeddings``) as pure functions.

Params (a plain dict)::

    char_embed  [262, E]            row 0 is padding (the +1 shift); bilm-tf's 261 rows follow
    conv        list of {"w": [width, E, n], "b": [n]}, in filter order
    highway     list of {"w": [F, 2F], "b": [2F]}: carry and transform side by side (one matmul)
    proj        {"w": [F, P], "b": [P]}  (identity when bilm-tf had no projection)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from elmo_jax.config import CharCNNConfig, ModelConfig
from elmo_jax.model.compute import Compute
from elmo_jax.model.gather import take_rows
from elmo_jax.model.initializers import Normal, Uniform, draw
from elmo_jax.model.vocabulary import PAD_CHAR


def init(key: jax.Array, config: ModelConfig) -> dict:
    """bilm-tf's initialisers, so training from scratch follows the reference recipe."""
    c, p = config.char_cnn, config.lstm.projection_dim
    f, e = c.n_filters, c.embedding_dim
    if c.activation == "relu":
        conv_specs: list[Uniform | Normal] = [Uniform((width, e, n), -0.05, 0.05) for width, n in c.filters]
    else:
        conv_specs = [Normal((width, e, n), np.sqrt(1.0 / (width * e))) for width, n in c.filters]
    # Per highway layer: carry, then transform.
    highway_specs = [Normal((f, f), np.sqrt(1.0 / f)) for _ in range(2 * c.n_highway)]
    # 262 rows whatever n_characters says: apply shifts every id by one (row 0 is padding), so
    # bilm-tf's 261-row training table would read each character's neighbour's row.
    char_embed, *weights = draw(
        key, [Uniform((262, e), -1.0, 1.0), *conv_specs, *highway_specs, Normal((f, p), np.sqrt(1.0 / f))]
    )
    char_embed = char_embed.at[0].set(0.0)
    conv = [{"w": w, "b": jnp.zeros((n,), jnp.float32)} for w, (_, n) in zip(weights, c.filters)]
    highway_w = weights[len(c.filters) : -1]
    # b_carry = -2: the gate starts mostly closed, so the highway starts near the identity.
    b = jnp.concatenate([jnp.full((f,), -2.0, jnp.float32), jnp.zeros((f,), jnp.float32)])
    highway = [{"w": jnp.concatenate(highway_w[2 * i : 2 * i + 2], axis=1), "b": b} for i in range(c.n_highway)]
    proj = {"w": weights[-1], "b": jnp.zeros((p,), jnp.float32)}
    return {"char_embed": char_embed, "conv": conv, "highway": highway, "proj": proj}


def _activation(name: str):
    return jax.nn.relu if name == "relu" else jnp.tanh


def _dot_max(cols: jax.Array, w: jax.Array, precision) -> jax.Array:
    """``[N, positions, K] @ [K, n]``, max over positions: ``[N, n]`` (one filter, no bias)."""
    return jnp.dot(cols, w, precision=precision).max(axis=1)


# ``_dot_max`` differentiated by hand (``Layout.cnn_vjp``), with autodiff's rule for a max (jax's
# reduce-max JVP, as TF's for bilm-tf): the gradient goes to the position of the maximum, split
# evenly where positions tie (e.g. the identical all-padding windows past a short word).
# Autodiff keeps where the maxima lie as a float mask of the outputs' size, and its backward
# multiplies by it; here they are kept as a bool mask (a quarter of the bytes in float32) that
# the backward selects with: on XLA:CPU about 40 % off the char CNN's gradient
# (``benchmarks/bench_grad.py --part cnn``).
_dot_max_vjp = jax.custom_vjp(_dot_max, nondiff_argnums=(2,))


def _dot_max_vjp_fwd(cols, w, precision):
    y = jnp.dot(cols, w, precision=precision)
    top = y.max(axis=1)
    return top, (cols, w, y == top[:, None, :])


def _dot_max_vjp_bwd(precision, residuals, g):
    cols, w, at_max = residuals  # at_max: [N, positions, n] bool
    share = g / at_max.sum(axis=1).astype(g.dtype)
    dy = jnp.where(at_max, share[:, None, :], jnp.zeros((), g.dtype))
    f32 = jnp.float32
    dw = jnp.einsum("npk,npf->kf", cols, dy, precision=precision, preferred_element_type=f32)
    dcols = jnp.einsum("npf,kf->npk", dy, w, precision=precision, preferred_element_type=f32)
    return dcols.astype(cols.dtype), dw.astype(w.dtype)


_dot_max_vjp.defvjp(_dot_max_vjp_fwd, _dot_max_vjp_bwd)


def _conv_max(x: jax.Array, conv: list[dict], c: CharCNNConfig, *, compute: Compute, vjp: bool = False) -> jax.Array:
    """``[N, chars, E] -> [N, F]``: each filter's VALID convolution + bias, max over positions
    (``x`` already in ``compute.dtype``); ``vjp``: differentiated by ``_dot_max_vjp``'s backward.

    Each filter is one matmul over an im2col view: XLA's CPU convolution runs at about 45 % of
    its matmul rate, the matmuls at about 70 %. One im2col at the widest width serves every
    filter (a width-w window is the first w*E columns of a wider one), which keeps the graph and
    its gradient small.
    """
    n_chars, e = x.shape[1], c.embedding_dim
    wmax = max(w for w, _ in c.filters)
    xp = jnp.pad(x, ((0, 0), (0, wmax - 1), (0, 0)))
    cols = jnp.concatenate([xp[:, k : k + n_chars] for k in range(wmax)], axis=-1)  # [N, chars, wmax*E]
    outs = []
    for layer, (width, n) in zip(conv, c.filters):
        window, w = cols[:, : n_chars - width + 1, : width * e], layer["w"].reshape(width * e, n).astype(x.dtype)
        y = (_dot_max_vjp if vjp else _dot_max)(window, w, compute.precision)
        outs.append(y + layer["b"].astype(x.dtype))
    return jnp.concatenate(outs, axis=-1)


def _pad_window_values(params: dict, c: CharCNNConfig, compute: Compute) -> jax.Array:
    """``[F]``: each filter's value on a window of in-token padding chars only."""
    pad = jnp.full((1, max(w for w, _ in c.filters)), PAD_CHAR + 1, dtype=jnp.int32)
    x = jnp.take(params["char_embed"], pad, axis=0).astype(compute.dtype)
    return _conv_max(x, params["conv"], c, compute=compute)[0]


def _token_chunks(f, x: jax.Array, chunk: int) -> jax.Array:
    """Applies ``f: [chunk, ...] -> [chunk, F]`` over ``x: [N, ...]`` in blocks of tokens.

    The convolution outputs are ``[N, positions, filters]`` (400 KB a token for the released
    filters) and only their max survives; in blocks the outputs stay in cache, which measured
    1.5-1.8x faster on CPU than one large matmul.
    """
    n = x.shape[0]
    if chunk == 0 or n <= chunk:
        return f(x)
    blocks = -(-n // chunk)
    xp = jnp.pad(x, ((0, blocks * chunk - n),) + ((0, 0),) * (x.ndim - 1))
    out = jax.lax.map(f, xp.reshape(blocks, chunk, *x.shape[1:]))
    return out.reshape(blocks * chunk, -1)[:n]


def _last_char(char_ids: np.ndarray) -> int:
    """The last column any token's text reaches (its end-of-word char; 0 for no text)."""
    text = (char_ids != PAD_CHAR + 1) & (char_ids != 0)
    width = char_ids.shape[-1]
    eow = np.where(text.any(axis=-1), width - 1 - np.argmax(text[..., ::-1], axis=-1), 0)
    return int(eow.max(initial=0))


def trim_char_ids(char_ids: np.ndarray, config: ModelConfig, multiple: int = 8) -> np.ndarray:
    """Drops trailing char columns that only hold in-token padding, keeping ``apply`` exact.

    Windows made only of padding chars all give the same value, which ``apply`` adds back when
    the char axis is shorter than ``max_characters_per_token``; so the char CNN need only see each
    token's chars plus ``widest - 1`` padding columns. Typical English batches need about 20 of
    the 50 columns. The width is rounded up to ``multiple`` to bound the number of compiles.
    """
    c = config.char_cnn
    full, widest = c.max_characters_per_token, max(w for w, _ in c.filters)
    if char_ids.shape[-1] != full:
        return char_ids
    # Windows starting at or before the end-of-word must all be kept: width >= eow + widest.
    # A width below `full` then also leaves every token an all-padding window in the full axis,
    # which is what makes adding the padding-window value back exact.
    width = min(full, -(-(_last_char(char_ids) + widest) // multiple) * multiple)
    if width == full:
        return char_ids
    return np.ascontiguousarray(char_ids[..., :width])


def check_char_ids(params: dict, config: ModelConfig, char_ids, *, ndim: int | None = None) -> jax.Array | np.ndarray:
    """``char_ids`` as an array, or ``TypeError``/``ValueError`` (one line) for ids the encoder
    would read wrongly without a word: not integers, more chars per token than the model takes,
    not ``ndim`` axes (word ids ``[batch, time]`` given for char ids). Their values (0 for padding,
    up to the char embedding's rows) are checked too where they are on the host (numpy, a list: as
    ``batch_to_ids`` gives them): out of range, the gather would clamp them to a real character.
    A traced or device array keeps its values unread, so a jitted call costs nothing more.
    """
    tokens = "char_ids are tokens (str), not char ids: batch_to_ids(sentences) gives the ids"
    if isinstance(char_ids, (list, tuple)):
        first = char_ids
        while isinstance(first, (list, tuple)) and first:
            first = first[0]
        if isinstance(first, str):
            raise TypeError(tokens)
        try:
            char_ids = np.asarray(char_ids)
        except ValueError:  # numpy's "inhomogeneous shape"
            raise ValueError("char_ids are lists of different lengths; batch_to_ids pads them") from None
    shape, dtype = getattr(char_ids, "shape", None), getattr(char_ids, "dtype", None)
    if dtype is not None and getattr(dtype, "kind", None) in ("U", "S", "O"):
        raise TypeError(tokens)
    if shape is None or dtype is None:
        raise TypeError(f"char_ids is a {type(char_ids).__name__}; expected an int32 array (from batch_to_ids)")
    axes = "[batch, time, chars]" if ndim == 3 else "[..., chars]"
    if (ndim is not None and len(shape) != ndim) or len(shape) == 0:
        why = (
            "fold the extra leading axes into the batch (reshape(-1, time, chars))"
            if ndim is not None and len(shape) > ndim
            else "ELMo reads each token's characters, not a word id"
        )
        raise ValueError(f"char_ids must be {axes} (from batch_to_ids); got shape {tuple(shape)}: {why}")
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"char_ids must be integers {axes} (int32, from batch_to_ids); got {dtype}")
    full, widest = config.char_cnn.max_characters_per_token, max(w for w, _ in config.char_cnn.filters)
    if shape[-1] > full:
        raise ValueError(f"char_ids have {shape[-1]} chars per token; the model takes at most {full}")
    # Fewer columns are read as trim_char_ids' cut: each token's text and widest - 1 padding
    # columns after it, the windows beyond all alike. Other cuts change windows, silently.
    cut = shape[-1] < full and (
        shape[-1] < widest or (isinstance(char_ids, np.ndarray) and _last_char(char_ids) + widest > shape[-1])
    )
    if cut:
        raise ValueError(
            f"char_ids have {shape[-1]} chars per token, which cuts windows of the model's {full}: make them "
            f"with batch_to_ids(max_chars={full}) (char_cnn.trim_char_ids drops only what no window needs)"
        )
    if isinstance(char_ids, np.ndarray) and char_ids.size:
        rows = params["char_embed"].shape[0]
        lo, hi = int(char_ids.min()), int(char_ids.max())
        if lo < 0 or hi >= rows:
            raise ValueError(
                f"char_ids hold {lo if lo < 0 else hi}; the char embedding has rows 0 (padding) to {rows - 1}: "
                "make them with batch_to_ids"
            )
    return char_ids


def apply(params: dict, config: ModelConfig, char_ids: jax.Array, *, compute: Compute = Compute()) -> jax.Array:
    """``[..., chars] int32`` char ids (shifted) -> ``[..., projection_dim]`` float32 token vectors.

    ``chars`` is ``max_characters_per_token`` or fewer (see ``trim_char_ids``). Rows of zeros
    (padding) get a vector too; callers mask it. ``compute``: the matmul precision and compute
    dtype (e.g. bfloat16), and the layout whose ``cnn_chunk`` tokens are encoded at a time (a
    speed knob, not a semantic one; the backend's when the layout is None).
    """
    c = config.char_cnn
    precision, dtype = compute.precision, compute.dtype
    checked = jnp.asarray(check_char_ids(params, config, char_ids))
    lead = checked.shape[:-1]
    ids = checked.reshape(-1, checked.shape[-1])

    layout = compute.resolved_layout()

    def encode(block):
        x = take_rows(params["char_embed"], block, sums=layout.row_sums).astype(dtype)  # [n, chars, E]
        return _conv_max(x, params["conv"], c, compute=compute, vjp=layout.cnn_vjp)

    h = _token_chunks(encode, ids, layout.cnn_chunk)
    if ids.shape[-1] < c.max_characters_per_token:
        # A char axis cut by trim_char_ids: add back the all-padding windows it dropped.
        h = jnp.maximum(h, _pad_window_values(params, c, compute))
    h = _activation(c.activation)(h)
    for layer in params["highway"]:
        f = h.shape[-1]
        z = jnp.dot(h, layer["w"].astype(dtype), precision=precision) + layer["b"].astype(dtype)
        gate = jax.nn.sigmoid(z[:, :f])
        # bilm-tf's "carry" gate multiplies the transform branch; the highway is always ReLU.
        h = gate * jax.nn.relu(z[:, f:]) + (1.0 - gate) * h
    out = jnp.dot(h, params["proj"]["w"].astype(dtype), precision=precision) + params["proj"]["b"].astype(dtype)
    return out.astype(jnp.float32).reshape(*lead, out.shape[-1])  # not -1: lead may hold a 0
