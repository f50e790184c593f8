"""A run directory's weights in id order: load, export to bilm-tf files, start a fine-tuning run.

Checkpoints keep the softmax in ``RowLayout`` slot order (split by rows over the devices);
everything here works in vocabulary id order, ``[V, P]``, as bilm-tf's files do. Both checkpoint
formats are read (see ``checkpoint``).
"""

from __future__ import annotations

import os

import h5py
import jax
import numpy as np
from etils import epath

from elmo_jax import lstm, train
from elmo_jax.atomic import atomic_path, write_text_atomic
from elmo_jax.chars import Vocabulary
from elmo_jax.checkpoint import CheckpointError, Checkpointer
from elmo_jax.config import Options
from elmo_jax.sharded_softmax import RowLayout
from elmo_jax.weights import load_hdf5, save_hdf5


def abstract_shared(options: Options, meta: dict, sharding=None) -> dict:
    """Restore target of a checkpoint's ``state`` item, written in ``meta['format']``; every leaf
    on ``sharding`` (default: this process's first device)."""
    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    shared = jax.eval_shape(lambda: train.init_state(jax.random.PRNGKey(0), options.model, options.train, 1)).shared()
    if meta.get("format", 1) == 1:  # the softmax in id order, unpadded
        v = options.train.n_tokens_vocab
        for part in ("params", "opt"):
            shared[part]["softmax"] = {k: jax.ShapeDtypeStruct((v,) + x.shape[1:], x.dtype)
                                       for k, x in shared[part]["softmax"].items()}
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), shared)


def abstract_rows(model, global_rows: int, sharding=None) -> dict:
    """Restore target of a checkpoint's ``lstm`` item (``sharding`` a tree like the rows, or one
    sharding for all; default: this process's first device)."""
    rows = jax.eval_shape(lambda: lstm.zero_state(model, global_rows))
    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    if not isinstance(sharding, dict):
        sharding = {k: sharding for k in rows}
    return {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding[k]) for k, x in rows.items()}


def saved_layout(meta: dict) -> RowLayout | None:
    """The softmax layout a checkpoint was written in (None: format 1, id order)."""
    return RowLayout(**meta["softmax_layout"]) if meta.get("format", 1) >= 2 else None


def softmax_in_id_order(shared: dict, layout: RowLayout | None) -> dict:
    """``shared`` with its softmax weights and accumulators ``[V, ...]`` in id order (numpy), from
    ``layout``'s slot order (None: already in id order)."""
    convert = np.asarray if layout is None else layout.from_stored
    return {**shared, **{part: {**shared[part], "softmax": {k: convert(x) for k, x in shared[part]["softmax"].items()}}
                         for part in ("params", "opt")}}


def softmax_in_slot_order(shared: dict, layout: RowLayout) -> dict:
    """The inverse: id order -> slot order (padding: weights 0, accumulators 1, as at init)."""
    out = dict(shared)
    for part, fill in (("params", 0.0), ("opt", 1.0)):
        out[part] = {**shared[part], "softmax": {k: layout.to_stored(np.asarray(x), fill)
                                                 for k, x in shared[part]["softmax"].items()}}
    return out


def read_run(run_dir: str | os.PathLike, step: int | None = None) -> tuple[Options, Vocabulary, dict, int]:
    """(options, vocab, shared state with the softmax in id order, step) of a run directory's
    newest readable (or the given) checkpoint. ``run_dir`` may be a ``gs://`` path (etils.epath)."""
    options_path = os.path.join(run_dir, "options.json")
    if not epath.Path(options_path).is_file():
        raise CheckpointError(f"{run_dir}: not a run directory (no options.json)")
    options = Options.load(options_path)
    vocab = Vocabulary.load(os.path.join(run_dir, "vocab.txt"))
    ckpt = Checkpointer(run_dir, read_only=True)
    try:
        steps = ckpt.steps()
        if not steps:
            raise CheckpointError(f"{run_dir}: no checkpoint found")
        abstract = lambda meta: (abstract_shared(options, meta), None)  # noqa: E731
        if step is None:
            restored = ckpt.restore_latest(abstract, with_host=False)
            if restored is None:
                raise CheckpointError(f"{run_dir}: no readable checkpoint")
            step, shared, _, _, meta = restored
        else:
            if step not in steps:
                raise CheckpointError(f"{run_dir}: no checkpoint at step {step}; have {steps}")
            shared, _, _, meta = ckpt.restore(step, abstract, with_host=False)
    finally:
        ckpt.close()
    return options, vocab, softmax_in_id_order(jax.device_get(shared), saved_layout(meta)), int(step)


def load_run(run_dir: str | os.PathLike, step: int | None = None) -> tuple[Options, Vocabulary, dict, int]:
    """(options, vocab, params, step): params ``{"bilm", "softmax": {"w" [V, P], "b" [V]}}`` in id order."""
    options, vocab, shared, step = read_run(run_dir, step)
    return options, vocab, shared["params"], step


def write_vocab_file(path: str | os.PathLike, vocab: Vocabulary) -> None:
    write_text_atomic(path, "\n".join(vocab.words) + "\n")


def export_run(run_dir: str | os.PathLike, out_dir: str | os.PathLike, step: int | None = None) -> list[str]:
    """A run's checkpoint -> bilm-tf files: ``options.json`` (with the training keys),
    ``weights.hdf5`` (AllenNLP's layout), ``softmax.hdf5`` (``softmax/W`` [V, P], ``softmax/b`` [V])
    and ``vocab.txt``. Each file is written atomically. Either dir may be a ``gs://`` path."""
    options, vocab, params, step = load_run(run_dir, step)
    epath.Path(out_dir).mkdir(parents=True, exist_ok=True)
    paths = [os.path.join(out_dir, n) for n in ("options.json", "weights.hdf5", "softmax.hdf5", "vocab.txt")]
    save_hdf5(options, params["bilm"], paths[0], paths[1])
    with atomic_path(paths[2]) as tmp:
        with h5py.File(tmp, "w") as f:
            f["softmax/W"] = np.asarray(params["softmax"]["w"], np.float32)
            f["softmax/b"] = np.asarray(params["softmax"]["b"], np.float32)
    write_vocab_file(paths[3], vocab)
    return paths


def finetune_state(source: str, options: Options, vocab: Vocabulary, seed: int = 0) -> dict:
    """A fresh shared state (no LSTM rows; numpy, softmax in id order) for ``options``/``vocab``
    that starts from another model: ``pretrain(..., init_state=...)`` trains from it.

    ``source`` is a run directory (params and Adagrad accumulators carry over) or a directory of
    bilm-tf files (``options.json``, ``weights.hdf5``, optionally ``softmax.hdf5`` + ``vocab.txt``;
    accumulators start at 1.0). Softmax rows (and accumulators) of the words both vocabularies share
    are copied by word; the other rows are initialised as in a fresh run. The step restarts at 0.
    """
    layout = RowLayout.for_vocab(options.train.n_tokens_vocab)
    fresh = softmax_in_id_order(jax.device_get(train.init_state(jax.random.PRNGKey(seed), options.model,
                                                                options.train, 1).shared()), layout)
    if epath.Path(source, "checkpoints").is_dir():  # a run dir, possibly gs://
        old_options, old_vocab, old, _ = read_run(source)
        bilm_params, dense_opt = old["params"]["bilm"], old["opt"]["bilm"]
        softmax, acc = old["params"]["softmax"], old["opt"]["softmax"]
        old_model = old_options.model
    else:
        old_model, bilm_params = load_hdf5(os.path.join(source, "options.json"), os.path.join(source, "weights.hdf5"))
        dense_opt = fresh["opt"]["bilm"]
        softmax = acc = old_vocab = None
        if os.path.isfile(os.path.join(source, "softmax.hdf5")):
            with h5py.File(os.path.join(source, "softmax.hdf5"), "r") as f:
                softmax = {"w": f["softmax/W"][...], "b": f["softmax/b"][...]}
            old_vocab = Vocabulary.load(os.path.join(source, "vocab.txt"))
    if old_model != options.model:
        raise CheckpointError(f"{source}: its model differs from the options given; fine-tuning keeps the "
                              f"biLM shape (saved {old_model}, now {options.model})")
    state = dict(fresh)
    state["params"] = {"bilm": bilm_params, "softmax": dict(fresh["params"]["softmax"])}
    state["opt"] = {"bilm": dense_opt, "softmax": dict(fresh["opt"]["softmax"])}
    if softmax is not None:
        shared = [(i, old_vocab.word_to_id(w)) for i, w in enumerate(vocab.words) if w in old_vocab]
        if shared:
            new_ids, old_ids = (np.array(x) for x in zip(*shared))
            for name in ("w", "b"):
                state["params"]["softmax"][name] = np.array(state["params"]["softmax"][name])
                state["params"]["softmax"][name][new_ids] = np.asarray(softmax[name])[old_ids]
                if acc is not None:
                    state["opt"]["softmax"][name] = np.array(state["opt"]["softmax"][name])
                    state["opt"]["softmax"][name][new_ids] = np.asarray(acc[name])[old_ids]
    return state
