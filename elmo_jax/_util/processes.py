"""Agreement between the processes of a multi-host run.

Every process must call these at the same point with values of the same length: a process that
calls one where the others do not leaves them waiting, or mismatches the next collective."""

from __future__ import annotations

import contextlib
import secrets
from typing import Any

import jax
import numpy as np

# A blocking read of the store waits this long at a time: between two waits Python runs the
# signal handlers, so a Ctrl-C is noted within a second, not when a slow peer answers.
WAIT_MS = 1000


class StoreFailed(RuntimeError):
    """jax.distributed's key-value store failed (not a timeout): its service is gone or unreachable."""


def kv_client() -> Any:
    """jax.distributed's client, whose key-value store the processes share; None without
    ``jax.distributed.initialize`` (one process). jax has no public handle on it."""
    from jax._src import distributed

    return distributed.global_state.client


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

    Round ``r``: each process sets ``PREFIX/r/<its id>``, then reads the round's directory in
    one request, waiting on a key still missing until it comes (a few requests a round when the
    processes arrive together, not one per process). It deletes its key of round ``r - 2`` then:
    each process set its round ``r - 1`` key after it had read every round ``r - 2`` one.
    Without jax.distributed's client (one process, or processes that jax started otherwise), the
    collective."""

    def __init__(self) -> None:
        self.n, self.me, self.round = jax.process_count(), jax.process_index(), 0
        self.client = kv_client() if self.n > 1 else None
        # A prefix of this object's own, the same on every process (one collective, once): a
        # second run in this process (a notebook) talks to the same service, whose store still
        # holds the first one's last rounds. (31 bits: the collective's integers are 32-bit.)
        self.prefix = f"elmo_jax/step/{agree_max([secrets.randbits(31)])[0]}" if self.client is not None else ""

    def __call__(self, values: list[int]) -> list[int]:
        """The element-wise max of ``values`` over processes."""
        if self.client is None:
            return agree_max(values)
        r, self.round = self.round, self.round + 1
        keys = [f"{self.prefix}/{r}/{p}" for p in range(self.n)]
        self._store(self.client.key_value_set, keys[self.me], " ".join(str(int(v)) for v in values))
        while True:
            words = dict(self._store(self.client.key_value_dir_get, f"{self.prefix}/{r}"))
            missing = [k for k in keys if k not in words]
            if not missing:
                break
            self._wait(missing[0])
        if r >= 2:
            with contextlib.suppress(Exception):  # a key left behind costs a few bytes of the store
                self.client.key_value_delete(f"{self.prefix}/{r - 2}/{self.me}")
        return [max(column) for column in zip(*(map(int, words[k].split()) for k in keys))]

    def _wait(self, key: str) -> None:
        """Until ``key`` is set. A process that never sets it (dead, stuck) is for the run's
        watches to find: its peer watch, its stall watch."""
        assert self.client is not None
        while True:
            try:
                self.client.blocking_key_value_get(key, WAIT_MS)
                return
            except jax.errors.JaxRuntimeError as e:
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise StoreFailed(_store_error(key, e)) from None

    @staticmethod
    def _store(call, key: str, *args):
        try:
            return call(key, *args)
        except jax.errors.JaxRuntimeError as e:  # raised as such, it would read as the device's failure
            raise StoreFailed(_store_error(key, e)) from None


def _store_error(key: str, e: Exception) -> str:
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    return (
        f"the step agreement could not use jax.distributed's key-value store ({key}: {first}); the coordination "
        "service on process 0's host is gone or unreachable: restart every process with the same command"
    )
