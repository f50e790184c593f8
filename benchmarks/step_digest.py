"""A digest of the train step's lowered program, to tell whether a change touched it at all.

    PYTHONPATH=<tree> python <tree>/benchmarks/step_digest.py [--shape small] [--batch 32] [--vocab 10000]

Lowers ``make_train_step`` (one CPU device, float32) for ``--shape`` at ``--batch`` rows and a
``--vocab``-word softmax, strips the source locations from its StableHLO text, and prints the
text's sha256 and length. Two trees that print the same digest run the same step program, so a
difference in their timed steps (``cpu_compare.py``) is the machine's, not the code's.
"""

from __future__ import annotations

import argparse
import hashlib
import re

import jax
import numpy as np
from bench_train import abstract_step_inputs
from jax.sharding import Mesh


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="small")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=10_000)
    ap.add_argument("--words", type=int, default=512, help="distinct words a batch (the char CNN's rows)")
    args = ap.parse_args()

    from elmo_jax.config import ConfigError, TrainConfig, preset
    from elmo_jax.training.step import make_train_step

    model = preset(args.shape)
    try:
        tc = TrainConfig(n_tokens_vocab=args.vocab, batch_size=args.batch)
    except ConfigError as e:  # --vocab below the default 8,192 negatives, say
        ap.error(str(e))
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    state, batch, *_ = abstract_step_inputs(model, tc, mesh, args.words)
    text = make_train_step(model, tc, mesh).lower(state, batch).as_text()
    text = re.sub(r"loc\(.*?\)", "", text)  # where each op came from: lines move without the program changing
    print(
        f"{args.shape}, {args.batch} rows, V = {args.vocab:,}: sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]}, {len(text):,} chars"
    )


if __name__ == "__main__":
    main()
