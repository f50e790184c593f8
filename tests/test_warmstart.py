"""Continued pretraining: every source ``--init-from`` reads, vocabulary extension, and bad sources."""

import dataclasses
import json
import os
import re
import shutil

import h5py
import jax
import numpy as np
import pytest
from helpers import FIXTURES
from test_pretrain import TRAIN, trained_run  # noqa: F401  (a fixture: test_pretrain's short run)

from elmo_jax import Embedder, cli
from elmo_jax.compat.hdf5 import WeightsError
from elmo_jax.config import Options
from elmo_jax.model.vocabulary import Vocabulary
from elmo_jax.text.vocab import build_vocab
from elmo_jax.training.checkpoint import CheckpointError
from elmo_jax.training.run_dir import export_names, export_run, load_run, read_run
from elmo_jax.training.warmstart import NO_ACCUMULATORS_LEARNING_RATE, finetune_state, read_warmstart

TRAIN_WORDS = Vocabulary.load(TRAIN / "vocab.txt").words[3:]


@pytest.fixture(scope="module")
def released(trained_run, tmp_path_factory):
    """The run exported under AllenNLP's released file names."""
    out = tmp_path_factory.mktemp("released")
    export_run(str(trained_run[0]), str(out), layout="released")
    return out


def _same(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_released_names_round_trip(trained_run, released):
    run_dir, options, vocab = trained_run
    assert sorted(os.listdir(released)) == sorted(export_names(options.model, "released"))
    warm = read_warmstart(str(released))
    _, _, params, _ = load_run(str(run_dir))
    assert warm.kind == "hdf5" and warm.bilm_acc is None and warm.vocab.words == vocab.words
    _same(warm.bilm, params["bilm"])
    _same(warm.softmax, params["softmax"])
    # An export read as a run dir (Embedder.from_checkpoint, --run-dir) says what it is, in either
    # layout (the released one has no options.json of that name).
    plain = released.parent / "plain"
    export_run(str(run_dir), str(plain))
    for export, said in ((released, "not a run directory (no options.json)"), (plain, "no checkpoint found")):
        weights = export_names(options.model, "released" if export == released else "elmo_jax")[1]
        with pytest.raises(
            CheckpointError, match=re.escape(f"{said}; its {weights} is an export's: read it with from_hdf5")
        ):
            load_run(str(export))
    # The biLM's readers need no vocab.txt, so an export without one is told apart too (before:
    # "vocab.txt: vocabulary file not found").
    (plain / "vocab.txt").unlink()
    weights = export_names(options.model, "elmo_jax")[1]
    with pytest.raises(CheckpointError, match=re.escape(f"no checkpoint found; its {weights} is an export's")):
        Embedder.from_checkpoint(str(plain))


@pytest.mark.slow
def test_every_source_gives_the_same_weights_and_only_a_run_its_accumulators(trained_run, released, tmp_path):
    run_dir, options, vocab = trained_run
    plain = tmp_path / "plain"
    export_run(str(run_dir), str(plain))
    from_run, from_plain, from_released = (
        finetune_state(str(s), options, vocab, warn_rate=False) for s in (run_dir, plain, released)
    )
    old = read_run(str(run_dir))[2]
    for state in (from_run, from_plain, from_released):
        _same(state["params"], old["params"])
    _same(from_run["opt"], old["opt"])
    _same(from_plain["opt"], from_released["opt"])  # no optimizer state in hdf5: accumulators start at 1.0
    assert all((np.asarray(x) == 1.0).all() for x in jax.tree_util.tree_leaves(from_plain["opt"]))


def test_build_vocab_extend_keeps_old_words_sorted_by_the_new_counts():
    counts = {"new": 9, "shared": 5, "rare": 1, "tie": 5}
    old = ["<S>", "</S>", "<UNK>", "gone2", "shared", "rare", "gone1"]
    assert build_vocab(counts, min_count=2, extend=old) == [
        "<S>",
        "</S>",
        "<UNK>",
        "new",
        "shared",
        "tie",
        "rare",
        "gone2",
        "gone1",
    ]
    assert build_vocab(counts, min_count=2) == ["<S>", "</S>", "<UNK>", "new", "shared", "tie"]


@pytest.mark.slow
def test_cli_continues_a_released_layout_with_an_extended_vocabulary(trained_run, released, tmp_path, capsys):
    """No --config, no --vocab: the source's biLM, its words plus the new text's, sorted by new counts."""
    _, options, vocab = trained_run
    text = tmp_path / "new.txt"
    text.write_text("the zebra said hello .\nhello zebra .\n" * 5)
    out = tmp_path / "ft"
    argv = ["train", "--init-from", str(released), "--train-files", str(text), "--run-dir", str(out)]
    argv += ["--batch-size", "2", "--devices", "1", "--no-progress"]
    assert cli.main([*argv, "--steps", "1"]) == 0
    new_vocab = Vocabulary.load(out / "vocab.txt")
    assert set(vocab.words) <= set(new_vocab.words) and {"zebra", "hello"} <= set(new_vocab.words)
    counts = dict.fromkeys(new_vocab.words, 0)
    for w in text.read_text().split():
        counts[w] += 1
    got = [counts[w] for w in new_vocab.words[3:]]
    assert got == sorted(got, reverse=True)  # frequency order for the log-uniform sampler
    saved = Options.load(out / "options.json")
    assert saved.model == options.model and saved.train.n_tokens_vocab == len(new_vocab)
    # hdf5 files carry no accumulators: the gentler learning rate, said in one line.
    assert saved.train.learning_rate == NO_ACCUMULATORS_LEARNING_RATE
    said = capsys.readouterr().out
    assert "has no optimizer state" in said and f"starting {out} from {released} to step 1" in said
    assert load_run(str(out))[3] == 1
    # The same command resumes: with the run's own options, not the default preset's (before: "holds
    # a run with different options"), its learning rate kept, the source not read again.
    assert cli.main([*argv, "--steps", "2"]) == 0, capsys.readouterr().err
    assert load_run(str(out))[3] == 2 and "has no optimizer state" not in capsys.readouterr().out
    assert Options.load(out / "options.json") == saved


def test_released_model_by_name(trained_run, released, tmp_path, monkeypatch):
    """A registry name fetches the files (here: a local mirror directory standing in for AllenNLP's)."""
    from model_server import fixture_model

    from elmo_jax import pretrained

    run_dir, options, vocab = trained_run
    entry = fixture_model("pubmed")
    names = export_names(options.model, "released")
    files = {
        role: (pretrained.RemoteFile(f"m/{name}", (released / name).stat().st_size),)
        for role, name in zip(("options", "weights", "softmax", "vocab"), names)
    }
    monkeypatch.setitem(pretrained.MODELS, "pubmed", dataclasses.replace(entry, files=files))
    mirror = tmp_path / "mirror"
    shutil.copytree(released, mirror / "m")
    monkeypatch.setenv("ELMO_JAX_MIRROR", str(mirror))
    monkeypatch.setenv("ELMO_JAX_HOME", str(tmp_path / "cache"))
    warm = read_warmstart("pubmed")
    _same(warm.bilm, load_run(str(run_dir))[2]["bilm"])
    assert warm.vocab.words == vocab.words


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_bad_sources_give_one_line(trained_run, released, tmp_path, capsys):
    run_dir, options, vocab = trained_run
    names = export_names(options.model, "released")
    # A softmax whose rows disagree with its vocabulary.
    d = _copy(released, tmp_path / "rows")
    (d / names[3]).write_text("\n".join(vocab.words[:-1]) + "\n")
    with pytest.raises(CheckpointError, match=r"softmax rows, but its vocabulary .* has"):
        read_warmstart(str(d))
    # A vocabulary without the three specials.
    d = _copy(released, tmp_path / "specials")
    (d / names[3]).write_text("\n".join(["x1"] + vocab.words[3:] + ["x2", "x3"]) + "\n")
    with pytest.raises(CheckpointError, match="must contain"):
        read_warmstart(str(d))
    # A softmax file without the datasets.
    d = _copy(released, tmp_path / "nosoftmax")
    with h5py.File(d / names[2], "w") as f:
        f["other"] = np.zeros(3)
    with pytest.raises(WeightsError, match="softmax/W"):
        read_warmstart(str(d))
    # A softmax file that is not HDF5 at all (a truncated download, text): one line naming it.
    (d / names[2]).write_text("not hdf5\n")
    with pytest.raises(WeightsError, match=rf"^{d / names[2]}: not a readable HDF5 file \("):
        read_warmstart(str(d))
    # Not a model at all, and an unknown name.
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no options file"):
        read_warmstart(str(tmp_path / "empty"))
    with pytest.raises(CheckpointError, match="neither a directory nor a released model"):
        read_warmstart("no-such-model")
    # An --init-from whose biLM differs from --config: one line from the CLI.
    other = json.loads((released / names[0]).read_text())
    other["lstm"]["projection_dim"] *= 2
    (tmp_path / "other.json").write_text(json.dumps(other))
    code = cli.main(
        [
            "train",
            "--init-from",
            str(released),
            "--config",
            str(tmp_path / "other.json"),
            "--train-files",
            str(TRAIN / "data.txt"),
            "--run-dir",
            str(tmp_path / "x"),
            "--steps",
            "1",
            "--devices",
            "1",
            "--no-progress",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "its biLM differs" in err, err
    # Refused before the vocabulary pass (before: it left vocab.txt, which a rerun without
    # --init-from took silently, the source's words and all).
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_a_source_directory_named_with_glob_characters_is_read_as_any_other(trained_run, released, tmp_path):
    """Its files were looked up by a glob of the path itself, which takes ``[1]`` for a pattern: a
    TF checkpoint's vocabulary was said to be missing beside it, an export's weights not found."""
    from elmo_jax.compat.tf_checkpoint import read_bilm_tf

    odd = tmp_path / "run[1]*?"
    ckpt = shutil.copytree(FIXTURES / "tf_checkpoint" / "single", odd / "ckpt")
    words = ["<S>", "</S>", "<UNK>", *[f"w{i}" for i in range(47)]]
    (ckpt / "vocab.txt").write_text("\n".join(words) + "\n")
    warm = read_warmstart(str(ckpt))
    assert warm.kind == "tf_checkpoint" and warm.vocab.words == words
    assert warm.step == read_bilm_tf(str(FIXTURES / "tf_checkpoint" / "single"))["global_step"]
    copy = shutil.copytree(released, odd / "released")
    warm = read_warmstart(str(copy))
    assert warm.kind == "hdf5" and warm.vocab.words == trained_run[2].words
    _same(warm.bilm, read_warmstart(str(released)).bilm)


def test_tf_checkpoint_continues_with_its_accumulators_and_an_extended_vocabulary(tmp_path):
    """bilm-tf's TF checkpoint (written by TensorFlow, read without it): weights, softmax rows and
    Adagrad slots carry over by word; the new text's words get fresh rows."""
    from elmo_jax.compat.tf_checkpoint import read_bilm_tf

    ckpt = shutil.copytree(FIXTURES / "tf_checkpoint" / "single", tmp_path / "ckpt")
    old_words = ["<S>", "</S>", "<UNK>", *TRAIN_WORDS[:5], *[f"old{i}" for i in range(42)]]
    (tmp_path / "vocab-test.txt").write_text("\n".join(old_words) + "\n")  # next to the checkpoint dir
    warm = read_warmstart(str(ckpt))
    ref = read_bilm_tf(str(ckpt))
    assert warm.kind == "tf_checkpoint" and warm.step == ref["global_step"] and warm.vocab.words == old_words
    out = tmp_path / "ft"
    assert (
        cli.main(
            [
                "train",
                "--init-from",
                str(ckpt),
                "--train-files",
                str(TRAIN / "data.txt"),
                "--run-dir",
                str(out),
                "--steps",
                "1",
                "--batch-size",
                "2",
                "--devices",
                "1",
                "--no-progress",
            ]
        )
        == 0
    )
    new_vocab = Vocabulary.load(out / "vocab.txt")
    assert set(old_words) <= set(new_vocab.words) and len(new_vocab) > len(old_words)
    # Step 0 of the continued run is the checkpoint, row by row.
    options = Options.load(out / "options.json")
    assert options.train.learning_rate == 0.2  # its accumulators came along: bilm-tf's rate
    state = finetune_state(warm, options, new_vocab)
    _same(state["params"]["bilm"], ref["params"]["bilm"])
    for i, w in enumerate(new_vocab.words):
        if w in warm.vocab:
            j = warm.vocab.word_to_id(w)
            np.testing.assert_array_equal(state["params"]["softmax"]["w"][i], ref["params"]["softmax"]["w"][j])
            np.testing.assert_array_equal(state["opt"]["softmax"]["w"][i], ref["accumulators"]["softmax"]["w"][j])
        else:
            assert (state["opt"]["softmax"]["w"][i] == 1.0).all()
    from elmo_jax.training.warmstart import dense_accumulators

    _same(dense_accumulators(state["opt"]["bilm"]), ref["accumulators"]["bilm"])
    assert load_run(str(out))[3] == 1
    # Without the vocabulary the softmax rows mean nothing: refused in one line.
    (tmp_path / "vocab-test.txt").unlink()
    with pytest.raises(CheckpointError, match="vocabulary"):
        read_warmstart(str(ckpt))
