"""A function called on each submitted item, in order, by one background thread.

``elmo-jax embed`` hands each line's arrays to ``calls(write, depth)``: the hdf5 writes (host
time) run while the loop's thread goes on with the device's work for the next window. The device
work stays on the loop's thread, so Ctrl-C interrupts it there as before, and stopping the writer
takes no longer than the write in progress. (Training's batches have their own prefetcher,
``elmo_jax.training.prefetch``: it keeps each step's data position with its batch.)
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T")
_END = object()


@contextlib.contextmanager
def calls(fn: Callable[[T], None], depth: int) -> Iterator[Callable[[T], None]]:
    """``with calls(fn, depth) as submit``: ``submit(item)`` queues ``fn(item)`` for a background
    thread, waiting while ``depth`` items are queued (``depth`` 0: ``submit`` is ``fn``, called
    right away).

    Leaving the block normally waits for every queued call. An exception raised by ``fn`` is
    raised on the caller's thread, by the next ``submit`` or on leaving; one raised inside the
    block (Ctrl-C included) drops what is queued, waits for the call in progress, and goes on.
    """
    if depth <= 0:
        yield fn
        return
    todo: queue.Queue = queue.Queue(maxsize=depth)
    failed: list[BaseException] = []
    stop = threading.Event()

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
        with contextlib.suppress(queue.Full):
            todo.put_nowait(_END)  # wakes an idle thread; a busy one sees stop after its call
        thread.join()
        raise
    while thread.is_alive():
        try:
            todo.put(_END, timeout=0.1)
            break
        except queue.Full:
            continue
    thread.join()
    if failed:
        raise failed[0]
