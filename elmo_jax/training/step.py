"""The pretraining step: sampled-softmax biLM loss, dropout, clipping, Adagrad, sharded softmax.

``train_step(state, batch) -> (state, metrics)`` is a per-device function over the mesh axis
``data``; ``make_train_step`` runs it under ``jax.shard_map`` inside ``jax.jit`` over a ``Mesh``
of every device of every process (one program for one host or many). The dense biLM weights are
replicated and their gradients averaged; the softmax ``[V_pad, P]`` and its Adagrad accumulators
are split by rows, one owner per row (``sharded_softmax``). The step fetches the rows of its
candidates and targets from their owners, differentiates w.r.t. those rows only, and sends their
gradients back; each owner sums them and updates its rows in place (the state is donated). Only
those rows enter the global norm; their gradient is exactly the dense one restricted to its
non-zero rows.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from elmo_jax.config import ModelConfig, TrainConfig
from elmo_jax.model import bilm, char_cnn, lstm
from elmo_jax.model.compute import Compute
from elmo_jax.model.gather import take_rows
from elmo_jax.training.sharded_softmax import RowLayout, SparseAdagrad, fetch_rows, plan_fetch, return_grads
from elmo_jax.training.softmax import sample_log_uniform_unique, sampled_softmax_loss

AXIS = "data"


# A pytree whose five fields are all data (none static), registered with jax itself: the
# training core needs no Flax (only elmo_jax.modules imports it; tests/test_layout.py checks).
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything a step changes. As global arrays: ``step``, ``rng`` and the dense biLM
    (``params["bilm"]``, ``opt["bilm"]``) replicated; ``params["softmax"]`` (``w [V_pad, P]``,
    ``b [V_pad]``, in ``RowLayout`` slot order) and ``opt["softmax"]`` split by rows; ``lstm``
    (``c [2, L, R, dim]``, ``h [2, L, R, P]`` for R global rows) split by rows."""

    step: jax.Array
    params: dict
    opt: dict
    lstm: dict
    rng: jax.Array  # a raw uint32 key: checkpoints as a plain array

    def replace(self, **changes) -> TrainState:
        return dataclasses.replace(self, **changes)

    def shared(self) -> dict:
        """What is the same for any number of rows: the checkpoint's ``state`` item."""
        return {"step": self.step, "params": self.params, "opt": self.opt, "rng": self.rng}


def dense_optimizer(train: TrainConfig) -> optax.GradientTransformation:
    # TF's Adagrad: accumulator starts at 1.0 and has no epsilon.
    return optax.adagrad(train.learning_rate, initial_accumulator_value=1.0, eps=0.0)


def state_specs(state: TrainState) -> TrainState:
    """The ``PartitionSpec`` of every leaf over the mesh axis ``data``."""
    rep = lambda tree: jax.tree_util.tree_map(lambda _: P(), tree)  # noqa: E731
    by_row = {k: P(AXIS) for k in ("w", "b")}
    # The same pytree, of specs: TrainState's fields are annotated as arrays.
    return TrainState(
        step=P(),  # type: ignore[arg-type]
        rng=P(),  # type: ignore[arg-type]
        params={"bilm": rep(state.params["bilm"]), "softmax": by_row},
        opt={"bilm": rep(state.opt["bilm"]), "softmax": by_row},
        lstm={k: P(None, None, AXIS) for k in state.lstm},
    )


def state_shardings(state: TrainState, mesh: Mesh) -> TrainState:
    return jax.tree_util.tree_map(
        lambda s: NamedSharding(mesh, s), state_specs(state), is_leaf=lambda x: isinstance(x, P)
    )


def put_global(tree, shardings):
    """Host arrays (the same on every process) -> global arrays with ``shardings`` (a tree or
    one sharding); each process copies only the shards its devices hold."""
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree_util.tree_map(lambda _: shardings, tree)
    return jax.tree_util.tree_map(
        lambda x, s: jax.make_array_from_callback(np.shape(x), s, lambda index: np.asarray(x)[index]), tree, shardings
    )


def init_state(key: jax.Array, model: ModelConfig, train: TrainConfig, rows: int | None = None) -> TrainState:
    """A fresh state for ``rows`` global rows (default ``train.batch_size``).

    Under ``jax.jit(..., out_shardings=state_shardings(...))`` each device draws only its own
    softmax rows (jax's threefry is partitionable). The weights are drawn in slot order:
    N(0, 1/sqrt(P)) as in bilm-tf, zero in the padding slots.
    """
    k_bilm, k_softmax, k_rng = jax.random.split(key, 3)
    p = model.lstm.projection_dim
    layout = RowLayout.for_vocab(train.n_tokens_vocab)
    valid = jnp.asarray(layout.valid())
    params = {
        "bilm": bilm.init(k_bilm, model),
        # bilm-tf: zero bias; the softmax is shared by both directions.
        "softmax": {
            "w": jax.random.normal(k_softmax, (layout.padded, p), jnp.float32) / float(np.sqrt(p)) * valid[:, None],
            "b": jnp.zeros((layout.padded,), jnp.float32),
        },
    }
    sparse = SparseAdagrad(train.learning_rate)
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt={
            "bilm": dense_optimizer(train).init(params["bilm"]),
            "softmax": {k: sparse.init(v) for k, v in params["softmax"].items()},
        },
        lstm=lstm.zero_state(model, train.batch_size if rows is None else rows),
        rng=k_rng,
    )


def token_vectors(params: dict, model: ModelConfig, batch: dict, *, compute: Compute = Compute()) -> jax.Array:
    """``[2, B, T, P]`` float32: each distinct word of the batch (``chars [U, C]`` int32)
    encoded once, then gathered at ``inputs [2, B, T]`` (indices into ``chars``)."""
    words = char_cnn.apply(params["char_cnn"], model, batch["chars"], compute=compute)
    return take_rows(words, batch["inputs"], sums=compute.resolved_layout().row_sums)


def _row_keys(state: TrainState, rows: jax.Array) -> jax.Array:
    # Keys depend on (seed, step, global row) only, never on the device that holds the row. Each
    # draw from a row's key folds in its own salt: LSTM layer k's input dropout k (lstm.run), the
    # top layer's output dropout n_layers, the state resets n_layers + 1. A new draw takes the next
    # salt; reusing one would correlate two draws.
    base = jax.random.fold_in(state.rng, state.step)
    return jax.vmap(lambda r: jax.random.fold_in(base, r))(rows)


def _resets(batch: dict, row_keys: jax.Array, model: ModelConfig, train: TrainConfig) -> jax.Array | None:
    """``[2, B, T]``: the sentence starts where the LSTM state is zeroed (``train.reset_state_prob``)."""
    if train.reset_state_prob <= 0:
        return None
    # Drawn from the row keys like dropout: the same resets however rows are split over devices.
    steps = batch["targets"].shape[2]
    draw = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, model.lstm.n_layers + 1), (2, steps)))(
        row_keys
    )  # [B, 2, T]
    return batch["starts"] & (draw.transpose(1, 0, 2) < train.reset_state_prob)


def _loss(
    bilm_params: dict,
    rows_w: jax.Array,
    rows_b: jax.Array,
    *,
    batch: dict,
    lstm_state: dict,
    row_keys: jax.Array,
    resets: jax.Array | None,
    model: ModelConfig,
    train: TrainConfig,
    compute: Compute,
) -> tuple[jax.Array, tuple[jax.Array, dict]]:
    """The loss ``train_step`` differentiates w.r.t. the dense biLM and the fetched softmax rows
    (``rows_w``, ``rows_b``): the mean sampled-softmax loss of both directions times
    ``unroll_steps``; also the per-direction means ``[2]`` and the new LSTM state."""
    # The named scopes label the parts of the step in a profile (benchmarks/bench_variants.py).
    with jax.named_scope("char_cnn"):
        x = token_vectors(bilm_params, model, batch, compute=compute)
    mask = jnp.ones(batch["targets"].shape[1:], bool)
    # Gradients stop at the window edge: the carried state is an input, not a graph.
    carried = jax.lax.stop_gradient(lstm_state)
    with jax.named_scope("lstm"):
        outs, new_lstm = lstm.run(
            bilm_params["lstm"],
            model,
            x,
            mask,
            carried,
            compute=compute,
            dropout_rate=train.dropout,
            dropout_keys=row_keys,
            resets=resets,
        )
    top = outs[-1]
    if train.dropout > 0:
        top = lstm.dropout(top, train.dropout, row_keys, salt=model.lstm.n_layers)
    per_dir = _sampled_losses(top, rows_w, rows_b, batch, train.n_tokens_vocab, compute)
    loss = 0.5 * (per_dir[0] + per_dir[1])
    # bilm-tf differentiates loss * unroll_steps; with Adagrad's initial accumulator of 1.0
    # that scale changes the effective step size, so it is kept.
    return loss * train.unroll_steps, (jnp.stack(per_dir), new_lstm)


def _sampled_losses(
    top: jax.Array, rows_w: jax.Array, rows_b: jax.Array, batch: dict, vocab_size: int, compute: Compute
) -> list[jax.Array]:
    """Each direction's mean sampled-softmax loss of the top layer ``top [2, B, T, P]``, against
    the fetched softmax rows ``rows_w [n*C, P]``, ``rows_b [n*C]``; draw ``g`` of ``G``
    (``batch["candidates"] [2, G, S]``) scores the device's ``g``-th block of ``B / G`` rows."""
    targets, cands, p = batch["targets"], batch["candidates"], top.shape[-1]
    n_pos = targets.shape[1] * targets.shape[2]
    flat_targets = targets.reshape(2, n_pos)
    cand_at, target_at = batch["cand_index"], batch["target_index"].reshape(2, n_pos)
    draws = cands.shape[1]
    per_draw = n_pos // draws  # positions are row-major: a block of rows is a block of positions
    # A draw's candidates are distinct (a unique draw), so are their rows: the gathers say so, and
    # their gradients' scatter-adds then skip XLA's deterministic-scatter rewrite on GPUs
    # (sharded_softmax.SparseAdagrad.apply). Two draws may share ids, hence a gather per draw.
    cand_w = [[rows_w.at[cand_at[d, g]].get(unique_indices=True) for g in range(draws)] for d in range(2)]
    cand_b = [[rows_b.at[cand_at[d, g]].get(unique_indices=True) for g in range(draws)] for d in range(2)]
    sums = compute.resolved_layout().row_sums
    with jax.named_scope("softmax"):
        # Targets repeat: both directions' are gathered at once, so that the layout's row sums
        # (elmo_jax.model.gather) run once over all of them.
        target_w, target_b = take_rows(rows_w, target_at, sums=sums), take_rows(rows_b, target_at, sums=sums)

        def scored(d: int, g: int) -> jax.Array:
            at = slice(g * per_draw, (g + 1) * per_draw)
            return sampled_softmax_loss(
                top[d].reshape(n_pos, p)[at],
                flat_targets[d, at],
                target_w[d, at],
                target_b[d, at],
                cands[d, g],
                cand_w[d][g],
                cand_b[d][g],
                batch["num_tries"][d, g],
                vocab_size,
                precision=compute.precision,
            )

        # A loop rather than a vmap, after the candidates' gathers: with one draw (the default)
        # this is the program from before draws, and XLA:CPU's fusions, which follow the op
        # order, give a run the same numbers to the bit.
        return [jnp.concatenate([scored(d, g) for g in range(draws)]).mean() for d in range(2)]


def _clip_by_global_norm(
    g_bilm: dict, g_rows: dict, clip: float, axis_name: str | None
) -> tuple[dict, jax.Array, jax.Array]:
    """The dense gradient scaled to the global norm ``clip`` (when above it), the norm over the
    dense and the sparse gradients, and the scale (which the sparse rows' update applies)."""
    # Each row has one owner, holding its whole gradient: the sparse part of the norm is a sum
    # over owners.
    sparse_sq = jnp.sum(g_rows["w"] * g_rows["w"]) + jnp.sum(g_rows["b"] * g_rows["b"])
    if axis_name is not None:
        sparse_sq = jax.lax.psum(sparse_sq, axis_name)
    grad_norm = jnp.sqrt(optax.tree_utils.tree_norm(g_bilm, squared=True) + sparse_sq)
    scale = jnp.where(grad_norm < clip, 1.0, clip / grad_norm)
    return jax.tree_util.tree_map(lambda g: g * scale, g_bilm), grad_norm, scale


def _updated(
    state: TrainState, g_bilm: dict, ids: jax.Array, g_rows: dict, scale: jax.Array, train: TrainConfig
) -> tuple[dict, dict]:
    """New ``(params, opt)``: Adagrad on the dense biLM, sparse Adagrad on the softmax rows ``ids``."""
    updates, opt_bilm = dense_optimizer(train).update(g_bilm, state.opt["bilm"], state.params["bilm"])
    new_bilm = optax.apply_updates(state.params["bilm"], updates)
    sparse = SparseAdagrad(train.learning_rate)
    new_sm, new_acc = {}, {}
    for name in ("w", "b"):
        new_sm[name], new_acc[name] = sparse.apply(
            state.params["softmax"][name], state.opt["softmax"][name], ids, g_rows[name] * scale
        )
    return {"bilm": new_bilm, "softmax": new_sm}, {"bilm": opt_bilm, "softmax": new_acc}


def train_step(
    state: TrainState,
    batch: dict,
    *,
    model: ModelConfig,
    train: TrainConfig,
    compute: Compute = Compute(),
    axis_name: str | None = AXIS,
) -> tuple[TrainState, dict]:
    """One optimisation step on this device's rows and softmax shard.

    ``batch`` (per device): ``chars [U, C]``, ``inputs [2, B, T]`` (indices into ``chars``),
    ``targets [2, B, T]``, ``rows [B]`` global row ids, ``starts [2, B, T]`` sentence starts (for
    ``train.reset_state_prob``), ``candidates [2, G, S]`` sampled ids, distinct within a draw
    (``G = train.draws_per_device``; draw ``g`` serves rows ``g*B/G`` to ``(g+1)*B/G - 1``),
    ``num_tries [2, G]``, and the fetch plan of ``sharded_softmax.plan_fetch``
    (``fetch [n, C]``, ``cand_index [2, G, S]``, ``target_index [2, B, T]``). ``state.lstm`` holds
    this device's B rows and ``state.params["softmax"]`` its ``V_pad / n`` rows. With
    ``axis_name`` None it runs on one device alone, outside any mesh. ``compute``: matmul
    precision, compute dtype and layout (``elmo_jax.model.compute``; default: float32, the
    backend's layout).

    Returns the state after the step (``step`` + 1) and its metrics, float32 scalars summed over
    the mesh: ``loss_sum_fwd`` and ``loss_sum_bwd`` (each direction's mean loss times ``count``),
    ``count`` (the positions scored) and ``grad_norm`` (before clipping); ``hooks.MetricsWindow``
    turns them into a record.
    """
    targets = batch["targets"]
    n_pos = targets.shape[1] * targets.shape[2]
    row_keys = _row_keys(state, batch["rows"])
    sm = state.params["softmax"]
    with jax.named_scope("softmax_rows"):
        rows, received = fetch_rows(sm, batch["fetch"], axis_name)
    loss_fn = functools.partial(
        _loss,
        batch=batch,
        lstm_state=state.lstm,
        row_keys=row_keys,
        resets=_resets(batch, row_keys, model, train),
        model=model,
        train=train,
        compute=compute,
    )

    bilm_params = state.params["bilm"]
    if axis_name is not None:
        # Replicated params enter a per-device loss: marked device-varying, their gradient is this
        # device's own (shard_map would otherwise psum it implicitly), averaged below.
        bilm_params = jax.lax.pcast(bilm_params, (axis_name,), to="varying")
    (g_bilm, g_w, g_b), (per_dir, new_lstm) = jax.grad(loss_fn, argnums=(0, 1, 2), has_aux=True)(
        bilm_params, rows["w"], rows["b"]
    )
    rows_per_device = sm["b"].shape[0]
    with jax.named_scope("softmax_rows"):
        ids, g_rows = return_grads({"w": g_w, "b": g_b}, received, rows_per_device, axis_name)
    if axis_name is not None:
        # The loss is a mean over this device's rows: the global loss is the mean over devices.
        n_dev = jax.lax.axis_size(axis_name)
        g_bilm = jax.lax.pmean(g_bilm, axis_name)
        g_rows = {k: g / n_dev for k, g in g_rows.items()}
    g_bilm, grad_norm, scale = _clip_by_global_norm(g_bilm, g_rows, train.all_clip_norm_val, axis_name)
    with jax.named_scope("optimizer"):
        params, opt = _updated(state, g_bilm, ids, g_rows, scale, train)

    loss_sums = per_dir * n_pos
    count = jnp.asarray(n_pos, jnp.float32)
    if axis_name is not None:
        loss_sums = jax.lax.psum(loss_sums, axis_name)
        count = jax.lax.psum(count, axis_name)
    new_state = TrainState(step=state.step + 1, params=params, opt=opt, lstm=new_lstm, rng=state.rng)
    metrics = {"loss_sum_fwd": loss_sums[0], "loss_sum_bwd": loss_sums[1], "count": count, "grad_norm": grad_norm}
    return new_state, metrics


BATCH_KEYS = (
    "chars",
    "inputs",
    "targets",
    "rows",
    "starts",
    "candidates",
    "num_tries",
    "fetch",
    "cand_index",
    "target_index",
)


@functools.lru_cache(maxsize=8)
def make_init(model: ModelConfig, train: TrainConfig, mesh: Mesh, rows: int) -> Callable[[jax.Array], TrainState]:
    """``init_state`` for ``rows`` global rows, jitted onto ``mesh`` as ``state_shardings`` places
    it: ``init(key) -> TrainState``. The key is an argument, not a constant of the program, so every
    seed runs one program (the persistent compile cache matches it across runs); cached in the
    process as ``make_train_step`` is (a notebook's second run neither traces nor compiles it)."""
    shardings = state_shardings(jax.eval_shape(lambda: init_state(jax.random.PRNGKey(0), model, train, rows)), mesh)
    return jax.jit(functools.partial(init_state, model=model, train=train, rows=rows), out_shardings=shardings)


@functools.lru_cache(maxsize=16)
def make_zero_rows(model: ModelConfig, rows: int, sharding: NamedSharding) -> Callable[[], dict]:
    """``zero_rows() -> {"c": [2, L, rows, D], "h": [2, L, rows, P]}``, the LSTM state at zero with
    ``sharding`` (a resumed run whose rows start afresh, the held-out evaluator's first window);
    cached as ``make_init`` is. The program is cached, not its arrays: a step donates them."""
    return jax.jit(functools.partial(lstm.zero_state, model, rows), out_shardings=sharding)


@functools.lru_cache(maxsize=8)
def make_train_step(model: ModelConfig, train: TrainConfig, mesh: Mesh, *, compute: Compute = Compute()):
    """``train_step`` under ``shard_map`` over ``mesh`` inside ``jit``; the state is donated
    (updated in place: the softmax and its accumulators are never copied).

    Takes global arrays: the state as ``state_shardings`` places it, and a batch whose every leaf
    has a leading axis of one entry per device (``P("data")``). Cached: runs of one process with
    the same model, recipe, mesh and ``compute`` share the compiled programs."""

    def per_device(state, batch):
        return train_step(
            state, {k: x[0] for k, x in batch.items()}, model=model, train=train, compute=compute, axis_name=AXIS
        )

    specs = state_specs(jax.eval_shape(lambda: init_state(jax.random.PRNGKey(0), model, train)))
    step = jax.shard_map(
        per_device, mesh=mesh, in_specs=(specs, {k: P(AXIS) for k in BATCH_KEYS}), out_specs=(specs, P())
    )
    return jax.jit(step, donate_argnums=(0,))


def add_candidates(
    batch: dict,
    *,
    step: int,
    seed: int,
    num_sampled: int,
    vocab_size: int,
    draws: int = 1,
    first_device: int = 0,
    fixed: bool = False,
) -> dict:
    """Adds ``candidates [D, 2, G, S]`` and ``num_tries [D, 2, G]`` to a host batch with device
    axis D: ``G = draws`` per device and direction (``TrainConfig.draws_per_device``), draw ``g``
    for the device's ``g``-th group of ``rows_per_draw`` rows.

    Each draw has its own seeded generator, keyed by (step, global draw ``device * G + g``,
    direction): a run is reproducible, a resumed run draws what it would have drawn, and a global
    draw is the same whether its rows sit on one device or on several (384 rows in 3 draws on
    one device draw what 3 devices of 128 rows draw). ``fixed``: every device gets device 0's
    draws (for tests that compare device layouts).
    """
    n_dev = batch["inputs"].shape[0]
    cands = np.empty((n_dev, 2, draws, num_sampled), np.int32)
    tries = np.empty((n_dev, 2, draws), np.float32)
    for k in range(n_dev):
        device = 0 if fixed else first_device + k
        for d in range(2):
            for g in range(draws):
                rng = np.random.default_rng([seed, step, device * draws + g, d])
                cands[k, d, g], tries[k, d, g] = sample_log_uniform_unique(rng, num_sampled, vocab_size)
    return {**batch, "candidates": cands, "num_tries": tries}


def prepare_batch(
    batch: dict,
    *,
    step: int,
    seed: int,
    train: TrainConfig,
    n_devices: int,
    first_device: int = 0,
    fixed: bool = False,
    capacity: int = 0,
) -> tuple[dict, int]:
    """A batcher's host batch ``[D, ...]`` -> everything ``train_step`` takes, and the fetch
    capacity used (at least ``capacity``; see ``sharded_softmax.plan_fetch``)."""
    batch = add_candidates(
        batch,
        step=step,
        seed=seed,
        num_sampled=train.n_negative_samples_batch,
        vocab_size=train.n_tokens_vocab,
        draws=train.draws_per_device,
        first_device=first_device,
        fixed=fixed,
    )
    return plan_batch(batch, train.n_tokens_vocab, n_devices, capacity)


def plan_batch(batch: dict, vocab_size: int, n_devices: int, capacity: int = 0) -> tuple[dict, int]:
    """A host batch with its candidates -> the same with the fetch plan of ``plan_fetch`` (which
    may replace an older one), and the capacity used (at least ``capacity``)."""
    plan, capacity = plan_fetch(
        batch["candidates"], batch["targets"], RowLayout.for_vocab(vocab_size), n_devices, capacity
    )
    return {**batch, **plan}, capacity
