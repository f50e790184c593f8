"""The watch on the other processes of a multi-host run (``elmo_jax.cli.multihost.PeerWatch``),
in one process, over a key-value store of its own in place of jax.distributed's. The real thing,
in several processes: ``tests/test_distributed.py``."""

from __future__ import annotations

import threading
import time

import pytest
from test_stall import PausedWait

from elmo_jax.cli import multihost
from elmo_jax.cli.multihost import KEY, PeerWatch


class Store:
    """jax.distributed's key-value calls that the watch makes; ``down``: every call fails."""

    def __init__(self):
        self.values: dict[str, str] = {}
        self.down = False

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        if self.down:
            raise RuntimeError("UNAVAILABLE: Socket closed")
        self.values[key] = value

    def key_value_dir_get(self, key: str) -> list[tuple[str, str]]:
        if self.down:
            raise RuntimeError("UNAVAILABLE: Socket closed")
        return [(k, v) for k, v in self.values.items() if k.startswith(key + "/")]


def _watch(store: Store, me: int = 0, n: int = 3, timeout: float = 0.6) -> PeerWatch:
    watch = PeerWatch(store, me, n, timeout, "/nonexistent/run")
    watch.grace = 0.5
    return watch


def _word(store: Store, k: int, word: str) -> None:
    store.values[f"{KEY}/{k}"] = word


def test_a_process_that_stops_counting_is_taken_for_dead_after_the_timeout_and_not_before():
    store = Store()
    watch = _watch(store)
    for count in range(1, 4):
        _word(store, 1, f"{count} running")
        _word(store, 2, f"{count} running")
        watch._tick()
        time.sleep(0.25)
    assert watch._verdict(1, working=True) is None and watch._verdict(2, working=True) is None
    for count in range(4, 8):  # process 1 counts on, process 2 is silent
        _word(store, 1, f"{count} running")
        watch._tick()
        time.sleep(0.2)
    assert watch._verdict(1, working=True) is None
    dead, line = watch._verdict(2, working=True)
    assert dead and line.startswith("process 2 of 3 stopped answering: no word from it for 0.6 s"), line
    assert watch._verdict(2, working=False) == (dead, line)  # a death counts after this one's own end too


def test_a_process_that_said_it_ended_is_never_taken_for_dead():
    store = Store()
    watch = _watch(store, n=2)
    _word(store, 1, "5 ended")
    watch._tick()
    time.sleep(1.0)
    watch._tick()
    assert watch._verdict(1, working=True) is None and watch._ended(1)


def test_a_failed_process_stops_this_one_after_the_grace_while_it_works_with_its_line():
    store = Store()
    watch = _watch(store, n=2, timeout=60)
    _word(store, 1, "3 failed own [Errno 2] No such file or directory: 'vocab.txt'")
    watch._tick()
    assert watch._verdict(1, working=True) is None  # within the grace: a collective may bring it here
    time.sleep(0.55)
    watch._tick()
    assert watch._verdict(1, working=True) == (
        False,
        "process 1 of 2 stopped with an error: [Errno 2] No such file or directory: 'vocab.txt'; once its cause "
        "is fixed, restart every process with the same command",
    )
    assert watch._verdict(1, working=False) is None  # this one ended too: no news, and not dead
    # A line with its own advice: that advice goes for every process, and is not repeated.
    _word(store, 1, "4 failed own RUN: step 4 not saved: the disk is full; free space and rerun the same command")
    watch._tick()  # failed since the first word: past the grace
    assert watch._verdict(1, working=True) == (
        False,
        "process 1 of 2 stopped with an error: RUN: step 4 not saved: the disk is full; free space and rerun the "
        "same command (every process alike)",
    )


def test_a_death_another_process_found_is_taken_at_once_and_before_any_failure():
    """Process 2 of 3 died; process 1 saw it first and stopped, saying so. This process has not
    yet seen process 2 silent for the timeout: it takes process 1's word for the death at once,
    and does not read process 1's stop as a failure to leave through jax's shutdown barrier
    (which a dead process never reaches: jax aborts there). Under load on 2 cores, the suite's
    3-process test met exactly that: process 0 quoted process 1 and aborted at the barrier."""
    store = Store()
    watch = _watch(store, me=0, n=3, timeout=60)
    said = "process 2 of 3 stopped answering: no word from it for 60 s (--heartbeat-timeout); ..."
    _word(store, 1, f"9 failed dead {said}")
    _word(store, 2, "7 running")
    watch._tick()
    assert watch._verdict(1, working=True) == (True, said)
    assert watch._verdict(2, working=True) is None  # not silent long enough here
    assert watch._dead(1) and not watch._dead(2)

    store = Store()
    watch = _watch(store, me=0, n=3)
    _word(store, 1, "3 failed follow another process failed")
    _word(store, 2, "3 running")
    watch._tick()
    time.sleep(0.7)  # past the grace for process 1's failure and the timeout for process 2's silence
    _word(store, 1, "4 failed follow another process failed")
    watch._tick()
    assert watch._verdict(1, working=True)[0] is False and watch._verdict(2, working=True)[0] is True
    dead, line = watch._first_verdict(working=True)
    assert dead and line.startswith("process 2 of 3 stopped answering"), line


def test_a_store_that_cannot_be_reached_is_no_word_and_the_others_go_silent():
    store = Store()
    watch = _watch(store, n=2)
    _word(store, 1, "1 running")
    watch._tick()
    store.down = True
    watch._tick()  # does not raise
    assert watch._verdict(1, working=True) is None
    time.sleep(0.7)
    watch._tick()
    assert watch._verdict(1, working=True)[0]


def test_this_process_says_how_it_ended_in_one_line():
    store = Store()
    watch = _watch(store, me=1, n=2)
    watch._tick()
    assert store.values[f"{KEY}/1"] == "1 running"
    watch.failed("the disk is full;\n  free space")
    assert store.values[f"{KEY}/1"] == "2 failed own the disk is full; free space"
    watch.failed("another process failed", follow=True)
    assert store.values[f"{KEY}/1"] == "3 failed follow another process failed"
    watch.ended()
    assert store.values[f"{KEY}/1"] == "4 ended"


def test_an_unforeseen_error_waits_until_every_other_process_has_said_how_it_ended():
    store = Store()
    watch = _watch(store, n=3, timeout=5)
    watch.period = 0.05
    _word(store, 1, "1 failed follow another process failed")
    _word(store, 2, "1 running")
    done = threading.Event()

    def fail():
        watch.failed("JaxRuntimeError: Gloo AllGather failed", wait=True)
        done.set()

    threading.Thread(target=fail, daemon=True).start()
    time.sleep(0.3)
    assert not done.is_set()  # process 2 has not said yet
    _word(store, 2, "2 ended")
    watch._tick()
    assert done.wait(2)


def test_the_watch_stops_the_process_with_the_dead_ones_line_and_what_is_kept(tmp_path, monkeypatch, capsys):
    """The thread itself: a silent process ends this one through ``leave`` (``os._exit`` in the
    program), with the checkpoints on disk named."""
    for step in ("4", "8", "12.orbax-checkpoint-tmp-1700000000"):
        (tmp_path / "checkpoints" / step).mkdir(parents=True)
    left = []

    def leave(line: str, code: int = 1, keeper=None) -> None:
        left.append(code)
        watch.quit.set()  # ends the watch's thread, as os._exit ends the program

    monkeypatch.setattr(multihost, "leave", leave)
    store = Store()
    watch = PeerWatch(store, 1, 2, 0.5, str(tmp_path))
    _word(store, 0, "1 running")
    watch.start()
    deadline = time.monotonic() + 10
    while not left and time.monotonic() < deadline:
        time.sleep(0.05)
    assert left == [1]
    err = capsys.readouterr().err
    assert err == (
        "elmo-jax train: error: process 0 of 2 stopped answering: no word from it for 0.5 s (--heartbeat-timeout); "
        "it was killed, ran out of memory, or lost its host; step(s) 4, 8 are intact: restart every process with "
        "the same command to resume from step 8\n"
    )
    assert store.values[f"{KEY}/1"].split(" ", 3)[1:3] == ["failed", "dead"]  # the others are told
    watch.thread.join(5)
    assert not watch.thread.is_alive()


@pytest.mark.parametrize("timeout", [1, 5, 100, 3600])
def test_jax_s_own_heartbeat_comes_after_every_process_has_stopped_itself(timeout):
    """The slowest stop: a death seen a period late, then process 0 waiting for the others' word
    (grace and three periods) and one period more. jax.distributed's heartbeat is a backstop
    only."""
    watch = PeerWatch(Store(), 0, 2, timeout, "run")
    slowest = timeout + 2 * watch.period + watch.grace + 4 * watch.period
    assert slowest < multihost.JAX_HEARTBEAT_FACTOR * timeout + 10


def test_a_pause_of_the_whole_run_is_not_a_silence_of_its_peers():
    """Every process stopped together (a scheduler's suspend of the job, SIGSTOP then SIGCONT):
    when this watch runs again, a peer that has not yet counted on is not dead for the pause,
    which the watch's thread did not see pass. The same time, seen, is a death (the control)."""
    store = Store()
    watch = _watch(store, n=2)
    _word(store, 1, "1 running")
    watch._tick()
    assert not watch.clock.wait(PausedWait(1.5))  # 2.5 times the timeout
    watch._tick()
    assert watch._verdict(1, working=True) is None
    time.sleep(0.7)
    watch._tick()
    dead, line = watch._verdict(1, working=True)
    assert dead and line.startswith("process 1 of 2 stopped answering"), line
