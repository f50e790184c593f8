"""The command line itself (``elmo-jax`` / ``python -m elmo_jax``): its flags, one-line messages
and exit codes, Ctrl-C, the compile-cache flag, and how library errors become flag messages.
What the commands compute and write is tested with the library: test_embed.py, test_pretrain.py, ..."""

import io
import json
import os
import signal
import subprocess
import sys
import tempfile

import h5py
import numpy as np
import pytest
from helpers import AS_FROM_A_TERMINAL, embed_sentences, model_files, run_elmo_jax, xla_flags
from test_pretrain import TRAIN, _write_tiny_options

from elmo_jax import cli
from elmo_jax._util.arguments import about
from elmo_jax._util.device_memory import DeviceFailed, OutOfDeviceMemory
from elmo_jax.cli import commands
from elmo_jax.cli import parser as cli_parser
from elmo_jax.config import ConfigError, preset
from elmo_jax.extract.embedder import Embedder
from elmo_jax.model.vocabulary import Vocabulary
from elmo_jax.text.sources import Lines

OPTIONS, WEIGHTS = (str(p) for p in model_files("allennlp"))


@pytest.fixture(scope="module")
def sentences():
    return embed_sentences()


def run_cli(*args):
    return cli.main(["embed", "--options", OPTIONS, "--weights", WEIGHTS, "--no-progress", *args])


# -- library errors, flag messages --------------------------------------------------------------
def test_an_error_about_arguments_names_the_flags_and_only_those():
    flags = cli.build_parser().parse_args(["embed", "--input", "x", "--output", "y"]).flags
    e = about(ConfigError("window must be 1 or more and ahead 0 or more; window_size stays"), "window", "ahead")
    assert commands.error_line(e, flags) == "--window must be 1 or more and --ahead 0 or more; window_size stays"
    # Negative control: the same words in an error not marked as about them stay as they are.
    assert commands.error_line(ConfigError("window and ahead"), flags) == "window and ahead"
    train = cli.build_parser().parse_args(["train"]).flags
    assert train["source"] == "--init-from" and train["eval_every"] == "--eval-every"
    assert (
        commands.error_line(
            about(ConfigError("eval_every 3 is not a multiple of log_every 2"), "eval_every", "log_every"), train
        )
        == "--eval-every 3 is not a multiple of --log-every 2"
    )


# -- embed (from test_embed.py) ------------------------------------------------------------------
def test_embed_drops_a_byte_order_mark_and_names_utf16_input(tmp_path, capsys):
    """A file that an editor started with U+FEFF embeds as the same file without it; a UTF-16 file
    is said to be one."""
    text = b"the cat sat\non the mat\n"
    (tmp_path / "plain.txt").write_bytes(text)
    # The mark again at the start of line 3, where it is not a byte-order mark and is kept.
    (tmp_path / "marked.txt").write_bytes(b"\xef\xbb\xbf" + text + b"\xef\xbb\xbfthe cat sat\n")
    (tmp_path / "one.txt").write_bytes(text.splitlines()[0])
    for name in ("plain", "marked", "one"):
        assert run_cli("--input", str(tmp_path / f"{name}.txt"), "--output", str(tmp_path / f"{name}.hdf5")) == 0
    err = capsys.readouterr().err.splitlines()
    assert [line.split(" to ")[0] for line in err] == ["wrote 2 sentences", "wrote 3 sentences", "wrote 1 sentence"]
    with h5py.File(tmp_path / "plain.hdf5", "r") as plain, h5py.File(tmp_path / "marked.hdf5", "r") as marked:
        assert sorted(plain) == ["0", "1"] and sorted(marked) == ["0", "1", "2"]
        for k in plain:  # equal up to float32 rounding: another line in the call packs it otherwise
            np.testing.assert_allclose(marked[k][()], plain[k][()], rtol=1e-5, atol=1e-6)
        # Negative control: kept, the mark changes the word's vectors.
        assert np.abs(marked["2"][()] - plain["0"][()]).max() > 1e-2
    (tmp_path / "utf16.txt").write_text("the cat sat\n", encoding="utf-16")
    assert run_cli("--input", str(tmp_path / "utf16.txt"), "--output", str(tmp_path / "u.hdf5")) == 2
    assert "utf16.txt: line 1: not UTF-8 (invalid start byte at byte 0); it starts as UTF-16" in capsys.readouterr().err


def test_embed_reads_standard_input_as_it_reads_a_file(tmp_path, capsys, monkeypatch):
    """``--input -``, as AllenNLP's ``elmo`` command takes it: the same datasets as the same text
    in a file (a byte-order mark dropped alike), its spooled copy removed; a line that is not UTF-8,
    no standard input, and shards of it are each one line. (Before: "-: does not exist".)"""
    text = b"the cat sat\non the mat\n"
    (tmp_path / "plain.txt").write_bytes(text)
    spool = tmp_path / "spool"
    spool.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spool))

    def from_stdin(data: bytes | None, *args: str) -> int:
        stdin = None if data is None else io.TextIOWrapper(io.BytesIO(data), encoding="utf-8")
        monkeypatch.setattr(sys, "stdin", stdin)
        return run_cli("--input", "-", *args)

    assert run_cli("--input", str(tmp_path / "plain.txt"), "--output", str(tmp_path / "file.hdf5")) == 0
    assert from_stdin(b"\xef\xbb\xbf" + text, "--output", str(tmp_path / "stdin.hdf5")) == 0
    assert capsys.readouterr().err.splitlines()[-1] == f"wrote 2 sentences to {tmp_path / 'stdin.hdf5'}"
    with h5py.File(tmp_path / "file.hdf5", "r") as file, h5py.File(tmp_path / "stdin.hdf5", "r") as stdin:
        assert sorted(stdin) == sorted(file) == ["0", "1"]
        for k in file:
            np.testing.assert_array_equal(stdin[k][()], file[k][()])
    assert list(spool.iterdir()) == []

    assert from_stdin(b"the cat\n\xff sat\n", "--output", str(tmp_path / "bad.hdf5")) == 2
    assert capsys.readouterr().err.strip() == (
        "elmo-jax embed: error: standard input (--input -): line 2: not UTF-8 (invalid start byte at byte 0)"
    )
    assert not (tmp_path / "bad.hdf5").exists() and list(spool.iterdir()) == []
    assert from_stdin(b"", "--output", str(tmp_path / "empty.hdf5")) == 0
    assert "standard input (--input -) is empty; wrote" in capsys.readouterr().err
    assert from_stdin(None, "--output", str(tmp_path / "none.hdf5")) == 2
    assert "standard input (--input -): this process has none to read; give a file" in capsys.readouterr().err
    shards = ["--output", str(tmp_path / "s.hdf5"), "--num-shards", "2", "--shard-index", "0"]
    assert from_stdin(text, *shards) == 2
    assert "--input -: standard input goes to one process; give a file to split with --num-shards" in (
        capsys.readouterr().err
    )


def test_cli_bad_input(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    assert run_cli("--input", str(tmp_path / "empty.txt"), "--output", str(tmp_path / "e.hdf5")) == 0
    with h5py.File(tmp_path / "e.hdf5", "r") as f:
        assert list(f.keys()) == []
    assert "is empty; wrote" in capsys.readouterr().err
    assert run_cli("--input", str(tmp_path / "empty.txt"), "--output", str(tmp_path / "p.hdf5"), "--pool", "mean") == 0
    with h5py.File(tmp_path / "p.hdf5", "r") as f:
        assert list(f.keys()) == ["embeddings"] and f["embeddings"].shape[0] == 0
    assert (
        "is empty; wrote " + str(tmp_path / "p.hdf5") + " with an 'embeddings' dataset of 0 rows"
        in capsys.readouterr().err
    )
    (tmp_path / "bad.txt").write_bytes(b"fine line\nbad \xff line\n")
    assert run_cli("--input", str(tmp_path / "bad.txt"), "--output", str(tmp_path / "b.hdf5")) == 2
    err = capsys.readouterr().err
    assert "bad.txt: line 2: not UTF-8" in err and "Traceback" not in err
    assert not (tmp_path / "b.hdf5").exists()
    assert sorted(os.listdir(tmp_path)) == ["bad.txt", "e.hdf5", "empty.txt", "p.hdf5"]  # no temporary file left
    assert run_cli("--input", str(tmp_path / "empty.txt"), "--output", str(tmp_path / "missing/o.hdf5")) == 2
    assert "does not exist" in capsys.readouterr().err
    assert (
        cli.main(
            [
                "embed",
                "--run-dir",
                str(tmp_path),
                "--input",
                str(tmp_path / "empty.txt"),
                "--output",
                str(tmp_path / "x.hdf5"),
            ]
        )
        == 2
    )
    assert "not a run directory" in capsys.readouterr().err
    opts = json.loads(open(OPTIONS).read())
    opts["lstm"]["dim"] = 32
    (tmp_path / "o.json").write_text(json.dumps(opts))
    assert (
        cli.main(
            [
                "embed",
                "--options",
                str(tmp_path / "o.json"),
                "--weights",
                WEIGHTS,
                "--input",
                str(tmp_path / "empty.txt"),
                "--output",
                str(tmp_path / "x.hdf5"),
            ]
        )
        == 2
    )
    assert "has shape (32, 256), expected (32, 128)" in capsys.readouterr().err


def test_ctrl_c_leaves_no_file_under_the_final_name(tmp_path, monkeypatch, sentences):
    (tmp_path / "in.txt").write_text("\n".join(" ".join(s) for s in sentences) + "\n")

    def interrupted(self, lines, window=2048, **options):
        yield 0, np.zeros((3, 1, 32), np.float32)
        raise KeyboardInterrupt

    monkeypatch.setattr(Embedder, "embed_stream", interrupted)
    assert run_cli("--input", str(tmp_path / "in.txt"), "--output", str(tmp_path / "o.hdf5")) == 130
    assert sorted(os.listdir(tmp_path)) == ["in.txt"]


@pytest.mark.slow
@pytest.mark.parametrize("sent", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_ctrl_c_or_sigterm_in_a_real_run_exits_128_plus_it_and_leaves_no_file(tmp_path, sentences, sent):
    """SIGINT, SIGTERM or SIGHUP to a running `elmo-jax embed` (its background thread writing,
    programs compiling): a clean exit, 128 + the signal's number, its partial output removed.
    (Before, SIGTERM and SIGHUP ended it at once, leaving a hidden temporary file as large as what
    it had written, and no word.)"""
    import signal
    import time

    lines = [" ".join(s) for s in sentences if s]
    (tmp_path / "in.txt").write_text("\n".join(lines[i % len(lines)] for i in range(20000)) + "\n")
    env = {**os.environ, "XLA_FLAGS": xla_flags(1)}
    # The compile cache off: Ctrl-C lands while programs compile, which could crash the exit.
    cmd = [
        sys.executable,
        "-c",
        AS_FROM_A_TERMINAL,
        "--compile-cache",
        "none",
        "embed",
        "--options",
        OPTIONS,
        "--weights",
        WEIGHTS,
        "--input",
        str(tmp_path / "in.txt"),
        "--output",
        str(tmp_path / "o.hdf5"),
        "--no-progress",
        "--window",
        "200",
    ]
    p = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not any(f.endswith(".tmp.hdf5") for f in os.listdir(tmp_path)) and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # windows embedded and being written
    signum = getattr(signal, sent)
    p.send_signal(signum)
    try:
        err = p.communicate(timeout=60)[1]
    finally:  # a wedged run must not outlive the test (one did, before background.Channel)
        p.kill()
    assert p.returncode == 128 + signum, err
    assert err.strip().splitlines()[-1] == "elmo-jax embed: interrupted" + ("" if sent == "SIGINT" else f" ({sent})")
    assert sorted(os.listdir(tmp_path)) == ["in.txt"]


@pytest.mark.slow
def test_an_interrupted_program_does_not_wait_at_its_exit_for_a_timer_a_library_left_running():
    """A signal that lands in jax's ``finally: timer.cancel()`` at backend start-up left its 60 s
    TPU-warning timer running: ``elmo-jax train`` said "interrupted", then waited 60 s at its exit
    (found by signals sent at random moments). Here a command leaves a 600 s timer, as jax did, and is
    interrupted: the program ends at once, 130. Negative control, without ``_cancel_timers``: the
    test times out after 30 s."""
    script = (
        "import sys, threading\n"
        "from elmo_jax.cli import commands\n"
        "def interrupted(args):\n"
        "    threading.Timer(600, print, ('the timer ran',)).start()\n"
        "    raise KeyboardInterrupt\n"
        "commands.cmd_train = interrupted\n"
        "sys.argv = ['elmo-jax', 'train']\n"
        "sys.exit(commands.main())\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert r.returncode == 130, r.stderr
    assert r.stderr.strip().splitlines()[-1] == "elmo-jax train: interrupted"
    assert "the timer ran" not in r.stdout


def _when_jax_is_imported(action: str, argv: list[str], then: str = "") -> str:
    """A program that runs ``elmo-jax ARGV`` as a terminal starts it, doing ``action`` (one line)
    when the imports first look for jax, and ``then`` after the command returns, before it exits."""
    return (
        AS_FROM_A_TERMINAL.replace("from elmo_jax.cli import main; sys.exit(main())", "") + "\nimport os, time\n"
        "class AtJax:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'jax':\n"
        f"            {action}\n"
        "sys.meta_path.insert(0, AtJax())\n"
        f"sys.argv = ['elmo-jax', *{argv!r}]\n"
        "from elmo_jax.cli import main\n"
        "code = main()\n"
        f"{then}\n"
        "sys.exit(code)\n"
    )


@pytest.mark.slow
@pytest.mark.parametrize("sent", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_signal_while_the_program_imports_jax_is_its_one_line_and_exit_code(sent):
    """The program's first second is its imports (jax, Orbax). A signal there gave Ctrl-C's
    traceback out of jax's import, and ended the process by SIGTERM or SIGHUP's own action with no
    word; raised inside the import of jaxlib's C extensions it can also abort the interpreter (exit
    -6 or -11, seen by tests/probe_signals.py). Now ``import elmo_jax`` imports nothing heavy, and
    ``cli.main`` holds the signal until the commands are imported, then says it. Here the program
    signals itself as it starts importing jax, as the console script runs it; jax's import must then
    complete. Negative controls: at 610ffdc, a traceback ending in KeyboardInterrupt (SIGINT), and
    killed by the signal with nothing said (SIGTERM, SIGHUP); with the signal raised at once rather
    than held, the line is said but jax's import is cut short."""
    script = _when_jax_is_imported(
        f"sys.meta_path.remove(self); os.kill(os.getpid(), signal.{sent})",
        ["train", "--config", "tiny"],
        then="print('jax.numpy' in sys.modules)",
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    signum = getattr(signal, sent)
    assert r.returncode == 128 + signum, r.stderr
    assert r.stderr == "elmo-jax train: interrupted" + ("\n" if sent == "SIGINT" else f" ({sent})\n")
    assert r.stdout == "True\n"  # held: the imports it came in went through


@pytest.mark.slow
def test_an_import_that_hangs_stops_at_the_second_signal():
    """The signals held in the imports are held once: an import that never returns (a stalled
    network file system) stops at a second Ctrl-C, where holding every signal would leave only
    kill -9. Negative control, holding every signal: the test times out."""
    script = _when_jax_is_imported(
        "print('importing jax', flush=True); time.sleep(3600)", ["embed", "--input", "in.txt", "--output", "out.h5"]
    )
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline() == "importing jax\n"
        p.send_signal(signal.SIGINT)
        with pytest.raises(subprocess.TimeoutExpired):
            p.wait(timeout=1)  # the first is held
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=30) == 130
        assert p.stderr is not None and p.stderr.read() == "elmo-jax embed: interrupted\n"
    finally:
        p.kill()
        p.communicate()


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        ([], None),
        (["-h"], None),
        (["train", "--preset", "tiny"], "train"),
        (["--compile-cache", "none", "embed", "-x"], "embed"),
        (["--compile-cache=c", "eval"], "eval"),
    ],
)
def test_the_command_an_interruption_before_the_parser_names(argv, command):
    """``cli.main`` names the command in its line for an interrupt before the parser has run."""
    assert cli_parser.named_command(argv) == command


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        ([], "no command given: choose one of demo, vocab, train, eval, embed, export, models"),
        (["--compile-cache", "x"], "no command given: choose one of demo, vocab, train, eval, embed, export, models"),
        (
            ["trian", "--steps", "3"],
            "'trian' is not a command (choose one of demo, vocab, train, eval, embed, "
            "export, models); did you mean train?",
        ),
        (
            ["frobnicate"],
            "'frobnicate' is not a command (choose one of demo, vocab, train, eval, embed, export, models)",
        ),
    ],
)
def test_a_missing_or_mistyped_command_is_one_line_naming_the_commands(argv, said, capsys):
    """argparse said "the following arguments are required: command" and "argument command:
    invalid choice: 'trian' (choose from 'demo', ...)"; the line now names the commands, and the
    nearest one to a typo. Negative control: the command spelt right parses."""
    with pytest.raises(SystemExit) as e:
        cli_parser.parse(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err == f"elmo-jax: error: {said} (see elmo-jax --help)\n"
    if argv[:1] == ["trian"]:
        assert cli_parser.parse(["train", *argv[1:]]).steps == 3


def test_version_is_the_installed_package_s(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as e:
        cli_parser.parse(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"elmo-jax {version('elmo_jax')}\n"


def test_help_and_a_mistyped_flag_are_answered_without_importing_jax(tmp_path):
    """``elmo-jax --help`` took about two seconds, nearly all of it importing jax and Orbax for a
    command that never ran; the parser imports neither, so help and usage errors come at once. One
    fresh interpreter answers each in turn and says whether jax is imported yet. Negative control,
    last: a command line that parses imports jax to run (its input is missing: exit 2)."""
    script = (
        "import contextlib, io, sys\n"
        "from elmo_jax.cli import main\n"
        "for argv in sys.argv[1:]:\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        "        try:\n"
        "            code = main(argv.split())\n"
        "        except SystemExit as e:\n"
        "            code = e.code\n"
        "    print(code, 'jax' in sys.modules)\n"
    )
    missing = tmp_path / "missing.txt"
    answers = [
        "--help",
        "train --help",
        "embed --help",
        "train --bogus",
        "trian",
        "train --batch-size many",
        "embed --options o.json --input a --output b",  # --options needs --weights
        "eval",  # --run-dir is required
        f"embed --input {missing} --output {tmp_path / 'out.h5'}",
    ]
    r = subprocess.run([sys.executable, "-c", script, *answers], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["0 False"] * 3 + ["2 False"] * 5 + ["2 True"]


@pytest.mark.parametrize(
    ("argv", "cache"),
    [
        (["embed", "--input", "a", "--output", "b"], None),  # the default
        (["--compile-cache", "x", "embed", "--input", "a", "--output", "b"], "x"),
        (["embed", "--input", "a", "--output", "b", "--compile-cache", "x"], "x"),  # where users put flags
        (["--compile-cache", "x", "train", "--compile-cache", "y"], "y"),  # the later one, as argparse does
        (["--compile-cache", "x", "models"], "none"),  # it compiles nothing
        (["models", "--compile-cache", "x"], "none"),  # taken, as after any other command, and unused
    ],
)
def test_compile_cache_is_a_flag_before_or_after_the_command(argv, cache):
    from elmo_jax._util.runtime import default_compile_cache

    assert cli.build_parser().parse_args(argv).compile_cache == (cache or default_compile_cache())


@pytest.mark.parametrize("where", ["a gc callback", "a __del__"])
@pytest.mark.parametrize("sent", ["SIGTERM", "SIGINT"])
def test_a_signal_whose_exception_python_swallows_is_sent_again_not_lost(where, sent):
    """A signal's handler can run inside code whose exceptions Python prints and drops: a gc
    callback (jax registers one), a ``__del__``. ``elmo-jax train`` so lost a signal at start-up
    in 2 runs of 80 (``tests/probe_signals.py``), printing "Exception ignored in: <function
    _xla_gc_callback>" and training on to its end. Under the command's handlers, the signal is
    sent again and raised once that code has returned. Negative control, without the
    unraisable hook: nothing is raised, and the test fails."""
    import gc
    import signal
    import time

    from elmo_jax.cli.signals import Terminated, interrupting_signals

    armed = [True]

    def land_here():
        if armed[0]:
            armed[0] = False
            signal.raise_signal(getattr(signal, sent))
            for _ in range(1000):  # the handler runs on a backward jump, still in here
                pass

    class Dropped:
        def __del__(self):
            land_here()

    def in_gc(phase, info):
        if phase == "start":
            land_here()

    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with interrupting_signals(), pytest.raises(KeyboardInterrupt) as e:
            if where == "a gc callback":
                gc.callbacks.append(in_gc)
                try:
                    gc.collect()
                finally:
                    gc.callbacks.remove(in_gc)
            else:
                Dropped()
            time.sleep(0.5)  # the signal sent again lands here, at the latest
    finally:
        signal.signal(signal.SIGINT, before)
    assert not armed[0]
    assert isinstance(e.value, Terminated) == (sent == "SIGTERM")


def test_embed_flag_errors_name_the_flags(tmp_path, capsys, sentences):
    """Split from test_embed.py's test_cli_pool_writes_one_dataset: its flag checks."""
    (tmp_path / "in.txt").write_text("\n".join(" ".join(s) for s in sentences) + "\n", encoding="utf-8")
    assert run_cli("--input", str(tmp_path / "in.txt"), "--output", str(tmp_path / "x.hdf5"), "--layers", "1,2") == 2
    assert "--layers: expected 3 weights" in capsys.readouterr().err
    for weights in ("1,2,nan", "1,inf,2"):  # both wrote every vector as NaN
        args = ("--input", str(tmp_path / "in.txt"), "--output", str(tmp_path / "x.hdf5"), "--layers", weights)
        assert run_cli(*args) == 2
        assert "error: --layers: the weights must be finite float32 numbers, got [1.0, " in capsys.readouterr().err
    assert run_cli("--input", str(tmp_path / "in.txt"), "--output", str(tmp_path / "x.hdf5"), "--shard-index", "0") == 2
    assert "--shard-index needs --num-shards" in capsys.readouterr().err
    assert (
        run_cli(
            "--input",
            str(tmp_path / "in.txt"),
            "--output",
            str(tmp_path / "x.hdf5"),
            "--num-shards",
            "2",
            "--shard-index",
            "2",
        )
        == 2
    )
    assert "needs --shard-index in 0..1" in capsys.readouterr().err
    args = ("--input", str(tmp_path / "in.txt"), "--output", str(tmp_path / "x.hdf5"), "--num-shards", "0")
    assert run_cli(*args) == 2
    assert "elmo-jax embed: error: --num-shards must be an integer >= 1; got 0\n" in capsys.readouterr().err
    assert (
        run_cli("--input", str(tmp_path / "in.txt"), "--output", str(tmp_path / "x.hdf5"), "--batch-tokens", "0") == 2
    )
    assert "--batch-tokens must be 1 or more; got 0" in capsys.readouterr().err
    assert run_cli("--input", str(tmp_path / "in.txt"), "--output", str(tmp_path / "x.hdf5"), "--ahead", "-1") == 2
    assert "elmo-jax embed: error: --ahead must be an integer >= 0; got -1\n" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["in.txt"]


@pytest.mark.slow
def test_cli_compile_cache_second_run_compiles_nothing(tmp_path, sentences):
    (tmp_path / "in.txt").write_text("\n".join(" ".join(s) for s in sentences[:6]) + "\n")

    def run(out):
        # jax's compiler logs each persistent-cache miss and hit at debug level.
        r = run_elmo_jax(
            "--compile-cache", tmp_path / "xla", "embed", "--options", OPTIONS, "--weights", WEIGHTS,
            "--input", tmp_path / "in.txt", "--output", tmp_path / out, "--no-progress",
            JAX_DEBUG_LOG_MODULES="jax._src.compiler",
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        return r.stderr.count("PERSISTENT COMPILATION CACHE MISS"), r.stderr.count("Persistent compilation cache hit")

    misses, hits = run("a.hdf5")
    assert misses >= 3 and hits == 0  # the char CNN, the gather, the biLSTM (and the marker vectors)
    assert run("b.hdf5") == (0, misses)
    with h5py.File(tmp_path / "a.hdf5") as a, h5py.File(tmp_path / "b.hdf5") as b:
        assert sorted(a) == sorted(b)
        for k in a:
            np.testing.assert_array_equal(a[k][()], b[k][()])


# -- precision (from test_policy.py), compute commands (from test_runtime.py) ----------------------
def test_cli_refuses_tf32_on_cpu(tmp_path, capsys):
    text = tmp_path / "in.txt"
    text.write_text("a b c\n")
    args = [
        "--compile-cache",
        "none",
        "embed",
        "--options",
        "x.json",
        "--weights",
        "x.hdf5",
        "--input",
        str(text),
        "--output",
        str(tmp_path / "out.hdf5"),
    ]
    assert cli.main(args + ["--precision", "tf32"]) == 2
    err = capsys.readouterr().err
    assert "--precision: precision 'tf32' is a GPU matmul mode" in err and "Traceback" not in err


def test_the_cli_warns_for_commands_that_compute_only(monkeypatch, tmp_path, capsys):
    calls = []
    monkeypatch.setattr(commands, "warn_if_accelerator_unused", lambda: calls.append(1))
    assert commands.main(["eval", "--run-dir", str(tmp_path / "missing"), "--files", str(tmp_path / "x.txt")]) != 0
    assert calls == [1]
    assert (
        commands.main(["vocab", "--train-files", str(tmp_path / "none-*.txt"), "--out", str(tmp_path / "v.txt")]) != 0
    )
    assert calls == [1]


# -- train (from test_pretrain.py) ----------------------------------------------------------------
def test_cli_bad_inputs_give_one_line_errors(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    blank = tmp_path / "blank.txt"
    blank.write_text(" \n\n\t\n")
    no_unk = tmp_path / "vocab.txt"
    no_unk.write_text("<S>\n</S>\nthe\n")
    big = _write_tiny_options(tmp_path / "o.json")
    opts = json.loads(big.read_text())
    opts["n_tokens_vocab"] = 99
    (tmp_path / "misfit.json").write_text(json.dumps(opts))
    cases = [
        (["--train-files", str(tmp_path / "nothing*.txt")], "no files match"),
        # Said as eval says it, of the text's part (before: "no sentences in X", whichever it was).
        *(
            (
                ["--train-files", str(text), "--vocab", str(TRAIN / "vocab.txt")],
                f"the training text ({text}) has no sentence to train on; give a file with text in it",
            )
            for text in (empty, blank)
        ),
        # No --vocab: the vocabulary's count of it finds nothing (before: "no tokens in X").
        (["--train-files", str(blank)], f"the training text ({blank}) has no sentence to train on"),
        *(
            (
                ["--train-files", str(TRAIN / "data.txt"), "--heldout-files", str(text)],
                f"the held-out text ({text}) has no sentence to score; give a file with text in it",
            )
            for text in (empty, blank)
        ),
        (  # which of the two patterns matched nothing (before: "no files match X" alone)
            ["--train-files", str(TRAIN / "data.txt"), "--heldout-files", str(tmp_path / "nothing*.txt")],
            f"error: --heldout-files {tmp_path / 'nothing*.txt'}: no files match",
        ),
        (["--train-files", str(TRAIN / "data.txt"), "--vocab", str(no_unk)], "must contain ['<UNK>']"),
        (
            [
                "--train-files",
                str(TRAIN / "data.txt"),
                "--vocab",
                str(TRAIN / "vocab.txt"),
                "--config",
                str(tmp_path / "misfit.json"),
            ],
            "the options say n_tokens_vocab 99 but",
        ),
        (["--config", "huge"], "neither a preset"),
        (["--batch-size", "4", "--rows-per-draw", "3"], "'--rows-per-draw' (3) must divide '--batch-size' (4)"),
        (["--num-processes", "2", "--process-id", "2"], "--process-id must be 0 to 1 (--num-processes - 1); got 2"),
        # Not two runs of one process each into one run dir:
        (["--num-processes", "2", "--process-id", "1"], "several processes need a --coordinator: the host:port"),
        (["--process-id", "1"], "several processes need a --coordinator"),
        (["--num-processes", "-1", "--process-id", "0"], "--num-processes must be 1 or more; got -1"),
        (["--num-processes", "0", "--process-id", "1"], "--num-processes must be 1 or more; got 0"),
        (["--coordinator", "127.0.0.1:99999", "--num-processes", "2", "--process-id", "1"], "a port from 1 to 65535"),
        (
            ["--coordinator", "host0", "--num-processes", "2", "--process-id", "0"],
            "--coordinator 'host0': expected host:port",
        ),
        (["--heartbeat-timeout", "0"], "argument --heartbeat-timeout: expected a whole number of seconds, 1 or more"),
        (["--stall-timeout", "-1"], "argument --stall-timeout: expected a whole number of seconds (0: off): '-1'"),
    ]
    for i, (args, message) in enumerate(cases):  # in this process: each is refused before any compile
        run = tmp_path / f"run{i}"
        try:
            code = cli.main(["train", "--run-dir", str(run), "--steps", "1", "--no-progress", *args])
        except SystemExit as e:  # argparse's own refusals
            code = e.code
        err = capsys.readouterr().err
        assert code == 2, (args, err)
        lines = [l for l in err.splitlines() if l.startswith("elmo-jax train: error:")]
        assert len(lines) == 1 and message in lines[0], (args, err)
        if (
            args[0] in ("--config", "--batch-size") or "--heldout-files" in args or "--vocab" in args[2:3]
        ):  # before the vocabulary is built into the run dir
            assert not run.exists(), args
        assert "Traceback" not in err
    # Blank lines past what the start reads of each file: found by the first batch, said alike.
    big_blank = tmp_path / "big_blank.txt"
    big_blank.write_text(" \n" * 40_000)
    args = ["--train-files", str(big_blank), "--vocab", str(TRAIN / "vocab.txt")]
    assert cli.main(["train", "--run-dir", str(tmp_path / "run"), "--steps", "1", "--no-progress", *args]) == 2
    [line] = [l for l in capsys.readouterr().err.splitlines() if "error" in l]
    assert (
        line
        == f"elmo-jax train: error: the training text ({big_blank}) has no sentence to train on; give a file with text in it"
    )


# -- a full disk (issue 29) ---------------------------------------------------------------------
@pytest.mark.slow
def test_embed_on_a_full_disk_is_one_line_leaves_no_file_and_a_rerun_completes(
    tmp_path, monkeypatch, capsys, sentences
):
    import errno

    (tmp_path / "in.txt").write_text("\n".join(" ".join(s) for s in sentences) + "\n", encoding="utf-8")
    real, calls = h5py.Group.create_dataset, []

    def fills_up(self, *args, **kwargs):  # the disk fills at the 5th dataset (written by the background thread)
        calls.append(1)
        if len(calls) == 5:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(h5py.Group, "create_dataset", fills_up)
    out = tmp_path / "o.hdf5"
    assert run_cli("--input", str(tmp_path / "in.txt"), "--output", str(out), "--window", "3") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"elmo-jax embed: error: {out}: not written: the disk is full ("), err
    assert err[0].endswith(" free in " + str(tmp_path) + "); free space or choose another output path and rerun")
    assert sorted(os.listdir(tmp_path)) == ["in.txt"]  # nothing under the final name, no temporary file
    monkeypatch.setattr(h5py.Group, "create_dataset", real)  # space again
    assert run_cli("--input", str(tmp_path / "in.txt"), "--output", str(out), "--window", "3") == 0
    with h5py.File(out, "r") as f:
        assert sorted(map(int, f)) == list(range(len(sentences)))


@pytest.mark.parametrize(
    ("xla", "said"),
    [
        (
            "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2.00GiB.",
            "the device ran out of memory (RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2.00GiB.); "
            "--batch-tokens 64 per device is more than it holds: lower --batch-tokens and rerun",
        ),
        (
            "INTERNAL: CUDA error: an illegal memory access was encountered",
            "the device failed (INTERNAL: CUDA error: an illegal memory access was encountered); check the device "
            "(nvidia-smi, on a GPU); once it works, rerun",
        ),
    ],
    ids=["out-of-memory", "device-failed"],
)
def test_embed_out_of_device_memory_or_a_failed_device_is_one_line_and_leaves_no_file(
    tmp_path, monkeypatch, capsys, sentences, xla, said
):
    """XLA's out-of-memory error, or a device that fails under the job, after three sentences
    (injected: a CPU has the host's memory, and does not fail): one line with XLA's words (and
    --batch-tokens for the memory), exit 1, nothing under the output's name. (Before: XLA's
    traceback.)"""
    import jax

    from elmo_jax.extract.embedder import Embedder

    (tmp_path / "in.txt").write_text("\n".join(" ".join(s) for s in sentences) + "\n", encoding="utf-8")
    real = Embedder.embed_stream

    def failing(self, *args, **kwargs):
        for i, x in enumerate(real(self, *args, **kwargs)):
            if i == 3:
                raise jax.errors.JaxRuntimeError(xla)
            yield x

    monkeypatch.setattr(Embedder, "embed_stream", failing)
    out = tmp_path / "o.hdf5"
    assert (
        run_cli("--input", str(tmp_path / "in.txt"), "--output", str(out), "--window", "3", "--batch-tokens", "64") == 1
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"elmo-jax embed: error: {out}: not written: {said}"], err
    assert sorted(os.listdir(tmp_path)) == ["in.txt"]


def test_gpu_kernels_are_fixed_by_default_and_the_old_flag_still_parses(capsys):
    """--gpu-kernels fixed (XLA's deterministic-ops flag) is the default until a GPU confirms a
    resume under saved; 0.x's --gpu-scatters maps onto fixed and tuned."""
    parser = cli.build_parser()
    assert parser.parse_args(["train"]).gpu_kernels == "fixed"
    assert parser.parse_args(["train", "--gpu-kernels", "saved"]).gpu_kernels == "saved"
    assert parser.parse_args(["train", "--gpu-kernels", "tuned"]).gpu_kernels == "tuned"
    assert parser.parse_args(["train", "--gpu-scatters", "deterministic"]).gpu_kernels == "fixed"
    assert parser.parse_args(["train", "--gpu-scatters", "fast"]).gpu_kernels == "tuned"
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--gpu-scatters", "fixed"])
    assert "invalid choice: 'fixed' (choose from deterministic, fast)" in capsys.readouterr().err


def test_eval_out_of_device_memory_is_one_line_naming_batch_size(monkeypatch):
    """XLA's out-of-memory error in the held-out evaluation (injected) becomes one line that names
    eval's --batch-size, and a device that failed under it one line too; a runtime error of the
    program (not the device's) is left as it is."""
    import jax
    import jax.numpy as jnp

    from elmo_jax.training import evaluate as evaluate_module

    raised = [jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 8.00GiB.")]

    class Evaluator:
        def __init__(self, *args, **kwargs):
            self.windows: list = []

        def __call__(self, params, on_window=None):
            raise raised[0]

    monkeypatch.setattr(evaluate_module, "HeldoutEvaluator", Evaluator)
    params = {"bilm": {}, "softmax": {"w": jnp.zeros((3, 2)), "b": jnp.zeros(3)}}
    rest = (preset("tiny"), Vocabulary(["<S>", "</S>", "<UNK>"]), Lines(["a b"]))  # unread: no evaluator
    with pytest.raises(OutOfDeviceMemory) as e:
        evaluate_module.evaluate(params, *rest, batch_size=64)
    flags = cli.build_parser().parse_args(["eval", "--run-dir", "r", "--files", "f"]).flags
    assert commands.error_line(e.value, flags) == (
        "the device ran out of memory (RESOURCE_EXHAUSTED: Out of memory while trying to allocate 8.00GiB.); "
        "--batch-size 64 rows is more than it holds: lower --batch-size (the perplexity with carried state "
        "depends on it: compare models at one --batch-size)"
    )
    raised[0] = jax.errors.JaxRuntimeError("UNAVAILABLE: TPU halted")
    with pytest.raises(DeviceFailed) as failed:
        evaluate_module.evaluate(params, *rest, batch_size=64)
    assert commands.error_line(failed.value, flags) == (
        "the device failed (UNAVAILABLE: TPU halted); check the device (nvidia-smi, on a GPU); once it works, rerun"
    )
    raised[0] = jax.errors.JaxRuntimeError("INVALID_ARGUMENT: something else")
    with pytest.raises(jax.errors.JaxRuntimeError, match="INVALID_ARGUMENT"):  # the negative control
        evaluate_module.evaluate(params, *rest, batch_size=64)


def test_demo_compares_every_occurrence_of_the_word_whatever_its_case(capsys):
    """(Before: ``--word Apple`` matched nothing, and a word twice in one sentence was found at its
    first place twice.)"""
    argv = ["demo", "--sentence", "The Apple fell .", "--sentence", "apple to apple", "--word", "Apple"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "cosine similarity of 'Apple'" in out
    layer0 = next(line for line in out.splitlines() if line.strip().startswith("layer 0:"))
    pairs = dict(pair.split(": ") for pair in layer0.split(": ", 1)[1].split(", "))
    assert list(pairs) == ["0-1", "0-2", "1-2"] and pairs["1-2"] == "1.000"  # three places; 1, 2 spelled alike
    layer1 = next(line for line in out.splitlines() if line.strip().startswith("layer 1:"))
    assert "1-2: 1.000" not in layer1  # the two places in one sentence are two contexts


def test_the_next_commands_run_as_printed(tmp_path, monkeypatch):
    """After the README's install the venv is not activated: the commands name the program by the
    path it was started by, unless the shell finds that same one as ``elmo-jax``; embed reads the
    held-out file when there is one."""
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "elmo-jax").write_text("#!/bin/sh\n")
    (bin_dir / "elmo-jax").chmod(0o755)
    heldout = tmp_path / "heldout.txt"
    heldout.write_text("a b\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setattr(sys, "argv", [str(bin_dir / "elmo-jax"), "train"])
    assert commands.program() == ".venv/bin/elmo-jax"
    text = commands.next_commands("runs/r", str(heldout))
    assert f"  .venv/bin/elmo-jax embed --run-dir runs/r --input {heldout} --output elmo.hdf5" in text
    assert f"  .venv/bin/elmo-jax eval --run-dir runs/r --files {heldout}" in text
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")  # activated: the shell finds this one
    assert commands.program() == "elmo-jax"
    monkeypatch.setattr(sys, "argv", ["/somewhere/else/python", "-m", "elmo_jax"])
    assert commands.program() == "elmo-jax"
    assert "--input sentences.txt" in commands.next_commands("runs/r", "corpus/*.txt")  # a glob: a placeholder


@pytest.mark.parametrize(
    "argv, line",
    [
        (
            ["train", "--learning-rate", "abc"],
            "elmo-jax train: error: argument --learning-rate: invalid float value: 'abc'",
        ),
        (["train", "--stepz", "5"], "elmo-jax train: error: unrecognized arguments: --stepz 5"),
        (
            ["embed", "--options", "o.json", "--input", "a", "--output", "b"],
            "elmo-jax embed: error: --options needs --weights",
        ),
        (["demo", "--options", "o.json"], "elmo-jax demo: error: --options needs --weights"),
    ],
)
def test_argparse_refusals_are_one_line_of_the_subcommand(argv, line, capsys):
    """(Before: argparse's usage block first, 20 lines for train; an unrecognized flag and
    --options without --weights were said by the top-level parser.)"""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == f"{line} (see {' '.join(line.split()[:2]).rstrip(':')} --help)\n"


def test_files_left_over_after_a_pattern_flag_are_said_to_be_a_pattern_expanded(tmp_path, capsys, monkeypatch):
    """(Before: "unrecognized arguments: corpus/b.txt corpus/c.txt" alone, for an unquoted pattern.)"""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus").mkdir()
    files = [f"corpus/{name}.txt" for name in "abc"]
    for name in files:
        (tmp_path / name).write_text("the cat .\n")
    for command, flag, rest in [
        ("train", "--train-files", ["--steps", "1"]),
        ("train", "--heldout-files", []),
        ("vocab", "--train-files", ["--out", "v.txt"]),
        ("eval", "--files", ["--run-dir", "r"]),
    ]:
        with pytest.raises(SystemExit):
            cli.main([command, *rest, flag, *files])
        assert capsys.readouterr().err == (
            f"elmo-jax {command}: error: unrecognized arguments: corpus/b.txt corpus/c.txt (a pattern the shell "
            f"expanded? quote it: {flag} 'corpus/*.txt') (see elmo-jax {command} --help)\n"
        )
    # Negative controls: files left over after a flag that takes one file, and a left-over word
    # that is not a file, get no such hint.
    for argv in (["train", "--vocab", *files], ["train", "--train-files", files[0], "corpus/x.txt"]):
        with pytest.raises(SystemExit):
            cli.main(argv)
        err = capsys.readouterr().err
        assert "unrecognized arguments: corpus/" in err and "pattern" not in err


def test_a_run_dir_that_is_not_there_is_said_after_its_flag(tmp_path, capsys):
    """(Before: "runs/nope: not a run directory (no options.json)", neither the flag nor what is wrong.)"""
    (tmp_path / "a.txt").write_text("x\n")
    for argv, said in [
        (["eval", "--run-dir", str(tmp_path / "nope"), "--files", str(tmp_path / "a.txt")], "nope: does not exist"),
        (
            ["export", "--run-dir", str(tmp_path / "a.txt"), "--out-dir", str(tmp_path / "x")],
            "a.txt: is a file, not a directory",
        ),
    ]:
        assert cli.main(argv) == 2
        assert capsys.readouterr().err == f"elmo-jax {argv[0]}: error: --run-dir {tmp_path}/{said}\n"
    (tmp_path / "empty").mkdir()  # negative control: a directory that is there, but no run
    assert cli.main(["export", "--run-dir", str(tmp_path / "empty"), "--out-dir", str(tmp_path / "x")]) == 2
    assert "not a run directory (no options.json)" in capsys.readouterr().err


def test_demo_refuses_what_it_would_silently_ignore_and_says_when_nothing_is_compared(capsys):
    assert cli.main(["demo", "--weights", "w.hdf5"]) == 2  # before: the bundled model, the weights unused
    assert capsys.readouterr().err == "elmo-jax demo: error: --weights needs --options (its options.json)\n"
    assert cli.main(["demo", "--sentence", ""]) == 2  # before: nan and numpy's warnings
    assert "--sentence: an empty one has no tokens" in capsys.readouterr().err
    assert cli.main(["demo", "--sentence", "a pear", "--word", "pear"]) == 0
    assert "'pear' occurs 1 time(s) in the sentences: no two of its vectors to compare" in capsys.readouterr().out


@pytest.mark.slow
def test_a_coordinator_without_the_ids_on_a_host_that_does_not_say_them_is_one_line(tmp_path):
    """jax.distributed's own refusal, before it connects (before: its ValueError's traceback)."""
    r = run_elmo_jax(
        "train", "--train-files", str(TRAIN / "data.txt"), "--run-dir", str(tmp_path / "run"), "--steps", "1",
        "--no-progress", "--coordinator", "127.0.0.1:1", devices=1, JAX_COORDINATOR_ADDRESS="",
    )  # fmt: skip
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    assert r.stderr == (
        "elmo-jax train: error: --coordinator 127.0.0.1:1: jax.distributed: Number of processes must be defined. "
        "Give --num-processes and --process-id\n"
    )
    assert not (tmp_path / "run").exists()


def test_vocab_extend_and_models_all_files_refusals_name_their_flags(tmp_path, capsys):
    """(Before: "nope.txt: vocabulary file not found" after the whole count, naming no flag; and
    models --all-files without --fetch was ignored.)"""
    argv = ["vocab", "--train-files", str(TRAIN / "data.txt"), "--out", str(tmp_path / "v.txt")]
    assert cli.main([*argv, "--extend", str(tmp_path / "nope.txt")]) == 2
    assert (
        capsys.readouterr().err
        == f"elmo-jax vocab: error: --extend: {tmp_path / 'nope.txt'}: vocabulary file not found\n"
    )
    assert not (tmp_path / "v.txt").exists()
    assert cli.main(["models", "--all-files"]) == 2
    assert (
        capsys.readouterr().err
        == "elmo-jax models: error: --all-files needs --fetch: it says which files a --fetch downloads\n"
    )


def test_embed_refuses_an_output_that_is_the_model_s_own_file(tmp_path, capsys):
    """The output is written to a temporary file and renamed over its name: over --weights, the
    model was lost once the vectors were written."""
    import shutil

    weights, options = tmp_path / "w.hdf5", tmp_path / "o.json"
    shutil.copyfile(WEIGHTS, weights)
    shutil.copyfile(OPTIONS, options)
    (tmp_path / "in.txt").write_text("a b\n")
    before = weights.read_bytes()
    for output, flag in ((weights, "--weights"), (options, "--options")):
        argv = ["embed", "--options", str(options), "--weights", str(weights), "--input", str(tmp_path / "in.txt")]
        assert cli.main([*argv, "--output", str(output)]) == 2
        assert capsys.readouterr().err == (
            f"elmo-jax embed: error: --output {output}: is the model's {flag} file; give another --output\n"
        )
    assert weights.read_bytes() == before


def test_every_help_shows_a_compile_cache_path_with_a_percent_sign(monkeypatch):
    """argparse %-formats each help text: the path, put into a subcommand's, broke its --help."""
    monkeypatch.setenv("ELMO_JAX_COMPILE_CACHE", "/tmp/100%done")
    parser = cli.build_parser()
    for name in ("train", "embed", "eval", "vocab", "export", "demo"):
        assert "/tmp/100%done" in cli_parser._subcommands(parser)[name].format_help().replace("\n", " ")


def test_train_on_the_sample_says_so_only_once_its_flags_pass(tmp_path, capsys):
    """Without --train-files, train says that it trains on the bundled sample: not above a line
    that refuses one of its flags (before: every such refusal was two lines)."""
    (tmp_path / "a.txt").write_text("not a directory\n")
    refusals = [
        (["--run-dir", str(tmp_path / "a.txt")], "a.txt: is a file, not a directory"),
        (["--run-dir", str(tmp_path / "a.txt" / "run")], "a.txt is a file, not a directory"),
        (["--run-dir", str(tmp_path / "r"), "--batch-size", "0"], "--batch-size' must be an integer >= 1"),
        (["--run-dir", str(tmp_path / "r"), "--init-from", "orignal"], "did you mean original?"),
    ]
    for flags, said in refusals:
        assert cli.main(["train", "--steps", "1", "--no-progress", *flags]) == 2
        out, err = capsys.readouterr()
        assert out == "" and len(err.splitlines()) == 1 and said in err, (out, err)
    # Negative control: a run that sets up (and trains no step) says it, first.
    assert cli.main(["train", "--steps", "0", "--no-progress", "--run-dir", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("no --train-files: training on the bundled sample "), out
    assert out[1] == f"no --vocab: wrote {tmp_path / 'r' / 'vocab.txt'}", out


def test_a_path_fault_names_the_flag_that_gave_the_path(tmp_path, capsys, fixtures_dir):
    """Said after the flag, as --run-dir's and --heldout-files' faults are. (Before: "RUN: is a
    directory, not a file" for --input and --output alike, where RUN was the --run-dir too; "no
    files match RUN" for --train-files and --files; "o/x.hdf5: o does not exist" for --output.)"""
    run = str(fixtures_dir / "format1_run")
    (tmp_path / "in.txt").write_text("the cat sat .\n")
    for argv, said in [
        (
            ["embed", "--run-dir", run, "--input", run, "--output", str(tmp_path / "x.hdf5")],
            f"--input {run}: is a directory, not a file",
        ),
        (
            ["embed", "--run-dir", run, "--input", str(tmp_path / "in.txt"), "--output", run],
            f"--output {run}: is a directory, not a file",
        ),
        (
            [
                "embed",
                "--run-dir",
                run,
                "--input",
                str(tmp_path / "in.txt"),
                "--output",
                str(tmp_path / "o" / "x.hdf5"),
            ],
            f"--output {tmp_path}/o/x.hdf5: {tmp_path}/o does not exist",
        ),
        (
            ["eval", "--run-dir", run, "--files", run],
            f"--files {run}: no files match {run} ({run} is a directory: give a pattern of its files, '{run}/*.txt')",
        ),
        (
            ["vocab", "--train-files", run, "--out", str(tmp_path / "v.txt")],
            f"--train-files {run}: no files match {run}",
        ),
        (
            ["train", "--run-dir", str(tmp_path / "r"), "--train-files", run],
            f"--train-files {run}: no files match {run}",
        ),
    ]:
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(f"elmo-jax {argv[0]}: error: {said}") and err.count("\n") == 1, err
    assert sorted(os.listdir(tmp_path)) == ["in.txt"]  # nothing written, no run dir made
