"""What continuing from hdf5 files (no optimizer state) does to a trained biLM (issue 14).

Released hdf5 files carry no Adagrad accumulators, so a run continued from them starts every
accumulator at 1.0, as a fresh run does: the first updates are as large as at step 1 of
pretraining, on a model that has long since settled. This script measures the damage on a
trained model and what a lower learning rate buys. It continues a trained run dir on its own
training text (no new domain, so any rise in held-out perplexity is damage) under several
starts, and scores held-out perplexity (full softmax, each sentence from zero state) at the
given steps:

- ``run``: from the run dir itself, the real accumulators (what a TF checkpoint also gives);
- ``hdf5@LR``: from its hdf5 export (weights, softmax, vocabulary), accumulators 1.0, learning
  rate LR;
- ``tf@LR``: from the same run written as a bilm-tf TF checkpoint (``--tf-checkpoint``, made by
  ``run_to_tf_checkpoint.py``): the real accumulators again, read without TensorFlow.

    python experiments/fresh_accumulators.py --run-dir runs/reset01 \\
        --train-files 'experiments/data/lm/train/*.txt' --heldout experiments/data/lm/heldout.txt \\
        --sentences 500 --at 0 20 50 100 --variants run hdf5@0.2 hdf5@0.05 hdf5@0.02 \\
        --out experiments/results/continue/fresh_accumulators.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import tempfile
import time

from elmo_jax.text.sources import TextFiles
from elmo_jax.training.evaluate import evaluate
from elmo_jax.training.loop import RunSettings, pretrain
from elmo_jax.training.run_dir import export_run, load_run, read_run
from elmo_jax.training.warmstart import finetune_state, read_warmstart


class _First:
    """The first ``n`` sentences of a text source, as one shard."""

    def __init__(self, source, n):
        self.lines = [line for i in range(len(source)) for line in source.read(i)][:n]
        self._name = source.name(0)

    def __len__(self):
        return 1

    def name(self, i):
        return self._name

    def read(self, i):
        return self.lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", required=True, help="the trained model (an elmo-jax run dir)")
    p.add_argument("--train-files", required=True)
    p.add_argument("--heldout", required=True)
    p.add_argument("--sentences", type=int, default=500, help="held-out sentences scored")
    p.add_argument("--at", type=int, nargs="+", default=[0, 20, 50, 100], help="steps to score at")
    p.add_argument("--variants", nargs="+", default=["run", "hdf5@0.2", "hdf5@0.05"])
    p.add_argument("--tf-checkpoint", help="the run as a TF checkpoint directory, for the tf variants")
    p.add_argument("--work-dir", help="where the continued runs go (default: a temporary directory)")
    p.add_argument("--out", help="also append one JSON line per (variant, step) here")
    args = p.parse_args()

    options, vocab, _, source_step = read_run(args.run_dir)
    heldout = _First(TextFiles(args.heldout), args.sentences)
    train = TextFiles(args.train_files)
    work = args.work_dir or tempfile.mkdtemp(prefix="fresh_acc_")
    export_dir = os.path.join(work, "export")
    export_run(args.run_dir, export_dir)
    for variant in args.variants:
        kind, _, lr = variant.partition("@")
        lr = float(lr) if lr else options.train.learning_rate
        run_options = dataclasses.replace(options, train=dataclasses.replace(options.train, learning_rate=lr))
        warm = read_warmstart({"run": args.run_dir, "hdf5": export_dir, "tf": args.tf_checkpoint}[kind])
        state = finetune_state(warm, run_options, vocab)
        run_dir = os.path.join(work, variant.replace("@", "_"))
        for step in sorted(args.at):
            start = time.perf_counter()
            if step == 0:
                params = {"bilm": state["params"]["bilm"], "softmax": state["params"]["softmax"]}
            else:
                pretrain(
                    run_options,
                    vocab,
                    train,
                    RunSettings(run_dir=run_dir, steps=step, save_every=step, keep=1, progress=False, async_save=False),
                    init_state=state,
                )
                params = load_run(run_dir)[2]
            result = evaluate(params, options.model, vocab, heldout, reset_state_per_sentence=True)
            line = {
                "source_step": source_step,
                "variant": variant,
                "learning_rate": lr,
                "step": step,
                **{k: (round(v, 3) if isinstance(v, float) else v) for k, v in result.items()},
                "seconds": round(time.perf_counter() - start, 1),
            }
            print(json.dumps(line), flush=True)
            if args.out:
                os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
                with open(args.out, "a", encoding="utf-8") as f:
                    f.write(json.dumps(line) + "\n")
            if not math.isfinite(result["perplexity"]):
                break


if __name__ == "__main__":
    main()
