"""elmo_jax._util.disk_full: which errors mean no space, and the one line that says so."""

import errno
import os

import h5py
import pytest
from helpers import model_files

from elmo_jax import load_hdf5, save_hdf5
from elmo_jax._util.disk_full import OutOfSpaceError, is_out_of_space, reported


@pytest.mark.parametrize(
    "exc, full",
    [
        (OSError(errno.ENOSPC, "No space left on device"), True),
        (OSError(errno.EDQUOT, "Disk quota exceeded"), True),
        (OSError(errno.EROFS, "Read-only file system"), True),
        (OSError("Can't write data (file write failed: time = x, errno = 28, error message = 'No space')"), True),
        (OSError(errno.ENOENT, "No such file"), False),  # negative controls
        (OSError("errno = 2"), False),
        (ValueError("errno = 28"), False),
    ],
)
def test_is_out_of_space(exc, full):
    assert is_out_of_space(exc) is full


def test_reported_names_the_file_and_the_space_left_and_passes_other_errors(tmp_path):
    path = tmp_path / "out.hdf5"
    with pytest.raises(OutOfSpaceError) as e:
        with reported(path):
            raise OSError(errno.ENOSPC, "No space left on device")
    line = str(e.value)
    assert line.startswith(f"{path}: not written: the disk is full (") and " free in " in line
    assert line.endswith("free space or choose another output path and rerun") and "\n" not in line
    assert e.value.errno == errno.ENOSPC and e.value.path == str(path) and is_out_of_space(e.value)
    with pytest.raises(FileNotFoundError):
        with reported(path):
            raise FileNotFoundError(errno.ENOENT, "gone")


def test_save_hdf5_on_a_full_disk_leaves_no_weights_file(tmp_path, monkeypatch):
    config, params = load_hdf5(*model_files("allennlp"))
    real = h5py.Group.create_dataset

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(h5py.Group, "create_dataset", full)
    with pytest.raises(OutOfSpaceError, match="weights.hdf5: not written: the disk is full"):
        save_hdf5(config, params, tmp_path / "options.json", tmp_path / "weights.hdf5")
    assert os.listdir(tmp_path) == []
    monkeypatch.setattr(h5py.Group, "create_dataset", real)
    save_hdf5(config, params, tmp_path / "options.json", tmp_path / "weights.hdf5")
    assert sorted(os.listdir(tmp_path)) == ["options.json", "weights.hdf5"]
