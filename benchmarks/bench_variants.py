"""The train step under each precision and layout choice, in one process, and a profile of one.

    python benchmarks/bench_variants.py --shape original --batch 128 [--variants f32 bf16 ...]
        [--profile bf16 --profile-out DIR]

Each variant prints its line as soon as it is measured (a timeout keeps the lines before it).
Figures: median ms per step over ``--steps`` steps, tokens/s (rows x 20, counted once), the
FLOP/s executed (``bench_train.train_flops``) as a share of the card's datasheet dense peak and of
the matmul rate measured in the same run (``harness.roofline``: the slope of dependent matmuls in
one ``fori_loop``, 8192^3 on a GPU, ``--roofline-size`` to change), each in the variant's dtype.
``--profile NAME`` runs that variant's steps again under ``jax.profiler`` and writes
``profile_top.txt``: time per part of the step, forward and backward, and the top ops
(``profile_parts.py``), so that only a small text file need come back.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from bench_train import device_batches, model_and_config, time_step, train_flops, zipf_corpus
from harness import mfu, roofline_report
from jax.sharding import Mesh
from profile_parts import profile_lines

from elmo_jax.config import TrainConfig
from elmo_jax.model.compute import Compute
from elmo_jax.model.layout import Layout, for_backend
from elmo_jax.training.step import AXIS

_PRESET = jax.lax.DotAlgorithmPreset
# name -> (precision, compute dtype, layout). "f32" with rows/1/32 and autodiff of the scan is the
# program every GPU ran before elmo_jax.model.layout existed: the baseline. The layouts of the
# earlier sweeps keep autodiff (lstm_vjp=False), so that their figures stay comparable.
VARIANTS = {
    "f32": Compute("highest", jnp.float32, Layout("rows", 1, 32, lstm_vjp=False)),
    "tf32": Compute(_PRESET.TF32_TF32_F32, jnp.float32, Layout("rows", 1, 32, lstm_vjp=False)),
    "bf16": Compute("default", jnp.bfloat16, Layout("rows", 1, 32, lstm_vjp=False)),
    "bf16-preset": Compute(_PRESET.BF16_BF16_F32, jnp.float32, Layout("rows", 1, 32, lstm_vjp=False)),
    "bf16-c0": Compute("default", jnp.bfloat16, Layout("rows", 1, 0, lstm_vjp=False)),
    "bf16-c256": Compute("default", jnp.bfloat16, Layout("rows", 1, 256, lstm_vjp=False)),
    "bf16-c0-u2": Compute("default", jnp.bfloat16, Layout("rows", 2, 0, lstm_vjp=False)),
    "bf16-c0-u5": Compute("default", jnp.bfloat16, Layout("rows", 5, 0, lstm_vjp=False)),
    "bf16-c0-u20": Compute("default", jnp.bfloat16, Layout("rows", 20, 0, lstm_vjp=False)),
    "f32-c0": Compute("highest", jnp.float32, Layout("rows", 1, 0, lstm_vjp=False)),
    "f32-c0-u5": Compute("highest", jnp.float32, Layout("rows", 5, 0, lstm_vjp=False)),
    # The library's CPU default, as the table has it now (was a fixed Layout("columns", 1, 32)).
    "cpu": Compute.from_policy("float32", layout=for_backend("cpu")),
    # The library's defaults on a GPU today: training's bfloat16 policy, and float32 (extraction's).
    "gpu": Compute.from_policy("bfloat16", layout=for_backend("gpu")),
    "gpu-f32": Compute.from_policy("float32", layout=for_backend("gpu")),
    # The GPU default with the LSTM differentiated by autodiff of the scan: the custom VJP's gain.
    "gpu-autodiff": Compute.from_policy("bfloat16", layout=dataclasses.replace(for_backend("gpu"), lstm_vjp=False)),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="small")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--negatives", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=100_000)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument(
        "--reset-state-prob",
        type=float,
        default=TrainConfig.reset_state_prob,
        help="TrainConfig.reset_state_prob (default: its default)",
    )
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--profile", choices=list(VARIANTS), help="trace this variant's timed steps")
    ap.add_argument("--profile-out", default=".", help="where profile_top.txt goes")
    ap.add_argument(
        "--roofline-size", type=int, help="n of the roofline's n^3 matmuls (default: harness.roofline's; 0: none)"
    )
    args = ap.parse_args()
    args.vocabs = [args.vocab]
    model, tc = model_and_config(args, args.vocab)
    mesh = Mesh(np.array(jax.local_devices()[:1]), (AXIS,))
    # --roofline-size 0: no roofline (a sweep of flag sets, one process each, measures it once elsewhere).
    lines, measured = roofline_report(args.roofline_size) if args.roofline_size != 0 else (["roofline: skipped"], {})
    print("\n".join(lines), flush=True)
    kind = jax.devices()[0].device_kind
    with tempfile.TemporaryDirectory() as tmp:
        vocab, path = zipf_corpus(tmp, args.vocab, 300_000)
        batches, width, capacity = device_batches(args, model, tc, vocab, path, mesh)
        flops = train_flops(model, tc, width)
        print(
            f"{args.shape}, {args.batch} rows x 20, V={args.vocab:,}, {width} distinct-word rows, "
            f"{flops / 1e9:,.0f} GFLOP a step",
            flush=True,
        )
        names = list(args.variants)
        if args.profile and args.profile not in names:
            names.append(args.profile)
        for name in names:
            compute = VARIANTS[name]
            trace = os.path.join(tmp, "trace") if name == args.profile else None
            try:
                timing = time_step(model, tc, mesh, batches, compute=compute, trace_dir=trace)
                sec = timing.seconds
            except Exception as e:  # noqa: BLE001 - a variant a backend rejects (tf32 on a CPU) must not stop the rest
                print(f"{name:<12} failed: {type(e).__name__}: {str(e).splitlines()[0][:150]}", flush=True)
                continue
            rate = flops / sec / 1e9
            # The roofline dtype the variant's matmuls run in (its MFU denominators).
            kind_of = (
                "bfloat16"
                if np.dtype(compute.dtype) == jnp.bfloat16 or name == "bf16-preset"
                else "tf32"
                if name == "tf32"
                else "float32"
            )
            print(
                f"{name:<12} {sec * 1e3:8.2f} ms/step {args.batch * 20 / sec:9.0f} tokens/s {rate:9,.0f} GFLOP/s "
                f"({mfu(rate / 1e3, kind_of, kind, measured)})  "
                f"[{np.dtype(compute.dtype).name}, {getattr(compute.precision, 'name', compute.precision)}, "
                f"{compute.layout}]",
                flush=True,
            )
            if trace:
                text = "\n".join(profile_lines(trace, timing, len(batches) - 1)) + "\n"
                os.makedirs(args.profile_out, exist_ok=True)
                with open(os.path.join(args.profile_out, "profile_top.txt"), "w") as f:
                    f.write(f"{name}: {args.shape}, {args.batch} rows x 20\n" + text)
                print(text, flush=True)


if __name__ == "__main__":
    main()
