"""Diagnose the early full-softmax blow-up of a pretraining run from its checkpoints (issue 12).

For every checkpoint of ``--run-dir`` (keep many: ``--save-every 100 --keep 100``), on the first
``--sentences`` held-out sentences, each from zero state, per direction:

- ``full``: the full-softmax cross-entropy (nats, mean and median; share of positions > 20 nats),
  with the evaluation-time top outputs (no dropout);
- ``sampled``: the training loss's estimate of it on the same outputs (bilm-tf's sampled softmax,
  candidates drawn as in training);
- ``full_drop``: the full cross-entropy with the training-time outputs (dropout on, as in a step);
- ``warm``: the full cross-entropy with each sentence started from a state the training carried
  (the checkpoint's LSTM rows) instead of zeros;
- ``|h|``: the mean norm of the top outputs, evaluation and training time, and the cosine of their
  mean directions;
- rows: how many softmax rows the run has ever updated (Adagrad accumulator above its initial 1.0),
  their mean norm and bias against those of the never-updated rows, and the cosine of each group's
  mean direction with the mean top output;
- logits: the median logit of the true word and of the best never-updated row, and the share of
  positions whose argmax is a never-updated row.

    python experiments/collapse.py --run-dir runs/collapse --heldout experiments/data/lm/heldout.txt \
        --out experiments/results/collapse/diagnosis.jsonl
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from elmo_jax.model import lstm
from elmo_jax.text.sources import DataError, TextFiles
from elmo_jax.training.batches import WordTable, split_over_devices
from elmo_jax.training.checkpoint import Checkpointer, CheckpointError
from elmo_jax.training.run_dir import read_run
from elmo_jax.training.softmax import sample_log_uniform_unique, sampled_softmax_loss
from elmo_jax.training.step import token_vectors


def top_outputs(bilm, model, batch, mask, dropout: float, seed: int, state=None) -> jax.Array:
    """``[2, B, T, P]`` top-layer outputs from ``state`` (default zero); with ``dropout`` as a
    training step applies it (each layer's input and the top output)."""
    x = token_vectors(bilm, model, batch)
    keys = jax.random.split(jax.random.PRNGKey(seed), mask.shape[0]) if dropout else None
    outs, _ = lstm.run(bilm["lstm"], model, x, mask, state, dropout_rate=dropout, dropout_keys=keys)
    top = outs[-1]
    if dropout:
        top = lstm.dropout(top, dropout, keys, salt=model.lstm.n_layers)
    return top


def positions(run_dir: str, heldout: str, n_sentences: int, rows: int = 32):
    """The held-out positions as ``(batch, targets [2, B, T], mask [B, T])`` per chunk of rows."""
    options, vocab, _, _ = read_run(run_dir)
    source = TextFiles(heldout)
    lines = [line for i in range(len(source)) for line in source.read(i)][:n_sentences]

    class First:  # a Source of the first n sentences
        def __len__(self):
            return 1

        def name(self, i):
            return heldout

        def read(self, i):
            return lines

    table = WordTable(vocab, options.model.char_cnn.max_characters_per_token)
    out = []
    for inputs, targets, mask in _one_a_row(First(), vocab, table, rows):
        batch = split_over_devices(table, inputs, targets, 1)
        out.append(({"chars": batch["chars"][0], "inputs": batch["inputs"][0]}, targets, mask))
    return options, vocab, out


def _one_a_row(source, vocab, table: WordTable, rows: int):
    """``rows`` sentences at a time, each alone in its row from the row's start (``diagnose``
    starts each from a state of its choosing: zero, or one the training reached), shortest
    first: ``inputs``, ``targets [2, rows, T]``, ``mask [rows, T]``, T a multiple of 8. (The
    held-out evaluation packs several sentences into a row instead, resetting at each start.)"""
    sentences = sorted((line.split() for i in range(len(source)) for line in source.read(i)), key=len)
    for lo in range(0, len(sentences), rows):
        chunk = sentences[lo : lo + rows]
        n = -(-(max(len(s) for s in chunk) + 1) // 8) * 8
        inputs, targets = np.zeros((2, len(chunk), n), np.int64), np.zeros((2, len(chunk), n), np.int64)
        mask = np.zeros((len(chunk), n), bool)
        for r, s in enumerate(chunk):
            for d, (words, start, end) in enumerate(((s, vocab.bos, vocab.eos), (s[::-1], vocab.eos, vocab.bos))):
                ids = table.input_ids(words)
                inputs[d, r, : len(s) + 1] = np.append(start, ids)
                targets[d, r, : len(s) + 1] = np.append(table.targets(ids), end)
            mask[r, : len(s) + 1] = True
        yield inputs, targets, mask


def training_state(run_dir: str, step: int, options, rows: int) -> dict:
    """``rows`` rows of the LSTM state the run carried at ``step`` (its checkpoint's rows, cycled):
    states the training itself reached, so in its distribution."""
    from elmo_jax.training.run_dir import abstract_rows, abstract_shared

    ckpt = Checkpointer(run_dir, read_only=True)
    _, saved, _, _ = ckpt.restore(
        step, lambda m: (abstract_shared(options, m), abstract_rows(options.model, m["global_rows"]))
    )
    ckpt.close()
    take = np.arange(rows) % saved["c"].shape[2]
    return {k: jnp.asarray(np.asarray(x)[:, :, take]) for k, x in saved.items()}


def diagnose(run_dir: str, step: int, options, vocab, chunks, seed: int = 0) -> dict:
    _, _, shared, _ = read_run(run_dir, step)
    model, t = options.model, options.train
    bilm = jax.device_put(shared["params"]["bilm"])
    w = np.asarray(shared["params"]["softmax"]["w"])
    b = np.asarray(shared["params"]["softmax"]["b"])
    acc_b = np.asarray(shared["opt"]["softmax"]["b"])
    trained = acc_b > 1.0
    v = len(w)
    h_eval, h_train, h_warm, tgt = [[], []], [[], []], [[], []], [[], []]
    carried = training_state(run_dir, step, options, max(mask.shape[0] for _, _, mask in chunks))
    for k, (batch, targets, mask) in enumerate(chunks):
        he = np.asarray(top_outputs(bilm, model, batch, mask, 0.0, seed))
        ht = np.asarray(top_outputs(bilm, model, batch, mask, t.dropout, seed + k + 1))
        rows = {k: x[:, :, : mask.shape[0]] for k, x in carried.items()}  # restored once per checkpoint
        hw = np.asarray(top_outputs(bilm, model, batch, mask, 0.0, seed, rows))
        for d in range(2):
            h_eval[d].append(he[d][mask])
            h_train[d].append(ht[d][mask])
            h_warm[d].append(hw[d][mask])
            tgt[d].append(targets[d][mask])
    rng = np.random.default_rng([seed, step])
    result = {"step": step, "rows_updated": int(trained.sum()), "rows": v}
    for name, rows in (("updated", trained), ("untouched", ~trained)):
        result[f"row_norm_{name}"] = float(np.linalg.norm(w[rows], axis=1).mean()) if rows.any() else None
        result[f"bias_{name}"] = float(b[rows].mean()) if rows.any() else None
    for d, direction in enumerate(("fwd", "bwd")):
        he, ht, y = np.concatenate(h_eval[d]), np.concatenate(h_train[d]), np.concatenate(tgt[d])
        full = _full_ce(he, y, w, b)
        full_drop = _full_ce(ht, y, w, b)
        hw = np.concatenate(h_warm[d])
        full_warm = _full_ce(hw, y, w, b)
        cands, tries = sample_log_uniform_unique(rng, t.n_negative_samples_batch, v)
        sampled = np.asarray(
            sampled_softmax_loss(
                jnp.asarray(he),
                jnp.asarray(y),
                jnp.asarray(w[y]),
                jnp.asarray(b[y]),
                jnp.asarray(cands),
                jnp.asarray(w[cands]),
                jnp.asarray(b[cands]),
                tries,
                v,
            )
        )
        logits = he @ w.T + b
        true = logits[np.arange(len(y)), y]
        best_untouched = logits[:, ~trained].max(axis=1) if (~trained).any() else np.full(len(y), np.nan)
        mean_h = he.mean(axis=0)
        result[direction] = {
            "full_mean": float(full.mean()),
            "full_median": float(np.median(full)),
            "full_over_20": float((full > 20).mean()),
            "sampled_mean": float(sampled.mean()),
            "full_drop_mean": float(full_drop.mean()),
            "full_warm_mean": float(full_warm.mean()),
            "h_norm_warm": float(np.linalg.norm(hw, axis=1).mean()),
            "h_norm_eval": float(np.linalg.norm(he, axis=1).mean()),
            "h_norm_train": float(np.linalg.norm(ht, axis=1).mean()),
            "cos_mean_h_eval_train": _cos(mean_h, ht.mean(axis=0)),
            "cos_mean_h_updated_rows": _cos(mean_h, w[trained].mean(axis=0)) if trained.any() else None,
            "cos_mean_h_untouched_rows": _cos(mean_h, w[~trained].mean(axis=0)) if (~trained).any() else None,
            "true_logit_median": float(np.median(true)),
            "best_untouched_logit_median": float(np.nanmedian(best_untouched)),
            "argmax_untouched": float((~trained[logits.argmax(axis=1)]).mean()),
            "argmax_top": [vocab.words[i] for i in np.bincount(logits.argmax(axis=1), minlength=v).argsort()[::-1][:3]],
        }
    return result


def start_gap(run_dir: str, step: int, options, chunks) -> dict:
    """Only the two columns ``--reset-state-prob`` is about: mean full-softmax CE per direction
    from zero state and from the carried rows, ``{"fwd": {"zero": ., "carried": .}, "bwd": ...}``
    (``diagnose``'s ``full_mean`` and ``full_warm_mean``, at a fraction of its cost)."""
    _, _, shared, _ = read_run(run_dir, step)
    bilm = jax.device_put(shared["params"]["bilm"])
    w, b = np.asarray(shared["params"]["softmax"]["w"]), np.asarray(shared["params"]["softmax"]["b"])
    carried = training_state(run_dir, step, options, max(mask.shape[0] for _, _, mask in chunks))
    ce = {(d, s): [] for d in ("fwd", "bwd") for s in ("zero", "carried")}
    for batch, targets, mask in chunks:
        rows = {k: x[:, :, : mask.shape[0]] for k, x in carried.items()}
        for start, state in (("zero", None), ("carried", rows)):
            h = np.asarray(top_outputs(bilm, options.model, batch, mask, 0.0, 0, state))
            for d, direction in enumerate(("fwd", "bwd")):
                ce[direction, start].append(_full_ce(h[d][mask], targets[d][mask], w, b))
    return {d: {s: float(np.concatenate(ce[d, s]).mean()) for s in ("zero", "carried")} for d in ("fwd", "bwd")}


def check_training_loss(run_dir: str, step: int, heldout: str, seed: int = 0) -> dict:
    """The sampled loss of one real training step (``train_step`` on the checkpoint's state,
    one device, dropout off so that the outputs are reproducible) against an independent numpy
    computation from the same top outputs, candidates and id-order softmax rows. Equal numbers
    rule out a bug in the row fetch, the slot layout, log Q or the accidental-hit masking at the
    real vocabulary size."""
    import dataclasses

    from elmo_jax.training.batches import LMBatcher
    from elmo_jax.training.run_dir import softmax_in_slot_order
    from elmo_jax.training.sharded_softmax import RowLayout
    from elmo_jax.training.softmax import expected_count
    from elmo_jax.training.step import BATCH_KEYS, TrainState, prepare_batch, train_step

    options, vocab, shared, _ = read_run(run_dir, step)
    # One draw for all rows: the numpy loss below scores every row against it.
    model, t = options.model, dataclasses.replace(options.train, dropout=0.0, rows_per_draw=0)
    layout = RowLayout.for_vocab(t.n_tokens_vocab)
    batcher = LMBatcher(
        TextFiles(heldout),
        vocab,
        rows_per_device=t.batch_size,
        unroll_steps=t.unroll_steps,
        max_chars=model.char_cnn.max_characters_per_token,
        max_epochs=1,
        shuffle=False,
    )
    host, _ = prepare_batch(batcher.next(), step=step, seed=seed, train=t, n_devices=1)
    stored = softmax_in_slot_order(shared, layout)
    state = TrainState(**jax.device_put(stored), lstm=lstm.zero_state(model, t.batch_size))
    _, m = train_step(state, {k: host[k][0] for k in BATCH_KEYS}, model=model, train=t, axis_name=None)
    got = np.asarray([m["loss_sum_fwd"], m["loss_sum_bwd"]]) / float(m["count"])

    batch = {"chars": host["chars"][0], "inputs": host["inputs"][0]}
    top = np.asarray(
        top_outputs(
            jax.device_put(shared["params"]["bilm"]), model, batch, np.ones(host["targets"].shape[2:], bool), 0.0, seed
        ),
        np.float64,
    )
    w = np.asarray(shared["params"]["softmax"]["w"], np.float64)
    b = np.asarray(shared["params"]["softmax"]["b"], np.float64)
    want = []
    for d in range(2):
        h, y = top[d].reshape(-1, w.shape[1]), host["targets"][0, d].reshape(-1)
        cands, tries = host["candidates"][0, d, 0], host["num_tries"][0, d, 0]
        log_q = lambda ids: np.log(np.asarray(expected_count(ids, tries, t.n_tokens_vocab), np.float64))  # noqa: E731, B023 - used in this iteration
        true = (h * w[y]).sum(axis=1) + b[y] - log_q(y)
        logits = h @ w[cands].T + b[cands] - log_q(cands)
        logits[cands[None, :] == y[:, None]] = -np.inf
        both = np.concatenate([true[:, None], logits], axis=1)
        top_ = both.max(axis=1)
        want.append(float(np.mean(top_ + np.log(np.exp(both - top_[:, None]).sum(axis=1)) - true)))
    return {"step": step, "train_step_loss": got.tolist(), "numpy_loss": want}


def _full_ce(h, y, w, b) -> np.ndarray:
    logits = h.astype(np.float64) @ w.T.astype(np.float64) + b
    top = logits.max(axis=1)
    return top + np.log(np.exp(logits - top[:, None]).sum(axis=1)) - logits[np.arange(len(y)), y]


def _cos(a, b) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--heldout", required=True)
    parser.add_argument("--sentences", type=int, default=256)
    parser.add_argument("--out", help="also write one JSON line per checkpoint here")
    parser.add_argument("--steps", type=int, nargs="+", help="only these checkpoints (default: all)")
    parser.add_argument("--check-step", type=int, help="only compare one training step's sampled loss with numpy")
    args = parser.parse_args()
    if args.check_step is not None:
        print(json.dumps(check_training_loss(args.run_dir, args.check_step, args.heldout)))
        return
    options, vocab, chunks = positions(args.run_dir, args.heldout, args.sentences)
    steps = args.steps or Checkpointer(args.run_dir, read_only=True).steps()
    lines = []
    print(
        "nats per held-out token, each sentence from zero state; warm: from states the training carried (the checkpoint's rows)"
    )
    for step in steps:
        r = diagnose(args.run_dir, step, options, vocab, chunks)
        lines.append(json.dumps(r))
        f, bw = r["fwd"], r["bwd"]
        print(
            f"step {step:>5}: full fwd {f['full_mean']:5.2f} bwd {bw['full_mean']:5.2f} | sampled fwd "
            f"{f['sampled_mean']:5.2f} bwd {bw['sampled_mean']:5.2f} | dropout on fwd {f['full_drop_mean']:5.2f} "
            f"bwd {bw['full_drop_mean']:5.2f} | warm fwd {f['full_warm_mean']:5.2f} bwd {bw['full_warm_mean']:5.2f} "
            f"| |h| fwd {f['h_norm_eval']:4.1f} bwd {bw['h_norm_eval']:4.1f}, warm fwd {f['h_norm_warm']:4.1f} "
            f"bwd {bw['h_norm_warm']:4.1f}",
            flush=True,
        )
    if args.out:
        from elmo_jax._util.atomic import write_text_atomic

        write_text_atomic(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    try:
        main()
    except (CheckpointError, DataError, OSError) as e:  # a step the run has not saved, a path missing
        raise SystemExit(f"collapse.py: {e}") from None
