"""Sampled softmax: log-uniform probabilities, the unique sampler, and the losses against numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from elmo_jax.training import softmax


def np_log_uniform(k, vocab_size):
    k = np.asarray(k, np.float64)
    return (np.log(k + 2) - np.log(k + 1)) / np.log(vocab_size + 1)


def np_expected_count(k, num_tries, vocab_size):
    return -np.expm1(num_tries * np.log1p(-np_log_uniform(k, vocab_size)))


def reference_sampler(rng, num_sampled, vocab_size):
    """TF's unique sampling loop, one draw at a time."""
    seen, tries = [], 0
    while len(seen) < num_sampled:
        k = int(np.exp(rng.random() * np.log(vocab_size + 1))) - 1
        tries += 1
        if k not in seen:
            seen.append(k)
    return np.array(seen), tries


def test_log_uniform_prob_sums_to_one_and_matches_formula():
    v = 1000
    k = np.arange(v)
    assert np_log_uniform(k, v).sum() == pytest.approx(1.0, abs=1e-12)
    p = np.asarray(softmax.log_uniform_prob(jnp.arange(v), v))
    assert p.dtype == np.float32
    np.testing.assert_allclose(p, np_log_uniform(k, v), rtol=1e-6)
    # The rare end of a real vocabulary, where log(k+2) - log(k+1) cancels in float32.
    big = 793471
    k = np.array([0, 1000, big - 2, big - 1])
    np.testing.assert_allclose(softmax.log_uniform_prob(k, big), np_log_uniform(k, big), rtol=1e-6)


def test_expected_count_tiny_p_huge_tries():
    v = 793471
    k = np.array([0, 1, 100, 10_000, v - 1])
    for n in [1, 8192, 16_000, 1e6, 1e9, 1e12]:
        q = np.asarray(softmax.expected_count(k, n, v))
        assert np.all((q >= 0) & (q <= 1))
        np.testing.assert_allclose(q, np_expected_count(k, n, v), rtol=1e-5)
    # A traced num_tries (the train step passes it as a jit argument).
    q = jax.jit(softmax.expected_count, static_argnums=2)(k, jnp.int32(16_000), v)
    np.testing.assert_allclose(q, np_expected_count(k, 16_000, v), rtol=1e-5)


@pytest.mark.parametrize("vocab_size,num_sampled", [(32, 16), (50, 10), (793471, 8192)])
def test_sampler_basic(vocab_size, num_sampled):
    cands, tries = softmax.sample_log_uniform_unique(np.random.default_rng(0), num_sampled, vocab_size)
    assert cands.dtype == np.int32 and cands.shape == (num_sampled,)
    assert len(np.unique(cands)) == num_sampled
    assert cands.min() >= 0 and cands.max() < vocab_size
    assert tries >= num_sampled
    again = softmax.sample_log_uniform_unique(np.random.default_rng(0), num_sampled, vocab_size)
    np.testing.assert_array_equal(again[0], cands)
    assert again[1] == tries


@pytest.mark.parametrize("vocab_size,num_sampled", [(32, 16), (50, 10), (5000, 300), (28_000, 2048)])
def test_sampler_equals_one_draw_at_a_time_loop(vocab_size, num_sampled):
    # The chunked draws consume the generator's stream in the same order as TF's loop would,
    # so candidates, their order and num_tries must all be identical.
    for seed in range(20):
        cands, tries = softmax.sample_log_uniform_unique(np.random.default_rng(seed), num_sampled, vocab_size)
        ref, ref_tries = reference_sampler(np.random.default_rng(seed), num_sampled, vocab_size)
        np.testing.assert_array_equal(cands, ref)
        assert tries == ref_tries


@pytest.mark.parametrize("vocab_size", [1_000, 100_000, 2_000_000])
def test_first_draws_by_table_and_by_sorting_agree(vocab_size):
    # 2,000 log-uniform draws: V = 1,000 and 100,000 take the [V] table, 2,000,000 the sort.
    ids = np.floor(np.exp(np.random.default_rng(3).random(2_000) * np.log(vocab_size + 1.0))).astype(np.int64) - 1
    seen, expected = set(), []
    for i, k in enumerate(ids.tolist()):
        if k not in seen:
            seen.add(k)
            expected.append(i)
    np.testing.assert_array_equal(softmax._first_draws(ids, vocab_size), expected)


def test_sampler_rejects_too_many_samples():
    with pytest.raises(ValueError, match="num_sampled"):
        softmax.sample_log_uniform_unique(np.random.default_rng(0), 32, 32)


def test_sampler_statistics():
    v, s, repeats = 50, 10, 4000
    rng = np.random.default_rng(1234)
    k = np.arange(v)
    included, mean_q, first = np.zeros(v), np.zeros(v), np.zeros(v)
    for _ in range(repeats):
        cands, tries = softmax.sample_log_uniform_unique(rng, s, v)
        included[cands] += 1
        first[cands[0]] += 1
        mean_q += np_expected_count(k, tries, v)
    included, mean_q, first = included / repeats, mean_q / repeats, first / repeats

    # The first candidate is a single draw, so it follows P(k) exactly.
    p = np_log_uniform(k, v)
    assert np.all(np.abs(first - p) <= 5 * np.sqrt(p * (1 - p) / repeats) + 1e-3)

    # TF's Q(k) = 1 - (1 - P)^num_tries is an approximation of the inclusion probability: it
    # treats num_tries as fixed although it is the stopping time of the loop (the last draw is
    # always a new id). With 1e5 repeats the gap measured up to 0.013 (at k=0, V=50, S=10), so
    # the tolerance is 5 binomial standard errors plus 0.02 for that model bias.
    se = np.sqrt(mean_q * (1 - mean_q) / repeats)
    assert np.all(np.abs(included - mean_q) <= 5 * se + 0.02)
    assert included.sum() == pytest.approx(s)


def np_sampled_loss(h, targets, w, b, cand_ids, num_tries, v, remove_hits=True):
    h, w, b = (np.asarray(x, np.float64) for x in (h, w, b))
    losses = []
    for n, t in enumerate(targets):
        keep = cand_ids != t if remove_hits else np.ones(len(cand_ids), bool)  # hits take no part
        ids = np.concatenate([[t], cand_ids[keep]])
        logits = w[ids] @ h[n] + b[ids] - np.log(np_expected_count(ids, num_tries, v))
        m = logits.max()
        losses.append(m + np.log(np.exp(logits - m).sum()) - logits[0])
    return np.array(losses)


def make_problem(seed=0, n=12, p=16, v=40, s=10):
    rng = np.random.default_rng(seed)
    h = rng.normal(size=(n, p)).astype(np.float32)
    w = (0.3 * rng.normal(size=(v, p))).astype(np.float32)
    b = (0.1 * rng.normal(size=v)).astype(np.float32)
    cand_ids, tries = softmax.sample_log_uniform_unique(rng, s, v)
    # Make sure some positions have an accidental hit, and some do not.
    targets = rng.integers(0, v, size=n).astype(np.int32)
    targets[:3] = cand_ids[[0, 4, 9]]
    targets[3:] = np.where(np.isin(targets[3:], cand_ids), (cand_ids.max() + 1) % v, targets[3:])
    return h, targets, w, b, cand_ids, tries, v


def call_sampled(h, targets, w, b, cand_ids, tries, v, **kw):
    return softmax.sampled_softmax_loss(
        h, targets, w[targets], b[targets], cand_ids, w[cand_ids], b[cand_ids], tries, v, **kw
    )


def test_sampled_softmax_loss_matches_numpy_and_masks_hits():
    h, targets, w, b, cand_ids, tries, v = make_problem()
    loss = np.asarray(call_sampled(h, targets, w, b, cand_ids, tries, v))
    assert loss.shape == targets.shape and loss.dtype == np.float32
    expected = np_sampled_loss(h, targets, w, b, cand_ids, tries, v)
    np.testing.assert_allclose(loss, expected, atol=1e-5, rtol=1e-5)
    # Without the masking the hit positions would differ (the target would also be a negative).
    assert np.isin(targets[:3], cand_ids).all() and not np.isin(targets[3:], cand_ids).any()
    unmasked = np_sampled_loss(h, targets, w, b, cand_ids, tries, v, remove_hits=False)
    assert np.all(np.abs(loss[:3] - unmasked[:3]) > 1e-3)
    np.testing.assert_allclose(loss[3:], unmasked[3:], atol=1e-5, rtol=1e-5)
    # Dropping the hit candidate by hand for one position gives the same loss.
    row = 0
    drop = cand_ids != targets[row]
    one = softmax.sampled_softmax_loss(
        h[row : row + 1],
        targets[row : row + 1],
        w[targets[row : row + 1]],
        b[targets[row : row + 1]],
        cand_ids[drop],
        w[cand_ids[drop]],
        b[cand_ids[drop]],
        tries,
        v,
    )
    np.testing.assert_allclose(loss[row], one[0], atol=1e-6, rtol=1e-6)


def np_full_loss(h, targets, w, b):
    logits = h.astype(np.float64) @ w.T.astype(np.float64) + b
    m = logits.max(axis=1, keepdims=True)
    log_probs = logits - m - np.log(np.exp(logits - m).sum(axis=1, keepdims=True))
    return -log_probs[np.arange(len(targets)), targets]


@pytest.mark.parametrize("block", [None, 40, 8, 5, 1])
def test_full_softmax_loss_matches_numpy_in_any_block_size(block):
    h, targets, w, b, *_ = make_problem(seed=1)
    got = jax.jit(softmax.full_softmax_loss, static_argnames="block")(h, targets, w, b, block=block)
    np.testing.assert_allclose(got, np_full_loss(h, targets, w, b), atol=1e-5, rtol=1e-5)


def test_full_softmax_loss_padding_rows_take_no_probability_even_a_whole_block():
    h, targets, w, b, *_ = make_problem(seed=3)
    pad = 16  # two whole blocks of 8 (and the first block is padding only)
    w_pad = np.concatenate([np.ones((pad, w.shape[1]), np.float32), w])
    b_pad = np.concatenate([np.full(pad, -np.inf, np.float32), b])
    got = softmax.full_softmax_loss(h, targets + pad, w_pad, b_pad, block=8)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, np_full_loss(h, targets, w, b), atol=1e-5, rtol=1e-5)


def test_full_softmax_loss_with_rows_split_over_two_devices():
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    h, targets, w, b, *_ = make_problem(seed=4)
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    fn = jax.jit(
        jax.shard_map(
            lambda h, t, w, b: softmax.full_softmax_loss(h, t, w, b, block=4, axis_name="x"),
            mesh=mesh,
            in_specs=(P(), P(), P("x"), P("x")),
            out_specs=P(),
        )
    )
    np.testing.assert_allclose(fn(h, targets, w, b), np_full_loss(h, targets, w, b), atol=1e-5, rtol=1e-5)


def test_full_softmax_loss_rejects_a_block_that_does_not_divide_the_rows():
    h, targets, w, b, *_ = make_problem(seed=1)
    with pytest.raises(ValueError, match="block 7 does not divide the 40 rows"):
        softmax.full_softmax_loss(h, targets, w, b, block=7)


def test_grad_under_jit_is_finite():
    h, targets, w, b, cand_ids, tries, v = make_problem(seed=2)

    @jax.jit
    def grads(true_w, cand_w, num_tries):
        def f(true_w, cand_w):
            return softmax.sampled_softmax_loss(
                h, targets, true_w, b[targets], cand_ids, cand_w, b[cand_ids], num_tries, v
            ).mean()

        return jax.grad(f, argnums=(0, 1))(true_w, cand_w)

    g_true, g_cand = grads(w[targets], w[cand_ids], jnp.int32(tries))
    assert g_true.shape == (len(targets), h.shape[1]) and g_cand.shape == (len(cand_ids), h.shape[1])
    assert np.isfinite(g_true).all() and np.isfinite(g_cand).all()
    assert np.abs(g_cand).sum() > 0
    # d loss / d true_w for position n is (softmax prob of the true class - 1) * h[n] / N.
    h64 = h.astype(np.float64)
    loss = np_sampled_loss(h, targets, w, b, cand_ids, tries, v)
    expected = (np.exp(-loss) - 1)[:, None] * h64 / len(targets)
    np.testing.assert_allclose(g_true, expected, atol=1e-5)
