"""A training run whose save runs out of space, or fails in the file system otherwise: one line,
what is kept, and nothing lost after the resume.

The run dir sits on a real small file system (a tmpfs, where the test may mount one: root), so
that Orbax's own asynchronous writes fail as they would on a full disk; a write hook that raises
ENOSPC in the save covers the same path where no tmpfs can be mounted. Other failures of the file
system (an I/O error, a step directory that cannot be made) are checked at the ``Checkpointer``.
"""

import asyncio
import errno
import functools
import gc
import itertools
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import run_elmo_jax, xla_flags
from test_faults import TRAIN, _error_lines, _steps, _train_args

from elmo_jax import cli
from elmo_jax._util.disk_full import out_of_space_errno
from elmo_jax.training import checkpoint
from elmo_jax.training import orbax_log as orbax_log_module
from elmo_jax.training.checkpoint import Checkpointer, DiskFull, SaveFailed
from elmo_jax.training.orbax_log import orbax_log
from elmo_jax.training.run_dir import load_run

STEPS = "60"


def _du(path: pathlib.Path) -> int:
    """Bytes in blocks (what a file system charges), of a file or a tree."""
    return sum(p.stat().st_blocks * 512 for p in [path, *path.rglob("*")] if p.is_file())


@pytest.fixture(scope="module")  # read, never written, by the tests that use it
def reference(tmp_path_factory):
    """The run as it goes when space never runs out: (run dir, final params)."""
    where = tmp_path_factory.mktemp("reference")
    assert cli.main(_train_args(where, str(TRAIN / "data.txt"), "--steps", STEPS)) == 0
    return where / "run", load_run(str(where / "run"))[2]


@pytest.fixture
def small_fs(tmp_path):
    """A tmpfs to mount (root only), unmounted at the end; skips where mounting is not allowed."""
    mount = tmp_path / "fs"
    mount.mkdir()
    mounted = []

    def make(size: int) -> pathlib.Path:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()[:80]}); the write-hook test covers it")
        mounted.append(mount)
        return mount

    def grow(size: int) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(mount)], check=True)

    def read_only(ro: bool = True) -> None:
        """Remounts it read-only (as the kernel does a file system after an I/O error), or back.
        The kernel refuses while a file is open for writing on it (EBUSY), as it is for a moment
        at each save: tried again until it takes."""
        for _ in range(500):
            if subprocess.run(["mount", "-o", "remount,ro" if ro else "remount,rw", str(mount)]).returncode == 0:
                return
            time.sleep(0.01)
        raise AssertionError(f"{mount} could not be remounted {'read-only' if ro else 'writable'}")

    make.grow, make.read_only = grow, read_only
    yield make
    for m in mounted:
        subprocess.run(["umount", str(m)], check=False)


def _assert_one_line_and_kept(err: str, run: pathlib.Path) -> int:
    """The stop's one line; returns the step it names to resume from."""
    assert "Traceback" not in err and "RESOURCE_EXHAUSTED" not in err, err[-2000:]
    [line] = _error_lines(err)
    assert line.startswith(f"elmo-jax train: error: {run}: step ")
    failed = int(line.split(": step ")[1].split()[0])
    assert f"step {failed} not saved: the disk is full (a checkpoint needs about " in line, line
    kept = _steps(run)
    assert kept and kept[-1] == failed - 10 and failed not in kept
    assert f"step(s) {', '.join(map(str, kept))} are intact" in line
    assert line.endswith(
        f"are intact; free space (or keep fewer checkpoints) and rerun the same command to resume from step {kept[-1]}"
    ), line
    assert not list((run / "checkpoints").glob("*tmp*"))  # the failed save's partial files are gone
    return kept[-1]


def _assert_same_weights(run: pathlib.Path, params: dict) -> None:
    _, _, got, step = load_run(str(run))
    assert step == int(STEPS)
    got_leaves, got_tree = jax.tree_util.tree_flatten(got)
    want_leaves, want_tree = jax.tree_util.tree_flatten(params)
    assert got_tree == want_tree
    # Bit for bit, as test_pretrain's resume in a new process.
    for a, b in zip(got_leaves, want_leaves):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
@pytest.mark.parametrize("keep", [3, 1])
def test_a_full_file_system_stops_in_one_line_and_the_rerun_loses_nothing(reference, small_fs, tmp_path, capsys, keep):
    """keep 1: the save that fails is the one that would have replaced the only checkpoint, which
    must stay whole, host file included (before: its host file was deleted as the failing save
    started, and the rerun found no readable checkpoint)."""
    ref_run, ref_params = reference
    # A checkpoint's size varies by step (Orbax compresses its chunks: 356-426 kB here), so the
    # room is set midway between n of the largest, which fit, and n + 1 of the smallest, which do
    # not; n = 1 with keep 1 (the old step and the new are on disk together while it saves) and 2
    # with keep 3. Sized from one step's checkpoint with a 256 kB margin, two early checkpoints of
    # the keep-1 run fitted in 2 runs of 3 and the test failed with exit 0.
    sizes = [_du(p) for p in (ref_run / "checkpoints").iterdir() if p.name.isdigit()]
    n = min(keep, 2)
    rest = _du(ref_run) - _du(ref_run / "checkpoints")
    fs = small_fs(rest + (n * max(sizes) + (n + 1) * min(sizes)) // 2 + (32 << 10))
    args = _train_args(fs, str(TRAIN / "data.txt"), "--steps", STEPS, "--keep", str(keep))
    # The stopping run is the real command in a process of its own: its whole stderr is what a
    # user reads, including what Orbax's futures log when they are collected, which once came
    # after the one line (~20 traceback lines, in some runs: it depends on how the writes race).
    # At this process's XLA level, as the rerun's weights are compared with the reference's bit
    # for bit (helpers.xla_flags).
    r = run_elmo_jax(*args, level=1)
    assert r.returncode == 1, r.stderr[-2000:]
    resume_from = _assert_one_line_and_kept(r.stderr, fs / "run")
    assert len(r.stderr.splitlines()) == 2, r.stderr[-3000:]
    warning = r.stderr.splitlines()[0]
    assert "a save may run out of space" in warning  # the start-up check saw it coming
    # Whether Orbax logs anything (and so whether orbax.log is made) depends on how the writes
    # race: 1 run in ~12 it logs nothing. Where its lines go is checked without the race below.

    small_fs.grow(64 << 20)  # space freed: the same command goes on
    capsys.readouterr()
    assert cli.main(args) == 0
    assert f"resuming {fs / 'run'} from step {resume_from}" in capsys.readouterr().out
    _assert_same_weights(fs / "run", ref_params)


@pytest.mark.slow
def test_a_file_system_remounted_read_only_under_the_run_stops_in_one_line_and_the_rerun_resumes(
    small_fs, tmp_path, capsys
):
    """The file system of the run dir turns read-only while the run trains (as ext4 does after an
    I/O error): one line that names the step not saved and the steps intact, and says to rerun
    once the file system is writable, not to free space; the same command then resumes.

    Before: every writer thread of Orbax's printed its traceback (~350 lines), the log file for
    them failed to open and printed its own, and the line said no step was intact and to start
    again (the failed save's clean-up had failed too, and taken the listing with it)."""
    fs = small_fs(64 << 20)
    args = _train_args(fs, str(TRAIN / "data.txt"), "--steps", "3000")
    run = fs / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "elmo_jax", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "XLA_FLAGS": xla_flags(1)},
    )
    try:
        deadline = time.monotonic() + 120
        while not (run / "checkpoints" / "20").is_dir():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        small_fs.read_only()
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err[-3000:]
    assert "Traceback" not in err and len(err.splitlines()) == 1, err[-3000:]
    kept = _steps(run)
    assert kept[:2] == [10, 20], kept
    failed = kept[-1] + 10
    assert err.strip() == (
        f"elmo-jax train: error: {run}: step {failed} not saved: the file system is read-only; step(s) "
        f"{', '.join(map(str, kept))} are intact; once the file system is writable again, rerun the same "
        f"command to resume from step {kept[-1]}"
    )
    small_fs.read_only(False)
    # The same command, to a nearer end; here, as the other reruns in this file (the stop above is
    # the one whose whole stderr is checked in a process of its own).
    capsys.readouterr()
    assert cli.main([*args[:-2], "--steps", str(failed + 10)]) == 0
    assert f"resuming {run} from step {kept[-1]} " in capsys.readouterr().out
    assert _steps(run)[-1] == failed + 10


def test_a_vocabulary_or_a_run_dir_s_first_files_on_a_full_disk_are_one_line_and_leave_nothing(small_fs, capsys):
    """``elmo-jax vocab --out`` and a new run's ``vocab.txt`` on a disk without room for them: one
    line naming the file and the space left, and no partial file. (Before: a traceback out of the
    write, whose OSError names no file.)"""
    fs = small_fs(16 << 10)  # the sample's vocabulary is larger
    out = fs / "vocab.txt"
    sample = pathlib.Path(cli.__file__).parents[1] / "data" / "sample" / "train.txt"
    assert cli.main(["vocab", "--train-files", str(sample), "--out", str(out)]) == 1
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"elmo-jax vocab: error: {out}: not written: the disk is full ("), line
    assert line.endswith(f" free in {fs}); free space or choose another output path and rerun"), line
    assert os.listdir(fs) == []
    assert cli.main(["train", "--run-dir", str(fs / "run"), "--steps", "1", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert (
        "Traceback" not in err
        and f"elmo-jax train: error: {fs / 'run' / 'vocab.txt'}: not written: the disk is full" in err
    )
    assert not [p.name for p in (fs / "run").iterdir() if p.name.startswith(".")]  # no temporary file left


@pytest.mark.slow
@pytest.mark.parametrize("layers", ["all", "top"])
def test_embed_on_a_really_full_disk_is_one_line_with_no_crash_and_the_rerun_completes(small_fs, layers):
    """A dataset a sentence: HDF5 meets the full disk when it flushes its metadata cache, in a
    dataset's deallocation and in the file's close. (Before: ~19,000 lines of h5py's tracebacks,
    then SIGSEGV at the interpreter's exit, and the partial file left; a write hook raising ENOSPC
    in create_dataset, tests/test_cli.py, never showed it.)"""
    fixture = pathlib.Path(__file__).parent / "fixtures" / "allennlp_elmo"
    sample = pathlib.Path(cli.__file__).parents[1] / "data" / "sample" / "heldout.txt"
    fs = small_fs(3 << 20)  # about a tenth of the output
    args = ["embed", "--options", fixture / "options.json", "--weights", fixture / "lm_weights.hdf5",
            "--input", sample, "--output", fs / "e.hdf5", "--layers", layers, "--no-progress"]  # fmt: skip
    r = run_elmo_jax(*args)
    assert r.returncode == 1, r.stderr[-3000:]
    [line] = r.stderr.splitlines()
    assert line.startswith(f"elmo-jax embed: error: {fs / 'e.hdf5'}: not written: the disk is full ("), line
    assert os.listdir(fs) == []
    small_fs.grow(64 << 20)
    assert run_elmo_jax(*args).returncode == 0
    import h5py

    with h5py.File(fs / "e.hdf5", "r") as f:
        assert len(f) == len(sample.read_text().splitlines())


def test_a_model_fetched_into_a_full_cache_is_one_line_and_the_rerun_completes(small_fs, tmp_path, monkeypatch, capsys):
    """``elmo-jax models --fetch`` whose cache fills mid-file: one line naming the file and the
    space left, exit 1; the partial file stays for the rerun to go on from. (Before: the copy's
    OSError and its traceback.)"""
    from model_server import fixture_model, fixture_tree

    from elmo_jax.pretrained import registry

    monkeypatch.setitem(registry.MODELS, "original", fixture_model("original"))
    monkeypatch.setenv("ELMO_JAX_MIRROR", str(fixture_tree(tmp_path / "mirror")))
    fs = small_fs(256 << 10)  # room for the options, not the weights (~450 kB)
    assert cli.main(["models", "--fetch", "original", "--cache-dir", str(fs), "--no-progress"]) == 1
    [line] = capsys.readouterr().err.strip().splitlines()
    weights = fs / "original" / registry.MODELS["original"].files["weights"][0].local
    assert line.startswith(f"elmo-jax models: error: {weights}: not written: the disk is full ("), line
    assert line.endswith("; free space or choose another output path and rerun"), line
    small_fs.grow(4 << 20)
    assert cli.main(["models", "--fetch", "original", "--cache-dir", str(fs), "--no-progress"]) == 0
    assert registry.verify("original", cache_dir=fs)[weights.name]


def test_a_failed_save_lists_the_steps_intact_when_its_clean_up_fails_too(tmp_path, monkeypatch):
    """On a read-only file system the failed save's clean-up (its host file's removal) fails as
    well: the steps before it are still listed as intact. (Before: none was, and the line said
    to start again.)"""
    ckpt = Checkpointer(tmp_path / "run", async_save=False)
    for step in (1, 2):
        ckpt.save(step, {"w": jnp.ones(4)}, {"h": jnp.ones(2)}, {"x": np.zeros(1)}, {})
    removed = []

    def read_only(path, *args, **kwargs):
        removed.append(path.name)
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    with monkeypatch.context() as m:
        m.setattr(type(ckpt._host_path(3, 0)), "unlink", read_only)  # epath's class for a local path
        failed = ckpt._save_failed(3, errno.EROFS, None)
    ckpt.close()
    assert removed == ["3.p0.npz"]
    assert failed.kept == [1, 2]
    assert str(failed) == (
        f"{tmp_path / 'run'}: step 3 not saved: the file system is read-only; step(s) 1, 2 are intact; once "
        "the file system is writable again, rerun the same command to resume from step 2"
    )


def test_a_failed_save_leaves_nothing_alive_that_logs_when_collected(small_fs):
    """What a run's end finds when it collects (``loop._orbax_log``): with the ``DiskFull`` still
    held, as it is while it propagates, no future of the failed save is left to log "exception was
    never retrieved" later, on the terminal."""
    ckpt = Checkpointer(small_fs(256 << 10) / "run")
    with pytest.raises(DiskFull) as failed:
        noise = jax.random.normal(jax.random.key(0), (1024, 1024))  # 4 MB that do not compress
        ckpt.save(1, {"w": noise}, {"h": jnp.ones(4)}, {"x": np.zeros(1)}, {})
        ckpt.close()
    ckpt.close()
    assert failed.value.__context__ is None  # Orbax's exception (and its frames) is not kept with it
    gc.collect()
    unlogged = [o for o in gc.get_objects() if isinstance(o, asyncio.Future) and getattr(o, "_log_traceback", False)]
    assert unlogged == []


@pytest.mark.slow
def test_a_save_refused_for_space_by_a_write_hook_stops_alike(reference, tmp_path, monkeypatch, capsys):
    _, ref_params = reference
    real, calls = ocp.CheckpointManager.save, []

    def third_fails(self, step, *args, **kwargs):
        calls.append(step)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "save", third_fails)
    args = _train_args(tmp_path, str(TRAIN / "data.txt"), "--steps", STEPS)
    assert cli.main(args) == 1
    resume_from = _assert_one_line_and_kept(capsys.readouterr().err, tmp_path / "run")
    assert resume_from == 20
    assert sorted(p.name for p in (tmp_path / "run" / "host_state").iterdir()) == ["10.p0.npz", "20.p0.npz"]

    monkeypatch.undo()
    assert cli.main(args) == 0
    assert f"resuming {tmp_path / 'run'} from step 20" in capsys.readouterr().out
    _assert_same_weights(tmp_path / "run", ref_params)


def test_a_save_failed_by_the_file_system_otherwise_says_so_and_what_is_kept(tmp_path, monkeypatch):
    """An I/O error, not space: a ``SaveFailed`` (not a ``DiskFull``) in the file system's words.
    The trainer stops on it as on a full disk (``loop._finish`` and the CLI take the same path for
    both), which the write-hook and tmpfs tests check end to end."""
    ckpt = Checkpointer(tmp_path / "run", async_save=False)
    _save_tiny(ckpt, 1)
    _save_tiny(ckpt, 2)

    def io_error(self, step, *args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(ocp.CheckpointManager, "save", io_error)
    with pytest.raises(SaveFailed) as failed:
        _save_tiny(ckpt, 3)
    assert not isinstance(failed.value, DiskFull) and failed.value.errno == errno.EIO and failed.value.kept == [1, 2]
    assert str(failed.value) == (
        f"{tmp_path / 'run'}: step 3 not saved: OSError: [Errno 5] Input/output error; step(s) 1, 2 are intact; "
        "once the cause is fixed, rerun the same command to resume from step 2"
    )
    assert sorted(p.name for p in (tmp_path / "run" / "host_state").iterdir()) == ["1.p0.npz", "2.p0.npz"]
    monkeypatch.undo()
    ckpt.close()


def _fail_a_save_at_its_step_directory(run: pathlib.Path) -> None:
    """Saves step 1, then step 2 with a file where the checkpoints directory was: making step 2's
    directory fails. Closes the ``Checkpointer``."""
    ckpt = Checkpointer(run)
    _save_tiny(ckpt, 1)
    ckpt.wait()
    shutil.rmtree(run / "checkpoints")
    (run / "checkpoints").write_text("")
    with pytest.raises(
        SaveFailed,
        match=r"step 2 not saved: NotADirectoryError: .*; no step is intact on disk; once the cause is fixed, rerun the same command to start again$",
    ):
        _save_tiny(ckpt, 2)
        ckpt.close()
    ckpt.close()


def test_a_save_whose_step_directory_cannot_be_made_leaves_no_write_waiting(tmp_path):
    """Orbax's writes wait up to 300 s for their step's directory; when making it fails they must
    not hold the process (not daemons: it could not exit) that long."""
    _fail_a_save_at_its_step_directory(tmp_path / "run")
    assert _waiting_orbax_writes() == []


# Outside any run (no ``orbax_log``), the failed save's coroutines are never awaited, and say so
# when collected: here, at the end, not under whichever test the garbage collector runs in next.
@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")  # outside a run
def test_a_closed_checkpointer_keeps_no_write_of_its_failed_save_alive(tmp_path, monkeypatch):
    """A released write still holds its coroutine, never awaited, which warns when collected. The
    closed checkpointer keeps its error; had the error's traceback kept a write, the warning came
    after the run's one line (CI once saw four). Here Orbax's close fails as well, so the error is
    raised again from the frame that let the writes go. (Before, that frame named the last one:
    its writes warned only once the checkpointer went.)"""
    # pytest's log capture would keep Orbax's logged tracebacks, and through them the writes.
    monkeypatch.setattr(logging.getLogger("absl"), "propagate", False)
    run = tmp_path / "run"
    ckpt = Checkpointer(run)
    _save_tiny(ckpt, 1)
    ckpt.wait()
    shutil.rmtree(run / "checkpoints")
    (run / "checkpoints").write_text("")
    _fail_after_closing(ckpt.manager)
    with pytest.raises(SaveFailed):
        _save_tiny(ckpt, 2)
        ckpt.wait()
    ckpt.close()
    assert ckpt._failed is not None and ckpt._failed.__traceback__ is not None  # kept, as a run keeps it
    gc.collect()  # what nothing keeps says so now
    with warnings.catch_warnings(record=True) as kept_until_now:
        warnings.simplefilter("always")
        del ckpt
        gc.collect()
    assert [str(w.message) for w in kept_until_now] == []


def _save_tiny(ckpt: Checkpointer, step: int) -> None:
    ckpt.save(step, {"w": jnp.ones(4)}, {"h": jnp.ones(2)}, {"x": np.zeros(1)}, {})


def _fail_after_closing(manager: ocp.CheckpointManager) -> None:
    """Makes ``manager.close()`` close it, then fail (no other reference to it is kept)."""
    close = manager.close

    def failing_close():
        close()
        raise OSError(errno.EIO, "Input/output error")

    manager.close = failing_close  # type: ignore[method-assign]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")
def test_without_the_release_the_writes_of_a_failed_save_wait(tmp_path, monkeypatch):
    """Negative control for the test above."""
    monkeypatch.setattr(checkpoint, "_release_stranded_writes", list)
    _fail_a_save_at_its_step_directory(tmp_path / "run")
    try:
        assert _waiting_orbax_writes()
    finally:
        monkeypatch.undo()
        released = checkpoint._release_stranded_writes()
        assert released  # not left waiting 300 s at the suite's exit
        for t in released:
            threading.Thread.join(t, timeout=10)  # Orbax's join raises for a cancelled write
        del released
        gc.collect()


def _waiting_orbax_writes() -> list[str]:
    from orbax.checkpoint._src.futures import future as orbax_future

    deadline = time.monotonic() + 5.0  # released threads end at once; give them a moment
    while True:
        alive = [t.name for t in threading.enumerate() if isinstance(t, orbax_future._SignalingThread) and t.is_alive()]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def test_orbax_s_full_disk_is_told_from_other_failures_through_the_chain():
    """tensorstore's words, wrapped as Orbax raises them, under another exception."""
    wrapped = ValueError(
        "RESOURCE_EXHAUSTED: Error writing ... Failed to write 1044480 bytes to file 4: No space "
        "left on device [os_error_code='28']"
    )
    try:
        try:
            raise wrapped
        except ValueError as e:
            raise RuntimeError("Save Finalize thread failed") from e
    except RuntimeError as outer:
        assert out_of_space_errno(outer) == errno.ENOSPC
    # Negative controls: other failures are not a full disk.
    assert out_of_space_errno(ValueError("RESOURCE_EXHAUSTED: out of memory")) is None
    assert out_of_space_errno(ValueError("NOT_FOUND [os_error_code='2']")) is None
    assert out_of_space_errno(None) is None


@pytest.mark.parametrize(
    "code,words",
    [
        (errno.ENOSPC, "the disk is full ("),
        (errno.EIO, "OSError: [Errno 5] Input/output error; once the cause is fixed, rerun"),
    ],
    ids=["no-space", "io-error"],
)
def test_export_on_a_full_disk_is_one_line_and_leaves_no_partial_file(
    fixtures_dir, tmp_path, monkeypatch, capsys, code, words
):
    """And on a disk that fails otherwise: the same, in the file system's words."""
    import h5py

    run = fixtures_dir / "format1_run"  # a finished run, committed: export only reads it
    out = tmp_path / "export"
    real, calls = h5py.Group.create_dataset, []

    def fills_up(self, *args, **kwargs):  # the disk fills inside weights.hdf5
        calls.append(1)
        if len(calls) == 3:
            raise OSError(code, os.strerror(code))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(h5py.Group, "create_dataset", fills_up)
    assert cli.main(["export", "--run-dir", str(run), "--out-dir", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"elmo-jax export: error: {out / 'weights.hdf5'}: not written: {words}"
    ), err
    assert "weights.hdf5" not in os.listdir(out) and not [n for n in os.listdir(out) if "tmp" in n]
    monkeypatch.undo()  # space again: the same command writes every file
    assert cli.main(["export", "--run-dir", str(run), "--out-dir", str(out)]) == 0
    assert sorted(os.listdir(out)) == ["options.json", "softmax.hdf5", "vocab.txt", "weights.hdf5"]


def _finalized_in(filename: str, message: str) -> None:
    """Makes and drops an object whose ``__del__``, compiled as ``filename``, raises ``message``."""
    namespace: dict = {}
    code = f"class Finalized:\n    def __del__(self):\n        raise ValueError({message!r})\n"
    exec(compile(code, filename, "exec"), namespace)
    namespace["Finalized"]()


def test_orbax_log_takes_orbax_s_noise_and_nothing_else(tmp_path, monkeypatch, recwarn):
    """Deterministic stand-ins for what a failed save or read leaves behind: a finalizer raising
    in Orbax's code and a coroutine never awaited go to the log; a finalizer of other code and
    other warnings go where they went before."""

    async def never_started():
        pass

    seen: list = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    log = tmp_path / "orbax.log"
    with orbax_log(str(log)):
        _finalized_in(os.path.join(os.sep, "venv", "site-packages", "orbax", "checkpoint", "x.py"), "orbax's")
        _finalized_in(str(tmp_path / "ours.py"), "ours")
        never_started()
        warnings.warn("a warning of ours", stacklevel=1)
    text = log.read_text()
    assert "ValueError: orbax's" in text and "never_started' was never awaited" in text
    assert "ValueError: ours" not in text and "a warning of ours" not in text
    assert [str(u.exc_value) for u in seen] == ["ours"]  # the hook in place before had the rest
    assert [str(w.message) for w in recwarn] == ["a warning of ours"]
    assert sys.unraisablehook == seen.append  # put back


def test_orbax_log_takes_the_tracebacks_of_orbax_s_threads_and_survives_a_log_it_cannot_open(tmp_path, monkeypatch):
    """A thread of Orbax's that a failed write ends (its ``array_type_handler`` writers, whose
    exception the save raises again to the run) has its traceback sent to the log; a thread of
    other code keeps the hook in place before (the negative control). And a log file that cannot
    be made (a read-only file system) drops Orbax's log lines rather than raising into Orbax's
    logging call."""
    namespace: dict = {}
    code = "import threading\nclass Writer(threading.Thread):\n    def run(self):\n        raise ValueError('orbax write')\n"
    exec(compile(code, os.path.join(os.sep, "venv", "site-packages", "orbax", "checkpoint", "f.py"), "exec"), namespace)

    def ours():
        raise ValueError("our thread")

    seen: list = []
    monkeypatch.setattr(threading, "excepthook", lambda args: seen.append(str(args.exc_value)))
    log = tmp_path / "orbax.log"
    with orbax_log(str(log)):
        for thread in (namespace["Writer"](name="array_type_handler"), threading.Thread(target=ours)):
            thread.start()
            thread.join()
    assert seen == ["our thread"]
    text = log.read_text()
    assert text.startswith("Exception in thread array_type_handler:\nTraceback") and "ValueError: orbax write" in text
    assert "our thread" not in text
    with orbax_log(str(tmp_path / "missing" / "orbax.log")):  # its open fails, as on a read-only file system
        logging.getLogger("absl").error("a failed write")
    assert not (tmp_path / "missing").exists()


def test_a_coroutine_of_orbax_alive_before_the_block_is_not_waited_for_again(monkeypatch):
    """A write that never ends (a disk that stays full) keeps its Orbax coroutine for the life of
    the process. The block that made it collects and looks again until the timeout; the blocks
    after it (a notebook's next run) look once. Before, each of them waited the 5 s again, and the
    slow tier's in-process runs after one such test took three times as long. (Looks are counted,
    on a clock that a second passes at each reading: in the whole suite's process one look, which
    scans every object, took over the 2 s that the test once gave two of them.)"""
    stuck, looks = _stuck_orbax_coroutine(), _counted_looks(monkeypatch)
    readings = itertools.count()
    clock = lambda: float(next(readings))  # noqa: E731
    monkeypatch.setattr(orbax_log_module, "_settle", functools.partial(orbax_log_module._settle, 2.0, clock))
    with orbax_log(None):
        coroutine = stuck()  # made in the block, and alive at its end
    # The negative control: this block looks again until its 2 s are past.
    assert len(looks) == 3
    looks.clear()
    with orbax_log(None):
        pass
    assert len(looks) == 1
    coroutine.close()


def test_a_block_where_nothing_of_orbax_failed_does_not_look_for_its_coroutines(monkeypatch):
    """Looking scans every object of the process: a third of a second a training run in the test
    suite's process. A run whose checkpointer saw no read or write fail, and that raised nothing,
    has no coroutine of Orbax's left, and skips it."""
    stuck, looks = _stuck_orbax_coroutine(), _counted_looks(monkeypatch)
    with orbax_log(None, failed=lambda: False):
        coroutine = stuck()
    assert looks == []
    coroutine.close()
    del coroutine
    # The controls: a block where a read or write failed looks, and so does one that raised.
    with orbax_log(None, failed=lambda: True):
        pass
    with pytest.raises(KeyError), orbax_log(None, failed=lambda: False):
        raise KeyError("the run's error")
    assert len(looks) == 2


def _stuck_orbax_coroutine():
    """A coroutine function whose code lies in Orbax's package, as far as ``orbax_log`` can tell."""
    namespace: dict = {}
    code = "async def write():\n    pass\n"
    exec(compile(code, os.path.join(os.sep, "venv", "site-packages", "orbax", "checkpoint", "w.py"), "exec"), namespace)
    return namespace["write"]


def _counted_looks(monkeypatch) -> list:
    find, looks = orbax_log_module._orbax_coroutines, []
    monkeypatch.setattr(orbax_log_module, "_orbax_coroutines", lambda: looks.append(1) or find())
    return looks
