"""The held-out evaluation's memory does not grow with the vocabulary (``perplexity``).

bilm-tf's 128 rows x 20 steps at the released 793,471-word vocabulary: the compiled evaluation
step's temporary memory (``memory_analysis``, compile only: nothing is allocated) must stay within
64 MiB of the same step at 10,000 words. The control, the textbook formula that materialises the
``[positions, V]`` logits, needs gigabytes more.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from elmo_jax import PRESETS, bilm, lstm, perplexity
from elmo_jax.sharded_softmax import RowLayout

MODEL = PRESETS["tiny"]
ROWS, STEPS, WORDS = 128, 20, 1024  # WORDS: distinct input words in a window (a bucket size)
MiB = 2 ** 20


def _temp_bytes(fn, *args) -> int:
    return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes


def _eval_step_temp(vocab_size: int) -> int:
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    spec = lambda *s: NamedSharding(mesh, P(*s))  # noqa: E731
    v_pad, p = RowLayout.for_vocab(vocab_size).padded, MODEL.lstm.projection_dim
    abstract = lambda shape, dtype, sharding: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
    bilm_params = jax.tree_util.tree_map(lambda x: abstract(x.shape, x.dtype, spec()),
                                         jax.eval_shape(lambda: bilm.init(jax.random.PRNGKey(0), MODEL)))
    params = {"bilm": bilm_params, "softmax": {"w": abstract((v_pad, p), jnp.float32, spec("data")),
                                               "b": abstract((v_pad,), jnp.float32, spec("data"))}}
    valid = abstract((v_pad,), bool, spec("data"))
    state = jax.tree_util.tree_map(lambda x: abstract(x.shape, x.dtype, spec(None, None, "data")),
                                   jax.eval_shape(lambda: lstm.zero_state(MODEL, ROWS)))
    local = {"chars": abstract((1, WORDS, MODEL.char_cnn.max_characters_per_token), jnp.int32, spec("data")),
             "inputs": abstract((1, 2, ROWS, STEPS), jnp.int32, spec("data")),
             "mask": abstract((1, ROWS, STEPS), bool, spec("data"))}
    everywhere = (abstract((2, ROWS, STEPS), jnp.int32, spec()), abstract((ROWS, STEPS), bool, spec()))
    block = perplexity._divisor_at_most(v_pad, perplexity.BLOCK)
    step = perplexity._step_fn(MODEL, mesh, "highest", block)
    return _temp_bytes(step, params, valid, state, local, everywhere)


def _dense_temp(vocab_size: int) -> int:
    """The control: full-softmax cross-entropy with the whole ``[2 x 128 x 20, V]`` logits."""
    def dense(h, targets, w, b):
        logits = h @ w.T + b
        return jax.nn.logsumexp(logits, axis=1) - jnp.take_along_axis(logits, targets[:, None], axis=1)[:, 0]
    n, p = 2 * ROWS * STEPS, MODEL.lstm.projection_dim
    args = [jax.ShapeDtypeStruct(s, d) for s, d in
            (((n, p), jnp.float32), ((n,), jnp.int32), ((vocab_size, p), jnp.float32), ((vocab_size,), jnp.float32))]
    return _temp_bytes(jax.jit(dense), *args)


def test_evaluation_memory_does_not_grow_with_the_vocabulary():
    small, released = _eval_step_temp(10_000), _eval_step_temp(793_471)
    assert released - small <= 64 * MiB, (small / MiB, released / MiB)
    control = _dense_temp(793_471) - _dense_temp(10_000)
    assert control > 4096 * MiB, control / MiB  # ~15.5 GiB of logits: the test can tell
