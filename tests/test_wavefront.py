"""The LSTM layers in one wavefront scan (``Layout.lstm_wavefront``, ``elmo_jax.model.wavefront``)
against ``lstm.run``'s layer-by-layer rows layout differentiated by autodiff.

Everything that reaches the layers: padding, resets, dropout, skip connections, a carried state
in and a loss on the final state out, with both clips active (``test_lstm_vjp``'s setup), for 1,
2 and 3 layers.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_lstm_vjp import _config, _setup, drop_term

from elmo_jax.model import lstm, wavefront
from elmo_jax.model.compute import Compute
from elmo_jax.model.layout import Layout

PLAIN = Layout("rows", unroll=1, lstm_vjp=False)


def _run(layout: Layout, setup, policy: str = "float32"):
    """(loss, (outputs, final state)) and the gradients w.r.t. params, inputs and state."""
    config, params, xs, state, mask, run_kw, weights = setup
    compute = Compute.from_policy(policy, layout)

    def loss(params, xs, state):
        out, final = lstm.run(params, config, xs, mask, state, compute=compute, **run_kw)
        value = (out * weights[0]).sum() + (final["c"] * weights[1]).sum() + (final["h"] * weights[2]).sum()
        return value, (out, final)

    return jax.device_get(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(params, xs, state))


def _assert_same(got, want):
    ((lg, aux_g), gg), ((lw, aux_w), gw) = got, want
    # The input and recurrent halves of W_0 are one matmul here, two in lstm.run: sums in another order.
    np.testing.assert_allclose(lg, lw, rtol=1e-5)
    for x, y in zip(jax.tree_util.tree_leaves(aux_g), jax.tree_util.tree_leaves(aux_w)):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-5)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(gg), jax.tree_util.tree_leaves(gw)):
        x, y = np.asarray(x), np.asarray(y)
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6 * np.abs(y).max(), err_msg=jax.tree_util.keystr(path))


def _setup_layers(n_layers: int, clip: bool):
    if n_layers <= 2:
        return _setup(n_layers, clip)
    # Three layers: the same inputs as two, one more layer's params and state.
    config, params, xs, state, mask, run_kw, weights = _setup(2, clip)
    config = dataclasses.replace(config, lstm=dataclasses.replace(_config(2, clip).lstm, n_layers=3))
    keys = jax.random.split(jax.random.PRNGKey(9), 4)
    params = params + [lstm.init(keys[0], config)[2]]
    state = {
        k: jnp.concatenate([v, jax.random.normal(keys[1], v[:, :1].shape) * 0.3], axis=1) for k, v in state.items()
    }
    weights = (jax.random.normal(keys[2], (3,) + weights[0].shape[1:]),) + tuple(
        jnp.concatenate([w, jax.random.normal(keys[3], w[:, :1].shape)], axis=1) for w in weights[1:]
    )
    return config, params, xs, state, mask, run_kw, weights


@pytest.mark.parametrize("n_layers", [1, 2, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("clip", [True, False], ids=["clipped", "unclipped"])
def test_wavefront_equals_the_layers_one_after_the_other(n_layers, clip):
    setup = _setup_layers(n_layers, clip)
    _assert_same(_run(Layout("rows", unroll=1, lstm_wavefront=True), setup), _run(PLAIN, setup))


def test_wavefront_unrolled_is_the_same():
    setup = _setup(2, True)
    _assert_same(_run(Layout("rows", unroll=20, lstm_wavefront=True), setup), _run(PLAIN, setup))


@pytest.mark.parametrize(
    "term",
    ["ldbg,ldig->ldbi", "kldbi,kldbg->ldig", "...bp,...cp->...bc"],
    ids=["dX-and-dh", "dW_0", "projection"],
)
def test_dropping_one_backward_term_fails_the_comparison(monkeypatch, term):
    """Negative control: the comparison above catches a backward pass missing one term (the
    projection's is in ``cell.backward``, which the wavefront shares with the rows layout)."""
    setup = _setup(2, True)
    want = _run(PLAIN, setup)
    drop_term(monkeypatch, term)
    with pytest.raises(AssertionError):
        _assert_same(_run(Layout("rows", unroll=1, lstm_wavefront=True), setup), want)


def test_wavefront_in_bfloat16_matches_up_to_rounding():
    setup = _setup(2, True)
    (_, g), (_, w) = (_run(lay, setup, "bfloat16") for lay in (Layout("rows", lstm_wavefront=True), PLAIN))
    for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(w)):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == np.float32 and np.abs(a - b).max() <= 0.05 * np.abs(b).max()


def test_the_columns_layout_ignores_the_flag():
    """The wavefront is the rows layout's: the CPU's columns layout runs its own scan."""
    config, params, xs, state, mask, _, _ = _setup(2, False)
    called = []
    run = wavefront.run

    def spy(*args, **kw):
        called.append(1)
        return run(*args, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(wavefront, "run", spy)
        lstm.run(params, config, xs, mask, state, compute=Compute(layout=Layout("columns", lstm_wavefront=True)))
        assert not called
        lstm.run(params, config, xs, mask, state, compute=Compute(layout=Layout("rows", lstm_wavefront=True)))
        assert called
