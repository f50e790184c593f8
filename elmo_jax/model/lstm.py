"""The biLSTM: TF's LSTMCell with projection and clipping (bilm-tf's ``bilm/model.py``) as a ``lax.scan``.

Params: a list with one dict per layer, each leaf stacked over the two directions
(index 0 forward, 1 backward)::

    w_x     [2, in, 4*dim]   rows of bilm-tf's W_0 that act on the input
    w_h     [2, P, 4*dim]    rows of W_0 that act on h
    b       [2, 4*dim]       B (the +1 forget bias is added at run time, never stored)
    w_proj  [2, dim, P]      W_P_0 (no bias)

State: ``{"c": [2, n_layers, batch, dim], "h": [2, n_layers, batch, P]}``, float32.

Both directions run in the same scan, as one batched matmul per step. The recurrence is
sequential, so on every backend the cost of a step is dominated by per-step overhead (loop
bookkeeping, kernel launches on a GPU) and small matmuls; doing the two directions together
halves the number of steps and doubles each matmul. The backward direction gets the same
recurrence by reversing each row within its own length first (so it starts at that row's
``</S>``), which also keeps padding at the end of every row for both directions.

Gradients: the rows layout (GPU/TPU) has a hand-written backward pass (``_rows_scan_vjp``, on by
``Layout.lstm_vjp``) that takes the weight gradients out of the reverse scan; the columns layout
(CPU) is differentiated by autodiff of its scan. With ``Layout.lstm_wavefront`` the rows layout
runs all layers in one scan instead (``elmo_jax.model.wavefront``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from elmo_jax.config import ModelConfig
from elmo_jax.model import cell, wavefront
from elmo_jax.model.compute import Compute
from elmo_jax.model.initializers import Uniform, draw


def init(key: jax.Array, config: ModelConfig) -> list[dict]:
    """Glorot-uniform weights and zero biases (TF 1.x's defaults, which bilm-tf used)."""
    l = config.lstm
    d, p = l.dim, l.projection_dim

    def glorot(shape):
        fan_in, fan_out = shape[-2], shape[-1]
        lim = np.sqrt(6.0 / (fan_in + fan_out))
        return Uniform(shape, -lim, lim)

    # W_0 is one [in + P, 4D] matrix in TF, so its Glorot limit uses fan_in = in + P.
    weights = draw(key, [spec for _ in range(l.n_layers) for spec in (glorot((2, p + p, 4 * d)), glorot((2, d, p)))])
    return [
        {"w_x": w0[:, :p], "w_h": w0[:, p:], "b": jnp.zeros((2, 4 * d), jnp.float32), "w_proj": w_proj}
        for w0, w_proj in zip(weights[0::2], weights[1::2])
    ]


def state_shapes(config: ModelConfig, batch: int) -> dict[str, tuple[int, ...]]:
    """The carried state's shapes: ``c [2, n_layers, batch, dim]`` and ``h [2, n_layers, batch, P]``
    (axis 0: the forward and backward directions)."""
    l = config.lstm
    return {"c": (2, l.n_layers, batch, l.dim), "h": (2, l.n_layers, batch, l.projection_dim)}


def zero_state(config: ModelConfig, batch: int, *, on_host: bool = False) -> dict:
    """The state at zero (``state_shapes``), float32: jax arrays, or numpy ones (``on_host``) for a
    caller that fills rows of it in place."""
    zeros = np.zeros if on_host else jnp.zeros
    return {k: zeros(shape, np.float32) for k, shape in state_shapes(config, batch).items()}


def reverse_within_length(x: jax.Array, lengths: jax.Array) -> jax.Array:
    """``[batch, time, ...]`` and ``lengths [batch]`` int: reverses ``x[b, :lengths[b]]`` per row;
    the padding stays put.

    It is its own inverse, so it also maps backward outputs back to input order.
    """
    t = jnp.arange(x.shape[1])[None, :]
    idx = jnp.where(t < lengths[:, None], lengths[:, None] - 1 - t, t)
    idx = idx.reshape(idx.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, idx, axis=1)


def _layer(
    params: dict,
    config: ModelConfig,
    xs: jax.Array,
    mask: jax.Array,
    c0: jax.Array,
    h0: jax.Array,
    *,
    compute: Compute,
    resets: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One layer, both directions. ``xs [2, B, T, in]``, ``mask [B, T]`` -> outputs ``[2, B, T, P]``;
    ``resets [2, B, T]``: the state is zeroed before those steps.

    The two layouts compute the same function (``elmo_jax.model.layout`` picks one per backend):
    ``compute``'s layout (the backend's when None) picks the layer function and its unroll.
    """
    layout = compute.resolved_layout()
    f = _layer_columns if layout.lstm == "columns" else _layer_rows
    return f(params, config, xs, mask, c0, h0, compute=compute, resets=resets)


def _layer_rows(
    params: dict,
    config: ModelConfig,
    xs: jax.Array,
    mask: jax.Array,
    c0: jax.Array,
    h0: jax.Array,
    *,
    compute: Compute = Compute(),
    resets: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``_layer`` with batch-major state ``[2, B, D]`` (GPU/TPU: the batch is the row axis).
    Unrolled ``compute.layout.unroll`` steps at a time (the backend's when None); differentiated
    by ``_rows_scan_vjp`` when the layout's ``lstm_vjp`` is set, else by autodiff of the scan."""
    layout = compute.resolved_layout()
    # The input half of W_0 needs no state: one large matmul over all steps, outside the scan
    # (autodiff of it is already one matmul each for dW_x and dX, whichever way the scan is differentiated).
    # With ``lstm_time_axis`` 2 time stays the third axis of everything per step ([2, B, T, ...],
    # as xs): the matmuls over all steps (this one, and the backward pass's dX, dW_x, dW_h,
    # dW_proj) then have the direction as their leading batch axis and (B, T) as contiguous rows,
    # so XLA needs no transposes of the [.., 4D] gate arrays around them. With 0 they are
    # time-major, as lax.scan stacks them.
    ta = layout.lstm_time_axis
    gx = jnp.einsum(
        "dbti,dig->" + ("dbtg" if ta else "tdbg"),
        xs.astype(compute.dtype),
        params["w_x"].astype(compute.dtype),
        precision=compute.precision,
    ).astype(jnp.float32) + (params["b"][:, None, None, :] if ta else params["b"][None, :, None, :])
    m = mask[None, :, :, None] if ta else mask.T[:, :, None]  # [1, B, T, 1] or [T, B, 1]
    r = (
        None if resets is None else (resets if ta else resets.transpose(2, 0, 1))[..., None]
    )  # [2, B, T, 1] or [T, 2, B, 1]
    if layout.lstm_vjp:
        scan = _rows_scan_vjp(config, compute, layout.unroll, ta)
    else:
        scan = functools.partial(
            _rows_scan, config=config, compute=compute, unroll=layout.unroll, time_axis=ta, save=False
        )
    ys, c, h = scan(params["w_h"], params["w_proj"], gx, m, r, c0, h0)[:3]
    return (ys if ta else ys.transpose(1, 2, 0, 3)), c, h


def _steps(step, carry, inputs: tuple, time_axis: int, *, unroll: int, reverse: bool = False):
    """``lax.scan`` of ``step`` over time, which is axis ``time_axis`` of every input and output:
    0 (time-major, as a scan stacks) or 2 (``[2, B, T, ...]``, masks ``[1, B, T, 1]``). With 2,
    when ``unroll`` covers every step the loop is written out in Python, each step reading its
    slices where they lie and its outputs stacked where the matmuls after the loop want them;
    otherwise it scans time-major copies.
    """
    if time_axis == 0:
        return jax.lax.scan(step, carry, inputs, unroll=unroll, reverse=reverse)
    n = inputs[0].shape[time_axis]
    if unroll >= n:
        outs = [None] * n
        for t in range(n - 1, -1, -1) if reverse else range(n):
            carry, outs[t] = step(carry, tuple(jax.lax.index_in_dim(x, t, time_axis, keepdims=False) for x in inputs))
        return carry, jax.tree.map(lambda *ys: jnp.stack(ys, axis=time_axis), *outs)
    inputs = tuple(jnp.moveaxis(x, time_axis, 0) for x in inputs)
    carry, ys = jax.lax.scan(step, carry, inputs, unroll=unroll, reverse=reverse)
    return carry, jax.tree.map(lambda y: jnp.moveaxis(y, 0, time_axis), ys)


def _rows_scan(
    w_h: jax.Array,
    w_proj: jax.Array,
    gx: jax.Array,
    m: jax.Array,
    r: jax.Array | None,
    c0: jax.Array,
    h0: jax.Array,
    *,
    config: ModelConfig,
    compute: Compute,
    unroll: int,
    time_axis: int = 0,
    save: bool,
) -> tuple:
    """The rows layout's recurrence over ``gx [T, 2, B, 4D]`` (input half and bias applied), masks
    ``m [T, B, 1]`` and resets ``r [T, 2, B, 1]`` (or None), from state ``c0 [2, B, D]``, ``h0 [2, B, P]``
    (with ``time_axis`` 2: ``gx [2, B, T, 4D]``, ``m [1, B, T, 1]``, ``r [2, B, T, 1]``, and so the outputs).

    Returns ``(ys [T, 2, B, P], c, h)``, and with ``save`` also what ``_rows_scan_vjp``'s backward
    reads, per step: the gate pre-activations ``z [T, 2, B, 4D]``, the state each step started from
    (after its reset) ``c [T, 2, B, D]`` and ``h [T, 2, B, P]``, the unclipped projection ``[T, 2, B, P]``.
    """
    precision, dtype = compute.precision, compute.dtype
    w_h, w_proj = w_h.astype(dtype), w_proj.astype(dtype)

    def project(a):
        return jnp.einsum("dbc,dcp->dbp", a.astype(dtype), w_proj, precision=precision)

    def step(carry, inputs):
        c, h = carry
        g, m, *r = inputs  # [2, B, 4D], [B, 1], optionally [2, B, 1]
        if r:
            c, h = jnp.where(r[0], 0.0, c), jnp.where(r[0], 0.0, h)
        z = g + jnp.einsum("dbp,dpg->dbg", h.astype(dtype), w_h, precision=precision).astype(jnp.float32)
        (carry, y), p = cell.forward(z, c, h, m, project, config=config, axis=-1)
        return carry, ((y, (z, c, h, p)) if save else y)

    per_step = (gx, m) + (() if r is None else (r,))
    (c, h), out = _steps(step, (c0, h0), per_step, time_axis, unroll=unroll)
    return (*out, c, h) if save else (out, c, h)


def _rows_scan_vjp(config: ModelConfig, compute: Compute, unroll: int, time_axis: int = 0):
    """``_rows_scan`` (``save=False``) with a hand-written backward pass, split as cuDNN splits it.

    Autodiff of ``lax.scan`` transposes the step, so every backward step would add
    ``h_{t-1}^T dz_t`` and ``a_t^T dp_t`` into loop-carried weight gradients (a small matmul and
    a rewrite of a ``[P, 4D]`` accumulator per step). Here the reverse scan carries only the
    state's gradients ``dc``, ``dh`` and emits the per-step gate gradients ``dz [T, 2, B, 4D]`` and
    projection gradients ``dp [T, 2, B, P]`` (time on axis 2 with ``time_axis`` 2); ``dW_h`` and
    ``dW_proj`` are then one matmul each over all ``T x B`` rows, and ``dz`` is the gradient of
    ``gx``, so autodiff of the input matmul outside (``_layer_rows``) gives ``dW_x``, ``db`` and
    ``dX`` as one matmul or sum each.

    The step's elementwise part (gates, clips) is differentiated with ``jax.vjp`` of the same
    functions the forward runs, from the saved pre-activations: the same derivatives as autodiff,
    including ``jnp.clip``'s (0 outside the range, 1/2 exactly at its ends).
    """
    fwd_scan = functools.partial(_rows_scan, config=config, compute=compute, unroll=unroll, time_axis=time_axis)

    @jax.custom_vjp
    def scan(w_h, w_proj, gx, m, r, c0, h0):
        return fwd_scan(w_h, w_proj, gx, m, r, c0, h0, save=False)

    def fwd(w_h, w_proj, gx, m, r, c0, h0):
        ys, saved, c, h = fwd_scan(w_h, w_proj, gx, m, r, c0, h0, save=True)
        return (ys, c, h), (w_h, w_proj, m, r, saved)

    def bwd(residuals, cotangents):
        w_h, w_proj, m, r, (z, c, h, p) = residuals
        dys, dc, dh = cotangents  # [T, 2, B, P] (or [2, B, T, P]); the final state's [2, B, D], [2, B, P]

        def step(carry, inputs):
            dc, dh = carry  # the gradients of the state this step passed on
            dy, z, c, p, m, *r = inputs
            dz, dc_in, dp, a = cell.backward(dy, dc, dh, z, c, p, m, w_proj, config=config, compute=compute)
            dh_in = jnp.where(m, 0.0, dh) + cell.backward_matmul("dbg,dpg->dbp", dz, w_h, compute)
            if r:  # a reset state was a constant: nothing flows back to the previous step
                dc_in, dh_in = jnp.where(r[0], 0.0, dc_in), jnp.where(r[0], 0.0, dh_in)
            return (dc_in, dh_in), (dz, dp, a)

        per_step = (dys, z, c, p, m) + (() if r is None else (r,))
        (dc0, dh0), (dz, dp, a) = _steps(step, (dc, dh), per_step, time_axis, unroll=unroll, reverse=True)
        # The weight gradients, each one matmul over all steps and rows.
        rows = "dbt" if time_axis else "tdb"
        dw_h = cell.backward_matmul(f"{rows}p,{rows}g->dpg", h, dz, compute)
        dw_proj = cell.backward_matmul(f"{rows}c,{rows}p->dcp", a, dp, compute)
        return dw_h, dw_proj, dz, None, None, dc0, dh0

    scan.defvjp(fwd, bwd)
    return scan


def _layer_columns(
    params: dict,
    config: ModelConfig,
    xs: jax.Array,
    mask: jax.Array,
    c0: jax.Array,
    h0: jax.Array,
    *,
    compute: Compute = Compute(),
    resets: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``_layer`` with the batch as the minor axis: state ``[2, D, B]``, weights transposed (CPU).

    On XLA's CPU backend a step's matmuls run much faster as ``[4D, in] @ [in, B]`` than as
    ``[B, in] @ [in, 4D]`` (few rows, many columns), and the input half is faster inside the
    step than as one ``[T*B]``-row einsum before it (``benchmarks/bench_bilm.py`` times both
    layouts). On a TPU a batch of 32 on the minor (lane) axis would waste most of each vector
    register, hence ``_layer_rows`` there.
    """
    precision, dtype, unroll = compute.precision, compute.dtype, compute.resolved_layout().unroll
    w_x, w_h, w_proj = (params[k].astype(dtype).transpose(0, 2, 1) for k in ("w_x", "w_h", "w_proj"))
    b = params["b"][:, :, None]

    def project(a):
        return jnp.einsum("dpc,dcb->dpb", w_proj, a.astype(dtype), precision=precision)

    def step(carry, inputs):
        c, h = carry  # [2, D, B], [2, P, B]
        x, m, *r = inputs  # [2, in, B], [1, B], optionally [2, 1, B]
        if r:
            c, h = jnp.where(r[0], 0.0, c), jnp.where(r[0], 0.0, h)
        z = (
            jnp.einsum("dgi,dib->dgb", w_x, x.astype(dtype), precision=precision).astype(jnp.float32)
            + jnp.einsum("dgp,dpb->dgb", w_h, h.astype(dtype), precision=precision).astype(jnp.float32)
            + b
        )
        return cell.forward(z, c, h, m, project, config=config, axis=1)[0]

    per_step = (xs.transpose(2, 0, 3, 1), mask.T[:, None, :]) + (
        () if resets is None else (resets.transpose(2, 0, 1)[:, :, None, :],)
    )
    (c, h), ys = jax.lax.scan(step, (c0.transpose(0, 2, 1), h0.transpose(0, 2, 1)), per_step, unroll=unroll)
    return ys.transpose(1, 3, 0, 2), c.transpose(0, 2, 1), h.transpose(0, 2, 1)


def run(
    params: list[dict],
    config: ModelConfig,
    xs: jax.Array,
    mask: jax.Array,
    state: dict | None = None,
    *,
    compute: Compute = Compute(),
    dropout_rate: float = 0.0,
    dropout_keys: jax.Array | None = None,
    resets: jax.Array | None = None,
) -> tuple[jax.Array, dict]:
    """Both directions' layer stacks, each over its own input in its own time order.

    Args:
      xs: ``[2, batch, time, P]`` inputs of the forward and the backward stack (training feeds
        the backward stack its own reversed stream; ``apply`` reverses within each row).
      mask: ``[batch, time]`` bool, True on a prefix of each row; padding passes the state
        through and outputs exactly 0.
      state: initial state (see module doc), or None for zeros.
      dropout_rate, dropout_keys: training only. Dropout on each layer's input, a fresh mask per
        step as in TF's DropoutWrapper (which wraps the residual, so a skip connection adds the
        dropped input). ``dropout_keys`` is ``[batch]`` keys, one per row, so masks do not depend
        on how rows are split over devices.
      resets: ``[2, batch, time]`` bool or None: every layer's state is zeroed just before those
        steps (training: some sentence starts begin from zero state, as evaluation and
        extraction do; see ``TrainConfig.reset_state_prob``).
      compute: matmul precision, compute dtype and layout (``elmo_jax.model.compute``; default:
        float32 at full precision, the backend's layout read when tracing).

    Returns:
      ``[n_layers, 2, batch, time, P]`` outputs and the final state.
    """
    l = config.lstm
    if dropout_rate > 0.0 and dropout_keys is None:
        raise ValueError("lstm.run: dropout_rate > 0 needs dropout_keys ([batch] keys, one per row)")
    if state is None:
        state = zero_state(config, xs.shape[1])
    xs = jnp.where(mask[None, :, :, None], xs, 0.0)
    keys = dropout_keys if dropout_rate > 0.0 else None  # None: no dropout
    layout = compute.resolved_layout()
    if layout.lstm == "rows" and layout.lstm_wavefront:
        keep = None
        if keys is not None:
            keep = jnp.stack([dropout_mask(xs.shape, dropout_rate, keys, k) for k in range(len(params))])
        return wavefront.run(
            params, config, xs, mask, state, keep=keep, kept=1.0 - dropout_rate, resets=resets, compute=compute
        )
    outputs, cs, hs = [], [], []
    for k, layer in enumerate(params):
        inp = dropout(xs, dropout_rate, keys, k) if keys is not None else xs
        ys, c, h = _layer(layer, config, inp, mask, state["c"][:, k], state["h"][:, k], compute=compute, resets=resets)
        if l.use_skip_connections and k > 0:
            ys = ys + inp  # both are 0 at padding
        outputs.append(ys)
        cs.append(c)
        hs.append(h)
        xs = ys
    return jnp.stack(outputs), {"c": jnp.stack(cs, 1), "h": jnp.stack(hs, 1)}


def apply(
    params: list[dict],
    config: ModelConfig,
    x: jax.Array,
    lengths: jax.Array,
    state: dict | None = None,
    *,
    compute: Compute = Compute(),
) -> tuple[jax.Array, dict]:
    """The biLSTM over sentences (inference).

    Args:
      x: ``[batch, time, P]`` float32 token vectors, ``<S>``/``</S>`` already in place.
      lengths: ``[batch] int32`` tokens per row, markers included (0: the row is skipped).
      state: initial state (see module doc), or None for zeros.

    Returns:
      ``([n_layers, batch, time, 2P]`` outputs, forward then backward on the last axis, exactly 0
      at padding; the final state: per row, forward after ``</S>``, backward after ``<S>``).
    """
    mask = jnp.arange(x.shape[1])[None, :] < lengths[:, None]
    xs = jnp.stack([x, reverse_within_length(x, lengths)])
    out, new_state = run(params, config, xs, mask, state, compute=compute)
    bwd = jax.vmap(reverse_within_length, in_axes=(0, None))(out[:, 1], lengths)
    return jnp.concatenate([out[:, 0], bwd], axis=-1), new_state


def dropout_mask(shape: tuple[int, ...], rate: float, row_keys: jax.Array, salt: int) -> jax.Array:
    """``[2, B, T, F]`` bool, True where ``dropout`` keeps ``x`` of that shape; row b's mask comes
    from ``row_keys[b]`` and ``salt``, so it does not depend on which device holds the row."""

    def row_mask(key):
        return jax.random.bernoulli(jax.random.fold_in(key, salt), 1.0 - rate, (shape[0],) + tuple(shape[2:]))

    return jax.vmap(row_mask, out_axes=1)(row_keys)


def dropout(x: jax.Array, rate: float, row_keys: jax.Array, salt: int) -> jax.Array:
    """Inverted dropout on ``x [2, B, T, F]``; the mask is ``dropout_mask``'s."""
    return jnp.where(dropout_mask(x.shape, rate, row_keys, salt), x / (1.0 - rate), 0.0)
