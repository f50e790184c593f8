"""elmo_jax.model.gather: gathers whose gradient sums repeated rows by sorting the row indices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from elmo_jax.model.gather import sorted_row_sums, take_rows
from elmo_jax.model.layout import Layout


def _longest_run(idx: np.ndarray) -> int:
    _, counts = np.unique(idx, return_counts=True)
    return int(counts.max()) if len(counts) else 0


@pytest.mark.parametrize(
    ("idx", "n_rows", "trail"),
    [
        (np.array([3]), 5, (4,)),
        (np.array([2, 0, 2, 2, 1, 0, 2]), 4, (3,)),
        (np.full(37, 6), 9, (2,)),  # one run of 37: every doubling step is needed (32 < 37)
        (np.random.default_rng(0).zipf(1.3, 1000) % 300, 300, (5,)),
        (np.random.default_rng(1).integers(0, 50, 200), 50, ()),  # 1-D rows (the softmax bias)
        (np.zeros(0, int), 4, (3,)),
    ],
    ids=["one", "repeats", "one-long-run", "zipf", "scalars", "empty"],
)
def test_sorted_row_sums_equal_a_scatter_add(idx, n_rows, trail):
    rng = np.random.default_rng(2)
    rows = rng.standard_normal((len(idx), *trail)).astype(np.float32)
    expect = np.zeros((n_rows, *trail))
    np.add.at(expect, idx, rows.astype(np.float64))
    got = np.asarray(jax.jit(sorted_row_sums, static_argnums=2)(jnp.asarray(rows), jnp.asarray(idx), n_rows))
    assert got.shape == expect.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, expect, rtol=1e-5, atol=1e-5)
    absent = np.setdiff1d(np.arange(n_rows), idx)
    np.testing.assert_array_equal(got[absent], 0.0)
    if len(idx) > 1 and _longest_run(idx) > 1:
        # Negative control: the repeats matter here (keeping one row per index is not the sum).
        last = np.zeros((n_rows, *trail))
        last[idx] = rows
        assert not np.allclose(got, last, atol=1e-3)


@pytest.mark.parametrize("shape", [(3, 4, 5), (7,)])
def test_take_rows_is_the_same_function_either_way(shape):
    rng = np.random.default_rng(3)
    table = jnp.asarray(rng.standard_normal((20, 6)), jnp.float32)
    idx = jnp.asarray(rng.integers(0, 20, shape))
    weight = jnp.asarray(rng.standard_normal((*shape, 6)), jnp.float32)

    def f(t, sums):
        return jnp.sum(jnp.tanh(take_rows(t, idx, sums=sums)) * weight)

    np.testing.assert_array_equal(take_rows(table, idx, sums="sorted"), table[idx])
    by_scatter = jax.grad(f)(table, "scatter")
    by_sort = jax.jit(jax.grad(f), static_argnums=1)(table, "sorted")
    np.testing.assert_allclose(by_sort, by_scatter, rtol=1e-5, atol=1e-6)
    assert np.count_nonzero(np.abs(by_scatter).sum(axis=1)) == len(np.unique(np.asarray(idx)))


def test_a_wrong_sums_name_is_named():
    with pytest.raises(ValueError, match="sums must be one of"):
        take_rows(jnp.zeros((2, 2)), jnp.zeros(3, int), sums="atomic")
    with pytest.raises(ValueError, match="row_sums must be one of"):
        Layout(row_sums="atomic")
    with pytest.raises(ValueError, match="lstm_time_axis must be 0 or 2"):
        Layout(lstm_time_axis=1)


@pytest.mark.parametrize("sums", ["scatter", "sorted"])
def test_a_numpy_table_is_taken_under_jit(sums):
    # Params loaded from files are NumPy arrays; indexing one with a traced index would fail.
    table = np.arange(12, dtype=np.float32).reshape(6, 2)
    got = jax.jit(lambda idx: take_rows(table, idx, sums=sums))(jnp.array([[5, 0], [5, 2]]))
    np.testing.assert_array_equal(got, table[[[5, 0], [5, 2]]])
