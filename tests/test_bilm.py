import dataclasses
import functools
import re

import h5py
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FIXTURES, model_files, reference_batches

from elmo_jax import batch_to_ids, bilm_apply, init_bilm, load_hdf5
from elmo_jax.model import char_cnn
from elmo_jax.model.compute import Compute
from elmo_jax.model.layout import Layout
from elmo_jax.model.vocabulary import Vocabulary

ATOL = 1e-5


@pytest.fixture(scope="module")
def allennlp_model():
    return load_hdf5(*model_files("allennlp"))


@pytest.mark.parametrize("name,width", [pytest.param("allennlp", 16, marks=pytest.mark.slow), ("bilm_tf", 80)])
def test_reference_fixtures_stateful_10x3(name, width):
    """One fixture's batches padded to a multiple of 16 columns (3 shapes, 3 to 15 padding
    columns), the other's all to 80 (one compile): padding passes the state through, so the
    carried state is the same."""
    config, params = load_hdf5(*model_files(name))
    state = None
    for batch, expected in reference_batches(name):
        columns = max(len(s) for s in batch)
        columns = width if name == "bilm_tf" else -(-columns // width) * width
        layers, mask, state = bilm_apply(params, config, batch_to_ids(batch, min_length=columns), state)
        assert layers.shape[0] == 3 and layers.shape[-1] == 32
        # On the host: slicing the device arrays here would compile a slice per shape.
        layers, mask = np.asarray(layers), np.asarray(mask)
        for row, exp in enumerate(expected):
            n = len(batch[row])
            assert exp.shape == (n, 32)
            np.testing.assert_allclose(layers[-1, row, :n], exp, atol=ATOL, rtol=0)
            assert mask[row, :n].all() and not mask[row, n:].any()


def test_without_state_only_the_first_batch_matches(allennlp_model):
    config, params = allennlp_model
    batches = list(reference_batches("allennlp"))
    for i, (batch, expected) in enumerate(batches[:2]):
        layers, _, _ = bilm_apply(params, config, batch_to_ids(batch))
        got = np.asarray(layers[-1, 0, : len(batch[0])])
        assert np.allclose(got, expected[0], atol=ATOL) == (i == 0)


def test_token_embeddings_fixture(allennlp_model):
    config, params = allennlp_model
    vocab = Vocabulary.load(FIXTURES / "allennlp_elmo/vocab_test.txt", lm=False)
    with h5py.File(FIXTURES / "allennlp_elmo/elmo_token_embeddings.hdf5", "r") as f:
        expected = f["embedding"][...]
    assert len(vocab) == expected.shape[0] == 458
    got = char_cnn.apply(params["char_cnn"], config, jnp.asarray(vocab.char_ids()))
    np.testing.assert_allclose(np.asarray(got), expected, atol=ATOL, rtol=0)


def test_stateless_vectors_do_not_depend_on_batch_or_padding(allennlp_model):
    config, params = allennlp_model
    sentence = "The apple fell far from the tree .".split()
    alone, _, _ = bilm_apply(params, config, batch_to_ids([sentence]))
    batch = [
        ["a", "much", "longer", "sentence", "with", "more", "words", "than", "the", "other", "one"],
        sentence,
        [],
        ["short"],
    ]
    padded, mask, _ = bilm_apply(params, config, batch_to_ids(batch))
    wide, _, _ = bilm_apply(params, config, batch_to_ids([sentence], min_length=25))
    n = len(sentence)
    np.testing.assert_allclose(np.asarray(padded[:, 1, :n]), np.asarray(alone[:, 0]), atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.asarray(wide[:, 0, :n]), np.asarray(alone[:, 0]), atol=ATOL, rtol=0)
    # Padded positions are exactly zero, in every layer.
    assert not np.asarray(padded)[:, ~np.asarray(mask)].any()
    assert not np.asarray(wide)[:, 0, n:].any()


def test_layer0_is_the_token_vector_twice(allennlp_model):
    config, params = allennlp_model
    layers, _, _ = bilm_apply(params, config, batch_to_ids([["hello", "world"]]))
    tokens = char_cnn.apply(params["char_cnn"], config, jnp.asarray(batch_to_ids([["hello", "world"]])))
    np.testing.assert_array_equal(np.asarray(layers[0, 0, :, :16]), np.asarray(layers[0, 0, :, 16:]))
    np.testing.assert_allclose(np.asarray(layers[0, 0, :, :16]), np.asarray(tokens[0]), atol=1e-6, rtol=0)


def test_empty_sentences_run_over_their_markers_and_update_state(allennlp_model):
    config, params = allennlp_model
    layers, mask, state = bilm_apply(params, config, batch_to_ids([[], []]))
    assert layers.shape == (3, 2, 1, 32) and not np.asarray(mask).any() and not np.asarray(layers).any()
    assert np.abs(np.asarray(state["h"])).min() > 0  # every row ran over <S>, </S>
    kept, kept_mask, _ = bilm_apply(params, config, batch_to_ids([[]]), keep_sentence_markers=True)
    assert kept.shape == (3, 1, 3, 32) and np.asarray(kept_mask).tolist() == [[True, True, False]]


def test_no_sentences_and_no_tokens_give_empty_arrays(allennlp_model):
    config, params = allennlp_model
    layers, mask, state = bilm_apply(params, config, batch_to_ids([]))
    assert layers.shape[:2] == (3, 0) and layers.shape[-1] == 32 and mask.shape[0] == 0
    assert state["h"].shape == (2, 2, 0, 16)
    for shape in [(0, 50), (3, 0, 50)]:  # a reshape of -1 cannot infer a size beside a 0
        assert char_cnn.apply(params["char_cnn"], config, jnp.zeros(shape, jnp.int32)).shape == shape[:-1] + (16,)


def test_keep_sentence_markers_places_eos_after_each_row(allennlp_model):
    config, params = allennlp_model
    batch = [["a", "b", "c"], ["d"]]
    kept, kept_mask, _ = bilm_apply(params, config, batch_to_ids(batch), keep_sentence_markers=True)
    dropped, _, _ = bilm_apply(params, config, batch_to_ids(batch))
    assert np.asarray(kept_mask).sum(axis=1).tolist() == [5, 3]
    np.testing.assert_array_equal(np.asarray(kept[:, 1, 1:2]), np.asarray(dropped[:, 1, :1]))
    eos = np.asarray(kept[0, :, :])[[0, 1], [4, 2]]  # </S> of both rows: the same token vector
    np.testing.assert_allclose(eos[0], eos[1], atol=1e-6)


def test_unicode_long_tokens_and_lengths_1_and_500(allennlp_model):
    config, params = allennlp_model
    batch = [["東京", "🙂", "e\u0301", "", "x" * 80, "a" * 47 + "é"], ["one"], ["w"] * 500]
    layers, mask, _ = bilm_apply(params, config, batch_to_ids(batch))
    assert layers.shape == (3, 3, 500, 32)
    assert np.isfinite(np.asarray(layers)).all()
    assert np.asarray(mask).sum(axis=1).tolist() == [6, 1, 500]
    alone, _, _ = bilm_apply(params, config, batch_to_ids([["one"]]))
    np.testing.assert_allclose(np.asarray(layers[:, 1, :1]), np.asarray(alone[:, 0]), atol=ATOL, rtol=0)


def test_trimmed_char_axis_gives_the_same_vectors(allennlp_model):
    config, params = allennlp_model
    batch = [["a", "tiny", "batch"], ["of", "short", "words", "indeed"], []]
    ids = batch_to_ids(batch)
    trimmed = char_cnn.trim_char_ids(ids, config)
    assert trimmed.shape[-1] < ids.shape[-1]
    full, _, _ = bilm_apply(params, config, ids)
    cut, _, _ = bilm_apply(params, config, jnp.asarray(trimmed))
    np.testing.assert_allclose(np.asarray(cut), np.asarray(full), atol=1e-6, rtol=0)
    # A token that needs the whole width is left alone.
    assert char_cnn.trim_char_ids(batch_to_ids([["y" * 60]]), config).shape[-1] == 50


def test_chunked_token_encoding_is_exact(allennlp_model):
    config, params = allennlp_model
    ids = jnp.asarray(batch_to_ids([[f"word{i}" for i in range(37)]]))
    a = char_cnn.apply(params["char_cnn"], config, ids, compute=Compute(layout=Layout(cnn_chunk=8)))
    b = char_cnn.apply(params["char_cnn"], config, ids, compute=Compute(layout=Layout(cnn_chunk=0)))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)


def test_bfloat16_compute_is_close_and_float32_out(allennlp_model):
    config, params = allennlp_model
    batch, expected = next(reference_batches("allennlp"))
    layers, _, _ = bilm_apply(params, config, batch_to_ids(batch), compute=Compute(dtype=jnp.bfloat16))
    assert layers.dtype == jnp.float32
    got = np.asarray(layers[-1, 0, : len(batch[0])])
    assert np.all(np.abs(got - expected[0]) <= 2e-2 + 1e-2 * np.abs(expected[0]))


def test_jit_and_grad_through_bilm(allennlp_model):
    config, params = allennlp_model
    ids = jnp.asarray(batch_to_ids([["a", "b"], ["c"]]))

    @jax.jit
    def loss(p):
        layers, mask, _ = bilm_apply(p, config, ids)
        return (layers[-1] ** 2).sum()

    grads = jax.grad(loss)(jax.tree_util.tree_map(jnp.asarray, params))
    leaves = jax.tree_util.tree_leaves(grads)
    assert all(np.isfinite(np.asarray(g)).all() for g in leaves)
    assert np.abs(np.asarray(grads["lstm"][0]["w_h"])).sum() > 0


def test_char_ids_of_the_wrong_shape_type_or_range_are_one_line_naming_them(allennlp_model):
    """Word ids ``[batch, time]``, floats, ids past the char embedding, a state of other shapes,
    swapped or training-state params: each is refused before anything runs, in words. (Before:
    jax's "zero-size array to reduction operation max", a broadcasting or einsum error; ids out of
    range were taken silently, the gather clamping them to a real character.)"""
    config, params = allennlp_model
    ids = batch_to_ids([["a", "b"], ["c"]])
    rows = params["char_cnn"]["char_embed"].shape[0]
    shape = "char_ids must be [batch, time, chars] (from batch_to_ids); got shape "
    refused = [
        (ids[..., 0], ValueError, shape + "(2, 2): ELMo reads each token's characters, not a word id"),
        (ids[None], ValueError, shape + "(1, 2, 2, 50): fold the extra leading axes into the batch (reshape(-1, time, chars))"),
        (ids.astype(np.float32), TypeError, "char_ids must be integers [batch, time, chars] (int32, from batch_to_ids); got float32"),
        (np.where(ids > 0, rows, 0), ValueError, f"char_ids hold {rows}; the char embedding has rows 0 (padding) to {rows - 1}: make them with batch_to_ids"),
        (np.where(ids > 0, -1, 0), ValueError, f"char_ids hold -1; the char embedding has rows 0 (padding) to {rows - 1}: make them with batch_to_ids"),
        ("a b", TypeError, "char_ids is a str; expected an int32 array (from batch_to_ids)"),
        # Fewer chars per token than the model's 50, cut where windows need them (before: other vectors, silently).
        (batch_to_ids([["abcdefgh"]], max_chars=10), ValueError, "char_ids have 10 chars per token, which cuts windows of the model's 50: make them with batch_to_ids(max_chars=50) (char_cnn.trim_char_ids drops only what no window needs)"),
        (ids[..., :2], ValueError, "char_ids have 2 chars per token, which cuts windows of the model's 50: make them with batch_to_ids(max_chars=50) (char_cnn.trim_char_ids drops only what no window needs)"),
        # Tokens for their ids (before: numpy's "inhomogeneous shape", or with sentences of one
        # length "got shape (2, 2): ... not a word id", of strings), and ragged lists of ids.
        ([["The", "cat", "sat"], ["Hi"]], TypeError, "char_ids are tokens (str), not char ids: batch_to_ids(sentences) gives the ids"),
        ([["The", "cat"], ["Hi", "x"]], TypeError, "char_ids are tokens (str), not char ids: batch_to_ids(sentences) gives the ids"),
        (np.array([["The", "cat"]]), TypeError, "char_ids are tokens (str), not char ids: batch_to_ids(sentences) gives the ids"),
        ([ids[0].tolist(), ids[1, :1].tolist()], ValueError, "char_ids are lists of different lengths; batch_to_ids pads them"),
        # Padding before a token: left padding, a gap (before: the length counted the tokens, so
        # the LSTM ran over the padding and dropped the last token, silently).
        (ids[:, ::-1], ValueError, "char_ids row 1 has padding (an all-zero token) at 0 before a token at 1; each row holds its tokens first, then padding (batch_to_ids makes them so)"),
        (batch_to_ids([["a", "", "b"]]) * np.array([1, 0, 1])[None, :, None], ValueError, "char_ids row 0 has padding (an all-zero token) at 1 before a token at 2; each row holds its tokens first, then padding (batch_to_ids makes them so)"),
    ]  # fmt: skip
    for bad, error, said in refused:
        with pytest.raises(error) as e:
            bilm_apply(params, config, bad)
        assert str(e.value) == said
    # Shape and type are checked in a traced call too; a traced array's values are not read.
    with pytest.raises(ValueError, match=re.escape(shape + "(2, 2)")):
        jax.jit(lambda x: bilm_apply(params, config, x))(ids[..., 0])
    jax.jit(lambda x: bilm_apply(params, config, x))(np.where(ids > 0, rows, 0))
    # The edges of the range, and nested lists, are taken (the same numbers as the array's).
    layers, _, state = bilm_apply(params, config, ids)
    np.testing.assert_array_equal(bilm_apply(params, config, ids.tolist())[0], layers)
    bilm_apply(params, config, np.where(ids > 0, rows - 1, 0))

    with pytest.raises(
        ValueError, match=r"here \{'c': \(2, 2, 2, 64\), 'h': \(2, 2, 2, 16\)\} .*; got \{'c': \(2, 2, 3, 64\)"
    ):
        bilm_apply(params, config, ids, {k: v[:, :, :1].repeat(3, axis=2) for k, v in state.items()})
    bilm_apply(params, config, ids, state)
    with pytest.raises(TypeError, match="^config is a dict; expected a ModelConfig$"):
        bilm_apply(config, params, ids)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"got \['bilm', 'softmax'\]: a training state's params hold the biLM's as params\['bilm'\]$"
    ):
        bilm_apply({"bilm": params, "softmax": {}}, config, ids)
    # Another model's weights (before: a reshape error from inside jax's char CNN), and a policy
    # name where a Compute goes (before: AttributeError 'str' object has no attribute 'precision').
    other = init_bilm(jax.random.PRNGKey(0), dataclasses.replace(config, lstm=dataclasses.replace(config.lstm, dim=32)))
    with pytest.raises(
        ValueError, match=r"^params are not this config's biLM: params\['lstm'\]\[0\]\['b'\] is \(2, 128\)"
    ):
        bilm_apply(other, config, ids)
    with pytest.raises(TypeError, match=r"^compute is a str \('bfloat16'\); expected a Compute"):
        bilm_apply(params, config, ids, compute="bfloat16")  # type: ignore[arg-type]
    np.testing.assert_array_equal(bilm_apply({**params, "mine": np.ones(3)}, config, ids)[0], layers)  # keys beside


def test_init_bilm_takes_a_key_then_a_config_and_says_so(allennlp_model):
    """(Before: jax's "invalid PRNG key data" for a seed, its "Error interpreting argument" for
    the two swapped.)"""
    config, _ = allennlp_model
    key = "; expected one PRNG key: jax.random.key(0) or jax.random.PRNGKey(0)"
    with pytest.raises(TypeError, match=re.escape("key is a int (0)" + key)):
        init_bilm(0, config)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=re.escape("key is an array of shape (2, 2) and dtype uint32" + key)):
        init_bilm(jax.random.split(jax.random.PRNGKey(0)), config)
    with pytest.raises(
        TypeError, match=r"^config is a ArrayImpl; expected a ModelConfig \(the arguments are key, then"
    ):
        init_bilm(config, jax.random.PRNGKey(0))  # type: ignore[arg-type]
    raw, typed = init_bilm(jax.random.PRNGKey(3), config), init_bilm(jax.random.key(3), config)
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(lambda a, b: bool((a == b).all()), raw, typed))
    traced = jax.jit(lambda k: init_bilm(k, config))(jax.random.PRNGKey(3))
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(lambda a, b: bool((a == b).all()), raw, traced))


@pytest.mark.parametrize("layout", ["_layer_rows", "_layer_columns"])
def test_a_reset_starts_the_rest_of_the_row_from_zero_state(layout):
    """``resets``: before step t the state is zero, as if the row's text started there; steps
    before t are untouched. Per direction and row."""
    from elmo_jax.config import preset
    from elmo_jax.model import lstm

    config = preset("tiny")
    fn = getattr(lstm, layout)
    params = lstm.init(jax.random.PRNGKey(0), config)[0]
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(3), 3)
    batch, time, dim, p = 2, 6, config.lstm.dim, config.lstm.projection_dim
    xs = jax.random.normal(k1, (2, batch, time, p))
    mask = jnp.ones((batch, time), bool)
    c0, h0 = jax.random.normal(k2, (2, batch, dim)), jax.random.normal(k3, (2, batch, p))
    resets = np.zeros((2, batch, time), bool)
    resets[0, 1, 3] = resets[1, 0, 2] = True  # forward row 1 at step 3; backward row 0 at step 2
    ys, c, h = fn(params, config, xs, mask, c0, h0, resets=jnp.asarray(resets))
    plain, _, _ = fn(params, config, xs, mask, c0, h0)
    zero_c, zero_h = jnp.zeros_like(c0), jnp.zeros_like(h0)
    tail3, c3, _ = fn(params, config, xs[:, :, 3:], mask[:, 3:], zero_c, zero_h)
    tail2, c2, _ = fn(params, config, xs[:, :, 2:], mask[:, 2:], zero_c, zero_h)
    close = lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)  # noqa: E731
    close(ys[0, 1, :3], plain[0, 1, :3])
    close(ys[0, 1, 3:], tail3[0, 1])
    close(c[0, 1], c3[0, 1])
    close(ys[1, 0, :2], plain[1, 0, :2])
    close(ys[1, 0, 2:], tail2[1, 0])
    close(ys[0, 0], plain[0, 0])  # rows and directions without a reset are unchanged
    close(ys[1, 1], plain[1, 1])
    assert np.abs(np.asarray(ys[0, 1, 3:] - plain[0, 1, 3:])).max() > 1e-3  # the reset did something


@pytest.mark.slow
def test_lstm_layouts_agree_with_masks_state_and_gradients():
    """The batch-major layer (GPU/TPU) and the batch-minor one (CPU) are the same function."""
    from elmo_jax.config import preset
    from elmo_jax.model import lstm

    config = preset("tiny")
    params = lstm.init(jax.random.PRNGKey(0), config)[0]
    params = {**params, "b": jax.random.normal(jax.random.PRNGKey(1), params["b"].shape)}
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(2), 3)
    batch, time, dim, p = 3, 7, config.lstm.dim, config.lstm.projection_dim
    xs = jax.random.normal(k1, (2, batch, time, p))
    mask = jnp.arange(time)[None, :] < jnp.array([7, 4, 0])[:, None]
    c0 = jax.random.normal(k2, (2, batch, dim))
    h0 = jax.random.normal(k3, (2, batch, p))

    def loss(fn, params, xs):
        ys, c, h = fn(params, config, xs, mask, c0, h0)
        return (ys**2).sum() + (c * h.sum()).sum(), (ys, c, h)

    # Jitted: run eagerly, every op of the backward pass compiled a program of its own.
    grad = jax.jit(jax.value_and_grad(loss, argnums=(1, 2), has_aux=True), static_argnums=0)
    unrolled = lambda n, t=0: Compute(layout=Layout("rows", unroll=n, lstm_time_axis=t))  # noqa: E731
    (l_cols, out_cols), g_cols = grad(functools.partial(lstm._layer_columns, compute=unrolled(1)), params, xs)
    # Rows as the GPU runs them (unrolled: 3 does not divide 7 steps, so a remainder runs too),
    # with time on axis 0 or 2 of the per-step arrays.
    for n, t in ((1, 0), (3, 0), (20, 0), (3, 2), (20, 2)):
        fn = functools.partial(lstm._layer_rows, compute=unrolled(n, t))
        (l_rows, out_rows), g_rows = grad(fn, params, xs)
        for a, b in zip(jax.tree_util.tree_leaves((out_rows, g_rows)), jax.tree_util.tree_leaves((out_cols, g_cols))):
            # Weight gradients sum over every step and row: float32 rounding differs in the last digits.
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
    assert not np.asarray(out_cols[0][:, 2]).any()  # an empty row outputs zeros...
    np.testing.assert_array_equal(np.asarray(out_cols[1][:, 2]), np.asarray(c0[:, 2]))  # ...and keeps its state


def test_a_261_row_char_table_is_refused_and_a_training_config_inits_262(allennlp_model):
    """The ids are shifted by one (row 0: padding), so bilm-tf's 261-row training table would read
    each character's neighbour's row (before: accepted; its trimmed padding window read row 261,
    out of range: NaN)."""
    import dataclasses

    from elmo_jax.model.bilm import check_params
    from elmo_jax.model.bilm import init as init_bilm

    config, params = allennlp_model
    short = {**params, "char_cnn": {**params["char_cnn"], "char_embed": params["char_cnn"]["char_embed"][1:]}}
    with pytest.raises(
        ValueError, match=r"\['char_embed'\] has bilm-tf's 261 rows; the model reads 262, row 0 for padding"
    ):
        check_params(short, config, shapes=True)  # as Embedder and the Flax modules check them
    training = dataclasses.replace(config, char_cnn=dataclasses.replace(config.char_cnn, n_characters=261))
    fresh = init_bilm(jax.random.PRNGKey(0), training)
    assert fresh["char_cnn"]["char_embed"].shape[0] == 262 and not np.asarray(fresh["char_cnn"]["char_embed"][0]).any()
    assert np.isfinite(np.asarray(bilm_apply(fresh, training, batch_to_ids([["abc"]]))[0])).all()
