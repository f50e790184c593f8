"""An elmo-jax run as a bilm-tf TensorFlow checkpoint, with its real Adagrad accumulators (issue 14).

The released models' TF checkpoints are the richest form to continue from (weights, softmax,
accumulators, step). To exercise that path on a trained model, this writes the experiments'
stand-in in the same form, in two steps, because TensorFlow must never be a dependency:

    # 1. project venv: the run's tensors under bilm-tf's TF names (+ options.json, vocab.txt)
    python experiments/run_to_tf_checkpoint.py dump --run-dir runs/real --out runs/real_tf
    # 2. a separate venv with TensorFlow (see tests/fixtures/make_tf_checkpoint.py for its install):
    /tmp/tfvenv/bin/python experiments/run_to_tf_checkpoint.py write --out runs/real_tf
    # 3. project venv: read it back without TensorFlow and compare with the run, tensor by tensor
    python experiments/run_to_tf_checkpoint.py check --run-dir runs/real --out runs/real_tf

``write`` saves with ``tf.compat.v1.train.Saver`` (the V2 format bilm-tf used) under bilm-tf's
names: ``lm/...`` weights, ``<name>/Adagrad`` slots, a float32 ``global_step``. The directory then
holds ``model.ckpt-STEP.*``, TF's ``checkpoint`` file, bilm-tf's ``options.json`` and the
vocabulary, which is what ``elmo-jax train --init-from DIR`` reads.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

TENSORS = "tensors.npz"


def tf_name(hdf5_name: str) -> str:
    """bilm-tf's hdf5 dataset name -> its TF variable name (``tf_checkpoint.bilm_tf_hdf5_name`` inverted)."""
    if "/RNN/MultiRNNCell/" in hdf5_name:
        direction, _, _, cell, _, leaf = hdf5_name.split("/")
        leaf = {"W_0": "kernel", "B": "bias", "W_P_0": "projection/kernel"}[leaf]
        return f"lm/{direction}/rnn/multi_rnn_cell/cell_{cell[len('Cell') :]}/lstm_cell/{leaf}"
    return "lm/" + hdf5_name


def dump(run_dir: str, out: str) -> None:
    from elmo_jax.compat.hdf5 import to_datasets
    from elmo_jax.training.run_dir import read_run, write_vocab_file
    from elmo_jax.training.warmstart import dense_accumulators

    options, vocab, shared, step = read_run(run_dir)
    model = options.model
    tensors = {"global_step": np.float32(step)}
    for tree, suffix in ((shared["params"]["bilm"], ""), (dense_accumulators(shared["opt"]["bilm"]), "/Adagrad")):
        for name, x in to_datasets(model, tree).items():
            tensors[tf_name(name) + suffix] = x
    for part, suffix in (("params", ""), ("opt", "/Adagrad")):
        tensors["lm/softmax/W" + suffix] = np.asarray(shared[part]["softmax"]["w"], np.float32)
        tensors["lm/softmax/b" + suffix] = np.asarray(shared[part]["softmax"]["b"], np.float32)
    os.makedirs(out, exist_ok=True)
    np.savez(os.path.join(out, TENSORS), **tensors)
    d = options.to_dict(n_characters=261)  # bilm-tf's training options: the checkpoint's char_embed has 261 rows
    with open(os.path.join(out, "options.json"), "w", encoding="utf-8") as f:
        json.dump(d, f, indent=1)
    write_vocab_file(os.path.join(out, "vocab.txt"), vocab)
    print(f"{out}: {len(tensors)} tensors of step {step}; next, with TensorFlow: write --out {out}")


def write(out: str) -> None:
    try:
        import tensorflow as tf
    except ImportError:
        sys.exit("write needs TensorFlow, which the project never installs: run it with a venv that has it "
                 "(tests/fixtures/make_tf_checkpoint.py says how)")  # fmt: skip
    if not os.path.isfile(os.path.join(out, TENSORS)):
        sys.exit(f"{out}: no {TENSORS}; run dump --out {out} first")

    tf.compat.v1.disable_eager_execution()
    tensors = dict(np.load(os.path.join(out, TENSORS)))
    step = int(tensors["global_step"])
    # Checkpoint keys are the Saver's dict keys, so the slots keep bilm-tf's "<var>/Adagrad" names.
    variables = {name: tf.compat.v1.Variable(value, name=f"v{i}") for i, (name, value) in enumerate(tensors.items())}
    saver = tf.compat.v1.train.Saver(variables, save_relative_paths=True)
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        prefix = saver.save(sess, os.path.join(out, "model.ckpt"), global_step=step, write_meta_graph=False)
    reader = tf.train.load_checkpoint(prefix)
    for name, value in tensors.items():
        np.testing.assert_array_equal(reader.get_tensor(name), value)
    os.remove(os.path.join(out, TENSORS))
    print(f"{prefix}: {len(tensors)} tensors, read back by TensorFlow")


def check(run_dir: str, out: str) -> None:
    import jax

    from elmo_jax.training.run_dir import read_run
    from elmo_jax.training.warmstart import dense_accumulators, read_warmstart

    if os.path.isfile(os.path.join(out, TENSORS)):  # dumped, not yet written by TensorFlow
        sys.exit(f"{out}: holds the dump only; run write --out {out} with TensorFlow first")
    options, vocab, shared, step = read_run(run_dir)
    warm = read_warmstart(out)
    pairs = [
        (warm.bilm, shared["params"]["bilm"]),
        (warm.bilm_acc, dense_accumulators(shared["opt"]["bilm"])),
        (warm.softmax, shared["params"]["softmax"]),
        (warm.softmax_acc, shared["opt"]["softmax"]),
    ]
    n = 0
    for got, want in pairs:
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            n += 1
    assert warm.model == options.model and warm.vocab.words == vocab.words and warm.step == step
    print(
        f"{out}: the TF checkpoint holds the run's step-{step} weights, softmax and accumulators exactly ({n} arrays)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["dump", "write", "check"])
    p.add_argument("--run-dir")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.what != "write" and not args.run_dir:
        sys.exit(f"{args.what} needs --run-dir")
    {
        "dump": lambda: dump(args.run_dir, args.out),
        "write": lambda: write(args.out),
        "check": lambda: check(args.run_dir, args.out),
    }[args.what]()


if __name__ == "__main__":
    main()
