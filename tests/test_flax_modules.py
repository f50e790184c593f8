"""Flax modules: scalar mix (both conventions) against numpy, linen ``Elmo`` and ``ElmoNNX``."""

import dataclasses
import re
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.traverse_util import flatten_dict
from helpers import model_files

import elmo_jax.modules.elmo as fm
from elmo_jax import batch_to_ids, bilm_apply, load_hdf5
from elmo_jax import init_bilm as bilm_init
from elmo_jax._util.hlo import constant_sizes
from elmo_jax.config import Options
from elmo_jax.model.compute import Compute
from elmo_jax.modules.elmo import (
    FROZEN_COLLECTION,
    Elmo,
    ElmoNNX,
    FrozenBiLM,
    l2_penalty,
    remove_sentence_markers,
    scalar_mix,
    with_bilm,
)

SENTENCES = [["The", "cat", "sat", "on", "the", "mat", "."], ["Hello", "!"], [], ["A", "b", "c", "d"]]
TAGS = np.array([[1, 2, 3, 1, 2, 3, 4], [0, 4, 0, 0, 0, 0, 0], [0] * 7, [3, 3, 2, 1, 0, 0, 0]])
N_TAGS = 5


# ------------------------------------------------------------------------------- numpy reference


def numpy_mix(layers, mask, weights, gamma, layer_norm, convention):
    """Direct float64 computation; for "allennlp" the markers are cut row by row afterwards."""
    layers = np.asarray(layers, np.float64)
    mask = np.asarray(mask, bool)
    eps = {"allennlp": 1e-13, "bilm_tf": 1e-12}[convention]
    s = np.exp(weights - np.max(weights))
    s = s / s.sum()
    out = np.zeros(layers.shape[1:])
    for j in range(layers.shape[0]):
        x = layers[j]
        if layer_norm:
            vals = x[mask]  # [n_unmasked, D]: the whole batch's unmasked elements
            mean = vals.mean()
            var = np.mean((vals - mean) ** 2)
            x = (x - mean) / np.sqrt(var + eps)
        out += s[j] * x
    out *= gamma
    if convention == "bilm_tf":
        out[~mask] = 0.0
        return out, mask
    batch, time, dim = out.shape
    res, new_mask = np.zeros((batch, time - 2, dim)), np.zeros((batch, time - 2), bool)
    for b in range(batch):
        n = int(mask[b].sum()) - 2  # <S> at 0, tokens 1..n, </S> at n+1
        res[b, :n] = out[b, 1 : n + 1]
        new_mask[b, :n] = True
    return res, new_mask


def random_inputs(convention, seed=0):
    rng = np.random.default_rng(seed)
    lengths = np.array([3, 0, 6, 1, 5])
    extra = 2 if convention == "allennlp" else 0
    time = lengths.max() + extra + 1  # one all-padding column too
    layers = rng.normal(0.5, 2.0, (3, len(lengths), time, 8)).astype(np.float32)  # padding not zero
    mask = np.arange(time)[None, :] < (lengths + extra)[:, None]
    return layers, mask, lengths


@pytest.mark.parametrize("convention", ["allennlp", "bilm_tf"])
@pytest.mark.parametrize("layer_norm", [False, True])
def test_scalar_mix_matches_numpy(convention, layer_norm):
    layers, mask, lengths = random_inputs(convention)
    weights, gamma = np.array([0.3, -1.2, 0.7], np.float32), np.float32(1.7)
    got, got_mask = scalar_mix(layers, mask, weights, gamma, layer_norm, convention)
    want, want_mask = numpy_mix(layers, mask, weights, gamma, layer_norm, convention)
    assert got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-6, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(got_mask), want_mask)
    np.testing.assert_array_equal(np.asarray(got_mask).sum(1), lengths)
    assert not np.any(np.asarray(got)[~np.asarray(got_mask)])  # exactly 0 where masked


@pytest.mark.parametrize("convention", ["allennlp", "bilm_tf"])
def test_a_layer_normed_mix_of_float16_layers_is_the_float32_mix_of_them(convention):
    """Precomputed layers stored as float16 (the POS tagger's features): a batch of more than
    65504 elements overflowed the count and the epsilon rounded to 0, and every output was NaN.
    The statistics now take float32; the control (float32 input) gives the same numbers."""
    rng = np.random.default_rng(0)
    layers = rng.normal(0.0, 3.0, (3, 4, 22, 1024)).astype(np.float16)
    mask = np.arange(22)[None, :] < np.array([22, 22, 20, 5])[:, None]  # 69 x 1024 unmasked
    w, g = np.array([0.1, -0.2, 0.3], np.float32), np.float32(1.3)
    half, _ = scalar_mix(layers, mask, w, g, True, convention)
    full, _ = scalar_mix(layers.astype(np.float32), mask, w, g, True, convention)
    assert np.isfinite(np.asarray(half)).all()
    np.testing.assert_allclose(np.asarray(half, np.float32), np.asarray(full), rtol=1e-3, atol=1e-3)


def test_the_markers_enter_the_statistics_only_for_allennlp():
    layers, mask, _ = random_inputs("allennlp")
    w, g = np.zeros(3, np.float32), np.float32(1.0)
    a, a_mask = scalar_mix(layers, mask, w, g, True, "allennlp")
    # The same tokens without markers, mixed the bilm-tf way.
    inner, inner_mask = remove_sentence_markers(jnp.moveaxis(jnp.asarray(layers), 0, 2), mask)
    inner = jnp.moveaxis(inner, 2, 0)
    b, b_mask = scalar_mix(inner, inner_mask, w, g, True, "bilm_tf")
    np.testing.assert_array_equal(np.asarray(a_mask), np.asarray(b_mask))
    assert np.abs(np.asarray(a) - np.asarray(b)).max() > 1e-3
    a, _ = scalar_mix(layers, mask, w, g, False, "allennlp")  # without layer norm: identical
    b, _ = scalar_mix(inner, inner_mask, w, g, False, "bilm_tf")
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_l2_penalty_and_bad_arguments():
    w = jnp.array([1.0, -2.0, 0.5])
    np.testing.assert_allclose(float(l2_penalty(w, 0.01)), 0.01 * 5.25, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(jax.grad(l2_penalty)(w, 0.01)), 0.02 * np.asarray(w), rtol=1e-6)
    layers, mask, _ = random_inputs("bilm_tf")
    with pytest.raises(ValueError, match="convention"):
        scalar_mix(layers, mask, jnp.zeros(3), 1.0, convention="tf")
    with pytest.raises(ValueError, match="one per layer"):
        scalar_mix(layers, mask, jnp.zeros(2), 1.0)


# ------------------------------------------------------------------------------- fixture model


@pytest.fixture(scope="module")
def model():
    config, params = load_hdf5(*model_files("allennlp"))
    return config, jax.tree.map(jnp.asarray, params), batch_to_ids(SENTENCES)


def bilm_layers(params, config, char_ids, convention="bilm_tf"):
    """``bilm_apply`` called exactly as the modules call it (same jit cache entry)."""
    return bilm_apply(
        params,
        config,
        jnp.asarray(char_ids),
        None,
        keep_sentence_markers=convention == "allennlp",
        compute=Compute.from_policy("float32"),
    )


def bilm_leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


class Tagger(nn.Module):
    elmo: Elmo
    n_tags: int = N_TAGS

    @nn.compact
    def __call__(self, char_ids, *, deterministic):
        out = self.elmo(char_ids, deterministic=deterministic)
        return nn.Dense(self.n_tags)(out["elmo_representations"][0]), out["mask"]


def masked_ce(logits, mask):
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(TAGS[:, : logits.shape[1]]))
    return jnp.sum(ce * mask) / jnp.maximum(mask.sum(), 1)


def make_train_step(module, tx):
    @jax.jit
    def step(params, opt_state, others, char_ids, key):
        def loss_fn(p, o):
            logits, mask = module.apply({"params": p, **o}, char_ids, deterministic=False, rngs={"dropout": key})
            return masked_ce(logits, mask)

        # The gradient w.r.t. the other collections too: a frozen biLM must get exactly zero.
        loss, (grads, other_grads) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, others)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads, other_grads

    return step


@pytest.mark.slow
def test_frozen_bilm_is_not_a_param_and_survives_a_weight_decay_step(model):
    config, params, char_ids = model
    tagger = Tagger(Elmo(config, dropout=0.1))
    variables = with_bilm(tagger.init(jax.random.PRNGKey(0), char_ids, deterministic=True), params)
    assert set(flatten_dict(variables["params"])) == {
        ("elmo", "scalar_mix_0", "weights"),
        ("elmo", "scalar_mix_0", "gamma"),
        ("Dense_0", "kernel"),
        ("Dense_0", "bias"),
    }
    frozen = {FROZEN_COLLECTION: variables[FROZEN_COLLECTION]}
    before = bilm_leaves(params)
    tx = optax.adamw(1e-2, weight_decay=0.5)
    step = make_train_step(tagger, tx)
    new_params, _, loss, grads, frozen_grads = step(
        variables["params"], tx.init(variables["params"]), frozen, char_ids, jax.random.PRNGKey(1)
    )
    assert np.isfinite(float(loss))
    assert set(flatten_dict(grads)) == set(flatten_dict(variables["params"]))
    assert not np.allclose(new_params["elmo"]["scalar_mix_0"]["weights"], 0.0)
    for a, b, c in zip(before, bilm_leaves(frozen[FROZEN_COLLECTION]["elmo"]["bilm"]), bilm_leaves(params)):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
    # No gradient reaches the biLM even when asked for one (stop_gradient).
    assert len(bilm_leaves(frozen_grads)) == len(before)
    assert all(not np.any(x) for x in bilm_leaves(frozen_grads))
    # Without the frozen collection there is no biLM: one clear error.
    with pytest.raises(ValueError, match="elmo has no biLM: pass the 'frozen_bilm' collection"):
        tagger.apply({"params": new_params}, char_ids, deterministic=True)


@pytest.mark.slow
def test_trainable_bilm_is_in_params_and_moves(model):
    config, params, char_ids = model
    tagger = Tagger(Elmo(config, dropout=0.1, trainable_bilm=True))
    variables = with_bilm(tagger.init(jax.random.PRNGKey(0), char_ids, deterministic=True), params)
    assert set(variables) == {"params"}
    for a, b in zip(bilm_leaves(variables["params"]["elmo"]["bilm"]), bilm_leaves(params)):
        np.testing.assert_array_equal(a, b)
    # Weight decay on matrices only, by a mask over paths that walks the biLM's lists (its layers:
    # flax.traverse_util.flatten_dict stops at them, as docs/downstream.md says).
    decayed = lambda p: jax.tree_util.tree_map_with_path(lambda path, x: x.ndim > 1, p)  # noqa: E731
    assert sum(jax.tree.leaves(decayed(variables["params"]["elmo"]["bilm"]))) == 17  # of 25
    tx = optax.adamw(1e-2, weight_decay=0.5, mask=decayed)
    new_params, _, _, grads, _ = make_train_step(tagger, tx)(
        variables["params"], tx.init(variables["params"]), {}, char_ids, jax.random.PRNGKey(1)
    )
    assert any(np.any(g) for g in bilm_leaves(grads["elmo"]["bilm"]["lstm"]))
    moved = [not np.array_equal(a, b) for a, b in zip(bilm_leaves(new_params["elmo"]["bilm"]), bilm_leaves(params))]
    assert all(moved)


def direct_mix(params, config, char_ids, weights, gamma, layer_norm, convention):
    layers, mask, _ = bilm_layers(params, config, char_ids, convention)
    return scalar_mix(layers, mask, weights, gamma, layer_norm, convention)


def test_several_representations_are_independent_and_dropout_only_when_asked(model):
    config, params, char_ids = model
    elmo = Elmo(config, num_output_representations=2, dropout=0.5, do_layer_norm=True)
    variables = with_bilm(elmo.init(jax.random.PRNGKey(0), char_ids, deterministic=True), params)
    p = jax.tree.map(np.array, variables["params"])
    assert set(p) == {"scalar_mix_0", "scalar_mix_1"}
    p["scalar_mix_1"]["weights"][:] = [2.0, -1.0, 0.5]
    p["scalar_mix_1"]["gamma"] = np.float32(3.0)
    v = {"params": p, FROZEN_COLLECTION: variables[FROZEN_COLLECTION]}
    out = elmo.apply(v, char_ids, deterministic=True)
    assert len(out["elmo_representations"]) == 2
    for k in range(2):
        want, want_mask = direct_mix(
            params, config, char_ids, p[f"scalar_mix_{k}"]["weights"], p[f"scalar_mix_{k}"]["gamma"], True, "allennlp"
        )
        np.testing.assert_array_equal(np.asarray(out["elmo_representations"][k]), np.asarray(want))
        np.testing.assert_array_equal(np.asarray(out["mask"]), np.asarray(want_mask))
    assert out["elmo_representations"][0].shape == (4, 7, 32)
    np.testing.assert_array_equal(np.asarray(out["mask"]).sum(1), [len(s) for s in SENTENCES])
    # A loss on representation 0 gives no gradient to mix 1.
    grads = jax.grad(
        lambda q: jnp.sum(elmo.apply({**v, "params": q}, char_ids, deterministic=True)["elmo_representations"][0] ** 2)
    )(p)
    assert np.any(grads["scalar_mix_0"]["weights"]) and not np.any(grads["scalar_mix_1"]["weights"])
    # Dropout: each representation its own mask, scaled by 1 / (1 - rate).
    noisy = elmo.apply(v, char_ids, deterministic=False, rngs={"dropout": jax.random.PRNGKey(3)})
    for k in range(2):
        clean, drop = np.asarray(out["elmo_representations"][k]), np.asarray(noisy["elmo_representations"][k])
        kept = drop != 0
        assert 0.3 < kept[clean != 0].mean() < 0.7
        np.testing.assert_allclose(drop[kept], 2.0 * clean[kept], rtol=1e-6)
    assert not np.array_equal(
        np.asarray(noisy["elmo_representations"][0]) != 0, np.asarray(noisy["elmo_representations"][1]) != 0
    )


def test_keep_sentence_boundaries_keeps_the_markers_of_the_same_mix(model):
    """AllenNLP's keep_sentence_boundaries: the representations and the mask with <S>/</S> in
    ([B, T + 2, D]); the tokens' vectors are those of the mix without them (the same statistics),
    for linen and NNX. bilm-tf's convention never has the markers in its mix: refused."""
    config, params, char_ids = model
    lengths = np.array([len(s) for s in SENTENCES])
    plain = Elmo(config, do_layer_norm=True, dropout=0.0)
    kept = Elmo(config, do_layer_norm=True, dropout=0.0, keep_sentence_boundaries=True)
    variables = with_bilm(plain.init(jax.random.PRNGKey(0), char_ids, deterministic=True), params)
    a = plain.apply(variables, char_ids, deterministic=True)
    b = kept.apply(variables, char_ids, deterministic=True)
    rep, with_markers = np.asarray(a["elmo_representations"][0]), np.asarray(b["elmo_representations"][0])
    assert with_markers.shape == (4, 7 + 2, 32)
    np.testing.assert_array_equal(np.asarray(b["mask"]).sum(1), lengths + 2)
    for row, n in enumerate(lengths):
        np.testing.assert_array_equal(with_markers[row, 1 : n + 1], rep[row, :n])
        assert np.abs(with_markers[row, [0, n + 1]]).min() > 0  # the markers' own vectors
        assert not with_markers[row, n + 2 :].any()  # padding: exactly 0
    nnx_kept = ElmoNNX(config, params, do_layer_norm=True, dropout=0.0, keep_sentence_boundaries=True, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(
        np.asarray(nnx_kept(char_ids, deterministic=True)["elmo_representations"][0]), with_markers, atol=1e-6
    )
    for make in (
        lambda: Elmo(config, keep_sentence_boundaries=True, convention="bilm_tf"),
        lambda: ElmoNNX(config, params, keep_sentence_boundaries=True, convention="bilm_tf", rngs=nnx.Rngs(0)),
    ):
        with pytest.raises(ValueError, match="^keep_sentence_boundaries needs convention 'allennlp'"):
            make()


def test_fixed_scalar_mix_parameters_are_constants_with_a_gamma_of_1(model):
    """AllenNLP's scalar_mix_parameters: pre-softmax weights given, not trained, and gamma 1 (its
    ScalarMix is made with trainable=False); the mix has no params, so an optimizer cannot move it."""
    config, params, char_ids = model
    fixed = [0.0, -1.0, 2.0]
    elmo = Elmo(config, do_layer_norm=False, dropout=0.0, scalar_mix_parameters=fixed)
    assert elmo.scalar_mix_parameters == (0.0, -1.0, 2.0) and hash(elmo)  # a tuple: nn.jit can hash it
    variables = with_bilm(elmo.init(jax.random.PRNGKey(0), char_ids, deterministic=True), params)
    assert "params" not in variables or not variables["params"]
    want, _ = direct_mix(params, config, char_ids, jnp.asarray(fixed), 1.0, False, "allennlp")
    got = elmo.apply(variables, char_ids, deterministic=True)["elmo_representations"][0]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # The control: the trained mix at its init (weights 0) is another mix.
    free = Elmo(config, dropout=0.0)
    other = free.apply(
        with_bilm(free.init(jax.random.PRNGKey(0), char_ids, deterministic=True), params), char_ids, deterministic=True
    )
    assert np.abs(np.asarray(other["elmo_representations"][0]) - np.asarray(want)).max() > 1e-3
    # Trainable, the biLM alone is in params, with no scalar mix beside it: with_bilm still finds it
    # (it looked for a scalar_mix_0 next to "bilm", and said the model had no Elmo).
    trainable = Elmo(config, dropout=0.0, trainable_bilm=True, scalar_mix_parameters=fixed)
    init = trainable.init(jax.random.PRNGKey(0), char_ids, deterministic=True)
    assert set(init["params"]) == {"bilm"}
    got = trainable.apply(with_bilm(init, params), char_ids, deterministic=True)["elmo_representations"][0]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    nnx_elmo = ElmoNNX(config, params, dropout=0.0, scalar_mix_parameters=fixed, rngs=nnx.Rngs(0))
    assert not jax.tree.leaves(nnx.state(nnx_elmo, nnx.Param))
    np.testing.assert_allclose(
        np.asarray(nnx_elmo(char_ids, deterministic=True)["elmo_representations"][0]), np.asarray(want), atol=1e-6
    )
    for bad in ([1.0, 2.0], [0.0, float("nan"), 1.0], "abc", [True, 0.0, 0.0]):
        with pytest.raises(ValueError, match=r"^scalar_mix_parameters must be 3 finite numbers"):
            Elmo(config, scalar_mix_parameters=bad)
        with pytest.raises(ValueError, match=r"^scalar_mix_parameters must be 3 finite numbers"):
            ElmoNNX(config, params, scalar_mix_parameters=bad, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("convention", ["allennlp", "bilm_tf"])
def test_precomputed_layers_give_the_char_ids_output(model, convention):
    config, params, char_ids = model
    elmo = Elmo(config, do_layer_norm=True, convention=convention)
    variables = with_bilm(elmo.init(jax.random.PRNGKey(0), char_ids, deterministic=True), params)
    layers, mask, _ = bilm_layers(params, config, char_ids, convention)
    a = elmo.apply(variables, char_ids, deterministic=True)
    b = elmo.apply(variables, layers=layers, mask=mask, deterministic=True)
    # Fed layers, the module needs no biLM: its init declares none, its apply reads none.
    on_layers = elmo.init(jax.random.PRNGKey(0), layers=layers, mask=mask, deterministic=True)
    assert set(on_layers) == {"params"} and set(on_layers["params"]) == {"scalar_mix_0"}
    c = elmo.apply({"params": variables["params"]}, layers=layers, mask=mask, deterministic=True)
    for other in (b, c):
        np.testing.assert_allclose(
            np.asarray(a["elmo_representations"][0]), np.asarray(other["elmo_representations"][0]), atol=1e-6
        )
        np.testing.assert_array_equal(np.asarray(a["mask"]), np.asarray(other["mask"]))
    with pytest.raises(ValueError, match="either char_ids"):
        elmo.apply(variables, char_ids, layers=layers, mask=mask, deterministic=True)
    with pytest.raises(ValueError, match="no Elmo biLM in these variables"):
        with_bilm(on_layers, params)


def test_word_ids_or_char_ids_out_of_range_are_refused_in_words_by_the_modules(model):
    """A downstream model's most likely slip: its word ids ``[B, T]`` where char ids go (before:
    jax's "zero-size array to reduction operation max"), or char ids made some other way."""
    config, params, char_ids = model
    elmo = Elmo(config)
    variables = with_bilm(elmo.init(jax.random.PRNGKey(0), char_ids, deterministic=True), params)
    with pytest.raises(ValueError, match=re.escape("got shape (4, 7): ELMo reads each token's characters")):
        elmo.apply(variables, char_ids[..., 0], deterministic=True)
    with pytest.raises(ValueError, match="^char_ids hold 300; the char embedding has rows 0 .padding. to 261"):
        elmo.apply(variables, np.where(char_ids > 0, 300, 0), deterministic=True)
    nnx_elmo = ElmoNNX(config, bilm_params=params, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=re.escape("got shape (4, 7): ELMo reads")):
        nnx_elmo(char_ids[..., 0], deterministic=True)


def test_elmo_nnx_refuses_weights_of_another_model_when_built(model):
    """(Before: a KeyError 'char_embed', or a shape error in the char CNN at the first call.)"""
    config, params, _ = model
    with pytest.raises(TypeError, match=r"a training state's params hold the biLM's as bilm_params\['bilm'\]$"):
        ElmoNNX(config, bilm_params={"bilm": params, "softmax": {}}, rngs=nnx.Rngs(0))
    # The two swapped (before: Flax's 21 lines on data assigned to a static attribute).
    with pytest.raises(TypeError) as e:
        ElmoNNX(params, config, rngs=nnx.Rngs(0))
    assert str(e.value) == "config is a dict; expected a ModelConfig: ElmoNNX(config, bilm_params, rngs=...)"
    other = bilm_init(jax.random.PRNGKey(0), dataclasses.replace(config, lstm=dataclasses.replace(config.lstm, dim=8)))
    with pytest.raises(ValueError) as e:
        ElmoNNX(config, bilm_params=other, rngs=nnx.Rngs(0))
    assert str(e.value) == (
        "bilm_params are not this config's biLM: bilm_params['lstm'][0]['b'] is (2, 32) where the config's is "
        f"(2, {4 * config.lstm.dim}) (another model's weights?)"
    )
    # bilm-tf's options say 261 characters; the weights as read carry the padding row too (262).
    c261 = dataclasses.replace(config, char_cnn=dataclasses.replace(config.char_cnn, n_characters=261))
    assert params["char_cnn"]["char_embed"].shape[0] == 262
    ElmoNNX(c261, bilm_params=params, rngs=nnx.Rngs(0))


def test_an_unknown_precision_is_refused_as_the_module_is_made(model):
    """As dropout and convention are (before: taken, then refused at the first init)."""
    config, params, _ = model
    said = "^precision must be one of float32, tf32, bfloat16; got 'fp16'$"
    with pytest.raises(ValueError, match=said):
        Elmo(config=config, precision="fp16")
    with pytest.raises(ValueError, match=said):
        ElmoNNX(config, bilm_params=params, precision="fp16", rngs=nnx.Rngs(0))
    Elmo(config=config, precision="bfloat16")


def test_from_hdf5_and_from_checkpoint(model, monkeypatch):
    config, params, char_ids = model
    elmo, weights = Elmo.from_hdf5(*model_files("allennlp"), dropout=0.0)
    assert elmo.config == config and elmo.dropout == 0.0
    for a, b in zip(bilm_leaves(weights), bilm_leaves(params)):
        np.testing.assert_array_equal(a, b)
    options = Options.load(model_files("allennlp")[0])
    calls = []

    def fake_read_bilm(run_dir, step=None):
        calls.append((run_dir, step))
        return options, {"bilm": params, "softmax": {}}, 7

    monkeypatch.setattr("elmo_jax.training.run_dir.read_bilm", fake_read_bilm)
    ck, ck_weights = Elmo.from_checkpoint("/some/run", step=7, trainable_bilm=True)
    nn_ck = ElmoNNX.from_checkpoint("/some/run", rngs=nnx.Rngs(0))
    assert calls == [("/some/run", 7), ("/some/run", None)]  # the biLM alone: no vocabulary
    assert ck.config == options.model and ck.trainable_bilm and nn_ck.config == options.model
    for a, b in zip(bilm_leaves(ck_weights), bilm_leaves(params)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(bilm_leaves(nn_ck.bilm_weights()), bilm_leaves(params)):
        np.testing.assert_array_equal(a, b)


def test_with_bilm_puts_weights_where_told_and_refuses_other_shapes(model):
    config, params, char_ids = model

    class Two(nn.Module):  # a frozen and a trainable Elmo, nested, next to a user's own "bilm"
        @nn.compact
        def __call__(self, char_ids):
            a = Elmo(config, name="frozen")(char_ids, deterministic=True)["elmo_representations"][0]
            b = Elmo(config, trainable_bilm=True, name="trainable")(char_ids, deterministic=True)
            mine = self.param("bilm", nn.initializers.ones, (3,))
            return a + b["elmo_representations"][0] + mine.sum()

    two = Two()
    init = two.init(jax.random.PRNGKey(0), char_ids)
    # Two Elmos: which one is said (before: both got the weights, silently, whatever they were for).
    with pytest.raises(ValueError) as e:
        with_bilm(init, params)
    assert str(e.value) == (
        "with_bilm: the model has 2 Elmos ('trainable', 'frozen'); say which these weights are for with at= "
        "(one name, or several)"
    )
    with pytest.raises(ValueError, match=r"^with_bilm: at='elmo' is not an Elmo of this model; its Elmos are 'tr"):
        with_bilm(init, params, at="elmo")
    doubled = jax.tree.map(lambda x: 2 * x, params)
    one = with_bilm(init, doubled, at="frozen")  # the other keeps what it had
    assert bilm_leaves(one[FROZEN_COLLECTION]["frozen"]["bilm"])[0].tolist() == bilm_leaves(doubled)[0].tolist()
    assert (
        bilm_leaves(one["params"]["trainable"]["bilm"])[0].tolist()
        == bilm_leaves(init["params"]["trainable"]["bilm"])[0].tolist()
    )
    variables = with_bilm(one, params, at=("frozen", "trainable"))
    for tree in (variables[FROZEN_COLLECTION]["frozen"]["bilm"], variables["params"]["trainable"]["bilm"]):
        for a, b in zip(bilm_leaves(tree), bilm_leaves(params)):
            np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(np.asarray(variables["params"]["bilm"]), np.ones(3))
    assert not np.array_equal(
        bilm_leaves(init[FROZEN_COLLECTION]["frozen"]["bilm"])[0], bilm_leaves(params)[0]
    )  # init drew a random biLM; with_bilm made new dicts
    # The same numbers as the biLM run directly.
    want, _ = direct_mix(params, config, char_ids, jnp.zeros(3), 1.0, False, "allennlp")
    np.testing.assert_allclose(np.asarray(two.apply(variables, char_ids)), 2 * np.asarray(want) + 3, atol=1e-5)
    other = jax.tree.map(lambda x: x[..., :1] if x.ndim else x, params)
    with pytest.raises(ValueError, match="do not have the shapes of the biLM at frozen_bilm/frozen/bilm"):
        with_bilm(init, other, at="frozen")
    # Abstract variables (jax.eval_shape of init: no random biLM drawn) take the weights too
    # (before: "float() argument must be ... not 'ShapeDtypeStruct'", 13 frames deep).
    abstract = jax.eval_shape(lambda: two.init(jax.random.PRNGKey(0), char_ids))
    put = with_bilm(abstract, params, at=["frozen", "trainable"])
    assert bilm_leaves(put["params"]["trainable"]["bilm"])[0].tolist() == bilm_leaves(params)[0].tolist()
    assert isinstance(put["params"]["bilm"], jax.ShapeDtypeStruct)  # the user's own, left as it was
    with pytest.raises(ValueError, match="do not have the shapes of the biLM at params/trainable/bilm"):
        with_bilm(abstract, other, at="trainable")
    # Not a biLM tree at all: one line from our check (before: "do not have the shapes" for a
    # training state's params, and a TypeError from inside jax for the config).
    with pytest.raises(TypeError, match=r"got \['bilm', 'softmax'\]: a training state's params hold the biLM's"):
        with_bilm(init, {"bilm": params, "softmax": {}})
    with pytest.raises(TypeError, match=r"^bilm_params must be the biLM's .*; got ModelConfig$"):
        with_bilm(init, config)


def test_bad_module_settings_and_missing_inputs_are_one_line_as_the_module_is_made(model):
    """(Before: ``Elmo(config, params)`` put the weights in ``num_output_representations`` and failed
    at init in a TypeError from a FrozenDict; a dropout of 1.5 and 0 representations ran.)"""
    config, params, char_ids = model
    with pytest.raises(TypeError, match=r"^num_output_representations must be an int of at least 1, got a dict "
                       r"\(the biLM weights go in with with_bilm, after init\)$"):  # fmt: skip
        Elmo(config, params)
    # The weights first (before: said to be a num_output_representations that is not an int).
    with pytest.raises(TypeError) as e:
        Elmo(params, config)
    assert str(e.value) == (
        "config is a dict; expected a ModelConfig: Elmo(config), the biLM weights put in with with_bilm after init"
    )
    for bad, said in (
        ({"dropout": 1.5}, "dropout must be a rate from 0 up to"),
        ({"num_output_representations": 0}, "got 0$"),
    ):
        with pytest.raises(ValueError, match=said):
            Elmo(config, **bad)
        with pytest.raises(ValueError, match=said):
            ElmoNNX(config, params, rngs=nnx.Rngs(0), **bad)
    Elmo(config, dropout=0.0, num_output_representations=2)  # the edges that are taken
    Elmo(config, dropout=np.float32(0.5), num_output_representations=np.int64(2))  # a numpy sweep's values
    elmo = Elmo(config)
    variables = with_bilm(elmo.init(jax.random.PRNGKey(0), char_ids, deterministic=True), params)
    with pytest.raises(ValueError, match="neither was given"):
        elmo.apply(variables, deterministic=True)
    with pytest.raises(ValueError, match="not both"):
        elmo.apply(variables, char_ids, layers=jnp.zeros((3, 1, 2, 4)), mask=jnp.ones((1, 2), bool), deterministic=True)
    # A mask beside char ids was dropped silently (the output's came from the ids).
    mask = np.ones(char_ids.shape[:2], bool)
    with pytest.raises(
        ValueError, match="^mask goes with precomputed layers; with char_ids the mask comes from the ids"
    ):
        elmo.apply(variables, char_ids, mask=mask, deterministic=True)
    with pytest.raises(ValueError, match="^mask goes with precomputed layers"):
        ElmoNNX(config, params, rngs=nnx.Rngs(0))(char_ids, mask=mask, deterministic=True)


def test_nn_jit_of_a_module_using_elmo_equals_no_jit(model):
    config, params, char_ids = model
    # deterministic is a Python bool: static (nn.jit traces every other argument).
    jitted = nn.jit(Tagger, static_argnames="deterministic")(Elmo(config, dropout=0.5))
    plain = Tagger(Elmo(config, dropout=0.5))
    variables = with_bilm(jitted.init(jax.random.PRNGKey(0), char_ids, deterministic=True), params)
    plain_variables = with_bilm(plain.init(jax.random.PRNGKey(0), char_ids, deterministic=True), params)
    assert jax.tree.map(np.shape, variables) == jax.tree.map(np.shape, plain_variables)
    a = jitted.apply(variables, char_ids, deterministic=True)
    b = plain.apply(variables, char_ids, deterministic=True)
    np.testing.assert_allclose(np.asarray(a[0]), np.asarray(b[0]), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(a[1]), np.asarray(b[1]))
    # With dropout (nn.jit derives its own dropout keys, so not the plain module's numbers).
    noisy = jitted.apply(variables, char_ids, deterministic=False, rngs={"dropout": jax.random.PRNGKey(2)})[0]
    assert np.all(np.isfinite(np.asarray(noisy))) and not np.allclose(np.asarray(noisy), np.asarray(a[0]))


def test_jit_of_apply_takes_the_frozen_bilm_as_arguments_not_constants(model):
    config, params, char_ids = model
    tagger = Tagger(Elmo(config))
    variables = with_bilm(tagger.init(jax.random.PRNGKey(0), char_ids, deterministic=True), params)
    frozen = {FROZEN_COLLECTION: variables[FROZEN_COLLECTION]}
    largest_weight = max(x.size for x in jax.tree.leaves(params))

    def run(params, frozen, char_ids):
        return tagger.apply({"params": params, **frozen}, char_ids, deterministic=True)

    as_args = jax.jit(run).lower(variables["params"], frozen, char_ids).as_text()
    assert max(constant_sizes(as_args)) < largest_weight  # only small constants (char ids of <S>, </S>)
    # The check sees weights closed over: they are compiled in as constants.
    closed = jax.jit(lambda p, ids: run(p, frozen, ids)).lower(variables["params"], char_ids).as_text()
    assert max(constant_sizes(closed)) >= largest_weight


# ------------------------------------------------------------------------------- NNX


class TaggerNNX(nnx.Module):
    def __init__(self, elmo, rngs):
        self.elmo = elmo
        self.out = nnx.Linear(elmo.config.output_dim, N_TAGS, rngs=rngs)

    def __call__(self, char_ids, *, deterministic=None):
        out = self.elmo(char_ids, deterministic=deterministic)
        return self.out(out["elmo_representations"][0]), out["mask"]


@nnx.jit
def nnx_train_step(model, optimizer, char_ids):
    loss, grads = nnx.value_and_grad(lambda m: masked_ce(*m(char_ids, deterministic=False)))(model)
    optimizer.update(model, grads)
    return loss


def test_nnx_elmo_frozen_and_trainable(model):
    config, params, char_ids = model
    for trainable in (True, False):
        elmo = ElmoNNX(config, params, dropout=0.1, trainable_bilm=trainable, do_layer_norm=True, rngs=nnx.Rngs(0))
        param_paths = {path for path, _ in nnx.to_flat_state(nnx.state(elmo, nnx.Param))}
        mix = {("scalar_mix_0", "weights"), ("scalar_mix_0", "gamma")}
        assert {p for p in param_paths if p[0] != "bilm"} == mix
        n_bilm = len([p for p in param_paths if p[0] == "bilm"])
        assert n_bilm == (len(jax.tree.leaves(params)) if trainable else 0)
        assert len(jax.tree.leaves(nnx.state(elmo, FrozenBiLM))) == (0 if trainable else len(jax.tree.leaves(params)))
    # A (jitted) train step with weight decay on the frozen model: the mix moves, the biLM does not.
    tagger = TaggerNNX(elmo, nnx.Rngs(1))
    optimizer = nnx.Optimizer(tagger, optax.adamw(1e-2, weight_decay=0.5), wrt=nnx.Param)
    before = bilm_leaves(params)
    loss = nnx_train_step(tagger, optimizer, char_ids)
    assert np.isfinite(float(loss))
    assert not np.allclose(np.asarray(tagger.elmo.scalar_mix_0.weights[...]), 0.0)
    for a, b in zip(bilm_leaves(tagger.elmo.bilm_weights()), before):
        np.testing.assert_array_equal(a, b)
    # A call's own dropout rngs, as nnx.Dropout takes them: the same key, the same mask; the
    # control, the module's own stream, draws another one each call.
    elmo = ElmoNNX(config, params, dropout=0.5, rngs=nnx.Rngs(0))
    first, again = (
        elmo(char_ids, deterministic=False, rngs=nnx.Rngs(dropout=7))["elmo_representations"][0] for _ in "ab"
    )
    np.testing.assert_array_equal(np.asarray(first), np.asarray(again))
    own = [elmo(char_ids, deterministic=False)["elmo_representations"][0] for _ in "ab"]
    assert not np.array_equal(np.asarray(own[0]), np.asarray(own[1]))


def test_nnx_matches_linen(model):
    config, params, char_ids = model
    linen = Elmo(config, num_output_representations=2, do_layer_norm=True, convention="bilm_tf")
    variables = with_bilm(linen.init(jax.random.PRNGKey(0), char_ids, deterministic=True), params)
    elmo = ElmoNNX(
        config, params, num_output_representations=2, do_layer_norm=True, convention="bilm_tf", rngs=nnx.Rngs(0)
    )
    elmo.scalar_mix_1.weights[...] = jnp.array([1.0, 0.0, -1.0])
    p = jax.tree.map(np.array, variables["params"])
    p["scalar_mix_1"]["weights"][:] = [1.0, 0.0, -1.0]
    a = linen.apply({**variables, "params": p}, char_ids, deterministic=True)
    b = elmo(char_ids, deterministic=True)
    for k in range(2):
        np.testing.assert_array_equal(
            np.asarray(a["elmo_representations"][k]), np.asarray(b["elmo_representations"][k])
        )
    np.testing.assert_array_equal(np.asarray(a["mask"]), np.asarray(b["mask"]))
    noisy = elmo(char_ids, deterministic=False)["elmo_representations"][0]
    assert not np.array_equal(np.asarray(noisy), np.asarray(b["elmo_representations"][0]))
    layers, mask, _ = bilm_layers(params, config, char_ids)
    c = ElmoNNX(config, None, num_output_representations=2, do_layer_norm=True, convention="bilm_tf", rngs=nnx.Rngs(0))
    c.scalar_mix_1.weights[...] = jnp.array([1.0, 0.0, -1.0])
    c = c(layers=layers, mask=mask, deterministic=True)
    np.testing.assert_allclose(
        np.asarray(c["elmo_representations"][1]), np.asarray(b["elmo_representations"][1]), atol=1e-6
    )


def test_docstring_examples_run(model):
    """The module docstring's two examples, on the fixture model."""
    blocks = re.findall(r"::\n\n((?:    .*\n|\n)+)", fm.__doc__)
    assert len(blocks) == 2
    options, weights = (str(p) for p in model_files("allennlp"))
    ns = {}
    for code in blocks:
        code = textwrap.dedent(code).replace('"options.json"', repr(options)).replace('"weights.hdf5"', repr(weights))
        exec(compile(code, "flax_modules docstring", "exec"), ns)
    assert np.isfinite(float(ns["loss"]))
    # The NNX example's step is the one test_nnx_elmo_frozen_and_trainable runs; here, its model.
    assert isinstance(ns["model"], nnx.Module) and isinstance(ns["optimizer"], nnx.Optimizer)
    out, mask = ns["model"](ns["char_ids"], deterministic=True)
    assert out.shape == (2, 3, 17) and np.asarray(mask).sum() == 4
