"""The watch for a stuck run (``elmo_jax.cli.stall.StallWatch``), in this process, with its exit
recorded instead of taken. Through the program: ``test_faults.py`` (one process) and
``test_distributed.py`` (one of two stuck)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from elmo_jax._util.clock import WatchClock
from elmo_jax.cli import multihost, stall
from elmo_jax.cli.stall import StallWatch


class Left(list):
    """The lines the watch left with; ``done`` is set at the first."""

    def __init__(self):
        super().__init__()
        self.done = threading.Event()

    def __call__(self, line: str, code: int = 1) -> None:
        self.append(line)
        self.done.set()


@pytest.fixture
def left(monkeypatch) -> Left:
    """``multihost.leave``, which is ``os._exit`` in the program, recorded instead."""
    lines = Left()
    monkeypatch.setattr(multihost, "leave", lines)
    return lines


def waiting_on_a_read_that_never_returns(done: threading.Event) -> None:
    done.wait(10)


def test_a_run_without_a_beat_for_the_timeout_is_stopped_with_its_stacks_in_the_run_dir(tmp_path, left):
    for step in ("10", "20", "30.orbax-checkpoint-tmp-1700000000"):
        (tmp_path / "checkpoints" / step).mkdir(parents=True)
    watch = StallWatch(0.3, str(tmp_path))
    watch.start()
    watch.beat("running step 21")
    waiting_on_a_read_that_never_returns(left.done)
    watch.close()
    assert left == [
        f"elmo-jax train: error: {tmp_path}: no progress for 0.3 s (--stall-timeout) while running step 21: the run "
        "is stuck (a read that never returns, a deadlock, a device that no longer answers); every thread's stack is "
        f"in {tmp_path / 'stalled.txt'}; step(s) 10, 20 are intact: rerun the same command to resume from step 20"
    ]
    stacks = (tmp_path / "stalled.txt").read_text()
    assert stacks.startswith("no progress for 0.3 s while running step 21; every thread's Python stack:\n")
    assert "in waiting_on_a_read_that_never_returns" in stacks and "in _stalled" in stacks, stacks


def test_beats_keep_it_quiet(tmp_path, left):
    watch = StallWatch(0.3, str(tmp_path))
    watch.start()
    for step in range(12):
        watch.beat(f"running step {step}")
        time.sleep(0.1)
    watch.close()
    time.sleep(0.3)
    assert left == [] and not (tmp_path / "stalled.txt").exists()


def test_it_is_armed_from_the_start_before_any_beat(tmp_path, left):
    """A read that hangs before the first step (the first batch, the checkpoint) is stopped too."""
    watch = StallWatch(0.3, str(tmp_path))
    watch.start()
    assert left.done.wait(10)
    watch.close()
    [line] = left
    assert line.startswith(
        f"elmo-jax train: error: {tmp_path}: no progress for 0.3 s (--stall-timeout) while starting "
    )
    assert line.endswith("no checkpoint was saved before it: rerun the same command")


def test_stacks_that_cannot_be_written_are_said_to_be_so_and_the_run_still_stops(tmp_path, left):
    run = tmp_path / "not-a-dir"
    run.write_text("")
    watch = StallWatch(0.2, str(run))
    watch.start()
    assert left.done.wait(10)
    watch.close()
    [line] = left
    assert f"its threads' stacks could not be written to {run / 'stalled.txt'} (Not a directory)" in line, line
    assert line.endswith("no checkpoint was saved before it: rerun the same command")


def test_the_check_comes_often_enough_to_stop_near_the_timeout():
    for timeout in (1, 60, 1800, 86400):
        watch = StallWatch(timeout, "run")
        assert watch.period <= max(0.1, timeout / 20) and watch.period <= 5.0
    assert stall.StallWatch(1800, "run").period == 5.0


SUSPENDED_PROGRAM = """
import sys, time
from elmo_jax.cli.stall import StallWatch
watch = StallWatch(2, sys.argv[1])
watch.start()
watch.beat("running step 1")
print("ready", flush=True)
sys.stdin.readline()  # the next beat waits for the test: after the pause, the watch looks first
watch.beat("running step 2")
time.sleep(0.5)
print("done", flush=True)
"""


@pytest.mark.slow
def test_a_run_suspended_longer_than_the_timeout_is_not_taken_for_stuck_when_it_goes_on(tmp_path):
    """Ctrl-Z or a scheduler's suspend (SIGSTOP, then SIGCONT) for 4 s, twice the timeout: the
    watch did not see that time pass, so it does not count it. (Before: the run woke up and was
    stopped as stuck at once, the monotonic clock having run on through the pause.)"""
    proc = subprocess.Popen(
        [sys.executable, "-c", SUSPENDED_PROGRAM, str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    time.sleep(0.3)
    os.kill(proc.pid, signal.SIGSTOP)
    time.sleep(4)
    os.kill(proc.pid, signal.SIGCONT)
    time.sleep(0.5)  # the watch has looked by now: every 0.1 s
    out, err = proc.communicate("go\n", timeout=60)
    assert (proc.returncode, out, err) == (0, "done\n", ""), err
    assert not (tmp_path / "stalled.txt").exists()


class PausedWait(threading.Event):
    """An event whose ``wait`` returns ``pause`` seconds late, as it does in a thread that could not
    run (its process stopped)."""

    def __init__(self, pause: float):
        super().__init__()
        self.pause = pause

    def wait(self, timeout: float | None = None) -> bool:
        time.sleep((timeout or 0) + self.pause)
        return False


def test_the_watch_clock_leaves_out_a_pause_of_its_thread_and_not_its_period():
    clock = WatchClock(0.1)
    start = clock.now()
    assert not clock.wait(threading.Event())
    assert 0.1 <= clock.now() - start < 0.5  # an ordinary period counts
    before = clock.now()
    assert not clock.wait(PausedWait(1.5))
    assert clock.now() - before < 0.5  # 1.6 s passed, of which the thread saw 0.1
    ended = threading.Event()
    ended.set()
    assert clock.wait(ended)
