"""What a large vocabulary costs a training run before its first step: the char-id table of every
vocabulary word that each batcher builds (``batches.WordTable``, one per batcher: the training
data's, the held-out evaluation's and its check's).

    python benchmarks/bench_vocab.py [--words 793471] [--repeats 3]
    PYTHONPATH=.baseline python benchmarks/bench_vocab.py      # another tree (git archive), alike

The vocabulary is synthetic and the same in every tree (seeded lowercase words of 1 to 14
letters, a few accented, after the three specials), at the released models' size by default.
Prints the seconds of each repeat and the best.
"""

from __future__ import annotations

import argparse
import random
import string
import time

from elmo_jax.model.vocabulary import Vocabulary
from elmo_jax.training.batches import WordTable


def synthetic_vocabulary(n: int, seed: int = 0) -> Vocabulary:
    rng = random.Random(seed)
    letters = string.ascii_lowercase + "éü-'"
    words: set[str] = set()
    while len(words) < n - 3:
        words.add("".join(rng.choice(letters) for _ in range(rng.randint(1, 14))))
    return Vocabulary(["<S>", "</S>", "<UNK>", *sorted(words)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--words", type=int, default=793_471, help="vocabulary size (the released models': 793,471)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    vocab = synthetic_vocabulary(args.words)
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        WordTable(vocab, 50)
        times.append(time.perf_counter() - t)
    print(
        f"WordTable of {len(vocab.words):,} words x 50 chars: "
        + ", ".join(f"{s:.2f}" for s in times)
        + f" s; best {min(times):.2f} s (a run builds one per batcher)"
    )


if __name__ == "__main__":
    main()
