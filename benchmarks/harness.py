"""Shared pieces of the benchmark scripts: the machine's matmul rate, FLOP counts, timing.

    python benchmarks/harness.py [--size N]    # the roofline of this machine's first device

The roofline (``roofline``) is the slope of dependent matmuls inside one jitted ``fori_loop``:
a chain of N and of M matmuls, each the previous one's result times a fixed matrix, timed to
``block_until_ready``; the rate is ``2 n^3 (M - N) / (t_M - t_N)``. The dispatch, the launch and
the copies cost the same in both chains and drop out of the difference, and no matmul can be
hoisted out of the loop or skipped, since each needs the one before. (One jitted call timed
alone, as the benchmarks' ``matmul_gflops`` once did at 2048^3, mostly measures dispatch on a
GPU.) ``matmul_gflops`` gives the benchmarks' float32 limit by the same method.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from elmo_jax.config import ModelConfig


def matmul_gflops(dtype: str = "float32") -> tuple[float, str]:
    """The default device's ``dtype`` matmul rate in GFLOP/s by the slope method, at the
    roofline's size for the backend (1024^3 on a CPU, 8192^3 elsewhere), and a label for it."""
    n = 1024 if jax.default_backend() == "cpu" else 8192
    r = matmul_slope(n, dtype)
    return r.tflops * 1e3, f"{dtype} {n}^3 matmul by the slope of {r.counts[0]} and {r.counts[1]} dependent matmuls"


@dataclasses.dataclass(frozen=True)
class MatmulRate:
    """One roofline figure: ``n``^3 matmuls in ``dtype`` (``"float32"``, ``"tf32"``, ``"bfloat16"``)."""

    dtype: str
    n: int
    counts: tuple[int, int]  # the chain lengths timed
    seconds: tuple[float, float]  # their median wall times
    tflops: float  # 2 n^3 per matmul over the slope

    def line(self) -> str:
        (a, b), (ta, tb) = self.counts, self.seconds
        return (
            f"{self.dtype} {self.n}^3 matmul, slope of {a} and {b} dependent matmuls in one fori_loop "
            f"({ta * 1e3:.1f} and {tb * 1e3:.1f} ms): {self.tflops:.4g} TFLOP/s"
        )


_DTYPES = {
    "float32": (jnp.float32, "highest"),
    "bfloat16": (jnp.bfloat16, "default"),
    "tf32": (jnp.float32, jax.lax.DotAlgorithmPreset.TF32_TF32_F32),
}


def matmul_chain(n: int, dtype: str = "float32", dependent: bool = True) -> tuple[Callable[[int], Callable], jax.Array]:
    """(``chain``, ``x``): ``chain(count)`` is the jitted loop of ``count`` ``dtype`` matmuls at
    ``n``^3 that ``matmul_slope`` times, on ``x`` ``[n, n]``.

    ``dependent=False`` is the mistake the slope method avoids, kept for its test: a loop body
    ``x + a @ b`` whose matmul XLA takes out of the loop (it folds ``a @ b``, two constants of the
    program, into one), so that the chains take the same time."""
    array_dtype, precision = _DTYPES[dtype]
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    a = jax.random.normal(k1, (n, n), jnp.float32).astype(array_dtype)
    # Entries of variance 1/n: x @ b keeps x's scale on average, so no chain over- or underflows.
    b = (jax.random.normal(k2, (n, n), jnp.float32) / np.sqrt(n)).astype(array_dtype)

    def chain(count: int) -> Callable:
        if dependent:
            body = lambda _, x: jnp.matmul(x, b, precision=precision).astype(array_dtype)  # noqa: E731
        else:
            body = lambda _, x: x + jnp.matmul(a, b, precision=precision).astype(array_dtype)  # noqa: E731
        return jax.jit(lambda x: jax.lax.fori_loop(0, count, body, x))

    return chain, a


def matmul_slope(n: int, dtype: str = "float32", counts: tuple[int, int] = (8, 40), repeats: int = 5) -> MatmulRate:
    """The ``dtype`` matmul rate of the default device at ``n``^3, by the slope method (module doc).

    Each chain is one compiled program (``matmul_chain``); its times are medians of ``repeats`` runs
    after one warm-up, the two chains' runs interleaved so that a drift of the machine's speed hits
    both."""
    chain, a = matmul_chain(n, dtype)
    runs = [chain(c) for c in counts]
    for run in runs:
        run(a).block_until_ready()
    times: list[list[float]] = [[], []]
    for _ in range(repeats):
        for i, run in enumerate(runs):
            times[i].append(_time(lambda run=run: run(a).block_until_ready()))
    t = (float(np.median(times[0])), float(np.median(times[1])))
    per_matmul = (t[1] - t[0]) / (counts[1] - counts[0]) if counts[1] != counts[0] else 0.0
    rate = 2 * n**3 / per_matmul / 1e12 if per_matmul > 0 else float("nan")
    return MatmulRate(dtype, n, counts, t, rate)


def roofline(
    size: int | None = None,
    repeats: int = 5,
    dtypes: tuple[str, ...] | None = None,
    failed: dict[str, str] | None = None,
) -> dict[str, MatmulRate]:
    """The device's matmul rates by the slope method: bfloat16 and tf32 at 8192^3 on a GPU,
    bfloat16 at 8192^3 on a TPU, float32 at 1024^3 on a CPU (seconds there); ``size`` and
    ``dtypes`` override. A dtype the backend refuses is left out, its error in ``failed``."""
    backend = jax.default_backend()
    dtypes = dtypes or {"gpu": ("bfloat16", "tf32"), "tpu": ("bfloat16",)}.get(backend, ("float32",))
    n = size or (1024 if backend == "cpu" else 8192)
    rates = {}
    for d in dtypes:
        try:
            rates[d] = matmul_slope(n, d, repeats=repeats)
        except Exception as e:  # noqa: BLE001 - one refused mode (tf32 off a GPU) must not lose the others
            if failed is not None:
                failed[d] = f"{type(e).__name__}: {str(e).splitlines()[0][:150]}"
    return rates


# Vendor datasheet dense (without sparsity) tensor-core peaks, TFLOP/s, at the boost clock: NVIDIA's
# H100/H200 and A100 datasheets (whose headline figures are the 2:4-sparse ones, twice these).
# First match of the device name wins: the PCIe and NVL cards before the SXM ones.
DENSE_PEAKS = (
    ("H100 PCIe", r"H100.*PCIe", {"bfloat16": 756.0, "tf32": 378.0}),
    ("H100 NVL / H200 NVL", r"H[12]00.*NVL", {"bfloat16": 835.5, "tf32": 417.5}),
    ("H100 SXM", r"H100", {"bfloat16": 989.4, "tf32": 494.7}),
    ("H200 SXM", r"H200", {"bfloat16": 989.4, "tf32": 494.7}),
    ("A100 (SXM or PCIe)", r"A100", {"bfloat16": 312.0, "tf32": 156.0}),
)


def dense_peak(device_name: str) -> tuple[str, dict[str, float]] | None:
    """``(card, {dtype: TFLOP/s})`` from ``DENSE_PEAKS`` for a device name, or None if not listed."""
    for card, pattern, peaks in DENSE_PEAKS:
        if re.search(pattern, device_name, re.IGNORECASE):
            return card, peaks
    return None


def mfu(tflops: float, dtype: str, device_name: str, measured: dict[str, MatmulRate]) -> str:
    """``tflops`` executed as a share of the card's datasheet dense ``dtype`` peak and of the
    ``dtype`` matmul rate measured by ``roofline`` (each "n/a" where unknown)."""
    peak = dense_peak(device_name)
    sheet = (
        f"{100 * tflops / peak[1][dtype]:.1f}% of the {peak[0]} datasheet dense {dtype} peak "
        f"({peak[1][dtype]:,.0f} TFLOP/s)"
        if peak and dtype in peak[1]
        else f"datasheet {dtype} peak n/a"
    )
    rate = measured.get(dtype)
    ours = (
        f"{100 * tflops / rate.tflops:.1f}% of the measured {dtype} {rate.n}^3 matmul ({rate.tflops:.4g} TFLOP/s)"
        if rate and rate.tflops > 0
        else f"measured {dtype} matmul n/a"
    )
    return f"{sheet}; {ours}"


def gpu_clocks() -> str | None:
    """nvidia-smi's name, SM clock, its maximum, memory clock and power limit (CSV with a header),
    or None where there is no nvidia-smi."""
    query = "--query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.limit"
    try:
        r = subprocess.run(["nvidia-smi", query, "--format=csv"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 and r.stdout.strip() else None


def roofline_report(
    size: int | None = None, repeats: int = 5, dtypes: tuple[str, ...] | None = None
) -> tuple[list[str], dict[str, MatmulRate]]:
    """The lines ``python benchmarks/harness.py`` prints: device, clocks, each measured rate beside
    the datasheet peak; and the rates (for ``mfu``)."""
    device = jax.devices()[0]
    lines = [f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}"]
    clocks = gpu_clocks()
    if clocks:
        lines += ["nvidia-smi:", *("  " + c for c in clocks.splitlines())]
    failed: dict[str, str] = {}
    rates = roofline(size, repeats, dtypes, failed)
    lines += [f"{dtype} matmul failed: {error}" for dtype, error in failed.items()]
    for dtype, rate in rates.items():
        lines.append(rate.line())
        peak = dense_peak(device.device_kind)
        if peak and dtype in peak[1]:
            lines.append(
                f"  = {100 * rate.tflops / peak[1][dtype]:.1f}% of the {peak[0]} datasheet dense {dtype} "
                f"peak, {peak[1][dtype]:,.0f} TFLOP/s"
            )
    return lines, rates


def local_processes(script: str, n: int, args: list[str], env: dict[str, str] | None = None, **popen) -> list:
    """``n`` processes of ``python script *args --worker PORT RANK`` on this machine, for a
    benchmark of several jax.distributed processes on 127.0.0.1 (``PORT``: a free one), each with
    one CPU device. ``env``: added to this process's environment; ``popen``: ``subprocess.Popen``'s."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu", **(env or {}))
    command = [sys.executable, os.path.abspath(script), *args, "--worker", str(port)]
    return [subprocess.Popen([*command, str(rank)], env=env, **popen) for rank in range(n)]


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


def main() -> None:
    ap = argparse.ArgumentParser(description="The roofline of this machine's first device (module doc).")
    ap.add_argument("--size", type=int, help="n of the n^3 matmuls (default: 8192 on a GPU or TPU, 1024 on a CPU)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print("\n".join(roofline_report(args.size, args.repeats)[0]))


if __name__ == "__main__":
    main()
