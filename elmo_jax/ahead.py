"""An iterable's items produced in a background thread, a few ahead of whoever consumes them.

``iterate_ahead(windows_of_embeddings, 1)``: the next window is computed while the consumer writes this
one. The producer's work must mostly release the GIL (device work, large numpy copies) for the
two to overlap. (Training's batches have their own prefetcher, ``elmo_jax.prefetch``: it keeps
each step's data position with its batch.)
"""

from __future__ import annotations

import queue
import threading
from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")
_END = object()


def iterate_ahead(items: Iterable[T], depth: int = 1) -> Iterator[T]:
    """``items`` in their order, produced by a daemon thread up to ``depth`` items (at least 1)
    ahead of the consumer.

    An exception raised while producing (``KeyboardInterrupt`` and bad input included) is raised
    here, in place of the item it stopped. Closing this generator (or dropping it) tells the
    thread to stop after the item it is producing; nothing waits for that item.
    """
    out: queue.Queue = queue.Queue(maxsize=max(1, depth))
    stop = threading.Event()

    def put(entry) -> bool:
        while not stop.is_set():
            try:
                out.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def run() -> None:
        try:
            for item in items:
                if not put((item, None)):
                    return
            put((_END, None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
            put((_END, e))

    thread = threading.Thread(target=run, name="elmo-jax-ahead", daemon=True)
    thread.start()
    try:
        while True:
            item, error = out.get()
            if item is _END:
                if error is not None:
                    raise error
                return
            yield item
    finally:
        stop.set()
