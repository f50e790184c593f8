"""Pretraining throughput on one device: the train step, the sparse softmax at a large vocabulary,
and the input pipeline alone.

    python experiments/bench_train.py [--shape small] [--batch 32] [--steps 5] [--pipeline-only]

Tokens are real tokens per step, ``rows x unroll_steps``, each counted once although both
directions learn from it (bilm-tf's count). FLOPs are those executed: forward (the char CNN over
the batch's distinct words, the biLSTM, the sampled softmax) times 3 for forward + backward.
Fake CPU devices measure overhead, not speed: this script uses one device.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench_common import encoder_flops, lstm_flops, matmul_gflops  # noqa: E402
from elmo_jax import train  # noqa: E402
from elmo_jax.chars import Vocabulary  # noqa: E402
from elmo_jax.config import PRESETS, Options, TrainConfig, preset  # noqa: E402
from elmo_jax.data import LMBatcher, TextFiles  # noqa: E402


def zipf_corpus(directory: str, vocab_size: int, n_tokens: int, seed: int = 0) -> tuple[Vocabulary, str]:
    """A synthetic Zipfian corpus over ``vocab_size`` made-up words (plus some OOV words)."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = sorted({"".join(rng.choice(letters, rng.integers(2, 12))) for _ in range(int(vocab_size * 1.3))})
    rng.shuffle(words)
    words = words[:vocab_size + 1000]
    ranks = np.minimum(rng.zipf(1.1, n_tokens), len(words)) - 1
    lengths = rng.integers(5, 40, n_tokens // 5)
    path = os.path.join(directory, "corpus.txt")
    with open(path, "w") as f:
        pos = 0
        for n in lengths:
            if pos >= n_tokens:
                break
            f.write(" ".join(words[i] for i in ranks[pos:pos + n]) + "\n")
            pos += n
    return Vocabulary(["<S>", "</S>", "<UNK>", *words[:vocab_size - 3]], source="zipf"), path


def bench_pipeline(vocab: Vocabulary, path: str, rows: int, max_chars: int) -> float:
    batcher = LMBatcher(TextFiles(path), vocab, rows_per_device=rows, unroll_steps=20, max_chars=max_chars)
    batcher.next()  # loads and encodes the shard
    n = 0
    t = time.perf_counter()
    while time.perf_counter() - t < 3.0:
        batcher.next()
        n += 1
    return n * rows * 20 / (time.perf_counter() - t)  # real tokens, counted once, with char ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="small", help="a preset or a bilm-tf options.json")
    ap.add_argument("--batch", type=int, default=32, help="rows (bilm-tf batch_size)")
    ap.add_argument("--negatives", type=int, default=8192)
    ap.add_argument("--vocabs", type=int, nargs="+", default=[10_000, 793_471])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--pipeline-only", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        vocab, path = zipf_corpus(tmp, 100_000, 600_000)
        rate = bench_pipeline(vocab, path, 128, 50)
        print(f"input pipeline alone, one core (100k vocab, 128 rows x 20, both directions' windows with char ids): "
              f"{rate:,.0f} tokens/s")
        if args.pipeline_only:
            return
        peak = matmul_gflops()
        print(f"device: {jax.devices()[0].device_kind}; float32 matmul (2048^3): {peak:.1f} GFLOP/s")
        model = preset(args.shape) if args.shape in PRESETS else Options.load(args.shape).model
        batcher = LMBatcher(TextFiles(path), vocab, rows_per_device=args.batch, unroll_steps=20,
                            max_chars=model.char_cnn.max_characters_per_token)
        host_batches = [batcher.next() for _ in range(args.steps + 2)]
        # One distinct-word bucket for all timed steps, so no step recompiles.
        width = max(b["chars"].shape[1] for b in host_batches)
        for b in host_batches:
            b["chars"] = np.pad(b["chars"], ((0, 0), (0, width - b["chars"].shape[1]), (0, 0)))
        for v in args.vocabs:
            tc = TrainConfig(n_tokens_vocab=v, batch_size=args.batch, unroll_steps=20,
                             n_negative_samples_batch=args.negatives)
            step = jax.jit(functools.partial(train.train_step, model=model, train=tc, axis_name=None),
                           donate_argnums=0)
            state = train.init_state(jax.random.PRNGKey(0), model, tc)
            batches = [{k: x[0] for k, x in train.add_candidates(b, step=i, seed=0, num_sampled=args.negatives,
                                                                vocab_size=v).items()}
                       for i, b in enumerate(host_batches)]
            compiled = step.lower(state, batches[0]).compile()
            mem = compiled.memory_analysis()
            state, m = step(state, batches[0])
            jax.block_until_ready(m)
            times = []
            for b in batches[1:]:
                t = time.perf_counter()
                state, m = step(state, b)
                jax.block_until_ready(m)
                times.append(time.perf_counter() - t)
            sec = float(np.median(times))
            tokens = args.batch * 20
            u = width
            p = model.lstm.projection_dim
            fwd = (u * encoder_flops(model) + tokens * lstm_flops(model)
                   + 2 * tokens * 2 * p * (args.negatives + 1))
            gflops = 3 * fwd / sec / 1e9
            temp = f", compiled temp {mem.temp_size_in_bytes / 2**20:.0f} MiB vs softmax {v * p * 4 / 2**20:.0f} MiB" \
                if mem is not None else ""
            print(f"{args.shape} V={v:>7,}: {sec * 1e3:7.1f} ms/step  {tokens / sec:7.0f} tokens/s  "
                  f"{gflops:6.1f} GFLOP/s ({100 * gflops / peak:.0f}% of matmul)  [distinct-word rows encoded {u}]{temp}")
            del state


if __name__ == "__main__":
    main()
