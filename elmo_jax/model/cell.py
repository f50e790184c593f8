"""One step of TF's LSTMCell with projection and clipping, forward and backward: what the rows and
columns layouts (``elmo_jax.model.lstm``) and the wavefront (``elmo_jax.model.wavefront``) share.

The forward takes the gate pre-activations ``z`` (gates i, j, f, o, bilm-tf's order), so that each
caller does its matmuls its own way (before the scan, inside it, batched over layers); the
backward is the step's hand-written gradient, and ``backward_matmul`` the one matmul of every
hand-written backward pass (the tests' negative controls drop its terms one at a time).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from elmo_jax.config import ModelConfig
from elmo_jax.model.compute import Compute


def clip(x: jax.Array, value) -> jax.Array:
    """``x`` clipped to ``[-value, value]``; unclipped where ``value`` is 0 or None (bilm-tf's
    ``cell_clip`` and ``proj_clip``; ``jnp.clip``'s gradient is 0 outside)."""
    return jnp.clip(x, -value, value) if value else x


def gates(z: jax.Array, c: jax.Array, cell_clip, axis: int) -> tuple[jax.Array, jax.Array]:
    """The cell's elementwise part, from gate pre-activations ``z`` (float32, ``c``'s shape with
    ``4D`` along ``axis``: gates i, j, f, o) and the previous cell state ``c`` (``D`` along
    ``axis``: ``[..., B, D]`` in the rows layout, ``[..., D, B]`` in the columns one): the new
    (clipped) cell state and the projection's input ``sigmoid(o) * tanh(c_new)``, each shaped
    like ``c``."""
    i, j, f, o = jnp.split(z, 4, axis=axis)
    c_new = clip(jax.nn.sigmoid(f + 1.0) * c + jax.nn.sigmoid(i) * jnp.tanh(j), cell_clip)
    return c_new, jax.nn.sigmoid(o) * jnp.tanh(c_new)


def forward(z: jax.Array, c: jax.Array, h: jax.Array, m: jax.Array, project, *, config: ModelConfig, axis: int):
    """TF's LSTMCell step from the gate pre-activations ``z`` (gates i, j, f, o along ``axis``; see
    ``gates`` for ``z`` and ``c``), the state ``h`` (``P`` along ``axis``), the mask ``m`` (bool,
    broadcasting against ``c``: False at padding) and ``project`` (``[.., D] -> [.., P]`` along
    ``axis``): ``((c, h), output)`` as a scan step returns them (``output`` shaped like ``h``,
    0 at padding), and the projection before its clip (float32, shaped like ``h``)."""
    l = config.lstm
    c_new, a = gates(z, c, l.cell_clip, axis)
    p = project(a).astype(jnp.float32)
    h_new = clip(p, l.proj_clip)
    # Padding never enters the recurrence: the state passes through and the output is 0.
    return ((jnp.where(m, c_new, c), jnp.where(m, h_new, h)), jnp.where(m, h_new, 0.0)), p


def backward_matmul(spec: str, a: jax.Array, b: jax.Array, compute: Compute) -> jax.Array:
    """A backward-pass matmul: inputs in ``compute.dtype`` at ``compute.precision``, float32 out
    (float32 accumulation for the sums over all steps; the forward's matmuls return
    ``compute.dtype``, widened to float32 for the cell)."""
    return jnp.einsum(
        spec,
        a.astype(compute.dtype),
        b.astype(compute.dtype),
        precision=compute.precision,
        preferred_element_type=jnp.float32,
    )


def backward(dout, dc, dh, z, c, p, m, w_proj, *, config: ModelConfig, compute: Compute) -> tuple:
    """The backward pass of ``forward`` in the rows layout (any leading axes ``...`` before the
    rows: ``w_proj [..., D, P]``), from the gradients of the step's output ``dout`` and of the
    state it passed on (``dc [..., B, D]``, ``dh [..., B, P]``) and what its forward saved
    (``z [..., B, 4D]``, ``c [..., B, D]`` after any reset, the unclipped projection
    ``p [..., B, P]``, the mask ``m`` broadcasting against them). Returns, all float32, the gate
    pre-activations' gradient ``dz [..., B, 4D]``, the gradient of the cell state the step started
    from ``dc_in [..., B, D]``, the unclipped projection's ``dp [..., B, P]`` and the projection's
    input ``a [..., B, D]``. The recurrent part of the gradient of ``h`` is the caller's, as only
    it knows how ``h`` entered the gates' matmul."""
    l = config.lstm
    dh_new = jnp.where(m, dh + dout, 0.0)  # the step's h reaches both its output and its state
    dp = jax.vjp(lambda q: clip(q, l.proj_clip), p)[1](dh_new)[0]
    (_, a), gates_vjp = jax.vjp(lambda z, c: gates(z, c, l.cell_clip, -1), z, c)
    dz, dc_in = gates_vjp((jnp.where(m, dc, 0.0), backward_matmul("...bp,...cp->...bc", dp, w_proj, compute)))
    # At padding the state passed through (and the gates' cotangents above are 0).
    return dz, dc_in + jnp.where(m, 0.0, dc), dp, a
