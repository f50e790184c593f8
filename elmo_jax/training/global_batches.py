"""The step's global batch on every process, and the agreement that lets all processes stop at one step.

``GlobalBatches`` joins this process's rows (``batches.LMBatcher``, built ahead by ``prefetch``)
into global arrays and, once per step, agrees with the other processes on the batch's shapes and
on whether to stop, so that a signal, an error or the end of the data on one process stops every
process at the same step boundary.
"""

from __future__ import annotations

import functools
import weakref

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from elmo_jax._util.processes import StepAgreement
from elmo_jax.config import TrainConfig
from elmo_jax.training.batches import LMBatcher
from elmo_jax.training.prefetch import HostBatch, HostPipeline, Prefetcher
from elmo_jax.training.step import AXIS, BATCH_KEYS, plan_batch


class StopTogether(Exception):
    """All processes agreed to stop at this step boundary; ``reason`` says why (the strongest
    reason any process had: an error, then a signal, then the end of the data)."""

    REASONS = (None, "end of data", "signal", "error")

    def __init__(self, reason: str, signum: int = 0):
        super().__init__(reason)
        self.reason = reason
        self.signum = signum  # the signal a process stopped for (the highest number of several); 0: none


class PeerFailed(RuntimeError):
    """Another process failed; this one saved the agreed step and stops too."""


class GlobalBatches:
    """The step's global batch: this process's rows from the batcher, candidates, the fetch plan,
    and what all processes must agree on at every step boundary. One small agreement per step
    (multi-process runs only, ``StepAgreement``: through jax.distributed's key-value store, not
    the devices) carries the distinct-word count, the fetch capacity (which only grows) and
    whether any process wants to stop, so that every stop happens at the same step on every
    process and no process is left waiting in a collective of a step the others skipped.

    ``prefetch``: host batches (``prefetch.HostPipeline``) built ahead in a background thread,
    while the device runs the step before, and copied to the devices there (0: built in ``next``,
    on the loop's thread). The agreement stays on the loop's thread, once per step in step order;
    a batch it changes (another process needs more words or capacity) is planned and copied again.
    ``workers``: processes that draw the candidates ahead (``prefetch.CandidatePool``; 0: drawn
    where the batch is built, the default, as ``RunSettings.host_workers``). ``close()``
    stops both; so does dropping the object.

    The batcher runs ahead of the loop: a checkpoint saves ``data_state()``, not
    ``batcher.state()``, and ``capacity``, the fetch capacity of the last batch taken; a run resumed
    from it passes that back as ``capacity`` and plans its batches as the unbroken run did.
    """

    def __init__(
        self,
        batcher: LMBatcher,
        train_cfg: TrainConfig,
        mesh: Mesh,
        seed: int,
        first_device: int,
        fixed: bool,
        prefetch: int = 2,
        workers: int = 0,
        capacity: int = 0,
    ):
        self.batcher, self.train, self.mesh, self.seed = batcher, train_cfg, mesh, seed
        self.first_device, self.fixed, self.capacity = first_device, fixed, capacity
        self.sharding = NamedSharding(mesh, P(AXIS))
        self.error: BaseException | None = None  # this process's own failure, re-raised after the save
        self.prefetch = prefetch
        # Built ahead, a batch is copied to the devices ahead too: in the loop's thread each copy
        # waits for the GIL, which the builder's Python code holds more often than not.
        self.host = HostPipeline(
            batcher,
            train_cfg,
            mesh.size,
            seed,
            first_device,
            fixed,
            workers,
            to_device=functools.partial(_global_arrays, self.sharding, mesh.size) if prefetch else None,
        )
        self.agree = StepAgreement()
        self.host.agreed = capacity  # a resumed run's (``loop._restore_or_init``): batches start there
        self._prefetcher: Prefetcher | None = None  # started by the first next(): it knows the first step
        # batcher.snapshot() after the last batch this process trained on (taken at the first next(),
        # before any batch is built). Only a batch that next() returns moves it: a batch built but
        # not taken (a failed build, or a step another process stops before) must not be skipped
        # by a run resumed from the checkpoint of this stop.
        self._snapshot: list | None = None
        # What to stop, in order; the finaliser holds the list, not self, so dropping self stops them.
        self._parts: list = [self.host]
        self._closer = weakref.finalize(self, _close_all, self._parts)

    def next(self, step_number: int, stopping: str | None = None, signum: int = 0) -> dict:
        """The global batch of ``step_number``; raises ``StopTogether`` if any process stops here.

        ``stopping``: this process's own reason to stop (``StopTogether.REASONS``), and ``signum``
        the signal's number when that is one (told to the others, whose exit says it). An exception
        while building the batch is one too (kept in ``self.error``). Called once per step, in
        step order."""
        n, local, capacity, arrays, snapshot = self.mesh.size, None, 0, None, None
        if self._snapshot is None:
            self._snapshot = self.batcher.snapshot()
        if stopping is None:
            try:
                item = self._take(step_number)
            except Exception as e:  # noqa: BLE001 - e.g. the prefetch thread is gone
                item = HostBatch(step_number, error=e)
            snapshot = item.data_snapshot
            if isinstance(item.error, StopIteration):
                stopping = "end of data"
            elif item.error is not None:  # every process must hear of it before it stops
                stopping, self.error = "error", item.error
            else:
                # A batch built ahead may have been planned before the last agreement.
                local, capacity, arrays = item.batch, max(item.capacity, self.capacity), item.arrays
        words = local["chars"].shape[1] if local is not None else 0
        words, capacity, reason, signum = self.agree([words, capacity, StopTogether.REASONS.index(stopping), signum])
        if reason:
            raise StopTogether(str(StopTogether.REASONS[reason]), signum)
        assert local is not None  # no process stops here, so this one built its batch
        self._snapshot = snapshot
        if local["fetch"].shape[-1] != capacity:  # another process needs more: plan again with its capacity
            local, _ = plan_batch(local, self.train.n_tokens_vocab, n, capacity)
            arrays = None
        self.capacity = self.host.agreed = capacity
        if words != local["chars"].shape[1]:
            local["chars"] = np.pad(local["chars"], ((0, 0), (0, words - local["chars"].shape[1]), (0, 0)))
            arrays = None
        return arrays if arrays is not None else _global_arrays(self.sharding, n, local)

    def _take(self, step_number: int) -> HostBatch:
        if not self.prefetch:
            return self.host.build(step_number)
        if self._prefetcher is None:  # next() took the batcher's snapshot before the thread moves it on
            self._prefetcher = Prefetcher(self.host.build, step_number, self.prefetch)
            self._parts.insert(0, self._prefetcher)  # stopped before the pool it draws from
        item = self._prefetcher.take()
        if item.step != step_number:
            raise RuntimeError(
                f"asked for the batch of step {step_number}, but the next one prefetched is of step "
                f"{item.step}: GlobalBatches.next must be called once per step, in order"
            )
        return item

    def data_state(self) -> dict:
        """The batcher's state after the last batch ``next`` returned (what a checkpoint of the
        steps taken so far holds; the batcher itself may be further on: batches built ahead, or
        one built for a step that did not run)."""
        return self.batcher.state(self._snapshot)

    def epoch(self) -> int:
        """The batcher's epoch after the last batch ``next`` returned (the one to log)."""
        return self.batcher.epoch if self._snapshot is None else LMBatcher.epoch_of(self._snapshot)

    def close(self) -> None:
        """Stops the prefetch thread and the candidate workers (idempotent)."""
        self._closer()


def _global_arrays(sharding: NamedSharding, n: int, local: dict) -> dict:
    """This process's host batch ``[D, ...]`` -> the step's global arrays ``[n, ...]``."""
    # One call for the whole dict: jax transfers its arrays as one batch (in one process, a single
    # device_put) instead of paying a call's Python overhead per array.
    local = {k: local[k] for k in BATCH_KEYS}
    shapes = {k: (n,) + v.shape[1:] for k, v in local.items()}
    return jax.make_array_from_process_local_data(sharding, local, shapes)


def _close_all(parts: list) -> None:
    for part in parts:
        part.close()
