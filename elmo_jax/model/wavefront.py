"""The biLSTM's layers in one wavefront scan (``Layout.lstm_wavefront``, rows layout only).

``lstm.run`` runs its layers one after the other: ``n_layers x T`` sequential steps, each a small
matmul for both directions. Layer ``l`` at step ``t`` needs only layer ``l - 1`` at step ``t``
and itself at ``t - 1``, so at wavefront step ``k`` every layer ``l`` can run its step
``t = k - l`` together: ``T + n_layers - 1`` sequential steps, each one batched matmul over
``[n_layers, 2]`` (layer, direction) for the gates and one for the projections. That halves the
sequential steps of the 2-layer biLM and doubles the rows of each kernel, for a GPU whose LSTM
steps are bound by latency rather than by their FLOPs; the price is that every layer's input
half of ``W_0`` runs inside the loop (``[u, h] @ W_0``, ``K = in + P``) rather than as one matmul
before it, which moves no FLOPs but reads each ``W_0`` once a step.

A layer's steps outside ``0 <= t < T`` are padding steps (the state passes through, the output is
0), so the loop has no special first or last steps. Dropout on a layer's input uses the same
masks as ``lstm.dropout`` (``lstm.dropout_mask``), and a skip connection adds a layer's input to
its output, as ``lstm.run`` does; ``tests/test_wavefront.py`` compares outputs, final states and
gradients with it. The gradient is written by hand as in ``lstm._rows_scan_vjp``: the reverse
scan carries the state's gradients and the gradient of each layer's output that the next layer's
input sends back, and emits each step's gate and projection gradients; the weight gradients are
then one matmul each over all steps and rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from elmo_jax.config import ModelConfig
from elmo_jax.model import cell
from elmo_jax.model.compute import Compute


def run(
    params: list[dict],
    config: ModelConfig,
    xs: jax.Array,
    mask: jax.Array,
    state: dict,
    *,
    keep: jax.Array | None,
    kept: float,
    resets: jax.Array | None,
    compute: Compute,
) -> tuple[jax.Array, dict]:
    """``lstm.run``'s layers as one wavefront scan, from its arguments once it has masked ``xs``
    (0 at padding) and drawn each layer's dropout mask: ``keep [L, 2, B, T, P]`` bool (None: no
    dropout), ``kept`` the keep probability. Returns what ``lstm.run`` returns."""
    n, t = len(params), xs.shape[2]
    # Layer l's step t runs at wavefront step k = t + l: each layer's per-step inputs shift by l.
    steps = t + n - 1
    m = jnp.stack([_shift(mask[:, :, None], i, steps) for i in range(n)], axis=1)  # [K, L, B, 1]
    r = None
    if resets is not None:
        r = jnp.stack([_shift(resets[..., None], i, steps) for i in range(n)], axis=1)  # [K, L, 2, B, 1]
    kp = None if keep is None else jnp.stack([_shift(keep[i], i, steps) for i in range(n)], axis=1)  # [K, L, 2, B, P]
    x0 = jnp.moveaxis(jnp.pad(xs, ((0, 0), (0, 0), (0, n - 1), (0, 0))), 2, 0)  # [K, 2, B, P]
    w = jnp.stack([jnp.concatenate([layer["w_x"], layer["w_h"]], axis=1) for layer in params])  # [L, 2, in + P, 4D]
    bias = jnp.stack([layer["b"] for layer in params])[:, :, None, :]  # [L, 2, 1, 4D]
    w_proj = jnp.stack([layer["w_proj"] for layer in params])  # [L, 2, D, P]
    unroll = compute.resolved_layout().unroll
    # A layout that writes out a whole window (unroll >= T) writes out the wavefront's T + L - 1
    # steps too, rather than a loop of one unrolled body and a remainder.
    scan = _scan_vjp(config, compute, steps if unroll >= t else unroll, kept)
    c0, h0 = state["c"].transpose(1, 0, 2, 3), state["h"].transpose(1, 0, 2, 3)  # [L, 2, B, ...]
    outs, c, h = scan(w, bias, w_proj, x0, m, r, kp, c0, h0)  # outs [K, L, 2, B, P]
    ys = jnp.stack([outs[i : i + t, i] for i in range(n)])  # [L, T, 2, B, P]
    return ys.transpose(0, 2, 3, 1, 4), {"c": c.transpose(1, 0, 2, 3), "h": h.transpose(1, 0, 2, 3)}


def _shift(a: jax.Array, by: int, steps: int) -> jax.Array:
    """``a [..., T, F]`` bool (time second to last) -> ``[steps, ..., F]``: step ``k`` holds time
    ``k - by``, and False outside ``0 <= k - by < T`` (a padding step)."""
    pad = [(0, 0)] * a.ndim
    pad[-2] = (by, steps - a.shape[-2] - by)
    return jnp.moveaxis(jnp.pad(a, pad, constant_values=False), -2, 0)


def _forward(w, bias, w_proj, x0, m, r, kp, c0, h0, *, config: ModelConfig, compute: Compute, unroll: int, kept, save):
    """The wavefront scan: ``x0 [K, 2, B, P]`` layer 0's inputs, ``m [K, L, B, 1]``, ``r`` and ``kp``
    (or None) each layer's resets and dropout keep masks at its own step, state ``[L, 2, B, ...]``.
    Returns ``(outs [K, L, 2, B, P], c, h)``, and with ``save`` also per step the matmul's input
    ``[u, h]``, the gate pre-activations, the cell state the step started from and the unclipped
    projection (what ``_scan_vjp``'s backward reads)."""
    dtype, precision = compute.dtype, compute.precision
    wc, wpc = w.astype(dtype), w_proj.astype(dtype)
    skip = _skip(config, w.shape[0])

    def project(a):
        return jnp.einsum("ldbc,ldcp->ldbp", a.astype(dtype), wpc, precision=precision)

    def step(carry, inputs):
        c, h, prev = carry  # [L, 2, B, D], [L, 2, B, P], each layer's last output [L, 2, B, P]
        x, mk, rk, keep = inputs
        inp = jnp.concatenate([x[None], prev[:-1]])  # layer l's input: layer l - 1's last output
        u = inp if keep is None else jnp.where(keep, inp / kept, 0.0)
        if rk is not None:
            c, h = jnp.where(rk, 0.0, c), jnp.where(rk, 0.0, h)
        uh = jnp.concatenate([u, h], axis=-1)
        z = jnp.einsum("ldbi,ldig->ldbg", uh.astype(dtype), wc, precision=precision).astype(jnp.float32) + bias
        ((c_next, h_next), y), pr = cell.forward(
            z, c, h, mk[:, None], project, config=config, axis=-1
        )  # mask [L, 1, B, 1]
        out = y + skip * u  # a skip adds the layer's input (0 at padding)
        return (c_next, h_next, out), ((out, (uh, z, c, pr)) if save else out)

    prev0 = jnp.zeros_like(h0)
    (c, h, _), ys = jax.lax.scan(step, (c0, h0, prev0), (x0, m, r, kp), unroll=unroll)
    return (*ys, c, h) if save else (ys, c, h)


def _skip(config: ModelConfig, n: int) -> jax.Array:
    """``[L, 1, 1, 1]``: 1 where a layer's output adds its input (every layer but the first, with
    skip connections), else 0."""
    skip = [0.0] + [1.0 if config.lstm.use_skip_connections else 0.0] * (n - 1)
    return jnp.asarray(skip, jnp.float32)[:, None, None, None]  # not float64 under jax_enable_x64: the scan's carry


def _scan_vjp(config: ModelConfig, compute: Compute, unroll: int, kept: float):
    """``_forward`` with a hand-written backward pass (see the module doc); ``kept``: the dropout
    keep probability, by which a kept input is divided (as ``lstm.dropout`` does)."""
    fwd_scan = functools.partial(_forward, config=config, compute=compute, unroll=unroll, kept=kept)

    @jax.custom_vjp
    def scan(w, bias, w_proj, x0, m, r, kp, c0, h0):
        return fwd_scan(w, bias, w_proj, x0, m, r, kp, c0, h0, save=False)

    def fwd(w, bias, w_proj, x0, m, r, kp, c0, h0):
        outs, saved, c, h = fwd_scan(w, bias, w_proj, x0, m, r, kp, c0, h0, save=True)
        return (outs, c, h), (w, w_proj, m, r, kp, saved)

    def bwd(residuals, cotangents):
        w, w_proj, m, r, kp, (uh, z, c, pr) = residuals
        douts, dc, dh = cotangents  # [K, L, 2, B, P]; the final state's [L, 2, B, D], [L, 2, B, P]
        p, skip = w_proj.shape[-1], _skip(config, w.shape[0])

        def step(carry, inputs):
            dc, dh, dnext = carry  # dnext[i]: the gradient of layer i's output sent back by layer i + 1's input
            dout, z, c, pr, mk, rk, keep = inputs
            mk = mk[:, None]
            dout = dout + jnp.concatenate([dnext[1:], jnp.zeros_like(dnext[:1])])
            dz, dc_in, dpr, a = cell.backward(dout, dc, dh, z, c, pr, mk, w_proj, config=config, compute=compute)
            duh = cell.backward_matmul("ldbg,ldig->ldbi", dz, w, compute)
            du, dh_in = duh[..., :p] + skip * dout, jnp.where(mk, 0.0, dh) + duh[..., p:]
            if rk is not None:
                dc_in, dh_in = jnp.where(rk, 0.0, dc_in), jnp.where(rk, 0.0, dh_in)
            dinp = du if keep is None else jnp.where(keep, du / kept, 0.0)
            # dinp[0] is layer 0's input's; dinp[i] reaches layer i - 1's output one step earlier.
            return (dc_in, dh_in, dinp), (dz, dpr, a, dinp[0])

        zero = jnp.zeros_like(dh)  # zeros_like: under shard_map it varies over the mesh as dh does
        (dc0, dh0, _), (dz, dpr, a, dx0) = jax.lax.scan(
            step, (dc, dh, zero), (douts, z, c, pr, m, r, kp), unroll=unroll, reverse=True
        )
        dw = cell.backward_matmul("kldbi,kldbg->ldig", uh, dz, compute)
        dbias = dz.sum(axis=(0, 3))[:, :, None, :]
        dw_proj = cell.backward_matmul("kldbc,kldbp->ldcp", a, dpr, compute)
        return dw, dbias, dw_proj, dx0, None, None, None, dc0, dh0

    scan.defvjp(fwd, bwd)
    return scan
