"""Reading bilm-tf's TensorFlow checkpoints without TensorFlow (elmo_jax.compat.tf_checkpoint).

The checkpoints in fixtures/tf_checkpoint/ were written by TensorFlow itself
(fixtures/make_tf_checkpoint.py, which documents them); ``values.npz`` beside each holds what TF
saved. Damaged variants are made here from copies: truncated or missing data files, a flipped
data byte, and index files rewritten by a small table writer (``write_table``).
"""

import json
import os
import shutil
import struct

import h5py
import jax
import numpy as np
import pytest
from helpers import FIXTURES

from elmo_jax import load_hdf5
from elmo_jax.compat import tf_checkpoint as tfc
from elmo_jax.compat.tf_checkpoint import TFCheckpoint, TFCheckpointError, bilm_tf_hdf5_name, read_bilm_tf
from elmo_jax.config import Options

TF_FIXTURES = FIXTURES / "tf_checkpoint"
BILM = ("single", "sharded", "one_layer")


def values(name):
    with np.load(TF_FIXTURES / name / "values.npz") as z:
        return {k: z[k] for k in z.files}


def copy_fixture(name, tmp_path):
    return shutil.copytree(TF_FIXTURES / name, tmp_path / name)


def data_files(directory):
    return sorted(p for p in os.listdir(directory) if ".data-" in p)


def one_line(excinfo):
    message = str(excinfo.value)
    assert "\n" not in message
    return message


# --------------------------------------------------------------------------------------------
# The raw reader.


@pytest.mark.parametrize("name", [*BILM, "dtypes"])
def test_every_tensor_equals_what_tensorflow_saved(name):
    expected = values(name)
    ckpt = TFCheckpoint(TF_FIXTURES / name, verify=True)
    assert sorted(ckpt.keys()) == sorted(expected)
    assert len(ckpt) == len(expected)
    for key, want in expected.items():
        assert key in ckpt
        assert ckpt.shape(key) == want.shape and ckpt.dtype(key) == want.dtype
        got = ckpt.get(key)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
        assert not got.flags.writeable
    assert "nope" not in ckpt
    with pytest.raises(KeyError):
        ckpt.get("nope")


def test_tensors_are_memmap_views_of_the_data_shards():
    ckpt = TFCheckpoint(TF_FIXTURES / "sharded")
    assert ckpt.num_shards == 2
    shards = {ckpt.entry(k).shard_id for k in ckpt}
    assert shards == {0, 1}
    w = ckpt.get("lm/softmax/W")
    assert isinstance(w, np.memmap)
    np.testing.assert_array_equal(w[3:5], values("sharded")["lm/softmax/W"][3:5])
    with pytest.raises(ValueError):
        w[0, 0] = 1.0


def test_dtypes_scalars_and_empty_tensors():
    ckpt = TFCheckpoint(TF_FIXTURES / "dtypes")
    assert ckpt.dtype("a/f64") == np.float64 and ckpt.dtype("a/b/i32") == np.int32
    assert ckpt.dtype("i64") == np.int64 and ckpt.get("i64")[0] == -(2**62)
    assert ckpt.shape("scalar_f32") == () and float(ckpt.get("scalar_f32")) == 3.25
    assert ckpt.get("empty").shape == (0, 3)


def test_prefix_directory_and_checkpoint_file_resolution(tmp_path):
    single = TF_FIXTURES / "single"
    prefix = str(single / "model.ckpt-2")
    for path in (single, prefix, prefix + ".index", prefix + ".data-00000-of-00001"):
        assert tfc.resolve_prefix(path) == prefix
    # sharded/checkpoint names the absolute path where the model was trained: look beside it.
    text = (TF_FIXTURES / "sharded" / "checkpoint").read_text()
    assert '"/tmp/elmo_jax_make_tf_checkpoint/sharded/model.ckpt-2"' in text
    assert tfc.resolve_prefix(TF_FIXTURES / "sharded") == str(TF_FIXTURES / "sharded" / "model.ckpt-2")

    two = tmp_path / "two"
    two.mkdir()
    for src, prefix_name in ((TF_FIXTURES / "single", "model.ckpt-2"), (TF_FIXTURES / "dtypes", "model.ckpt")):
        for f in os.listdir(src):
            if f.startswith(prefix_name + "."):
                shutil.copy(src / f, two / f.replace(prefix_name, "a" if prefix_name == "model.ckpt" else "b"))
    with pytest.raises(TFCheckpointError) as e:
        tfc.resolve_prefix(two)
    assert "2 checkpoints (a, b)" in one_line(e) and str(two) in str(e.value)
    (two / "checkpoint").write_text('model_checkpoint_path: "b"\nall_model_checkpoint_paths: "b"\n')
    assert tfc.resolve_prefix(two) == str(two / "b")
    (two / "checkpoint").write_text('model_checkpoint_path: "gone"\n')
    with pytest.raises(TFCheckpointError, match="names checkpoint 'gone'"):
        tfc.resolve_prefix(two)
    (tmp_path / "empty").mkdir()
    with pytest.raises(TFCheckpointError, match="no TF checkpoint"):
        tfc.resolve_prefix(tmp_path / "empty")
    with pytest.raises(TFCheckpointError, match=r"model.ckpt-9.index: checkpoint index not found"):
        TFCheckpoint(single / "model.ckpt-9")


# --------------------------------------------------------------------------------------------
# Damaged checkpoints.


def test_truncated_data_file_is_refused_naming_it(tmp_path):
    d = copy_fixture("single", tmp_path)
    data = d / data_files(d)[0]
    size = os.path.getsize(data)
    with open(data, "r+b") as f:
        f.truncate(size - 3)
    with pytest.raises(TFCheckpointError) as e:
        TFCheckpoint(d)
    message = one_line(e)
    assert str(data) in message and "truncated" in message and f"file has {size - 3} bytes" in message


def test_missing_shard_is_refused_naming_it(tmp_path):
    d = copy_fixture("sharded", tmp_path)
    missing = d / "model.ckpt-2.data-00001-of-00002"
    os.remove(missing)
    with pytest.raises(TFCheckpointError) as e:
        TFCheckpoint(d)
    assert str(missing) in one_line(e) and "missing data shard 2 of 2" in str(e.value)


@pytest.mark.parametrize("implementation", ["default", "numpy"])
def test_corrupted_byte_is_caught_by_the_entry_crc(tmp_path, monkeypatch, implementation):
    if implementation == "numpy":
        monkeypatch.setattr(tfc, "_google_crc32c", None)
    d = copy_fixture("single", tmp_path)
    name = "lm/CNN_proj/W_proj"
    ckpt = TFCheckpoint(d)
    entry = ckpt.entry(name)
    data = d / data_files(d)[0]
    with open(data, "r+b") as f:
        f.seek(entry.offset + 5)
        byte = f.read(1)
        f.seek(entry.offset + 5)
        f.write(bytes([byte[0] ^ 0x10]))
    ckpt = TFCheckpoint(d)  # opening checks the index and the file sizes only
    with pytest.raises(TFCheckpointError) as e:
        ckpt.get(name)
    message = one_line(e)
    assert f"corrupted entry '{name}' in {data}" in message
    np.testing.assert_array_equal(ckpt.get("lm/CNN_proj/b_proj"), values("single")["lm/CNN_proj/b_proj"])
    assert not np.array_equal(ckpt.get(name, verify=False), values("single")[name])  # unchecked: garbage
    with pytest.raises(TFCheckpointError, match="corrupted entry 'lm/CNN_proj/W_proj'"):
        TFCheckpoint(d, verify=True)
    with pytest.raises(TFCheckpointError, match="corrupted entry 'lm/CNN_proj/W_proj'"):
        read_bilm_tf(d)


def write_table(entries, per_block=1000):
    """A LevelDB table of ``(key, value)`` pairs as TF writes it (no prefix compression here, a
    restart point at every entry, ``per_block`` entries per data block)."""
    out = bytearray()

    def varint(n):
        b = bytearray()
        while True:
            b.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
            n >>= 7
            if not n:
                return bytes(b)

    def block(pairs):
        body, restarts = bytearray(), []
        for k, v in pairs:
            restarts.append(len(body))
            body += varint(0) + varint(len(k)) + varint(len(v)) + k + v
        restarts = restarts or [0]
        body += b"".join(struct.pack("<I", r) for r in restarts) + struct.pack("<I", len(restarts))
        return bytes(body)

    def emit(body):
        offset = len(out)
        out.extend(body + b"\0" + struct.pack("<I", tfc.mask_crc32c(tfc.crc32c(body + b"\0"))))
        return varint(offset) + varint(len(body))

    index = []
    for i in range(0, len(entries), per_block):
        chunk = entries[i : i + per_block]
        index.append((chunk[-1][0], emit(block(chunk))))
    handles = emit(block([])) + emit(block(index))
    return bytes(out) + handles.ljust(40, b"\0") + struct.pack("<Q", 0xDB4775248B80FB57)


def rewrite_index(directory, change=lambda entries: entries, per_block=1000):
    index = next(directory / f for f in os.listdir(directory) if f.endswith(".index"))
    entries = tfc._read_table(str(index))
    index.write_bytes(write_table(change(entries), per_block))
    return index


def test_index_in_many_blocks_reads_the_same(tmp_path):
    d = copy_fixture("sharded", tmp_path)
    rewrite_index(d, per_block=3)
    ckpt = TFCheckpoint(d, verify=True)
    for key, want in values("sharded").items():
        np.testing.assert_array_equal(ckpt.get(key), want)


def test_big_endian_header_is_refused(tmp_path):
    d = copy_fixture("single", tmp_path)
    index = rewrite_index(d, lambda entries: [(b"", entries[0][1] + b"\x10\x01")] + entries[1:])
    with pytest.raises(TFCheckpointError) as e:
        TFCheckpoint(d)
    assert "big-endian" in one_line(e) and str(index) in str(e.value)


def test_unsupported_dtype_is_refused(tmp_path):
    d = copy_fixture("dtypes", tmp_path)

    def to_string(entries):
        out = []
        for k, v in entries:
            if k == b"scalar_f32":
                assert v[:2] == b"\x08\x01"  # dtype DT_FLOAT
                v = b"\x08\x07" + v[2:]  # DT_STRING
            out.append((k, v))
        return out

    rewrite_index(d, to_string)
    ckpt = TFCheckpoint(d)
    with pytest.raises(TFCheckpointError) as e:
        ckpt.get("scalar_f32")
    assert "'scalar_f32' has unsupported dtype DT_STRING" in one_line(e)
    np.testing.assert_array_equal(ckpt.get("a/f64"), values("dtypes")["a/f64"])


def test_bad_index_is_refused(tmp_path):
    d = copy_fixture("single", tmp_path)
    index = d / "model.ckpt-2.index"
    good = index.read_bytes()
    bad = bytearray(good)
    bad[20] ^= 0x01  # inside the data block
    index.write_bytes(bytes(bad))
    with pytest.raises(TFCheckpointError) as e:
        TFCheckpoint(d)
    assert "bad index: crc32c mismatch in the data block" in one_line(e) and str(index) in str(e.value)
    index.write_bytes(good[:-1] + b"\0")
    with pytest.raises(TFCheckpointError, match="bad index: no table magic number"):
        TFCheckpoint(d)
    index.write_bytes(good[:30])
    with pytest.raises(TFCheckpointError, match="shorter than the 48-byte footer"):
        TFCheckpoint(d)


# --------------------------------------------------------------------------------------------
# bilm-tf.


def test_tf_names_map_to_bilm_tf_hdf5_names():
    assert (
        bilm_tf_hdf5_name("lm/RNN_1/rnn/multi_rnn_cell/cell_1/lstm_cell/projection/kernel")
        == "RNN_1/RNN/MultiRNNCell/Cell1/LSTMCell/W_P_0"
    )
    assert (
        bilm_tf_hdf5_name("lm/RNN_0/rnn/multi_rnn_cell/cell_0/lstm_cell/kernel")
        == "RNN_0/RNN/MultiRNNCell/Cell0/LSTMCell/W_0"
    )
    assert bilm_tf_hdf5_name("lm/RNN_0/rnn/lstm_cell/bias") == "RNN_0/RNN/LSTMCell/B"
    assert (
        bilm_tf_hdf5_name("lm/RNN_0/RNN/MultiRNNCell/Cell0/LSTMCell/W_0") == "RNN_0/RNN/MultiRNNCell/Cell0/LSTMCell/W_0"
    )
    assert bilm_tf_hdf5_name("lm/CNN_high_0/W_carry") == "CNN_high_0/W_carry"
    assert bilm_tf_hdf5_name("lm/char_embed") == "char_embed"
    assert bilm_tf_hdf5_name("lm/softmax/W") == "softmax/W"
    assert bilm_tf_hdf5_name("global_step") is None


def expected_trees(name, tmp_path):
    """(config, params, accumulators) as load_hdf5 reads hdf5 files written from values.npz
    under bilm-tf's hdf5 names (dump_weights); n_layers 1 goes under Cell0."""
    vals = values(name)
    trees = []
    for suffix in ("", "/Adagrad"):
        path = tmp_path / f"{name}{suffix.replace('/', '_')}.hdf5"
        with h5py.File(path, "w") as f:
            for key, value in vals.items():
                if not key.startswith("lm/") or "softmax" in key or key.endswith("/Adagrad") != bool(suffix):
                    continue
                h5 = bilm_tf_hdf5_name(key[: len(key) - len(suffix)])
                f[h5.replace("/RNN/LSTMCell/", "/RNN/MultiRNNCell/Cell0/LSTMCell/")] = value
        config, tree = load_hdf5(TF_FIXTURES / name / "options.json", path)
        trees.append(tree)
    params, acc = trees
    acc["char_cnn"]["char_embed"][0] = 1.0  # the padding row's fresh accumulator
    if "lm/CNN_proj/W_proj" not in vals:
        acc["char_cnn"]["proj"] = jax.tree_util.tree_map(np.ones_like, acc["char_cnn"]["proj"])
    return config, params, acc


@pytest.mark.parametrize("name", BILM)
def test_read_bilm_tf_gives_load_hdf5_trees_softmax_accumulators_and_step(name, tmp_path):
    vals = values(name)
    config, params, acc = expected_trees(name, tmp_path)
    out = read_bilm_tf(TF_FIXTURES / name)
    assert out["config"] == config and config.char_cnn.n_characters == 262
    assert out["global_step"] == 2 and isinstance(out["global_step"], int)
    assert out["prefix"] == str(TF_FIXTURES / name / "model.ckpt-2")
    assert jax.tree_util.tree_structure(out["params"]["bilm"]) == jax.tree_util.tree_structure(params)
    jax.tree_util.tree_map(np.testing.assert_array_equal, out["params"]["bilm"], params)
    jax.tree_util.tree_map(np.testing.assert_array_equal, out["accumulators"]["bilm"], acc)
    char_embed = out["params"]["bilm"]["char_cnn"]["char_embed"]
    assert char_embed.shape == (262, config.char_cnn.embedding_dim)
    assert (char_embed[0] == 0).all() and (char_embed[1:] == vals["lm/char_embed"]).all()
    char_acc = out["accumulators"]["bilm"]["char_cnn"]["char_embed"]
    assert (char_acc[0] == 1.0).all() and (char_acc[1:] == vals["lm/char_embed/Adagrad"]).all()
    for tree, suffix in ((out["params"], ""), (out["accumulators"], "/Adagrad")):
        assert isinstance(tree["softmax"]["w"], np.memmap)
        np.testing.assert_array_equal(tree["softmax"]["w"], vals["lm/softmax/W" + suffix])
        np.testing.assert_array_equal(tree["softmax"]["b"], vals["lm/softmax/b" + suffix])
    v = Options.load(TF_FIXTURES / name / "options.json").train.n_tokens_vocab
    assert out["params"]["softmax"]["w"].shape == (v, config.lstm.projection_dim)
    # The dense trees by the documented mapping, for two leaves:
    p = config.lstm.projection_dim
    kernel = vals[
        (
            "lm/RNN_1/rnn/multi_rnn_cell/cell_0/lstm_cell/kernel"
            if config.lstm.n_layers > 1
            else "lm/RNN_1/rnn/lstm_cell/kernel"
        )
        + "/Adagrad"
    ]
    np.testing.assert_array_equal(out["accumulators"]["bilm"]["lstm"][0]["w_h"][1], kernel[p:])
    if config.char_cnn.n_highway:
        np.testing.assert_array_equal(
            out["params"]["bilm"]["char_cnn"]["highway"][0]["b"],
            np.concatenate([vals["lm/CNN_high_0/b_carry"], vals["lm/CNN_high_0/b_transform"]]),
        )


def test_read_bilm_tf_without_options_infers_the_shapes(tmp_path):
    d = copy_fixture("sharded", tmp_path)
    os.remove(d / "options.json")
    out = read_bilm_tf(d)
    assert out["config"] is None
    config, params, acc = expected_trees("sharded", tmp_path)
    jax.tree_util.tree_map(np.testing.assert_array_equal, out["params"]["bilm"], params)
    jax.tree_util.tree_map(np.testing.assert_array_equal, out["accumulators"]["bilm"], acc)
    assert read_bilm_tf(d, options=TF_FIXTURES / "sharded" / "options.json")["config"] == config


@pytest.mark.parametrize(
    "change, tensor, got, want",
    [
        (lambda o: o["lstm"].update(projection_dim=7), "lm/CNN_proj/W_proj", (16, 8), (16, 7)),
        (
            lambda o: o["lstm"].update(dim=32),
            "lm/RNN_0/rnn/multi_rnn_cell/cell_0/lstm_cell/kernel",
            (16, 64),
            (16, 128),
        ),
        (lambda o: o.update(n_tokens_vocab=51), "lm/softmax/W", (50, 8), (51, 8)),
    ],
)
def test_mismatched_options_are_refused_in_one_line(tmp_path, change, tensor, got, want):
    options = json.loads((TF_FIXTURES / "single" / "options.json").read_text())
    change(options)
    path = tmp_path / "options.json"
    path.write_text(json.dumps(options))
    with pytest.raises(TFCheckpointError) as e:
        read_bilm_tf(TF_FIXTURES / "single", options=path)
    assert one_line(e) == (
        f"{TF_FIXTURES / 'single' / 'model.ckpt-2'}: tensor '{tensor}' has shape {got}, expected {want} (per {path})"
    )


def test_missing_and_unexpected_tensors_are_refused(tmp_path):
    options = Options.load(TF_FIXTURES / "single" / "options.json")
    fewer = json.loads((TF_FIXTURES / "single" / "options.json").read_text())
    fewer["char_cnn"]["n_highway"] = 0
    (tmp_path / "fewer.json").write_text(json.dumps(fewer))
    with pytest.raises(TFCheckpointError, match=r"unexpected tensor 'lm/CNN_high_0/W_carry(/Adagrad)?'"):
        read_bilm_tf(TF_FIXTURES / "single", options=tmp_path / "fewer.json")
    more = json.loads((TF_FIXTURES / "single" / "options.json").read_text())
    more["lstm"]["n_layers"] = 3
    (tmp_path / "more.json").write_text(json.dumps(more))
    with pytest.raises(TFCheckpointError) as e:
        read_bilm_tf(TF_FIXTURES / "single", options=tmp_path / "more.json")
    assert (
        "missing tensor 'lm/RNN_0/rnn/multi_rnn_cell/cell_2/lstm_cell/kernel' (expected shape (16, 64) float32"
        in one_line(e)
    )
    assert read_bilm_tf(TF_FIXTURES / "single", options=options)["config"].lstm.n_layers == 2


# --------------------------------------------------------------------------------------------
# crc32c.


def test_crc32c_known_values_and_mask():
    for fn in (tfc.crc32c, tfc.crc32c_numpy):
        assert fn(b"") == 0
        assert fn(b"123456789") == 0xE3069283
        assert fn(b"\0" * 32) == 0x8A9136AA
        assert fn(b"456789", fn(b"123")) == 0xE3069283
    for crc in (0, 1, 0xE3069283, 0xFFFFFFFF):
        assert tfc.unmask_crc32c(tfc.mask_crc32c(crc)) == crc
    assert tfc.mask_crc32c(0) == 0xA282EAD8


def test_numpy_crc32c_equals_google_crc32c():
    google_crc32c = pytest.importorskip("google_crc32c")
    rng = np.random.default_rng(0)
    lengths = [0, 1, 2, 3, 4, 5, 7, 8, 63, 255, 256, 257, 1023, 4097, 65537, 300001, (1 << 20) + 3, (3 << 20) - 1]
    for n in lengths:
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert tfc.crc32c_numpy(data) == google_crc32c.value(data), n
        cut = n // 3
        assert tfc.crc32c_numpy(data[cut:], tfc.crc32c_numpy(data[:cut])) == google_crc32c.value(data), n
    same = np.full(1 << 16, 0xFF, np.uint8)
    assert tfc.crc32c_numpy(same) == google_crc32c.value(same.tobytes())


def test_reading_with_the_numpy_crc32c(monkeypatch):
    monkeypatch.setattr(tfc, "_google_crc32c", None)
    assert tfc.crc32c_implementation() == "numpy"
    for name in BILM:
        TFCheckpoint(TF_FIXTURES / name, verify=True)
