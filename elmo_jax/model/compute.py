"""How the model's math runs: the matmul precision, the compute dtype and the layout, as one value.

The model, training and extraction functions take one ``Compute`` (keyword ``compute``) instead
of three loose arguments. The user-facing APIs take a policy name (``elmo_jax.policy``:
``"float32"``, ``"tf32"``, ``"bfloat16"``) and build it once::

    Compute()                              # float32, full passes: bilm-tf's and AllenNLP's numbers
    Compute.from_policy("bfloat16")        # bfloat16 matmuls (float32 accumulation inside)
    Compute(layout=BY_BACKEND["gpu"])      # the GPU's layout, run anywhere (a speed choice only)

It is frozen and hashable: jitted functions take it as a static argument.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from elmo_jax import policy
from elmo_jax.model.layout import Layout, for_backend


def _matmul_args(name: str) -> tuple[str | jax.lax.DotAlgorithmPreset, jax.typing.DTypeLike]:
    """The ``(precision, dtype)`` of a policy name (the table in ``elmo_jax.policy``)."""
    if name == "float32":
        return "highest", jnp.float32
    if name == "tf32":
        return jax.lax.DotAlgorithmPreset.TF32_TF32_F32, jnp.float32
    # bfloat16 inputs, float32 accumulation (the MXU / tensor-core default for bfloat16 operands).
    return "default", jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class Compute:
    """``precision``: the ``jax.lax`` matmul precision (a ``Precision`` or its name, or a
    ``DotAlgorithmPreset``). ``dtype``: what matmul and convolution inputs are cast to, and so what
    a forward matmul returns (params, LSTM state and the model's outputs stay float32; see
    ``elmo_jax.policy``). ``layout``: ``elmo_jax.model.layout.Layout``, or None for the
    backend's, read when tracing (``resolved_layout``)."""

    precision: str | jax.lax.Precision | jax.lax.DotAlgorithmPreset = "highest"
    dtype: jax.typing.DTypeLike = jnp.float32
    layout: Layout | None = None

    def __post_init__(self):
        precision = self.precision
        if isinstance(precision, str):
            try:
                precision = jax.lax.Precision(precision)
            except ValueError:
                raise ValueError(f"Compute.precision: unknown matmul precision {self.precision!r}") from None
        elif not isinstance(precision, (jax.lax.Precision, jax.lax.DotAlgorithmPreset)):
            raise ValueError(
                f"Compute.precision must be a jax.lax.Precision, its name or a "
                f"DotAlgorithmPreset, got {self.precision!r}"
            )
        try:
            dtype = np.dtype(self.dtype)
        except TypeError:
            raise ValueError(f"Compute.dtype: not a dtype: {self.dtype!r}") from None
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"Compute.dtype must be a floating dtype, got {dtype}")
        if self.layout is not None and not isinstance(self.layout, Layout):
            raise ValueError(f"Compute.layout must be a Layout or None, got {self.layout!r}")
        # Canonical forms, so that equal settings are equal (and hash alike) however spelled.
        object.__setattr__(self, "precision", precision)
        object.__setattr__(self, "dtype", dtype)

    @classmethod
    def from_policy(cls, name: str, layout: Layout | None = None) -> Compute:
        """The ``Compute`` of a policy name (checked with ``policy.check`` on this backend)."""
        precision, dtype = _matmul_args(policy.check(name))
        return cls(precision, dtype, layout)

    def resolved_layout(self) -> Layout:
        """``layout``, or the backend's when it is None."""
        return self.layout or for_backend()
