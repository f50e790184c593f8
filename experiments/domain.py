"""Domain adaptation by continued pretraining (issue 14): a general biLM moved onto Python's docs.

Up to five models (``--arms``), the trained ones all for ``--steps`` x rows x 20 tokens:

- ``a``: the general model as it is (a run dir trained on the experiments' general text);
- ``b``: ``elmo-jax train --init-from`` its bilm-tf TF checkpoint (weights, softmax and Adagrad
  accumulators; the vocabulary extended with pydoc's words), or without ``--tf-checkpoint`` from
  the run dir itself, which holds the same arrays (experiments/README.md, "Continuing from hdf5
  files": the two starts give the same run);
- ``c``: ``--init-from`` its hdf5 export (no accumulators: learning rate 0.05 by default);
- ``d``: from scratch on pydoc, the same model and recipe, pydoc's own vocabulary;
- ``mix``: as ``b``, on pydoc's and the general text's training files together (pydoc is about a
  third of the tokens), to see whether the old text keeps what pure pydoc forgets.

Each model is scored on pydoc's and on the original held-out text (full softmax, every sentence
from zero state, as extraction runs), on target positions whose word is in every model's
vocabulary, with each model's own ``<UNK>`` rate beside. Then the probe: for "thread", "class",
"kernel", "module" and "pipe", up to 20 occurrences each in the held-out texts, the share of each
occurrence's 10 nearest neighbours (cosine, ELMo's layer average, other sentences only) among a
pool of tokens half from pydoc and half from the general text that come from pydoc.

    python experiments/domain.py --source runs/real --export runs/real/export --steps 500 \\
        --arms a b c d mix --work-dir runs/domain --out experiments/results/domain/domain.jsonl
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

from elmo_jax.model.vocabulary import Vocabulary
from elmo_jax.text.sources import TextFiles
from elmo_jax.training.run_dir import load_run

PROBE = ("thread", "class", "kernel", "module", "pipe")
LM, DOMAIN = "experiments/data/lm", "experiments/data/domain"


def elmo_jax(*args: str) -> float:
    """Runs ``elmo-jax ARGS`` (the user's command) and returns its wall time."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "elmo_jax", *args], check=True)
    return time.perf_counter() - start


def train_runs(args) -> dict[str, float]:
    """Trains the arms other than ``a`` into ``args.work_dir`` (skipping any already there); seconds each."""
    # The default recipe (reset_state_prob 0.1) throughout: every start here is a fresh run.
    common = ["--steps", str(args.steps), "--log-every", "50", "--save-every", str(args.steps), "--no-progress"]
    pydoc = ["--train-files", f"{DOMAIN}/train/*.txt"]
    # One glob for both texts (--train-files takes one): data/lm/train/ and data/domain/train/.
    mixed = ["--train-files", "experiments/data/*/train/*.txt"]
    assert sorted(glob.glob(mixed[1])) == sorted(glob.glob(f"{DOMAIN}/train/*.txt") + glob.glob(f"{LM}/train/*.txt"))
    full = ["--init-from", args.tf_checkpoint or args.source]
    seconds = {}
    for name, extra in (("b", full + pydoc), ("c", ["--init-from", args.export] + pydoc), ("mix", full + mixed)):
        run = os.path.join(args.work_dir, name)
        if name in args.arms and not os.path.exists(os.path.join(run, "metrics.jsonl")):
            seconds[name] = elmo_jax("train", "--run-dir", run, *extra, *common)
    run = os.path.join(args.work_dir, "d")
    if "d" in args.arms and not os.path.exists(os.path.join(run, "metrics.jsonl")):
        start = time.perf_counter()
        vocab = os.path.join(args.work_dir, "d_vocab.txt")
        elmo_jax("vocab", "--train-files", f"{DOMAIN}/train/*.txt", "--out", vocab)
        with open(os.path.join(args.source, "options.json")) as f:
            options = json.load(f)
        with open(vocab + ".json") as f:
            options["n_train_tokens"] = json.load(f)["n_train_tokens"]
        options["n_tokens_vocab"] = len(Vocabulary.load(vocab))
        config = os.path.join(args.work_dir, "d_options.json")
        with open(config, "w") as f:
            json.dump(options, f, indent=1)
        elmo_jax("train", "--run-dir", run, "--config", config, "--vocab", vocab, *pydoc, *common)
        seconds["d"] = time.perf_counter() - start
    return seconds


def perplexities(runs: dict[str, str]) -> list[dict]:
    from elmo_jax.training.evaluate import evaluate

    loaded = {name: load_run(path) for name, path in runs.items()}
    common = set.intersection(*({vocab.words[i] for i in range(len(vocab))} for _, vocab, _, _ in loaded.values()))
    common -= {"<UNK>"}
    lines = []
    for text_name, path in (("pydoc", f"{DOMAIN}/heldout.txt"), ("original", f"{LM}/heldout.txt")):
        for name, (options, vocab, params, step) in loaded.items():
            scored = np.array([vocab.words[i] in common for i in range(len(vocab))])
            start = time.perf_counter()
            r = evaluate(params, options.model, vocab, TextFiles(path), reset_state_per_sentence=True, scored=scored)
            lines.append(
                {
                    "what": "perplexity",
                    "model": name,
                    "text": text_name,
                    "step": step,
                    "vocab": len(vocab),
                    "common_vocab": len(common),
                    **{k: round(v, 4) for k, v in r.items()},
                    "seconds": round(time.perf_counter() - start, 1),
                }
            )
            print(json.dumps(lines[-1]), flush=True)
    return lines


def probe(runs: dict[str, str], pool_sentences: int, per_word: int, k: int = 10) -> list[dict]:
    from elmo_jax.extract.embedder import Embedder

    texts = {
        src: [line.split() for line in open(path, encoding="utf-8") if line.strip()]
        for src, path in (("pydoc", f"{DOMAIN}/heldout.txt"), ("original", f"{LM}/heldout.txt"))
    }
    rng = np.random.default_rng(0)
    pool = [(src, i) for src in texts for i in rng.permutation(len(texts[src]))[:pool_sentences]]
    # Occurrences: alternate between the two texts, so both senses (where a word has two) appear.
    occurrences = {}
    for word in PROBE:
        found = {
            src: [(src, i, j) for i, s in enumerate(texts[src]) for j, w in enumerate(s) if w.lower() == word]
            for src in texts
        }
        mixed = [x for pair in zip(found["pydoc"], found["original"]) for x in pair]
        rest = found["pydoc"][len(mixed) // 2 :] + found["original"][len(mixed) // 2 :]
        occurrences[word] = (mixed + rest)[:per_word]
    wanted = sorted({(src, i) for occ in occurrences.values() for src, i, _ in occ} | set(pool))
    lines = []
    for name, path in runs.items():
        embedder = Embedder.from_checkpoint(path)
        vectors = embedder.embed([texts[src][i] for src, i in wanted])
        where = {key: v.mean(axis=0) for key, v in zip(wanted, vectors)}  # layer average, [tokens, 2P]
        pool_vecs = np.concatenate([where[key] for key in pool])
        pool_src = np.concatenate([[src == "pydoc"] * len(texts[src][i]) for src, i in pool])
        pool_sent = np.concatenate([[n] * len(texts[src][i]) for n, (src, i) in enumerate(pool)])
        pool_key = {key: n for n, key in enumerate(pool)}
        unit = pool_vecs / np.linalg.norm(pool_vecs, axis=1, keepdims=True)
        for word, occ in occurrences.items():
            shares = {"pydoc": [], "original": []}
            for src, i, j in occ:
                v = where[(src, i)][j]
                sim = unit @ (v / np.linalg.norm(v))
                sim[pool_sent == pool_key.get((src, i), -1)] = -np.inf  # not its own sentence
                top = np.argpartition(-sim, k)[:k]
                shares[src].append(pool_src[top].mean())
            lines.append(
                {
                    "what": "probe",
                    "model": name,
                    "word": word,
                    "k": k,
                    **{f"n_{src}": len(v) for src, v in shares.items()},
                    **{f"pydoc_share_{src}": round(float(np.mean(v)), 3) if v else None for src, v in shares.items()},
                }
            )
            print(json.dumps(lines[-1]), flush=True)
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source", required=True, help="the stand-in general model (a run dir)")
    p.add_argument(
        "--tf-checkpoint",
        help="the same model as a bilm-tf TF checkpoint dir, for b and mix "
        "(default: the --source run dir, the same arrays)",
    )
    p.add_argument("--export", help="the same model's hdf5 export (elmo-jax export), for c")
    p.add_argument("--arms", nargs="+", choices=["a", "b", "c", "d", "mix"], default=["a", "b", "c", "d"])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--work-dir", required=True)
    p.add_argument("--pool-sentences", type=int, default=500, help="per text, in the probe's neighbour pool")
    p.add_argument("--per-word", type=int, default=20)
    p.add_argument("--out", help="append the JSON lines here too")
    args = p.parse_args()
    if "c" in args.arms and not args.export:
        p.error("arm c needs --export")
    for path in (f"{DOMAIN}/heldout.txt", f"{LM}/heldout.txt"):  # each arm is scored on both
        if not os.path.isfile(path):
            p.error(f"{path} is missing: run `python experiments/prep_domain.py` (and prep_corpus.py) first")
    os.makedirs(args.work_dir, exist_ok=True)
    seconds = train_runs(args)
    runs = {n: args.source if n == "a" else os.path.join(args.work_dir, n) for n in args.arms}
    machine = f"{platform.node()}, {os.cpu_count()} CPUs ({platform.processor() or platform.machine()})"
    lines = [
        {
            "what": "runs",
            "steps": args.steps,
            "train_seconds": {k: round(v) for k, v in seconds.items()},
            "machine": machine,
        }
    ]
    print(json.dumps(lines[0]), flush=True)
    lines += perplexities(runs)
    lines += probe(runs, args.pool_sentences, args.per_word)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "a", encoding="utf-8") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)


if __name__ == "__main__":
    main()
