"""elmo_jax._util.hlo: what a compiled program's text says about it."""

import jax
import jax.numpy as jnp

from elmo_jax._util.hlo import scatter_census


def test_scatter_census_counts_scatters_by_uniqueness_and_the_sorts_and_loops_of_their_rewrites():
    def f(table, ids, rows, x):
        repeated = table.at[ids].add(rows)  # ids may repeat: not unique
        distinct = table.at[jnp.arange(3)].add(rows, unique_indices=True)
        ordered = jnp.sort(x)
        looped = jax.lax.while_loop(lambda c: c[0] < 5, lambda c: (c[0] + 1, c[1] * 2.0), (0, x))[1]
        return repeated, distinct, ordered, looped

    args = (jnp.zeros((10, 4)), jnp.array([1, 1, 2]), jnp.ones((3, 4)), jnp.arange(8.0)[::-1])
    # The HLO before XLA's passes: the same op lines as a compiled program's text, whatever this
    # backend makes of a scatter (under the suite's XLA flags the CPU turns them into loops).
    census = scatter_census(jax.jit(f).lower(*args).as_text(dialect="hlo"))
    assert census["scatter"] >= 2 and census["scatter unique"] >= 1
    assert census["scatter unique"] < census["scatter"]  # the repeated ids' scatter is counted apart
    assert census["sort"] >= 1 and census["while"] >= 1
    # Negative control: a program without any of them counts none.
    plain = scatter_census(jax.jit(lambda x: x * 2).lower(args[3]).as_text(dialect="hlo"))
    assert plain == {"scatter": 0, "scatter unique": 0, "sort": 0, "while": 0}
