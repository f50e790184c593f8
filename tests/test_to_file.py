"""elmo_jax.extract.to_file: ``embed_file`` from Python, without the command line."""

import json
import os

import h5py
import numpy as np
import pytest
from helpers import embed_sentences, model_files

from elmo_jax import cli
from elmo_jax._util.arguments import arguments_of
from elmo_jax.config import ConfigError
from elmo_jax.extract import EmbedFileOptions, embed_file
from elmo_jax.extract.embedder import Embedder
from elmo_jax.text.sources import DataError

OPTIONS, WEIGHTS = (str(p) for p in model_files("allennlp"))


@pytest.fixture(scope="module")
def embedder():
    return Embedder.from_hdf5(OPTIONS, WEIGHTS, batch_tokens=64)


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "in.txt"
    path.write_text("\n".join(" ".join(s) for s in embed_sentences()[:9]) + "\n\n", encoding="utf-8")
    return path


def _contents(path):
    with h5py.File(path, "r") as f:
        return {k: (f[k].dtype, f[k].shape, f[k][()]) for k in f}


@pytest.mark.parametrize(
    "flags, options",
    [
        ([], EmbedFileOptions(progress=False)),
        (
            ["--sentence-to-index", "--window", "4", "--layers", "top"],
            EmbedFileOptions(sentence_to_index=True, window=4, layers="top", progress=False),
        ),
        (["--pool", "max", "--layers", "0.5,-1,2"], EmbedFileOptions(pool="max", layers=[0.5, -1, 2], progress=False)),
        (
            ["--num-shards", "2", "--shard-index", "1", "--pool", "mean"],
            EmbedFileOptions(num_shards=2, shard_index=1, pool="mean", progress=False),
        ),
    ],
)
def test_from_python_writes_what_the_cli_writes(tmp_path, text, embedder, flags, options):
    (tmp_path / "cli").mkdir()
    (tmp_path / "py").mkdir()
    assert (
        cli.main(
            [
                "embed",
                "--options",
                OPTIONS,
                "--weights",
                WEIGHTS,
                "--no-progress",
                "--batch-tokens",
                "64",
                "--input",
                str(text),
                "--output",
                str(tmp_path / "cli" / "e.hdf5"),
                *flags,
            ]
        )
        == 0
    )
    done = embed_file(embedder, text, tmp_path / "py" / "e.hdf5", options)
    assert done.lines == 10 and done.empty_pooled == (1 if options.pool else 0)
    assert sorted(os.listdir(tmp_path / "cli")) == sorted(os.listdir(tmp_path / "py"))
    got, want = _contents(done.output), _contents(str(tmp_path / "cli" / os.path.basename(done.output)))
    assert got.keys() == want.keys() and got
    for k in want:
        assert got[k][:2] == want[k][:2], k
        if k == "sentence_to_index":
            assert json.loads(got[k][2]) == json.loads(want[k][2])
        else:
            np.testing.assert_array_equal(got[k][2], want[k][2])
    if done.manifest:
        assert done.written == 5
        manifests = [
            json.loads(open(p).read()) for p in (done.manifest, str(tmp_path / "cli" / os.path.basename(done.manifest)))
        ]
        assert manifests[0] == manifests[1] and manifests[0]["lines"] == {"start": 1, "stop": 10, "step": 2}


@pytest.mark.parametrize(
    "kwargs, message, fields",
    [
        (dict(window=0), "window must be an integer >= 1; got 0$", ("window",)),  # not ahead, which is fine
        (dict(ahead=-1), "ahead must be an integer >= 0; got -1$", ("ahead",)),
        (dict(shard_index=0), "shard_index needs num_shards", ("shard_index", "num_shards")),
        (dict(num_shards=2, shard_index=2), "num_shards 2 needs shard_index in 0..1", ("num_shards", "shard_index")),
        (dict(num_shards=0), "num_shards must be an integer >= 1; got 0$", ("num_shards",)),
        (dict(num_shards=0, shard_index=0), "num_shards must be an integer >= 1; got 0$", ("num_shards",)),
        (dict(layers="bottom"), "layers 'bottom': expected all, top, average", ("layers",)),
        (dict(layers=["x"]), "layers \\['x'\\]: expected all, top, average", ("layers",)),
        (dict(pool="sum"), "pool 'sum': expected None, mean or max", ("pool",)),
    ],
)
def test_options_errors_name_the_field_not_a_flag(kwargs, message, fields):
    with pytest.raises(ConfigError, match=f"^{message}") as e:
        EmbedFileOptions(**kwargs)
    assert "--" not in str(e.value) and arguments_of(e.value) == fields


def test_good_options_are_frozen_and_weights_a_tuple():
    options = EmbedFileOptions(layers=np.array([1, 0, 0]), num_shards=3, shard_index=2)
    assert options.layers == (1.0, 0.0, 0.0) and options.sharded
    with pytest.raises(AttributeError):
        options.window = 3  # frozen


def test_batch_tokens_and_layers_that_misfit_the_model_name_the_argument(tmp_path, text, embedder):
    with pytest.raises(ConfigError, match="^batch_tokens must be 1 or more; got 0$") as e:
        Embedder.from_hdf5(OPTIONS, WEIGHTS, batch_tokens=0)
    assert arguments_of(e.value) == ("batch_tokens",)
    for bad in ("64", 64.7):  # (before: "'<' not supported between 'str' and 'int'"; 64.7 taken as 64)
        with pytest.raises(TypeError, match=f"^batch_tokens must be an int; got {bad!r}$"):
            Embedder.from_hdf5(OPTIONS, WEIGHTS, batch_tokens=bad)
    assert Embedder.from_hdf5(OPTIONS, WEIGHTS, batch_tokens=np.int64(64)).batch_tokens == 64
    with pytest.raises(TypeError, match=r"^devices must be an int; got '2'$"):  # (before: '<' not supported)
        Embedder.from_hdf5(OPTIONS, WEIGHTS, devices="2")
    # A model's file for the Embedder (before: AttributeError, 'str' object has no attribute 'config').
    for wrong in (str(OPTIONS), lambda: str(OPTIONS)):
        with pytest.raises(TypeError, match=r"^embedder is a str; expected an Embedder \(Embedder.from_hdf5"):
            embed_file(wrong, text, tmp_path / "o.hdf5")
    assert not (tmp_path / "o.hdf5").exists()
    with pytest.raises(ConfigError, match=r"^devices must be 1 or more \(None: every local device\); got -1$") as e:
        Embedder.from_hdf5(OPTIONS, WEIGHTS, devices=-1)
    assert arguments_of(e.value) == ("devices",)
    with pytest.raises(ConfigError, match="^layers: expected 3 weights") as e:
        embed_file(embedder, text, tmp_path / "o.hdf5", EmbedFileOptions(layers=(1, 2)))
    assert arguments_of(e.value) == ("layers",)
    assert sorted(os.listdir(tmp_path)) == ["in.txt"]


def test_bad_paths_are_refused_before_the_model_is_loaded(tmp_path, text):
    def load():
        raise AssertionError("the model was loaded")

    # Each named by its argument: the same path may be both (the command line names the flag).
    for args, said, argument in [
        (
            (tmp_path / "missing.txt", tmp_path / "o.hdf5"),
            f"input_path {tmp_path}/missing.txt: does not exist",
            "input_path",
        ),
        (
            (text, tmp_path / "no" / "o.hdf5"),
            f"output_path {tmp_path}/no/o.hdf5: {tmp_path}/no does not exist",
            "output_path",
        ),
        ((tmp_path / "d", tmp_path / "o.hdf5"), f"input_path {tmp_path}/d: is a directory, not a file", "input_path"),
        (
            (text, tmp_path / "d"),
            f"output_path {tmp_path}/d: is a directory, not a file",
            "output_path",
        ),  # not at the rename
    ]:
        if not (tmp_path / "d").exists():
            (tmp_path / "d").mkdir()
        with pytest.raises(DataError) as e:
            embed_file(load, *args)
        assert (str(e.value), arguments_of(e.value)) == (said, (argument,))
    # The arguments in another order (before: os.fspath's "expected str, bytes or os.PathLike object, not Embedder").
    with pytest.raises(TypeError) as e:
        embed_file(text, load, tmp_path / "o.hdf5")  # type: ignore[arg-type]
    assert str(e.value) == "input_path is a function; expected a path: embed_file(embedder, input_path, output_path)"
    assert arguments_of(e.value) == ("input_path",)
    # Options as a dict (before: AttributeError 'dict' object has no attribute 'layers').
    with pytest.raises(TypeError, match=r"^options must be an EmbedFileOptions, got dict"):
        embed_file(load, text, tmp_path / "o.hdf5", {"pool": "mean"})  # type: ignore[arg-type]
    (tmp_path / "d").rmdir()
    with pytest.raises(DataError, match="gs://bucket/in.txt: the input is read as a local file"):
        embed_file(load, "gs://bucket/in.txt", tmp_path / "o.hdf5")
    # The negative control: with good paths the loader is called.
    with pytest.raises(AssertionError, match="the model was loaded"):
        embed_file(load, text, tmp_path / "o.hdf5")
    assert sorted(os.listdir(tmp_path)) == ["in.txt"]


def test_an_output_that_is_the_input_or_not_an_hdf5_file_is_refused_and_kept(tmp_path, text, embedder):
    """``--output`` named like ``--input`` replaced the text with its vectors, and any other file
    there was replaced without a word; an hdf5 file there (a previous run's output) is rewritten."""
    before = text.read_bytes()
    with pytest.raises(DataError) as e:
        embed_file(embedder, text, text, EmbedFileOptions(progress=False))
    assert str(e.value) == f"{text}: is the input file: its text would be lost; give another output"
    assert arguments_of(e.value) == ("output",)
    notes = tmp_path / "notes.txt"
    notes.write_text("mine\n")
    with pytest.raises(DataError, match=r"notes.txt: exists and is not an hdf5 file, which this would replace"):
        embed_file(embedder, text, notes, EmbedFileOptions(progress=False))
    assert text.read_bytes() == before and notes.read_text() == "mine\n"
    out = tmp_path / "out.hdf5"
    for _ in range(2):
        assert embed_file(embedder, text, out, EmbedFileOptions(progress=False, pool="mean"))
    assert sorted(os.listdir(tmp_path)) == ["in.txt", "notes.txt", "out.hdf5"]
