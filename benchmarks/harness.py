"""Shared pieces of the benchmark scripts: the machine's matmul rate, FLOP counts, timing."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from elmo_jax.config import ModelConfig


def matmul_gflops(n: int = 2048, repeats: int = 20, dtype=jnp.float32) -> float:
    """The measured ``dtype`` matmul rate of the default device, GFLOP/s (best of ``repeats``)."""
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), dtype)
    f = jax.jit(lambda a: a @ a)
    f(a).block_until_ready()
    best = min(_time(lambda: f(a).block_until_ready()) for _ in range(repeats))
    return 2 * n ** 3 / best / 1e9


def _time(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def time_best(fn, repeats: int = 5, warmup: int = 1) -> float:
    """Best wall time of ``fn()`` in seconds (``fn`` must block until its result is ready)."""
    for _ in range(warmup):
        fn()
    return min(_time(fn) for _ in range(repeats))


def encoder_flops(config: ModelConfig, chars: int | None = None) -> float:
    """Forward FLOPs of the token encoder for one token over ``chars`` char slots."""
    c, p = config.char_cnn, config.lstm.projection_dim
    chars = chars or c.max_characters_per_token
    f = c.n_filters
    cnn = sum(2 * (chars - w + 1) * w * c.embedding_dim * n for w, n in c.filters)
    return cnn + c.n_highway * 2 * f * 2 * f + 2 * f * p


def lstm_flops(config: ModelConfig) -> float:
    """Forward FLOPs of the biLSTM for one position (both directions, all layers)."""
    l = config.lstm
    per_layer = 2 * (2 * l.projection_dim) * 4 * l.dim + 2 * l.dim * l.projection_dim
    return 2 * l.n_layers * per_layer


def random_sentences(n: int, length: int, seed: int = 0) -> list[list[str]]:
    """``n`` sentences of ``length`` random lowercase words (3 to 10 letters)."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    return [["".join(rng.choice(letters, rng.integers(3, 11))) for _ in range(length)] for _ in range(n)]
