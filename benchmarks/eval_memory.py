"""Temporary memory of the compiled held-out evaluation step, against the vocabulary size.

Compiles (never runs) ``elmo_jax.training.evaluate``'s step on one device at bilm-tf's 128 rows x 20
steps and prints XLA's ``memory_analysis`` temporary bytes, beside the control: the textbook
full-softmax cross-entropy that materialises ``[positions, V]`` logits.

    python benchmarks/eval_memory.py                      # tiny model, V = 10,000 and 793,471
    python benchmarks/eval_memory.py --config original --vocab 793471
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from elmo_jax import PRESETS
from elmo_jax.config import ModelConfig
from elmo_jax.model import bilm, lstm
from elmo_jax.training.evaluate import BLOCK, _divisor_at_most, _step_fn
from elmo_jax.training.sharded_softmax import RowLayout

MiB = 2**20


def _temp_bytes(fn, *args) -> int:
    return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes


def eval_step_temp(model: ModelConfig, vocab_size: int, rows: int = 128, steps: int = 20, words: int = 1024) -> int:
    """Temporary bytes of the evaluation step for a training state's softmax (``RowLayout`` of
    ``vocab_size``); ``words``: distinct input words in a window (a ``bucket_size``)."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    spec = lambda *s: NamedSharding(mesh, P(*s))  # noqa: E731
    abstract = lambda shape, dtype, sharding: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
    v_pad, p = RowLayout.for_vocab(vocab_size).padded, model.lstm.projection_dim
    bilm_params = jax.tree_util.tree_map(
        lambda x: abstract(x.shape, x.dtype, spec()), jax.eval_shape(lambda: bilm.init(jax.random.PRNGKey(0), model))
    )
    params = {
        "bilm": bilm_params,
        "softmax": {
            "w": abstract((v_pad, p), jnp.float32, spec("data")),
            "b": abstract((v_pad,), jnp.float32, spec("data")),
        },
    }
    valid = abstract((v_pad,), bool, spec("data"))
    state = jax.tree_util.tree_map(
        lambda x: abstract(x.shape, x.dtype, spec(None, None, "data")),
        jax.eval_shape(lambda: lstm.zero_state(model, rows)),
    )
    local = {
        "chars": abstract((1, words, model.char_cnn.max_characters_per_token), jnp.int32, spec("data")),
        "inputs": abstract((1, 2, rows, steps), jnp.int32, spec("data")),
        "mask": abstract((1, rows, steps), bool, spec("data")),
    }
    everywhere = (abstract((2, rows, steps), jnp.int32, spec()), abstract((rows, steps), bool, spec()))
    step = _step_fn(model, mesh, _divisor_at_most(v_pad, BLOCK))
    return _temp_bytes(step, params, valid, state, local, everywhere)


def dense_temp(model: ModelConfig, vocab_size: int, rows: int = 128, steps: int = 20) -> int:
    """The control: cross-entropy of ``2 x rows x steps`` positions with the whole logits."""

    def dense(h, targets, w, b):
        logits = h @ w.T + b
        return jax.nn.logsumexp(logits, axis=1) - jnp.take_along_axis(logits, targets[:, None], axis=1)[:, 0]

    n, p = 2 * rows * steps, model.lstm.projection_dim
    args = [
        jax.ShapeDtypeStruct(s, d)
        for s, d in (
            ((n, p), jnp.float32),
            ((n,), jnp.int32),
            ((vocab_size, p), jnp.float32),
            ((vocab_size,), jnp.float32),
        )
    ]
    return _temp_bytes(jax.jit(dense), *args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--vocab", type=int, nargs="+", default=[10_000, 793_471])
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    model = PRESETS[args.config]
    print(f"{args.config}, {args.rows} rows x {args.steps} steps, block {BLOCK}, {jax.devices()[0].platform}")
    print(f"{'V':>9} {'blockwise MiB':>14} {'[positions, V] MiB':>19}")
    for v in args.vocab:
        print(
            f"{v:>9,} {eval_step_temp(model, v, args.rows, args.steps) / MiB:>14.1f} "
            f"{dense_temp(model, v, args.rows, args.steps) / MiB:>19.1f}"
        )


if __name__ == "__main__":
    main()
