"""The softmax ``[V, P]`` split by rows over the devices of a mesh, and its sparse Adagrad.

Every row has exactly one owner. A train step needs a few thousand rows (its candidates and
targets); each device asks the owners for its rows with one ``all_to_all`` of ids and one of rows,
and sends the rows' gradients back the same way. The owner sums what it receives (in a fixed
order: no atomic scatter-add decides a result) and alone applies the update. Per device that
moves ``n x C`` ids and rows, where ``C`` (the capacity per owner) is about ``R / n`` for ``R``
rows asked: the bytes per device do not grow with the device count, nor does the softmax memory
(``V_pad / n`` rows each).

**Row order.** The log-uniform sampler draws mostly low ids (at n = 8, 85 % of draws fall in the
first V/8 ids), so contiguous blocks of ids would make device 0 serve almost every fetch. Row
``k`` is stored at slot ``k * a mod V_pad`` instead, for a fixed ``a`` near ``V_pad / phi``
(a Weyl sequence: consecutive ids land far apart, every block of slots gets a fair share of the
low ids). The order depends on V only, never on the device count, so a checkpoint is one global
array that any mesh can restore. ``V_pad`` is V rounded up to a multiple of ``ROW_MULTIPLE``; the
padding slots are never sampled nor targeted, start at zero, and evaluation masks them.

Which rows a device asks for, and where each lands, is planned on the host (``plan_fetch``) from
the step's candidates and targets, which the host draws anyway: the device program has no sort
or bucketing of its own, and the capacity is always sufficient (a step that needs more than the
current capacity gets a larger one and one recompile, rare: see ``capacity_headroom``).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

# 3 x 1024: V_pad splits evenly over 1, 2, 3, 4, 6, 8, ..., 1024, 1536 or 3072 devices.
ROW_MULTIPLE = 3072
# The smallest fetch capacity. A small run's request counts (tens of rows) depend on its data and
# where in it it starts, so with capacities of 8, 10, 12, ... small runs of one model (tests, toy
# configs) each compiled a step of their own; 64 rows cost nothing to exchange, and a real run
# asks for hundreds or thousands.
MIN_CAPACITY = 64
_PHI = (math.sqrt(5.0) - 1.0) / 2.0


class LayoutError(ValueError):
    """The softmax cannot be split as asked."""


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """Where id ``k`` of a ``vocab_size``-row softmax is stored: slot ``k * multiplier % padded``."""

    vocab_size: int
    padded: int
    multiplier: int

    def __post_init__(self):
        # Read back from a checkpoint's metadata too: a layout that is not a permutation of the
        # slots would put rows where no reader finds them, silently.
        v, p, a = self.vocab_size, self.padded, self.multiplier
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (v, p, a)):
            raise LayoutError(f"a row layout is three integers; got {self}")
        if not (0 < v <= p and p % ROW_MULTIPLE == 0 and 0 < a < p and math.gcd(a, p) == 1):
            raise LayoutError(
                f"not a row layout: {self} (vocab_size <= padded, padded a multiple of {ROW_MULTIPLE}, "
                "multiplier a unit mod padded)"
            )

    @classmethod
    def for_vocab(cls, vocab_size: int) -> RowLayout:
        padded = -(-vocab_size // ROW_MULTIPLE) * ROW_MULTIPLE
        a = max(1, round(padded * _PHI))
        while math.gcd(a, padded) != 1:  # a unit mod V_pad: the map is a permutation
            a += 1
        return cls(vocab_size, padded, a)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def rows_per_device(self, n_devices: int) -> int:
        if self.padded % n_devices:
            raise LayoutError(
                f"the softmax ({self.vocab_size} rows, padded to {self.padded}) cannot be split "
                f"evenly over {n_devices} devices; use a device count that divides {ROW_MULTIPLE}"
            )
        return self.padded // n_devices

    def slots(self, ids) -> np.ndarray:
        """Storage slot of each id (any shape), int64."""
        return (np.asarray(ids, np.int64) * self.multiplier) % self.padded

    def valid(self) -> np.ndarray:
        """``[padded]`` bool: slots that hold a real row."""
        out = np.zeros(self.padded, bool)
        out[self.slots(np.arange(self.vocab_size))] = True
        return out

    def to_stored(self, table: np.ndarray, fill: float = 0.0) -> np.ndarray:
        """``[V, ...]`` in id order -> ``[V_pad, ...]`` in slot order (padding slots ``fill``)."""
        table = np.asarray(table)
        out = np.full((self.padded,) + table.shape[1:], fill, table.dtype)
        out[self.slots(np.arange(self.vocab_size))] = table
        return out

    def from_stored(self, stored) -> np.ndarray:
        """``[V_pad, ...]`` in slot order -> ``[V, ...]`` in id order."""
        return np.asarray(stored)[self.slots(np.arange(self.vocab_size))]


def capacity_bucket(n: int) -> int:
    """Rounds a per-owner request count up to ``MIN_CAPACITY``, then to a quarter octave (80, 96,
    112, 128, 160, ...): above the minimum at most 25 % of the exchanged rows are padding, and a
    run compiles for a handful of capacities."""
    if n <= MIN_CAPACITY:
        return MIN_CAPACITY
    step = 1 << max(0, (int(n) - 1).bit_length() - 3)
    return -(-n // step) * step


def capacity_headroom(need: int) -> int:
    """Rows added to a request count before it is bucketed, so that a run's first capacity is
    usually its last (each new capacity recompiles the step).

    The count moves little from step to step: ``benchmarks/fetch_capacity.py`` found a standard
    deviation of 0.30-0.43 sqrt(mean), and a maximum over 150-300 steps at most 1.45 sqrt(first
    step's count) above the first, from 11 to 12,771 rows, on 1 and 2 devices
    (``benchmarks/results/cpu/fetch_capacity.txt``). With the bucket of the first count alone, 3 of its 8
    settings recompiled a few steps in; with this headroom none did. At 12,771 rows it is 2.7 %,
    within the bucket's own padding there."""
    return math.ceil(3 * math.sqrt(need))


def next_capacity(need: int, capacity: int) -> int:
    """The fetch capacity for a step whose fullest request list is ``need`` rows long, after a run
    has used ``capacity`` (0 before its first step): kept while it fits, else grown with headroom."""
    return capacity if need <= capacity else capacity_bucket(need + capacity_headroom(need))


def plan_fetch(
    candidates: np.ndarray, targets: np.ndarray, layout: RowLayout, n_devices: int, capacity: int = 0
) -> tuple[dict, int]:
    """Which rows each local device asks each owner for, and where its loss finds them.

    ``candidates [D, 2, G, S]`` and ``targets [D, 2, B, T]`` are global ids for this process's ``D``
    devices; ``n_devices`` is the mesh size. Returns (arrays, capacity) with

    - ``fetch [D, n, C] int32``: the owner-local slots device d asks owner o for (each distinct
      row once; unused entry ``j`` holds ``V_pad / n + j``, out of range, so gathers fill and
      scatters drop, and every entry of a list is distinct: see ``SparseAdagrad.apply``)
    - ``cand_index [D, 2, G, S]``, ``target_index [D, 2, B, T] int32``: positions in the fetched rows
      ``[n * C]`` (owner-major) of each candidate and target

    ``C`` is ``next_capacity`` of the fullest request list's length: a run plans its first step
    with ``capacity=0``, then with the capacity it got, which rarely grows again.
    """
    d_local = candidates.shape[0]
    per_owner = layout.rows_per_device(n_devices)
    plans, need = [], 0
    for d in range(d_local):
        ids = np.concatenate([candidates[d].ravel(), targets[d].ravel()])
        uniq, inv = np.unique(ids, return_inverse=True)
        slots = layout.slots(uniq)
        owner, local = slots // per_owner, slots % per_owner
        order = np.argsort(owner, kind="stable")
        counts = np.bincount(owner, minlength=n_devices)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        pos = np.empty(len(uniq), np.int64)
        pos[order] = np.arange(len(uniq)) - starts[owner[order]]
        plans.append((owner, local, pos, inv))
        need = max(need, int(counts.max()))
    cap = next_capacity(need, capacity)
    fetch = np.broadcast_to(per_owner + np.arange(cap, dtype=np.int32), (d_local, n_devices, cap)).copy()
    n_cand = candidates[0].size
    cand_index = np.empty(candidates.shape, np.int32)
    target_index = np.empty(targets.shape, np.int32)
    for d, (owner, local, pos, inv) in enumerate(plans):
        fetch[d, owner, pos] = local
        where = (owner * cap + pos)[inv]
        cand_index[d] = where[:n_cand].reshape(candidates.shape[1:])
        target_index[d] = where[n_cand:].reshape(targets.shape[1:])
    return {"fetch": fetch, "cand_index": cand_index, "target_index": target_index}, cap


# -- inside the per-device step (under shard_map; ``axis_name`` None: one device, no mesh) ---------


def _all_to_all(x: jax.Array, axis_name: str | None) -> jax.Array:
    return x if axis_name is None else jax.lax.all_to_all(x, axis_name, 0, 0, tiled=True)


def fetch_rows(tables: dict, fetch: jax.Array, axis_name: str | None) -> tuple[dict, jax.Array]:
    """The rows this device asked for, owner-major ``[n * C, ...]`` per table, and the requests
    this device received as an owner (``[n, C]`` owner-local slots, by asking device)."""
    received = _all_to_all(fetch, axis_name)
    rows = {k: _all_to_all(t.at[received].get(mode="fill", fill_value=0), axis_name) for k, t in tables.items()}
    n, c = fetch.shape
    return {k: r.reshape((n * c,) + r.shape[2:]) for k, r in rows.items()}, received


def return_grads(
    grads: dict, received: jax.Array, rows_per_device: int, axis_name: str | None
) -> tuple[jax.Array, dict]:
    """Sends each fetched row's gradient back to its owner, which sums them per row.

    ``grads``: ``[n * C, ...]`` per table, laid out as ``fetch_rows`` returned the rows.
    Returns (owner-local ids ``[n * C]``, summed gradients ``[n * C, ...]``): distinct ids, the
    unused ones out of range (``rows_per_device`` and above) with zero gradient.

    Every asking device sends a row at most once, so the sum over devices is a loop of scatters
    without collisions, in device order: the result does not depend on atomics or on timing.
    """
    n, c = received.shape
    back = {k: _all_to_all(g.reshape((n, c) + g.shape[1:]), axis_name) for k, g in grads.items()}
    if n == 1:  # one device asked: its requests are distinct already
        return received[0], {k: g[0] for k, g in back.items()}
    ids, inverse = jnp.unique(received.reshape(-1), size=n * c, fill_value=rows_per_device, return_inverse=True)
    inverse = inverse.reshape(n, c)
    # unique's padding repeats its fill value: out-of-range ids made distinct, as the scatters
    # that use them promise (unique_indices).
    ids = jnp.where(ids < rows_per_device, ids, rows_per_device + jnp.arange(n * c, dtype=ids.dtype))

    def add(k, sums):
        # One asking device's requests are distinct, so are their places in ``ids``.
        return {name: s.at[inverse[k]].add(back[name][k], unique_indices=True) for name, s in sums.items()}

    # zeros_like of the received rows: under shard_map the carry must be device-varying like them.
    sums = jax.lax.fori_loop(0, n, add, {k: jnp.zeros_like(g.reshape((n * c,) + g.shape[2:])) for k, g in back.items()})
    return ids, sums


@dataclasses.dataclass(frozen=True)
class SparseAdagrad:
    """TF's Adagrad (accumulator starts at ``initial``, no epsilon) on given rows of a table.

    ``apply`` touches only ``ids`` (distinct; out-of-range ids are dropped): a scatter of new
    values, never an add, so each row is written once.

    The scatters say their ids are distinct (``unique_indices``). Under
    ``--xla_gpu_exclude_nondeterministic_ops``, which ``elmo-jax train`` sets on GPUs, XLA rewrites
    every scatter it cannot show to be deterministic, and one marked unique it can. Without the
    mark the step ran 2.8x slower under that flag, mostly in device-to-device copies
    (experiments/README.md, "One H200, issue 30").
    """

    learning_rate: float
    initial: float = 1.0

    def init(self, table: jax.Array) -> jax.Array:
        return jnp.full_like(table, self.initial)

    def apply(self, table: jax.Array, acc: jax.Array, ids: jax.Array, grads: jax.Array) -> tuple[jax.Array, jax.Array]:
        new_acc = acc.at[ids].get(mode="fill", fill_value=self.initial) + grads * grads
        rows = table.at[ids].get(mode="fill", fill_value=0) - self.learning_rate * grads * jax.lax.rsqrt(new_acc)
        return (
            table.at[ids].set(rows, mode="drop", unique_indices=True),
            acc.at[ids].set(new_acc, mode="drop", unique_indices=True),
        )
