"""Memory of the compiled train step on one device at several batch sizes: XLA's
``memory_analysis()`` of ``make_train_step``, compiled and never run.

    python benchmarks/step_memory.py [--shape original] [--rows 128 256 384 512] [--vocab 793471]
        [--variants cpu gpu] [--out FILE]

bilm-tf trains 128 rows on each of 3 GPUs with averaged gradients, so 384 rows on one device is
the paper's global batch. Per variant and batch: the arguments (params, Adagrad accumulators, LSTM
state, the batch), the outputs, the part of the outputs that reuses donated arguments (aliased),
the temporaries, and their total (arguments + outputs - aliased + temporaries: what the step
needs at once, as XLA's buffer assignment plans it). Variants: ``cpu`` is float32 under the CPU
layout, ``gpu`` bfloat16 under the GPU layout. On a CPU both are planned by the CPU compiler, so
``gpu`` there is a stand-in for a GPU's plan (its fusions and scratch differ); on a GPU the
``gpu`` row is the GPU's own plan.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_train import abstract_step_inputs
from jax.sharding import Mesh

from elmo_jax.config import PRESETS, Options, TrainConfig, preset
from elmo_jax.model.compute import Compute
from elmo_jax.model.layout import for_backend
from elmo_jax.training.step import AXIS, make_train_step

VARIANTS = {"cpu": ("highest", jnp.float32, "cpu"), "gpu": ("default", jnp.bfloat16, "gpu")}
MIB = 2**20


def step_memory(model, tc: TrainConfig, variant: str, words: int) -> dict[str, float]:
    """Bytes of each part of ``memory_analysis()`` of the one-device train step, and compile seconds."""
    precision, dtype, backend = VARIANTS[variant]
    mesh = Mesh(np.array(jax.local_devices()[:1]), (AXIS,))
    state, batch, _, _ = abstract_step_inputs(model, tc, mesh, words)
    t = time.perf_counter()
    compute = Compute(precision, dtype, for_backend(backend))
    compiled = make_train_step(model, tc, mesh, compute=compute).lower(state, batch).compile()
    seconds = time.perf_counter() - t
    mem = compiled.memory_analysis()
    parts = {k: float(getattr(mem, f"{k}_size_in_bytes", 0) or 0) for k in ("argument", "output", "alias", "temp")}
    parts["total"] = parts["argument"] + parts["output"] - parts["alias"] + parts["temp"]
    parts["compile_s"] = seconds
    return parts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="original", help="a preset or a bilm-tf options.json")
    ap.add_argument("--rows", type=int, nargs="+", default=[128, 256, 384, 512], help="rows per device")
    ap.add_argument("--vocab", type=int, default=793_471, help="softmax rows (the released models': 793,471)")
    ap.add_argument("--negatives", type=int, default=8192)
    ap.add_argument(
        "--words-per-row",
        type=int,
        default=16,
        help="distinct words a batch encodes, per row (16: 2,048 at 128 rows, as bench_train.py)",
    )
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--out", help="also write the table here")
    args = ap.parse_args()
    model = preset(args.shape) if args.shape in PRESETS else Options.load(args.shape).model
    device = jax.devices()[0]
    lines = [
        f"# python benchmarks/{os.path.basename(__file__)} {' '.join(sys.argv[1:])}".rstrip(),
        f"# {device.device_kind} ({device.platform}), jax {jax.__version__}; compiled, not run",
        f"# {args.shape}, V = {args.vocab:,}, {args.negatives:,} negatives, 20 steps, "
        f"{args.words_per_row} distinct words per row; MiB",
        f"{'variant':<8} {'rows':>5} {'arguments':>10} {'outputs':>9} {'aliased':>9} {'temps':>9} "
        f"{'total':>9} {'compile s':>9}",
    ]
    print("\n".join(lines), flush=True)
    for variant in args.variants:
        for rows in args.rows:
            tc = TrainConfig(
                n_tokens_vocab=args.vocab, batch_size=rows, unroll_steps=20, n_negative_samples_batch=args.negatives
            )
            m = step_memory(model, tc, variant, rows * args.words_per_row)
            line = (
                f"{variant:<8} {rows:>5} {m['argument'] / MIB:>10,.0f} {m['output'] / MIB:>9,.0f} "
                f"{m['alias'] / MIB:>9,.0f} {m['temp'] / MIB:>9,.0f} {m['total'] / MIB:>9,.0f} "
                f"{m['compile_s']:>9.0f}"
            )
            print(line, flush=True)
            lines.append(line)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
