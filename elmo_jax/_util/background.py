"""Hand-offs to background threads that a signal in the main thread cannot wedge.

``elmo-jax embed`` hands each line's arrays to ``calls(write, depth)``: the hdf5 writes (host
time) run while the loop's thread goes on with the device's work for the next window. The device
work stays on the loop's thread, so Ctrl-C interrupts it there as before, and stopping the writer
takes no longer than the write in progress. Training's batches have their own thread
(``elmo_jax.training.prefetch``), which keeps each step's data position with its batch; both pass
their items through a ``Channel``.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")
_END = object()


class Channel(Generic[T]):
    """A first-in first-out hand-off of at most ``depth`` items from one thread to another whose
    calls never leave a lock held, whatever exception interrupts them.

    ``queue.Queue`` takes its mutex in Python (``with self.not_full:``). A signal handler that
    raises in the main thread (Ctrl-C's KeyboardInterrupt, the command line's ``Terminated``) runs
    between two bytecodes: when that is just after the lock is taken and before the ``with`` block
    is set up, or in ``__exit__`` before the release, the lock stays held for good, and the next
    ``put`` or ``get`` on either thread waits forever (or fails with "release unlocked lock").
    ``elmo-jax embed`` hung so when a SIGHUP came as it handed a line to its writer.

    ``queue.SimpleQueue`` is written in C: its ``put`` and ``get`` take and release their lock
    without running Python in between, so a raised signal leaves it as it was. Two of them make
    this channel: the items, and a token per free place.
    """

    def __init__(self, depth: int):
        if depth < 1:
            raise ValueError(f"depth must be 1 or more, not {depth}")
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(depth):
            self._free.put(None)

    def put(self, item: T, timeout: float | None = None) -> None:
        """Queues ``item``, waiting up to ``timeout`` seconds (None: for good) for a free place;
        raises ``queue.Full`` if none came. (An exception between taking the place and queueing
        the item loses the place: the channel holds one item fewer from then on, and stays
        usable.)"""
        try:
            self._free.get(timeout=timeout)
        except queue.Empty:
            raise queue.Full from None
        self._items.put(item)

    def put_past_the_limit(self, item: T) -> None:
        """Queues ``item`` at once, beyond ``depth`` if it must (an end marker)."""
        self._items.put(item)

    def get(self, timeout: float | None = None) -> T:
        """The oldest item, waiting up to ``timeout`` seconds; raises ``queue.Empty`` if none came."""
        item = self._items.get(timeout=timeout)
        self._free.put(None)
        return item

    def empty(self) -> bool:
        return self._items.empty()


@contextlib.contextmanager
def calls(fn: Callable[[T], None], depth: int) -> Iterator[Callable[[T], None]]:
    """``with calls(fn, depth) as submit``: ``submit(item)`` queues ``fn(item)`` for a background
    thread, waiting while ``depth`` items are queued (``depth`` 0: ``submit`` is ``fn``, called
    right away).

    Leaving the block normally waits for every queued call. An exception raised by ``fn`` is
    raised on the caller's thread, by the next ``submit`` or on leaving; one raised inside the
    block (Ctrl-C or a signal included, wherever it lands) drops what is queued, waits for the
    call in progress, and goes on.
    """
    if depth <= 0:
        yield fn
        return
    todo: Channel = Channel(depth)
    failed: list[BaseException] = []
    stop = threading.Event()  # only set and read (is_set takes no lock), never waited on

    def run() -> None:
        while True:
            item = todo.get()
            if item is _END or stop.is_set():
                return
            try:
                fn(item)
            except BaseException as e:  # noqa: BLE001 - raised on the caller's thread
                failed.append(e)
                return

    def submit(item: T) -> None:
        while not failed:
            try:
                todo.put(item, timeout=0.1)
                return
            except queue.Full:
                if not thread.is_alive():
                    break
        raise failed[0] if failed else RuntimeError("the background thread has stopped")

    thread = threading.Thread(target=run, name="elmo-jax-background", daemon=True)
    thread.start()
    try:
        yield submit
    except BaseException:
        stop.set()
        todo.put_past_the_limit(_END)  # wakes an idle thread; a busy one sees stop after its call
        thread.join()
        raise
    todo.put_past_the_limit(_END)
    thread.join()
    if failed:
        raise failed[0]
