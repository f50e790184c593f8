"""iterate_ahead: an iterable's items from a background thread, in order, errors in place."""

import threading
import time

import pytest

from elmo_jax.ahead import iterate_ahead


def test_items_come_in_order_and_the_producer_stays_within_depth():
    made = []

    def items():
        for i in range(20):
            made.append(i)
            yield i

    got = []
    for item in iterate_ahead(items(), depth=2):
        time.sleep(0.01)  # a slow consumer: the producer waits for room
        # At most depth items queued and one more made and waiting to be put.
        assert len(made) - len(got) <= 2 + 2
        got.append(item)
    assert got == list(range(20))


def test_an_error_while_producing_is_raised_in_its_place():
    def items():
        yield 1
        yield 2
        raise ValueError("line 3: bad input")

    it = iterate_ahead(items())
    assert [next(it), next(it)] == [1, 2]
    with pytest.raises(ValueError, match="^line 3: bad input$"):
        next(it)

    def interrupted():
        yield 1
        raise KeyboardInterrupt  # Ctrl-C while producing: the consumer sees it, as it would unthreaded

    with pytest.raises(KeyboardInterrupt):
        list(iterate_ahead(interrupted()))


def test_closing_stops_the_producer():
    made = []

    def items():
        i = 0
        while True:
            made.append(i)
            yield i
            i += 1

    it = iterate_ahead(items(), depth=1)
    assert next(it) == 0
    it.close()
    time.sleep(0.5)
    n = len(made)
    time.sleep(0.3)
    assert len(made) == n <= 4  # it stopped (after the item it was making), not ran on
    assert not any(t.name == "elmo-jax-ahead" and t.is_alive() for t in threading.enumerate())
