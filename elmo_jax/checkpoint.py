"""Checkpoints of a training run: Orbax for the replicated state, a small per-process file for the rest.

A run directory holds::

    checkpoints/<step>/          Orbax: params, optimizer state, step, RNG, and JSON metadata
                                 (the options, the vocabulary's hash and size, global rows)
    host_state/<step>.p<i>.npz   per process: its rows' LSTM state and its data position
    options.json, vocab.txt      what the run was started with
    metrics.jsonl                one JSON line per logged step

Orbax commits a step by renaming a finished temporary directory, so a crash mid-save leaves
nothing that looks like a checkpoint; a step whose files are damaged anyway is skipped with a
warning and the previous one is used. The host file is written (temp + rename) before the Orbax
save starts, and is only read for steps Orbax has committed.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from typing import Any

import h5py
import jax
import numpy as np
import orbax.checkpoint as ocp

from elmo_jax import train
from elmo_jax.chars import Vocabulary
from elmo_jax.config import Options
from elmo_jax.weights import load_hdf5, save_hdf5


class CheckpointError(ValueError):
    """A run directory cannot be resumed as asked."""


def vocab_hash(vocab: Vocabulary) -> str:
    return hashlib.sha256("\n".join(vocab.words).encode("utf-8")).hexdigest()


def unreplicate_state(state: dict) -> tuple[dict, np.ndarray]:
    """pmapped state ``[D, ...]`` -> (device-independent state, LSTM state by global row).

    The LSTM state differs per device (each holds its own rows): ``{"c": [D, 2, L, B, dim]}``
    becomes ``[2, L, D*B, dim]``, ordered by global row.
    """
    shared = jax.device_get({k: jax.tree_util.tree_map(lambda x: x[0], v) for k, v in state.items() if k != "lstm"})
    lstm = {k: np.asarray(jax.device_get(v)) for k, v in state["lstm"].items()}
    rows = {k: v.transpose(1, 2, 0, 3, 4).reshape(v.shape[1], v.shape[2], -1, v.shape[-1]) for k, v in lstm.items()}
    return shared, rows


def replicate_state(shared: dict, lstm_rows: dict, n_devices: int) -> dict:
    """The inverse of ``unreplicate_state`` for ``n_devices`` local devices, as host arrays with a
    leading device axis: the first pmapped call shards them (no per-device copies made here)."""
    rep = jax.tree_util.tree_map(lambda x: np.broadcast_to(np.asarray(x), (n_devices,) + np.shape(x)), shared)
    lstm = {}
    for k, v in lstm_rows.items():
        two, layers, rows, dim = v.shape
        lstm[k] = v.reshape(two, layers, n_devices, rows // n_devices, dim).transpose(2, 0, 1, 3, 4)
    return {**rep, "lstm": lstm}


def _flatten(tree: dict, prefix: str = "") -> dict[str, np.ndarray]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}/"))
        elif isinstance(v, np.ndarray) and v.dtype == object:
            # Token strings hold no whitespace: one newline-joined string is lossless.
            out[f"{prefix}{k}#words"] = np.array("\n".join(str(w) for w in v))
        else:
            out[f"{prefix}{k}"] = np.asarray(v)
    return out


def _unflatten(flat: dict[str, np.ndarray]) -> dict:
    out: dict[str, Any] = {}
    for key, v in flat.items():
        *parents, leaf = key.split("/")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        if leaf.endswith("#words"):
            text = str(v)
            node[leaf[:-6]] = np.array(text.split("\n") if text else [], dtype=object)
        else:
            node[leaf] = v
    return out


class Checkpointer:
    """Saves every ``save_every`` steps (and on demand), keeps the last ``keep``, async by default."""

    def __init__(self, run_dir: str, keep: int = 3, async_save: bool = True):
        self.run_dir = os.path.abspath(run_dir)
        self.host_dir = os.path.join(self.run_dir, "host_state")
        os.makedirs(self.host_dir, exist_ok=True)
        self.manager = ocp.CheckpointManager(
            os.path.join(self.run_dir, "checkpoints"),
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                                 cleanup_tmp_directories=True, create=True))

    def _host_path(self, step: int, process: int) -> str:
        return os.path.join(self.host_dir, f"{step}.p{process}.npz")

    def save(self, step: int, shared: dict, host: dict, meta: dict) -> None:
        process = jax.process_index()
        path = self._host_path(step, process)
        tmp = f"{path}.tmp-{os.getpid()}.npz"
        np.savez(tmp, **_flatten(host))
        os.replace(tmp, path)
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(shared),
                                                        meta=ocp.args.JsonSave(meta)), force=True)
        self._prune_host_files()

    def _prune_host_files(self) -> None:
        keep = set(self.manager.all_steps())
        for name in os.listdir(self.host_dir):
            step = name.split(".", 1)[0]
            if step.isdigit() and int(step) not in keep and int(step) < max(keep, default=0):
                try:
                    os.remove(os.path.join(self.host_dir, name))
                except FileNotFoundError:
                    pass

    def latest_meta(self) -> dict | None:
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
            except Exception as e:  # noqa: BLE001 - any damage means "try the previous one"
                warnings.warn(f"{self.run_dir}: checkpoint {step} metadata unreadable ({type(e).__name__}); trying older")
        return None

    def restore_latest(self, abstract_shared: dict, with_host: bool = True
                       ) -> tuple[int, dict, dict | None, dict] | None:
        """(step, shared state, host state, meta) of the newest readable checkpoint, or None.

        ``with_host=False`` skips this process's host file (a run resumed on another layout of
        processes and devices has none that fits); the host state is then None.
        """
        for step in sorted(self.manager.all_steps(), reverse=True):
            path = self._host_path(step, jax.process_index())
            try:
                restored = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_shared), meta=ocp.args.JsonRestore()))
                host = None
                if with_host:
                    with np.load(path, allow_pickle=False) as f:
                        host = _unflatten({k: f[k] for k in f.files})
            except Exception as e:  # noqa: BLE001 - a damaged step falls back to the previous one
                warnings.warn(f"{self.run_dir}: checkpoint {step} is unreadable "
                              f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); "
                              f"falling back to an older one")
                continue
            return step, restored["state"], host, restored["meta"]
        return None

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def load_run(run_dir: str, step: int | None = None) -> tuple[Options, Vocabulary, dict, int]:
    """(options, vocab, unreplicated params, step) of a run directory's newest (or given) checkpoint."""
    options_path = os.path.join(run_dir, "options.json")
    if not os.path.isfile(options_path):
        raise CheckpointError(f"{run_dir}: not a run directory (no options.json)")
    options = Options.load(options_path)
    vocab = Vocabulary.load(os.path.join(run_dir, "vocab.txt"))
    ckpt = Checkpointer(run_dir, async_save=False)
    fresh = jax.eval_shape(lambda: train.init_state(jax.random.PRNGKey(0), options.model, options.train))
    abstract = {k: v for k, v in fresh.items() if k != "lstm"}
    steps = sorted(ckpt.manager.all_steps())
    if not steps:
        raise CheckpointError(f"{run_dir}: no checkpoint found")
    if step is not None and step not in steps:
        raise CheckpointError(f"{run_dir}: no checkpoint at step {step}; have {steps}")
    if step is None:
        restored = ckpt.restore_latest(abstract)
        if restored is None:
            raise CheckpointError(f"{run_dir}: no readable checkpoint")
        step, shared = restored[0], restored[1]
    else:
        shared = ckpt.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
    ckpt.close()
    return options, vocab, shared["params"], int(step)


def export_run(run_dir: str, out_dir: str, step: int | None = None) -> list[str]:
    """A run's checkpoint -> bilm-tf files: ``options.json`` (with the training keys),
    ``weights.hdf5`` (AllenNLP's layout), ``softmax.hdf5`` (``softmax/W`` [V, P], ``softmax/b`` [V])
    and ``vocab.txt``. Each file is written atomically."""
    options, vocab, params, step = load_run(run_dir, step)
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, n) for n in ("options.json", "weights.hdf5", "softmax.hdf5", "vocab.txt")]
    save_hdf5(options, params["bilm"], paths[0], paths[1])
    tmp = f"{paths[2]}.tmp-{os.getpid()}"
    with h5py.File(tmp, "w") as f:
        f["softmax/W"] = np.asarray(params["softmax"]["w"], np.float32)
        f["softmax/b"] = np.asarray(params["softmax"]["b"], np.float32)
    os.replace(tmp, paths[2])
    tmp = f"{paths[3]}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("\n".join(vocab.words) + "\n")
    os.replace(tmp, paths[3])
    return paths


def finetune_state(source: str, options: Options, vocab: Vocabulary, seed: int = 0) -> dict:
    """A fresh train state for ``options``/``vocab`` that starts from another model.

    ``source`` is a run directory (params and Adagrad accumulators carry over) or a directory of
    bilm-tf files (``options.json``, ``weights.hdf5``, optionally ``softmax.hdf5`` + ``vocab.txt``;
    accumulators start at 1.0). Softmax rows (and accumulators) of the words both vocabularies share
    are copied by word; the other rows are initialised as in a fresh run. The step restarts at 0.
    """
    fresh = jax.device_get(train.init_state(jax.random.PRNGKey(seed), options.model, options.train))
    if os.path.isdir(os.path.join(source, "checkpoints")):
        old_options, old_vocab, _, step = load_run(source)
        ckpt = Checkpointer(source, async_save=False)
        abstract = {k: v for k, v in jax.eval_shape(lambda: train.init_state(
            jax.random.PRNGKey(0), old_options.model, old_options.train)).items() if k != "lstm"}
        old = ckpt.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
        ckpt.close()
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
