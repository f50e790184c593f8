"""How many softmax rows a train step fetches from each owner, step after step, and how often the
fetch capacity grows (each growth recompiles the step).

For each setting it builds the batches a run would (``LMBatcher``, ``add_candidates``) and prints
the per-step need (``plan_fetch``'s fullest request list) and, for the capacity rule in
``sharded_softmax`` (``next_capacity``) and for the rule before it (``capacity_bucket`` of the need,
no headroom), the first and last capacity and how many times it grew.

    python benchmarks/fetch_capacity.py --files 'experiments/data/lm/train/shard-0?.txt' \\
        --vocab experiments/data/lm/vocab.txt --rows 128 --negatives 8192 --steps 150 --devices 1 2

With no ``--files`` it reads the bundled sample and the vocabulary of its words.
"""

from __future__ import annotations

import argparse
import pathlib

import numpy as np

from elmo_jax.model.vocabulary import Vocabulary
from elmo_jax.text.sources import TextFiles
from elmo_jax.text.vocab import build_vocab, count_tokens
from elmo_jax.training.batches import LMBatcher
from elmo_jax.training.sharded_softmax import RowLayout, capacity_bucket, next_capacity
from elmo_jax.training.step import add_candidates

SAMPLE = pathlib.Path(__file__).resolve().parents[1] / "elmo_jax" / "data" / "sample" / "train.txt"


def needs(source, vocab, rows: int, unroll: int, negatives: int, devices: int, steps: int) -> np.ndarray:
    layout = RowLayout.for_vocab(len(vocab))
    per_owner = layout.rows_per_device(devices)
    batcher = LMBatcher(
        source, vocab, rows_per_device=rows, unroll_steps=unroll, max_chars=50, n_devices=devices, seed=0
    )
    out = []
    for step in range(steps):
        batch = add_candidates(batcher.next(), step=step, seed=0, num_sampled=negatives, vocab_size=len(vocab))
        need = 0
        for d in range(devices):
            ids = np.unique(np.concatenate([batch["candidates"][d].ravel(), batch["targets"][d].ravel()]))
            need = max(need, int(np.bincount(layout.slots(ids) // per_owner, minlength=devices).max()))
        out.append(need)
    return np.array(out)


def grow(need: np.ndarray, rule) -> tuple[int, int, int]:
    """(first capacity, last capacity, growths after the first step) under ``rule(need, capacity)``."""
    cap, first, growths = 0, 0, 0
    for i, n in enumerate(need):
        new = rule(int(n), cap)
        growths += i > 0 and new != cap
        cap, first = new, first or new
    return first, cap, growths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", help="training text (a glob); default: the bundled sample")
    ap.add_argument("--vocab", help="its vocabulary; default: built from --files")
    ap.add_argument("--rows", type=int, default=32, help="rows per device")
    ap.add_argument("--unroll", type=int, default=20)
    ap.add_argument("--negatives", type=int, default=1024)
    ap.add_argument("--devices", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    source = TextFiles(args.files or str(SAMPLE))
    if args.vocab:
        vocab = Vocabulary.load(args.vocab)
    else:
        vocab = Vocabulary(build_vocab(count_tokens(source)[0]))
    print(
        f"{args.files or SAMPLE}: V={len(vocab)}, {args.rows} rows x {args.unroll} per device, "
        f"{args.negatives} negatives, {args.steps} steps"
    )
    for d in args.devices:
        need = needs(source, vocab, args.rows, args.unroll, args.negatives, d, args.steps)
        spread = (need.max() - need[0]) / np.sqrt(need[0])
        print(
            f"  {d} device(s): need first {need[0]}, mean {need.mean():.0f}, std {need.std():.1f} "
            f"({need.std() / np.sqrt(need.mean()):.2f} sqrt(mean)), max {need.max()} "
            f"(first + {spread:.2f} sqrt(first))"
        )
        for name, rule in (("no headroom", lambda n, cap: max(cap, capacity_bucket(n))), ("headroom", next_capacity)):
            first, last, growths = grow(need, rule)
            print(
                f"    {name:12s}: capacity {first} -> {last}, grew {growths} time(s); "
                f"padding {1 - need.mean() / last:.1%} of the fetched rows at the end"
            )


if __name__ == "__main__":
    main()
