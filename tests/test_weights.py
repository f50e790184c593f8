import json
import os
import shutil

import h5py
import jax
import numpy as np
import pytest
from helpers import FIXTURES, model_files

from elmo_jax import batch_to_ids, bilm_apply, init_bilm, load_hdf5, preset, save_hdf5
from elmo_jax._util.arguments import arguments_of
from elmo_jax.compat.hdf5 import WeightsError, expected_datasets
from elmo_jax.config import ConfigError, Options

AL_WEIGHTS = FIXTURES / "allennlp_elmo/lm_weights.hdf5"
AL_OPTIONS = FIXTURES / "allennlp_elmo/options.json"


def layout(path):
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(
            lambda name, obj: out.__setitem__(name, (obj.shape, obj.dtype)) if isinstance(obj, h5py.Dataset) else None
        )
    return out


def test_written_file_has_the_reference_layout_and_values_round_trip(tmp_path):
    config, params = load_hdf5(AL_OPTIONS, AL_WEIGHTS)
    save_hdf5(config, params, tmp_path / "options.json", tmp_path / "weights.hdf5")
    assert layout(tmp_path / "weights.hdf5") == layout(AL_WEIGHTS)
    with h5py.File(AL_WEIGHTS, "r") as a, h5py.File(tmp_path / "weights.hdf5", "r") as b:
        for name in layout(AL_WEIGHTS):
            np.testing.assert_array_equal(a[name][...], b[name][...])
    written = json.loads((tmp_path / "options.json").read_text())
    assert written["char_cnn"]["n_characters"] == 262
    assert Options.load(tmp_path / "options.json").model == config
    assert sorted(os.listdir(tmp_path)) == ["options.json", "weights.hdf5"]  # no temporary file left


def test_bilm_tf_fixture_layout_is_what_we_expect():
    config, _ = load_hdf5(*model_files("bilm_tf"))
    assert {k: v[0] for k, v in layout(FIXTURES / "bilm_tf_model/lm_weights.hdf5").items()} == expected_datasets(config)


def test_random_model_saved_and_reloaded_gives_identical_outputs(tmp_path):
    config = preset("tiny")
    params = init_bilm(jax.random.PRNGKey(3), config)
    save_hdf5(config, params, tmp_path / "o.json", tmp_path / "w.hdf5")
    config2, params2 = load_hdf5(tmp_path / "o.json", tmp_path / "w.hdf5")
    assert config2 == config
    ids = batch_to_ids([["Round", "trip", "!"], ["ok"]])
    a, _, _ = bilm_apply(params, config, ids)
    b, _, _ = bilm_apply(params2, config2, ids)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_262_row_char_embed_and_261_options_are_read(tmp_path):
    shutil.copy(AL_WEIGHTS, tmp_path / "w.hdf5")
    with h5py.File(tmp_path / "w.hdf5", "a") as f:
        e = f["char_embed"][...]
        del f["char_embed"]
        f["char_embed"] = np.concatenate([np.zeros((1, 4), np.float32), e])
    opts = json.loads(AL_OPTIONS.read_text())
    opts["char_cnn"]["n_characters"] = 261
    (tmp_path / "o.json").write_text(json.dumps(opts))
    config, params = load_hdf5(tmp_path / "o.json", tmp_path / "w.hdf5")
    ref_config, ref = load_hdf5(AL_OPTIONS, AL_WEIGHTS)
    assert config == ref_config and config.char_cnn.n_characters == 262
    np.testing.assert_array_equal(params["char_cnn"]["char_embed"], ref["char_cnn"]["char_embed"])


def test_missing_projection_is_identity_when_bilm_tf_had_none(tmp_path):
    opts = json.loads(AL_OPTIONS.read_text())
    opts["lstm"]["projection_dim"] = 124  # == n_filters: bilm-tf builds no CNN_proj
    opts["lstm"]["dim"] = 8
    config = Options.from_dict(opts).model
    shapes = expected_datasets(config)
    rng = np.random.default_rng(0)
    with h5py.File(tmp_path / "w.hdf5", "w") as f:
        for name, shape in shapes.items():
            if not name.startswith("CNN_proj"):
                f[name] = rng.normal(size=shape).astype(np.float32)
    (tmp_path / "o.json").write_text(json.dumps(opts))
    _, params = load_hdf5(tmp_path / "o.json", tmp_path / "w.hdf5")
    np.testing.assert_array_equal(params["char_cnn"]["proj"]["w"], np.eye(124, dtype=np.float32))


def _copy_and_edit(tmp_path, edit):
    w = tmp_path / "w.hdf5"
    shutil.copy(AL_WEIGHTS, w)
    with h5py.File(w, "a") as f:
        edit(f)
    return w


@pytest.mark.parametrize(
    "edit,message",
    [
        (
            lambda f: f.__delitem__("CNN/W_cnn_3"),
            "missing dataset 'CNN/W_cnn_3' (expected shape (1, 4, 4, 32) float32)",
        ),
        (
            lambda f: f.__delitem__("RNN_1/RNN/MultiRNNCell/Cell1/LSTMCell/B"),
            "missing dataset 'RNN_1/RNN/MultiRNNCell/Cell1/LSTMCell/B'",
        ),
        (
            lambda f: (
                f.__delitem__("CNN_proj/b_proj"),
                f.create_dataset("CNN_proj/b_proj", data=np.zeros(17, np.float32)),
            ),
            "dataset 'CNN_proj/b_proj' has shape (17,), expected (16,)",
        ),
        (
            lambda f: (f.__delitem__("CNN/b_cnn_0"), f.create_dataset("CNN/b_cnn_0", data=np.zeros(4, np.float64))),
            "dataset 'CNN/b_cnn_0' has dtype float64, expected float32",
        ),
        # A group where a dataset belongs (char_embed's 262-row check read its shape first: an
        # AttributeError).
        (
            lambda f: (f.__delitem__("char_embed"), f.create_group("char_embed")),
            "'char_embed' is a group, expected a dataset of shape (261, 4) float32",
        ),
        (
            lambda f: (f.__delitem__("CNN/b_cnn_0"), f.create_group("CNN/b_cnn_0")),
            "'CNN/b_cnn_0' is a group, expected a dataset of shape (4,) float32",
        ),
        # The counts of layers, more and fewer than the options say (before: the name of the first
        # one too many alone, and for one too few the first dataset missing).
        (
            lambda f: f.copy("CNN_high_1", "CNN_high_2"),
            "has 3 highway layers (CNN_high_0..CNN_high_2) but the options say n_highway 2 (per the options in",
        ),
        (
            lambda f: f.__delitem__("CNN_high_1"),
            "has 1 highway layer (CNN_high_0) but the options say n_highway 2 (per the options in",
        ),
        (
            lambda f: f.copy("RNN_0/RNN/MultiRNNCell/Cell1", "RNN_0/RNN/MultiRNNCell/Cell2"),
            "has 3 LSTM layers (RNN_0/RNN/MultiRNNCell/Cell0..Cell2) but the options say n_layers 2",
        ),
        (
            lambda f: f.__delitem__("RNN_0/RNN/MultiRNNCell/Cell1"),
            "has 1 LSTM layer (RNN_0/RNN/MultiRNNCell/Cell0) but the options say n_layers 2",
        ),
    ],
)
def test_bad_weight_files_name_the_dataset(tmp_path, edit, message):
    w = _copy_and_edit(tmp_path, edit)
    with pytest.raises(WeightsError) as e:
        load_hdf5(AL_OPTIONS, w)
    assert str(w) in str(e.value) and message in str(e.value) and "\n" not in str(e.value)


def test_options_that_disagree_with_the_weights(tmp_path):
    opts = json.loads(AL_OPTIONS.read_text())
    opts["lstm"]["dim"] = 128
    (tmp_path / "o.json").write_text(json.dumps(opts))
    with pytest.raises(
        WeightsError,
        match=r"dataset 'RNN_0/RNN/MultiRNNCell/Cell0/LSTMCell/W_0' has shape "
        r"\(32, 256\), expected \(32, 512\) \(per the options in .*o.json\)",
    ):
        load_hdf5(tmp_path / "o.json", AL_WEIGHTS)


def test_missing_or_non_hdf5_weight_files(tmp_path):
    with pytest.raises(WeightsError, match="weight file not found"):
        load_hdf5(AL_OPTIONS, tmp_path / "none.hdf5")
    (tmp_path / "junk.hdf5").write_text("not hdf5")
    with pytest.raises(WeightsError, match="junk.hdf5: not a readable HDF5 file"):
        load_hdf5(AL_OPTIONS, tmp_path / "junk.hdf5")
    with pytest.raises(ConfigError, match="options file not found"):
        load_hdf5(tmp_path / "none.json", AL_WEIGHTS)


def test_a_failed_save_keeps_the_previous_file(tmp_path, monkeypatch):
    config, params = load_hdf5(AL_OPTIONS, AL_WEIGHTS)
    save_hdf5(config, params, tmp_path / "o.json", tmp_path / "w.hdf5")
    before = (tmp_path / "w.hdf5").read_bytes()
    broken = jax.tree_util.tree_map(lambda x: x, params)
    broken["lstm"] = broken["lstm"][:1]  # params no longer fit the config
    with pytest.raises(WeightsError, match="params do not fit the config"):
        save_hdf5(config, broken, tmp_path / "o.json", tmp_path / "w.hdf5")
    assert (tmp_path / "w.hdf5").read_bytes() == before
    # A training state's params, or the two arguments swapped (before: a KeyError, an AttributeError).
    with pytest.raises(TypeError, match=r"got \['bilm', 'softmax'\]: a training state's params hold the biLM's"):
        save_hdf5(config, {"bilm": params, "softmax": {}}, tmp_path / "o.json", tmp_path / "w.hdf5")
    with pytest.raises(TypeError, match="^config is a dict; expected a ModelConfig$"):
        save_hdf5(params, config, tmp_path / "o.json", tmp_path / "w.hdf5")  # type: ignore[arg-type]
    # The two paths swapped: before, each file was written under the other's name.
    for o, w in [("w.hdf5", "o.json"), ("x.h5", "y"), ("x", "y.JSON")]:
        with pytest.raises(ValueError) as e:
            save_hdf5(config, params, tmp_path / o, tmp_path / w)
        assert str(e.value) == (
            f"options_path is {tmp_path / o} and weights_path is {tmp_path / w}: swapped? "
            "save_hdf5(config, params, options_path, weights_path) takes the options.json's path first"
        )
        assert arguments_of(e.value) == ("options_path", "weights_path")
    assert (tmp_path / "w.hdf5").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.json", "w.hdf5"]
    save_hdf5(config, params, tmp_path / "x.json", tmp_path / "y.weights")  # other names pass
    assert load_hdf5(tmp_path / "x.json", tmp_path / "y.weights")[0] == config.with_shifted_chars()
    # Swapped when read: the options reader says the file is HDF5, not only that it is not UTF-8.
    with pytest.raises(ConfigError) as e:
        load_hdf5(tmp_path / "w.hdf5", tmp_path / "o.json")
    assert str(e.value) == (
        f"{tmp_path / 'w.hdf5'}: not an options.json: not UTF-8 text (invalid start byte at byte 0); "
        "it is an HDF5 file: the weight file, given where the options go?"
    )
    for name in ("x.json", "y.weights"):
        (tmp_path / name).unlink()

    def fail(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(h5py.File, "create_dataset", fail)
    with pytest.raises(KeyboardInterrupt):
        save_hdf5(config, params, tmp_path / "o.json", tmp_path / "w.hdf5")
    assert (tmp_path / "w.hdf5").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.json", "w.hdf5"]


def test_a_path_that_cannot_be_written_is_refused_before_either_file_of_a_pair_is(tmp_path):
    """The weight file was written first and the options' path met afterwards: an options_path
    that is a directory left a new weights.hdf5 beside the old options.json (a pair that no longer
    loads) and ended in a bare IsADirectoryError; a missing directory read "'nodir' -> 'nodir/w.hdf5'"."""
    config, params = load_hdf5(AL_OPTIONS, AL_WEIGHTS)
    pair = tmp_path / "pair"
    pair.mkdir()
    save_hdf5(config, params, pair / "options.json", pair / "weights.hdf5")
    before = {p.name: p.read_bytes() for p in pair.iterdir()}
    other = jax.tree_util.tree_map(lambda x: x + 1, params)
    (pair / "sub").mkdir()
    cases = [
        ("options_path", pair / "sub", pair / "weights.hdf5", f"options_path {pair / 'sub'}: is a directory, not a file"),
        ("weights_path", pair / "options.json", pair / "sub", f"weights_path {pair / 'sub'}: is a directory, not a file"),
        ("options_path", tmp_path / "no" / "o.json", pair / "weights.hdf5", f"options_path {tmp_path / 'no' / 'o.json'}: {tmp_path / 'no'} does not exist"),
        ("weights_path", pair / "options.json", tmp_path / "no" / "w.hdf5", f"weights_path {tmp_path / 'no' / 'w.hdf5'}: {tmp_path / 'no'} does not exist"),
    ]  # fmt: skip
    for name, o, w, message in cases:
        with pytest.raises(WeightsError) as e:
            save_hdf5(config, other, o, w)
        assert (str(e.value), arguments_of(e.value)) == (message, (name,))
        assert {p.name: p.read_bytes() for p in pair.iterdir() if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pair"]
    for args, name in (((None, AL_WEIGHTS), "options_path"), ((AL_OPTIONS, None), "weights_path")):
        with pytest.raises(TypeError, match=rf"^{name} is a NoneType; expected a path: load_hdf5\(") as e:
            load_hdf5(*args)
        assert arguments_of(e.value) == (name,)
    save_hdf5(config, other, pair / "options.json", pair / "weights.hdf5")  # the control: both replaced
    read = load_hdf5(pair / "options.json", pair / "weights.hdf5")[1]
    np.testing.assert_array_equal(read["lstm"][0]["b"], other["lstm"][0]["b"])
