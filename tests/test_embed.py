"""Embedding extraction: Embedder (stateless, stateful, cache, bf16) and the files `elmo-jax embed` writes
(its flags, messages and exit codes: test_cli.py)."""

import contextlib
import dataclasses
import json
import os
import pathlib
import random
import re
import subprocess
import sys
import threading
import warnings

import h5py
import numpy as np
import pytest
from helpers import FIXTURES, compiled_programs, embed_sentences, model_files, reference_batches, xla_flags

from elmo_jax import batch_to_ids, bilm_apply, cli, load_hdf5
from elmo_jax.config import ConfigError
from elmo_jax.extract.embedder import Embedder
from elmo_jax.model.layout import Layout
from elmo_jax.model.vocabulary import Vocabulary

OPTIONS, WEIGHTS = (str(p) for p in model_files("allennlp"))


@pytest.fixture(scope="module")
def model():
    return load_hdf5(OPTIONS, WEIGHTS)


@pytest.fixture(scope="module")
def sentences():
    return embed_sentences()


@pytest.fixture(scope="module")
def expected(model, sentences):
    config, params = model
    # One padded width for all (the stateless result does not depend on padding): one compile.
    width = max(len(s) for s in sentences)
    return [
        np.asarray(bilm_apply(params, config, batch_to_ids([s], min_length=width))[0])[:, 0, : len(s)]
        for s in sentences
    ]


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"dedup": False},
        {"devices": 1},
        {"batch_tokens": 40},
        {"batch_tokens": 100000},
        {"layout": Layout("rows", 3, 0, extract_steps=5, extract_tokens=10)},
        {"layout": Layout("rows", 3, 0, extract_steps=5, extract_tokens=10, lstm_wavefront=True)},
    ],
)
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


def _every_layer_and_the_top(model, sentences, **fields) -> dict:
    """``{value: {"all" | "top": embed's arrays}}`` for each value of the one ``Layout`` field given
    as a tuple (the other fields fixed), under a layout of many short calls: sentences cross them."""
    config, params = model
    [(name, values)] = [(k, v) for k, v in fields.items() if isinstance(v, tuple)]
    layout = Layout(
        "columns", 1, 32, extract_steps=4, extract_tokens=64, **{k: v for k, v in fields.items() if k != name}
    )
    return {
        value: {
            layers: Embedder(config, params, layout=dataclasses.replace(layout, **{name: value})).embed(
                sentences, layers=layers
            )
            for layers in ("all", "top")
        }
        for value in values
    }


def test_copy_threads_give_the_same_arrays_and_do_the_copies(model, sentences, monkeypatch):
    """Outputs copied into the sentences' arrays by several threads (``Layout.extract_copy_threads``)
    equal, bit for bit, those copied by the calling thread alone; and the copies did run in the
    copy threads (else the comparison would hold vacuously)."""
    from elmo_jax.extract import embedder as module

    used: list[int] = []
    where: set[str] = set()
    made = module.copy_threads

    @contextlib.contextmanager
    def watched(threads):
        used.append(threads)
        with made(threads) as run:

            def run_watched(fn, items):
                def fn_watched(part):
                    where.add(threading.current_thread().name)
                    fn(part)

                run(fn_watched, items)

            yield run_watched

    monkeypatch.setattr(module, "copy_threads", watched)
    out = _every_layer_and_the_top(model, sentences, extract_copy_threads=(1, 2))
    assert used == [1, 1, 2, 2] and any(n.startswith("elmo-copy") for n in where) and "MainThread" in where
    for layers in ("all", "top"):
        for a, b in zip(out[1][layers], out[2][layers]):
            np.testing.assert_array_equal(a, b)


def test_outputs_in_shared_blocks_equal_each_sentence_s_own_array(model, sentences):
    """``Layout.extract_block_mib``: the sentences' arrays are views into shared blocks, bit for bit
    the arrays of the default (one allocation a sentence), C-contiguous and of the same shapes, with
    every layer or one. The negative control: by default no two sentences share memory."""
    out = _every_layer_and_the_top(model, sentences, extract_block_mib=(0, 1), extract_copy_threads=2)
    for layers in ("all", "top"):
        own, shared = out[0][layers], out[1][layers]
        assert len(own) == len(shared) == len(sentences)
        for a, b in zip(own, shared):
            assert a.shape == b.shape and a.dtype == b.dtype == np.float32 and b.flags.c_contiguous
            np.testing.assert_array_equal(a, b)
        # The memory's owner (numpy points a view of a view at the array that owns the memory).
        owners = {mib: [x if x.base is None else x.base for x in out[mib][layers]] for mib in (0, 1)}
        assert len({id(o) for o in owners[0]}) == len(sentences), "the default's arrays share memory"
        # The fixture's sentences (a few KiB each) fit in one 1 MiB block.
        assert len({id(o) for o in owners[1]}) == 1 and owners[1][0].size == sum(x.size for x in shared)


def test_block_views_fill_each_block_to_its_size_then_start_the_next():
    from elmo_jax.extract.packing import block_views

    views = block_views([3, 5, 0, 7, 2, 9], block_bytes=32)  # blocks of 8 floats or more
    assert [v.shape for v in views] == [(3,), (5,), (0,), (7,), (2,), (9,)]
    assert all(v.dtype == np.float32 and v.flags.c_contiguous for v in views)
    blocks = [v.base for v in views]
    # [3, 5] make 8; [0, 7, 2] make 9; [9] alone (the last block)
    assert blocks[0] is blocks[1] and blocks[2] is blocks[3] is blocks[4] and blocks[5] is not blocks[4]
    assert blocks[1] is not blocks[2] and [b.size for b in (blocks[0], blocks[2], blocks[5])] == [8, 9, 9]
    for v in views:  # each view is its own part of its block
        v[...] = v.size
    assert [int(v[0]) for v in views if v.size] == [3, 5, 7, 2, 9]
    assert block_views([], 32) == [] and len({id(v.base) for v in block_views([4] * 6, 1 << 20)}) == 1


def test_an_error_in_a_copy_thread_reaches_the_caller():
    from elmo_jax.extract.packing import copy_threads

    def fail(part):
        if 3 in part:
            raise MemoryError("no room for the copy")

    with pytest.raises(MemoryError, match="no room"), copy_threads(2) as run:
        run(fail, np.arange(8))


def test_two_devices_give_the_vectors_of_one(model):
    from elmo_jax.extract.embedder import ENCODE_ROWS

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
        sentences.append(words[lo : lo + n])
        lo += n
    layout = Layout("columns", 1, 32, extract_steps=32)
    one = Embedder(config, params, devices=1, batch_tokens=64, layout=layout)
    two = Embedder(config, params, devices=2, batch_tokens=64, layout=layout)
    assert two.n_devices == 2 and -(-len(words) // ENCODE_ROWS) == 3
    pack = two._packing([len(s) for s in sentences])
    assert pack.rows == 4 and pack.calls > 1  # 2 rows a device; sentences cross calls
    calls = []

    def spy(fn, axis):
        def call(p, *args, **kw):
            # Each device holds its own part of the inputs: one block, or half the rows.
            assert [s.data.shape[axis] for s in args[0].addressable_shards] == [1 if axis == 0 else 2] * 2
            calls.append(fn)
            return fn(p, *args, **kw)

        return call

    two._encode_multi, two._packed_multi = spy(two._encode_multi, 0), spy(two._packed_multi, 1)
    got, want = two.embed(sentences), one.embed(sentences)
    assert len(calls) == 2 + pack.calls
    for g, w in zip(got, want):
        assert g.dtype == np.float32
        np.testing.assert_allclose(g, w, atol=1e-6, rtol=0)


@pytest.mark.parametrize("budget,devices", [(1, 1), (40, 2), (4096, 1), (4096, 2)])
def test_packing_places_every_sentence_once_without_overlap_within_the_budget(model, budget, devices):

    config, params = model
    rng = random.Random(budget)
    lengths = [rng.choice([0, 1, 3, 7, 20, 21, 22, 40, 90, 700]) for _ in range(3000)]
    layout = Layout("columns", 1, 32, extract_steps=16)
    pack = Embedder(config, params, batch_tokens=budget, devices=devices, layout=layout)._packing(lengths)
    assert pack.rows % devices == 0 and pack.steps == 16
    assert pack.rows // devices <= max(1, budget // 16)  # rows x steps within the budget (or one row)
    used = np.zeros((pack.rows, pack.calls * pack.steps), np.int64)
    for n, r, s in zip(lengths, pack.row, pack.start):
        if n:
            used[r, s : s + n + 2] += 1  # raises if past the last call
            assert s + n + 2 <= used.shape[1]
    assert used.max() == 1 and used.sum() == sum(n + 2 for n in lengths if n)
    # Each row is filled from its start (padding only at the end), and no row is longer than the
    # mean plus the longest sentence (LPT), so the last call is the only one with much padding.
    loads = used.sum(axis=1)
    assert all(used[r, : loads[r]].all() for r in range(pack.rows))
    assert loads.max() <= loads.mean() + max(lengths) + 2
    assert (pack.calls - 1) * pack.steps < loads.max()


def test_a_small_call_runs_one_short_call_and_jobs_share_one_bilstm_program(model):
    from elmo_jax.extract.packing import length_bucket

    config, params = model
    embedder = Embedder(
        config, params, devices=1, layout=Layout("columns", 1, 32, extract_steps=16, extract_tokens=128)
    )
    pack = embedder._packing([3, 5, 4])  # in 4 rows, 7 steps: one call of a length bucket, not of 16 steps
    assert (pack.rows, pack.steps, pack.calls) == (4, length_bucket(5) + 2, 1) and pack.steps < 16
    rng = random.Random(0)
    # Each job has its own vocabulary size, so its token table is a bucket of its own; its words
    # are all 5 chars, so their char-CNN blocks all have one shape.
    jobs = [
        [[f"w{rng.randrange(v):04d}" for _ in range(rng.randint(1, 25))] for _ in range(n)]
        for n, v in ((200, 150), (90, 600), (300, 3000))
    ]
    with compiled_programs() as compiles:
        for k, job in enumerate(jobs):
            pack = embedder._packing([len(s) for s in job])
            assert (pack.rows, pack.steps) == (8, 16) and pack.calls > 10
            embedder.embed(job)
            if k == 0:
                compiles.clear()
    # Every biLSTM call of the later jobs ran the program the first one compiled; only the lookup
    # of their larger token tables compiled again.
    assert compiles == ["jit(_gather)"] * 2


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


@pytest.mark.parametrize("devices", [1, 2])
def test_a_second_embedder_of_the_same_model_compiles_nothing(model, sentences, devices):
    """A notebook or a server that makes another Embedder (the same config and precision) runs the
    programs the first one compiled (before: the char CNN and the biLSTM compiled again, as each
    Embedder jitted partials of its own)."""
    config, params = model
    first = Embedder(config, params, devices=devices)
    want = first.embed(sentences)
    with compiled_programs() as compiles:
        got = Embedder(config, params, devices=devices).embed(sentences)
        second = list(compiles)
        Embedder(config, params, devices=devices, precision="bfloat16").embed(sentences)  # the control
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert second == []
    # Another precision is another program: the listener hears a compile when there is one.
    assert len(compiles) >= 2, compiles


@pytest.mark.slow
def test_stateful_batches_of_other_sizes_run_one_program_and_continue_each_row(model):
    """Rows are padded to a power of two with inactive rows, whose state passes through: batch
    sizes 6, 5, 8, 7 compile one biLSTM program (before: one per size), a later batch of 2 one
    more, and each row continues its own state as ``bilm_apply`` with the state carried by hand
    gives."""
    config, params = model
    embedder = Embedder(config, params, stateful=True)
    compiled = embedder._contextualize._cache_size()  # shared by the Embedders of this model
    words = ["the", "cat", "sat", "on", "a", "mat", "today"]
    l = config.lstm
    state = {
        "c": np.zeros((2, l.n_layers, 8, l.dim), np.float32),
        "h": np.zeros((2, l.n_layers, 8, l.projection_dim), np.float32),
    }
    for k, n in enumerate((6, 5, 8, 7, 2)):
        batch = [words[(k + r) % 4 : (k + r) % 4 + 3] for r in range(n)]  # three tokens each: one length bucket
        got = embedder.embed(batch)
        layers, _, new = bilm_apply(params, config, batch_to_ids(batch), {x: v[:, :, :n] for x, v in state.items()})
        for x in state:
            state[x][:, :, :n] = np.asarray(new[x])
        for r in range(n):
            np.testing.assert_allclose(got[r], np.asarray(layers)[:, r, :3], atol=1e-6, rtol=0)
        np.testing.assert_allclose(embedder.state["c"][:, :, :n], state["c"][:, :, :n], atol=1e-5, rtol=0)
        if k == 3:  # sizes 6, 5, 8 and 7: one program (none if an earlier test made it)
            assert embedder._contextualize._cache_size() - compiled <= 1
    assert embedder.state["c"].shape[2] == 8  # the largest call's rows


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

    from elmo_jax.extract.embedder import embed_tokens
    from elmo_jax.model.vocabulary import token_to_ids

    config, params = model
    batch = sentences[:4]
    words = sorted({w for s in batch for w in s})
    cached, fresh = words[::2], words[1::2]  # half the words from a cache, half through the char CNN
    cache = Embedder(config, params, token_cache=cached).cache
    slot = {w: i for i, w in enumerate(cached + fresh)}
    index = np.zeros((4, max(len(s) for s in batch)), np.int32)
    for r, s in enumerate(batch):
        index[r, : len(s)] = [slot[w] for w in s]
    chars = np.stack([token_to_ids(w, 50) for w in fresh])
    fn = jax.jit(
        lambda p, chars, index, lengths, cache, cache_index: embed_tokens(
            p, config, chars, index, lengths, cache=cache, cache_index=cache_index
        )[0]
    )
    layers = np.asarray(
        fn(
            params,
            chars,
            index,
            np.array([len(s) for s in batch], np.int32),
            cache,
            np.arange(len(cached), dtype=np.int32),
        )
    )
    for r, s in enumerate(batch):
        np.testing.assert_allclose(layers[:, r, : len(s)], expected[r], atol=1e-5, rtol=0)


def test_bfloat16_is_close_to_float32(model, sentences, expected):
    config, params = model
    out = Embedder(config, params, precision="bfloat16").embed(sentences[:6])
    for got, exp in zip(out, expected[:6]):
        assert got.dtype == np.float32
        assert np.all(np.abs(got - exp) <= 2e-2 + 1e-2 * np.abs(exp))


@pytest.fixture(scope="module")
def embedder(model):
    return Embedder(*model)


def test_a_str_where_tokens_are_expected_is_rejected(embedder):
    with pytest.raises(
        TypeError,
        match=r"^sentence 1 is a str \('The cat sat'\); expected a list of tokens: use "
        r"embed_texts\(\) for raw text",
    ):
        embedder.embed([["ok"], "The cat sat"])
    with pytest.raises(TypeError, match="^sentences is one str"):
        embedder.embed("The cat sat")
    with pytest.raises(TypeError, match="^sentences is a NoneType; expected a list of token lists"):
        embedder.embed(None)
    with pytest.raises(TypeError, match=r"^texts is a NoneType; expected a list of strings \(one sentence each\)"):
        embedder.embed_texts(None)
    with pytest.raises(
        TypeError, match=r"^inputs is one str \('hello world'\); expected a list of strings or of token lists"
    ):
        embedder.hub_outputs("hello world")  # not 11 one-letter sentences
    with pytest.raises(TypeError, match=r"^sentence 0, token 1 has type int \(3\); expected str$"):
        embedder.embed([["a", 3]])
    with pytest.raises(TypeError, match="^sentence 0 is a str .* str.split"):
        batch_to_ids(["The cat sat"])
    with pytest.raises(TypeError, match=r"^sentence 1, token 0 has type bytes"):
        batch_to_ids([["a"], [b"b"]])
    assert batch_to_ids([("a", "b"), ["c"]]).shape == (2, 2, 50)  # any sequence of str is fine
    generated = batch_to_ids(s.split() for s in ["a b", "c"])  # (before: "object of type 'generator' has no len()")
    np.testing.assert_array_equal(generated, batch_to_ids([["a", "b"], ["c"]]))
    # A cache of words and a vocabulary's ids, alike (before: "The apple" cached 7 letters, and
    # encode("the cat") gave 7 ids).
    with pytest.raises(TypeError, match=r"^token_cache is one str \('The apple'\); expected a list of words"):
        Embedder(embedder.config, embedder.params, token_cache="The apple")
    with pytest.raises(TypeError, match=r"^token_cache\[0\] has type int \(3\); expected str$"):
        Embedder(embedder.config, embedder.params, token_cache=[3, "a"])
    vocab = Vocabulary(["<S>", "</S>", "<UNK>", "the", "cat"])
    with pytest.raises(TypeError, match=r"^words is one str \('the cat'\); expected a list of words$"):
        vocab.encode("the cat")
    assert vocab.encode("the cat".split()).tolist() == [3, 4]


def test_more_devices_than_the_process_has_are_said(model):
    """(Before: devices=3 on this 2-device process ran on 2 without a word.)"""
    with pytest.warns(UserWarning, match=r"^devices=3, but this process has 2 local device\(s\): embedding on 2$"):
        assert Embedder(*model, devices=3).n_devices == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Embedder(*model, devices=2).n_devices == 2


def test_weights_that_are_not_the_configs_bilm_are_refused_before_anything_compiles(model):
    """(Before: a KeyError 'char_cnn' for a training state's params, jax's "Cannot interpret value
    of type ModelConfig" for the two swapped, a broadcasting error for another model's weights.)"""
    config, params = model
    with pytest.raises(TypeError, match=r"got \['bilm', 'softmax'\]: a training state's params hold the biLM's"):
        Embedder(config, {"bilm": params, "softmax": {}})
    with pytest.raises(TypeError, match="^config is a dict; expected a ModelConfig$"):
        Embedder(params, config)  # type: ignore[arg-type]
    smaller = dataclasses.replace(config, lstm=dataclasses.replace(config.lstm, projection_dim=8))
    with pytest.raises(
        ValueError,
        match=r"^params are not this config's biLM: params\['char_cnn'\]\['proj'\]\['b'\] is \(16,\) where the config's is \(8,\)",
    ):
        Embedder(smaller, params)


def test_embed_stream_checks_its_arguments_when_called_not_at_its_first_window(embedder):
    """(Before: ``window=0`` held every sentence, then embedded them all at once, without a word;
    a bad ``layers`` was said only once a window's sentences had been read.)"""
    read = []

    def lines():
        for s in [["a", "b"], ["c"], ["d", "e", "f"]]:
            read.append(s)
            yield s

    for kwargs, error, said in [
        ({"window": 0}, ConfigError, "window must be an integer >= 1; got 0"),
        ({"window": 2.5}, ConfigError, "window must be an integer >= 1; got 2.5"),
        ({"layers": "bottom"}, ValueError, "layers"),
        ({"pool": "sum"}, ValueError, "pool"),
    ]:
        with pytest.raises(error, match=re.escape(said)):
            embedder.embed_stream(lines(), **kwargs)
    assert read == []
    got = list(embedder.embed_stream(lines(), window=2, layers="top"))
    assert [k for k, _ in got] == [0, 1, 2] and [x.shape[0] for _, x in got] == [2, 1, 3]


def test_embed_texts_is_embed_of_the_tokenized_text(embedder):
    from elmo_jax.text.tokenize import tokenize

    texts = ["The cat can't sit on the mat.", "“Yes,” said Mr. Smith.", ""]
    for got, want in zip(embedder.embed_texts(texts), embedder.embed([tokenize(t) for t in texts])):
        np.testing.assert_array_equal(got, want)
    assert embedder.embed_texts(["The cat."])[0].shape == (3, 3, 32)  # "The cat ." by elmo_jax.text.tokenize's rules
    got = embedder.embed_texts(["The cat."], tokenizer=str.split, layers="top", pool="mean")[0]
    np.testing.assert_array_equal(got, embedder.embed([["The", "cat."]], layers="top", pool="mean")[0])
    with pytest.raises(TypeError, match=r"^text 1 has type list; expected a str \(for tokenized sentences use embed"):
        embedder.embed_texts(["fine", ["The", "cat"]])
    with pytest.raises(TypeError, match="^the tokenizer returned a str for text 0"):
        embedder.embed_texts(["fine"], tokenizer=str.lower)
    with pytest.raises(TypeError, match=r"^tokenizer is a int; expected a function str -> list of tokens"):
        embedder.embed_texts(["fine"], tokenizer=5)  # before: 'int' object is not callable
    with pytest.raises(TypeError, match=r"^tokenizer is a str; expected a function"):
        embedder.hub_outputs(["fine"], tokenizer="split")


def test_layer_choice(embedder, sentences, expected):
    some = sentences[:5] + [[]]
    want = expected[:5] + [expected[sentences.index([])]]
    weights = [0.5, -1.0, 2.0]  # used as given: not normalised
    for layers, pick in (
        ("top", lambda e: e[-1]),
        ("average", lambda e: e.mean(axis=0)),
        (weights, lambda e: 0.5 * e[0] - e[1] + 2 * e[2]),
        ("all", lambda e: e),
    ):
        for got, e in zip(embedder.embed(some, layers=layers), want):
            assert got.dtype == np.float32 and got.shape == pick(e).shape
            np.testing.assert_allclose(got, pick(e), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"^layers: expected 3 weights \(one per ELMo layer\), got shape \[2\]"):
        embedder.embed(some, layers=[0.5, 0.5])
    with pytest.raises(ValueError, match="^layers='bottom'"):
        embedder.embed(some, layers="bottom")


def test_a_layer_mix_is_computed_before_the_host_and_equals_the_mix_of_all_layers(model, sentences):
    """``layers`` other than "all" are mixed on the device, per call of packed rows (here 5 steps
    a call, so sentences cross calls): the host receives and keeps one layer, not all of them."""
    config, params = model
    embedder = Embedder(config, params, layout=Layout("columns", 1, 32, extract_steps=5, extract_tokens=10))
    assert embedder._packing([len(s) for s in sentences]).calls > 20
    full = embedder.embed(sentences)
    weights = np.float32([0.5, -1.0, 2.0])
    for layers, pick, tol in (
        ("top", lambda e: e[-1], 0.0),
        ("average", lambda e: e.mean(axis=0), 1e-6),
        (weights, lambda e: np.tensordot(weights, e, axes=1), 1e-6),
    ):
        for got, e in zip(embedder.embed(sentences, layers=layers), full):
            assert got.shape == e.shape[1:] and got.flags.c_contiguous
            assert got.base is None or got.base.nbytes == got.nbytes  # no hidden copy of every layer
            np.testing.assert_allclose(got, pick(e), atol=tol, rtol=0)


def test_pooling_over_the_tokens(embedder, sentences):
    some = [sentences[0], [], sentences[3], []]
    full = embedder.embed(some)
    with pytest.warns(UserWarning, match=r"^2 empty sentence\(s\) pooled to zero vectors$") as caught:
        mean_all = embedder.embed(some, pool="mean")
    assert len(caught) == 1  # once per call
    with pytest.warns(UserWarning, match="^2 empty"):
        top_max = embedder.embed(some, layers="top", pool="max")
    for x, m, t in zip(full, mean_all, top_max):
        assert m.shape == (3, 32) and t.shape == (32,)
        np.testing.assert_allclose(m, x.mean(axis=1) if x.shape[1] else np.zeros((3, 32)), atol=1e-6, rtol=0)
        np.testing.assert_allclose(t, x[-1].max(axis=0) if x.shape[1] else np.zeros(32), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="^pool='sum'"):
        embedder.embed(some, pool="sum")
    # No sentence at all, pooled or not (before: a ValueError from a reshape of the empty sums).
    for pool in (None, "mean", "max"):
        assert embedder.embed([], pool=pool) == [] and embedder.embed([], layers="top", pool=pool) == []


@pytest.mark.parametrize("devices", [1, 2])
def test_pooling_runs_on_the_device_and_equals_pooling_every_token(model, sentences, devices, monkeypatch):
    """Pooled, the host receives one sum (or max) per piece of a sentence that a call runs, never
    its tokens' vectors; with 5-step calls most sentences are split over several calls."""
    from elmo_jax.extract.embedder import pool_tokens, select_layers
    from elmo_jax.extract.packing import Packing

    config, params = model
    embedder = Embedder(
        config, params, devices=devices, layout=Layout("columns", 1, 32, extract_steps=5, extract_tokens=10)
    )
    assert embedder.n_devices == devices
    some = sentences
    full = embedder.embed(some)

    def no_scatter(*_):
        raise AssertionError("pooled output went through the per-token copy")

    monkeypatch.setattr(Packing, "scatter", no_scatter)
    cases = [("all", "mean", 1e-6), ("all", "max", 0.0), ([0.5, -1.0, 2.0], "max", 1e-6)]
    with pytest.warns(UserWarning, match=r"^1 empty"):
        for layers, pool, tol in cases if devices == 1 else cases[:1]:
            got = embedder.embed(some, layers=layers, pool=pool)
            for g, x in zip(got, full):
                want = pool_tokens(select_layers(x, layers), pool)
                assert g.dtype == np.float32 and g.shape == want.shape and g.base is None
                np.testing.assert_allclose(g, want, atol=tol, rtol=0)


@pytest.mark.parametrize("devices", [1, 2])
def test_pieces_name_each_sentences_tokens_in_every_call(devices):
    from elmo_jax.extract.packing import batch_rows, pack_sentences

    rng = random.Random(devices)
    lengths = [rng.choice([0, 1, 2, 5, 9, 30, 61]) for _ in range(400)]
    pack = pack_sentences(lengths, devices, 8 * 7, 7)
    segment, owner = pack.pieces(devices)
    per_device, s = pack.rows // devices, owner.shape[1] // devices
    assert pack.calls > 10 and s == batch_rows(s) and segment.shape == (pack.rows, pack.calls * pack.steps)
    seen = np.zeros(segment.shape, bool)
    for i, (n, r, start) in enumerate(zip(lengths, pack.row, pack.start)):
        for t in range(start + 1, start + n + 1):  # the sentence's token steps, markers excluded
            c, piece = t // pack.steps, segment[r, t]
            assert 0 <= piece < s and owner[c, (r // per_device) * s + piece] == i
            seen[r, t] = True
    assert (segment[~seen] == -1).all()
    assert sorted(owner[owner >= 0].tolist()) == sorted(  # each (sentence, call) pair once
        i
        for i, (n, st) in enumerate(zip(lengths, pack.start))
        if n
        for _ in range((st + n) // pack.steps - (st + 1) // pack.steps + 1)
    )


def test_hub_outputs_have_tf_hubs_names_shapes_and_values(embedder):
    texts = ["the cat is on the mat", "dogs are in the fog", ""]
    with pytest.warns(UserWarning, match="^1 empty sentence"):
        hub = embedder.hub_outputs(texts)  # split on spaces, as the hub's default signature
    assert {k: v.shape for k, v in hub.items()} == {
        "word_emb": (3, 6, 16),
        "lstm_outputs1": (3, 6, 32),
        "lstm_outputs2": (3, 6, 32),
        "elmo": (3, 6, 32),
        "default": (3, 32),
        "sequence_len": (3,),
    }
    assert hub["sequence_len"].tolist() == [6, 5, 0] and hub["sequence_len"].dtype == np.int32
    assert all(v.dtype == np.float32 for k, v in hub.items() if k != "sequence_len")
    for b, layers in enumerate(embedder.embed([t.split() for t in texts])):
        n = layers.shape[1]
        np.testing.assert_array_equal(hub["word_emb"][b, :n], layers[0, :, :16])  # the char CNN, not doubled
        np.testing.assert_array_equal(layers[0, :, 16:], layers[0, :, :16])
        np.testing.assert_array_equal(hub["lstm_outputs1"][b, :n], layers[1])
        np.testing.assert_array_equal(hub["lstm_outputs2"][b, :n], layers[2])
        np.testing.assert_allclose(hub["elmo"][b, :n], layers.mean(axis=0), atol=1e-6, rtol=0)
        np.testing.assert_allclose(hub["default"][b], layers.mean(axis=0).mean(axis=0) if n else 0, atol=1e-6)
        for k in ("word_emb", "lstm_outputs1", "lstm_outputs2", "elmo"):
            assert not hub[k][b, n:].any()  # zero padding
    tokens = embedder.hub_outputs([t.split() for t in texts[:2]], weights=[0.0, 0.0, 1.0])  # the tokens signature
    np.testing.assert_allclose(tokens["elmo"], hub["lstm_outputs2"][:2], atol=1e-6, rtol=0)
    with pytest.raises(TypeError, match="mixes raw strings and token lists"):
        embedder.hub_outputs(["a b", ["a", "b"]])


def run_cli(*args):
    return cli.main(["embed", "--options", OPTIONS, "--weights", WEIGHTS, "--no-progress", *args])


def test_cli_writes_bilm_tf_dump_format(tmp_path, model, expected, sentences):
    lines = [" ".join(s) for s in sentences]
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert (
        run_cli(
            "--input",
            str(tmp_path / "in.txt"),
            "--output",
            str(tmp_path / "all.hdf5"),
            "--sentence-to-index",
            "--batch-tokens",
            "64",
            "--window",
            "7",
        )
        == 0
    )
    with h5py.File(tmp_path / "all.hdf5", "r") as f:
        assert sorted(f.keys(), key=lambda k: (k != "sentence_to_index", k.zfill(5))) == ["sentence_to_index"] + [
            str(i) for i in range(len(lines))
        ]
        for i, exp in enumerate(expected):
            assert f[str(i)].dtype == np.float32 and f[str(i)].shape == (3, len(sentences[i]), 32)
            np.testing.assert_allclose(f[str(i)][...], exp, atol=1e-5, rtol=0)
        index = json.loads(f["sentence_to_index"][()])
        assert index[lines[3]] == "3"
    for layers, pick in (("top", lambda e: e[-1]), ("average", lambda e: e.mean(axis=0))):
        assert (
            run_cli(
                "--input", str(tmp_path / "in.txt"), "--output", str(tmp_path / f"{layers}.hdf5"), "--layers", layers
            )
            == 0
        )
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


def test_cli_pool_writes_one_dataset(tmp_path, expected, sentences, capsys):
    (tmp_path / "in.txt").write_text("\n".join(" ".join(s) for s in sentences) + "\n", encoding="utf-8")
    empty = sentences.index([])
    assert (
        run_cli(
            "--input",
            str(tmp_path / "in.txt"),
            "--output",
            str(tmp_path / "mean.hdf5"),
            "--pool",
            "mean",
            "--window",
            "7",
        )
        == 0
    )
    assert "1 empty line(s) pooled to zero vectors" in capsys.readouterr().err
    assert (
        run_cli(
            "--input",
            str(tmp_path / "in.txt"),
            "--output",
            str(tmp_path / "max.hdf5"),
            "--pool",
            "max",
            "--layers",
            "0.5,-1,2",
        )
        == 0
    )
    with h5py.File(tmp_path / "mean.hdf5", "r") as f, h5py.File(tmp_path / "max.hdf5", "r") as g:
        assert list(f) == ["embeddings"] and f["embeddings"].shape == (len(sentences), 3, 32)
        assert g["embeddings"].shape == (len(sentences), 32) and g["embeddings"].dtype == np.float32
        for i, e in enumerate(expected):
            if i == empty:
                assert not f["embeddings"][i].any() and not g["embeddings"][i].any()
                continue
            np.testing.assert_allclose(f["embeddings"][i], e.mean(axis=1), atol=1e-5, rtol=0)
            np.testing.assert_allclose(g["embeddings"][i], (0.5 * e[0] - e[1] + 2 * e[2]).max(axis=0), atol=1e-5)
    assert sorted(os.listdir(tmp_path)) == ["in.txt", "max.hdf5", "mean.hdf5"]


@pytest.mark.slow
def test_two_shard_processes_read_back_as_one_run(tmp_path, sentences):
    from elmo_jax.cli.commands import bundled_model
    from elmo_jax.extract import ShardedEmbeddings

    options, weights = bundled_model()
    (tmp_path / "in.txt").write_text("\n".join(" ".join(s) for s in sentences) + "\n", encoding="utf-8")
    env = {**os.environ, "XLA_FLAGS": xla_flags(1)}

    def command(output, *extra):
        return [
            sys.executable,
            "-m",
            "elmo_jax",
            "embed",
            "--options",
            options,
            "--weights",
            weights,
            "--input",
            str(tmp_path / "in.txt"),
            "--output",
            str(tmp_path / output),
            "--no-progress",
            "--window",
            "5",
            *extra,
        ]

    shards = [
        subprocess.Popen(
            command("sharded.hdf5", "--num-shards", "2", "--shard-index", str(i)),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    single = subprocess.run(command("single.hdf5"), env=env, capture_output=True, text=True, timeout=600)
    for p in shards:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
    assert single.returncode == 0, single.stderr
    assert sorted(os.listdir(tmp_path)) == [
        "in.txt",
        "sharded-00000-of-00002.hdf5",
        "sharded-00000-of-00002.hdf5.json",
        "sharded-00001-of-00002.hdf5",
        "sharded-00001-of-00002.hdf5.json",
        "single.hdf5",
    ]
    manifest = json.loads((tmp_path / "sharded-00001-of-00002.hdf5.json").read_text())
    assert manifest["lines"] == {"start": 1, "stop": len(sentences), "step": 2}
    with h5py.File(tmp_path / "sharded-00001-of-00002.hdf5", "r") as f:
        assert sorted(map(int, f)) == list(range(1, len(sentences), 2))  # datasets named by input line
    with ShardedEmbeddings(tmp_path / "sharded.hdf5") as view, ShardedEmbeddings(tmp_path / "single.hdf5") as one:
        assert len(view) == len(one) == len(sentences)
        for i, (got, want) in enumerate(zip(view, one)):
            assert got.shape == want.shape == (3, len(sentences[i]), 32)
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
        np.testing.assert_array_equal(view[-1], view[len(sentences) - 1])
        with pytest.raises(IndexError):
            view[len(sentences)]
        with pytest.raises(TypeError, match=r"^a line's index must be an int, got slice"):
            view[0:2]  # (before: a TypeError comparing an int with a slice)
        np.testing.assert_array_equal(view[np.int64(1)], view[1])
    with pytest.raises(FileNotFoundError) as e:
        ShardedEmbeddings([tmp_path / "sharded-00000-of-00002.hdf5.json"])
    # The file it looked for, by name (before: "next to <dir>/...", and "..." alone in the current directory).
    missing = tmp_path / "sharded-00001-of-00002.hdf5.json"
    assert str(e.value) == f"shard(s) [1] of 2 have no manifest: {missing} (still running, or failed?)"


def test_sharded_pooled_output_reads_back(tmp_path, sentences, expected):
    from elmo_jax.extract import ShardedEmbeddings

    (tmp_path / "in.txt").write_text("\n".join(" ".join(s) for s in sentences[:7]) + "\n", encoding="utf-8")
    for i in range(3):  # in turn, in one process: the files are what counts here
        assert (
            run_cli(
                "--input",
                str(tmp_path / "in.txt"),
                "--output",
                str(tmp_path / "p.hdf5"),
                "--pool",
                "mean",
                "--layers",
                "top",
                "--num-shards",
                "3",
                "--shard-index",
                str(i),
            )
            == 0
        )
    # Another output next to it whose name extends this one's: p-x.hdf5, with its own values.
    for i in range(3):
        manifest = json.loads((tmp_path / f"p-{i:05d}-of-00003.hdf5.json").read_text())
        manifest["file"] = f"p-x-{i:05d}-of-00003.hdf5"
        (tmp_path / f"p-x-{i:05d}-of-00003.hdf5.json").write_text(json.dumps(manifest))
        with h5py.File(tmp_path / f"p-x-{i:05d}-of-00003.hdf5", "w") as f:
            f["embeddings"] = np.full((len(range(i, 7, 3)), 32), 7.0, np.float32)
    view = ShardedEmbeddings(tmp_path / "p.hdf5")
    assert len(view) == 7
    for got, e in zip(view, expected[:7]):
        np.testing.assert_allclose(got, e[-1].mean(axis=0), atol=1e-5, rtol=0)
    view.close()
    with ShardedEmbeddings(tmp_path / "p-x.hdf5") as other:
        assert all((x == 7.0).all() for x in other)
    # Manifests of the two outputs given together name shard 0 twice: refused, not one silently taken.
    with pytest.raises(ValueError, match="two manifests of shard 0"):
        ShardedEmbeddings([tmp_path / "p-00000-of-00003.hdf5.json", tmp_path / "p-x-00000-of-00003.hdf5.json"])
    # One shard run again with another --pool: its arrays mean something else (before: mixed in silently).
    again = tmp_path / "p-x-00001-of-00003.hdf5.json"
    again.write_text(json.dumps({**json.loads(again.read_text()), "pool": "max"}))
    with pytest.raises(
        ValueError, match=r"the manifests come from different runs \(their num_shards, num_lines, layers"
    ):
        ShardedEmbeddings(tmp_path / "p-x.hdf5")
    # What is not embed's output, or not all of it, is said so. (Before: one shard's file read as
    # a run of its lines, then h5py's KeyError for line 1; a weights file, 0 lines; a text file,
    # h5py's "file signature not found"; a list of hdf5 files, a UnicodeDecodeError.)
    shard = tmp_path / "p-00001-of-00003.hdf5"
    wrong = {
        shard: f"{shard}: is shard 1 of 3 of {tmp_path / 'p.hdf5'}, one line in 3: give {tmp_path / 'p.hdf5'} to read",
        pathlib.Path(WEIGHTS): f"{WEIGHTS}: not what elmo-jax embed writes (it holds ['CNN', 'CNN_high_0', ",
        tmp_path / "in.txt": f"{tmp_path / 'in.txt'}: not an hdf5 file: give what elmo-jax embed wrote",
        (shard,): f"{shard}: a list names shard manifests (*.hdf5.json); give an hdf5 file, or the --output",
    }
    for source, said in wrong.items():
        with pytest.raises(ValueError) as e:
            ShardedEmbeddings(list(source) if isinstance(source, tuple) else source)
        assert str(e.value).startswith(said), str(e.value)


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    """A random biLM with 2P = 1024 outputs (the fixture's are 32 wide) and a cheap LSTM (dim 32)."""
    import jax

    from elmo_jax import init_bilm, save_hdf5
    from elmo_jax.config import CharCNNConfig, LSTMConfig, ModelConfig

    config = ModelConfig(
        CharCNNConfig(embedding_dim=4, filters=((1, 256), (2, 256)), n_highway=1),
        LSTMConfig(dim=32, projection_dim=512, n_layers=2),
    )
    d = tmp_path_factory.mktemp("wide")
    save_hdf5(config, init_bilm(jax.random.PRNGKey(0), config), d / "options.json", d / "weights.hdf5")
    return str(d / "options.json"), str(d / "weights.hdf5")


MEMORY_TOKENS, MEMORY_WINDOW = 8, 256


def _peak_rss_kb(tmp_path, n_lines, options, weights):
    path = tmp_path / f"in{n_lines}.txt"
    rng = random.Random(n_lines)
    words = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran"]
    with open(path, "w") as f:
        for _ in range(n_lines):
            f.write(" ".join(rng.choice(words) for _ in range(MEMORY_TOKENS)) + "\n")
    # The same --window for both runs: the window's outputs are the one thing held at a time.
    code = (
        "import resource, sys; from elmo_jax.cli import main; "
        f"rc = main(['embed', '--options', {options!r}, '--weights', {weights!r}, '--input', {str(path)!r}, "
        f"'--output', {str(tmp_path / 'o.hdf5')!r}, '--layers', 'top', '--window', '{MEMORY_WINDOW}', "
        "'--no-progress']); "
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); sys.exit(rc)"
    )
    # glibc: arrays above 16 KB get their own mmap, returned to the OS when freed, so the peak RSS
    # follows live memory (by default the heap's fragmentation grows it ~70 MB over 10k lines, then stops).
    env = {**os.environ, "XLA_FLAGS": xla_flags(1, level=1), "MALLOC_MMAP_THRESHOLD_": "16384"}  # a long run
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr
    return int(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_cli_memory_does_not_grow_with_the_input(tmp_path, wide_model):
    small_n, large_n = 4 * MEMORY_WINDOW, 36 * MEMORY_WINDOW  # whole windows: the same batch shapes
    # Keeping every line's output (a leak) would add this much between the two runs: 256 MiB.
    leak_kb = (large_n - small_n) * MEMORY_TOKENS * 1024 * 4 // 1024
    small, large = _peak_rss_kb(tmp_path, small_n, *wide_model), _peak_rss_kb(tmp_path, large_n, *wide_model)
    assert large - small < leak_kb / 4, (small, large, leak_kb)


def test_length_buckets_pad_to_the_next_size_and_no_further():
    from elmo_jax.extract.packing import length_bucket

    steps = {n: length_bucket(n) + 2 for n in range(1000)}  # the biLSTM's steps, markers included
    assert all(steps[n] >= n + 2 and steps[n + 1] >= steps[n] for n in range(999))
    # 80 and 128 are 64 x 1.25 and 64 x 1.25^3 rounded up to 8: exactly that, not a further 8
    # (before: 88 and 136), and the buckets that follow are the next sizes.
    assert [steps[n] for n in (63, 78, 79, 99, 124)] == [80, 80, 104, 128, 160]
    assert len(set(steps.values())) == 25  # few programs for a long tail of lengths


def test_a_pooled_sentence_to_index_gives_rows_of_embeddings(tmp_path, sentences):
    """With --pool the file holds one dataset, embeddings: the index gives each sentence's row
    there (before: dataset names, "0", "1", ..., that the file does not have), in a shard too."""
    lines = [" ".join(s) for s in sentences[:5]]
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    flags = ["--input", str(tmp_path / "in.txt"), "--pool", "mean", "--layers", "top", "--sentence-to-index"]
    assert run_cli(*flags, "--output", str(tmp_path / "p.hdf5")) == 0
    assert run_cli(*flags, "--output", str(tmp_path / "s.hdf5"), "--num-shards", "2", "--shard-index", "1") == 0
    with h5py.File(tmp_path / "p.hdf5", "r") as whole, h5py.File(tmp_path / "s-00001-of-00002.hdf5", "r") as shard:
        assert sorted(whole) == ["embeddings", "sentence_to_index"]
        for f, mine in ((whole, range(5)), (shard, range(1, 5, 2))):
            index = json.loads(f["sentence_to_index"][()])
            assert sorted(index.values(), key=int) == [str(r) for r in range(len(mine))]
            for line in mine:
                row = f["embeddings"][int(index[lines[line]])]
                np.testing.assert_allclose(row, whole["embeddings"][line], atol=1e-5, rtol=0)
        # Negative control: the rows differ, so a wrong row would be told.
        assert np.abs(whole["embeddings"][1] - whole["embeddings"][3]).max() > 1e-3
