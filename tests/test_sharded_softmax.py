"""The row-split softmax: its storage order, the host's fetch plan, and the exchange on 2 devices."""

import re

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from elmo_jax.training.sharded_softmax import (
    MIN_CAPACITY,
    ROW_MULTIPLE,
    LayoutError,
    RowLayout,
    SparseAdagrad,
    capacity_bucket,
    capacity_headroom,
    fetch_rows,
    plan_fetch,
    return_grads,
)
from elmo_jax.training.softmax import sample_log_uniform_unique


def _log_uniform_draws(v: int, n: int, seed: int = 0) -> np.ndarray:
    u = np.random.default_rng(seed).random(n)
    return np.clip(np.floor(np.exp(u * np.log(v + 1.0))).astype(np.int64) - 1, 0, v - 1)


@pytest.mark.parametrize("v", [32, 50_000, 793_471])
def test_layout_is_a_permutation_padded_to_the_row_multiple(v):
    layout = RowLayout.for_vocab(v)
    assert layout.padded % ROW_MULTIPLE == 0 and 0 <= layout.padded - v < ROW_MULTIPLE
    slots = layout.slots(np.arange(layout.padded))
    assert np.array_equal(np.sort(slots), np.arange(layout.padded))  # a permutation of all slots
    assert layout.valid().sum() == v
    table = np.random.default_rng(0).normal(size=(v, 3)).astype(np.float32)
    stored = layout.to_stored(table, fill=7.0)
    np.testing.assert_array_equal(layout.from_stored(stored), table)
    assert np.all(stored[~layout.valid()] == 7.0)
    assert RowLayout.for_vocab(v) == layout and RowLayout(**layout.to_dict()) == layout


def test_a_layout_that_is_no_permutation_is_refused_and_a_damaged_one_in_a_checkpoint_is_one_line():
    """A layout is read back from each checkpoint's metadata: one that maps two ids to one slot (a
    multiplier sharing a factor with the padded size), pads to no multiple of the rows, or has
    fewer slots than words, would put rows where no reader finds them."""
    from elmo_jax.training.checkpoint import CheckpointError
    from elmo_jax.training.run_dir import saved_layout
    from elmo_jax.training.sharded_softmax import LayoutError

    good = RowLayout.for_vocab(50_000)
    for bad in (dict(multiplier=2), dict(padded=good.padded + 1), dict(vocab_size=good.padded + 1),
                dict(multiplier=0), dict(vocab_size="50000"), dict(multiplier=True)):  # fmt: skip
        with pytest.raises(LayoutError, match="row layout"):
            RowLayout(**{**good.to_dict(), **bad})
    meta = {"format": 2, "softmax_layout": {**good.to_dict(), "multiplier": 2}}
    with pytest.raises(CheckpointError, match=r"^a checkpoint's softmax_layout is unreadable \(not a row layout"):
        saved_layout(meta)
    with pytest.raises(CheckpointError, match="unreadable"):
        saved_layout({"format": 2, "softmax_layout": {"vocab_size": 5}})
    assert saved_layout({"format": 2, "softmax_layout": good.to_dict()}) == good  # the control
    assert saved_layout({"format": 1}) is None


def test_layout_spreads_the_sampled_ids_over_the_owners():
    """What an owner serves per step is the distinct rows asked of it: the candidates (distinct
    per draw) of 8 steps, at the released vocabulary."""
    v = 793_471
    layout = RowLayout.for_vocab(v)
    rng = np.random.default_rng(0)
    ids = np.concatenate([sample_log_uniform_unique(rng, 8192, v)[0] for _ in range(8)])
    for n, bound in ((8, 1.1), (64, 1.2)):
        per_owner = layout.padded // n
        share = np.bincount(layout.slots(ids) // per_owner, minlength=n) / len(ids)
        assert share.max() < bound / n, (n, share.max() * n)
        # The control: contiguous blocks of ids put most of them on the first owner.
        contiguous = np.bincount(ids // per_owner, minlength=n) / len(ids)
        assert contiguous[0] > 5 / n, (n, contiguous[0] * n)
    with pytest.raises(LayoutError, match="cannot be split evenly over 5 devices"):
        layout.rows_per_device(5)


def test_capacity_buckets_cover_every_count_with_few_shapes():
    sizes = {capacity_bucket(k) for k in range(1, 5000)}
    assert all(capacity_bucket(k) >= k for k in range(1, 5000))
    assert len(sizes) <= 40 and min(sizes) == MIN_CAPACITY == 64
    # Above the minimum, at most a quarter padding.
    assert max(capacity_bucket(k) / k for k in range(MIN_CAPACITY + 1, 50_000)) <= 1.25


def _plan(v=5000, n=4, d_local=2, s=64, b=3, t=5, capacity=0, seed=0):
    rng = np.random.default_rng(seed)
    cands = np.stack([np.stack([sample_log_uniform_unique(rng, s, v)[0] for _ in range(2)]) for _ in range(d_local)])
    targets = _log_uniform_draws(v, d_local * 2 * b * t, seed + 1).reshape(d_local, 2, b, t)
    layout = RowLayout.for_vocab(v)
    plan, cap = plan_fetch(cands, targets, layout, n, capacity)
    return layout, cands, targets, plan, cap


def test_plan_fetch_asks_each_owner_for_each_row_once_and_finds_every_row():
    n = 4
    layout, cands, targets, plan, cap = _plan(n=n)
    per_owner = layout.padded // n
    table = np.arange(layout.padded, dtype=np.float64)  # a row's value is its slot
    for d in range(cands.shape[0]):
        fetch = plan["fetch"][d]
        used = fetch < per_owner
        asked = (np.arange(n)[:, None] * per_owner + fetch)[used]
        wanted = layout.slots(np.union1d(cands[d].ravel(), targets[d].ravel()))
        assert np.array_equal(np.sort(asked), np.sort(wanted))  # every needed row once, no other
        # What owner o returns for entry (o, c) lands at o * cap + c of the fetched rows.
        fetched = np.where(used, table[np.minimum(np.arange(n)[:, None] * per_owner + fetch, layout.padded - 1)], -1)
        fetched = fetched.reshape(-1)
        np.testing.assert_array_equal(fetched[plan["cand_index"][d]], layout.slots(cands[d]))
        np.testing.assert_array_equal(fetched[plan["target_index"][d]], layout.slots(targets[d]))
    need = max(
        np.bincount(layout.slots(np.union1d(cands[d].ravel(), targets[d].ravel())) // per_owner, minlength=n).max()
        for d in range(cands.shape[0])
    )
    assert cap == capacity_bucket(need + capacity_headroom(need))
    # A capacity that fits is kept, even one far larger (another process needed it), and the plan
    # stays right; one that does not fit grows as from nothing.
    _, _, _, big, cap2 = _plan(n=n, capacity=cap * 3)
    assert cap2 == cap * 3 and big["fetch"].shape[-1] == cap * 3
    assert _plan(n=n, capacity=need)[4] == need and _plan(n=n, capacity=need - 1)[4] == cap


def test_exchange_on_two_devices_equals_numpy():
    assert jax.local_device_count() == 2
    n, p = 2, 3
    mesh = Mesh(np.array(jax.devices()[:n]), ("data",))
    layout, cands, targets, plan, cap = _plan(v=3000, n=n, d_local=n, seed=3)
    per_owner = layout.padded // n
    rng = np.random.default_rng(1)
    table = {
        "w": rng.normal(size=(layout.padded, p)).astype(np.float32),
        "b": rng.normal(size=layout.padded).astype(np.float32),
    }
    acc = {k: (1.0 + rng.random(x.shape)).astype(np.float32) for k, x in table.items()}
    # Each device's gradient w.r.t. each of its fetched rows; zero on unused entries, as in a step.
    used = plan["fetch"] < per_owner  # [D, n, C]
    grads = {
        "w": rng.normal(size=(n, n * cap, p)).astype(np.float32) * used.reshape(n, -1, 1),
        "b": rng.normal(size=(n, n * cap)).astype(np.float32) * used.reshape(n, -1),
    }
    opt = SparseAdagrad(learning_rate=0.3)

    def per_device(table, acc, fetch, grads):
        rows, received = fetch_rows(table, fetch[0], "data")
        ids, sums = return_grads({k: g[0] for k, g in grads.items()}, received, per_owner, "data")
        new = {k: opt.apply(table[k], acc[k], ids, sums[k]) for k in table}
        return (
            {k: r[None] for k, r in rows.items()},
            {k: t for k, (t, _) in new.items()},
            {k: a for k, (_, a) in new.items()},
        )

    spec = P("data")
    fn = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=spec, out_specs=spec))
    put = lambda x: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    rows, new_table, new_acc = jax.device_get(fn(put(table), put(acc), put(plan["fetch"]), put(grads)))

    slots_of = lambda d: np.minimum(np.arange(n)[:, None] * per_owner + plan["fetch"][d], layout.padded - 1)  # noqa: E731
    total = {k: np.zeros_like(x, np.float64) for k, x in table.items()}
    for d in range(n):
        for k in table:
            expect = np.where(used[d].reshape(n, cap, *([1] * (table[k].ndim - 1))), table[k][slots_of(d)], 0).reshape(
                (n * cap,) + table[k].shape[1:]
            )
            np.testing.assert_array_equal(rows[k][d], expect)  # the owners' rows, in plan order
            np.add.at(total[k], slots_of(d)[used[d]], grads[k][d][used[d].reshape(-1)])
    for k in table:
        a = acc[k] + total[k] ** 2
        expect = table[k] - 0.3 * total[k] / np.sqrt(a)
        np.testing.assert_allclose(new_table[k], expect, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(new_acc[k], a, rtol=1e-6)
        touched = np.zeros(layout.padded, bool)
        for d in range(n):
            touched[slots_of(d)[used[d]]] = True
        np.testing.assert_array_equal(new_table[k][~touched], table[k][~touched])  # no other row moved
        np.testing.assert_array_equal(new_acc[k][~touched], acc[k][~touched])
    # Both devices asked for some rows: those sums really added two devices' gradients.
    both = np.intersect1d(slots_of(0)[used[0]], slots_of(1)[used[1]])
    assert len(both) > 10


def _scatters(stablehlo: str) -> list[tuple[str, str, bool]]:
    """(operand type, updates type, unique_indices) of every scatter in StableHLO text."""
    out = []
    for m in re.finditer(r'"stablehlo\.scatter"\(', stablehlo):
        head = stablehlo[m.end() : stablehlo.index("({", m.end())]
        signature = re.search(r"\}\) : \((tensor<[^>]*>), tensor<[^>]*>, (tensor<[^>]*>)\)", stablehlo[m.end() :])
        out.append((signature.group(1), signature.group(2), "unique_indices = true" in head))
    return out


def test_plan_fetch_lists_are_distinct_with_every_unused_entry_out_of_range():
    n = 4
    layout, _, _, plan, cap = _plan(n=n)
    per_owner = layout.padded // n
    for lists in plan["fetch"]:
        for entries in lists:
            assert len(np.unique(entries)) == cap
            unused = entries[entries >= per_owner]
            np.testing.assert_array_equal(np.sort(unused), per_owner + np.arange(cap - len(unused), cap))


def _lowered_step(tmp_path, compute=None) -> tuple[str, object]:
    import argparse

    from bench_train import device_batches, model_and_config, zipf_corpus

    from elmo_jax.model.compute import Compute
    from elmo_jax.training.step import AXIS, init_state, make_train_step

    ns = argparse.Namespace(shape="tiny", batch=2, negatives=16, steps=0, reset_state_prob=0.1)
    model, tc = model_and_config(ns, 500)
    mesh = Mesh(np.array(jax.devices()[:1]), (AXIS,))
    vocab, path = zipf_corpus(str(tmp_path), 500, 2000)
    batches, _, _ = device_batches(ns, model, tc, vocab, path, mesh)
    state = jax.eval_shape(lambda: init_state(jax.random.PRNGKey(0), model, tc, tc.batch_size))
    step = make_train_step(model, tc, mesh, compute=compute or Compute())
    return step.lower(state, batches[0]).as_text(), tc


def test_the_train_step_marks_its_softmax_scatters_unique(tmp_path):
    """Under --xla_gpu_exclude_nondeterministic_ops (set by `elmo-jax train` on GPUs) XLA rewrites
    every scatter it cannot show to be deterministic; one marked unique_indices it leaves alone.
    The scatters into the [V_pad, P] table and its accumulators must carry the mark, and so must
    the candidates' row gradients (a unique draw: distinct rows)."""
    text, tc = _lowered_step(tmp_path)
    scatters = _scatters(text)
    padded = RowLayout.for_vocab(500).padded
    table = [unique for operand, _, unique in scatters if operand.startswith(f"tensor<{padded}x")]
    assert len(table) >= 2 and all(table), scatters  # the softmax's weights and their accumulators
    # Weights and biases, both directions: updates [S, P] and [S].
    s = tc.n_negative_samples_batch
    candidates = [unique for _, updates, unique in scatters if re.match(rf"tensor<{s}(x\d+)?xf32>", updates)]
    assert len(candidates) == 4 and all(candidates), scatters
    # Negative control: the parse tells the two apart (the gradients of repeated targets are
    # summed by scatter-adds that cannot promise distinct ids).
    assert any(not unique for _, _, unique in scatters), scatters


def test_under_the_gpu_layout_every_scatter_of_the_train_step_is_unique(tmp_path):
    """The GPU layout sums the gradients of repeated rows (targets, token vectors, char
    embeddings) by sorting their indices (elmo_jax.model.gather), so XLA's deterministic-scatter
    rewrite, which sorts every scalar of a scatter-add, finds nothing to rewrite; the backend's
    layout on this CPU keeps plain scatter-adds (the negative control above)."""
    from elmo_jax.model.compute import Compute
    from elmo_jax.model.layout import BY_BACKEND

    text, _ = _lowered_step(tmp_path, Compute(layout=BY_BACKEND["gpu"]))
    scatters = _scatters(text)
    assert len(scatters) >= 8 and all(unique for _, _, unique in scatters), scatters
