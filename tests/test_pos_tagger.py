"""experiments/pos_tagger.py end to end on the fixture biLM and a tiny synthetic Brown directory."""

import json
import os
import pathlib

import numpy as np
import pos_tagger
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
OPTIONS = ROOT / "elmo_jax" / "data" / "fixture_options.json"
WEIGHTS = ROOT / "elmo_jax" / "data" / "fixture_weights.hdf5"
LEXICON = {
    "the": "DET",
    "a": "DET",
    "dog": "NOUN",
    "cat": "NOUN",
    "A/B": "NOUN",
    "runs": "VERB",
    "sees": "VERB",
    "big": "ADJ",
    "red": "ADJ",
    "on": "ADP",
    "and": "CONJ",
    "it": "PRON",
    "up": "PRT",
    "3": "NUM",
    "very": "ADV",
    "xyz": "X",
    ".": ".",
}


def write_brown(directory: pathlib.Path, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    words = sorted(LEXICON)
    directory.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", 24), ("dev", 8), ("test", 8)):
        lines = []
        for _ in range(n):
            sentence = [words[i] for i in rng.integers(0, len(words), rng.integers(2, 8))]
            lines.append(" ".join(f"{w}/{LEXICON[w]}" for w in sentence))
        (directory / f"{split}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")


def run(capsys, *argv) -> tuple[int, str, str]:
    try:
        pos_tagger.main([str(a) for a in argv])
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.slow
def test_features_then_quick_grid(tmp_path, capsys):
    data, feats, out = tmp_path / "brown", tmp_path / "feats", tmp_path / "res" / "pos.json"
    write_brown(data)
    code, _, err = run(
        capsys, "features", "--options", OPTIONS, "--weights", WEIGHTS, "--data-dir", data, "--out", feats
    )
    assert code == 0, err
    meta = json.loads((feats / "meta.json").read_text())
    train = np.load(feats / "train.npy")
    offsets = np.load(feats / "train.offsets.npy")
    sentences, _ = pos_tagger.read_split(str(data / "train.txt"))
    assert train.dtype == np.float16 and train.shape == (sum(map(len, sentences)), 3, 32)
    assert meta["splits"]["train"]["shape"] == list(train.shape) and offsets[-1] == len(train)
    assert sorted(os.listdir(feats)) == [
        "dev.npy",
        "dev.offsets.npy",
        "meta.json",
        "test.npy",
        "test.offsets.npy",
        "train.npy",
        "train.offsets.npy",
    ]  # no temporary file left
    from elmo_jax.extract.embedder import Embedder

    expected = Embedder.from_hdf5(OPTIONS, WEIGHTS).embed(sentences[3:4])[0]  # [L+1, n, 2P]
    np.testing.assert_allclose(train[offsets[3] : offsets[4]].transpose(1, 0, 2), expected, atol=2e-3, rtol=2e-3)

    code, stdout, err = run(
        capsys,
        "grid",
        "--quick",
        "--seeds",
        0,
        "--fractions",
        0.5,
        1.0,
        "--variants",
        "words",
        "elmo",
        "layer1",
        "--data-dir",
        data,
        "--features",
        feats,
        "--out",
        out,
    )
    assert code == 0, err
    result = json.loads(out.read_text())
    assert [(r["variant"], r["fraction"]) for r in result["runs"]] == [
        ("words", 0.5),
        ("words", 1.0),
        ("elmo", 0.5),
        ("elmo", 1.0),
        ("layer1", 1.0),
    ]
    for r in result["runs"]:
        assert 0 <= r["test_acc"] <= 1 and r["steps"] >= 1 and r["best_step"] >= 1
    assert result["runs"][2]["train_sentences"] == 12 and len(result["runs"][3]["mix_weights"]) == 3
    assert "| elmo | 100 |" in (out.parent / "pos.md").read_text() and "| elmo | 100 |" in stdout
    assert (out.parent / "pos_sample_efficiency.png").read_bytes()[:4] == b"\x89PNG"

    # A new biLM's grid takes the word-only runs (which never read its features) from the last grid.
    again = tmp_path / "again" / "pos.json"
    code, stdout, err = run(
        capsys,
        "grid",
        "--quick",
        "--seeds",
        0,
        "--fractions",
        0.5,
        1.0,
        "--variants",
        "words",
        "layer1",
        "--reuse",
        out,
        "--reuse-variants",
        "words",
        "--data-dir",
        data,
        "--features",
        feats,
        "--out",
        again,
    )
    assert code == 0 and "reused 2 run(s) of words" in stdout, err
    second = json.loads(again.read_text())
    assert second["runs"][:2] == result["runs"][:2] and [r["variant"] for r in second["runs"]] == [
        "words",
        "words",
        "layer1",
    ]
    code, _, err = run(
        capsys,
        "grid",
        "--quick",
        "--seeds",
        1,
        "--fractions",
        0.5,
        1.0,
        "--variants",
        "words",
        "--reuse",
        out,
        "--reuse-variants",
        "words",
        "--data-dir",
        data,
        "--features",
        feats,
        "--out",
        again,
    )  # other seeds: other settings, nothing to reuse
    assert code == 2 and "grid settings differ" in err and len(err.strip().splitlines()) == 1, err

    # Features that no longer match the data are refused.
    with open(data / "dev.txt", "a", encoding="utf-8") as f:
        f.write("the/DET dog/NOUN\n")
    code, _, err = run(capsys, "grid", "--quick", "--data-dir", data, "--features", feats, "--out", out)
    assert code == 2 and "features were made from another" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "argv, message",
    [
        (["grid", "--features", "{tmp}/nowhere"], "pos_tagger.py features"),
        (
            ["features", "--options", OPTIONS, "--weights", WEIGHTS, "--data-dir", "{tmp}/nowhere", "--out", "{tmp}/f"],
            "prep_corpus.py",
        ),
        (
            ["features", "--run-dir", "{tmp}/no_run", "--data-dir", "{tmp}/brown", "--out", "{tmp}/f"],
            "cannot load the biLM",
        ),
        (
            ["features", "--options", OPTIONS, "--weights", WEIGHTS, "--data-dir", "{tmp}/bad", "--out", "{tmp}/f"],
            "bad token",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, message):
    write_brown(tmp_path / "brown")
    write_brown(tmp_path / "bad")
    (tmp_path / "bad" / "dev.txt").write_text("the/DET dog/NOUNX\n", encoding="utf-8")
    code, _, err = run(capsys, *[str(a).replace("{tmp}", str(tmp_path)) for a in argv])
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_read_split_and_vocab(tmp_path):
    path = tmp_path / "x.txt"
    path.write_text("1/2/NUM and/CONJ\n\nA/B/NOUN ./.\n", encoding="utf-8")
    words, tags = pos_tagger.read_split(str(path))
    assert words == [["1/2", "and"], ["A/B", "."]] and tags == [[7, 4], [6, 0]]
    vocab = pos_tagger.build_vocab([w.lower() for w in ["a", "b", "b", "C", "c", "d", "d", "d"]])
    assert vocab == {"d": 2, "b": 3, "c": 4}  # lowercased, count >= 2, most frequent first; 0 pad, 1 UNK


def test_batches_cover_every_sentence_once_within_budget():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 150, 500)
    ids = np.arange(0, 500, 2)
    batches = pos_tagger.plan_batches(lengths, ids, 1024, rng)
    seen = np.concatenate([b[2] for b in batches])
    assert sorted(seen) == list(ids)
    for time, rows, members in batches:
        assert len(members) <= rows and lengths[members].max() <= time and rows * time <= max(1024, time)


def test_bilstm_ignores_padding_and_reads_both_ways():
    import jax
    import jax.numpy as jnp

    model = pos_tagger.bilstm(5)
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 6, 3))
    mask = jnp.array([[True] * 6, [True] * 3 + [False] * 3])
    params = model.init(jax.random.PRNGKey(1), x, mask)
    out = model.apply(params, x, mask)
    alone = model.apply(params, x[1:, :3], mask[1:, :3])
    np.testing.assert_allclose(out[1, :3], alone[0], atol=1e-6)  # padding changes nothing
    changed = model.apply(params, x.at[1, 2].set(7.0), mask)
    assert np.allclose(changed[1, 0, :5], out[1, 0, :5])  # forward half at 0 does not see token 2
    assert not np.allclose(changed[1, 0, 5:], out[1, 0, 5:])  # backward half does
