import os
import stat

import numpy as np
import pytest

from elmo_jax._util.atomic import atomic_path, write_bytes_atomic, write_text_atomic


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
