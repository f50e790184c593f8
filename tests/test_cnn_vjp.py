"""The char CNN's hand-written backward pass for each filter's max (``char_cnn._dot_max_vjp``,
on by ``Layout.cnn_vjp``) against autodiff (``cnn_vjp=False``).

The words include the cases where the gradient of a max needs care: short words (their
all-padding windows tie), repeated letters (identical windows tie), and two different chars made
to give the same value for every width-1 filter (different windows tie). Autodiff splits such a
gradient evenly over the tied positions; so must the hand-written pass.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from elmo_jax.config import preset
from elmo_jax.model import char_cnn
from elmo_jax.model.compute import Compute
from elmo_jax.model.layout import Layout
from elmo_jax.model.vocabulary import words_to_ids

CONFIG = preset("tiny")
WORDS = ["ab", "ba", "a", "I", "aaaa", "abba", "the", "tree", "unbelievably", "Ünïcödé", "."]
LONG = "x" * 60  # cut to 50 chars: no char column can be trimmed


def _setup(trim: bool = False):
    """Params with the tie between 'a' and 'b' built in, the words' char ids (``trim``: without
    the long word, cut by ``trim_char_ids``), a cotangent."""
    params = char_cnn.init(jax.random.PRNGKey(0), CONFIG)
    ids = words_to_ids(WORDS + ([] if trim else [LONG]), CONFIG.char_cnn.max_characters_per_token)
    a, b = int(ids[0, 1]), int(ids[0, 2])  # after the begin-of-word char
    embed = np.asarray(params["char_embed"]).copy()
    # 'a' and 'b' differ only in the last embedding dimension, which no width-1 filter reads;
    # large, so that for many filters the maximum lies on them.
    embed[a] = 3.0 * np.abs(embed[a])
    embed[b] = embed[a]
    embed[b, -1] = -embed[a, -1]
    conv = [dict(layer) for layer in params["conv"]]
    for layer, (width, _) in zip(conv, CONFIG.char_cnn.filters):
        if width == 1:
            layer["w"] = layer["w"].at[:, -1, :].set(0.0)
    params = {**params, "char_embed": jnp.asarray(embed), "conv": conv}
    cotangent = jax.random.normal(jax.random.PRNGKey(1), (len(ids), CONFIG.lstm.projection_dim))
    return params, char_cnn.trim_char_ids(ids, CONFIG) if trim else ids, cotangent


def _grads(params, ids, cotangent, *, vjp: bool, chunk: int = 0, policy: str = "float32"):
    compute = Compute.from_policy(policy, Layout("columns", cnn_chunk=chunk, cnn_vjp=vjp))

    def loss(params):
        return (char_cnn.apply(params, CONFIG, ids, compute=compute) * cotangent).sum()

    return jax.device_get(jax.jit(jax.value_and_grad(loss))(params))


@functools.cache
def _reference(trim: bool, chunk: int):
    params, ids, cotangent = _setup(trim)
    return _grads(params, jnp.asarray(ids), cotangent, vjp=False, chunk=chunk)


def _assert_same(got, want):
    (lg, gg), (lw, gw) = got, want
    np.testing.assert_allclose(lg, lw, rtol=1e-6)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(gg), jax.tree_util.tree_leaves(gw)):
        x, y = np.asarray(x), np.asarray(y)
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6 * np.abs(y).max(), err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("chunk", [0, 5], ids=["one-block", "in-blocks"])
@pytest.mark.parametrize("trim", [False, True], ids=["50-chars", "trimmed"])
def test_hand_written_max_backward_equals_autodiff(chunk, trim):
    params, ids, cotangent = _setup(trim)
    assert ids.shape[1] == (24 if trim else CONFIG.char_cnn.max_characters_per_token)
    _assert_same(_grads(params, jnp.asarray(ids), cotangent, vjp=True, chunk=chunk), _reference(trim, chunk))


def test_the_forward_pass_is_the_same_bit_for_bit():
    params, ids, _ = _setup()
    out = {
        vjp: np.asarray(char_cnn.apply(params, CONFIG, jnp.asarray(ids), compute=Compute(layout=Layout(cnn_vjp=vjp))))
        for vjp in (True, False)
    }
    np.testing.assert_array_equal(out[True], out[False])


def _argmax_window_max():
    """A backward that sends each max's whole gradient to its first position: right except at ties."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
    def window_max(cols, w, precision):
        return jnp.dot(cols, w, precision=precision).max(axis=1)

    def fwd(cols, w, precision):
        y = jnp.dot(cols, w, precision=precision)
        return y.max(axis=1), (cols, w, jnp.argmax(y, axis=1))

    def bwd(precision, residuals, g):
        cols, w, first = residuals
        dy = jnp.where(jnp.arange(cols.shape[1])[None, :, None] == first[:, None, :], g[:, None, :], 0.0)
        return jnp.einsum("npf,kf->npk", dy, w), jnp.einsum("npk,npf->kf", cols, dy)

    window_max.defvjp(fwd, bwd)
    return window_max


def _without_input_gradient():
    """A backward that forgets the gradient of the windows (so of the char embeddings)."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
    def window_max(cols, w, precision):
        return jnp.dot(cols, w, precision=precision).max(axis=1)

    def fwd(cols, w, precision):
        return char_cnn._dot_max_vjp_fwd(cols, w, precision)

    def bwd(precision, residuals, g):
        dcols, dw = char_cnn._dot_max_vjp_bwd(precision, residuals, g)
        return jnp.zeros_like(dcols), dw

    window_max.defvjp(fwd, bwd)
    return window_max


@pytest.mark.parametrize("broken", [_argmax_window_max, _without_input_gradient], ids=["ties-unsplit", "no-dX"])
def test_a_wrong_max_backward_fails_the_comparison(monkeypatch, broken):
    """Negative control: the comparison sees a backward that mishandles ties, or drops a term
    (and so the layout's ``cnn_vjp`` does route the gradient through ``_dot_max_vjp``)."""
    params, ids, cotangent = _setup()
    monkeypatch.setattr(char_cnn, "_dot_max_vjp", broken())
    with pytest.raises(AssertionError):
        _assert_same(_grads(params, jnp.asarray(ids), cotangent, vjp=True), _reference(False, 0))


def test_bfloat16_gradients_match_autodiff_up_to_rounding():
    params, ids, cotangent = _setup()
    (_, a), (_, b) = (_grads(params, jnp.asarray(ids), cotangent, vjp=v, policy="bfloat16") for v in (True, False))
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == np.float32 and np.abs(x - y).max() <= 0.02 * np.abs(y).max()


def test_hand_written_max_backward_lowers_with_a_dot_algorithm_preset():
    """tf32 (a ``DotAlgorithmPreset``, GPU only) with float32 results: lowered for CUDA, not run."""
    params, ids, cotangent = _setup()
    compute = Compute(jax.lax.DotAlgorithmPreset.TF32_TF32_F32, jnp.float32, Layout("rows", cnn_vjp=True))

    def loss(params):
        return (char_cnn.apply(params, CONFIG, jnp.asarray(ids), compute=compute) * cotangent).sum()

    text = jax.jit(jax.grad(loss)).trace(params).lower(lowering_platforms=("cuda",)).as_text()
    assert "tf32" in text.lower() and "custom_vjp" not in text  # lowered through the hand-written rule
