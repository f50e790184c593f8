"""The ``elmo-jax`` commands: each runs a command line that ``parser`` parsed, calling the library, and
turns its errors into one line that names the flags (``error_line``) and an exit code."""

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
import warnings
from collections.abc import Callable
from importlib import resources

import numpy as np

from elmo_jax._util.arguments import about, arguments_of
from elmo_jax._util.device_memory import DeviceFailed, OutOfDeviceMemory
from elmo_jax._util.disk_full import WriteFailed
from elmo_jax._util.paths import IS_A_FILE, PATH_ERRORS, describe, fault, replaced_input, said, same_path, under
from elmo_jax._util.runtime import (
    enable_compile_cache,
    set_gpu_kernels,
    warn_if_accelerator_unused,
)
from elmo_jax.cli import multihost
from elmo_jax.cli.coordinator import CoordinatorError
from elmo_jax.cli.parser import parse
from elmo_jax.cli.signals import say_interrupted
from elmo_jax.cli.stall import StallWatch
from elmo_jax.cli.streams import STDIN, outliving_reader, spooled_stdin
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
    files = _source("--train-files", args.train_files, args.tfds_data_dir)
    check_vocab_arguments(args.min_count, args.max_size)  # before the count, which can take minutes
    check_vocab_path(args.out, files)
    _refuse_a_runs_vocab(args.out)
    counts, n_tokens, n_sentences = count_tokens(files)
    words = build_vocab(counts, min_count=args.min_count, max_size=args.max_size, extend=extend)
    write_vocab(
        words, args.out, n_tokens, n_sentences, [files.name(i) for i in range(len(files))], min_count=args.min_count
    )
    # The markers, and with --extend the old words kept whatever their count here, said apart from
    # the text's words (counted with them, "17740 tokens (of 2679 distinct)" misled).
    frequent = sum(counts.get(w, 0) >= args.min_count for w in words[len(SPECIALS) :])
    old = len(words) - len(SPECIALS) - frequent
    kept = f", {old} more of {args.extend}" if extend else ""
    print(
        f"{args.out}: {len(words)} entries: the {len(SPECIALS)} markers, {frequent} of the text's {len(counts)} "
        f"distinct words{kept}; {n_tokens} token{'' if n_tokens == 1 else 's'}, {n_sentences} "
        f"sentence{'' if n_sentences == 1 else 's'}, {len(files)} shard(s)"
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


def cmd_train(args: argparse.Namespace) -> int:
    """``elmo_jax.training.setup.train`` on the data, vocabulary and options the flags give; the
    exit code: 0 at the run's end, 128 + the signal's number when a signal stopped it short (143
    for SIGTERM), so that a scheduler or a retry loop does not take a preempted run for a finished
    one."""
    import jax

    from elmo_jax.training.hooks import Stopped

    if (cluster := multihost.from_cluster(args)) is not None and args.process_id == 0:
        print(cluster)
    # Before jax starts its backend, which is when XLA reads its flags.
    several = (args.num_processes or 1) > 1 or bool(multihost.coordinator(args))
    kernels = set_gpu_kernels(args.gpu_kernels, args.run_dir, several)
    train_files, heldout_files = args.train_files, args.heldout_files
    notes = []  # said once the flags have passed their checks (_train), not above a refusal of them
    if train_files is None:
        train_files, sample_heldout = bundled_sample()
        heldout_files = heldout_files or _sample_heldout(args.run_dir, train_files, sample_heldout)
        notes.append(f"no --train-files: training on the bundled sample {train_files}")
    source = _source("--train-files", train_files, args.tfds_data_dir)
    multihost.check_processes(args, source)
    heldout = _source("--heldout-files", heldout_files, args.tfds_data_dir) if heldout_files else None
    peers = multihost.start(args)
    stall = StallWatch(args.stall_timeout, args.run_dir, peers) if args.stall_timeout else None
    try:
        with _watched(peers, args):
            multihost.check_count(args)  # in the watch: the others hear of it and stop too
            if jax.default_backend() == "gpu":
                print(kernels)
            if stall is not None:
                stall.start()
            stopped = None
            try:
                last = _train(args, source, heldout, None if stall is None else stall.beat, notes)
            except Stopped as e:  # saved, and said so; every process stopped at the same step
                stopped, last = e, e.metrics
    finally:
        if stall is not None:
            stall.close()
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in last.items()}))
    if jax.process_index() == 0 and last.get("step"):  # a run with no step (--steps 0) has nothing to use
        # The run's own held-out file when this session had none; read by one process, so not
        # where reading checkpoints is a collective of several.
        saved = _saved_heldout(args.run_dir) if heldout_files is None and jax.process_count() == 1 else None
        print(next_commands(args.run_dir, heldout_files or saved, args.tfds_data_dir), file=sys.stderr)
    return 0 if stopped is None else 128 + stopped.signum


def _source(flag: str, files: str, tfds_data_dir: str | None):
    """``open_source`` of a flag's files, its refusal naming the flag: "no files match X" alone
    does not say which flag gave X (the training or the held-out files; X the run dir too)."""
    from elmo_jax.text.sources import DataError, open_source

    try:
        return open_source(files, tfds_data_dir)
    except DataError as e:
        raise DataError(f"{flag} {files}: {e}") from None


def _sample_heldout(run_dir: str, sample: str, sample_heldout: str) -> str | None:
    """The bundled sample's held-out file for a run without --train-files, which trains on the
    sample: a run dir trained on other files is refused (it would be refused later, saying that
    the sample's train.txt is new), and one that scored other held-out text is not given the
    sample's (its perplexities would mix two texts; the run warns that it scores none)."""
    from elmo_jax.training.setup import newest_meta

    meta = newest_meta(run_dir) or {}
    trained = [f.get("name") for f in meta.get("train_files") or [] if isinstance(f, dict)]
    if trained and trained != [os.path.basename(sample)]:
        names = ", ".join(map(str, trained[:3])) + (", ..." if len(trained) > 3 else "")
        raise ConfigError(
            f"--run-dir {run_dir}: was trained on {names}, and no --train-files trains on the bundled sample; "
            "give --train-files with its files to resume it"
        )
    scored = [os.path.basename(str(f)) for f in meta.get("heldout_files") or []]
    return sample_heldout if scored in ([], [os.path.basename(sample_heldout)]) else None


def _saved_heldout(run_dir: str) -> str | None:
    """The held-out file the run's newest checkpoint was scored on, when it was one file."""
    from elmo_jax.training.checkpoint import Checkpointer

    ckpt = Checkpointer(run_dir, read_only=True)
    try:
        files = (ckpt.latest_meta() or {}).get("heldout_files") or []
    finally:
        ckpt.close()
    return files[0] if len(files) == 1 else None


def _train(
    args: argparse.Namespace, source, heldout, on_progress: Callable[[str], None] | None, notes: list[str]
) -> dict:
    """``setup.train`` with the flags' spec and settings; the last metrics. ``notes`` are said
    before the first thing the run says or does, past the checks of its settings."""
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

    def after_notes(then: Callable[..., None]) -> Callable[..., None]:
        def call(*what: str) -> None:
            while notes:
                print(notes.pop(0))
            then(*what)

        return call

    say = after_notes(lambda text, *names: print(flag_text(text, names, args.flags)))
    beat = after_notes(on_progress or (lambda doing: None))
    return train(spec, source, settings, heldout=heldout, say=say, on_progress=beat)


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
    from elmo_jax.training.evaluate import evaluate
    from elmo_jax.training.run_dir import load_run

    source = _source("--files", args.files, args.tfds_data_dir)
    options, vocab, params, step = load_run(args.run_dir, args.step)
    result = evaluate(
        params,
        options.model,
        vocab,
        source,
        batch_size=args.batch_size,
        unroll_steps=args.unroll_steps,
        reset_state_per_sentence=args.reset_state_per_sentence,
        progress=not args.no_progress,
    )
    print(json.dumps({"step": step, **{k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}}))


def cmd_export(args: argparse.Namespace) -> None:
    from elmo_jax.training.run_dir import export_run

    done = export_run(args.run_dir, args.out_dir, args.step, args.layout)
    print(f"wrote {', '.join(done.paths)}: step {done.step} of {args.run_dir}")


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
    if args.input == "-":
        if args.num_shards is not None:
            raise ConfigError("--input -: standard input goes to one process; give a file to split with --num-shards")
        if bad := fault(args.output, "output"):  # said before the input is read to its end
            raise DataError(f"--output {said(*bad, args.output)}")
        with spooled_stdin(DataError) as spooled:
            done = embed_file(load, spooled, args.output, options)
    else:
        done = embed_file(load, args.input, args.output, options)
    if done.empty_pooled:
        print(f"elmo-jax embed: {done.empty_pooled} empty line(s) pooled to zero vectors", file=sys.stderr)
    if done.lines == 0:
        what = "an 'embeddings' dataset of 0 rows" if args.pool else "no datasets"
        name = STDIN if args.input == "-" else args.input
        print(f"elmo-jax embed: {name} is empty; wrote {done.output} with {what}", file=sys.stderr)
    elif done.manifest:
        print(
            f"wrote {done.written} of {done.lines} lines (shard {args.shard_index} of {args.num_shards}) to "
            f"{done.output} and {done.manifest}",
            file=sys.stderr,
        )
    else:
        print(f"wrote {done.lines} sentence{'s' if done.lines > 1 else ''} to {done.output}", file=sys.stderr)


def _embedder(args: argparse.Namespace, precision: str):
    """The Embedder of --model, --run-dir or --options/--weights."""
    from elmo_jax.extract.embedder import Embedder

    kw = dict(batch_tokens=args.batch_tokens, precision=precision)
    if args.model:
        return Embedder.from_pretrained(args.model, **kw)
    if args.run_dir:
        return Embedder.from_checkpoint(args.run_dir, **kw)
    return Embedder.from_hdf5(args.options, args.weights, **kw)


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
        bad = checked = 0
        print()
        for model in registry.list_models():
            try:
                hashes = registry.verify(model, cache_dir=args.cache_dir)
            except PretrainedError as e:
                bad += 1
                print(f"{model.name}: FAILED: {e}")
                continue
            checked += len(hashes)
            if hashes:
                print(f"{model.name}: {len(hashes)} cached file(s) match their sha256")
        if bad:
            raise PretrainedError(f"{bad} model(s) failed verification")
        if not checked:
            print("no file is cached, so none was checked; elmo-jax models --fetch NAME downloads a model")
    else:
        print(
            "\nelmo-jax models --fetch NAME downloads a model (--all-files: softmax, vocab, checkpoint too); "
            "--verify rechecks the cached files' sha256"
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
        # The path a write asked for, where the OS refused its directory (``atomic_path``).
        wanted = exc.filename2 if exc.filename2 is not None else exc.filename
        asked = os.fspath(wanted) if isinstance(wanted, (str, os.PathLike)) else ""
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
    """The command named in ``argv`` (None: ``sys.argv[1:]``), parsed and run; ``elmo_jax.cli.main``
    parses first, then imports this module under the signal handling of the command line (SIGTERM
    and SIGHUP as interrupts) and calls ``run``."""
    return run(parse(argv), argv)


def run(args: argparse.Namespace, argv: list[str] | None) -> int:
    """The command that ``args`` (``parser.parse(argv)``) name; returns its exit code. ``argv`` None
    is the program, not a caller's Python: its warnings are one line, as its errors are."""
    if argv is None:
        warnings.formatwarning = _one_line_warning
    if args.command in COMPUTE_COMMANDS:
        warn_if_accelerator_unused()
    with outliving_reader(args.command):
        return _run(args, argv)


def _function(command: str) -> Callable[[argparse.Namespace], int | None]:
    """The function that runs ``command``, looked up when it runs; it returns its exit code when
    that is not 0 (None)."""
    return {
        "demo": cmd_demo,
        "vocab": cmd_vocab,
        "train": cmd_train,
        "eval": cmd_eval,
        "embed": cmd_embed,
        "export": cmd_export,
        "models": cmd_models,
    }[command]


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
        code = _function(args.command)(args)
    except KeyboardInterrupt as e:
        exit_code = say_interrupted(args.command, e)
        if argv is None:  # the program, not a caller's Python
            _cancel_timers()
            if args.command == "embed":
                # Its partial output already removed: leave without the interpreter's teardown, in
                # which XLA can crash (SIGSEGV) when Ctrl-C landed while a program compiled.
                # (train saves on a signal, and returns its exit code.)
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(exit_code)
        return exit_code
    except Exception as e:
        if (code := _exit_code(e)) is None:
            raise
        return _failed(args, e, code)
    return code or 0


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
