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
import json
import os
import warnings
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from elmo_jax.chars import Vocabulary


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
    """The inverse of ``unreplicate_state`` for ``n_devices`` local devices."""
    devices = jax.local_devices()[:n_devices]
    rep = jax.tree_util.tree_map(lambda x: np.broadcast_to(np.asarray(x), (n_devices,) + np.shape(x)), shared)
    lstm = {}
    for k, v in lstm_rows.items():
        two, layers, rows, dim = v.shape
        lstm[k] = v.reshape(two, layers, n_devices, rows // n_devices, dim).transpose(2, 0, 1, 3, 4)
    return _put_per_device({**rep, "lstm": lstm}, devices)


def _put_per_device(tree: dict, devices: list) -> dict:
    # pmap takes a [D, ...] array sharded over the devices along its first axis.
    sharding = jax.sharding.PmapSharding.default((len(devices),), sharded_dim=0, devices=devices)
    return jax.tree_util.tree_map(lambda x: jax.device_put(np.ascontiguousarray(x), sharding), tree)


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

    def restore_latest(self, abstract_shared: dict) -> tuple[int, dict, dict, dict] | None:
        """(step, shared state, host state, meta) of the newest readable checkpoint, or None."""
        for step in sorted(self.manager.all_steps(), reverse=True):
            path = self._host_path(step, jax.process_index())
            try:
                restored = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_shared), meta=ocp.args.JsonRestore()))
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


def write_json_atomic(path: str, obj: Any) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)
