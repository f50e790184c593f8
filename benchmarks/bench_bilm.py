"""Forward throughput of ``bilm_apply``: tokens/s and achieved GFLOP/s vs the matmul rate.

    python benchmarks/bench_bilm.py [--shapes small original] [--batch 32] [--length 20]

Real tokens are counted once for both directions. FLOPs are those actually executed (the token
encoder over the char slots it was given, the two sentence markers once, the biLSTM over every
row position including <S>/</S> and padding).

It also times one LSTM layer (both directions, ``length + 2`` steps) in each of the two layouts
of ``elmo_jax.model.lstm``, batch-major (``_layer_rows``, GPU/TPU) and batch-minor (``_layer_columns``,
CPU), at ``--batch`` and 4x that many rows: the figures behind the choice of layout per backend.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from harness import encoder_flops, lstm_flops, matmul_gflops, random_sentences, time_best

from elmo_jax import batch_to_ids, bilm_apply, init_bilm, preset
from elmo_jax.model import lstm
from elmo_jax.model.char_cnn import trim_char_ids
from elmo_jax.model.compute import Compute
from elmo_jax.model.layout import Layout


def bench_layouts(name, config, params, rows: int, steps: int, repeats: int, peak: float) -> None:
    """ms per LSTM layer (both directions) in each layout, on random inputs."""
    layer = params["lstm"][0]
    state = lstm.zero_state(config, rows)
    xs = jax.random.normal(jax.random.PRNGKey(1), (2, rows, steps, config.lstm.projection_dim))
    mask = jnp.ones((rows, steps), bool)
    flops = rows * steps * lstm_flops(config) / config.lstm.n_layers
    compute = Compute(layout=Layout(unroll=1))  # no unrolling: the layer functions' own figures
    for label, fn in (("rows (GPU/TPU)", lstm._layer_rows), ("columns (CPU)", lstm._layer_columns)):
        f = jax.jit(lambda p, x, fn=fn: fn(p, config, x, mask, state["c"][:, 0], state["h"][:, 0], compute=compute)[0])
        seconds = time_best(lambda: f(layer, xs).block_until_ready(), repeats)  # noqa: B023 - timed here
        gflops = flops / seconds / 1e9
        print(
            f"{name:8s} LSTM layer, {label:14s} {rows} rows x {steps} steps: {seconds * 1e3:7.1f} ms  "
            f"{gflops:6.1f} GFLOP/s ({100 * gflops / peak:.0f}% of matmul)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["small", "original"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--length", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    peak, limit = matmul_gflops()
    print(f"device: {jax.devices()[0].device_kind} x{jax.device_count()}; {limit}: {peak:.1f} GFLOP/s")
    sentences = random_sentences(args.batch, args.length)
    n_tokens = args.batch * args.length
    for name in args.shapes:
        config = preset(name)
        params = init_bilm(jax.random.PRNGKey(0), config)
        full = batch_to_ids(sentences)
        for label, ids in (("50 char slots", full), ("trimmed chars", trim_char_ids(full, config))):
            ids = jnp.asarray(ids)
            run = lambda: bilm_apply(params, config, ids)[0].block_until_ready()  # noqa: E731, B023 - timed here
            seconds = time_best(run, args.repeats)
            chars = ids.shape[-1]
            flops = (n_tokens + 2) * encoder_flops(config, chars) + args.batch * (args.length + 2) * lstm_flops(config)
            gflops = flops / seconds / 1e9
            print(
                f"{name:8s} {label:14s} {args.batch}x{args.length}: {n_tokens / seconds:8.0f} tokens/s  "
                f"{seconds * 1e3:7.1f} ms/batch  {gflops:6.1f} GFLOP/s ({100 * gflops / peak:.0f}% of matmul)  "
                f"[{flops / n_tokens / 1e6:.1f} MFLOP/token, chars {chars}]"
            )
        for rows in (args.batch, 4 * args.batch):
            bench_layouts(name, config, params, rows, args.length + 2, args.repeats, peak)


if __name__ == "__main__":
    main()
