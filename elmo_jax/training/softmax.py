"""The sampled softmax of bilm-tf training, and the full softmax for evaluation, as pure functions.

bilm-tf trains with ``tf.nn.sampled_softmax_loss`` at its defaults: candidates come from a
``LogUniformCandidateSampler`` with ``unique=True`` (ids are assumed sorted by decreasing
frequency, so the log-uniform "Zipf" proposal roughly follows the unigram distribution),
``subtract_log_q=True`` and ``remove_accidental_hits=True``. Sampling happens on the host with
numpy (it is a data-dependent ``while`` loop that XLA has no business running); the loss is
plain jnp and takes the sampled rows of the softmax already gathered, so a train step can
differentiate w.r.t. those ``[S, P]`` rows only and the ``[V, P]`` table never gets a dense
gradient.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

Precision = jax.lax.Precision | jax.lax.DotAlgorithmPreset | str | None  # as elmo_jax.model.compute.Compute.precision


def log_uniform_prob(ids: jax.Array, vocab_size: int) -> jax.Array:
    """``P(k) = (log(k+2) - log(k+1)) / log(V+1)`` for ``ids`` of any shape, float32.

    Written as ``log1p(1/(k+1))``: the difference of two nearly equal logs loses every digit in
    float32 for the rare ids (``k ~ 8e5``), log1p keeps full relative precision.
    """
    k = jnp.asarray(ids, jnp.float32)
    return jnp.log1p(1.0 / (k + 1.0)) / np.float32(np.log(vocab_size + 1.0))


def expected_count(ids: jax.Array, num_tries, vocab_size: int) -> jax.Array:
    """``Q(k) = 1 - (1 - P(k))**num_tries``, float32 shaped like ``ids`` (any shape, int): the
    chance that id ``k`` is among the candidates.

    This is TF's "expected count" for a unique sampler that needed ``num_tries`` draws. The
    naive power rounds ``1 - P`` to 1 in float32 for rare ids (``P ~ 1e-7``) and gives 0, whose
    log is -inf; ``-expm1(n * log1p(-P))`` stays accurate. ``num_tries`` may be traced.
    (TF itself switches to ``P * num_tries`` when ``num_tries == num_sampled``, i.e. when no
    draw repeated; for real vocabularies that never happens and the two agree to O(P^2) anyway.)
    """
    p = log_uniform_prob(ids, vocab_size)
    return -jnp.expm1(jnp.asarray(num_tries, jnp.float32) * jnp.log1p(-p))


@functools.lru_cache(maxsize=16)
def _expected_draws(num_sampled: int, vocab_size: int) -> float:
    """The number of draws ``n`` after which ``num_sampled`` distinct ids are expected:
    ``sum_k 1 - (1 - P(k))**n = num_sampled``, by bisection (once per run: ~0.1 s at V ~ 8e5)."""
    k = np.arange(vocab_size, dtype=np.float64)
    log_miss = np.log1p(-np.log1p(1.0 / (k + 1.0)) / np.log(vocab_size + 1.0))  # log(1 - P(k))
    distinct = lambda n: vocab_size - np.exp(n * log_miss).sum()  # noqa: E731
    lo = hi = float(num_sampled)
    while distinct(hi) < num_sampled:
        hi *= 2
    for _ in range(24):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if distinct(mid) < num_sampled else (lo, mid)
    return hi


def sample_log_uniform_unique(rng: np.random.Generator, num_sampled: int, vocab_size: int) -> tuple[np.ndarray, int]:
    """TF's ``LogUniformCandidateSampler(unique=True)`` on the host.

    Draws ids with replacement from ``P(k)`` until ``num_sampled`` distinct ones have appeared.
    Returns ``(candidates [num_sampled] int32, num_tries)``: the distinct ids in order of first
    draw and the exact number of draws that took (the draw giving the last new id included).

    A Python loop over draws costs ~10 ms at ``S = 8192``; instead uniforms are drawn in chunks
    of 1.04x the expected number of draws (the draws needed vary by ~1 %, so one chunk nearly
    always does), and each id's first draw is found in O(chunk) with ``np.minimum.at`` where a
    ``[V]`` table is small, by sorting the chunk where it is not. Since the chunks consume the
    generator's stream in order, the result equals that of the one-draw-at-a-time loop on the
    same stream. (Sorting a growing array of all draws, as before, took 9.6 ms at S = 8192,
    V = 28k, where ids repeat most; this takes 1.1 ms.)
    """
    if not 0 < num_sampled < vocab_size:
        raise ValueError(
            f"num_sampled must be in [1, vocab_size): got num_sampled={num_sampled}, "
            f"vocab_size={vocab_size} (a unique sampler cannot draw the whole vocabulary)"
        )
    log_range = np.log(vocab_size + 1.0)
    chunk = int(1.04 * _expected_draws(num_sampled, vocab_size)) + 64
    found: list[np.ndarray] = []
    drawn, need = 0, num_sampled
    while True:
        u = rng.random(chunk)
        # Inverse CDF: the CDF of P at k is log(k+2) / log(V+1). The clip only guards round-off.
        ids = np.clip(np.floor(np.exp(u * log_range)).astype(np.int64) - 1, 0, vocab_size - 1)
        new = _first_draws(ids, vocab_size)
        if found:  # a later chunk (rare): drop ids an earlier one found
            new = new[~np.isin(ids[new], np.concatenate(found))]
        if new.size >= need:
            found.append(ids[new[:need]])
            return np.concatenate(found).astype(np.int32), drawn + int(new[need - 1]) + 1
        found.append(ids[new])
        need -= new.size
        drawn += chunk


def _first_draws(ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """The positions in ``ids`` where an id appears for the first time, ascending.

    Through a ``[V]`` int32 table of first positions while V is at most 128x the draws, else by
    sorting the draws (the table's cost grows with V, the sort's with the draws, and a slot
    filled costs far less than a draw sorted). At S = 8192 and V = 793,471 (chunks of about
    16,800 draws) that is the table: both directions' candidates took 1.1-1.5 ms a step, against
    5.3-5.4 ms by sorting (``benchmarks/bench_train.py --pipeline-only``,
    ``benchmarks/results/cpu/host_pipeline.txt``).
    """
    if vocab_size > 128 * ids.size:
        _, first = np.unique(ids, return_index=True)
        return np.sort(first)
    at = np.arange(ids.size, dtype=np.int32)
    first = np.full(vocab_size, ids.size, np.int32)
    np.minimum.at(first, ids, at)
    return np.flatnonzero(first[ids] == at)


def sampled_logits(
    h: jax.Array,
    targets: jax.Array,
    true_w: jax.Array,
    true_b: jax.Array,
    cand_ids: jax.Array,
    cand_w: jax.Array,
    cand_b: jax.Array,
    num_tries,
    vocab_size: int,
    *,
    precision: Precision = "highest",
) -> tuple[jax.Array, jax.Array]:
    """The logits of ``sampled_softmax_loss`` (same arguments): each position's true logit
    ``[N]`` and its candidates' ``[N, S]``, both less ``log Q``, accidental hits at float32's
    minimum (see there)."""
    true_logit = jnp.sum(h * true_w, axis=-1) + true_b - jnp.log(expected_count(targets, num_tries, vocab_size))
    sampled = (
        jnp.dot(h, cand_w.T, precision=precision) + cand_b - jnp.log(expected_count(cand_ids, num_tries, vocab_size))
    )
    hit = cand_ids[None, :] == targets[:, None]
    return true_logit, jnp.where(hit, jnp.finfo(sampled.dtype).min, sampled)


def sampled_softmax_loss(
    h: jax.Array,
    targets: jax.Array,
    true_w: jax.Array,
    true_b: jax.Array,
    cand_ids: jax.Array,
    cand_w: jax.Array,
    cand_b: jax.Array,
    num_tries,
    vocab_size: int,
    *,
    precision: Precision = "highest",
) -> jax.Array:
    """Per-position sampled softmax cross-entropy ``[N]`` (``tf.nn.sampled_softmax_loss``).

    Shapes: ``h [N, P]``, ``targets [N]``, ``true_w [N, P] = W[targets]``, ``true_b [N]``,
    ``cand_ids [S]``, ``cand_w [S, P] = W[cand_ids]``, ``cand_b [S]``; ``num_tries`` from the
    sampler (may be traced).

    Subtracting ``log Q`` from every logit makes the sampled softmax an unbiased-ish estimate of
    the full one (frequent ids are over-represented among candidates and get discounted). A
    candidate equal to a position's own target would count the target as a negative too, so that
    logit is pushed to float32's minimum, exactly where TF adds ``-FLOAT_MAX``.
    """
    true_logit, sampled = sampled_logits(
        h, targets, true_w, true_b, cand_ids, cand_w, cand_b, num_tries, vocab_size, precision=precision
    )
    # logsumexp over [true, sampled] without building that [N, 1 + S] array (a copy of the
    # whole block, and its slice in the backward pass: a fifth of the sampled softmax's
    # gradient time on XLA:CPU, ``benchmarks/bench_grad.py --part softmax``). As
    # jax.nn.logsumexp, the max is a constant to autodiff.
    top = jax.lax.stop_gradient(jnp.maximum(true_logit, sampled.max(axis=1)))
    total = jnp.exp(true_logit - top) + jnp.exp(sampled - top[:, None]).sum(axis=1)
    return top + jnp.log(total) - true_logit


def full_softmax_loss(
    h: jax.Array,
    targets: jax.Array,
    w: jax.Array,
    b: jax.Array,
    *,
    precision: Precision = "highest",
    block: int | None = None,
    axis_name: str | None = None,
) -> jax.Array:
    """Per-position cross-entropy ``[N]`` of the full softmax: ``h [N, P]``, ``targets [N]`` row
    indices, ``w [V, P]``, ``b [V]``; rows with bias ``-inf`` (padding) take no probability.

    The logits are never materialised whole: the rows are visited ``block`` at a time (``block``
    divides ``V``; default all at once) with a running max, a running sum of exponentials and the
    target's logit picked out of the block that holds it, so memory is ``[N, block]`` for any V
    (``[N, V]`` at V = 793,471 and 2,560 positions would be 8 GB). Under ``axis_name`` the rows
    are split over that mesh axis, ``w``/``b`` being this device's contiguous share (``targets``
    still index the whole table): each device reduces its share, then one ``pmax`` and two
    ``psum`` of ``[N]`` combine them; nothing ``[N, V]``-sized crosses the wire.
    """
    v = w.shape[0]
    block = block or v
    if v % block:
        raise ValueError(f"block {block} does not divide the {v} rows of the softmax")
    first = jax.lax.axis_index(axis_name) * v if axis_name is not None else 0
    local = targets - first
    n = h.shape[0]
    # A finite floor, not -inf: a block of padding rows alone would give exp(-inf - -inf) = nan.
    floor = jnp.full((n,), jnp.finfo(jnp.float32).min, jnp.float32)

    def visit(i, carry):
        top, total, true = carry
        w_blk = jax.lax.dynamic_slice_in_dim(w, i * block, block)
        logits = jnp.dot(h, w_blk.T, precision=precision) + jax.lax.dynamic_slice_in_dim(b, i * block, block)
        new_top = jnp.maximum(top, logits.max(axis=1))
        total = total * jnp.exp(top - new_top) + jnp.exp(logits - new_top[:, None]).sum(axis=1)
        at = local - i * block
        here = (at >= 0) & (at < block)
        picked = jnp.take_along_axis(logits, jnp.clip(at, 0, block - 1)[:, None], axis=1)[:, 0]
        return new_top, total, true + jnp.where(here, picked, 0.0)

    init = (floor, jnp.zeros((n,), jnp.float32), jnp.zeros((n,), jnp.float32))
    if axis_name is not None:  # the loop's results differ per device: so must its initial carry
        init = jax.lax.pcast(init, axis_name, to="varying")
    top, total, true = jax.lax.fori_loop(0, v // block, visit, init)
    if axis_name is not None:
        everywhere = jax.lax.pmax(top, axis_name)
        total = jax.lax.psum(total * jnp.exp(top - everywhere), axis_name)
        true, top = jax.lax.psum(true, axis_name), everywhere
    return top + jnp.log(total) - true
