"""Random weights for a fresh model, from one random call per distribution.

XLA compiles each ``jax.random`` call of a new shape into its own threefry loop, about 0.4 s
each on a CPU. The char CNN and the LSTM have about 20 weights of different shapes: drawn one by
one, compiling a fresh model's init took 6-8 s of every run's start (the tiny test model on 2
cores). One flat draw per distribution, cut into the weights, compiles one loop.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp


class Uniform(NamedTuple):
    shape: tuple[int, ...]
    low: float
    high: float


class Normal(NamedTuple):
    shape: tuple[int, ...]
    stddev: float


def draw(key: jax.Array, specs: list[Uniform | Normal]) -> list[jax.Array]:
    """One float32 array per spec, in order: ``U(low, high)`` or ``N(0, stddev^2)``."""
    k_uniform, k_normal = jax.random.split(key)
    sizes = [math.prod(s.shape) for s in specs]
    flat = {
        # float32 named: with jax_enable_x64 the default draw is float64, and the whole run with it.
        Uniform: jax.random.uniform(
            k_uniform, (sum(n for s, n in zip(specs, sizes) if isinstance(s, Uniform)),), jnp.float32
        ),
        Normal: jax.random.normal(
            k_normal, (sum(n for s, n in zip(specs, sizes) if isinstance(s, Normal)),), jnp.float32
        ),
    }
    offset = {Uniform: 0, Normal: 0}
    out = []
    for spec, n in zip(specs, sizes):
        kind = type(spec)
        x = flat[kind][offset[kind] : offset[kind] + n].reshape(spec.shape)
        offset[kind] += n
        # Python floats: weakly typed, so they keep x float32 (a numpy float64 would widen it under x64).
        if isinstance(spec, Uniform):
            out.append(float(spec.low) + float(spec.high - spec.low) * x)
        else:
            out.append(float(spec.stddev) * x)
    return out
