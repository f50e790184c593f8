"""The ``elmo-jax`` command line's flags: the parser of every subcommand, which imports no jax.

``elmo-jax --help`` and a mistyped flag are answered here in a fraction of a second, before the
commands (jax, Orbax: most of two seconds) are imported (``elmo_jax.cli.main``). The commands
themselves are in ``commands``, which runs a parsed command line.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import typing

from elmo_jax import __version__
from elmo_jax._util.arguments import did_you_mean
from elmo_jax._util.runtime import GPU_KERNELS, default_compile_cache

__all__ = ["build_parser", "named_command", "parse"]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """``argv`` (None: ``sys.argv[1:]``) parsed; argparse's refusals exit 2 with one line, and
    ``--help`` exits 0."""
    parser = build_parser()
    words = sys.argv[1:] if argv is None else argv
    named, commands = named_command(words), list(_subcommands(parser))
    if not {"-h", "--help", "--version"} & set(words):
        if named is None:
            parser.error(f"no command given: choose one of {', '.join(commands)}")
        if named not in commands:
            parser.error(
                f"{named!r} is not a command (choose one of {', '.join(commands)}){did_you_mean(named, commands)}"
            )
    args = parser.parse_args(argv)
    if args.command in ("demo", "embed") and args.options and not args.weights:
        _subcommands(parser)[args.command].error("--options needs --weights")
    return args


def _seconds(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of seconds, 1 or more: {value!r}")
    return int(value)


def _seconds_or_off(value: str) -> int:
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"expected a whole number of seconds (0: off): {value!r}")
    return int(value)


def _old_gpu_scatters(value: str) -> str:
    names = {"deterministic": "fixed", "fast": "tuned"}
    if value not in names:
        raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from deterministic, fast)")
    return names[value]


def _layers_arg(value: str):
    if value in ("all", "top", "average"):
        return value
    try:
        return tuple(float(w) for w in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: expected all, top, average or comma-separated weights") from None


# Library errors name arguments by their own names (elmo_jax._util.arguments); a subcommand's flag
# is found by its dest, or, where the library's name differs, through this table (command -> name -> dest).
ARGUMENT_DESTS = {
    "train": {"source": "init_from"},
    "vocab": {"path": "out"},
    "embed": {"input_path": "input", "output_path": "output"},
}


class _Parser(argparse.ArgumentParser):
    """argparse's refusals as one line, like the commands' own errors (not the usage block first);
    its subcommands' parsers are of this class too."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:  # said by the subcommand they were given to, whose --help lists its flags
            command = getattr(parsed, "command", None)
            hint = _expanded_pattern(sys.argv[1:] if args is None else list(args), extra)
            (_subcommands(self)[command] if command else self).error(f"unrecognized arguments: {' '.join(extra)}{hint}")
        return parsed


_PATTERN_FLAGS = ("--train-files", "--heldout-files", "--files")


def _expanded_pattern(argv: list[str], extra: list[str]) -> str:
    """A hint when the arguments left over are files after a flag that takes a pattern: an unquoted
    ``corpus/*.txt`` the shell turned into its files, the first taken as the pattern, the others
    left over (``unrecognized arguments: corpus/b.txt``, which says nothing of the cause)."""
    if not os.path.isfile(extra[0]):
        return ""
    flag = next((a for a in reversed(argv[: argv.index(extra[0])]) if a.startswith("-")), None)
    if flag not in _PATTERN_FLAGS or flag in extra:  # a flag the command does not have is left over too
        return ""
    pattern = os.path.join(os.path.dirname(extra[0]), "*" + os.path.splitext(extra[0])[1])
    return f" (a pattern the shell expanded? quote it: {flag} {shlex.quote(pattern)})"


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``elmo-jax`` and its subcommands. A parsed command line's ``flags`` maps each
    argument name of the library to the subcommand's flag (``commands.error_line`` speaks in them)."""
    p = _Parser(prog="elmo-jax", description="ELMo biLMs in JAX.")
    p.add_argument("--version", action="version", version=f"elmo-jax {__version__}")
    cache_help = "persistent XLA compilation cache ('none': off; default: %s, or $ELMO_JAX_COMPILE_CACHE)"
    p.add_argument("--compile-cache", default=default_compile_cache(), metavar="DIR", help=cache_help % "%(default)s")
    shown = default_compile_cache().replace("%", "%%")  # argparse %-formats each help text
    sub = p.add_subparsers(dest="command", required=True)
    for add in (_add_demo, _add_vocab, _add_train, _add_eval, _add_embed, _add_export, _add_models):
        add(sub)
    for name, command in sub.choices.items():
        # Also after the command, where users put flags; SUPPRESS keeps the one given before it.
        # models compiles nothing (and its cache would import jax): it takes the flag, as scripts
        # pass it to every command, and leaves it unused.
        if name == "models":
            command.add_argument(
                "--compile-cache", dest="unused_compile_cache", default=argparse.SUPPRESS, metavar="DIR",
                help="unused: models compiles nothing",
            )  # fmt: skip
        else:
            command.add_argument("--compile-cache", default=argparse.SUPPRESS, metavar="DIR", help=cache_help % shown)
        command.set_defaults(flags=_flags(command, ARGUMENT_DESTS.get(name, {})))
    return p


def named_command(argv: list[str]) -> str | None:
    """The subcommand named in ``argv`` (the first word that is not an option of ``elmo-jax``
    itself), as far as it can be told without parsing (an interrupt may come before the parser
    has told it); None if there is none."""
    words = iter(argv)
    for word in words:
        if word == "--compile-cache":  # the one option before the subcommand that takes a value
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Each subcommand's name -> its parser."""
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def _flags(parser: argparse.ArgumentParser, aliases: dict[str, str]) -> dict[str, str]:
    """Argument name -> flag of one subcommand: each option's dest, and ``aliases``' names."""
    flags = {a.dest: max(a.option_strings, key=len) for a in parser._actions if a.option_strings}
    return {**flags, **{name: flags[dest] for name, dest in aliases.items() if dest in flags}}


def _add_demo(sub) -> None:
    """elmo-jax demo"""
    demo = sub.add_parser("demo", help="embed a few sentences with the bundled test model and print the result")
    demo.add_argument("--options", help="bilm-tf options.json (default: the bundled test model)")
    demo.add_argument("--weights", help="bilm-tf weights hdf5 (with --options)")
    demo.add_argument("--sentence", action="append", help="a whitespace-tokenized sentence (repeatable)")
    demo.add_argument("--word", default="apple", help="word whose vectors to compare across sentences")


def _add_vocab(sub) -> None:
    """elmo-jax vocab"""
    vocab = sub.add_parser("vocab", help="count words in training text and write an LM vocabulary")
    vocab.add_argument("--train-files", required=True, help="glob of text shards, one tokenized sentence per line")
    vocab.add_argument("--out", required=True, help="vocabulary file to write (a .json sidecar records counts)")
    vocab.add_argument("--min-count", type=int, default=1, help="keep words seen at least this often (default: 1)")
    vocab.add_argument("--tfds-data-dir", help="tfds data dir, for --train-files tfds:NAME/SPLIT")
    vocab.add_argument("--max-size", type=int, default=None, help="at most this many lines, specials included")
    vocab.add_argument(
        "--extend",
        metavar="VOCAB",
        help="keep every word of this vocabulary (continued pretraining: "
        "their softmax rows carry over); all sorted by the new counts",
    )


def _add_train(sub) -> None:
    """elmo-jax train: what to train on and how (the run's settings: _add_train_run_args)"""
    tr = sub.add_parser(
        "train", help="pretrain (or resume) a biLM; with no data flags, the tiny model on the bundled sample"
    )
    tr.add_argument(
        "--config",
        help="preset (tiny, small, medium, original) or a bilm-tf options.json (default: a resumed "
        "run's own; for a new run tiny, or with --init-from the source's biLM and bilm-tf's recipe)",
    )
    tr.add_argument("--train-files", help="glob of training shards (default: the bundled sample)")
    tr.add_argument("--heldout-files", help="glob of held-out text for perplexity every --eval-every steps")
    tr.add_argument("--tfds-data-dir", help="tfds data dir, for --train-files tfds:NAME/SPLIT (ArrayRecord)")
    tr.add_argument("--vocab", help="LM vocabulary (default: built from --train-files into the run dir)")
    tr.add_argument(
        "--run-dir",
        default="runs/tiny-sample",
        help="checkpoints, metrics.jsonl, options, vocab; the same command again resumes it (default: %(default)s)",
    )
    stop = tr.add_mutually_exclusive_group()
    stop.add_argument("--steps", type=int, help="train until this global step")
    stop.add_argument(
        "--epochs",
        type=float,
        help="train this many passes over the data (default: n_epochs); after --new-data, over the new text, "
        "counted from the step its session began at",
    )
    tr.add_argument(
        "--n-train-tokens",
        type=int,
        metavar="N",
        help="tokens + sentences of the training text, to count epochs (default: the vocabulary's "
        "vocab.txt.json sidecar, written by elmo-jax vocab)",
    )
    _add_train_recipe_args(tr)
    tr.add_argument("--min-count", type=int, default=1, help="for the vocabulary built when --vocab is not given")
    tr.add_argument(
        "--init-from",
        metavar="SOURCE",
        help="continue pretraining another model: a released model's name (see elmo-jax models), a "
        "bilm-tf TF checkpoint dir, a run dir, or a dir of hdf5 files (options.json + weights.hdf5 "
        "or elmo_*_options.json + elmo_*_weights.hdf5, optionally the softmax and vocab-*.txt). "
        "Weights and any accumulators carry over, softmax rows by word; without --vocab the "
        "vocabulary is the source's plus the new text's words. Ignored when --run-dir already "
        "holds a checkpoint",
    )
    _add_train_run_args(tr)
    _add_train_watch_args(tr)
    _add_multihost_args(tr)


def _add_train_recipe_args(tr: argparse.ArgumentParser) -> None:
    """elmo-jax train: the recipe's values that a flag overrides."""
    tr.add_argument(
        "--batch-size",
        type=int,
        help="rows per device (bilm-tf batch_size; default: the --config's, 32 for tiny and 128 for the others, "
        "or a resumed run's own)",
    )
    tr.add_argument(
        "--rows-per-draw",
        type=int,
        metavar="N",
        help="rows that share one draw of sampled candidates; divides --batch-size (default: the "
        "config's, else 0: all of a device's rows). bilm-tf draws once per GPU of 128 rows, so "
        "--batch-size 384 --rows-per-draw 128 is its 3-GPU recipe on one device",
    )
    tr.add_argument(
        "--reset-state-prob",
        type=float,
        metavar="P",
        help="chance that a row's LSTM state is zeroed at a sentence start, so the biLM learns the zero "
        "state extraction starts from (default: the --config file's reset_state_prob, else 0.1; a "
        "resumed run keeps its own). 0 is bilm-tf's handling of sentence starts; see experiments/README.md",
    )
    tr.add_argument(
        "--learning-rate",
        type=float,
        metavar="LR",
        help="Adagrad's learning rate (default: the config's, bilm-tf's 0.2; 0.05 when --init-from "
        "has no optimizer state)",
    )


def _add_train_run_args(tr: argparse.ArgumentParser) -> None:
    """elmo-jax train: how the run computes (seed, precision, devices, its host pipeline)."""
    tr.add_argument(
        "--seed",
        type=int,
        help="initial weights, data order, dropout: 0 to 2**32 - 1 (default: 0; a resumed run keeps its own, and "
        "refuses another but with --new-data)",
    )
    _add_precision(tr, "default: bfloat16 on a TPU or a GPU from compute capability 8.0 (A100, H100), else float32")
    tr.add_argument("--devices", type=int, help="local devices to use (default: all)")
    tr.add_argument(
        "--prefetch", type=int, default=2, metavar="N", help="host batches built ahead in a thread (0: off)"
    )
    tr.add_argument(
        "--host-workers",
        type=int,
        default=0,
        metavar="N",
        help="processes that draw the sampled candidates ahead (0: drawn with each batch)",
    )
    tr.add_argument(
        "--gpu-kernels",
        choices=GPU_KERNELS,
        default="fixed",
        help="how XLA picks a GPU's matmul kernels. fixed (default): XLA's deterministic-ops flag, no autotuning, "
        "so that two runs of one command agree to the bit; saved: autotuned once, the choices kept in "
        "RUN_DIR/xla_autotune and read by every later start of the run, so that a resume runs the same kernels "
        "(one process and a local run directory, else fixed; the step ran 1.5-2.1 ms faster at 128 rows on an "
        "H200, and a resume's bit-exactness on a GPU awaits a GPU check); tuned: autotuned at every start, so a "
        "resume may differ in the last bits. No effect on a CPU or TPU",
    )
    # The option's earlier name, kept for scripts that use it: deterministic is fixed, fast is tuned.
    tr.add_argument("--gpu-scatters", dest="gpu_kernels", type=_old_gpu_scatters, help=argparse.SUPPRESS)
    tr.add_argument(
        "--new-data",
        action="store_true",
        help="resume on training files other than the run's: keep the weights and optimizer state, start "
        "the data position afresh (without it such a resume is refused)",
    )


def _add_train_watch_args(tr: argparse.ArgumentParser) -> None:
    """elmo-jax train: checkpoints, logging and the watches on the run."""
    tr.add_argument(
        "--save-every", type=int, default=500, help="a checkpoint every N steps, and at the end (default: 500)"
    )
    tr.add_argument("--keep", type=int, default=3, help="checkpoints to keep, the newest (default: 3)")
    tr.add_argument(
        "--eval-every",
        type=int,
        help="held-out perplexity every N steps, a multiple of --log-every (0: never; default: with "
        "--heldout-files, --save-every rounded up to a multiple of --log-every)",
    )
    tr.add_argument("--log-every", type=int, default=10, help="a metrics.jsonl line every N steps (default: 10)")
    tr.add_argument("--no-progress", action="store_true", help="no progress bar")
    tr.add_argument(
        "--stall-timeout",
        type=_seconds_or_off,
        default=1800,
        metavar="SECONDS",
        help="when the run makes no progress for this long (no training step, held-out window or vocabulary shard "
        "completes, from the start on), write every thread's stack to RUN/stalled.txt, say so in one line and exit "
        "1, so that the run can be restarted from its newest checkpoint (0: wait for ever); it must exceed the "
        "first step's compile",
    )
    tr.add_argument(
        "--on-divergence",
        choices=("stop", "warn"),
        default="stop",
        help="a training loss that is not finite, or above ln V + 1 for 3 logged steps: stop, with no "
        "checkpoint of the diverged state left as the newest (default), or warn once and go on",
    )


def _add_multihost_args(tr: argparse.ArgumentParser) -> None:
    """elmo-jax train: one process per host under jax.distributed."""
    tr.add_argument(
        "--coordinator",
        help="multi-host: jax.distributed coordinator host:port (or JAX_COORDINATOR_ADDRESS; under srun, "
        "the job's first node by default)",
    )
    tr.add_argument(
        "--num-processes",
        type=int,
        help="multi-host: how many processes (default: from SLURM's or Open MPI's environment)",
    )
    tr.add_argument(
        "--process-id",
        type=int,
        help="multi-host: this process's id, 0 to N-1 (default: from SLURM's or Open MPI's environment)",
    )
    tr.add_argument(
        "--heartbeat-timeout",
        type=_seconds,
        default=100,
        metavar="SECONDS",
        help="multi-host: a process silent this long is taken for dead, and every other process stops with one "
        "line naming it and the step to resume from (jax.distributed's own heartbeat timeout, a backstop, is set "
        "to twice this plus 10 s)",
    )
    tr.add_argument(
        "--init-timeout",
        type=_seconds,
        default=300,
        metavar="SECONDS",
        help="multi-host: how long each process waits at start for all of them to join before it stops "
        "with one line saying what is missing (jax.distributed's initialization timeout is 300 s)",
    )


def _add_eval(sub) -> None:
    """elmo-jax eval"""
    ev = sub.add_parser("eval", help="full-softmax perplexity of a run's checkpoint on held-out text (one JSON line)")
    ev.add_argument("--run-dir", required=True, help="a run directory of elmo-jax train")
    ev.add_argument("--files", required=True, help="glob of text files, or tfds:NAME/SPLIT as for train")
    ev.add_argument("--tfds-data-dir", help="tfds data dir, for --files tfds:NAME/SPLIT")
    ev.add_argument("--step", type=int, help="the checkpoint of this step (default: the newest readable)")
    ev.add_argument("--batch-size", type=int, default=16, help="rows of text scored at a time (default: 16)")
    ev.add_argument(
        "--unroll-steps", type=int, default=20, help="tokens per row and window, in both protocols (default: 20)"
    )
    ev.add_argument(
        "--reset-state-per-sentence",
        action="store_true",
        help="every sentence alone from zero state (to compare with models that cannot carry context)",
    )
    ev.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_embed(sub) -> None:
    """elmo-jax embed. Long because: a table of flags, one call each."""
    em = sub.add_parser("embed", help="ELMo layers of every line of a file into hdf5 (bilm-tf's dump format)")
    em.add_argument("--model", help="a released model, downloaded once into the cache (see elmo-jax models)")
    em.add_argument("--run-dir", help="an elmo-jax run directory (newest checkpoint)")
    em.add_argument("--options", help="bilm-tf options.json (with --weights)")
    em.add_argument("--weights", help="bilm-tf weights hdf5")
    em.add_argument(
        "--input",
        required=True,
        help="UTF-8 text, one whitespace-tokenized sentence per line; - reads standard input (kept in $TMPDIR "
        "until the command ends)",
    )
    em.add_argument(
        "--output",
        required=True,
        help="hdf5 to write: dataset 'i' for line i (0-based); with --pool one dataset 'embeddings', "
        "row i for line i. With --num-shards 4, shard 1 of --output e.hdf5 writes "
        "e-00001-of-00004.hdf5 (datasets still named by input line; with --pool, its own lines in "
        "order) and, once complete, its manifest e-00001-of-00004.hdf5.json; "
        "elmo_jax.extract.ShardedEmbeddings('e.hdf5') reads all shards as one, in line order",
    )
    em.add_argument(
        "--layers",
        type=_layers_arg,
        default="all",
        metavar="{all,top,average,W0,W1,...}",
        help="all (the default): [n_layers+1, n_tokens, 2P]; top, average, or n_layers+1 comma-separated "
        "weights (a weighted sum, the weights used as given, not normalised): [n_tokens, 2P]",
    )
    em.add_argument(
        "--pool",
        choices=["mean", "max"],
        help="pool each line over its tokens (an empty line gives zeros): one dataset 'embeddings', "
        "[n_lines, n_layers+1, 2P] with --layers all (the default), else [n_lines, 2P]",
    )
    em.add_argument(
        "--num-shards",
        type=int,
        metavar="N",
        help="split the work over N independent processes: this one embeds the lines i with "
        "i %% N == --shard-index into its own file (see --output)",
    )
    em.add_argument("--shard-index", type=int, metavar="I", help="this process's shard, 0..N-1 (with --num-shards)")
    em.add_argument(
        "--batch-tokens",
        type=int,
        default=None,
        help="token-steps of one biLSTM call per device (default: the backend's, 4096 on a CPU)",
    )
    em.add_argument(
        "--window", type=int, default=2048, help="sentences read, sorted and written at a time (default: 2048)"
    )
    em.add_argument(
        "--ahead",
        type=int,
        default=1,
        help="windows the embedding may run ahead of the writes, which a background thread "
        "does (default 1; 0: written in the loop; each costs a window's memory)",
    )
    _add_precision(em, "default: float32, which reproduces bilm-tf's and AllenNLP's numbers")
    em.add_argument("--sentence-to-index", action="store_true", help="also write AllenNLP's sentence_to_index JSON")
    em.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_export(sub) -> None:
    """elmo-jax export"""
    ex = sub.add_parser(
        "export", help="a run's checkpoint -> bilm-tf options.json, weights.hdf5, softmax.hdf5, vocab.txt"
    )
    ex.add_argument("--run-dir", required=True, help="a run directory of elmo-jax train")
    ex.add_argument("--out-dir", required=True, help="made if missing; its files of the same names are replaced")
    ex.add_argument("--step", type=int, help="the checkpoint of this step (default: the newest readable)")
    ex.add_argument(
        "--layout",
        choices=["elmo_jax", "released"],
        default="elmo_jax",
        help="file names: options.json, weights.hdf5, softmax.hdf5, vocab.txt; or AllenNLP's released "
        "ones (elmo_<shape>_options.json, elmo_<shape>_weights.hdf5, "
        "elmo_<shape>_softmax_weights.hdf5, vocab-<shape>.txt)",
    )


def _add_models(sub) -> None:
    """elmo-jax models"""
    mo = sub.add_parser(
        "models", help="AllenNLP's released models: their files, sizes, what is cached; fetch or verify"
    )
    mo.add_argument("--fetch", metavar="NAME", help="download a model's options and weights into the cache")
    mo.add_argument("--all-files", action="store_true", help="with --fetch: also softmax, vocab and TF checkpoint")
    mo.add_argument("--verify", action="store_true", help="recompute the sha256 of every cached file")
    mo.add_argument("--cache-dir", help="the model cache (default: $ELMO_JAX_HOME, else ~/.cache/elmo_jax/models)")
    mo.add_argument("--no-progress", action="store_true", help="no download progress bar")
    # No XLA compile cache: setting it up would import jax, which listing models never needs.
    mo.set_defaults(compile_cache="none")


def _add_precision(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument(
        "--precision",
        choices=["float32", "tf32", "bfloat16"],
        help=f"matmul precision (elmo_jax.policy; tf32: GPUs only); {default}",
    )
