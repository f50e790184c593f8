"""elmo_jax._util.disk_full: which errors mean no space (or another failure of the file system),
and the one line that says so."""

import errno
import os

import h5py
import pytest
from helpers import model_files

from elmo_jax import load_hdf5, save_hdf5
from elmo_jax._util.disk_full import OutOfSpaceError, WriteFailed, is_out_of_space, os_errno, remedy, reported
from elmo_jax.training import hooks


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


def test_a_read_only_file_system_is_said_with_what_to_do_for_it_not_for_a_full_disk(tmp_path):
    """A file system mounted (or remounted, after an I/O error) read-only has room: its lines say
    to make it writable or write elsewhere, never to free space, and give no free-space figure."""
    path = tmp_path / "out.hdf5"
    with pytest.raises(OutOfSpaceError) as e:
        with reported(path):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
    assert (
        str(e.value)
        == f"{path}: not written: {tmp_path} is on a read-only file system; choose another output path and rerun"
    )
    metrics = str(tmp_path / "metrics.jsonl")
    assert str(hooks._not_logged(metrics, OSError(errno.EROFS, "Read-only file system"))) == (
        f"{metrics}: not written: the file system is read-only; once the file system is writable again, rerun "
        "the same command: the run resumes from its newest checkpoint"
    )
    # The negative control: a full disk is still told to free space.
    assert str(hooks._not_logged(metrics, OSError(errno.ENOSPC, "No space left on device"))) == (
        f"{metrics}: not written: the disk is full; free space and rerun the same command: the run resumes "
        "from its newest checkpoint"
    )
    assert (
        remedy(errno.EDQUOT, "free space (or keep fewer checkpoints) and")
        == "free space (or keep fewer checkpoints) and"
    )


def test_reported_words_another_failure_of_the_file_system_in_one_line(tmp_path):
    path = tmp_path / "out.hdf5"
    with pytest.raises(WriteFailed) as e:
        with reported(path):
            try:
                raise OSError(errno.EIO, "Input/output error")
            except OSError as inner:  # as h5py raises it: a plain OSError around the OS's
                raise OSError("Can't write data (file write failed: errno = 5)") from inner
    assert str(e.value) == f"{path}: not written: OSError: [Errno 5] Input/output error; once the cause is fixed, rerun"
    assert e.value.errno == errno.EIO and not isinstance(e.value, OutOfSpaceError)
    # Negative controls: the path's own faults, and errors that are not the OS's, pass unchanged.
    for error in (
        PermissionError(errno.EACCES, "denied"),
        IsADirectoryError(errno.EISDIR, "a dir"),
        OSError("no code"),
    ):
        with pytest.raises(type(error)) as passed:
            with reported(path):
                raise error
        assert passed.value is error
    assert (
        os_errno(ValueError("PERMISSION_DENIED [os_error_code='13']")) == errno.EACCES and os_errno(KeyError()) is None
    )


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
