"""The one precision policy of the API: ``"float32"``, ``"tf32"`` or ``"bfloat16"``.

| policy     | matmul inputs        | accumulate | where                                            |
|------------|----------------------|------------|--------------------------------------------------|
| "float32"  | float32, full passes | float32    | the CPU's default; extraction's default anywhere |
| "tf32"     | TF32 (10-bit mantissa) | float32  | GPUs only (NVIDIA Ampere and later)              |
| "bfloat16" | bfloat16             | float32    | training's default on TPUs and GPUs from sm 8.0  |

Under every policy the params, the Adagrad accumulators, the LSTM cell state, the logsumexp and
the loss stay float32. Under "bfloat16" a forward matmul (or convolution) takes bfloat16 inputs,
accumulates in float32 and returns bfloat16: the LSTM widens its gate pre-activations and
projections back to float32 for its cell, while the char CNN's max-pool, highway and projection run
in bfloat16 up to its float32 output. The hand-written backward passes return float32. ``"float32"`` is the
one that reproduces bilm-tf's and AllenNLP's numbers (to about 1e-6); XLA's own default on a GPU
or TPU is neither exact nor named, which is why "float32" and "tf32" never use it.

One exception under "bfloat16": the softmax's logits (sampled in training, full in evaluation).
Their inputs, the LSTM's float32 output and the float32 softmax rows, are not cast, and their
matmul runs at the backend's default precision for float32: TF32 passes on NVIDIA GPUs from
sm 8.0, one bfloat16 pass on TPUs, float32 on CPUs. The GPU figures and the bfloat16
perplexities in experiments/README.md were measured with it; casting them to bfloat16 as well
is for a GPU to time first.

The functions below the policy (``bilm_apply``, ``train_step``, ...) take a
``elmo_jax.model.compute.Compute``: ``Compute.from_policy(name)`` is the policy's ``jax.lax``
precision and compute dtype, with the layout.
"""

from __future__ import annotations

import re

import jax

POLICIES = ("float32", "tf32", "bfloat16")


def check(policy: str, backend: str | None = None) -> str:
    """``policy`` if valid here, else a one-line ValueError naming what is allowed."""
    if policy not in POLICIES:
        raise ValueError(f"precision must be one of {', '.join(POLICIES)}; got {policy!r}")
    if policy == "tf32":
        backend = backend or jax.default_backend()
        if backend != "gpu":
            raise ValueError(
                f"precision 'tf32' is a GPU matmul mode; this backend is {backend}: use 'float32' or 'bfloat16'"
            )
    return policy


# NVIDIA compute capability by model name, for a device that does not report its own (jax before
# the ``compute_capability`` attribute, or a runtime that leaves it out). First match wins.
_CAPABILITY_BY_NAME = (
    (r"\bG?B(100|200)\b", "10.0"),
    (r"\bG?H(100|200|800)\b", "9.0"),
    (r"\bA(100|800|30)\b", "8.0"),
    (r"\bL(4|40S?)\b|RTX 40\d0|RTX \d000 Ada", "8.9"),
    (r"\bA(10G?|40|16|2)\b|RTX 30\d0|RTX A\d000", "8.6"),
    (r"\bT4\b|RTX 20\d0|Quadro RTX|TITAN RTX", "7.5"),
    (r"\bV100|TITAN V\b", "7.0"),
    (r"\bP100\b", "6.0"),
    (r"\bP(4|40)\b|GTX 10\d0", "6.1"),
    (r"\bK80\b", "3.7"),
)


def compute_capability(device) -> tuple[str | None, str]:
    """``(capability, source)`` of a GPU ``device``: its ``compute_capability`` attribute (a string
    such as ``"9.0"``) when it has one, else the capability of its ``device_kind`` in a table of
    known NVIDIA cards (source ``"from its name"``), else ``(None, "unknown")``."""
    cap = getattr(device, "compute_capability", None)
    if cap:
        return str(cap), "reported"
    kind = getattr(device, "device_kind", "") or ""
    for pattern, cap in _CAPABILITY_BY_NAME:
        if re.search(pattern, kind, re.IGNORECASE):
            return cap, "from its name"
    return None, "unknown"


def training_default(device=None) -> tuple[str, str]:
    """``(policy, reason)``: training's precision for ``device`` (default: jax's first device).

    bfloat16 where the device computes it natively: TPUs, and NVIDIA GPUs of compute capability 8.0
    and up (A100, L4, H100, H200, ...). float32 on older GPUs (T4, V100, P100: no bfloat16 tensor
    cores, so bfloat16 is emulated and slower), on a GPU whose capability can be neither read nor
    told from its name, and on a CPU. ``reason`` is one line for the training start line, e.g.
    ``"NVIDIA H100 80GB HBM3, compute capability 9.0: native bfloat16"``.
    """
    device = jax.devices()[0] if device is None else device
    platform = str(getattr(device, "platform", "")).lower()
    kind = str(getattr(device, "device_kind", "") or platform)
    if platform == "tpu":
        return "bfloat16", f"{kind if kind.startswith('TPU') else 'TPU'}: native bfloat16"
    if platform in ("gpu", "cuda", "rocm"):
        cap, source = compute_capability(device)
        if cap is None:
            return "float32", (
                f"{kind}, compute capability unknown: float32, as bfloat16 is native only from "
                "compute capability 8.0 on"
            )
        where = f"{kind}, compute capability {cap}" + (" (from its name)" if source == "from its name" else "")
        if int(cap.split(".")[0]) >= 8:
            return "bfloat16", f"{where}: native bfloat16"
        return "float32", f"{where}: no native bfloat16, float32 is faster"
    return "float32", f"{platform.upper() or kind}: bfloat16 matmuls are slower here"
