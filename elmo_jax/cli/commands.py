"""The ``elmo-jax`` command line (also ``python -m elmo_jax``)."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import shlex
import shutil
import sys
import threading
import typing
import warnings
from collections.abc import Callable
from importlib import resources

import numpy as np

from elmo_jax._util.arguments import about, arguments_of
from elmo_jax._util.device_memory import DeviceFailed, OutOfDeviceMemory
from elmo_jax._util.disk_full import WriteFailed
from elmo_jax._util.paths import IS_A_FILE, PATH_ERRORS, describe, replaced_input, said, same_path, under
from elmo_jax._util.runtime import (
    GPU_KERNELS,
    default_compile_cache,
    enable_compile_cache,
    set_gpu_kernels,
    warn_if_accelerator_unused,
)
from elmo_jax.cli import multihost
from elmo_jax.cli.coordinator import CoordinatorError
from elmo_jax.cli.signals import say_interrupted
from elmo_jax.cli.stall import StallWatch
from elmo_jax.cli.streams import outliving_reader
from elmo_jax.compat.hdf5 import WeightsError
from elmo_jax.config import ConfigError
from elmo_jax.model.vocabulary import VocabError
from elmo_jax.pretrained.registry import DownloadFailed, PretrainedError
from elmo_jax.text.sources import DataError
from elmo_jax.training.checkpoint import CheckpointError

# Errors that are the user's input, not our bug: one line, no traceback.
USER_ERRORS = (
    ConfigError,
    WeightsError,
    VocabError,
    DataError,
    CheckpointError,
    PretrainedError,
    *PATH_ERRORS,
)

DEMO_SENTENCES = [
    "I ate an apple and a pear for lunch .",
    "Apple released a new phone yesterday .",
    "The apple pie was still warm .",
]


def bundled_model() -> tuple[str, str]:
    """Paths of the bundled AllenNLP test biLM (options, weights)."""
    data = resources.files("elmo_jax") / "data"
    return str(data / "fixture_options.json"), str(data / "fixture_weights.hdf5")


def cmd_demo(args: argparse.Namespace) -> None:
    from elmo_jax.compat.hdf5 import load_hdf5
    from elmo_jax.model.bilm import bilm_apply
    from elmo_jax.model.vocabulary import batch_to_ids

    if args.weights and not args.options:
        raise about(ConfigError("weights needs options (its options.json)"), "weights", "options")
    sentences = [s.split() for s in (args.sentence or DEMO_SENTENCES)]
    if not all(sentences):
        raise about(ConfigError("sentence: an empty one has no tokens to embed"), "sentence")
    options, weights = (args.options, args.weights) if args.options else bundled_model()
    config, params = load_hdf5(options, weights)
    layers, mask = (np.asarray(x) for x in bilm_apply(params, config, batch_to_ids(sentences))[:2])
    print(f"model: {weights}")
    print(
        f"  {config.lstm.n_layers} LSTM layers, dim {config.lstm.dim}, projection {config.lstm.projection_dim}; "
        f"ELMo layers: {config.n_output_layers} x {config.output_dim}"
    )
    print(f"batch: {len(sentences)} sentence(s) -> layers {list(layers.shape)}, mask {list(mask.shape)}")
    for i, s in enumerate(sentences):
        n = int(mask[i].sum())
        norms = np.linalg.norm(layers[:, i, :n], axis=-1).mean(axis=1)
        print(f"  [{i}] {n:2d} tokens  mean |layer| = {', '.join(f'{x:.3f}' for x in norms)}  {' '.join(s)}")
    word = args.word
    found = [(i, k) for i, s in enumerate(sentences) for k, t in enumerate(s) if t.lower() == word.lower()][:8]
    if len(found) >= 2:
        print(
            f"cosine similarity of '{word}' across sentences (layer 0 is context-free: the same spelling always gives 1.000):"
        )
        for layer in range(layers.shape[0]):
            v = np.stack([layers[layer, i, t] for i, t in found])
            v = v / np.linalg.norm(v, axis=-1, keepdims=True)
            sims = v @ v.T
            pairs = [f"{a}-{b}: {sims[a, b]:.3f}" for a in range(len(found)) for b in range(a + 1, len(found))]
            print(f"  layer {layer}: {', '.join(pairs)}")
    else:
        print(f"'{word}' occurs {len(found)} time(s) in the sentences: no two of its vectors to compare (--word)")
    if not args.options:
        print("(the bundled model is AllenNLP's tiny test biLM: the numbers show the plumbing, not meaning)")


def bundled_sample() -> tuple[str, str]:
    """The bundled State of the Union sample: (train file, held-out file)."""
    data = resources.files("elmo_jax") / "data" / "sample"
    return str(data / "train.txt"), str(data / "heldout.txt")


def cmd_vocab(args: argparse.Namespace) -> None:
    from elmo_jax.model.vocabulary import Vocabulary
    from elmo_jax.text.sources import open_source
    from elmo_jax.text.vocab import (
        SPECIALS,
        build_vocab,
        check_vocab_arguments,
        check_vocab_path,
        count_tokens,
        write_vocab,
    )

    try:  # before the count, which can take minutes
        extend = Vocabulary.load(args.extend).words if args.extend else None
    except VocabError as e:
        raise about(VocabError(f"extend: {e}"), "extend") from None
    files = open_source(args.train_files, args.tfds_data_dir)
    check_vocab_arguments(args.min_count, args.max_size)  # before the count, which can take minutes
    check_vocab_path(args.out, files)
    _refuse_a_runs_vocab(args.out)
    counts, n_tokens, n_sentences = count_tokens(files)
    words = build_vocab(counts, min_count=args.min_count, max_size=args.max_size, extend=extend)
    write_vocab(words, args.out, n_tokens, n_sentences, [files.name(i) for i in range(len(files))])
    # The markers, and with --extend the old words kept whatever their count here, said apart from
    # the text's words (before: "17740 tokens (of 2679 distinct)").
    frequent = sum(counts.get(w, 0) >= args.min_count for w in words[len(SPECIALS) :])
    old = len(words) - len(SPECIALS) - frequent
    kept = f", {old} more of {args.extend}" if extend else ""
    print(
        f"{args.out}: {len(words)} entries: the {len(SPECIALS)} markers, {frequent} of the text's {len(counts)} "
        f"distinct words{kept}; {n_tokens} tokens, {n_sentences} sentences, {len(files)} shard(s)"
    )


def _refuse_a_runs_vocab(out: str) -> None:
    """A run's own vocab.txt holds the words of its softmax's rows, in order: another one there
    would make every later eval and export of the run refuse it."""
    from elmo_jax.training.setup import has_checkpoint

    run_dir = os.path.dirname(out) or "."
    if os.path.basename(out) == "vocab.txt" and has_checkpoint(run_dir):
        raise ConfigError(
            f"--out {out}: is the vocabulary of the run in {run_dir}, which its checkpoints were trained with; "
            "give another path"
        )


@contextlib.contextmanager
def _watched(watch: multihost.PeerWatch | None, args: argparse.Namespace):
    """Tells the other processes how this one's training ended (``watch``: None for one process).
    An error the command line has no line for waits to see whether another process died first (a
    collective that lost its peer raises here), and then that process's line is the one said. So
    does a device failure: XLA's words for a collective that lost its peer may read as one."""
    from elmo_jax.training.global_batches import PeerFailed

    if watch is None:
        yield
        return
    try:
        yield
    except Exception as e:
        if _exit_code(e) is None:
            watch.failed(f"{type(e).__name__}: {e}", wait=True)
        else:
            line = error_line(e, args.flags, args)
            watch.failed(line, follow=isinstance(e, PeerFailed), wait=isinstance(e, DeviceFailed))
        raise
    except BaseException:
        watch.failed("interrupted")
        raise
    watch.ended()


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


def cmd_train(args: argparse.Namespace) -> None:
    """``elmo_jax.training.setup.train`` on the data, vocabulary and options the flags give."""
    import jax

    from elmo_jax.text.sources import open_source

    if (cluster := multihost.from_cluster(args)) is not None and args.process_id == 0:
        print(cluster)
    # Before jax starts its backend, which is when XLA reads its flags.
    several = (args.num_processes or 1) > 1 or bool(multihost.coordinator(args))
    kernels = set_gpu_kernels(args.gpu_kernels, args.run_dir, several)
    train_files, heldout_files = args.train_files, args.heldout_files
    if train_files is None:
        train_files, sample_heldout = bundled_sample()
        heldout_files = heldout_files or sample_heldout
        print(f"no --train-files: training on the bundled sample {train_files}")
    source = open_source(train_files, args.tfds_data_dir)
    multihost.check_processes(args, source)
    heldout = open_source(heldout_files, args.tfds_data_dir) if heldout_files else None
    peers = multihost.start(args)
    stall = StallWatch(args.stall_timeout, args.run_dir, peers) if args.stall_timeout else None
    try:
        with _watched(peers, args):
            multihost.check_count(args)  # in the watch: the others hear of it and stop too
            if jax.default_backend() == "gpu":
                print(kernels)
            if stall is not None:
                stall.start()
            last = _train(args, source, heldout, None if stall is None else stall.beat)
    finally:
        if stall is not None:
            stall.close()
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in last.items()}))
    if jax.process_index() == 0 and last.get("step"):  # a run with no step (--steps 0) has nothing to use
        print(next_commands(args.run_dir, heldout_files, args.tfds_data_dir), file=sys.stderr)


def _train(args: argparse.Namespace, source, heldout, on_progress: Callable[[str], None] | None) -> dict:
    """``setup.train`` with the flags' spec and settings; the last metrics."""
    from elmo_jax.training.loop import RunSettings
    from elmo_jax.training.setup import TrainSpec, train

    spec = TrainSpec(
        config=args.config,
        vocab=args.vocab,
        min_count=args.min_count,
        n_train_tokens=args.n_train_tokens,
        batch_size=args.batch_size,
        rows_per_draw=args.rows_per_draw,
        reset_state_prob=args.reset_state_prob,
        learning_rate=args.learning_rate,
        init_from=args.init_from,
    )
    settings = RunSettings(
        run_dir=args.run_dir,
        steps=args.steps,
        epochs=args.epochs,
        seed=args.seed,
        save_every=args.save_every,
        keep=args.keep,
        eval_every=args.eval_every,
        log_every=args.log_every,
        precision=_policy(args, None),
        progress=not args.no_progress,
        devices=args.devices,
        prefetch=args.prefetch,
        host_workers=args.host_workers,
        parse_ahead=True,  # this program's main is guarded, as the loader process's spawn needs
        on_divergence=args.on_divergence,
        new_data=args.new_data,
    )
    say = lambda text, *names: print(flag_text(text, names, args.flags))  # noqa: E731
    return train(spec, source, settings, heldout=heldout, say=say, on_progress=on_progress)


def next_commands(run_dir: str, heldout_files: str | None, tfds_data_dir: str | None = None) -> str:
    """What to do with a trained run dir: commands ready to run as printed, on the held-out file
    when there is one (else placeholders for the user's files)."""
    run, me = shlex.quote(run_dir), program()
    files = shlex.quote(heldout_files) if heldout_files else "heldout.txt"
    if heldout_files and heldout_files.startswith("tfds:") and tfds_data_dir:
        files += f" --tfds-data-dir {shlex.quote(tfds_data_dir)}"
    lines = shlex.quote(heldout_files) if heldout_files and os.path.isfile(heldout_files) else "sentences.txt"
    return "\n".join(
        [
            "next:",
            f"  {me} embed --run-dir {run} --input {lines} --output elmo.hdf5   # ELMo vectors of each line",
            f"  {me} eval --run-dir {run} --files {files}   # full-softmax perplexity",
            f"  {me} export --run-dir {run} --out-dir export/   # bilm-tf/AllenNLP files",
        ]
    )


def program() -> str:
    """This program as the shell can run it again from here: ``elmo-jax`` when that is the one it
    finds, else the path it was started by (``.venv/bin/elmo-jax`` of a venv not activated)."""
    started = sys.argv[0] if sys.argv else ""
    if os.path.basename(started) != "elmo-jax":  # python -m elmo_jax, a test, a notebook
        return "elmo-jax"
    found = shutil.which("elmo-jax")
    if found and same_path(found, started):
        return "elmo-jax"
    relative = os.path.relpath(started)
    return shlex.quote(
        started if relative.startswith("..") else relative if os.sep in relative else f".{os.sep}{relative}"
    )


def cmd_eval(args: argparse.Namespace) -> None:
    from elmo_jax.text.sources import open_source
    from elmo_jax.training.evaluate import evaluate
    from elmo_jax.training.run_dir import load_run

    source = open_source(args.files, args.tfds_data_dir)
    options, vocab, params, step = load_run(args.run_dir, args.step)
    result = evaluate(
        params,
        options.model,
        vocab,
        source,
        batch_size=args.batch_size,
        unroll_steps=args.unroll_steps,
        reset_state_per_sentence=args.reset_state_per_sentence,
    )
    print(json.dumps({"step": step, **{k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}}))


def cmd_export(args: argparse.Namespace) -> None:
    from elmo_jax.training.run_dir import export_run

    paths = export_run(args.run_dir, args.out_dir, args.step, args.layout)
    print("wrote " + ", ".join(paths))


def cmd_embed(args: argparse.Namespace) -> None:
    """``elmo_jax.extract.embed_file`` with the model the flags name; a summary line on stderr."""
    from elmo_jax.extract import EmbedFileOptions, embed_file

    if sum(map(bool, (args.run_dir, args.options, args.model))) != 1:
        raise ConfigError("give one of --model, --run-dir, or --options with --weights")
    for flag, model_file in (("--weights", args.weights), ("--options", args.options)):
        if model_file and replaced_input(args.output, [model_file]):  # embed_file checks --input
            raise ConfigError(f"--output {args.output}: is the model's {flag} file; give another --output")
    options = EmbedFileOptions(
        layers=args.layers,
        pool=args.pool,
        window=args.window,
        ahead=args.ahead,
        num_shards=args.num_shards,
        shard_index=args.shard_index,
        sentence_to_index=args.sentence_to_index,
        progress=not args.no_progress,
    )
    load = functools.partial(_embedder, args, _policy(args, "float32") or "float32")
    done = embed_file(load, args.input, args.output, options)
    if done.empty_pooled:
        print(f"elmo-jax embed: {done.empty_pooled} empty line(s) pooled to zero vectors", file=sys.stderr)
    if done.lines == 0:
        print(f"elmo-jax embed: {args.input} is empty; wrote {done.output} with no datasets", file=sys.stderr)
    elif done.manifest:
        print(
            f"wrote {done.written} of {done.lines} lines (shard {args.shard_index} of {args.num_shards}) to "
            f"{done.output} and {done.manifest}",
            file=sys.stderr,
        )
    else:
        print(f"wrote {done.lines} sentences to {done.output}", file=sys.stderr)


def _embedder(args: argparse.Namespace, precision: str):
    """The Embedder of --model, --run-dir or --options/--weights."""
    from elmo_jax.extract.embedder import Embedder

    kw = dict(batch_tokens=args.batch_tokens, precision=precision)
    if args.model:
        return Embedder.from_pretrained(args.model, **kw)
    if args.run_dir:
        return Embedder.from_checkpoint(args.run_dir, **kw)
    return Embedder.from_hdf5(args.options, args.weights, **kw)


def _layers_arg(value: str):
    if value in ("all", "top", "average"):
        return value
    try:
        return tuple(float(w) for w in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: expected all, top, average or comma-separated weights") from None


def cmd_models(args: argparse.Namespace) -> None:
    """Lists the released models and their cache state; or fetches one (--fetch), or rehashes the cache (--verify)."""
    from elmo_jax.pretrained import registry

    if args.all_files and not args.fetch:
        raise about(ConfigError("all_files needs fetch: it says which files a fetch downloads"), "all_files", "fetch")
    if args.fetch:
        model = registry.get_model(args.fetch)
        files = tuple(model.files) if args.all_files else registry.DEFAULT_FILES
        paths = registry.fetch(model, files, cache_dir=args.cache_dir, progress=False if args.no_progress else None)
        for role, path in paths.items():
            print(f"{role}: {path}")
        return
    rows = registry.cache_status(args.cache_dir)
    width = max(len(r.file) for r in rows)
    print(f"cache: {registry.cache_root(args.cache_dir)}")
    for model in registry.list_models():
        print(f"\n{model.name}: {model.summary()}")
        for r in (r for r in rows if r.model == model.name):
            size = f"{r.size:,}" if r.size is not None else "?"
            state = r.state if r.state in ("cached", "missing") else f"{r.state} ({r.on_disk:,} bytes)"
            print(f"  {r.role:<10} {r.file:<{width}} {size:>13}  {state}")
    if args.verify:
        bad = 0
        print()
        for model in registry.list_models():
            try:
                hashes = registry.verify(model, cache_dir=args.cache_dir)
            except PretrainedError as e:
                bad += 1
                print(f"{model.name}: FAILED: {e}")
                continue
            if hashes:
                print(f"{model.name}: {len(hashes)} cached file(s) match their sha256")
        if bad:
            raise PretrainedError(f"{bad} model(s) failed verification")
    else:
        print(
            "\nelmo-jax models --fetch NAME downloads a model (--all-files: softmax, vocab, checkpoint too); "
            "--verify rechecks the cached files' sha256"
        )


# Library errors name arguments by their own names (elmo_jax._util.arguments); a subcommand's flag
# is found by its dest, or, where the library's name differs, through this table (command -> name -> dest).
ARGUMENT_DESTS = {"train": {"source": "init_from"}, "vocab": {"path": "out"}}


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
            (_subcommand(self, command) if command else self).error(f"unrecognized arguments: {' '.join(extra)}{hint}")
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
    p = _Parser(prog="elmo-jax", description="ELMo biLMs in JAX.")
    cache_help = "persistent XLA compilation cache ('none': off; default: %s, or $ELMO_JAX_COMPILE_CACHE)"
    p.add_argument("--compile-cache", default=default_compile_cache(), metavar="DIR", help=cache_help % "%(default)s")
    shown = default_compile_cache().replace("%", "%%")  # argparse %-formats each help text
    sub = p.add_subparsers(dest="command", required=True)
    for add in (_add_demo, _add_vocab, _add_train, _add_eval, _add_embed, _add_export, _add_models):
        add(sub)
    for name, command in sub.choices.items():
        if name != "models":  # it compiles nothing
            # Also after the command, where users put flags; SUPPRESS keeps the one given before it.
            command.add_argument("--compile-cache", default=argparse.SUPPRESS, metavar="DIR", help=cache_help % shown)
        command.set_defaults(flags=_flags(command, ARGUMENT_DESTS.get(name, {})))
    return p


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of the subcommand ``name``."""
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


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
    demo.set_defaults(func=cmd_demo)


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
    vocab.set_defaults(func=cmd_vocab)


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
    stop.add_argument("--epochs", type=float, help="train this many passes over the data (default: n_epochs)")
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
    tr.set_defaults(func=cmd_train)


def _add_train_recipe_args(tr: argparse.ArgumentParser) -> None:
    """elmo-jax train: the recipe's values that a flag overrides."""
    tr.add_argument("--batch-size", type=int, help="rows per device (bilm-tf batch_size)")
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
        help="initial weights, data order, dropout (default: 0; a resumed run keeps its own, and refuses another "
        "but with --new-data)",
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
        "--heldout-files, at every --save-every)",
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
    ev.set_defaults(func=cmd_eval)


def _add_embed(sub) -> None:
    """elmo-jax embed"""
    em = sub.add_parser("embed", help="ELMo layers of every line of a file into hdf5 (bilm-tf's dump format)")
    em.add_argument("--model", help="a released model, downloaded once into the cache (see elmo-jax models)")
    em.add_argument("--run-dir", help="an elmo-jax run directory (newest checkpoint)")
    em.add_argument("--options", help="bilm-tf options.json (with --weights)")
    em.add_argument("--weights", help="bilm-tf weights hdf5")
    em.add_argument("--input", required=True, help="UTF-8 text, one whitespace-tokenized sentence per line")
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
    em.add_argument("--no-progress", action="store_true")
    em.set_defaults(func=cmd_embed)


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
    ex.set_defaults(func=cmd_export)


def _add_models(sub) -> None:
    """elmo-jax models"""
    mo = sub.add_parser(
        "models", help="AllenNLP's released models: their files, sizes, what is cached; fetch or verify"
    )
    mo.add_argument("--fetch", metavar="NAME", help="download a model's options and weights into the cache")
    mo.add_argument("--all-files", action="store_true", help="with --fetch: also softmax, vocab and TF checkpoint")
    mo.add_argument("--verify", action="store_true", help="recompute the sha256 of every cached file")
    mo.add_argument("--cache-dir", help="the model cache (default: $ELMO_JAX_HOME, else ~/.cache/elmo_jax/models)")
    mo.add_argument("--no-progress", action="store_true")
    # No XLA compile cache: setting it up would import jax, which listing models never needs.
    mo.set_defaults(func=cmd_models, compile_cache="none")


def _add_precision(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument(
        "--precision",
        choices=["float32", "tf32", "bfloat16"],
        help=f"matmul precision (elmo_jax.policy; tf32: GPUs only); {default}",
    )


def _policy(args, default: str | None) -> str | None:
    """The --precision policy (``default`` when not given; None: the library's own default),
    checked against this backend."""
    from elmo_jax import policy

    name = args.precision or default
    if name is not None:
        try:
            policy.check(name)
        except ValueError as e:
            raise ConfigError(f"--precision: {e}") from None
    return name


# The commands that run JAX programs: a GPU or TPU left unused is worth a warning for these.
COMPUTE_COMMANDS = ("train", "eval", "embed", "demo", "export")


def error_line(exc: BaseException, flags: dict[str, str], given: argparse.Namespace | None = None) -> str:
    """``str(exc)`` with each argument it speaks of (``elmo_jax._util.arguments.about``) written as
    the flag ``flags`` gives it: the one place a library error becomes a command-line message.

    A fault of a path (``PATH_ERRORS``: missing, a directory where a file is read, a file where a
    directory is made) is said after the flag whose value ``given`` holds it, or holds a path
    above or below it: ``--run-dir a.txt: is a file, not a directory``, not the OS's
    ``[Errno 17] File exists: 'a.txt'``. Any other ``OSError`` that names a file (a read-only file
    system, a name too long) is said the same way, in the OS's words where ``describe`` has none."""
    if isinstance(exc, OSError) and exc.filename is not None:
        culprit, phrase = describe(exc)
        asked = os.fspath(exc.filename) if isinstance(exc.filename, (str, os.PathLike)) else ""
        flag, value = _flag_of(culprit, phrase, flags, given, asked)
        return f"{flag} {said(culprit, phrase, value)}" if flag else said(culprit, phrase, os.fspath(exc.filename))
    return flag_text(str(exc), arguments_of(exc), flags)


def _flag_of(
    path: str, phrase: str, flags: dict[str, str], given: argparse.Namespace | None, asked: str = ""
) -> tuple[str, str] | tuple[None, None]:
    """The flag, and its value, that gave ``path`` or a path above or below it.

    Where ``path`` is a file that a directory was wanted in place of, a flag whose path runs
    through it is the one that wanted it (``--out corpus.txt/vocab.txt``), not one that names the
    file itself (``--train-files corpus.txt``); then the flag naming ``asked``, the path the OS
    refused, when the fault is its directory's (``--out-dir RUN/export``, not ``--run-dir RUN``
    read from); otherwise the flag naming ``path`` itself, else the nearest one above or below it."""
    candidates = []
    for dest, value in (vars(given) if given is not None else {}).items():
        if dest not in flags or not isinstance(value, str) or not value:
            continue
        through, same = under(value, path), same_path(value, path)
        if through or same or under(path, value):
            wanted = bool(asked) and same_path(value, asked)
            candidates.append(
                ((through and phrase == IS_A_FILE, wanted, same, len(os.path.abspath(value))), flags[dest], value)
            )
    if not candidates:
        return None, None
    _, flag, value = max(candidates)
    return flag, value


def flag_text(text: str, names, flags: dict[str, str]) -> str:
    """``text`` with each of the argument ``names`` written as the flag ``flags`` gives it; a name
    that is part of a path or a file name (``runs/vocab.txt``) stays as it is."""
    for name in names:
        if name in flags:
            text = re.sub(rf"(?<![\w./-]){re.escape(name)}(?![\w/-])(?!\.\w)", flags[name], text)
    return text


def main(argv: list[str] | None = None) -> int:
    """The command named in ``argv``; ``elmo_jax.cli.main`` runs it under the signal handling of
    the command line (SIGTERM and SIGHUP as interrupts), set before this module is imported."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in ("demo", "embed") and args.options and not args.weights:
        _subcommand(parser, args.command).error("--options needs --weights")
    if argv is None:  # the program, not a caller's Python: a warning is one line, as an error is
        warnings.formatwarning = _one_line_warning
    if args.command in COMPUTE_COMMANDS:
        warn_if_accelerator_unused()
    with outliving_reader(args.command):
        return _run(args, argv)


def _cancel_timers() -> None:
    """Cancels every ``threading.Timer`` still waiting, so that an interrupted program's exit does
    not wait for them (the interpreter joins its threads first).

    An interrupt that lands inside a library's ``finally: timer.cancel()`` leaves that timer
    running: jax's backend start-up sets one of 60 s for a warning about TPU hosts, and
    ``elmo-jax train`` interrupted there said so, then sat at its exit for 60 s (found by signals
    sent at random moments, as ``tests/probe_signals.py`` sends them). An interrupted command runs
    no delayed action."""
    for thread in threading.enumerate():
        if isinstance(thread, threading.Timer):
            thread.cancel()


def _run(args: argparse.Namespace, argv: list[str] | None) -> int:
    """The command, its one-line errors and their exit codes."""
    try:
        enable_compile_cache(args.compile_cache)
        args.func(args)
    except KeyboardInterrupt as e:
        exit_code = say_interrupted(args.command, e)
        if argv is None:  # the program, not a caller's Python
            _cancel_timers()
            if args.command == "embed":
                # Its partial output already removed: leave without the interpreter's teardown, in
                # which XLA can crash (SIGSEGV) when Ctrl-C landed while a program compiled.
                # (train saves and returns on a signal.)
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(exit_code)
        return exit_code
    except Exception as e:
        if (code := _exit_code(e)) is None:
            raise
        return _failed(args, e, code)
    return 0


def _exit_code(exc: BaseException) -> int | None:
    """The exit code of an error said in one line: 2 for the user's input, 1 for what the machine or
    the run met; None for an error the command line has no line for (a bug: its traceback)."""
    from elmo_jax._util.processes import StoreFailed
    from elmo_jax.training.global_batches import PeerFailed
    from elmo_jax.training.hooks import Diverged

    # WriteFailed: the input was fine; the machine ran out of room, or its file system failed.
    # DownloadFailed is a PretrainedError, one of USER_ERRORS, but the network failed, not the input.
    if isinstance(
        exc,
        (
            DownloadFailed,
            WriteFailed,
            PeerFailed,
            StoreFailed,
            Diverged,
            OutOfDeviceMemory,
            DeviceFailed,
            CoordinatorError,
        ),
    ):
        return 1
    if isinstance(exc, USER_ERRORS):
        return 2
    # The OS refused a file for another reason (a file system mounted read-only, a name too long):
    # the file is named, and nothing of the program is at fault.
    if isinstance(exc, OSError) and exc.filename is not None:
        return 1
    return None


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    """``warnings.formatwarning`` for the program: the library's words, without its source line."""
    return f"warning: {message}\n"


def _failed(args: argparse.Namespace, exc: BaseException, code: int) -> int:
    """Prints ``exc`` as the command's one error line; returns the exit code ``code``."""
    print(f"elmo-jax {args.command}: error: {error_line(exc, args.flags, args)}", file=sys.stderr)
    return code


if __name__ == "__main__":
    from elmo_jax import cli

    sys.exit(cli.main())
