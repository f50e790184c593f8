"""background.calls: a function called on each submitted item, in order, by one background thread."""

import threading
import time

import pytest

from elmo_jax._util import background


def test_every_item_is_handled_in_order_before_the_block_ends():
    done, threads = [], set()

    def slow(item):
        time.sleep(0.002)
        done.append(item)
        threads.add(threading.current_thread().name)

    with background.calls(slow, depth=5) as submit:
        for i in range(50):
            submit(i)
        assert len(done) < 50  # the loop went on while the thread worked
    assert done == list(range(50)) and threads == {"elmo-jax-background"}
    with background.calls(done.append, depth=0) as submit:
        assert submit == done.append  # depth 0: called right away, on this thread


def test_a_failure_in_the_thread_is_raised_on_the_callers_thread():
    def write(item):
        if item == 3:
            raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        with background.calls(write, depth=2) as submit:
            for i in range(1000):
                submit(i)
                time.sleep(0.001)
    assert i < 1000 - 1  # raised by a submit, not only at the end
    with pytest.raises(OSError, match="No space left"):  # the last item fails: raised on leaving
        with background.calls(write, depth=10) as submit:
            for i in range(4):
                submit(i)


def test_an_error_in_the_block_drops_the_queue_and_waits_for_the_call_in_progress():
    started, finished = [], []

    def write(item):
        started.append(item)
        time.sleep(0.2)
        finished.append(item)

    with pytest.raises(KeyboardInterrupt):
        with background.calls(write, depth=100) as submit:
            for i in range(10):
                submit(i)
            time.sleep(0.05)
            raise KeyboardInterrupt  # Ctrl-C in the loop
    assert started == finished == [0]  # the write in progress completed; the rest were dropped
    assert not any(t.name == "elmo-jax-background" and t.is_alive() for t in threading.enumerate())
