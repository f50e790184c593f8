"""Packing items of given lengths into a few rows laid end to end: extraction's sentences into its
biLSTM rows (``elmo_jax.extract.packing``) and held-out sentences into evaluation's streams
(``elmo_jax.training.evaluate``)."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np


def longest_first(steps: Sequence[int], rows: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Longest first, each item into the row that is shortest so far (LPT scheduling: no row is
    longer than the mean plus the longest item); ties go to the earlier item and the lower row.
    ``steps`` of 0 take no room.

    Returns each item's row ``[n] int64`` and first step ``[n] int64``, and the longest row's steps.
    """
    load = np.zeros(rows, np.int64)
    row, start = np.zeros(len(steps), np.int64), np.zeros(len(steps), np.int64)
    heap = [(0, r) for r in range(rows)]
    for i in sorted(range(len(steps)), key=lambda i: -steps[i]):
        if steps[i]:
            at, r = heapq.heappop(heap)
            row[i], start[i], load[r] = r, at, at + steps[i]
            heapq.heappush(heap, (load[r], r))
    return row, start, int(load.max(initial=0))
