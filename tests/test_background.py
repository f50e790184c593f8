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


class _Signal(Exception):
    """Raised by a signal handler in the main thread, as Ctrl-C's KeyboardInterrupt and the
    command line's ``Terminated`` are."""


@pytest.fixture
def raising_signals():
    """``arm(seconds)``: SIGALRM raises ``_Signal`` in this (the main) thread after ``seconds``,
    wherever it is then. A watchdog raises ``AssertionError`` instead if the test wedges."""
    import signal

    def handler(signum, frame):
        raise _Signal

    def wedged(signum, frame):
        raise AssertionError("wedged: a hand-off waited for a lock that an interrupted call left held")

    before = signal.signal(signal.SIGALRM, handler), signal.signal(signal.SIGUSR1, wedged)
    main = threading.get_ident()
    watchdog = threading.Timer(60, signal.pthread_kill, (main, signal.SIGUSR1))
    watchdog.start()
    yield lambda seconds: signal.setitimer(signal.ITIMER_REAL, seconds)
    watchdog.cancel()
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, before[0])
    signal.signal(signal.SIGUSR1, before[1])


def test_a_signal_that_raises_anywhere_in_a_submit_never_wedges_the_hand_off(raising_signals):
    """`elmo-jax embed` hung for good once when a SIGHUP came while it handed a line to its
    writer: the signal's exception landed in ``queue.Queue.put`` while it held its lock, which
    stayed held, and leaving the block waited for it. Here a signal lands at a different moment
    of 2,000 blocks of submits; each must end at once with the signal's error. Negative control,
    with ``queue.Queue`` as before: 2 runs of 2 wedged (the signal landed in the lock's
    ``__exit__`` before the release; the clean-up's ``put_nowait`` then waited for it)."""
    for i in range(2000):
        with pytest.raises(_Signal):
            with background.calls(lambda item: None, depth=2) as submit:
                raising_signals(0.0005 * (1 + (i % 7) / 7))
                while True:
                    submit(i)
    assert not any(t.name == "elmo-jax-background" and t.is_alive() for t in threading.enumerate())


def test_a_signal_that_raises_anywhere_in_a_take_leaves_the_prefetch_thread_free_to_end(raising_signals):
    """Training's second Ctrl-C raises in ``Prefetcher.take``; ``close`` must still end the
    thread, which could not hand over its next batch (nor end) after a ``queue.Queue`` lock left
    held."""
    from elmo_jax.training.prefetch import HostBatch, Prefetcher

    for i in range(500):
        ahead = Prefetcher(HostBatch, 0, 2)
        with pytest.raises(_Signal):
            raising_signals(0.0005 * (1 + (i % 7) / 7))
            while True:
                ahead.take()
        ahead.close()
        assert not ahead._thread.is_alive(), f"round {i}: the prefetch thread did not end"
