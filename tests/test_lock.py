"""``elmo_jax._util.lock.FileLock``: one process at a time, the holder's note told to the next,
and no lock outliving a process killed outright."""

import signal
import subprocess
import sys

import pytest

from elmo_jax._util.lock import FileLock, Held

# A process that takes the lock on argv[1] with a note, says so, and holds it until it is killed.
HOLDER = """
import sys, time
from elmo_jax._util.lock import FileLock
lock = FileLock(sys.argv[1])
lock.acquire(note="the holder's note")
print("held", flush=True)
time.sleep(3600)
"""


def _holder(path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


def test_a_lock_held_by_another_process_is_refused_with_its_note_and_freed_when_it_is_killed(tmp_path):
    path = tmp_path / ".lock"
    holder = _holder(path)
    try:
        with pytest.raises(Held) as held:
            FileLock(path, wait=False).acquire(note="mine")
        assert held.value.note == "the holder's note" and held.value.path == str(path)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # Killed outright, it left the file and its note, but not the lock.
    assert path.read_text() == "the holder's note"
    lock = FileLock(path, wait=False)
    lock.acquire(note="mine")
    assert path.read_text() == "mine"  # the new holder's note replaces the old one
    lock.release()


def test_a_released_lock_is_free_for_the_next_and_release_twice_is_harmless(tmp_path):
    path = tmp_path / ".lock"
    first = FileLock(path, wait=False)
    first.acquire()
    with pytest.raises(Held):  # another open of the file, in this process too, is refused
        FileLock(path, wait=False).acquire()
    first.release()
    first.release()
    with FileLock(path, wait=False):
        pass


def test_a_note_that_cannot_be_written_lets_the_lock_go_at_once(tmp_path, monkeypatch):
    """A full or read-only disk while the note is written: the error reaches the caller and the
    lock is free, even while the error (and so the frame that opened the file) is kept."""
    import elmo_jax._util.lock as lock_module

    path = tmp_path / ".lock"

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(lock_module, "open", full, raising=False)
    with pytest.raises(OSError, match="No space left") as kept:
        FileLock(path, wait=False).acquire(note="mine")
    monkeypatch.undo()
    with FileLock(path, wait=False):
        pass
    assert kept.value.__traceback__ is not None
