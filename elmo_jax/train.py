"""The pretraining step: sampled-softmax biLM loss, dropout, clipping, Adagrad, sparse softmax.

``train_step(state, batch) -> (state, metrics)`` is a pure function over a named device axis;
``make_train_step`` wraps it in ``jax.pmap`` over the local devices (and, after
``jax.distributed.initialize``, the same step spans every process's devices).

The softmax ``[V, P]`` (1.6 GB at bilm-tf's 793,471 words) is never differentiated densely: the
step gathers the rows of this step's candidates and targets, differentiates w.r.t. those rows
only, sums duplicate rows across devices, and scatters the Adagrad update back into the weights
and accumulators in place (the state is donated). Only those rows enter the global norm; their
gradient is exactly the dense one restricted to its non-zero rows.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from elmo_jax import bilm, char_cnn, lstm
from elmo_jax.config import ModelConfig, TrainConfig
from elmo_jax.softmax import full_softmax_loss, sample_log_uniform_unique, sampled_softmax_loss

AXIS = "batch"
State = dict[str, Any]


def dense_optimizer(train: TrainConfig) -> optax.GradientTransformation:
    # TF's Adagrad: accumulator starts at 1.0 and has no epsilon.
    return optax.adagrad(train.learning_rate, initial_accumulator_value=1.0, eps=0.0)


def init_state(key: jax.Array, model: ModelConfig, train: TrainConfig) -> State:
    """A fresh, unreplicated train state for one device's rows (``train.batch_size``)."""
    k_bilm, k_softmax, k_rng = jax.random.split(key, 3)
    p, v = model.lstm.projection_dim, train.n_tokens_vocab
    params = {
        "bilm": bilm.init(k_bilm, model),
        # bilm-tf: N(0, 1/sqrt(P)) softmax weights, zero bias; shared by both directions.
        "softmax": {"w": jax.random.normal(k_softmax, (v, p)) / np.sqrt(p), "b": jnp.zeros((v,))},
    }
    return {
        "step": jnp.zeros((), jnp.int32),
        "params": params,
        "opt": {"bilm": dense_optimizer(train).init(params["bilm"]),
                "softmax": {"w": jnp.ones((v, p)), "b": jnp.ones((v,))}},
        "lstm": lstm.zero_state(model, train.batch_size),
        "rng": k_rng,  # a raw uint32 key: checkpoints as a plain array
    }


def _token_vectors(params: dict, model: ModelConfig, batch: dict, precision, dtype) -> jax.Array:
    """``[2, B, T, P]``: each distinct word of the batch encoded once, then gathered."""
    words = char_cnn.apply(params["char_cnn"], model, batch["chars"], precision, dtype)
    return words[batch["inputs"]]


def _row_keys(state: State, rows: jax.Array) -> jax.Array:
    # Keys depend on (seed, step, global row) only, never on the device that holds the row.
    base = jax.random.fold_in(state["rng"], state["step"])
    return jax.vmap(lambda r: jax.random.fold_in(base, r))(rows)


def train_step(state: State, batch: dict, *, model: ModelConfig, train: TrainConfig,
               precision="highest", dtype=jnp.float32, axis_name: str | None = AXIS
               ) -> tuple[State, dict]:
    """One optimisation step on this device's rows.

    ``batch`` (per device): ``chars [U, C]``, ``inputs [2, B, T]`` (indices into ``chars``),
    ``targets [2, B, T]``, ``rows [B]`` global row ids, ``candidates [2, S]`` sampled ids and
    ``num_tries [2]`` (per direction). With ``axis_name`` None it runs on one device alone.
    """
    v, p = train.n_tokens_vocab, model.lstm.projection_dim
    targets, cands = batch["targets"], batch["candidates"]
    n_pos = targets.shape[1] * targets.shape[2]
    flat_targets = targets.reshape(2, n_pos)
    row_keys = _row_keys(state, batch["rows"])
    sm = state["params"]["softmax"]

    def loss_fn(bilm_params, cand_w, cand_b, true_w, true_b):
        x = _token_vectors(bilm_params, model, batch, precision, dtype)
        mask = jnp.ones(targets.shape[1:], bool)
        # Gradients stop at the window edge: the carried state is an input, not a graph.
        carried = jax.lax.stop_gradient(state["lstm"])
        outs, new_lstm = lstm.run(bilm_params["lstm"], model, x, mask, carried, precision, dtype,
                                  train.dropout, row_keys)
        top = outs[-1]
        if train.dropout > 0:
            top = lstm.dropout(top, train.dropout, row_keys, salt=model.lstm.n_layers)
        per_dir = [
            sampled_softmax_loss(top[d].reshape(n_pos, p), flat_targets[d], true_w[d], true_b[d], cands[d],
                                 cand_w[d], cand_b[d], batch["num_tries"][d], v, precision).mean()
            for d in range(2)]
        loss = 0.5 * (per_dir[0] + per_dir[1])
        # bilm-tf differentiates loss * unroll_steps; with Adagrad's initial accumulator of 1.0
        # that scale changes the effective step size, so it is kept.
        return loss * train.unroll_steps, (jnp.stack(per_dir), new_lstm)

    rows_in = (sm["w"][cands], sm["b"][cands], sm["w"][flat_targets], sm["b"][flat_targets])
    grads, (per_dir, new_lstm) = jax.grad(loss_fn, argnums=(0, 1, 2, 3, 4), has_aux=True)(
        state["params"]["bilm"], *rows_in)
    g_bilm, g_cw, g_cb, g_tw, g_tb = grads
    ids = jnp.concatenate([cands.reshape(-1), flat_targets.reshape(-1)])
    g_w = jnp.concatenate([g_cw.reshape(-1, p), g_tw.reshape(-1, p)])
    g_b = jnp.concatenate([g_cb.reshape(-1), g_tb.reshape(-1)])
    if axis_name is not None:
        g_bilm = jax.lax.pmean(g_bilm, axis_name)
        n_dev = jax.lax.psum(1, axis_name)
        ids = jax.lax.all_gather(ids, axis_name).reshape(-1)
        g_w = jax.lax.all_gather(g_w, axis_name).reshape(-1, p) / n_dev
        g_b = jax.lax.all_gather(g_b, axis_name).reshape(-1) / n_dev
    # Sum duplicate rows (a word that is both a target and a candidate, or on two devices).
    # Unused slots get id V: out of range, so the scatters below drop them.
    uniq, inv = jnp.unique(ids, size=ids.shape[0], fill_value=v, return_inverse=True)
    g_w = jax.ops.segment_sum(g_w, inv.reshape(-1), num_segments=ids.shape[0])
    g_b = jax.ops.segment_sum(g_b, inv.reshape(-1), num_segments=ids.shape[0])

    grad_norm = jnp.sqrt(optax.tree_utils.tree_norm(g_bilm, squared=True)
                         + jnp.sum(g_w * g_w) + jnp.sum(g_b * g_b))
    clip = train.all_clip_norm_val
    scale = jnp.where(grad_norm < clip, 1.0, clip / grad_norm)
    g_bilm = jax.tree_util.tree_map(lambda g: g * scale, g_bilm)
    g_w, g_b = g_w * scale, g_b * scale

    updates, opt_bilm = dense_optimizer(train).update(g_bilm, state["opt"]["bilm"], state["params"]["bilm"])
    new_bilm = optax.apply_updates(state["params"]["bilm"], updates)
    new_sm, new_acc = {}, {}
    for name, g in (("w", g_w), ("b", g_b)):
        acc = state["opt"]["softmax"][name].at[uniq].get(mode="fill", fill_value=1.0) + g * g
        rows = sm[name].at[uniq].get(mode="fill", fill_value=0.0) - train.learning_rate * g * jax.lax.rsqrt(acc)
        new_sm[name] = sm[name].at[uniq].set(rows, mode="drop")
        new_acc[name] = state["opt"]["softmax"][name].at[uniq].set(acc, mode="drop")

    loss_sums = per_dir * n_pos
    count = jnp.asarray(n_pos, jnp.float32)
    if axis_name is not None:
        loss_sums = jax.lax.psum(loss_sums, axis_name)
        count = jax.lax.psum(count, axis_name)
    new_state = {
        "step": state["step"] + 1,
        "params": {"bilm": new_bilm, "softmax": new_sm},
        "opt": {"bilm": opt_bilm, "softmax": new_acc},
        "lstm": new_lstm,
        "rng": state["rng"],
    }
    metrics = {"loss_sum_fwd": loss_sums[0], "loss_sum_bwd": loss_sums[1], "count": count,
               "grad_norm": grad_norm}
    return new_state, metrics


def make_train_step(model: ModelConfig, train: TrainConfig, precision="highest", dtype=jnp.float32,
                    devices=None):
    """``train_step`` pmapped over ``devices`` (default: all local ones); the state is donated
    (updated in place, so the [V, P] softmax and its accumulators are never copied)."""
    step = functools.partial(train_step, model=model, train=train, precision=precision, dtype=dtype,
                             axis_name=AXIS)
    return jax.pmap(step, axis_name=AXIS, donate_argnums=(0,), devices=devices)


def eval_step(params: dict, lstm_state: dict, batch: dict, *, model: ModelConfig, precision="highest"
              ) -> tuple[dict, dict]:
    """Full-softmax cross-entropy sums per direction; returns (new LSTM state, sums)."""
    x = _token_vectors(params["bilm"], model, batch, precision, jnp.float32)
    targets = batch["targets"]
    mask = jnp.ones(targets.shape[1:], bool)
    outs, new_lstm = lstm.run(params["bilm"]["lstm"], model, x, mask, lstm_state, precision)
    p = model.lstm.projection_dim
    sm = params["softmax"]
    ce = jnp.stack([full_softmax_loss(outs[-1, d].reshape(-1, p), targets[d].reshape(-1), sm["w"], sm["b"],
                                      precision).reshape(targets.shape[1:]) for d in range(2)])
    return new_lstm, {"ce_fwd": ce[0], "ce_bwd": ce[1]}


def add_candidates(batch: dict, *, step: int, seed: int, num_sampled: int, vocab_size: int,
                   first_device: int = 0, fixed: bool = False) -> dict:
    """Adds ``candidates [D, 2, S]`` and ``num_tries [D, 2]`` to a host batch with device axis D.

    Drawn per (step, global device, direction) from its own seeded generator, so a run is
    reproducible and a resumed run draws what it would have drawn. ``fixed``: every device gets
    the same draw (for tests that compare device layouts).
    """
    n_dev = batch["inputs"].shape[0]
    cands = np.empty((n_dev, 2, num_sampled), np.int32)
    tries = np.empty((n_dev, 2), np.float32)
    for k in range(n_dev):
        for d in range(2):
            device = 0 if fixed else first_device + k
            rng = np.random.default_rng([seed, step, device, d])
            cands[k, d], tries[k, d] = sample_log_uniform_unique(rng, num_sampled, vocab_size)
    return {**batch, "candidates": cands, "num_tries": tries}
