"""What issue 30's train-step targets ask of one H100, from arithmetic and the one H100 measurement
this project has: a projection, not a measurement (``gpu_measure.py`` measures when a GPU is lent).

    python benchmarks/step_projection.py

Printed, each with its source:

- the ``original`` step's executed FLOPs at 128 and 384 rows (``bench_train.train_flops``, the char
  CNN over the distinct words of real batches of a Zipfian corpus at V = 793,471);
- for each target (250,000 tokens/s at 128 rows, 450,000 at 384), the step time it allows and the
  FLOP rate that needs, against the H100 SXM's dense bfloat16 peak, and the target against the
  tokens/s of the 128-row step measured on an H100 (``results/gpu_h100/call2_variants.txt``);
- two floors no program beats: the FLOPs at the dense peak, and the recurrent weights read once
  per sequential step from HBM;
- what autodiff of the scan moves that the custom VJP (``lstm._rows_scan_vjp``) does not: each
  backward step reads and writes float32 weight-gradient accumulators, whatever the batch;
- the measured 128-row step with that traffic taken away: the custom VJP's gain from bytes alone
  (the per-step accumulating matmuls, K = 128 rows each, also cost launches and run on poor
  shapes; what that adds only a GPU measures).
"""

from __future__ import annotations

import argparse
import os
import tempfile

import jax
import numpy as np
from bench_train import device_batches, model_and_config, train_flops, zipf_corpus
from gpu_projection import H100, measured_steps
from harness import dense_peak
from jax.sharding import Mesh

from elmo_jax.training.step import AXIS

# NVIDIA's H100 SXM5 datasheet: HBM3 at 3.35 TB/s.
HBM_TB_S = 3.35
TARGETS = {128: 250_000, 384: 450_000}  # rows -> tokens/s, issue 30
V = 793_471


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    device, steps = measured_steps(os.path.join(H100, "call2_variants.txt"))
    ms_now, gflop_now = steps["gpu"]
    card, peaks = dense_peak("H100 SXM")
    peak = peaks["bfloat16"]
    print(f"measured (results/gpu_h100/call2_variants.txt): {device}")
    print(
        f"  the default step (bfloat16, GPU layout, autodiff of the scan), 128 rows: {ms_now:.2f} ms, "
        f"{gflop_now:,.0f} GFLOP -> {gflop_now / ms_now:.1f} TFLOP/s executed, "
        f"{100 * gflop_now / ms_now / peak:.1f}% of the {card} dense bfloat16 peak ({peak} TFLOP/s)"
    )
    mesh = Mesh(np.array(jax.local_devices()[:1]), (AXIS,))
    flops = {}
    with tempfile.TemporaryDirectory() as tmp:
        vocab, path = zipf_corpus(tmp, 100_000, 400_000)
        for rows in TARGETS:
            ns = argparse.Namespace(shape="original", batch=rows, negatives=8192, steps=0, reset_state_prob=0.1)
            model, tc = model_and_config(ns, V)
            _, width, _ = device_batches(ns, model, tc, vocab, path, mesh)
            flops[rows] = train_flops(model, tc, width)
            print(f"the step at {rows} rows: {flops[rows] / 1e12:.2f} TFLOP ({width:,} distinct-word rows encoded)")
    l = model.lstm
    tokens_now = 128 * 20 / ms_now * 1e3
    print("\nwhat each target asks:")
    for rows, target in TARGETS.items():
        ms = rows * 20 / target * 1e3
        need = flops[rows] / ms / 1e9
        # Against tokens/s, not FLOP/s: the measured step's FLOPs were counted with the char CNN's
        # distinct-word rows of its day, and a count's buckets have changed since.
        print(
            f"  {target:,} tokens/s at {rows} rows: {ms:.2f} ms a step -> {need:.0f} TFLOP/s executed, "
            f"{100 * need / peak:.0f}% of the dense peak, {target / tokens_now:.1f}x the tokens/s measured at 128 rows"
        )
    # bfloat16 weights of one layer, both directions: W_h [P, 4D] and W_proj [D, P].
    weights = 2 * 2 * (l.projection_dim * 4 * l.dim + l.dim * l.projection_dim)
    sequential = 2 * l.n_layers * 20  # forward and backward, layer after layer, 20 steps each
    stream_ms = sequential * weights / (HBM_TB_S * 1e12) * 1e3
    print(f"\nfloors on one {card} ({HBM_TB_S} TB/s HBM3):")
    for rows in TARGETS:
        print(f"  {rows} rows: its FLOPs at the dense peak {flops[rows] / peak / 1e9:.2f} ms", end="; ")
        print(
            f"the recurrent weights ({weights / 1e6:.0f} MB a layer) read once per sequential step "
            f"({sequential} steps) {stream_ms:.2f} ms"
        )
    # Autodiff of the scan: each backward step adds into float32 accumulators for W_h and W_proj of
    # each layer and direction, read and written once per step, whatever the batch.
    acc = 2 * 4 * 2 * (l.projection_dim * 4 * l.dim + l.dim * l.projection_dim)
    acc_bytes = l.n_layers * 20 * acc
    acc_ms = acc_bytes / (HBM_TB_S * 1e12) * 1e3
    print(
        f"\nautodiff's weight-gradient accumulators in the backward scan: {acc / 1e6:.0f} MB read and written a "
        f"step and layer, {acc_bytes / 1e9:.2f} GB a train step: {acc_ms:.2f} ms at {HBM_TB_S} TB/s, at any batch"
    )
    best = ms_now - acc_ms
    print(
        f"the measured 128-row step without that traffic: {ms_now:.2f} -> {best:.2f} ms, "
        f"{128 * 20 / best * 1e3:,.0f} tokens/s (bytes alone; the {2 * l.n_layers * 20} accumulating matmuls' "
        f"launches and K = 128 shapes come on top, which only a GPU measures); the 250,000 target needs "
        f"{128 * 20 / 250_000 * 1e3:.2f} ms"
    )


if __name__ == "__main__":
    main()
