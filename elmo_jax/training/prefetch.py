"""The host's share of a train step, done ahead of the step: so that the host never limits it.

A step's host work is the batcher's window (``LMBatcher.next``), the sampled candidates
(``add_candidates``: numpy sampling per device and direction, the largest part at
V ~ 8e5, S = 8192) and the fetch plan (``sharded_softmax.plan_fetch``). Two things take it off
the step's critical path:

- ``CandidatePool`` draws the candidates of the next steps in worker processes. They are a pure
  function of (seed, step, global device, direction), so they can be drawn before the batch that
  needs them exists, and bit for bit as in-process.
- ``Prefetcher`` builds whole host batches (``HostPipeline.build``: with the batcher's state
  after each, and copied to the devices) in a background thread, ``depth`` steps ahead of the
  training loop, while the device runs the current step.

What has to happen in step order on the loop's thread (the multi-process agreement, and a batch
it changes) stays in ``loop.GlobalBatches``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import multiprocessing
import queue
import threading
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import numpy as np

from elmo_jax._util.background import Channel
from elmo_jax.config import TrainConfig
from elmo_jax.training.batches import LMBatcher
from elmo_jax.training.step import add_candidates, plan_batch


def _draw(step: int, n_devices: int, **draw) -> tuple[np.ndarray, np.ndarray]:
    """In a worker: one step's ``candidates [D, 2, G, S] int32`` and ``num_tries [D, 2, G] float32``
    (``draw``: ``add_candidates``' keyword arguments)."""
    # add_candidates reads only the batch's leading (device) axis: a placeholder batch lets the
    # workers run the one definition of the draw, so that they cannot drift from it.
    out = add_candidates({"inputs": np.empty((n_devices, 0), np.int32)}, step=step, **draw)
    return out["candidates"], out["num_tries"]


def _started() -> None:
    """In a worker, when it starts: nothing (unpickling it imports this module: the draws' imports)."""


class CandidatePool:
    """``add_candidates`` for steps in order, drawn ahead in ``workers`` processes.

    ``add(batch, step)`` returns exactly what ``add_candidates`` returns for that step and queues
    the draws of the next ``ahead`` steps (at least 2 in flight), one task per step. ``workers=0``
    draws in-process, when asked (no processes at all).

    The workers are started with "spawn": forking a process that has imported jax (whose runtime
    holds threads and locks) is unsafe. Each worker imports numpy and jax (not its backends) once,
    a second or two at the start; until then the steps are drawn in-process, so that the first
    steps do not wait for them. A worker that dies fails the step that waited on it with one line
    (``RuntimeError``); ``close()`` (or ``with``) stops them, and so does interpreter exit.
    """

    def __init__(
        self,
        *,
        seed: int,
        num_sampled: int,
        vocab_size: int,
        n_devices: int,
        draws: int = 1,
        first_device: int = 0,
        fixed: bool = False,
        workers: int = 0,
        ahead: int = 2,
    ):
        self.n_devices = n_devices
        self.args: dict[str, Any] = dict(
            seed=seed,
            num_sampled=num_sampled,
            vocab_size=vocab_size,
            draws=draws,
            first_device=first_device,
            fixed=fixed,
        )
        self.workers, self.ahead = workers, max(2, ahead, workers)
        self._futures: dict[int, concurrent.futures.Future] = {}
        self._executor = None
        if workers > 0:
            self._executor = concurrent.futures.ProcessPoolExecutor(
                workers, mp_context=multiprocessing.get_context("spawn"), initializer=_started
            )
            self._ready = self._executor.submit(_started)  # done once a worker has started

    @property
    def ready(self) -> bool:
        """Whether the draws come from the workers yet (in-process until one has started)."""
        return self._executor is not None and self._ready.done()

    def add(self, batch: dict, step: int) -> dict:
        """``batch`` (leading device axis D, as ``add_candidates`` takes it) with ``candidates
        [D, 2, G, S]`` and ``num_tries [D, 2, G]`` of ``step`` added."""
        if batch["inputs"].shape[0] != self.n_devices:
            raise ValueError(f"a batch of {batch['inputs'].shape[0]} devices; this pool draws for {self.n_devices}")
        if self._executor is None or not self._ready.done():
            return add_candidates(batch, step=step, **self.args)
        for s in [s for s in self._futures if s < step]:  # skipped steps (a restart): not needed
            self._futures.pop(s).cancel()
        try:
            for s in range(step, step + self.ahead + 1):
                if s not in self._futures:
                    self._futures[s] = self._executor.submit(_draw, s, n_devices=self.n_devices, **self.args)
            cands, tries = self._futures.pop(step).result()
        except BrokenProcessPool:  # from submit too, once the pool knows
            raise RuntimeError(
                f"a candidate sampling worker process died while drawing step {step} (killed, or "
                f"out of memory?); rerun, or draw in-process with 0 workers"
            ) from None
        return {**batch, "candidates": cands, "num_tries": tries}

    def close(self) -> None:
        """Stops the workers (waiting for the draws they are running: a few ms)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._futures.clear()

    def __enter__(self) -> CandidatePool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclasses.dataclass
class HostBatch:
    """One step's host batch, or why there is none."""

    step: int
    batch: dict | None = None
    """``prepare_batch``'s output: the batcher's arrays ``[D, ...]``, candidates, fetch plan."""
    capacity: int = 0
    """The fetch capacity ``batch`` was planned with."""
    arrays: dict | None = None
    """``batch`` as the step's global arrays (``HostPipeline``'s ``to_device``), or None."""
    error: BaseException | None = None
    """StopIteration at the end of the data, or what failed while building this step's batch."""
    data_snapshot: list | None = None
    """``batcher.snapshot()`` right after this step's ``batcher.next()``: what a checkpoint saved
    after this step must hold. None with ``error``: a failed build may have moved the batcher on,
    so a checkpoint must keep the last batch taken's snapshot, never one from after a failure."""


class HostPipeline:
    """This process's host work for a step: ``prepare_batch`` of the batcher's next batch,
    its candidates from a ``CandidatePool``.

    Steps must be built in order (the batcher is a stream). The fetch capacity only grows: a batch
    is planned with the largest capacity planned here so far, or the last one every process agreed
    on (``agreed``, set by the loop's thread), whichever is larger: the same capacity as
    ``prepare_batch(capacity=agreed)`` would give, or one that the loop's agreement replans.

    Each batch carries ``batcher.snapshot()`` as it was right after the batch (~0.1 ms).
    ``to_device``: also make the batch's global arrays, where it is built (the loop's thread then
    has nothing to copy).
    """

    def __init__(
        self,
        batcher: LMBatcher,
        train_cfg: TrainConfig,
        n_devices: int,
        seed: int,
        first_device: int,
        fixed: bool,
        workers: int = 0,
        to_device: Callable[[dict], dict] | None = None,
    ):
        self.batcher, self.n_devices, self.to_device = batcher, n_devices, to_device
        self.vocab_size = train_cfg.n_tokens_vocab
        self.pool = CandidatePool(
            seed=seed,
            num_sampled=train_cfg.n_negative_samples_batch,
            vocab_size=train_cfg.n_tokens_vocab,
            n_devices=batcher.n_devices,
            draws=train_cfg.draws_per_device,
            first_device=first_device,
            fixed=fixed,
            workers=workers,
        )
        self.capacity = 0  # written by the builder's thread only
        self.agreed = 0  # written by the loop's thread only

    def build(self, step: int) -> HostBatch:
        """The host batch of ``step``; never raises: a failure (or the end of the data) is the
        batch's ``error``, to be reported at its step."""
        try:
            return self._build(step)
        except Exception as e:  # noqa: BLE001 - StopIteration (the end of the data) included
            return HostBatch(step, error=e)

    def _build(self, step: int) -> HostBatch:
        batch = self.batcher.next()
        snapshot = self.batcher.snapshot()
        batch, capacity = plan_batch(
            self.pool.add(batch, step), self.vocab_size, self.n_devices, max(self.capacity, self.agreed)
        )
        self.capacity = capacity
        arrays = self.to_device(batch) if self.to_device is not None else None
        return HostBatch(step, batch, capacity, arrays, data_snapshot=snapshot)

    def close(self) -> None:
        """Stops the candidate workers and the batcher's shard loader."""
        self.pool.close()
        self.batcher.close()


class Prefetcher:
    """Calls ``build(step)`` for ``step = first, first + 1, ...`` in a background thread, keeping
    up to ``depth`` results ready for ``take()``; stops building after a result with an error
    (the end of the data, or a failure: there is nothing after it).

    The thread holds ``build`` (not whoever owns the prefetcher), so an owner that is dropped
    without ``close()`` can still be collected and close it from a finaliser. It is a daemon
    thread: it never keeps the interpreter alive.
    """

    def __init__(self, build, first: int, depth: int):
        # A Channel, not a queue.Queue: a second Ctrl-C raises in take(), which must not leave the
        # thread unable to hand over (or to end) for want of a lock held for good.
        self._queue: Channel[HostBatch] = Channel(depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(build, first, self._queue, self._stop), name="elmo-jax-prefetch", daemon=True
        )
        self._thread.start()

    @staticmethod
    def _run(build, step: int, out: Channel[HostBatch], stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                item = build(step)
            except BaseException as e:  # noqa: BLE001 - build reports its own; this keeps take() from waiting forever
                item = HostBatch(step, error=e)
            while not stop.is_set():
                try:
                    out.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item.error is not None:
                return
            step += 1

    def take(self) -> HostBatch:
        """The next step's result, in order; waits while it is being built."""
        while True:
            try:
                return self._queue.get(timeout=1.0)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the batch prefetch thread has stopped (closed?)") from None

    def close(self) -> None:
        """Stops the thread; waits for a build in progress (a few ms, at most a few seconds)."""
        self._stop.set()
        with contextlib.suppress(queue.Empty):  # frees a thread waiting for a place, which then sees stop
            while True:
                self._queue.get(timeout=0)
        self._thread.join(timeout=30)
