"""The rows layout's hand-written LSTM backward pass (``lstm._rows_scan_vjp``) against autodiff.

Reference: ``jax.grad`` of the plain scan (``Layout(lstm_vjp=False)``), through ``lstm.run`` with
everything that reaches the layer: padding, resets, dropout, skip connections, a carried state
in and a loss on the final state out, with both clips active (or both off).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from elmo_jax.config import LSTMConfig, preset
from elmo_jax.model import cell, lstm
from elmo_jax.model.compute import Compute
from elmo_jax.model.layout import Layout

B, T, DIM, P = 4, 7, 32, 16
LENGTHS = [7, 5, 2, 0]  # padding, and an empty row


def _config(n_layers: int, clip: bool):
    # Small clips so that, with the inputs below, some cells and some projections do clip.
    l = LSTMConfig(
        dim=DIM,
        projection_dim=P,
        n_layers=n_layers,
        cell_clip=1.0 if clip else None,
        proj_clip=0.3 if clip else 0,
        use_skip_connections=True,
    )
    return dataclasses.replace(preset("tiny"), lstm=l)


def _setup(n_layers: int, clip: bool):
    config = _config(n_layers, clip)
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 16))
    params = [
        {**layer, "w_h": 2.0 * layer["w_h"], "b": jax.random.normal(next(keys), layer["b"].shape)}
        for layer in lstm.init(next(keys), config)
    ]
    xs = 2.0 * jax.random.normal(next(keys), (2, B, T, P))
    state = {
        "c": jax.random.normal(next(keys), (2, n_layers, B, DIM)),
        "h": jax.random.uniform(next(keys), (2, n_layers, B, P), minval=-0.3, maxval=0.3),
    }
    mask = jnp.arange(T)[None, :] < jnp.array(LENGTHS)[:, None]
    resets = jax.random.bernoulli(next(keys), 0.2, (2, B, T))
    run_kw = {"dropout_rate": 0.25, "dropout_keys": jax.random.split(next(keys), B), "resets": resets}
    # Random cotangents for the outputs and both parts of the final state.
    weights = (
        jax.random.normal(next(keys), (n_layers, 2, B, T, P)),
        jax.random.normal(next(keys), state["c"].shape),
        jax.random.normal(next(keys), state["h"].shape),
    )
    return config, params, xs, state, mask, run_kw, weights


def _grads(vjp: bool, config, params, xs, state, mask, run_kw, weights, unroll: int = 1, time_axis: int = 0):
    compute = Compute(layout=Layout("rows", unroll=unroll, lstm_vjp=vjp, lstm_time_axis=time_axis))

    def loss(params, xs, state):
        out, final = lstm.run(params, config, xs, mask, state, compute=compute, **run_kw)
        return (out * weights[0]).sum() + (final["c"] * weights[1]).sum() + (final["h"] * weights[2]).sum()

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(params, xs, state)


@functools.cache
def _reference(n_layers: int, clip: bool):
    """``jax.grad`` of the plain scan for ``_setup(n_layers, clip)``, computed once for the module
    (several tests compare against it, and each compile of it costs seconds here)."""
    return jax.device_get(_grads(False, *_setup(n_layers, clip)))


def _assert_same(a, b):
    (la, ga), (lb, gb) = a, b
    np.testing.assert_allclose(np.asarray(la), np.asarray(lb), rtol=1e-6)
    paths = jax.tree_util.tree_leaves_with_path(ga)
    for (path, x), y in zip(paths, jax.tree_util.tree_leaves(gb)):
        x, y = np.asarray(x), np.asarray(y)
        # atol: a few float32 roundings of the largest entry (sums over steps run in another order).
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6 * np.abs(y).max(), err_msg=jax.tree_util.keystr(path))


def _clipped(config, params, xs, mask, run_kw) -> tuple[int, int]:
    """How many (cell, projection) values layer 0 clips in the run above (unmasked steps only)."""
    l = config.lstm
    inp = lstm.dropout(jnp.where(mask[None, :, :, None], xs, 0.0), run_kw["dropout_rate"], run_kw["dropout_keys"], 0)
    gx = jnp.einsum("dbti,dig->tdbg", inp, params[0]["w_x"]) + params[0]["b"][None, :, None, :]
    r = run_kw["resets"].transpose(2, 0, 1)[..., None]
    c0, h0 = jnp.zeros((2, B, DIM)), jnp.zeros((2, B, P))
    _, (z, c, _, p), _, _ = lstm._rows_scan(
        params[0]["w_h"],
        params[0]["w_proj"],
        gx,
        mask.T[:, :, None],
        r,
        c0,
        h0,
        config=config,
        compute=Compute(),
        unroll=1,
        save=True,
    )
    i, j, f, _ = jnp.split(z, 4, axis=-1)
    c_raw = jax.nn.sigmoid(f + 1.0) * c + jax.nn.sigmoid(i) * jnp.tanh(j)
    m = np.asarray(mask.T[:, None, :, None])
    return (
        int((np.abs(np.asarray(c_raw)) > l.cell_clip).__and__(m).sum()),
        int((np.abs(np.asarray(p)) > l.proj_clip).__and__(m).sum()),
    )


@pytest.mark.parametrize("n_layers", [pytest.param(1, marks=pytest.mark.slow), 2])
@pytest.mark.parametrize("clip", [True, False], ids=["clipped", "unclipped"])
def test_custom_vjp_equals_autodiff_of_the_scan(n_layers, clip):
    setup = _setup(n_layers, clip)
    config, params, xs, _, mask, run_kw, _ = setup
    if clip:  # not vacuous: both clips cut some values, and leave others
        cells, projections = _clipped(config, params, xs, mask, run_kw)
        steps = 2 * sum(LENGTHS)
        assert 0 < cells < steps * DIM and 0 < projections < steps * P, (cells, projections)
    reference = _reference(n_layers, clip)
    _assert_same(_grads(True, *setup), reference)
    _, (g_params, g_xs, g_state) = reference
    for g in (g_params[-1]["w_h"], g_params[-1]["w_proj"], g_xs, g_state["c"], g_state["h"]):
        assert np.abs(np.asarray(g[:, 0] if g.ndim == 5 else g[0])).max() > 0  # both directions get gradients
        assert np.abs(np.asarray(g[:, 1] if g.ndim == 5 else g[1])).max() > 0
    assert not np.asarray(g_xs[:, 3]).any()  # the empty row's inputs are masked out


def test_custom_vjp_unrolled_equals_autodiff():
    """Unrolled as the GPU runs it (3 does not divide 7 steps: a remainder runs too)."""
    setup = _setup(2, True)
    _assert_same(_grads(True, *setup, unroll=3), _reference(2, True))


@pytest.mark.parametrize(
    "unroll, vjp",
    [pytest.param(3, True, marks=pytest.mark.slow), (20, True), pytest.param(20, False, marks=pytest.mark.slow)],
    ids=str,
)
def test_time_on_axis_2_gives_the_same_gradients(unroll, vjp):
    """``Layout.lstm_time_axis`` 2 (the per-step arrays ``[2, B, T, ...]``): scanned over
    time-major copies (unroll 3, with a remainder) or written out in Python (20 covers the 7
    steps), by the hand-written backward pass or by autodiff, against autodiff of the time-major
    scan."""
    setup = _setup(2, True)
    _assert_same(_grads(vjp, *setup, unroll=unroll, time_axis=2), _reference(2, True))


def drop_term(monkeypatch, term: str) -> None:
    """Makes ``cell.backward_matmul`` (every hand-written backward pass's matmuls: the rows
    layout's, the wavefront's and the cell's own) return zeros for the einsum ``term``: a backward
    pass that forgets that term."""
    mm = cell.backward_matmul

    def without_term(spec, a, b, compute):
        out = mm(spec, a, b, compute)
        return jnp.zeros_like(out) if spec == term else out

    monkeypatch.setattr(cell, "backward_matmul", without_term)


@pytest.mark.parametrize(
    "term, time_axis",
    [("dbg,dpg->dbp", 0), ("tdbc,tdbp->dcp", 0), pytest.param("dbtc,dbtp->dcp", 2, marks=pytest.mark.slow)],
    ids=["recurrent-dh", "dW_proj", "dW_proj-time-axis-2"],
)
def test_dropping_one_backward_term_fails_the_comparison(monkeypatch, term, time_axis):
    """Negative control: the comparison above catches a backward pass missing one term."""
    setup, reference = _setup(2, True), _reference(2, True)
    drop_term(monkeypatch, term)
    with pytest.raises(AssertionError):
        _assert_same(_grads(True, *setup, unroll=20, time_axis=time_axis), reference)


def _loss_fn(compute, config, xs, state, mask, run_kw, weights):
    def loss(params):
        out, final = lstm.run(params, config, xs, mask, state, compute=compute, **run_kw)
        return (out * weights[0]).sum() + (final["c"] * weights[1]).sum()

    return loss


def test_custom_vjp_in_bfloat16_matches_autodiff_up_to_rounding():
    """bfloat16 matmul inputs: float32 gradients, as autodiff's up to bfloat16 rounding."""
    config, params, xs, state, mask, run_kw, weights = _setup(2, True)
    grads = {
        vjp: jax.jit(
            jax.grad(
                _loss_fn(
                    Compute.from_policy("bfloat16", Layout("rows", lstm_vjp=vjp)),
                    config,
                    xs,
                    state,
                    mask,
                    run_kw,
                    weights,
                )
            )
        )(params)
        for vjp in (True, False)
    }
    for a, b in zip(jax.tree_util.tree_leaves(grads[True]), jax.tree_util.tree_leaves(grads[False])):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == np.float32 and np.abs(a - b).max() <= 0.05 * np.abs(b).max()


def test_custom_vjp_lowers_with_a_dot_algorithm_preset():
    """tf32 (a ``DotAlgorithmPreset``, GPU only) with float32 results: lowered for CUDA, not run."""
    config, params, xs, state, mask, run_kw, weights = _setup(1, True)
    compute = Compute(jax.lax.DotAlgorithmPreset.TF32_TF32_F32, jnp.float32, Layout("rows", lstm_vjp=True))
    grad = jax.jit(jax.grad(_loss_fn(compute, config, xs, state, mask, run_kw, weights)))
    assert "tf32" in grad.trace(params).lower(lowering_platforms=("cuda",)).as_text().lower()
