"""Every path flag of every command given a path of a wrong kind, and the numeric flags given
values out of their range: the cases of ``tests/test_bad_input.py`` and
``tests/probe_bad_input.py``.

A case runs one command in this process (``elmo_jax.cli.commands.main``) with valid arguments but
for one flag. Each runs in a directory of its own, so what one case writes no other sees."""

import contextlib
import dataclasses
import io
import pathlib
import random
import shutil

from helpers import FIXTURES

from elmo_jax.cli import commands

ROOT = pathlib.Path(__file__).resolve().parent.parent
OPTIONS = ROOT / "elmo_jax" / "data" / "fixture_options.json"
WEIGHTS = ROOT / "elmo_jax" / "data" / "fixture_weights.hdf5"
TRAIN = FIXTURES / "bilm_tf_train"
RUN = FIXTURES / "format1_run"  # a finished run of a tiny biLM, checkpoint format 1


class World:
    """The valid inputs and the paths of each wrong kind, under a directory of one case."""

    def __init__(self, root: pathlib.Path):
        self.root = root

    def fresh(self, name: str) -> "World":
        d = self.root / name
        d.mkdir(parents=True)
        (d / "text.txt").write_text("the cat sat on the mat .\nthe dog sat .\n")
        (d / "empty.txt").write_text("")
        (d / "garbage.bin").write_bytes(random.Random(0).randbytes(4096))
        (d / "adir").mkdir()
        (d / "adir" / "a.txt").write_text("the cat .\n")
        (d / "emptydir").mkdir()
        (d / "junkdir").mkdir()
        (d / "junkdir" / "junk.bin").write_bytes(random.Random(1).randbytes(512))
        shutil.copytree(RUN, d / "run")
        return World(d)

    def path(self, name: str) -> str:
        return str(self.root / name)


# A wrong kind of path: its name and the path it gives in a world.
KINDS = {
    "missing": lambda w: w.path("nothing.txt"),
    "missing-dir": lambda w: w.path("nothing"),
    "a-dir": lambda w: w.path("adir"),
    "a-file": lambda w: w.path("text.txt"),
    "empty": lambda w: w.path("empty.txt"),
    "empty-dir": lambda w: w.path("emptydir"),
    "junk-dir": lambda w: w.path("junkdir"),
    "garbage": lambda w: w.path("garbage.bin"),
    "under-a-file": lambda w: w.path("text.txt/x"),
    "text-not-hdf5": lambda w: w.path("text.txt"),
    "hdf5-not-json": lambda w: str(WEIGHTS),
    "hdf5-not-text": lambda w: str(WEIGHTS),
    "no-parent": lambda w: w.path("nothing/out"),
}

# What each role of a path flag is given: the kinds that are wrong for it.
IN_FILE = ("missing", "a-dir", "empty", "garbage", "under-a-file")
IN_TEXT = (*IN_FILE, "hdf5-not-text")
IN_DIR = ("missing-dir", "a-file", "empty-dir", "junk-dir", "under-a-file")
GLOB = ("missing", "a-dir", "empty", "garbage", "under-a-file", "hdf5-not-text")
OUT_FILE = ("a-dir", "under-a-file", "no-parent")
OUT_DIR = ("a-file", "under-a-file")


def _train(w: World) -> dict:
    return {
        "--train-files": str(TRAIN / "data.txt"),
        "--vocab": str(TRAIN / "vocab.txt"),
        "--run-dir": w.path("newrun"),
        "--steps": "1",
        "--no-progress": None,
    }


# Each command's valid arguments.
BASE = {
    "demo": lambda w: {"--options": str(OPTIONS), "--weights": str(WEIGHTS), "--sentence": "a b"},
    "vocab": lambda w: {"--train-files": w.path("text.txt"), "--out": w.path("vocab.txt")},
    "train": _train,
    "eval": lambda w: {"--run-dir": w.path("run"), "--files": str(TRAIN / "data.txt")},
    "embed": lambda w: {
        "--options": str(OPTIONS),
        "--weights": str(WEIGHTS),
        "--input": w.path("text.txt"),
        "--output": w.path("o.hdf5"),
        "--no-progress": None,
    },
    "export": lambda w: {"--run-dir": w.path("run"), "--out-dir": w.path("export")},
    "models": lambda w: {"--cache-dir": w.path("cache")},
}

# (command, flag, the kinds that are wrong for it); a flag missing from the command's BASE is added.
FLAGS = [
    ("demo", "--options", (*IN_FILE, "hdf5-not-json")),
    ("demo", "--weights", (*IN_FILE, "text-not-hdf5")),
    ("vocab", "--train-files", GLOB),
    ("vocab", "--out", OUT_FILE),
    ("train", "--train-files", GLOB),
    ("train", "--heldout-files", GLOB),
    ("train", "--vocab", IN_TEXT),
    ("train", "--config", (*IN_FILE, "hdf5-not-json")),
    ("train", "--run-dir", OUT_DIR),
    ("train", "--init-from", (*IN_DIR, "garbage")),
    ("eval", "--run-dir", IN_DIR),
    ("eval", "--files", GLOB),
    ("embed", "--options", (*IN_FILE, "hdf5-not-json")),
    ("embed", "--weights", (*IN_FILE, "text-not-hdf5")),
    ("embed", "--run-dir", IN_DIR),
    ("embed", "--input", IN_TEXT),
    ("embed", "--output", OUT_FILE),
    ("export", "--run-dir", IN_DIR),
    ("export", "--out-dir", OUT_DIR),
    ("models", "--cache-dir", ("a-file", "under-a-file")),
]


@dataclasses.dataclass(frozen=True)
class Case:
    command: str
    flag: str
    kind: str

    @property
    def id(self) -> str:
        return f"{self.command} {self.flag} {self.kind}"

    def argv(self, w: World) -> tuple[list[str], str]:
        """The command line, and the bad path (or value) in it."""
        args = BASE[self.command](w)
        if self.command == "embed" and self.flag == "--run-dir":
            del args["--options"], args["--weights"]
        if self.flag == "--epochs":  # --steps and --epochs are either-or
            del args["--steps"]
        bad = self.kind[1:] if self.kind.startswith("=") else KINDS[self.kind](w)
        args[self.flag] = bad
        argv = [self.command]
        for flag, value in args.items():
            argv += [flag] if value is None else [flag, value]
        return argv, bad


# Values out of range ("=" and the value). Before 1faef2c most of these ended in a traceback (a
# modulo by zero, Orbax's or numpy's ValueError), were taken (--save-every -1 never saved) or
# named the argument rather than the flag; eval --unroll-steps 0 ran for ever.
VALUES = [
    ("train", "--save-every", ("=0", "=-1")),
    ("train", "--log-every", ("=0", "=-1")),
    ("train", "--keep", ("=-1", "=0")),
    ("train", "--seed", ("=-1", "=4294967296")),  # 2**32 and above: the same PRNG key as seed % 2**32
    ("train", "--steps", ("=-1", "=0")),
    ("train", "--eval-every", ("=-10",)),
    ("train", "--epochs", ("=nan", "=inf", "=-1")),
    ("train", "--n-train-tokens", ("=0", "=-5")),  # 0 was ignored (an epoch of the vocab's count), -5 refused late
    ("train", "--learning-rate", ("=inf", "=nan", "=0")),
    ("eval", "--batch-size", ("=0", "=-1")),
    ("eval", "--unroll-steps", ("=0", "=-1")),
    ("vocab", "--min-count", ("=0",)),
    ("train", "--min-count", ("=0", "=-3")),  # taken when --vocab was given; without it, refused after the count
    ("vocab", "--max-size", ("=2",)),
]

CASES = [Case(command, flag, kind) for command, flag, kinds in FLAGS + VALUES for kind in kinds]


# The cases where the command rightly goes on: it makes the output's directory; an empty input
# is an empty output (with a warning); 0 steps: nothing to do, said so. (`models --cache-dir` given
# a file was taken too, and listed every model as missing from it.)
ACCEPTED = {
    "vocab --out no-parent",
    "embed --input empty",
    "train --steps =0",
}


@dataclasses.dataclass(frozen=True)
class Outcome:
    kind: str  # "one line", "NO FLAG", "TRACEBACK", "ACCEPTED", "OTHER"
    code: int | None
    err: str
    detail: str
    left: list[str]  # what the command added to its directory


def run(case: Case, world: World) -> Outcome:
    """Runs ``case`` in a fresh directory under ``world`` and sorts how it ended."""
    w = world.fresh(case.id.replace(" ", "_").lstrip("-"))
    argv, bad = case.argv(w)
    before = _listing(w.root)
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = commands.main(argv)
            except SystemExit as e:  # argparse's own refusals
                code = e.code if isinstance(e.code, int) else 2
    except Exception as e:  # noqa: BLE001  (any escape is what the probe looks for)
        return Outcome("TRACEBACK", None, err.getvalue(), f"{type(e).__name__}: {e}"[:300], [])
    text, left = err.getvalue(), sorted(_listing(w.root) - before)
    if code == 0:
        return Outcome("ACCEPTED", 0, text, "exit 0", left)
    lines = [line for line in text.splitlines() if line.startswith(f"elmo-jax {case.command}: error:")]
    if len(lines) != 1 or "Traceback" in text:
        return Outcome("OTHER", code, text, f"exit {code}: {text.strip()[-300:]}", left)
    line = lines[0]
    if case.flag not in line and (bad not in line or case.kind.startswith("=")):
        return Outcome("NO FLAG", code, text, line, left)
    return Outcome("one line", code, text, line + (f" LEFT {left}" if left else ""), left)


def _listing(root: pathlib.Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}
