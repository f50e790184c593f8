"""The one precision policy of the API: ``"float32"``, ``"tf32"`` or ``"bfloat16"``.

| policy     | matmul inputs        | accumulate | where                                            |
|------------|----------------------|------------|--------------------------------------------------|
| "float32"  | float32, full passes | float32    | the CPU's default; extraction's default anywhere |
| "tf32"     | TF32 (10-bit mantissa) | float32  | GPUs only (NVIDIA Ampere and later)              |
| "bfloat16" | bfloat16             | float32    | training's default on GPUs and TPUs              |

Under every policy the params, the Adagrad accumulators, the LSTM cell state, the logsumexp and
the loss stay float32: only the matmul (and convolution) inputs are rounded. ``"float32"`` is the
one that reproduces bilm-tf's and AllenNLP's numbers (to about 1e-6); XLA's own default on a GPU
or TPU is neither exact nor named, which is why the library never uses it unasked.

The functions below the policy (``bilm_apply``, ``train_step``, ...) take a
``elmo_jax.model.compute.Compute``: ``Compute.from_policy(name)`` is the policy's ``jax.lax``
precision and compute dtype, with the layout.
"""

from __future__ import annotations

import jax

POLICIES = ("float32", "tf32", "bfloat16")


def check(policy: str, backend: str | None = None) -> str:
    """``policy`` if valid here, else a one-line ValueError naming what is allowed."""
    if policy not in POLICIES:
        raise ValueError(f"precision must be one of {', '.join(POLICIES)}; got {policy!r}")
    if policy == "tf32":
        backend = backend or jax.default_backend()
        if backend != "gpu":
            raise ValueError(f"precision 'tf32' is a GPU matmul mode; this backend is {backend}: use "
                             f"'float32' or 'bfloat16'")
    return policy


def default_for_training(backend: str | None = None) -> str:
    """``"float32"`` on a CPU (where bfloat16 matmuls are slower), ``"bfloat16"`` on GPUs and TPUs."""
    return "float32" if (backend or jax.default_backend()) == "cpu" else "bfloat16"

