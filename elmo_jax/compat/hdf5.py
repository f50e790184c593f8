"""bilm-tf / AllenNLP weight files: ``options.json`` + ``weights.hdf5``.

The layout written is the one AllenNLP reads and bilm-tf's ``dump_weights`` writes: a 261-row
``char_embed`` (no padding row), ``CNN_proj`` always present, LSTM ``W_0``/``B``/``W_P_0`` per
direction and layer, float32 everywhere, no stored forget bias.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable

import h5py
import jax
import numpy as np

from elmo_jax._util import disk_full
from elmo_jax._util.arguments import about, check_path
from elmo_jax._util.atomic import atomic_path
from elmo_jax._util.paths import fault, said, same_path
from elmo_jax.config import ModelConfig, Options
from elmo_jax.model.bilm import check_params


class WeightsError(ValueError):
    """A weight file does not hold what its options describe, or cannot be written where asked."""


def _lstm_cells(direction: int) -> str:
    return f"RNN_{direction}/RNN/MultiRNNCell/Cell"


def _lstm_prefix(direction: int, layer: int) -> str:
    return f"{_lstm_cells(direction)}{layer}/LSTMCell"


def expected_datasets(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Dataset name -> shape of a bilm-tf weight file for ``config`` (``char_embed``: 261 rows)."""
    c, l = config.char_cnn, config.lstm
    f, p, d = c.n_filters, l.projection_dim, l.dim
    shapes: dict[str, tuple[int, ...]] = {"char_embed": (261, c.embedding_dim)}
    for i, (w, n) in enumerate(c.filters):
        shapes[f"CNN/W_cnn_{i}"] = (1, w, c.embedding_dim, n)
        shapes[f"CNN/b_cnn_{i}"] = (n,)
    for k in range(c.n_highway):
        for name, shape in (("W_carry", (f, f)), ("W_transform", (f, f)), ("b_carry", (f,)), ("b_transform", (f,))):
            shapes[f"CNN_high_{k}/{name}"] = shape
    shapes["CNN_proj/W_proj"] = (f, p)
    shapes["CNN_proj/b_proj"] = (p,)
    for direction in range(2):
        for layer in range(l.n_layers):
            pre = _lstm_prefix(direction, layer)
            shapes[f"{pre}/W_0"] = (p + p, 4 * d)
            shapes[f"{pre}/B"] = (4 * d,)
            shapes[f"{pre}/W_P_0"] = (d, p)
    return shapes


def _read(f: h5py.File, path: str, name: str, shape: tuple[int, ...], hint: str) -> np.ndarray:
    if name not in f:
        raise WeightsError(f"{path}: missing dataset '{name}' (expected shape {shape} float32){hint}")
    ds = f[name]
    if not isinstance(ds, h5py.Dataset):
        raise WeightsError(f"{path}: '{name}' is a group, expected a dataset of shape {shape} float32")
    if ds.shape != shape:
        raise WeightsError(f"{path}: dataset '{name}' has shape {ds.shape}, expected {shape}{hint}")
    if ds.dtype != np.float32:
        raise WeightsError(f"{path}: dataset '{name}' has dtype {ds.dtype}, expected float32")
    return np.asarray(ds[...])


def open_hdf5(path: str, what: str = "weight file") -> h5py.File:
    """``h5py.File(path, "r")``, its failures as one line naming ``path``: a ``WeightsError``
    (missing, a directory, not HDF5), or a ``PermissionError`` for a file this user may not read."""
    try:
        return h5py.File(path, "r")
    except FileNotFoundError:
        raise WeightsError(f"{path}: {what} not found") from None
    except OSError as e:
        if bad := fault(path, "file"):  # a directory, or a path under a file: h5py's words run to lines
            raise WeightsError(said(*bad, path)) from None
        if isinstance(e, PermissionError):  # not this user's: not a question of the file's format
            raise PermissionError(e.errno, os.strerror(e.errno or errno.EACCES), path) from None
        raise WeightsError(f"{path}: not a readable HDF5 file ({str(e).splitlines()[0]})") from None


def _check_depth(f: h5py.File, path: str, stem: str, what: str, option: str, wanted: int, hint: str) -> None:
    """A ``WeightsError`` when the file's groups ``stem0``, ``stem1``, ... are more or fewer than
    ``wanted``, saying how many it has: the options' count is then wrong, not one dataset (a file
    with none is left to the datasets' own checks, which name the first one missing)."""
    n = 0
    while f"{stem}{n}" in f:
        n += 1
    if n and n != wanted:
        found = f"{n} {what}s ({stem}0..{stem.rsplit('/', 1)[-1]}{n - 1})" if n > 1 else f"1 {what} ({stem}0)"
        raise WeightsError(f"{path}: has {found} but the options say {option} {wanted}{hint}")


def load_hdf5(options_path: str | os.PathLike, weights_path: str | os.PathLike) -> tuple[ModelConfig, dict]:
    """Reads a bilm-tf/AllenNLP model. Returns ``(config, params)`` with numpy leaves: on the host,
    so that a conversion or an export never touches a device. To call ``bilm_apply`` more than
    once, ``jax.device_put(params)`` first; numpy leaves are copied to the device at every call.

    ``char_embed`` may have 261 rows (bilm-tf's file; a zero padding row is put in front) or 262.
    A missing ``CNN_proj`` is read as the identity when bilm-tf would have had none
    (``n_filters == projection_dim``).
    """
    for name, value in (("options_path", options_path), ("weights_path", weights_path)):
        check_path(value, name, "a path: load_hdf5(options_path, weights_path)")
    config = Options.load(options_path).model
    path = os.fspath(weights_path)
    hint = f" (per the options in {os.fspath(options_path)})"
    shapes = expected_datasets(config)
    c, l = config.char_cnn, config.lstm
    with open_hdf5(path) as f:
        _check_depth(f, path, "CNN_high_", "highway layer", "n_highway", c.n_highway, hint)
        _check_depth(f, path, _lstm_cells(0), "LSTM layer", "n_layers", l.n_layers, hint)

        def get(name: str) -> np.ndarray | None:
            embed = f.get("char_embed") if name == "char_embed" else None
            if isinstance(embed, h5py.Dataset) and embed.shape == (262, c.embedding_dim):
                return _read(f, path, name, (262, c.embedding_dim), hint)
            if name.startswith("CNN_proj/") and "CNN_proj" not in f and c.n_filters == l.projection_dim:
                return None
            return _read(f, path, name, shapes[name], hint)

        params = params_from_datasets(config, get)
    # Inference always uses the shifted ids; the file's options only say how it was trained.
    return config.with_shifted_chars(), params


def params_from_datasets(config: ModelConfig, get: Callable[[str], np.ndarray | None], pad: float = 0.0) -> dict:
    """bilm-tf's tensors by hdf5 name (``get``; ``expected_datasets`` gives the names and shapes)
    -> the params tree, for weight files and TF checkpoints alike. ``pad``: the padding row of
    ``char_embed`` (0 for weights, Adagrad's 1.0 for its slots), put in front of a 261-row one;
    ``get`` returns None for a ``CNN_proj`` bilm-tf did not build (n_filters == projection_dim),
    read as the identity for weights and ``pad`` for slots."""

    c, l = config.char_cnn, config.lstm

    def need(name: str) -> np.ndarray:  # every dataset but CNN_proj's: the callers checked them
        x = get(name)
        assert x is not None, name
        return x

    char_embed = np.asarray(need("char_embed"), np.float32)
    if char_embed.shape[0] == 261:
        char_embed = np.concatenate([np.full((1, c.embedding_dim), pad, np.float32), char_embed])
    else:
        char_embed = char_embed.copy()
        char_embed[0] = pad
    conv = [
        {"w": np.array(need(f"CNN/W_cnn_{i}")[0]), "b": np.array(need(f"CNN/b_cnn_{i}"))} for i in range(len(c.filters))
    ]
    highway = []
    for k in range(c.n_highway):
        r = {n: need(f"CNN_high_{k}/{n}") for n in ("W_carry", "W_transform", "b_carry", "b_transform")}
        highway.append(
            {
                "w": np.concatenate([r["W_carry"], r["W_transform"]], axis=1),
                "b": np.concatenate([r["b_carry"], r["b_transform"]]),
            }
        )
    w_proj = get("CNN_proj/W_proj")
    if w_proj is None:
        eye = np.eye(c.n_filters, dtype=np.float32)
        proj = {"w": eye if pad == 0 else np.full_like(eye, pad), "b": np.full(l.projection_dim, pad, np.float32)}
    else:
        proj = {"w": np.array(w_proj), "b": np.array(need("CNN_proj/b_proj"))}
    layers = []
    p = l.projection_dim
    for layer in range(l.n_layers):
        w0 = np.stack([need(f"{_lstm_prefix(d, layer)}/W_0") for d in range(2)])
        layers.append(
            {
                "w_x": w0[:, :p],
                "w_h": w0[:, p:],
                "b": np.stack([need(f"{_lstm_prefix(d, layer)}/B") for d in range(2)]),
                "w_proj": np.stack([need(f"{_lstm_prefix(d, layer)}/W_P_0") for d in range(2)]),
            }
        )
    return {"char_cnn": {"char_embed": char_embed, "conv": conv, "highway": highway, "proj": proj}, "lstm": layers}


def to_datasets(config: ModelConfig, params: dict) -> dict[str, np.ndarray]:
    """Params -> bilm-tf dataset name -> float32 array (the layout ``expected_datasets`` gives)."""
    c = config.char_cnn
    params = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), params)
    cp = params["char_cnn"]
    f = c.n_filters
    out = {"char_embed": cp["char_embed"][-261:]}
    for i, layer in enumerate(cp["conv"]):
        out[f"CNN/W_cnn_{i}"] = layer["w"][None]
        out[f"CNN/b_cnn_{i}"] = layer["b"]
    for k, layer in enumerate(cp["highway"]):
        out[f"CNN_high_{k}/W_carry"], out[f"CNN_high_{k}/W_transform"] = layer["w"][:, :f], layer["w"][:, f:]
        out[f"CNN_high_{k}/b_carry"], out[f"CNN_high_{k}/b_transform"] = layer["b"][:f], layer["b"][f:]
    out["CNN_proj/W_proj"], out["CNN_proj/b_proj"] = cp["proj"]["w"], cp["proj"]["b"]
    for layer, lp in enumerate(params["lstm"]):
        for direction in range(2):
            pre = _lstm_prefix(direction, layer)
            out[f"{pre}/W_0"] = np.concatenate([lp["w_x"][direction], lp["w_h"][direction]])
            out[f"{pre}/B"] = lp["b"][direction]
            out[f"{pre}/W_P_0"] = lp["w_proj"][direction]
    expected = expected_datasets(config)
    if set(out) != set(expected):
        raise WeightsError(
            f"params do not fit the config: missing {sorted(set(expected) - set(out))}, "
            f"unexpected {sorted(set(out) - set(expected))}"
        )
    for name, arr in out.items():
        if arr.shape != expected[name]:
            raise WeightsError(
                f"params do not fit the config: '{name}' has shape {arr.shape}, expected {expected[name]}"
            )
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def _check_not_swapped(options_path: str, weights_path: str) -> None:
    """Refuses the two output paths given in each other's places: each file would be written under
    the other's name, and a later ``load_hdf5`` of the right names would fail."""
    hdf5 = (".hdf5", ".h5")
    if options_path.lower().endswith(hdf5) or weights_path.lower().endswith(".json"):
        raise about(
            ValueError(
                f"options_path is {options_path} and weights_path is {weights_path}: swapped? "
                "save_hdf5(config, params, options_path, weights_path) takes the options.json's path first"
            ),
            "options_path",
            "weights_path",
        )


def save_hdf5(
    config: ModelConfig | Options, params: dict, options_path: str | os.PathLike, weights_path: str | os.PathLike
) -> None:
    """Writes ``options.json`` (``n_characters: 262``) and the weight file, each atomically (a full
    disk: ``disk_full.OutOfSpaceError`` naming the file). Both paths are checked before either file
    is written: a pair already there is never left half replaced by a path that cannot be written."""
    check_params(params, config.model if isinstance(config, Options) else config)
    for name, value in (("options_path", options_path), ("weights_path", weights_path)):
        check_path(value, name, "a path: save_hdf5(config, params, options_path, weights_path)")
        if bad := fault(value, "output"):
            raise about(WeightsError(f"{name} {said(*bad, os.fspath(value))}"), name)
    if same_path(os.fspath(options_path), os.fspath(weights_path)):  # the options would overwrite the weights
        raise about(
            ValueError(
                f"options_path and weights_path are both {os.fspath(weights_path)}; give each file its own path"
            ),
            "weights_path",
        )
    _check_not_swapped(os.fspath(options_path), os.fspath(weights_path))
    options = config if isinstance(config, Options) else Options(model=config)
    datasets = to_datasets(options.model, params)
    with disk_full.reported(weights_path), atomic_path(weights_path) as tmp, h5py.File(tmp, "w") as f:
        for name, arr in datasets.items():
            f.create_dataset(name, data=arr)
    with disk_full.reported(options_path):
        options.save(options_path, n_characters=262)
