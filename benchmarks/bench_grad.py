"""A model part's gradient under the layouts that differentiate it differently, in alternating rounds.

    python benchmarks/bench_grad.py [--part lstm|cnn|softmax] [--shape small] [--batch 32] [--length 20]
                                    [--words 512] [--rounds 5]

``--part lstm`` (the default): ``jax.grad`` of a loss on ``lstm.run``'s outputs and final state
(both layers and directions, all parameters and the inputs; no unrolling, dropout off), four
ways: rows with the hand-written VJP, rows by autodiff, columns by autodiff, and the rows
layout's layers in one wavefront scan (``Layout.lstm_wavefront``, its own hand-written VJP). The
figures behind ``Layout.lstm_vjp`` and behind the CPU keeping autodiff in its columns layout.

``--part cnn``: ``jax.grad`` of a loss on ``char_cnn.apply`` (every parameter, the char
embeddings included) over ``--words`` distinct words of the bundled sample at the full 50 char
slots, as the training step encodes them, in the backend's layout with and without
``Layout.cnn_vjp`` (the filters' max differentiated by hand, or by autodiff).

``--part softmax``: ``jax.grad`` of the sampled softmax loss (``training.softmax``) over
``--batch`` x ``--length`` x 2 positions and 8,192 candidates at the shape's projection, w.r.t.
the positions' vectors and the target and candidate rows, against the same loss through
``jax.nn.logsumexp`` of the concatenated ``[N, 1 + S]`` logits (how it was written before).

float32 throughout. Each variant is compiled first; then every round times each variant once (the
best of ``--repeats`` calls), so a busy machine slows them alike. Prints the best and median ms.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics

import jax
import jax.numpy as jnp
from harness import time_best

from elmo_jax import preset
from elmo_jax.model import char_cnn, lstm
from elmo_jax.model.compute import Compute
from elmo_jax.model.layout import Layout, for_backend
from elmo_jax.model.vocabulary import words_to_ids

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LSTM_VARIANTS = {
    "rows, custom VJP": Layout("rows", unroll=1, lstm_vjp=True),
    "rows, autodiff": Layout("rows", unroll=1, lstm_vjp=False),
    "columns, autodiff": Layout("columns", unroll=1),
    "rows, wavefront": Layout("rows", unroll=1, lstm_wavefront=True),
}


def lstm_grads(config, args) -> tuple[str, dict]:
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

    what = f"{args.batch} rows x {args.length} steps, grad of lstm.run"
    return what, {name: grad_fn(layout) for name, layout in LSTM_VARIANTS.items()}


def sample_words(n: int) -> list[str]:
    """The first ``n`` distinct words of the bundled sample's training text."""
    words: dict[str, None] = {}
    with open(os.path.join(ROOT, "elmo_jax/data/sample/train.txt"), encoding="utf-8") as f:
        for line in f:
            words.update(dict.fromkeys(line.split()))
            if len(words) >= n:
                return list(words)[:n]
    raise SystemExit(f"--words {n}: the sample has only {len(words)} distinct words")


def cnn_grads(config, args) -> tuple[str, dict]:
    params = char_cnn.init(jax.random.PRNGKey(0), config)
    ids = jnp.asarray(words_to_ids(sample_words(args.words), config.char_cnn.max_characters_per_token))
    cotangent = jax.random.normal(jax.random.PRNGKey(1), (args.words, config.lstm.projection_dim))
    layout = for_backend()

    def grad_fn(layout):
        def loss(params):
            return (char_cnn.apply(params, config, ids, compute=Compute(layout=layout)) * cotangent).sum()

        f = jax.jit(jax.grad(loss))
        return lambda: jax.block_until_ready(f(params))

    variants = {f"cnn_vjp={v}": dataclasses.replace(layout, cnn_vjp=v) for v in (True, False)}
    what = f"{args.words} words x {ids.shape[1]} chars, grad of char_cnn.apply (cnn_chunk {layout.cnn_chunk})"
    return what, {name: grad_fn(layout) for name, layout in variants.items()}


def concatenated_loss(h, targets, true_w, true_b, cand_ids, cand_w, cand_b, num_tries, vocab_size):
    """The sampled softmax loss as written before: logsumexp of the ``[N, 1 + S]`` logits."""
    from elmo_jax.training.softmax import sampled_logits

    true_logit, sampled = sampled_logits(h, targets, true_w, true_b, cand_ids, cand_w, cand_b, num_tries, vocab_size)
    return jax.nn.logsumexp(jnp.concatenate([true_logit[:, None], sampled], axis=1), axis=1) - true_logit


def softmax_grads(config, args) -> tuple[str, dict]:
    from elmo_jax.training.softmax import sampled_softmax_loss

    n, s, v, p = 2 * args.batch * args.length, 8192, 100_000, config.lstm.projection_dim
    k = jax.random.split(jax.random.PRNGKey(0), 5)
    h, true_w, cand_w = (jax.random.normal(key, shape) for key, shape in zip(k, ((n, p), (n, p), (s, p))))
    true_b, cand_b = jax.random.normal(k[3], (n,)), jax.random.normal(k[4], (s,))
    targets, cand_ids = jnp.arange(n) * 13 % v, jnp.arange(s) * 7  # some targets among the candidates

    def grad_fn(loss_fn):
        def loss(h, true_w, cand_w):
            return loss_fn(h, targets, true_w, true_b, cand_ids, cand_w, cand_b, 9000.0, v).sum()

        f = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        return lambda: jax.block_until_ready(f(h, true_w, cand_w))

    fns = {"this tree": grad_fn(sampled_softmax_loss), "concatenated": grad_fn(concatenated_loss)}
    return f"{n} positions x {s} candidates, grad of the sampled softmax loss", fns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("lstm", "cnn", "softmax"), default="lstm")
    ap.add_argument("--shape", default="small")
    ap.add_argument("--batch", type=int, default=32, help="lstm: rows")
    ap.add_argument("--length", type=int, default=20, help="lstm: steps")
    ap.add_argument("--words", type=int, default=512, help="cnn: distinct words encoded")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3, help="calls per variant and round (the best counts)")
    args = ap.parse_args()

    parts = {"lstm": lstm_grads, "cnn": cnn_grads, "softmax": softmax_grads}
    what, fns = parts[args.part](preset(args.shape), args)
    for fn in fns.values():
        fn()  # compile
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(args.rounds):
        for name, fn in fns.items():
            times[name].append(time_best(fn, args.repeats, warmup=0))
    print(
        f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}; {args.shape}, {what}, float32; "
        f"{args.rounds} alternating rounds"
    )
    for name, ts in times.items():
        print(f"  {name:18s} best {min(ts) * 1e3:7.1f} ms  median {statistics.median(ts) * 1e3:7.1f} ms")


if __name__ == "__main__":
    main()
