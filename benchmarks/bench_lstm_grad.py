"""The biLSTM's gradient step three ways: rows with the hand-written VJP, rows by autodiff, columns.

    python benchmarks/bench_lstm_grad.py [--shape small] [--batch 32] [--length 20] [--rounds 5]

Times ``jax.grad`` of a loss on ``lstm.run``'s outputs and final state (both layers and
directions, all parameters and the inputs; float32, no unrolling, dropout off) and prints the
best and median ms per call of each variant. The variants run in alternating rounds, so a
busy machine slows them alike. The figures behind ``Layout.lstm_vjp`` and behind the CPU
keeping autodiff in its columns layout (``elmo_jax.model.layout``).
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
from harness import time_best

from elmo_jax import preset
from elmo_jax.model import lstm
from elmo_jax.model.compute import Compute
from elmo_jax.model.layout import Layout

VARIANTS = {
    "rows, custom VJP": Layout("rows", unroll=1, lstm_vjp=True),
    "rows, autodiff": Layout("rows", unroll=1, lstm_vjp=False),
    "columns, autodiff": Layout("columns", unroll=1),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="small")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--length", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3, help="calls per variant and round (the best counts)")
    args = ap.parse_args()

    config = preset(args.shape)
    params = lstm.init(jax.random.PRNGKey(0), config)
    xs = jax.random.normal(jax.random.PRNGKey(1), (2, args.batch, args.length, config.lstm.projection_dim))
    mask = jnp.ones((args.batch, args.length), bool)
    state = lstm.zero_state(config, args.batch)

    def grad_fn(layout):
        def loss(params, xs, state):
            out, final = lstm.run(params, config, xs, mask, state, compute=Compute(layout=layout))
            return (out**2).sum() + final["c"].sum() + final["h"].sum()

        f = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        return lambda: jax.block_until_ready(f(params, xs, state))

    fns = {name: grad_fn(layout) for name, layout in VARIANTS.items()}
    for fn in fns.values():
        fn()  # compile
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(args.rounds):
        for name, fn in fns.items():
            times[name].append(time_best(fn, args.repeats, warmup=0))
    print(
        f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}; {args.shape}, "
        f"{args.batch} rows x {args.length} steps, grad of lstm.run, float32; {args.rounds} alternating rounds"
    )
    for name, ts in times.items():
        print(f"  {name:18s} best {min(ts) * 1e3:7.1f} ms  median {statistics.median(ts) * 1e3:7.1f} ms")


if __name__ == "__main__":
    main()
