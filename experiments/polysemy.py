"""Polysemy in context (the paper's Table 4): nearest neighbours of an ambiguous word's biLM vector.

    python experiments/polysemy.py --run-dir runs/real [--out experiments/results/polysemy.md]
    python experiments/polysemy.py --options O --weights W     # an exported (bilm-tf) model

For each query word, a few held-out sentences containing it (``lm/heldout.txt``; never seen in
pretraining) are embedded, and the word's vector in each is compared by cosine with the same
word's vectors in up to ``--pool`` pretraining sentences (``lm/train/*.txt``). Two representations:

* contextual: the top biLM layer (layer 2), which the paper found best for word sense;
* context-free: layer 0, the char-CNN token vector. It is the same for every occurrence of a word,
  so it cannot tell senses apart; its nearest *words* in the vocabulary are shown instead (the
  paper's GloVe row).

The table shows, per query, the nearest pretraining sentence by the contextual vector. Sentences
are shortened to a window around the word. Queries are the first held-out sentences containing
the word, in file order (no cherry-picking beyond the choice of words, listed in ``WORDS``).
"""

from __future__ import annotations

import argparse
import glob
import pathlib
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from elmo_jax._util.atomic import write_text_atomic  # noqa: E402
from elmo_jax.extract.embedder import Embedder  # noqa: E402
from elmo_jax.model.vocabulary import Vocabulary  # noqa: E402

WORDS = ("play", "bank", "fire", "spring", "bear", "party", "plant", "present", "apple")
CONTEXTUAL_LAYER = 2


def sentences_with(lines: list[str], word: str, limit: int) -> list[list[str]]:
    out = []
    for line in lines:
        tokens = line.split()
        if word in tokens:
            out.append(tokens)
            if len(out) == limit:
                break
    return out


def word_vectors(embedder: Embedder, sentences: list[list[str]], word: str, layer: int) -> np.ndarray:
    """``[n_sentences, 2P]``: the first occurrence of ``word`` in each sentence, unit length."""
    vecs = np.stack([layers[layer, s.index(word)] for s, layers in zip(sentences, embedder.embed(sentences))])
    return vecs / np.maximum(np.linalg.norm(vecs, axis=-1, keepdims=True), 1e-12)


def window(tokens: list[str], word: str, size: int = 8) -> str:
    i = tokens.index(word)
    lo, hi = max(0, i - size), min(len(tokens), i + size + 1)
    text = " ".join(tokens[lo:i] + [f"**{word}**"] + tokens[i + 1 : hi])
    return ("... " if lo else "") + text + (" ..." if hi < len(tokens) else "")


def nearest_words(embedder: Embedder, vocab_words: list[str], words: tuple[str, ...], k: int) -> dict[str, list[str]]:
    """Layer-0 nearest vocabulary words (cosine), the word itself excluded."""
    table = np.stack([x[0, 0] for x in embedder.embed([[w] for w in vocab_words])])
    table /= np.maximum(np.linalg.norm(table, axis=-1, keepdims=True), 1e-12)
    out = {}
    for w in words:
        q = np.stack([x[0, 0] for x in embedder.embed([[w]])])[0]
        sims = table @ (q / max(np.linalg.norm(q), 1e-12))
        order = [vocab_words[i] for i in np.argsort(-sims) if vocab_words[i] != w]
        out[w] = order[:k]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", default="runs/real")
    p.add_argument("--options", help="with --weights: a bilm-tf options.json instead of --run-dir")
    p.add_argument("--weights", help="bilm-tf weights.hdf5")
    p.add_argument("--data-dir", type=pathlib.Path, default=ROOT / "experiments" / "data" / "lm")
    p.add_argument("--queries", type=int, default=3, help="held-out sentences per word")
    p.add_argument("--pool", type=int, default=400, help="pretraining sentences per word")
    p.add_argument("--vocab-words", type=int, default=20000, help="most frequent words searched by layer 0")
    p.add_argument("--out", type=pathlib.Path, default=ROOT / "experiments" / "results" / "polysemy.md")
    args = p.parse_args(argv)
    heldout_path, train_paths = args.data_dir / "heldout.txt", sorted(glob.glob(str(args.data_dir / "train" / "*.txt")))
    if not heldout_path.exists() or not train_paths:
        sys.exit(
            f"polysemy: no {heldout_path} or {args.data_dir}/train/*.txt; run `python experiments/prep_corpus.py` first"
        )
    t0 = time.time()
    if bool(args.options) != bool(args.weights):
        sys.exit("polysemy: --options and --weights go together")
    model = args.weights or args.run_dir
    embedder = (
        Embedder.from_hdf5(args.options, args.weights) if args.options else Embedder.from_checkpoint(args.run_dir)
    )
    heldout = heldout_path.read_text(encoding="utf-8").splitlines()
    train = [line for path in train_paths for line in pathlib.Path(path).read_text(encoding="utf-8").splitlines()]
    vocab = Vocabulary.load(args.data_dir / "vocab.txt")
    vocab_words = vocab.words[3 : 3 + args.vocab_words]  # after <S>, </S>, <UNK>; most frequent first
    neighbours = nearest_words(embedder, vocab_words, WORDS, 6)

    lines = [
        f"# Polysemy: nearest neighbours in context ({model})",
        "",
        "Made by `python experiments/polysemy.py`. Query: a held-out sentence; neighbour: the "
        f"pretraining sentence whose layer-{CONTEXTUAL_LAYER} vector of the same word is nearest (cosine). "
        "Layer 0 (the char-CNN token vector) is context-free: its row lists the nearest vocabulary words.",
        "",
        "| word | source | sentence | cosine |",
        "|---|---|---|---:|",
    ]
    for word in WORDS:
        queries = sentences_with(heldout, word, args.queries)
        pool = sentences_with(train, word, args.pool)
        if not queries or not pool:
            print(f"polysemy: skipping {word!r} ({len(queries)} held-out, {len(pool)} pretraining sentences)")
            continue
        q = word_vectors(embedder, queries, word, CONTEXTUAL_LAYER)
        v = word_vectors(embedder, pool, word, CONTEXTUAL_LAYER)
        sims = q @ v.T
        lines.append(f"| **{word}** | layer 0 nearest words | {', '.join(neighbours[word])} | |")
        for i, s in enumerate(queries):
            j = int(np.argmax(sims[i]))
            lines.append(f"| | held-out | {window(s, word)} | |")
            lines.append(
                f"| | nearest (layer {CONTEXTUAL_LAYER}, of {len(pool)}) | {window(pool[j], word)} | {sims[i, j]:.3f} |"
            )
    lines += ["", f"{time.time() - t0:.0f} s on this machine, including loading the checkpoint."]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
