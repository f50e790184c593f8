"""Files this user may not read, and outputs where it may not write: a directory or file whose
permissions refuse it, and a file system mounted read-only. Each command says so in one line that
names its flag and the path at fault, and writes nothing there; the compile cache falls back to
compiling, with a warning.

The refusals are the kernel's own, not mocks. Root's reads and writes ignore permission bits
(CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH), so as root the commands run under ``setpriv`` without
those capabilities; the read-only file system is a tmpfs mounted ``ro`` (root only: skipped where
it cannot be mounted). Before: the temporary file's name instead of the flag (``/d/.x.hdf5.host-1
.abc.tmp.hdf5: is not open to this user``); on a read-only file system, tracebacks from ``vocab``
and ``train``, advice to free space from ``embed``, ``ELMO_JAX_HOME`` named for a ``--cache-dir``
given, and jax's own warning for the compile cache; weights not this user's called "not a
readable HDF5 file", a run dir it may not enter "not a run directory", and a glob into a
directory it may not enter "no files match" without a word why.
"""

import errno
import json
import os
import shutil
import subprocess
import sys

import pytest
from helpers import FIXTURES, xla_flags
from test_pretrain import TRAIN, _write_tiny_options

from elmo_jax._util.atomic import write_text_atomic
from elmo_jax._util.disk_full import OutOfSpaceError
from elmo_jax._util.paths import READ_ONLY

ELMO = FIXTURES / "allennlp_elmo"

# Runs each command of argv[1] (a JSON list) through the program's own entry point, as
# ``elmo-jax ...`` runs it (one-line warnings included), in this one process: [exit code, stderr].
DRIVER = """
import contextlib, io, json, sys
from elmo_jax import cli
said = []
for argv in json.loads(sys.argv[1]):
    sys.argv = ["elmo-jax", *argv]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli.main()
    said.append([code, err.getvalue()])
print(json.dumps(said))
"""

# Root without the capabilities that let it read and write where the permissions say no.
NO_OVERRIDE = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner"]


def _commands(refused, tmp_path) -> list[list[str]]:
    sentences = tmp_path / "sentences.txt"
    sentences.write_text("the cat sat .\n")
    options = _write_tiny_options(tmp_path / "options.json")
    train = ["train", "--config", str(options), "--train-files", str(TRAIN / "data.txt")]
    train += ["--vocab", str(TRAIN / "vocab.txt"), "--steps", "1", "--no-progress"]
    return [
        ["embed", "--input", str(sentences), "--output", f"{refused}/x.hdf5"]
        + ["--options", str(ELMO / "options.json"), "--weights", str(ELMO / "lm_weights.hdf5")],
        ["vocab", "--train-files", str(TRAIN / "data.txt"), "--out", f"{refused}/vocab.txt"],
        [*train, "--run-dir", f"{refused}/run"],
        [*train, "--run-dir", str(refused)],
        ["models", "--cache-dir", f"{refused}/cache", "--fetch", "small"],
        ["--compile-cache", f"{refused}/xla", "vocab", "--train-files", str(TRAIN / "data.txt")]
        + ["--out", str(tmp_path / "vocab.txt")],
    ]


def _run(commands, prefix=()) -> list[tuple[int, str]]:
    env = {
        **os.environ,
        "XLA_FLAGS": xla_flags(1),
        # A mirror that is not there: a fetch that got past the cache directory would fail on it,
        # never reach the network.
        "ELMO_JAX_MIRROR": "file:///nonexistent-mirror",
    }
    r = subprocess.run(
        [*prefix, sys.executable, "-c", DRIVER, json.dumps(commands)], capture_output=True, text=True, env=env
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return [(code, err) for code, err in json.loads(r.stdout)]


def _assert_said(said, expected) -> None:
    for (code, err), (want_code, want_line) in zip(said, expected, strict=True):
        assert "Traceback" not in err, err[-3000:]
        lines = [line for line in err.splitlines() if line.startswith(("elmo-jax", "warning:"))]
        assert (code, lines) == (want_code, [want_line]), err[-3000:]


def _no_override(tmp_path) -> list[str]:
    """The prefix under which this user's reads and writes obey the permission bits (only root's
    need one); a skip where it cannot be had."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("root, and no setpriv to run without CAP_DAC_OVERRIDE")
    probe = tmp_path / "probe"
    probe.mkdir(mode=0o555)
    r = subprocess.run([*NO_OVERRIDE, "touch", str(probe / "x")], capture_output=True, text=True)
    if r.returncode == 0 or "Permission denied" not in r.stderr:
        pytest.skip(f"setpriv cannot drop CAP_DAC_OVERRIDE here: {r.stderr.strip()[:80]}")
    return NO_OVERRIDE


@pytest.mark.slow
def test_a_directory_this_user_may_not_write_is_one_line_naming_the_flag_and_it(tmp_path):
    refused = tmp_path / "theirs"
    refused.mkdir()
    # A run this user may read but not write into: export's --out-dir under it is the flag at
    # fault, not --run-dir, which names the directory (before: --run-dir, read only here).
    commands = _commands(refused, tmp_path)
    trained = refused / "trained"
    assert _run([[*commands[2][: commands[2].index("--run-dir")], "--run-dir", str(trained)]])[0][0] == 0
    trained.chmod(0o555)
    refused.chmod(0o555)
    # A run dir of this user's whose checkpoints are not: refused before a step is trained (it
    # would train up to its first save).
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints").chmod(0o555)
    commands.append([*commands[2][: commands[2].index("--run-dir")], "--run-dir", str(run)])
    commands.append(["export", "--run-dir", str(trained), "--out-dir", f"{trained}/export"])
    # Its embed with --output inside it: the same (before: --run-dir, which embed only reads).
    commands.append([*commands[0][:3], "--run-dir", str(trained), "--output", f"{trained}/x.hdf5"])
    try:
        said = _run(commands, _no_override(tmp_path))
        assert os.listdir(refused) == ["trained"]  # nothing written, not even a temporary file
        assert "export" not in os.listdir(trained) and "x.hdf5" not in os.listdir(trained)
    finally:
        refused.chmod(0o755)
        trained.chmod(0o755)
        (run / "checkpoints").chmod(0o755)
    assert os.listdir(run / "checkpoints") == []
    why = f"{refused} is not writable by this user (permission denied)"
    _assert_said(
        said,
        [
            (2, f"elmo-jax embed: error: --output {refused}/x.hdf5: {why}"),
            (2, f"elmo-jax vocab: error: --out {refused}/vocab.txt: {why}"),
            (2, f"elmo-jax train: error: --run-dir {refused}/run: {why}"),
            (2, f"elmo-jax train: error: --run-dir {refused}: is not writable by this user (permission denied)"),
            (2, f"elmo-jax models: error: --cache-dir {refused}/cache: {why}"),
            (
                0,
                f"warning: the compile cache {refused}/xla: {why}; compiling without one: give it another "
                "directory ($ELMO_JAX_COMPILE_CACHE, or elmo-jax --compile-cache)",
            ),
            (
                2,
                f"elmo-jax train: error: --run-dir {run}: {run}/checkpoints is not writable by this user (permission denied)",
            ),
            (
                2,
                f"elmo-jax export: error: --out-dir {trained}/export: {trained} is not writable by this user (permission denied)",
            ),
            (
                2,
                f"elmo-jax embed: error: --output {trained}/x.hdf5: {trained} is not writable by this user (permission denied)",
            ),
        ],
    )
    assert (tmp_path / "vocab.txt").is_file()  # the command the compile cache could not serve ran


@pytest.mark.slow
def test_inputs_this_user_may_not_read_are_one_line_naming_the_flag_and_the_path(tmp_path):
    weights = tmp_path / "weights.hdf5"
    shutil.copyfile(ELMO / "lm_weights.hdf5", weights)
    text = tmp_path / "text.txt"
    shutil.copyfile(TRAIN / "data.txt", text)
    shards, run = tmp_path / "shards", tmp_path / "run"
    shards.mkdir()
    shutil.copyfile(TRAIN / "data.txt", shards / "a.txt")
    run.mkdir()
    (run / "options.json").write_text("{}")
    closed = [weights, text, shards, run]
    embed = ["embed", "--output", str(tmp_path / "out.hdf5"), "--options", str(ELMO / "options.json")]
    commands = [
        [*embed, "--input", str(TRAIN / "data.txt"), "--weights", str(weights)],
        [*embed, "--input", str(text), "--weights", str(ELMO / "lm_weights.hdf5")],
        ["vocab", "--train-files", f"{shards}/*.txt", "--out", str(tmp_path / "vocab.txt")],
        ["export", "--run-dir", str(run), "--out-dir", str(tmp_path / "export")],
    ]
    for path in closed:
        path.chmod(0)
    try:
        said = _run(commands, _no_override(tmp_path))
    finally:
        for path in closed:
            path.chmod(0o755)
    why = "is not open to this user (permission denied)"
    _assert_said(
        said,
        [
            (2, f"elmo-jax embed: error: --weights {weights}: {why}"),
            (2, f"elmo-jax embed: error: --input {text}: {why}"),  # as before: the control
            (2, f"elmo-jax vocab: error: --train-files {shards}/*.txt: no files match {shards}/*.txt ({shards} {why})"),
            (2, f"elmo-jax export: error: --run-dir {run}: {why}"),
        ],
    )
    assert sorted(set(os.listdir(tmp_path)) - {"probe"}) == ["run", "shards", "text.txt", "weights.hdf5"]


@pytest.mark.slow
def test_a_read_only_file_system_is_one_line_naming_the_flag_and_it(tmp_path):
    mount = tmp_path / "ro"
    mount.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mount)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()[:80]})")
    try:
        said = _run(_commands(mount, tmp_path))
        # A library caller is told of the file, in the same words.
        with pytest.raises(OutOfSpaceError) as refused:
            write_text_atomic(mount / "vocab.txt", "a\n")
        assert refused.value.errno == errno.EROFS
        assert (
            str(refused.value)
            == f"{mount}/vocab.txt: not written: {mount} {READ_ONLY}; choose another output path and rerun"
        )
        assert os.listdir(mount) == []
    finally:
        subprocess.run(["umount", str(mount)], check=False)
    why = f"{mount} is on a read-only file system"
    _assert_said(
        said,
        [
            (1, f"elmo-jax embed: error: {mount}/x.hdf5: not written: {why}; choose another output path and rerun"),
            (1, f"elmo-jax vocab: error: {mount}/vocab.txt: not written: {why}; choose another output path and rerun"),
            (1, f"elmo-jax train: error: --run-dir {mount}/run: {why}"),
            (1, f"elmo-jax train: error: --run-dir {mount}: is on a read-only file system"),
            (2, f"elmo-jax models: error: --cache-dir {mount}/cache: {why}"),
            (
                0,
                f"warning: the compile cache {mount}/xla: {why}; compiling without one: give it another "
                "directory ($ELMO_JAX_COMPILE_CACHE, or elmo-jax --compile-cache)",
            ),
        ],
    )
