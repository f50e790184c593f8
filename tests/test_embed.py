"""Embedding extraction: Embedder (stateless, stateful, cache, bf16) and `elmo-jax embed`."""

import json
import os
import random
import subprocess
import sys

import h5py
import numpy as np
import pytest

from elmo_jax import batch_to_ids, bilm_apply, cli, load_hdf5
from elmo_jax.embed import Embedder

from helpers import FIXTURES, model_files, reference_batches

OPTIONS, WEIGHTS = (str(p) for p in model_files("allennlp"))


@pytest.fixture(scope="module")
def model():
    return load_hdf5(OPTIONS, WEIGHTS)


@pytest.fixture(scope="module")
def sentences():
    groups = json.loads((FIXTURES / "allennlp_elmo/sentences.json").read_text())
    out = [s.split() for g in groups for s in g]
    return out + [[], ["x" * 70, "東京", "🙂"], ["a"]]


@pytest.fixture(scope="module")
def expected(model, sentences):
    config, params = model
    # One padded width for all (the stateless result does not depend on padding): one compile.
    width = max(len(s) for s in sentences)
    return [np.asarray(bilm_apply(params, config, batch_to_ids([s], min_length=width))[0])[:, 0, :len(s)]
            for s in sentences]


@pytest.mark.parametrize("kw", [{}, {"dedup": False}, {"devices": 1}, {"batch_tokens": 40}, {"batch_tokens": 100000}])
def test_embed_matches_bilm_apply_per_sentence_in_any_batching(model, sentences, expected, kw):
    config, params = model
    embedder = Embedder(config, params, **kw)
    order = list(range(len(sentences)))
    random.Random(0).shuffle(order)
    out = embedder.embed([sentences[i] for i in order])
    for got, i in zip(out, order):
        assert got.dtype == np.float32 and got.shape == (3, len(sentences[i]), 32)
        np.testing.assert_allclose(got, expected[i], atol=1e-5, rtol=0)
    # The same sentence, the same vectors, whatever else is in the call (up to rounding: alone, its
    # words and rows run in blocks and batches of other shapes, ~1e-6 apart on CPU).
    again = embedder.embed([sentences[order[0]]])[0]
    np.testing.assert_allclose(again, out[0], atol=1e-5, rtol=0)


def test_two_devices_give_the_vectors_of_one(model):
    from elmo_jax.embed import ENCODE_ROWS

    config, params = model
    rng = random.Random(3)
    words = set()
    while len(words) < 300:  # 3 char-CNN blocks: a group of 2 and a group of 1 (padded to 2)
        words.add("".join(rng.choice("abcdefghijklmnopqrstuvwxyzéß") for _ in range(rng.randint(1, 20))))
    words = sorted(words)
    rng.shuffle(words)
    sentences, lo = [], 0
    while lo < len(words):
        n = rng.choice([1, 2, 5, 9, 13, 30])
        sentences.append(words[lo:lo + n])
        lo += n
    one = Embedder(config, params, devices=1, batch_tokens=64)
    two = Embedder(config, params, devices=2, batch_tokens=64)
    assert two.n_devices == 2 and -(-len(words) // ENCODE_ROWS) == 3
    plan = two._plan([len(s) for s in sentences])
    # An odd number of batches (the last group has one), and groups whose batches differ in shape.
    assert len(plan) % 2 == 1 and len(plan) >= 5
    assert any(plan[i][1:] != plan[i + 1][1:] for i in range(0, len(plan) - 1, 2))
    calls = []

    def spy(fn):
        def call(p, *args):
            # One block or batch per device: each holds [1, ...] of the stacked group.
            assert [s.data.shape[0] for s in args[0].addressable_shards] == [1, 1]
            calls.append(fn)
            return fn(p, *args)
        return call
    two._encode_multi, two._contextualize_multi = spy(two._encode_multi), spy(two._contextualize_multi)
    got, want = two.embed(sentences), one.embed(sentences)
    assert len(calls) == 2 + len(plan) // 2
    for g, w in zip(got, want):
        assert g.dtype == np.float32
        np.testing.assert_allclose(g, w, atol=1e-6, rtol=0)  # on CPU in fact bit-equal


@pytest.mark.parametrize("budget", [1, 40, 4096])
def test_plan_covers_every_sentence_once_within_the_budget(model, budget):
    config, params = model
    rng = random.Random(budget)
    lengths = [rng.choice([0, 1, 3, 7, 20, 21, 22, 40, 90, 700]) for _ in range(3000)]
    plan = Embedder(config, params, batch_tokens=budget)._plan(lengths)
    assert sorted(i for ids, _, _ in plan for i in ids) == list(range(len(lengths)))
    for ids, rows, time in plan:
        assert len(ids) <= rows and time >= max(lengths[i] for i in ids)
        assert rows == 1 or rows * (time + 2) <= budget
    # Rows are filled up to the budget: only a batch cut short by a longer time bucket, or the
    # last one, has padding rows.
    short = [rows for ids, rows, _ in plan if len(ids) < rows]
    assert len(short) <= len({time for _, _, time in plan})


def test_stateful_mode_reproduces_the_reference_protocol(model):
    config, params = model
    embedder = Embedder(config, params, stateful=True)
    for batch, exp in reference_batches("allennlp"):
        out = embedder.embed(batch)
        for got, e in zip(out, exp):
            np.testing.assert_allclose(got[-1], e, atol=1e-5, rtol=0)
    embedder.reset()
    first_batch, first_exp = next(reference_batches("allennlp"))
    np.testing.assert_allclose(embedder.embed(first_batch)[0][-1], first_exp[0], atol=1e-5, rtol=0)
    # A smaller batch continues only the first rows.
    before = {k: v.copy() for k, v in embedder.state.items()}
    embedder.embed([["one"]])
    assert np.array_equal(embedder.state["c"][:, :, 1:], before["c"][:, :, 1:])
    assert not np.array_equal(embedder.state["c"][:, :, 0], before["c"][:, :, 0])


def test_token_cache_gives_the_same_vectors_and_falls_back_for_other_words(model, sentences, expected):
    config, params = model
    vocab = [w.strip() for w in (FIXTURES / "allennlp_elmo/vocab_test.txt").read_text().splitlines()]
    embedder = Embedder(config, params, token_cache=vocab)
    assert embedder.cache.shape == (len(set(vocab)), 16)
    in_cache = sum(w in embedder.cache_words for s in sentences for w in s)
    assert 0 < in_cache < sum(len(s) for s in sentences)  # both paths are exercised
    for got, exp in zip(embedder.embed(sentences), expected):
        np.testing.assert_allclose(got, exp, atol=1e-5, rtol=0)


def test_embed_tokens_is_the_same_function_inside_jit(model, sentences, expected):
    import jax

    from elmo_jax.chars import token_to_ids
    from elmo_jax.embed import embed_tokens

    config, params = model
    batch = sentences[:4]
    words = sorted({w for s in batch for w in s})
    cached, fresh = words[::2], words[1::2]  # half the words from a cache, half through the char CNN
    cache = Embedder(config, params, token_cache=cached).cache
    slot = {w: i for i, w in enumerate(cached + fresh)}
    index = np.zeros((4, max(len(s) for s in batch)), np.int32)
    for r, s in enumerate(batch):
        index[r, :len(s)] = [slot[w] for w in s]
    chars = np.stack([token_to_ids(w, 50) for w in fresh])
    fn = jax.jit(lambda p, *a: embed_tokens(p, config, *a)[0])
    layers = np.asarray(fn(params, chars, index, np.array([len(s) for s in batch], np.int32), cache,
                           np.arange(len(cached), dtype=np.int32)))
    for r, s in enumerate(batch):
        np.testing.assert_allclose(layers[:, r, :len(s)], expected[r], atol=1e-5, rtol=0)


def test_bfloat16_is_close_to_float32(model, sentences, expected):
    config, params = model
    out = Embedder(config, params, dtype="bfloat16").embed(sentences[:6])
    for got, exp in zip(out, expected[:6]):
        assert got.dtype == np.float32
        assert np.all(np.abs(got - exp) <= 2e-2 + 1e-2 * np.abs(exp))


def run_cli(*args):
    return cli.main(["embed", "--options", OPTIONS, "--weights", WEIGHTS, "--no-progress", *args])


def test_cli_writes_bilm_tf_dump_format(tmp_path, model, expected, sentences):
    lines = [" ".join(s) for s in sentences]
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert run_cli("--input", str(tmp_path / "in.txt"), "--output", str(tmp_path / "all.hdf5"),
                   "--sentence-to-index", "--batch-tokens", "64", "--window", "7") == 0
    with h5py.File(tmp_path / "all.hdf5", "r") as f:
        assert sorted(f.keys(), key=lambda k: (k != "sentence_to_index", k.zfill(5))) == \
            ["sentence_to_index"] + [str(i) for i in range(len(lines))]
        for i, exp in enumerate(expected):
            assert f[str(i)].dtype == np.float32 and f[str(i)].shape == (3, len(sentences[i]), 32)
            np.testing.assert_allclose(f[str(i)][...], exp, atol=1e-5, rtol=0)
        index = json.loads(f["sentence_to_index"][()])
        assert index[lines[3]] == "3"
    for layers, pick in (("top", lambda e: e[-1]), ("average", lambda e: e.mean(axis=0))):
        assert run_cli("--input", str(tmp_path / "in.txt"), "--output", str(tmp_path / f"{layers}.hdf5"),
                       "--layers", layers) == 0
        with h5py.File(tmp_path / f"{layers}.hdf5", "r") as f:
            for i, exp in enumerate(expected):
                assert f[str(i)].shape == (len(sentences[i]), 32)
                np.testing.assert_allclose(f[str(i)][...], pick(exp), atol=1e-5, rtol=0)
    assert sorted(os.listdir(tmp_path)) == ["all.hdf5", "average.hdf5", "in.txt", "top.hdf5"]


def test_cli_long_line_runs_whole(tmp_path, model):
    config, params = model
    words = [f"w{i % 97}" for i in range(5000)]
    (tmp_path / "in.txt").write_text(" ".join(words) + "\n")
    assert run_cli("--input", str(tmp_path / "in.txt"), "--output", str(tmp_path / "o.hdf5"), "--layers", "top") == 0
    with h5py.File(tmp_path / "o.hdf5", "r") as f:
        got = f["0"][...]
    assert got.shape == (5000, 32)
    ref = np.asarray(bilm_apply(params, config, batch_to_ids([words]))[0])[-1, 0]
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)


def test_cli_bad_input(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    assert run_cli("--input", str(tmp_path / "empty.txt"), "--output", str(tmp_path / "e.hdf5")) == 0
    with h5py.File(tmp_path / "e.hdf5", "r") as f:
        assert list(f.keys()) == []
    assert "is empty; wrote" in capsys.readouterr().err
    (tmp_path / "bad.txt").write_bytes(b"fine line\nbad \xff line\n")
    assert run_cli("--input", str(tmp_path / "bad.txt"), "--output", str(tmp_path / "b.hdf5")) == 2
    err = capsys.readouterr().err
    assert "bad.txt: line 2: not UTF-8" in err and "Traceback" not in err
    assert not (tmp_path / "b.hdf5").exists()
    assert sorted(os.listdir(tmp_path)) == ["bad.txt", "e.hdf5", "empty.txt"]  # no temporary file left
    assert run_cli("--input", str(tmp_path / "empty.txt"), "--output", str(tmp_path / "missing/o.hdf5")) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli.main(["embed", "--run-dir", str(tmp_path), "--input", str(tmp_path / "empty.txt"),
                     "--output", str(tmp_path / "x.hdf5")]) == 2
    assert "not a run directory" in capsys.readouterr().err
    opts = json.loads(open(OPTIONS).read())
    opts["lstm"]["dim"] = 32
    (tmp_path / "o.json").write_text(json.dumps(opts))
    assert cli.main(["embed", "--options", str(tmp_path / "o.json"), "--weights", WEIGHTS, "--input",
                     str(tmp_path / "empty.txt"), "--output", str(tmp_path / "x.hdf5")]) == 2
    assert "has shape (32, 256), expected (32, 128)" in capsys.readouterr().err


def test_ctrl_c_leaves_no_file_under_the_final_name(tmp_path, monkeypatch, sentences):
    (tmp_path / "in.txt").write_text("\n".join(" ".join(s) for s in sentences) + "\n")

    def interrupted(self, lines, window=2048):
        yield 0, np.zeros((3, 1, 32), np.float32)
        raise KeyboardInterrupt
    monkeypatch.setattr(Embedder, "embed_stream", interrupted)
    assert run_cli("--input", str(tmp_path / "in.txt"), "--output", str(tmp_path / "o.hdf5")) == 130
    assert sorted(os.listdir(tmp_path)) == ["in.txt"]


def _peak_rss_kb(tmp_path, n_lines):
    path = tmp_path / f"in{n_lines}.txt"
    rng = random.Random(n_lines)
    with open(path, "w") as f:
        for _ in range(n_lines):
            f.write(" ".join(rng.choice(["the", "cat", "sat", "on", "a", "mat", "dog", "ran"]) for _ in range(4)) + "\n")
    code = ("import resource, sys; from elmo_jax.cli import main; "
            f"rc = main(['embed', '--options', {OPTIONS!r}, '--weights', {WEIGHTS!r}, '--input', {str(path)!r}, "
            f"'--output', {str(tmp_path / 'o.hdf5')!r}, '--layers', 'top', '--no-progress']); "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); sys.exit(rc)")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr
    return int(r.stdout.strip().splitlines()[-1])


def test_cli_memory_does_not_grow_with_the_input(tmp_path):
    small, large = _peak_rss_kb(tmp_path, 5_000), _peak_rss_kb(tmp_path, 50_000)
    assert large <= 1.2 * small, (small, large)


def test_cli_compile_cache_second_run_compiles_nothing(tmp_path, sentences):
    (tmp_path / "in.txt").write_text("\n".join(" ".join(s) for s in sentences[:6]) + "\n")
    # jax's compiler logs each persistent-cache miss and hit at debug level.
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
           "JAX_DEBUG_LOG_MODULES": "jax._src.compiler"}

    def run(out):
        cmd = [sys.executable, "-m", "elmo_jax", "--compile-cache", str(tmp_path / "xla"), "embed", "--options",
               OPTIONS, "--weights", WEIGHTS, "--input", str(tmp_path / "in.txt"), "--output", str(tmp_path / out),
               "--no-progress"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        assert r.returncode == 0, r.stderr
        return r.stderr.count("PERSISTENT COMPILATION CACHE MISS"), r.stderr.count("Persistent compilation cache hit")

    misses, hits = run("a.hdf5")
    assert misses >= 3 and hits == 0  # the char CNN, the gather, the biLSTM (and the marker vectors)
    assert run("b.hdf5") == (0, misses)
    with h5py.File(tmp_path / "a.hdf5") as a, h5py.File(tmp_path / "b.hdf5") as b:
        assert sorted(a) == sorted(b)
        for k in a:
            np.testing.assert_array_equal(a[k][()], b[k][()])
