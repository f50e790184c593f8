"""Agreement between the processes of a multi-host run.

Every process must call these at the same point with values of the same length: a process that
calls one where the others do not leaves them waiting, or mismatches the next collective."""

from __future__ import annotations

import contextlib
import secrets

import jax
import numpy as np

# A blocking read of the store waits this long at a time: between two waits, Python runs the
# signal handlers (a Ctrl-C is noted at once, not when a slow peer answers).
WAIT_MS = 1000


def agree_max(values: list[int]) -> list[int]:
    """The element-wise max of ``values`` over processes, in one collective on the devices;
    ``values`` itself with one process."""
    if jax.process_count() == 1:
        return list(values)
    from jax.experimental import multihost_utils

    return [int(x) for x in np.max(multihost_utils.process_allgather(np.asarray(values, np.int64)), axis=0)]


class StepAgreement:
    """``agree_max`` once per step of a training loop, through jax.distributed's key-value store.

    A collective on the devices queues behind the step already dispatched: the host reads its
    result only once that step has ended, so the device idled between steps for the gather and
    the next dispatch. The store is host to host: the next step is dispatched while this one runs
    (``benchmarks/bench_agree.py`` times both, alone and behind a step in flight).

    Round ``r``: each process sets ``PREFIX/r/<its id>`` and reads every other's. It deletes its
    key of round ``r - 2`` then: each process set its round ``r - 1`` key after it had read every
    round ``r - 2`` one. Without jax.distributed's client (one process), the collective."""

    def __init__(self) -> None:
        self.n, self.me, self.round = jax.process_count(), jax.process_index(), 0
        from jax._src import distributed

        self.client = distributed.global_state.client if self.n > 1 else None
        # A prefix of this object's own, the same on every process (one collective, once): a
        # second run in this process (a notebook) talks to the same service, whose store still
        # holds the first one's last rounds.
        self.prefix = f"elmo_jax/step/{agree_max([secrets.randbits(62)])[0]}" if self.client is not None else ""

    def __call__(self, values: list[int]) -> list[int]:
        """The element-wise max of ``values`` over processes."""
        if self.client is None:
            return agree_max(values)
        r, self.round = self.round, self.round + 1
        self.client.key_value_set(f"{self.prefix}/{r}/{self.me}", " ".join(str(int(v)) for v in values))
        out = [int(v) for v in values]
        for p in range(self.n):
            if p != self.me:
                out = [max(a, int(b)) for a, b in zip(out, self._read(f"{self.prefix}/{r}/{p}").split())]
        if r >= 2:
            with contextlib.suppress(Exception):  # a key left behind costs a few bytes of the store
                self.client.key_value_delete(f"{self.prefix}/{r - 2}/{self.me}")
        return out

    def _read(self, key: str) -> str:
        """The value at ``key``, once the other process has set it. A process that never does
        (dead, stuck) is for the run's watches to find: its peer watch, its stall watch."""
        assert self.client is not None
        while True:
            try:
                return self.client.blocking_key_value_get(key, WAIT_MS)
            except jax.errors.JaxRuntimeError as e:
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise
