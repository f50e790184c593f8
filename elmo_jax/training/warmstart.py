"""What a new pretraining run can start from, and the state it starts with (continued pretraining).

``read_warmstart(source)`` reads any of:

- an elmo-jax run directory (``checkpoints/``, ``options.json``, ``vocab.txt``), possibly ``gs://``:
  weights, softmax and Adagrad accumulators;
- a bilm-tf TensorFlow checkpoint directory (``model.ckpt-STEP.index`` / ``.data-*``, bilm-tf's
  ``options.json``, and a ``vocab*.txt`` in it or next to it): the same, read without TensorFlow
  (``elmo_jax.compat.tf_checkpoint``);
- a directory of hdf5 files, under elmo-jax's export names (``options.json``, ``weights.hdf5``,
  ``softmax.hdf5``, ``vocab.txt``) or AllenNLP's released ones (``elmo_*_options.json``,
  ``elmo_*_weights.hdf5``, ``elmo_*_softmax_weights.hdf5``, ``vocab-*.txt``); softmax and
  vocabulary optional; no optimizer state;
- a released model's name (``elmo_jax.pretrained``): its TF checkpoint and vocabulary where one was
  released, else its hdf5 files.

``finetune_state`` turns it into the shared state ``pretrain(..., init_state=...)`` starts from,
for the new run's options and vocabulary: softmax rows (and accumulators) carried by word, new
words' rows fresh, the step back at 0.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import warnings

import jax
import numpy as np
from etils import epath

from elmo_jax._util.arguments import about, did_you_mean
from elmo_jax.compat.hdf5 import WeightsError, load_hdf5, open_hdf5
from elmo_jax.config import ModelConfig, Options
from elmo_jax.model.vocabulary import VocabError, Vocabulary
from elmo_jax.training.checkpoint import CheckpointError
from elmo_jax.training.run_dir import read_run, softmax_in_id_order
from elmo_jax.training.sharded_softmax import RowLayout
from elmo_jax.training.step import init_state

# The learning rate a continued run uses when its source has no Adagrad accumulators (hdf5 files):
# they restart at 1.0, so bilm-tf's 0.2 makes the first updates as large as at step 1 of
# pretraining. Measured by experiments/fresh_accumulators.py on a 1,500-step model continued on its
# own text (held-out perplexity 218.8 at the start): at 0.2, 258.6 / 249.3 / 214.5 after 20 / 50 /
# 100 steps; at 0.05, 212.3 / 208.3 / 207.6 (at 0.02: 212.1 / 209.4 / 208.4; from its real
# accumulators at 0.2: 218.0 / 214.2 / 211.5).
NO_ACCUMULATORS_LEARNING_RATE = 0.05


@dataclasses.dataclass
class Warmstart:
    """A model to continue from (numpy leaves; softmax ``{"w": [V, P], "b": [V]}`` in vocabulary order).

    ``bilm_acc``/``softmax_acc``: Adagrad accumulators like the params (None: the source has no
    optimizer state, e.g. hdf5 files). ``softmax`` and ``vocab`` are None when the source has no
    output layer (a released ``weights.hdf5`` alone).
    """

    source: str
    kind: str  # "run", "tf_checkpoint", "hdf5"
    model: ModelConfig
    bilm: dict
    bilm_acc: dict | None = None
    softmax: dict | None = None
    softmax_acc: dict | None = None
    vocab: Vocabulary | None = None
    step: int | None = None


def check_source(source: str) -> str:
    """What ``source`` is: ``"run"`` (an elmo-jax run dir), ``"released"`` (a released model's
    name) or ``"directory"`` (a TF checkpoint's or hdf5 files'); a one-line ``CheckpointError``
    when it can be no warm start at all (nothing there and no such model; a file), before any read."""
    source = os.fspath(source)
    if epath.Path(source, "checkpoints").is_dir():
        return "run"
    if not epath.Path(source).exists():
        from elmo_jax.pretrained import registry

        if str(source).lower() in registry.MODELS:
            return "released"
        raise about(
            CheckpointError(
                f"source {source}: neither a directory nor a released model ({', '.join(registry.MODELS)})"
                + did_you_mean(source, registry.MODELS)
            ),
            "source",
        )
    if not os.path.isdir(source):
        raise about(CheckpointError(f"source {source}: not a directory"), "source")
    return "directory"


def read_warmstart(source: str) -> Warmstart:
    """Reads ``source`` (see the module doc); one-line ``CheckpointError``/``WeightsError`` otherwise."""
    source = os.fspath(source)
    kind = check_source(source)
    if kind == "run":
        return _from_run(source)
    if kind == "released":
        return _from_released(source.lower())
    if glob.glob(os.path.join(glob.escape(source), "*.index")) or os.path.isfile(os.path.join(source, "checkpoint")):
        return _from_tf_checkpoint(source, _find_vocab(source, also_parent=True))
    return _from_hdf5_dir(source)


def _from_run(run_dir: str) -> Warmstart:
    options, vocab, shared, step = read_run(run_dir)
    return Warmstart(
        run_dir,
        "run",
        options.model,
        shared["params"]["bilm"],
        dense_accumulators(shared["opt"]["bilm"]),
        shared["params"]["softmax"],
        shared["opt"]["softmax"],
        vocab,
        step,
    )


def _from_released(name: str) -> Warmstart:
    from elmo_jax.pretrained import registry

    model = registry.MODELS[name]
    if "checkpoint" in model.files:
        paths = registry.fetch(name, ("checkpoint", "vocab"))
        return _from_tf_checkpoint(str(paths["checkpoint"]), str(paths["vocab"]))
    roles = [r for r in ("options", "weights", "softmax", "vocab") if r in model.files]
    paths = registry.fetch(name, roles)
    return _from_hdf5_files(name, {r: str(p) for r, p in paths.items()})


def _from_tf_checkpoint(path: str, vocab_path: str | None) -> Warmstart:
    from elmo_jax.compat import tf_checkpoint

    try:
        ckpt = tf_checkpoint.read_bilm_tf(path)
    except tf_checkpoint.TFCheckpointError as e:
        raise CheckpointError(str(e)) from None
    if ckpt["config"] is None:
        # The tensors give the shapes, not the clips, activation or skip connections.
        raise CheckpointError(
            f"{path}: no options.json next to the TF checkpoint (bilm-tf saves its training "
            f"options there); put the model's options.json in {os.path.dirname(ckpt['prefix'])}"
        )
    softmax = ckpt["params"].get("softmax")
    if softmax is None or vocab_path is None:
        raise CheckpointError(
            f"{path}: a TF checkpoint's softmax rows are words of its vocabulary; put that "
            f"vocabulary (vocab*.txt) in the checkpoint's directory or the one above it"
        )
    vocab = _load_vocab(vocab_path, len(softmax["w"]), path)
    acc = ckpt["accumulators"] or {}
    return Warmstart(
        path,
        "tf_checkpoint",
        ckpt["config"],
        ckpt["params"]["bilm"],
        acc.get("bilm"),
        softmax,
        acc.get("softmax"),
        vocab,
        ckpt["global_step"],
    )


def _find_vocab(directory: str, also_parent: bool = False) -> str | None:
    """The directory's ``vocab.txt`` or single ``vocab*.txt`` (then, optionally, its parent's)."""
    for d in [directory] + ([os.path.dirname(os.path.abspath(directory))] if also_parent else []):
        found = sorted(glob.glob(os.path.join(glob.escape(d), "vocab*.txt")))
        if os.path.join(d, "vocab.txt") in found:
            return os.path.join(d, "vocab.txt")
        if len(found) > 1:
            raise CheckpointError(
                f"{d}: more than one vocabulary ({', '.join(map(os.path.basename, found))}); "
                f"keep the one that goes with the softmax"
            )
        if found:
            return found[0]
    return None


def _one_file(directory: str, patterns: tuple[str, ...], exclude: str | None = None) -> str | None:
    found = sorted(
        {
            p
            for pat in patterns
            for p in glob.glob(os.path.join(glob.escape(directory), pat))
            if not (exclude and p.endswith(exclude))
        }
    )
    if len(found) > 1:
        raise CheckpointError(
            f"{directory}: more than one of {' / '.join(patterns)} "
            f"({', '.join(map(os.path.basename, found))}); expected one"
        )
    return found[0] if found else None


def _from_hdf5_dir(directory: str) -> Warmstart:
    files = {
        "options": _one_file(directory, ("options.json", "elmo_*_options.json")),
        "weights": _one_file(directory, ("weights.hdf5", "elmo_*_weights.hdf5"), exclude="softmax_weights.hdf5"),
        "softmax": _one_file(directory, ("softmax.hdf5", "elmo_*_softmax_weights.hdf5")),
        "vocab": _find_vocab(directory),
    }
    for role in ("options", "weights"):
        if files[role] is None:
            raise about(
                CheckpointError(
                    f"source {directory}: no {role} file (expected a run dir, a TF checkpoint, "
                    f"or options.json + weights.hdf5 / elmo_*_options.json + "
                    f"elmo_*_weights.hdf5)"
                ),
                "source",
            )
    return _from_hdf5_files(directory, {k: v for k, v in files.items() if v})


def _from_hdf5_files(source: str, files: dict[str, str]) -> Warmstart:
    model, bilm = load_hdf5(files["options"], files["weights"])
    softmax = vocab = None
    if "softmax" in files:
        softmax = _read_softmax(files["softmax"], model.lstm.projection_dim)
        if "vocab" not in files:
            raise CheckpointError(
                f"{files['softmax']}: its rows are words of a vocabulary, but none is next to "
                f"it (vocab.txt or vocab-*.txt)"
            )
        vocab = _load_vocab(files["vocab"], len(softmax["w"]), files["softmax"])
    return Warmstart(source, "hdf5", model, bilm, None, softmax, None, vocab)


def _read_softmax(path: str, projection_dim: int) -> dict:
    with open_hdf5(path, "softmax file") as f:
        try:
            w, b = f["softmax/W"][...], f["softmax/b"][...]
        except KeyError:
            raise WeightsError(f"{path}: expected datasets softmax/W [V, {projection_dim}] and softmax/b [V]") from None
    if w.ndim != 2 or w.shape[1] != projection_dim or b.shape != (w.shape[0],):
        raise WeightsError(
            f"{path}: softmax/W {w.shape} and softmax/b {b.shape}; expected [V, {projection_dim}] "
            f"and [V] (the model's projection_dim is {projection_dim})"
        )
    return {"w": w.astype(np.float32), "b": b.astype(np.float32)}


def _load_vocab(path: str, rows: int, softmax_source: str) -> Vocabulary:
    try:
        vocab = Vocabulary.load(path)
    except VocabError as e:
        raise CheckpointError(str(e)) from None
    if len(vocab) != rows:
        raise CheckpointError(
            f"{softmax_source}: {rows} softmax rows, but its vocabulary {path} has {len(vocab)} "
            f"words; expected one row per word"
        )
    return vocab


def dense_accumulators(opt_state) -> dict:
    """The Adagrad sums of squares of an optax ``adagrad`` state (``dense_optimizer``)."""
    return next(
        s.sum_of_squares
        for s in jax.tree_util.tree_leaves(opt_state, is_leaf=lambda s: hasattr(s, "sum_of_squares"))
        if hasattr(s, "sum_of_squares")
    )


def _with_accumulators(opt_state, acc: dict):
    return jax.tree_util.tree_map(
        lambda s: s._replace(sum_of_squares=acc) if hasattr(s, "sum_of_squares") else s,
        opt_state,
        is_leaf=lambda s: hasattr(s, "sum_of_squares"),
    )


def check_continues(warm: Warmstart, model: ModelConfig) -> None:
    """A ``CheckpointError`` unless ``model`` is ``warm``'s biLM: continuing keeps its shape. (The
    char table's ``n_characters`` aside: the model reads 262 rows whatever a file says.)"""
    if warm.model.with_shifted_chars() != model.with_shifted_chars():
        raise CheckpointError(
            f"{warm.source}: its biLM differs from the options given, and continuing keeps the "
            f"biLM's shape: it has {_shape(warm.model)}, the options {_shape(model)}"
        )


def finetune_state(
    source: str | Warmstart, options: Options, vocab: Vocabulary, seed: int = 0, *, warn_rate: bool = True
) -> dict:
    """A fresh shared state (no LSTM rows; numpy, softmax in id order) for ``options``/``vocab``
    that starts from ``source`` (a ``Warmstart`` or anything ``read_warmstart`` reads):
    ``pretrain(..., init_state=...)`` trains from it.

    The biLM weights carry over, with their Adagrad accumulators where the source has them (else
    1.0, as at init, and a warning when the options' learning rate is above
    ``NO_ACCUMULATORS_LEARNING_RATE``, unless ``warn_rate`` is False: the command line chose it). Softmax rows and accumulators of the words both vocabularies share are
    copied by word; the other rows are initialised as in a fresh run. The step restarts at 0.
    """
    warm = source if isinstance(source, Warmstart) else read_warmstart(source)
    check_continues(warm, options.model)
    assert options.train is not None  # continuing needs the training keys
    if warn_rate and warm.bilm_acc is None and options.train.learning_rate > NO_ACCUMULATORS_LEARNING_RATE:
        # elmo-jax train picks the lower rate itself; a caller of this function picks its options.
        warnings.warn(
            f"{warm.source}: has no optimizer state (Adagrad restarts at 1.0), and the options' learning_rate "
            f"{options.train.learning_rate:g} makes the first updates as large as at pretraining's first step; "
            f"elmo-jax train uses {NO_ACCUMULATORS_LEARNING_RATE} for such a source (TrainConfig learning_rate)",
            stacklevel=2,
        )
    layout = RowLayout.for_vocab(options.train.n_tokens_vocab)
    fresh = softmax_in_id_order(
        jax.device_get(init_state(jax.random.PRNGKey(seed), options.model, options.train, 1).shared()), layout
    )
    dense_opt = (
        fresh["opt"]["bilm"] if warm.bilm_acc is None else _with_accumulators(fresh["opt"]["bilm"], warm.bilm_acc)
    )
    state = dict(fresh)
    state["params"] = {"bilm": warm.bilm, "softmax": dict(fresh["params"]["softmax"])}
    state["opt"] = {"bilm": dense_opt, "softmax": dict(fresh["opt"]["softmax"])}
    if warm.softmax is not None and warm.vocab is not None:  # both or neither
        shared = [(i, warm.vocab.word_to_id(w)) for i, w in enumerate(vocab.words) if w in warm.vocab]
        if shared:
            new_ids, old_ids = (np.array(x) for x in zip(*shared))
            for name in ("w", "b"):
                state["params"]["softmax"][name] = np.array(state["params"]["softmax"][name])
                state["params"]["softmax"][name][new_ids] = np.asarray(warm.softmax[name])[old_ids]
                if warm.softmax_acc is not None:
                    state["opt"]["softmax"][name] = np.array(state["opt"]["softmax"][name])
                    state["opt"]["softmax"][name][new_ids] = np.asarray(warm.softmax_acc[name])[old_ids]
    return state


def _shape(model: ModelConfig) -> str:
    c, l = model.char_cnn, model.lstm
    return (
        f"{l.n_layers} x LSTM {l.dim}/{l.projection_dim}, {c.n_filters} char filters "
        f"{[list(f) for f in c.filters]}, {c.n_highway} highway"
    )
