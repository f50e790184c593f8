"""What a long run meets besides kill -9, through the CLI as a user meets it: a diverging loss,
training files that changed between sessions, and a device out of memory (the full disk is in
test_disk_full.py).

Each test checks the one-line message, the exit code, the checkpoints left, and that the command
the message names goes on from the last good step.
"""

import errno
import json
import math
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import time

import jax
import pytest
from helpers import FIXTURES, read_never_returns, run_elmo_jax, xla_flags
from test_pretrain import _write_tiny_options

from elmo_jax import cli
from elmo_jax.training import hooks
from elmo_jax.training.checkpoint import Checkpointer
from elmo_jax.training.hooks import Diverged, DivergenceGuard
from elmo_jax.training.setup import saved_steps

TRAIN = FIXTURES / "bilm_tf_train"


def _train_args(tmp_path: pathlib.Path, files: str, *extra: str) -> list[str]:
    options = _write_tiny_options(tmp_path / "options.json")
    return [
        "train",
        "--config",
        str(options),
        "--train-files",
        files,
        "--vocab",
        str(TRAIN / "vocab.txt"),
        "--run-dir",
        str(tmp_path / "run"),
        "--devices",
        "1",
        "--log-every",
        "10",
        "--save-every",
        "10",
        "--no-progress",
        *extra,
    ]


def _steps(run: pathlib.Path) -> list[int]:
    ckpt = Checkpointer(str(run), read_only=True)
    try:
        return ckpt.steps()
    finally:
        ckpt.close()


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("elmo-jax train: error:")]


def _one_error_line(args: list[str], capsys, code: int) -> str:
    """``elmo-jax train ARGS`` run here: it exits ``code`` with one error line and no traceback."""
    assert cli.main(args) == code
    err = capsys.readouterr().err
    [line] = _error_lines(err)
    assert "Traceback" not in err
    return line


def _resumes(args: list[str], capsys, run: pathlib.Path, step: int, last: int) -> None:
    """``elmo-jax train ARGS`` run here resumes ``run`` from ``step`` and trains to ``last``."""
    assert cli.main(args) == 0
    assert f"resuming {run} from step {step} " in capsys.readouterr().out
    assert _steps(run)[-1] == last


def _force_loss(monkeypatch, from_step: int, value: float) -> None:
    """The logged loss from ``from_step`` on is ``value``, as a blown-up run would log it."""
    real = hooks.summarise

    def forced(sums, n, step, *args):
        record = real(sums, n, step, *args)
        if step >= from_step:
            record.update(loss=value, loss_fwd=value, loss_bwd=value)
        return record

    monkeypatch.setattr(hooks, "summarise", forced)


@pytest.mark.slow
@pytest.mark.parametrize("value, decided_at", [(float("nan"), 50), (1e6, 70)], ids=["non-finite", "above-threshold"])
def test_a_diverged_loss_stops_and_leaves_no_diverged_checkpoint_newest(
    tmp_path, monkeypatch, capsys, value, decided_at
):
    run = tmp_path / "run"
    args = _train_args(tmp_path, str(TRAIN / "data.txt"), "--steps", "100")
    _force_loss(monkeypatch, 50, value)
    assert cli.main(args) == 1
    out = capsys.readouterr()
    [line] = _error_lines(out.err)
    assert "Traceback" not in out.err
    assert f"the training loss diverged at step {decided_at}" in line
    # The record at 40 is the last healthy one: it proves the parameters of step 39, not those
    # saved at 40 (first used by step 41, inside the first bad window).
    assert f"step(s) 40, saved after the last healthy step 39, were moved to {run / 'diverged'}" in line
    assert (
        "the newest checkpoint is step 30: rerun with a lower --learning-rate to resume from it (or "
        "--on-divergence 'warn'" in line
    )
    assert _steps(run) == [20, 30]  # keep 3: 10 went when 40 was saved; none saved while the loss was bad
    assert (run / "diverged" / "40" / "checkpoint").is_dir()  # set aside, not deleted
    assert sorted(p.name for p in (run / "host_state").iterdir()) == ["20.p0.npz", "30.p0.npz"]
    logged = [json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert logged[-1] == decided_at  # the record that decided it is in the log

    # The command to go on: the same one with a lower learning rate (here without the forced
    # loss), which resumes from step 30; a later plain resume keeps the lowered rate.
    monkeypatch.undo()
    assert cli.main([*args[:-1], "90", "--learning-rate", "0.1"]) == 0
    assert (
        "from step 30 (epoch 2, shard 1 of 1) to step 90 (float32 matmuls [CPU: bfloat16 matmuls are slower here], reset_state_prob "
        "0.1, learning rate 0.2 -> 0.1)" in capsys.readouterr().out
    )
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert f"resuming {run} from step 90" in out and "learning rate" not in out
    assert _steps(run)[-1] == 100
    assert Checkpointer(str(run), read_only=True).latest_meta()["options"]["learning_rate"] == 0.1


@pytest.mark.slow  # 11.6 s on a slow hour
def test_warn_mode_says_it_once_and_trains_on(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    _force_loss(monkeypatch, 30, 1e6)
    assert cli.main(_train_args(tmp_path, str(TRAIN / "data.txt"), "--steps", "80", "--on-divergence", "warn")) == 0
    err = capsys.readouterr().err
    warned = [l for l in err.splitlines() if "the training loss diverged" in l]
    assert len(warned) == 1 and "at step 50" in warned[0] and "training on" in warned[0]
    assert _steps(run)[-1] == 80 and not (run / "diverged").exists()


@pytest.mark.slow
def test_a_real_blow_up_is_caught_without_any_forcing(tmp_path, capsys):
    """bilm-tf's recipe at learning rate 10,000: the loss passes ln V within a few steps."""
    run = tmp_path / "run"
    args = _train_args(tmp_path, str(TRAIN / "data.txt"), "--steps", "200", "--learning-rate", "1e4")
    assert cli.main(args) == 1
    [line] = _error_lines(capsys.readouterr().err)
    assert "the training loss diverged at step" in line
    metrics = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["step"] < 200
    assert all(math.isfinite(m["loss"]) is False or m["loss"] > 0 for m in metrics)


def test_the_guard_needs_patience_for_a_finite_loss_and_none_for_a_nan():
    guard = DivergenceGuard(n_vocab=1000, start=0, margin=1.0, patience=3)
    threshold = math.log(1000) + 1.0

    def record(step, loss):
        return {"step": step, "loss": loss, "loss_fwd": loss, "loss_bwd": loss, "grad_norm": 1.0}

    assert guard.check(record(10, threshold - 0.01)) is None and guard.last_good == 9
    assert guard.check(record(20, threshold + 5)) is None and guard.suspect
    assert guard.check(record(30, threshold - 1)) is None and not guard.suspect  # one noisy window: recovered
    assert guard.last_good == 29
    guard.check(record(40, threshold + 5))
    guard.check(record(50, threshold + 5))
    with pytest.raises(Diverged) as e:
        guard.check(record(60, threshold + 5))
    assert e.value.step == 60 and e.value.last_good == 29
    with pytest.raises(Diverged):
        DivergenceGuard(n_vocab=1000, start=0).check(record(10, float("inf")))
    # Negative control: a healthy run never trips it.
    calm = DivergenceGuard(n_vocab=1000, start=0, patience=1)
    for step in range(10, 200, 10):
        assert calm.check(record(step, 5.0)) is None


@pytest.mark.slow
def test_a_resume_on_other_files_or_a_grown_glob_is_refused_and_new_data_goes_on(tmp_path, capsys):
    run = tmp_path / "run"
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(TRAIN / "data.txt", data / "a.txt")
    glob = str(data / "*.txt")
    assert cli.main(_train_args(tmp_path, glob, "--steps", "20")) == 0
    capsys.readouterr()

    shutil.copy(TRAIN / "data.txt", data / "b.txt")  # the glob now matches more files
    assert cli.main(_train_args(tmp_path, glob, "--steps", "30")) == 2
    [line] = _error_lines(capsys.readouterr().err)
    assert f"the training data differs from what {run} was saved with (b.txt is new)" in line
    assert "Give the same files, or --new-data to keep the weights and optimizer" in line
    assert _steps(run) == [10, 20]  # untouched

    other = tmp_path / "other.txt"
    other.write_text((TRAIN / "data.txt").read_text().replace(" the ", " a "))
    assert cli.main(_train_args(tmp_path, str(other), "--steps", "30")) == 2
    [line] = _error_lines(capsys.readouterr().err)
    assert "(a.txt is gone; other.txt is new)" in line

    (data / "b.txt").unlink()
    with open(data / "a.txt", "a") as f:  # regenerated in place: same name, other content
        f.write("one more sentence .\n")
    assert cli.main(_train_args(tmp_path, glob, "--steps", "30")) == 2
    assert "a.txt changed size" in capsys.readouterr().err

    # The flag the message names: weights and optimizer kept, the data position afresh.
    assert cli.main(_train_args(tmp_path, glob, "--steps", "30", "--new-data")) == 0
    out = capsys.readouterr().out
    assert "new training data (new_data): the data position and the LSTM state start afresh" in out
    assert "from step 20" in out and _steps(run)[-1] == 30
    # And the files it goes on with are now the run's: a plain resume is accepted.
    assert cli.main(_train_args(tmp_path, glob, "--steps", "40")) == 0
    assert f"resuming {run} from step 30" in capsys.readouterr().out


@pytest.mark.slow  # three short sessions
def test_a_new_data_session_does_not_count_epochs_in_the_earlier_text(tmp_path, capsys):
    """--new-data --epochs: the run's token count is of the text it trained on before, so it is
    not taken for the new text's epochs (before: an epoch of the new text planned from the old
    count, 5x off here, and the end of the data came long before the planned step)."""
    run = tmp_path / "run"

    def train(files: str, *flags: str) -> int:  # no --config: a resumed run keeps its own options
        common = ["--vocab", str(TRAIN / "vocab.txt"), "--run-dir", str(run), "--devices", "1", "--no-progress"]
        return cli.main(["train", "--train-files", files, *common, *flags])

    assert train(str(TRAIN / "data.txt"), "--config", "tiny", "--steps", "2", "--n-train-tokens", "50000") == 0
    other = tmp_path / "other.txt"
    other.write_text("\n".join((TRAIN / "data.txt").read_text().splitlines()[:300]) + "\n")
    capsys.readouterr()
    assert train(str(other), "--epochs", "1", "--new-data") == 2
    [line] = _error_lines(capsys.readouterr().err)
    assert f"and the count of the run in {run} is of the text before --new-data, so epochs cannot be counted" in line
    assert line.endswith("or --steps")  # not to rebuild the vocabulary, which a run keeps
    assert _steps(run) == [2]  # untouched
    # Negative control: with the new text's count given, the epoch (5 steps) is planned from it,
    # counted from the step the new text began at.
    assert train(str(other), "--epochs", "1", "--new-data", "--n-train-tokens", "3200") == 2
    captured = capsys.readouterr()
    assert f"resuming {run} from step 2 (epoch 0, shard 1 of 1) to step 7 " in captured.out, captured.out
    # The 5 sentences (134 tokens) fill no step of 32 rows x 20 tokens: said as a fresh run's text is
    # (before: "its data ended at step 2 (planned 5); nothing to do", exit 0, as a finished run's).
    [line] = _error_lines(captured.err)
    assert f"the training text ({other}: 5 sentences, 134 tokens) is smaller than one training step" in line, line
    assert _steps(run) == [2]


@pytest.mark.slow  # four short sessions
def test_the_epochs_of_a_new_data_session_count_from_the_step_its_text_began_at(tmp_path, capsys):
    """--epochs counts passes over the text the run trains on now: after --new-data, from the step
    that session began at, in it and in every later session of that text (the checkpoint keeps
    the step). Before, epochs counted from step 0 of the whole run: a run further on than the new
    text's epochs was "already trained" and stopped at once, and one not so far on trained only to
    the epoch's step count from 0."""
    run = tmp_path / "run"

    def train(files: pathlib.Path, *flags: str) -> int:  # no --config: a resumed run keeps its own options
        common = ["--vocab", str(TRAIN / "vocab.txt"), "--run-dir", str(run), "--devices", "1", "--no-progress"]
        return cli.main(["train", "--train-files", str(files), *common, *flags])

    assert train(TRAIN / "data.txt", "--config", "tiny", "--steps", "9") == 0
    lines = (TRAIN / "data.txt").read_text().splitlines() * 25
    other = tmp_path / "other.txt"
    other.write_text("\n".join(lines) + "\n")
    count = str(sum(len(line.split()) + 1 for line in lines))  # tokens + sentences: 3,475, 6 steps of 640
    capsys.readouterr()
    assert train(other, "--steps", "11", "--new-data", "--n-train-tokens", count) == 0
    capsys.readouterr()
    # The next session (the run's own files and count now): its epoch is planned to end 6 steps
    # after step 9.
    assert train(other, "--epochs", "1") == 0
    out = capsys.readouterr().out
    assert f"resuming {run} from step 11 (epoch 0, shard 1 of 1) to step 15 " in out, out
    # Rows take whole sentences, so the text's epoch ends before its count's: the data's end, not a
    # step count, stops it.
    assert "end of data at step 13; checkpoint saved" in out and _steps(run)[-1] == 13
    # --new-data --epochs: the epoch of the session's text counts from the step it starts at.
    assert train(other, "--epochs", "1", "--new-data", "--n-train-tokens", count) == 0
    out = capsys.readouterr().out
    assert f"resuming {run} from step 13 (epoch 0, shard 1 of 1) to step 19 " in out, out
    assert "end of data at step 17; checkpoint saved" in out and _steps(run)[-1] == 17


def _damage_newest(run: pathlib.Path) -> int:
    """Truncates the biggest data file of the newest checkpoint (a copy cut short, a bad disk)."""
    step = _steps(run)[-1]
    biggest = max(
        (p for p in (run / "checkpoints" / str(step)).rglob("*") if p.is_file()), key=lambda p: p.stat().st_size
    )
    with open(biggest, "r+b") as f:
        f.truncate(1000)
    return step


@pytest.mark.slow  # 16 s: two runs and a subprocess
def test_a_damaged_newest_checkpoint_is_named_moved_aside_and_the_run_goes_on_from_the_one_before(tmp_path, capsys):
    """Before, the resume fell back to step 10 and then crashed saving step 20 again
    (StepAlreadyExistsError), on every rerun; readers printed ~1,000 lines of tensorstore specs."""
    run = tmp_path / "run"
    assert cli.main(_train_args(tmp_path, str(TRAIN / "data.txt"), "--steps", "20")) == 0
    damaged = _damage_newest(run)
    assert damaged == 20

    # A reader asked for that step: one line, as the user's terminal gets it (what Orbax's
    # coroutines print when collected included), and the exit code of a bad argument.
    r = run_elmo_jax("export", "--run-dir", run, "--out-dir", tmp_path / "x", "--step", 20)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr[-3000:]
    line = r.stderr.strip()
    assert line.startswith(f"elmo-jax export: error: {run}: checkpoint 20 is unreadable (ValueError: OUT_OF_RANGE: ")
    assert _steps(run) == [10, 20]  # a reader moves nothing

    capsys.readouterr()
    with pytest.warns(UserWarning) as said:
        assert cli.main(_train_args(tmp_path, str(TRAIN / "data.txt"), "--steps", "30")) == 0
    [warning] = [str(w.message) for w in said if "unreadable" in str(w.message)]
    assert warning.startswith(f"{run}: checkpoint 20 is unreadable (ValueError: OUT_OF_RANGE: Error reading ")
    assert f"moved to {run / 'unreadable' / '20'}; falling back to an older one" in warning
    assert f"resuming {run} from step 10" in capsys.readouterr().out
    assert _steps(run) == [10, 20, 30]  # step 20 saved again, from the resumed run
    assert (run / "unreadable" / "20" / "checkpoint").is_dir()  # kept for a look, not deleted


def _out_of_memory_at(monkeypatch, where: str, at_call: int) -> None:
    """The ``at_call``-th training step (``where="step"``) or held-out evaluation raises XLA's
    out-of-memory error, as a device too small for the batch does."""
    from elmo_jax.training import loop
    from elmo_jax.training.evaluate import HeldoutEvaluator

    calls = [0]
    error = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4.00GiB.")

    def failing(real):
        def call(*args, **kwargs):
            calls[0] += 1
            if calls[0] == at_call:
                raise error
            return real(*args, **kwargs)

        return call

    if where == "step":
        real_make = loop.make_train_step
        monkeypatch.setattr(loop, "make_train_step", lambda *a, **k: failing(real_make(*a, **k)))
    else:  # a plain function as a class attribute: called as a method, with the evaluator first
        monkeypatch.setattr(HeldoutEvaluator, "__call__", failing(HeldoutEvaluator.__call__))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("where", "at_call", "intact"),
    [("step", 25, "10, 20"), ("evaluation", 3, "10, 20, 30")],
    ids=["in-a-step", "in-the-held-out-evaluation"],
)
def test_out_of_device_memory_stops_in_one_line_naming_the_batch_size(
    tmp_path, monkeypatch, capsys, where, at_call, intact
):
    """A device too small for the batch: one line with XLA's words and --batch-size, exit 1, every
    checkpoint saved before kept (after an evaluation's failure, the step it ran at too: the
    training state is sound). A lower --batch-size resumes from the newest."""
    run = tmp_path / "run"
    heldout = ["--heldout-files", str(TRAIN / "data.txt"), "--eval-every", "10"] if where == "evaluation" else []
    args = _train_args(tmp_path, str(TRAIN / "data.txt"), "--steps", "40", *heldout)
    _out_of_memory_at(monkeypatch, where, at_call)
    line = _one_error_line(args, capsys, 1)
    newest = intact.split(", ")[-1]
    assert line == (
        f"elmo-jax train: error: {run}: the device ran out of memory (RESOURCE_EXHAUSTED: Out of memory while "
        "trying to allocate 4.00GiB.); --batch-size 2 rows per device is more than it holds: lower --batch-size, "
        f"or spread the rows over more devices; step(s) {intact} are intact: rerun with a lower --batch-size to "
        f"resume from step {newest}"
    )
    assert _steps(run) == [int(s) for s in intact.split(", ")]
    if where == "step":
        monkeypatch.undo()
        _resumes([*args, "--batch-size", "1"], capsys, run, int(newest), 40)


class _Unreadable:
    """A step's result whose read fails, as a device that failed while it ran makes every read of
    that step's outputs fail (it shows at the read, not at the call, the step being asynchronous)."""

    def __init__(self, error: Exception):
        self.error = error

    def addressable_data(self, index: int):
        raise self.error


def _device_fails_at(monkeypatch, at_call: int, error: Exception, shows: str) -> None:
    """The ``at_call``-th training step fails on the device with ``error``: raised by the call
    (``shows="at the call"``), or by the first read of its metrics (``"at the read"``)."""
    from elmo_jax.training import loop

    calls = [0]

    def failing(real):
        def call(state, batch):
            calls[0] += 1
            if calls[0] == at_call and shows == "at the call":
                raise error
            state, metrics = real(state, batch)
            if calls[0] == at_call:
                metrics = {k: _Unreadable(error) for k in metrics}
            return state, metrics

        return call

    real_make = loop.make_train_step
    monkeypatch.setattr(loop, "make_train_step", lambda *a, **k: failing(real_make(*a, **k)))


@pytest.mark.slow
@pytest.mark.parametrize("shows", ["at the call", "at the read"])
def test_a_device_that_fails_in_a_step_stops_in_one_line_keeping_every_step_before_and_the_rerun_resumes(
    tmp_path, monkeypatch, capsys, shows
):
    """A GPU's illegal address in step 25, said when the step is called or when its results are
    first read (a step later, as an asynchronous failure shows): one line with XLA's words and what
    to do, exit 1, and nothing saved after it: the state it leaves is not the run's. The same
    command resumes from step 20. (Before: XLA's traceback.)"""
    run = tmp_path / "run"
    args = _train_args(tmp_path, str(TRAIN / "data.txt"), "--steps", "40")
    xla = "INTERNAL: CUDA error: an illegal memory access was encountered"
    _device_fails_at(monkeypatch, 25, jax.errors.JaxRuntimeError(xla), shows)
    line = _one_error_line(args, capsys, 1)
    assert line == (
        f"elmo-jax train: error: {run}: the device failed during the run ({xla}); step(s) 10, 20 are intact: "
        "check the device (nvidia-smi, on a GPU); once it works, rerun the same command to resume from step 20"
    )
    assert _steps(run) == [10, 20]
    monkeypatch.undo()
    _resumes(args, capsys, run, 20, 40)


@pytest.mark.slow
def test_a_training_file_unreadable_mid_run_stops_in_one_line_and_the_rerun_resumes(tmp_path, monkeypatch, capsys):
    """The training file fails to read mid-run (a failing disk or mount, a file gone since the
    glob): one line naming it, exit 2, the step reached saved; the same command resumes from it.
    (Before: the OSError's traceback.)"""
    from elmo_jax.text import sources

    run = tmp_path / "run"
    args = _train_args(tmp_path, str(TRAIN / "data.txt"), "--steps", "60")

    def failing_open(path, mode="r", *a, **k):
        # The first read after step 10 is on disk (each row's stream reads the file at each epoch).
        if str(path).endswith("data.txt") and mode == "rb" and (run / "checkpoints" / "10").exists():
            raise OSError(errno.EIO, "Input/output error", str(path))
        return open(path, mode, *a, **k)

    monkeypatch.setattr(sources, "open", failing_open, raising=False)
    line = _one_error_line(args, capsys, 2)
    assert line == (
        f"elmo-jax train: error: {TRAIN / 'data.txt'}: cannot be read (OSError: Input/output error); once it can, "
        "rerun the same command (a training run resumes from its newest checkpoint)"
    )
    saved = _steps(run)
    assert saved and 10 < saved[-1] < 60, saved  # the step reached, past step 10, saved
    monkeypatch.undo()
    _resumes(args, capsys, run, saved[-1], 60)


@pytest.mark.slow
def test_a_metrics_line_the_disk_refuses_stops_in_one_line_and_the_rerun_resumes(tmp_path, monkeypatch, capsys):
    """metrics.jsonl cannot be appended to at the second logged step (the disk fills, here for that
    file only): one line, exit 1, the step reached saved; the same command resumes from it.
    (Before: the OSError's traceback.)"""
    run = tmp_path / "run"
    args = _train_args(tmp_path, str(TRAIN / "data.txt"), "--steps", "40")
    appended = [0]

    def full(path, mode="r", *a, **k):
        if str(path).endswith("metrics.jsonl") and mode == "ab":
            appended[0] += 1
            if appended[0] == 2:
                raise OSError(errno.ENOSPC, "No space left on device")
        return open(path, mode, *a, **k)

    monkeypatch.setattr(hooks, "open", full, raising=False)
    line = _one_error_line(args, capsys, 1)
    assert line == (
        f"elmo-jax train: error: {run / 'metrics.jsonl'}: not written: the disk is full; free space and rerun "
        "the same command: the run resumes from its newest checkpoint"
    )
    assert _steps(run) == [10, 20]  # the step reached (the second logged one) saved
    monkeypatch.undo()
    assert cli.main(args) == 0
    assert f"resuming {run} from step 20 " in capsys.readouterr().out
    logged = [json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert logged == [10, 30, 40]  # step 20's record, refused by the disk, is lost: its step does not run again


@pytest.mark.slow
@pytest.mark.parametrize("at", [25, 1], ids=["later", "first-batch"])
def test_a_stuck_run_stops_in_one_line_with_its_threads_stacks_and_the_rerun_resumes(tmp_path, at, request, capsys):
    """No progress for --stall-timeout seconds (the reader hangs at its ``at``-th batch; nothing
    raises): one line naming the step it hung in and the file that holds every thread's stack,
    exit 1; that file shows the hanging reader; the same command, once the reader answers,
    resumes from the newest checkpoint. The watch is armed from the start, so a hang before the
    first step (its batch, its compile) is stopped too. (Without the watch the run waits for ever:
    the negative control below, with --stall-timeout 0.)"""
    run = tmp_path / "run"
    # Armed from the start, the watch's timeout also covers the set-up and the first step's
    # compile: 5 s was too few for them on a slow day, beside the negative control's run.
    args = _train_args(tmp_path, str(TRAIN / "data.txt"), "--steps", "30", "--stall-timeout", "10")
    env = {**os.environ, "XLA_FLAGS": xla_flags(1)}
    # The negative control, no watch, runs beside the test's runs (whose seconds it would add).
    control = None
    if at != 1:
        control = subprocess.Popen(
            [sys.executable, "-c", read_never_returns(at), *args[:-2], "--run-dir", str(tmp_path / "off"),
             "--stall-timeout", "0"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
        )  # fmt: skip
        request.addfinalizer(lambda: (control.kill(), control.wait()))
        started = time.monotonic()
    hung = subprocess.run(
        [sys.executable, "-c", read_never_returns(at), *args], capture_output=True, text=True, timeout=300, env=env
    )
    assert hung.returncode == 1, hung.stderr[-3000:]
    intact = _steps(run)
    [line] = _error_lines(hung.stderr)
    assert "Traceback" not in hung.stderr
    doing = re.search(r"\(--stall-timeout\) while (.*?): the run", line)
    assert doing is not None, line
    if at == 1:
        assert intact == [] and doing[1] == "running step 1, this run's first (its batch, then its compile)", line
        resume, rerun = "no checkpoint was saved before it: rerun the same command", f"starting {run} from scratch "
    else:
        stuck = re.fullmatch(r"running step (\d+)", doing[1])
        assert intact and intact[-1] >= 10 and stuck and int(stuck[1]) > intact[-1], line
        resume = (
            f"step(s) {', '.join(map(str, intact))} are intact: rerun the same command to resume from step {intact[-1]}"
        )
        rerun = f"resuming {run} from step {intact[-1]} "
    assert line == (
        f"elmo-jax train: error: {run}: no progress for 10 s (--stall-timeout) while {doing[1]}: the run is stuck (a "
        "read that never returns, a deadlock, a device that no longer answers); every thread's stack is in "
        f"{run / 'stalled.txt'}; {resume}"
    )
    stacks = (run / "stalled.txt").read_text()
    assert stacks.startswith(f"no progress for 10 s while {doing[1]}; every thread's Python stack:")
    assert "in next_batch_or_hang" in stacks and "prefetch.py" in stacks, stacks

    # The rerun, here (the stop above is the one that needs a process of its own).
    capsys.readouterr()
    assert cli.main(args) == 0
    assert rerun in capsys.readouterr().out
    assert _steps(run)[-1] == 30

    if control is None:
        return
    with pytest.raises(subprocess.TimeoutExpired):  # no watch, no end
        control.wait(timeout=max(0.1, 15 - (time.monotonic() - started)))


@pytest.mark.slow
def test_a_second_session_in_a_run_dir_in_use_is_refused_in_one_line_and_touches_nothing(tmp_path, capsys):
    """The same command started twice (a job requeued while the first still runs): the second
    session stops before it opens anything in the run dir, in one line naming the first one's
    process, exit 2; the run dir is as the first one left it. Once the first is gone, killed
    outright even, the same command resumes. (Before: the second trained into the same run dir,
    its checkpoint manager deleting the first one's saves in flight as it opened.)"""
    run = tmp_path / "run"
    args = _train_args(tmp_path, str(TRAIN / "data.txt"), "--steps", "30")
    env = {**os.environ, "XLA_FLAGS": xla_flags(1)}
    first = subprocess.Popen(
        [sys.executable, "-c", read_never_returns(15), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not saved_steps(str(run)) and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _steps(run) == [10], first.poll()  # saved step 10, then hangs at its 15th batch
        before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
        line = _one_error_line(args, capsys, 2)
        note = re.escape(f"process {first.pid} on {socket.gethostname()}, training since ")
        assert re.fullmatch(
            f"elmo-jax train: error: {re.escape(str(run))}: another session is training in this run dir \\({note}"
            r"[^)]+\); wait for it to end or stop it, or give another --run-dir",
            line,
        ), line
        assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before
        assert first.poll() is None  # the first goes on, untouched
    finally:
        first.kill()
        first.wait()
    _resumes(args, capsys, run, 10, 30)


@pytest.mark.slow
@pytest.mark.parametrize("gone", ["stdout", "both"])
def test_a_reader_of_its_output_that_goes_away_does_not_stop_the_run(tmp_path, gone):
    """``elmo-jax train | head -1``, a ``tee`` that was killed: the pipe of standard output (and,
    with ``2>&1``, of standard error) closes under the run. It goes on to its last step and saves
    it, saying so once on standard error where that is still there. (Before: BrokenPipeError's
    traceback out of the next print, and the run stopped.)"""
    run = tmp_path / "run"
    args = _train_args(tmp_path, str(TRAIN / "data.txt"), "--steps", "30", "--save-every", "10")
    proc = subprocess.Popen(
        [sys.executable, "-m", "elmo_jax", *args], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE if gone == "stdout" else subprocess.STDOUT, text=True,
        env={**os.environ, "XLA_FLAGS": xla_flags(1)},
    )  # fmt: skip
    assert proc.stdout is not None
    proc.stdout.close()  # the reader goes before the first line
    err = proc.stderr.read() if proc.stderr is not None else ""
    assert proc.wait(timeout=300) == 0, err[-3000:]
    assert _steps(run)[-1] == 30
    if gone == "stdout":
        assert "Traceback" not in err
        assert "warning: elmo-jax train: its standard output is gone (its reader closed it); going on without it" in (
            err.splitlines()
        ), err[-3000:]


def test_the_host_file_of_a_step_still_on_disk_is_kept_until_its_directory_goes(tmp_path):
    """keep 1: Orbax drops step 1 from its list as step 2's save starts, but deletes its directory
    only once step 2 commits. Until then step 1 is what a failed save or a kill -9 leaves to resume
    from, and it needs its host file. (Before: deleted as step 2's save started; with a full disk,
    or a kill during the save, no checkpoint was readable.) At the run's end none is left over."""
    import jax.numpy as jnp
    import numpy as np

    from elmo_jax.training.checkpoint import Checkpointer

    ckpt = Checkpointer(str(tmp_path / "run"), keep=1, async_save=False)
    state, lstm = {"w": jnp.arange(4.0)}, {"h": jnp.zeros(2)}
    ckpt.save(1, state, lstm, {"data": {"x": np.arange(3)}}, {"seed": 0})
    host = tmp_path / "run" / "host_state"
    (host / "2.p0.npz").write_bytes(b"")  # step 2's, written as its save starts
    real = ckpt.manager.all_steps
    ckpt.manager.all_steps = lambda: [2]  # Orbax's list once step 2's save has started
    ckpt._prune_host_files()
    assert (host / "1.p0.npz").exists()  # step 1's directory is there: it is still the newest intact
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "1")  # what Orbax does once step 2 commits
    ckpt._prune_host_files()
    assert sorted(p.name for p in host.iterdir()) == ["2.p0.npz"]
    ckpt.manager.all_steps = real
    (host / "2.p0.npz").unlink()
    # A real run's end: one checkpoint, one host file.
    ckpt.save(3, state, lstm, {"data": {"x": np.arange(3)}}, {"seed": 0})
    ckpt.save(4, state, lstm, {"data": {"x": np.arange(3)}}, {"seed": 0})
    ckpt.close()
    assert [p.name for p in host.iterdir()] == ["4.p0.npz"]
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["4"]
