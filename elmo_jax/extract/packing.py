"""The host side of packed extraction: where each sentence runs, and its outputs back into its own array.

``Embedder`` (``elmo_jax.extract.embedder``) runs the biLSTM over rows of sentences laid end to end.
This module plans that and handles the outputs, in numpy alone:

- ``pack_sentences``: each sentence's row and first step (``Packing``), the fewest rows that hold a
  job in about its longest sentence's steps, in calls of a fixed number of steps;
- ``Packing.streams`` and ``Packing.pieces``: the index streams of both directions, and the
  pieces of sentences that a call runs (for pooling on the device);
- ``new_outputs`` and ``Packing.scatter``: the per-sentence ``[layers, n, 2P]`` arrays, and each
  call's outputs copied into them, in a few threads (``copy_threads``);
- ``length_bucket``, ``batch_rows``, ``rows_within``: the few sizes that steps and rows are padded
  to, so that a job's programs compile once for many jobs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction

import numpy as np

from elmo_jax._util.lpt import longest_first
from elmo_jax.model.layout import Layout


def length_bucket(n: int) -> int:
    """The padded time axis for sentences of up to ``n`` tokens (markers not counted).

    The biLSTM runs ``time + 2`` steps (``<S>``, ``</S>``), so it is that count that is
    rounded: to multiples of 4 up to 32, of 8 up to 64, then steps of about 1.25x. Every padded
    step is a full step of the sequential LSTM, so short sentences get fine buckets.
    """
    steps = n + 2
    if steps <= 32:
        steps = max(4, -(-steps // 4) * 4)
    elif steps <= 64:
        steps = -(-steps // 8) * 8
    else:
        # 64 x 1.25^k exactly (a Fraction: a float's 80.00000001 would round up a step), up to a multiple of 8.
        bound = math.ceil(64 * Fraction(5, 4) ** math.ceil(math.log(steps / 64, 1.25)))
        steps = -(-max(bound, steps) // 8) * 8
    return steps - 2


def batch_rows(n: int) -> int:
    """Sentence rows of a batch: 1, 2, 4, 8, then powers of 2 and 1.5x powers of 2 (12, 16, 24, ...)."""
    if n <= 8:
        return 1 << max(n - 1, 0).bit_length()
    p = 1 << (n - 1).bit_length()
    return 3 * p // 4 if 3 * p // 4 >= n else p


def rows_within(n: int) -> int:
    """The largest ``batch_rows`` value not above ``n`` (at least 1)."""
    if n < 12:
        return 1 << max(n.bit_length() - 1, 0)
    p = 1 << (n.bit_length() - 1)
    return 3 * p // 2 if 3 * p // 2 <= n else p


Runner = Callable[[Callable[[np.ndarray], None], np.ndarray], None]  # run(fn, items): fn over parts of items


def serial(fn: Callable[[np.ndarray], None], items: np.ndarray) -> None:
    fn(items)


def copy_thread_count(layout: Layout) -> int:
    """``layout.extract_copy_threads``, at most the CPUs this process may run on."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(layout.extract_copy_threads, cpus))


@contextlib.contextmanager
def copy_threads(threads: int) -> Iterator[Runner]:
    """For one call of ``embed``: ``run(fn, items)`` calls ``fn(part)`` on ``threads`` parts of
    ``items`` (sentence indices) at once, each in a thread of its own (``serial`` for one).

    For the host's copies into the sentences' arrays: numpy lets go of the GIL while it copies a
    block, and a first write into new memory also pays the kernel's page faults, so a few threads
    copy and fault in parallel. Each sentence is in one part only, so no two threads write one array.
    """
    if threads <= 1:
        yield serial
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="elmo-copy") as pool:

        def run(fn: Callable[[np.ndarray], None], items: np.ndarray) -> None:
            for done in [pool.submit(fn, part) for part in np.array_split(items, threads) if len(part)]:
                done.result()

        yield run


@dataclasses.dataclass(frozen=True)
class Packing:
    """Sentences laid end to end in ``rows`` streams, run ``steps`` at a time in ``calls`` calls.

    Sentence i (``length[i]`` tokens, ``+ 2`` steps with its markers; 0: not run) takes steps
    ``start[i]`` .. of row ``row[i]``. The
    backward stream holds each sentence reversed in the same place, so both directions restart at
    the same steps and a row's padding is only at its end.
    """

    rows: int
    steps: int
    calls: int
    row: np.ndarray
    start: np.ndarray
    length: np.ndarray

    def streams(
        self, token_rows: Sequence[np.ndarray], bos: int, eos: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``index [2, rows, T]`` int32 (table rows of the forward and backward streams), ``mask``
        and ``starts`` ``[rows, T]`` bool (a step of a sentence; its first step), ``T = calls x steps``."""
        shape = (self.rows, self.calls * self.steps)
        index, mask, starts = np.zeros((2,) + shape, np.int32), np.zeros(shape, bool), np.zeros(shape, bool)
        for ids, r, s in zip(token_rows, self.row, self.start):
            n = len(ids)
            if n:
                index[0, r, s], index[0, r, s + 1 : s + n + 1], index[0, r, s + n + 1] = bos, ids, eos
                index[1, r, s], index[1, r, s + 1 : s + n + 1], index[1, r, s + n + 1] = eos, ids[::-1], bos
                mask[r, s : s + n + 2] = True
                starts[r, s] = True
        return index, mask, starts

    def scatter(self, out: list[np.ndarray], call: int, ys: np.ndarray, run: Runner = serial) -> None:
        """Copies call ``call``'s outputs ``ys [L, 2, rows, steps, P]`` into the last ``L`` layers of
        the sentences' arrays ``out[i] [layers, n, 2P]``, backward steps back in token order.
        ``run``: see ``copy_threads``."""
        lo, hi = call * self.steps, (call + 1) * self.steps
        first = out[0].shape[0] - ys.shape[0] if out else 0
        p = ys.shape[-1]

        def copy(sentences: np.ndarray) -> None:
            # Token j is step s + 1 + j forward and step s + n - j backward: both in [s + 1, s + n + 1).
            for i in sentences:
                n, r, s = self.length[i], self.row[i], self.start[i]
                a, b = max(s + 1, lo), min(s + n + 1, hi)
                if a < b:
                    out[i][first:, a - s - 1 : b - s - 1, :p] = ys[:, 0, r, a - lo : b - lo]
                    out[i][first:, s + n - b + 1 : s + n - a + 1, p:] = ys[:, 1, r, a - lo : b - lo][:, ::-1]

        run(copy, np.flatnonzero((self.start + 1 < hi) & (self.start + self.length + 1 > lo) & (self.length > 0)))

    def pieces(self, n_devices: int) -> tuple[np.ndarray, np.ndarray]:
        """For pooling on the device: the part of a sentence's tokens that one call runs is a piece.

        Returns ``segment [rows, calls x steps]`` int32, each token step's piece, numbered within its
        call and device from 0 (-1: a marker or padding step), and ``owner [calls, n_devices x S]``
        int64, the sentence of device d's piece j at ``d x S + j`` (-1: none). ``S``, the pieces a
        call and device may hold, is a row bucket, so that jobs share a few program shapes.
        """
        k, per_device = self.steps, self.rows // n_devices
        sent = np.flatnonzero(self.length > 0)
        first = self.start[sent] + 1  # token j of a sentence is step start + 1 + j in both streams
        end = first + self.length[sent]
        c0, c1 = first // k, (end - 1) // k
        count = c1 - c0 + 1
        i = np.repeat(sent, count)
        call = np.repeat(c0, count) + np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)
        group = call * n_devices + self.row[i] // per_device
        order = np.argsort(group, kind="stable")
        sizes = np.bincount(group, minlength=self.calls * n_devices)
        local = np.empty(len(i), np.int64)
        local[order] = np.arange(len(i)) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        s = batch_rows(int(sizes.max(initial=1)))
        owner = np.full((self.calls, n_devices * s), -1, np.int64)
        owner[call, (self.row[i] // per_device) * s + local] = i
        segment = np.full((self.rows, self.calls * k), -1, np.int32)
        for j, c, q in zip(i, call, local):
            segment[
                self.row[j], max(self.start[j] + 1, c * k) : min(self.start[j] + self.length[j] + 1, (c + 1) * k)
            ] = q
        return segment, owner


def pack_sentences(lengths: Sequence[int], n_devices: int, batch_tokens: int, max_steps: int) -> Packing:
    """Where each sentence of ``lengths`` tokens runs (see ``Packing``): the fewest rows (a row
    bucket, a multiple of ``n_devices``) that hold them in about the longest sentence's steps, at
    most ``batch_tokens // max_steps`` a device (at least 1), in calls of ``max_steps`` steps, or
    fewer (a length bucket) when the rows are shorter than that."""
    steps = [n + 2 if n > 0 else 0 for n in lengths]  # an empty sentence has no outputs: not run
    length = np.asarray(lengths, np.int64).reshape(-1)
    if not any(steps):
        return Packing(n_devices, 1, 0, np.zeros(len(steps), np.int64), np.zeros(len(steps), np.int64), length)
    per_device = rows_within(max(1, batch_tokens // max_steps))
    need = batch_rows(-(-sum(steps) // (max(steps) * n_devices)))
    rows = n_devices * min(per_device, need)
    row, start, longest = longest_first(steps, rows)
    k = min(max_steps, length_bucket(longest - 2) + 2)
    return Packing(rows, k, -(-longest // k), row, start, length)


def block_views(sizes: Sequence[int], block_bytes: int) -> list[np.ndarray]:
    """Empty flat float32 arrays of ``sizes[i]`` elements, each a view into a block that it shares
    with its neighbours: consecutive items fill a block until it holds ``block_bytes`` or more
    (the last block may hold less), and each block is one ``np.empty``."""
    views: list[np.ndarray] = []
    first = 0
    ends = np.cumsum(sizes, dtype=np.int64)
    while first < len(sizes):
        base = ends[first - 1] if first else 0
        # the first item whose end puts the block at block_bytes or more closes it
        last = min(int(np.searchsorted(ends, base + -(-block_bytes // 4))), len(sizes) - 1)
        block = np.empty(int(ends[last] - base), np.float32)
        bounds = np.concatenate([[0], ends[first : last + 1] - base])
        views += [block[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        first = last + 1
    return views


def new_outputs(
    table: np.ndarray, token_rows: Sequence[np.ndarray], layers: int, run: Runner = serial, block_bytes: int = 0
) -> list[np.ndarray]:
    """Each sentence's ``[layers, n, 2P]`` float32 array, for ``table [words, P]`` and each
    sentence's rows in it; with every layer (``layers > 1``), layer 0 is filled in: each token's
    vector, twice (bilm-tf's layer 0). The rest is left for ``Packing.scatter``. ``run``: see
    ``copy_threads``.

    ``block_bytes`` > 0 (``Layout.extract_block_mib``): the arrays are C-contiguous views into
    blocks of at least that many bytes (``block_views``). A block is one allocation, which numpy
    asks the kernel to back with 2 MiB pages where transparent huge pages are on, so the first
    writes into it fault once a 2 MiB page, not once every 4 KiB as a sentence's own array of a
    few hundred KiB does; keeping one sentence's array keeps its whole block."""
    p = table.shape[1]
    shared = block_bytes > 0
    out: list[np.ndarray] = [np.empty(0, np.float32)] * len(token_rows)
    if shared:
        flat = block_views([layers * len(ids) * 2 * p for ids in token_rows], block_bytes)
        out = [x.reshape(layers, len(ids), 2 * p) for x, ids in zip(flat, token_rows)]

    def make(sentences: np.ndarray) -> None:
        for i in sentences:
            ids = token_rows[i]
            x = out[i] if shared else np.empty((layers, len(ids), 2 * p), np.float32)
            out[i] = x
            if layers > 1:
                x[0, :, :p] = x[0, :, p:] = table[ids]

    run(make, np.arange(len(token_rows)))
    return out
