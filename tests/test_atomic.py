import os
import re
import signal
import socket
import stat
import subprocess
import sys
import warnings

import numpy as np
import pytest

from elmo_jax._util import atomic
from elmo_jax._util.atomic import atomic_path, remove_orphans, write_bytes_atomic, write_text_atomic
from elmo_jax._util.disk_full import WriteFailed


def test_writes_bytes_and_text(tmp_path):
    write_bytes_atomic(tmp_path / "a.bin", b"\x00\x01")
    write_text_atomic(tmp_path / "b.txt", "héllo\nworld\n")
    assert (tmp_path / "a.bin").read_bytes() == b"\x00\x01"
    assert (tmp_path / "b.txt").read_bytes() == "héllo\nworld\n".encode()
    assert sorted(os.listdir(tmp_path)) == ["a.bin", "b.txt"]


def test_replaces_an_existing_file(tmp_path):
    path = tmp_path / "x.txt"
    path.write_text("old")
    write_text_atomic(path, "new")
    assert path.read_text() == "new"
    assert os.listdir(tmp_path) == ["x.txt"]


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_failure_leaves_the_old_file_and_no_temp_file(tmp_path, error):
    path = tmp_path / "x.txt"
    path.write_text("old")
    with pytest.raises(error):
        with atomic_path(path) as tmp:
            with open(tmp, "w") as f:
                f.write("half")
            raise error
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["x.txt"]


def test_failure_with_no_old_file_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with atomic_path(tmp_path / "x.txt"):
            raise RuntimeError
    assert os.listdir(tmp_path) == []


def test_temp_file_is_hidden_next_to_the_target_and_keeps_the_extension(tmp_path):
    with atomic_path(tmp_path / "w.hdf5") as tmp:
        assert os.path.dirname(tmp) == str(tmp_path)
        name = os.path.basename(tmp)
        assert name.startswith(".w.hdf5.") and name.endswith(".tmp.hdf5")


def test_permissions_are_0644(tmp_path):
    write_text_atomic(tmp_path / "x.txt", "x")  # mkstemp alone would make it 0600
    assert stat.S_IMODE(os.stat(tmp_path / "x.txt").st_mode) == 0o644


def test_np_savez_lands_at_the_exact_name(tmp_path):
    # np.savez appends ".npz" to a name without it: the temp name must already end in ".npz".
    path = tmp_path / "arrays.npz"
    with atomic_path(path) as tmp:
        np.savez(tmp, a=np.arange(3))
    assert os.listdir(tmp_path) == ["arrays.npz"]
    with np.load(path) as z:
        np.testing.assert_array_equal(z["a"], np.arange(3))


def test_relative_path_in_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_text_atomic("x.txt", "x")
    assert os.listdir(".") == ["x.txt"]


def _killed_mid_write(path) -> str:
    """Runs a process that starts ``atomic_path(path)``, writes, and is killed outright (SIGKILL)
    before it finishes; returns its temporary file's name."""
    script = (
        "import os, signal, sys\n"
        "from elmo_jax._util.atomic import atomic_path\n"
        "with atomic_path(sys.argv[1]) as tmp:\n"
        "    with open(tmp, 'wb') as f:\n"
        "        f.write(b'x' * 3 * 2**20)\n"
        "    print(os.path.basename(tmp), flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    r = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == -signal.SIGKILL, r.stderr
    return r.stdout.strip()


def test_a_partial_file_of_a_writer_killed_outright_is_removed_by_the_next_write(tmp_path):
    """``elmo-jax embed`` killed by the out-of-memory killer (or kill -9, a lost node) leaves its
    temporary file, as large as what it had written; a rerun left it there for good, and its own
    write could then meet a full disk. The next write of the same path removes it, saying so.
    Negative control, without ``remove_orphans``: the file stays, and this test fails."""
    path = tmp_path / "out.hdf5"
    left = _killed_mid_write(path)
    assert os.listdir(tmp_path) == [left]
    with pytest.warns(UserWarning) as said:
        write_bytes_atomic(path, b"new")
    assert os.listdir(tmp_path) == ["out.hdf5"] and path.read_bytes() == b"new"
    [w] = said
    assert str(w.message).startswith(f"{tmp_path / left}: removed, 3.0 MiB: the partial file of an earlier write")


def test_a_partial_file_in_the_current_directory_is_named_as_the_output_was(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    left = _killed_mid_write("out.hdf5")
    with pytest.warns(UserWarning, match=rf"^{re.escape(left)}: removed, 3.0 MiB"):
        write_bytes_atomic("out.hdf5", b"new")
    assert os.listdir(".") == ["out.hdf5"]


def test_temporary_files_of_live_writers_other_hosts_or_other_paths_are_left_alone(tmp_path):
    """Only a writer that is gone, on this host, of the same path: a live process's file (this one,
    a child still running), another host's (a shared file system) and another path's stay."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        host = socket.gethostname()
        kept = [
            f".out.hdf5.{host}-{os.getpid()}.abc.tmp.hdf5",
            f".out.hdf5.{host}-{child.pid}.abc.tmp.hdf5",
            f".out.hdf5.another-host-{_gone_pid()}.abc.tmp.hdf5",
            f".other.hdf5.{host}-{_gone_pid()}.abc.tmp.hdf5",
            "out.hdf5.partial",
        ]
        for name in kept:
            (tmp_path / name).write_bytes(b"x")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert remove_orphans(tmp_path / "out.hdf5") == []
        assert sorted(os.listdir(tmp_path)) == sorted(kept)
        # The same name with a gone process of this host is removed: the check above is not vacuous.
        (tmp_path / f".out.hdf5.{host}-{_gone_pid()}.abc.tmp.hdf5").write_bytes(b"x")
        with pytest.warns(UserWarning):
            assert len(remove_orphans(tmp_path / "out.hdf5")) == 1
        assert sorted(os.listdir(tmp_path)) == sorted(kept)
    finally:
        child.kill()
        child.wait()


def _gone_pid() -> int:
    """The id of a process that has ended."""
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(p.stdout)


def test_a_name_near_the_file_systems_limit_is_written_and_its_partial_file_found(tmp_path):
    """A name the file system takes (here 250 bytes, of its 255) is written atomically: its
    temporary name is cut, with a hash of the whole, and a killed writer's partial file is still
    found by the next write. (Before: "File name too long", of the temporary name.) A name the
    file system refuses is said of that name, not of the temporary one."""
    name = "x" * 246 + ".txt"
    write_text_atomic(tmp_path / name, "a\n")
    assert os.listdir(tmp_path) == [name] and (tmp_path / name).read_text() == "a\n"
    left = _killed_mid_write(tmp_path / name)
    assert len(left.encode()) <= 255 and left.startswith(".x") and left.endswith(".tmp.txt"), left
    with pytest.warns(UserWarning, match="removed, 3.0 MiB"):
        write_text_atomic(tmp_path / name, "b\n")
    assert os.listdir(tmp_path) == [name]
    # Negative control: names that differ only past the cut get temporary names of their own.
    other = "x" * 246 + ".txy"
    assert atomic._temporary(name)[0] != atomic._temporary("x" * 247 + ".txt")[0] != atomic._temporary(other)[0]
    too_long = tmp_path / ("y" * 300 + ".txt")
    with pytest.raises(WriteFailed, match=r"File name too long") as refused:
        write_text_atomic(too_long, "a\n")
    assert str(refused.value).startswith(f"{too_long}: not written: ") and ".tmp" not in str(refused.value)
    assert os.listdir(tmp_path) == [name]
