"""A run directory's weights in id order: load them, export them to bilm-tf files.

Checkpoints keep the softmax in ``RowLayout`` slot order (split by rows over the devices);
everything here works in vocabulary id order, ``[V, P]``, as bilm-tf's files do. Both checkpoint
formats are read (see ``checkpoint``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os

import h5py
import jax
import numpy as np
from etils import epath

from elmo_jax._util import disk_full
from elmo_jax._util.arguments import about, check_path
from elmo_jax._util.atomic import atomic_path, is_local, write_text_atomic
from elmo_jax._util.paths import check_dir_to_make, closed_above
from elmo_jax.compat.hdf5 import save_hdf5
from elmo_jax.config import Options
from elmo_jax.model import lstm
from elmo_jax.model.vocabulary import Vocabulary
from elmo_jax.training.checkpoint import Checkpointer, CheckpointError, damaged_values, vocab_hash
from elmo_jax.training.orbax_log import orbax_log
from elmo_jax.training.sharded_softmax import LayoutError, RowLayout
from elmo_jax.training.step import init_state


def abstract_shared(options: Options, meta: dict) -> dict:
    """Restore target of a checkpoint's ``state`` item, written in ``meta['format']``; every leaf
    on this process's first device (the trainer puts its own shardings on the shapes)."""
    sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    train = options.train
    assert train is not None  # a run's options have their training keys
    shared = jax.eval_shape(lambda: init_state(jax.random.PRNGKey(0), options.model, train, 1)).shared()
    if meta.get("format", 1) == 1:  # the softmax in id order, unpadded
        v = train.n_tokens_vocab
        for part in ("params", "opt"):
            shared[part]["softmax"] = {
                k: jax.ShapeDtypeStruct((v,) + x.shape[1:], x.dtype) for k, x in shared[part]["softmax"].items()
            }
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), shared)


def abstract_rows(model, global_rows: int, sharding=None) -> dict:
    """Restore target of a checkpoint's ``lstm`` item (``sharding`` a tree like the rows, or one
    sharding for all; default: this process's first device)."""
    rows = jax.eval_shape(lambda: lstm.zero_state(model, global_rows))
    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    if not isinstance(sharding, dict):
        sharding = dict.fromkeys(rows, sharding)
    return {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding[k]) for k, x in rows.items()}


def saved_layout(meta: dict) -> RowLayout | None:
    """The softmax layout a checkpoint was written in (None: format 1, id order); a
    ``CheckpointError`` for metadata that holds no layout."""
    if meta.get("format", 1) < 2:
        return None
    try:
        return RowLayout(**meta["softmax_layout"])
    except (KeyError, TypeError, LayoutError) as e:  # damaged or hand-edited metadata
        raise CheckpointError(f"a checkpoint's softmax_layout is unreadable ({e}); the metadata is damaged") from None


def softmax_in_id_order(shared: dict, layout: RowLayout | None) -> dict:
    """``shared`` with its softmax weights and accumulators ``[V, ...]`` in id order (numpy), from
    ``layout``'s slot order (None: already in id order)."""
    convert = np.asarray if layout is None else layout.from_stored
    return {
        **shared,
        **{
            part: {**shared[part], "softmax": {k: convert(x) for k, x in shared[part]["softmax"].items()}}
            for part in ("params", "opt")
        },
    }


def softmax_in_slot_order(shared: dict, layout: RowLayout) -> dict:
    """The inverse: id order -> slot order (padding: weights 0, accumulators 1, as at init)."""
    out = dict(shared)
    for part, fill in (("params", 0.0), ("opt", 1.0)):
        out[part] = {
            **shared[part],
            "softmax": {k: layout.to_stored(np.asarray(x), fill) for k, x in shared[part]["softmax"].items()},
        }
    return out


def read_run(
    run_dir: str | os.PathLike, step: int | None = None, *, check_vocab: bool = True
) -> tuple[Options, Vocabulary, dict, int]:
    """(options, vocab, shared state with the softmax in id order, step) of a run directory's
    newest readable (or the given) checkpoint. ``run_dir`` may be a ``gs://`` path (etils.epath).
    ``check_vocab``: refuse a vocab.txt other than the one the checkpoint was trained with (off
    for readers of the biLM alone, which no vocabulary enters: ``read_bilm`` reads none)."""
    options = _run_options(run_dir, step)
    vocab = Vocabulary.load(os.path.join(run_dir, "vocab.txt"))
    options, shared, step = _read_checkpoint(run_dir, options, step, vocab if check_vocab else None)
    return options, vocab, shared, step


def read_bilm(run_dir: str | os.PathLike, step: int | None = None) -> tuple[Options, dict, int]:
    """(options, params, step) of a run directory's newest readable (or the given) checkpoint, for
    readers of the biLM alone (extraction): its vocab.txt is neither read nor needed."""
    options = _run_options(run_dir, step)
    options, shared, step = _read_checkpoint(run_dir, options, step, None)
    return options, shared["params"], step


def _run_options(run_dir: str | os.PathLike, step: int | None) -> Options:
    """The run's options.json, once ``run_dir`` and ``step`` are known to be a run dir and a step."""
    if step is not None and (isinstance(step, bool) or not isinstance(step, (int, np.integer))):
        # "8" or 8.0 would be looked for as a checkpoint of that name, and said to be missing or damaged.
        raise about(TypeError(f"step is a {type(step).__name__} ({step!r}); expected an int or None"), "step")
    check_path(run_dir, "run_dir", "a run directory's path")  # before: os.path.join's TypeError, naming no argument
    options_path = os.path.join(run_dir, "options.json")
    if is_local(run_dir) and not os.path.isdir(run_dir) and not closed_above(run_dir):
        # The OS's error for the path: the command line says it after the flag that gave it.
        exists = os.path.exists(run_dir)
        code = errno.ENOTDIR if exists else errno.ENOENT
        raise (NotADirectoryError if exists else FileNotFoundError)(code, os.strerror(code), os.fspath(run_dir))
    if not epath.Path(options_path).is_file():
        if closed := closed_above(options_path):  # its files may be there, out of this user's reach
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), closed)
        raise CheckpointError(f"{run_dir}: not a run directory (no options.json){_export_hint(run_dir)}")
    return Options.load(options_path, saved=True)


def _read_checkpoint(
    run_dir: str | os.PathLike, options: Options, step: int | None, vocab: Vocabulary | None
) -> tuple[Options, dict, int]:
    """(the step's options, shared state, step) of ``step`` or the newest readable checkpoint;
    ``vocab``: checked against the one the checkpoint was trained with (None: not checked)."""
    ckpt = Checkpointer(run_dir, read_only=True)
    # A damaged checkpoint's noise is dropped (a reader writes nothing into a run dir); the
    # warning or the error says what was unreadable.
    with orbax_log(None, failed=lambda: ckpt.orbax_failed):
        try:
            newest = None  # a run's vocabulary is one for all its checkpoints: one check does
            if vocab is not None:  # before the restore, which reads every array of a large run
                with contextlib.suppress(Exception):  # unreadable metadata: the restore says why
                    newest = ckpt.latest_meta()
                if newest is not None:
                    check_run_vocab(vocab, newest, run_dir)
            shared, step, meta = _restore(ckpt, run_dir, options, step)
        finally:
            ckpt.close()
    if vocab is not None and newest is None:  # the newest metadata unreadable: the restored step's
        check_run_vocab(vocab, meta, run_dir)
    if "options" in meta:  # the step's own: a later session may have changed its recipe (batch_size,
        # learning_rate, ...), which options.json, written when the run began, does not follow
        options = Options.from_dict(meta["options"], where=f"{run_dir}: checkpoint {step}'s options", saved=True)
    return options, shared, step


def check_run_vocab(vocab: Vocabulary, meta: dict, run_dir: str | os.PathLike) -> None:
    """The run's vocab.txt is the one its checkpoint (``meta``) was trained with: the softmax's
    rows are its words, in its order (a copy from another run may have replaced it since)."""
    saved = meta.get("vocab_sha256")  # checkpoints of every format record it
    if saved is not None and saved != vocab_hash(vocab):
        raise CheckpointError(
            f"{vocab.source}: not the vocabulary {run_dir} was trained with ({len(vocab)} words; its checkpoints "
            f"have {meta.get('vocab_size', 'another')}, or other words or another order): put the run's own "
            "vocab.txt back (an export of the run holds a copy)"
        )


def _export_hint(run_dir: str | os.PathLike) -> str:
    """What to do with a directory of exported files (``export_run``'s) given as a run dir."""
    weights: list[str] = []
    with contextlib.suppress(Exception):  # an unreachable directory: the error it is a hint for stays
        weights = sorted(p.name for p in epath.Path(run_dir).glob("*weights.hdf5") if "softmax" not in p.name)
    return f"; its {weights[0]} is an export's: read it with from_hdf5 (or --weights)" if weights else ""


def _restore(
    ckpt: Checkpointer, run_dir: str | os.PathLike, options: Options, step: int | None
) -> tuple[dict, int, dict]:
    """(shared state with the softmax in id order, step, meta) of ``step``, or of the newest readable one."""
    steps = ckpt.steps()
    if not steps:
        raise CheckpointError(f"{run_dir}: no checkpoint found{_export_hint(run_dir)}")
    abstract = lambda meta: (abstract_shared(options, meta), None)  # noqa: E731
    if step is None:
        restored = ckpt.restore_latest(abstract, with_host=False)
        if restored is None:
            raise CheckpointError(f"{run_dir}: no readable checkpoint")
        step, shared, _, _, meta = restored
    else:
        if step not in steps:
            raise CheckpointError(f"{run_dir}: no checkpoint at step {step}; have {steps}")
        why = None
        try:
            shared, _, _, meta = ckpt.restore(step, abstract, with_host=False)
            why = damaged_values({"state": shared})
        except Exception as e:  # noqa: BLE001 - Orbax's and tensorstore's errors, in one line
            why = ckpt.why_unreadable(step, e)
        if why is not None:  # raised out here, without Orbax's exception as its context (see orbax_log)
            raise CheckpointError(f"{run_dir}: checkpoint {step} is unreadable ({why})")
    return softmax_in_id_order(jax.device_get(shared), saved_layout(meta)), int(step), meta


def load_run(
    run_dir: str | os.PathLike, step: int | None = None, *, check_vocab: bool = True
) -> tuple[Options, Vocabulary, dict, int]:
    """(options, vocab, params, step): params ``{"bilm", "softmax": {"w" [V, P], "b" [V]}}`` in id
    order (``check_vocab`` as ``read_run``'s)."""
    options, vocab, shared, step = read_run(run_dir, step, check_vocab=check_vocab)
    return options, vocab, shared["params"], step


def write_vocab_file(path: str | os.PathLike, vocab: Vocabulary) -> None:
    write_text_atomic(path, "\n".join(vocab.words) + "\n")


def released_stem(model) -> str:
    """AllenNLP's name for a biLM shape, e.g. ``2x4096_512_2048cnn_2xhighway`` for ``original``."""
    c, l = model.char_cnn, model.lstm
    return f"{l.n_layers}x{l.dim}_{l.projection_dim}_{c.n_filters}cnn_{c.n_highway}xhighway"


LAYOUTS = ("elmo_jax", "released")


def export_names(model, layout: str = "elmo_jax") -> list[str]:
    """The four files' names: options, weights, softmax, vocabulary. ``"released"``: AllenNLP's
    (``elmo_<stem>_options.json``, ``elmo_<stem>_weights.hdf5``, ``elmo_<stem>_softmax_weights.hdf5``,
    ``vocab-<stem>.txt``), which AllenNLP and bilm-tf users load as they load the released models."""
    if layout == "elmo_jax":
        return ["options.json", "weights.hdf5", "softmax.hdf5", "vocab.txt"]
    if layout != "released":
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    stem = released_stem(model)
    return [
        f"elmo_{stem}_options.json",
        f"elmo_{stem}_weights.hdf5",
        f"elmo_{stem}_softmax_weights.hdf5",
        f"vocab-{stem}.txt",
    ]


@dataclasses.dataclass(frozen=True)
class ExportResult:
    """What ``export_run`` wrote: ``paths`` (options, weights, softmax, vocabulary) and the
    checkpoint ``step`` they hold: the newest readable one when none was asked for (a damaged
    newer one is passed over with a warning)."""

    paths: list[str]
    step: int


def export_run(
    run_dir: str | os.PathLike, out_dir: str | os.PathLike, step: int | None = None, layout: str = "elmo_jax"
) -> ExportResult:
    """A run's checkpoint -> bilm-tf files: options (with the training keys), weights (AllenNLP's
    layout), softmax (``softmax/W`` [V, P], ``softmax/b`` [V]) and vocabulary, named as
    ``export_names(layout)`` says. Each file is written atomically. Either dir may be ``gs://``.
    A full disk stops it with ``disk_full.OutOfSpaceError`` naming the file: the files before it are
    complete, and none is left half-written under its name."""
    if layout not in LAYOUTS:  # before the checkpoint is read and out_dir made
        raise about(ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}"), "layout")
    check_dir_to_make(out_dir)
    options, vocab, params, step = load_run(run_dir, step)
    paths = [os.path.join(out_dir, n) for n in export_names(options.model, layout)]
    epath.Path(out_dir).mkdir(parents=True, exist_ok=True)
    save_hdf5(options, params["bilm"], paths[0], paths[1])
    with disk_full.reported(paths[2]), atomic_path(paths[2]) as tmp:
        with h5py.File(tmp, "w") as f:
            f["softmax/W"] = np.asarray(params["softmax"]["w"], np.float32)
            f["softmax/b"] = np.asarray(params["softmax"]["b"], np.float32)
    write_vocab_file(paths[3], vocab)
    return ExportResult(paths, step)
