"""Row gathers whose gradient sums repeated rows without a scatter-add.

``table[idx]`` differentiates into a scatter-add of the output's cotangent into the table's rows.
On a GPU that is a loop of atomics: fast, but the order in which a repeated row's terms meet
varies from run to run. ``elmo-jax train`` asks XLA for deterministic scatters
(``--xla_gpu_exclude_nondeterministic_ops``), and XLA then sorts the scatter's *scalar* updates:
a ``[5,120, 512]`` cotangent is a 2.6-million-element sort, about 1 ms on an H200 (the step's
three such sorts took 2.5 ms of its 16, ``benchmarks/results/gpu_h200/s4_row_sums.txt``).

``take_rows(..., sums="sorted")`` sums the cotangent rows itself: it sorts the ``N`` row indices
(not the ``N x D`` scalars), adds each row to its run of equal indices in ``ceil(log2 N)``
shifted adds (a segmented Hillis-Steele scan), and writes each run's total with a scatter whose
indices are distinct. Every step is deterministic by construction, with or without the XLA flag.
The forward pass is the same gather; only the order of the floating-point sums differs from the
scatter-add's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

SUMS = ("scatter", "sorted")


def take_rows(table: jax.Array, idx: jax.Array, *, sums: str = "scatter") -> jax.Array:
    """``table[idx]``: ``[R, ...]`` rows at ``idx [...] int`` (each in ``[0, R)``) ->
    ``[*idx.shape, ...]``. ``sums``: how the gradient adds repeated rows, "scatter" (XLA's
    scatter-add) or "sorted" (``sorted_row_sums``); the same value either way."""
    table = jnp.asarray(table)  # a NumPy table would index with a tracer, and fail
    if sums == "scatter":
        return table[idx]
    if sums != "sorted":
        raise ValueError(f"take_rows: sums must be one of {SUMS}, got {sums!r}")
    flat = _take_sorted(table.shape[0], table, idx.reshape(-1))
    return flat.reshape(*idx.shape, *table.shape[1:])


# The row count is static (a shape): a non-differentiable argument, not a residual.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _take_sorted(n_rows: int, table: jax.Array, idx: jax.Array) -> jax.Array:
    return table[idx]


def _take_sorted_fwd(n_rows, table, idx):
    return table[idx], idx


def _take_sorted_bwd(n_rows, idx, g):
    return sorted_row_sums(g, idx, n_rows), None


_take_sorted.defvjp(_take_sorted_fwd, _take_sorted_bwd)


def sorted_row_sums(rows: jax.Array, idx: jax.Array, n_rows: int) -> jax.Array:
    """``[n_rows, ...]``: the sum of the ``rows [N, ...]`` whose ``idx [N] int`` (in ``[0, n_rows)``)
    is each row number; zero where none is. What ``zeros.at[idx].add(rows)`` computes, in an order
    fixed by the indices alone."""
    n = idx.shape[0]
    if n == 0:
        return jnp.zeros((n_rows, *rows.shape[1:]), rows.dtype)
    order = jnp.argsort(idx, stable=True)
    keys = idx[order]
    x = rows[order]
    trail = (1,) * (rows.ndim - 1)
    shift = 1
    while shift < n:
        # After this step x[i] sums the rows i - 2*shift + 1 .. i of i's run: a run is contiguous
        # in sorted order, so one comparison says whether the row `shift` back is in it.
        same = (keys[shift:] == keys[:-shift]).reshape(-1, *trail)
        add = jnp.where(same, x[:-shift], jnp.zeros((), x.dtype))
        x = x + jnp.concatenate([jnp.zeros((shift, *x.shape[1:]), x.dtype), add])
        shift *= 2
    last = jnp.concatenate([keys[1:] != keys[:-1], jnp.ones((1,), bool)])
    # A run's last row holds its total. The others get distinct out-of-range targets, which the
    # scatter drops, so every target is distinct and XLA keeps it a plain scatter on any backend.
    to = jnp.where(last, keys, n_rows + jnp.arange(n, dtype=keys.dtype))
    out = jnp.zeros((n_rows, *rows.shape[1:]), rows.dtype)
    return out.at[to].set(x, mode="drop", unique_indices=True)
