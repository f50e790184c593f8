"""Agreement between the processes of a multi-host run, in one collective each time.

Every process must call these at the same point with values of the same length: a process that
calls one where the others do not leaves them waiting, or mismatches the next collective."""

from __future__ import annotations

import jax
import numpy as np


def agree_max(values: list[int]) -> list[int]:
    """The element-wise max of ``values`` over processes; ``values`` itself with one process."""
    if jax.process_count() == 1:
        return list(values)
    from jax.experimental import multihost_utils

    return [int(x) for x in np.max(multihost_utils.process_allgather(np.asarray(values, np.int64)), axis=0)]
