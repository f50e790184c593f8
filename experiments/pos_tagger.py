"""POS tagging on the Brown corpus (12 universal tags) over frozen ELMo, after Peters et al. (2018).

Two of the paper's analyses, on Brown POS: sample efficiency (its Figure 1, there for SNLI and SRL:
baseline vs ELMo at 1 %, 10 %, 100 % of the training data) and what each biLM layer holds (its
Table 6: POS accuracy from single layers).

    python experiments/pos_tagger.py features --run-dir runs/real     # embed train/dev/test once
    python experiments/pos_tagger.py grid [--seeds 0 1 2] [--fractions 0.01 0.1 1.0]

``features`` runs the frozen biLM over every sentence of ``{train,dev,test}.txt`` (one sentence a
line, tokens ``word/TAG``) and stores per split ``<split>.npy`` ``[n_tokens, L+1, 2P] float16``,
``<split>.offsets.npy`` ``[n_sentences + 1] int64`` and one ``meta.json`` (model, data file hashes,
shapes). ``grid`` trains taggers on those features only (no biLM in the loop):

    token  = concat(dropout(word embedding [100]), ELMo part)   ELMo part, by variant:
               words:  none                                     elmo:   Elmo module's scalar mix + dropout
               layerK: dropout(biLM layer K) (0 = char CNN, 1.. = LSTM layers)
    tagger = one biLSTM layer (--hidden 64 per direction) -> dropout -> Dense(12)

Dropout 0.3 everywhere (the Elmo module's own dropout for the mix). The scalar mix is Elmo's
(``convention="bilm_tf"``, no layer norm, no L2 on its weights); the learned softmax weights and
gamma of each dev-best elmo model are in the JSON.

Word vocabulary: the *lowercased* words seen at least twice in the run's own training sentences
(the rest is UNK, so UNK is trained on singletons); case and spelling are left to ELMo's char CNN.
The embedding table has the size of the full training set's vocabulary in every run (rows that a
subset never uses get no gradient), so all runs of a model kind share its compiled programs.

Training: Adam 4e-3 (constant), gradient norm clipped at 5, batches of ~2048 padded tokens of
sentences of similar length (length buckets: one compile each), a step count fixed in advance
(below), dev accuracy evaluated ``--evals`` (4) times per run at even step intervals; the dev-best
params are kept and scored on test. Accuracy counts every token, punctuation included (the usual
Brown/PTB convention). Standard deviations are over seeds (n - 1), each seed drawing its own
training subset, initialisation, dropout and batch order.

Subsampling: a fraction f keeps the first ``round(f * n)`` sentences of a seed-dependent
permutation of the training set (so for one seed 1 % is inside 10 % is inside 100 %). A run trains
for ``max(epochs * batches_per_epoch(f), min_share * epochs * batches_per_epoch(100 %))`` steps:
small fractions get many more epochs (with the defaults on Brown: 1 %: 26 epochs, 10 %: 4.6
epochs, each 287 steps against 573 for 100 %), enough to fit them (the dev-best checkpoint guards
against overfitting).

Time on the 2-core CPU, with another job running (nice'd): a 100 % run takes ~55-90 s with ELMo
input, ~30-50 s without; each model kind (words, elmo, and one shared by layer0-2) first compiles
~18 programs, ~5 s each. The first 16 of the default grid's 27 runs took 584 s on the real
features; the whole grid extrapolates to ~21 min (up to ~30 min when the machine is busier).
``--epochs 2`` (~1.7x) trains the words baseline further (one epoch: 96.7 dev, three: 97.1).
``features`` on the real model: ~2-4k tokens/s with the token cache, ~5-8 min.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

TAGS = (".", "ADJ", "ADP", "ADV", "CONJ", "DET", "NOUN", "NUM", "PRON", "PRT", "VERB", "X")
TAG_ID = {t: i for i, t in enumerate(TAGS)}
SPLITS = ("train", "dev", "test")
PAD, UNK = 0, 1
PREP_HINT = "run `python experiments/prep_corpus.py` first"
FEATURES_HINT = "run `python experiments/pos_tagger.py features --run-dir runs/real` first"


class Fail(Exception):
    """Bad input: reported as one line, exit status 2."""


# ------------------------------------------------------------------------------------------ data


def read_split(path: str, max_sentences: int | None = None) -> tuple[list[list[str]], list[list[int]]]:
    """Words and tag ids per sentence of a ``word/TAG`` file (blank lines skipped)."""
    if not os.path.isfile(path):
        raise Fail(f"{path}: not found; {PREP_HINT}")
    words, tags = [], []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if max_sentences is not None and len(words) >= max_sentences:
                break
            tokens = line.split()
            if not tokens:
                continue
            pairs = [t.rsplit("/", 1) for t in tokens]
            bad = next((t for t, p in zip(tokens, pairs) if len(p) != 2 or not p[0] or p[1] not in TAG_ID), None)
            if bad is not None:
                raise Fail(f"{path}:{n}: bad token {bad!r} (expected word/TAG with TAG one of {' '.join(TAGS)})")
            words.append([w for w, _ in pairs])
            tags.append([TAG_ID[t] for _, t in pairs])
    if not words:
        raise Fail(f"{path}: no sentences")
    return words, tags


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def offsets_of(sentences) -> np.ndarray:
    """``[n + 1] int64``: sentence i is tokens ``offsets[i]:offsets[i + 1]`` of the flat arrays."""
    return np.concatenate([[0], np.cumsum([len(s) for s in sentences])]).astype(np.int64)


def write_json_atomic(path: str, obj) -> None:
    from elmo_jax._util.atomic import write_text_atomic

    write_text_atomic(path, json.dumps(obj, indent=1) + "\n")


# -------------------------------------------------------------------------------------- features


def load_embedder(args, words: list[str] | None):
    """(Embedder, description of the model for meta.json) from a run dir or bilm-tf files.

    ``words``: the corpus's distinct words, for the Embedder's token cache: each goes through the
    char CNN once, up front, instead of once per batch (same vectors up to float rounding; on the
    2-core CPU this halves the time, most of it saved compiles of per-batch char-CNN shapes).
    """
    from elmo_jax.config import Options
    from elmo_jax.extract.embedder import Embedder

    try:
        if args.run_dir:
            from elmo_jax.training.run_dir import load_run

            options, _, params, step = load_run(args.run_dir)
            config, source = options.model, {"run_dir": os.path.abspath(args.run_dir), "step": step}
            params = params["bilm"]
        else:
            from elmo_jax.compat.hdf5 import load_hdf5

            config, params = load_hdf5(args.options, args.weights)
            source = {"options": os.path.abspath(args.options), "weights": os.path.abspath(args.weights)}
    except (ValueError, OSError, KeyError) as e:  # CheckpointError, ConfigError, WeightsError are ValueErrors
        raise Fail(f"cannot load the biLM: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    source["model"] = Options(model=config).to_dict()
    return Embedder(config, params, token_cache=words), source


def embed_split(embedder, sentences: list[list[str]], path: str, chunk: int) -> tuple[tuple, float]:
    """Writes ``path`` (``[n_tokens, L+1, 2P] float16``) and ``<path>.offsets``; returns (shape, seconds)."""
    from tqdm import tqdm

    from elmo_jax._util.atomic import atomic_path

    offsets = offsets_of(sentences)
    shape = (int(offsets[-1]), embedder.config.n_output_layers, embedder.config.output_dim)
    offsets_path = path.replace(".npy", ".offsets.npy")
    start = time.perf_counter()
    # Nested: the offsets are renamed into place first, the features last, and only once both are
    # written; an interruption before that leaves neither temporary file behind.
    with atomic_path(path) as tmp, atomic_path(offsets_path) as tmp_offsets:
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float16, shape=shape)
        with tqdm(total=shape[0], unit="tok", unit_scale=True, desc=os.path.basename(path)) as bar:
            # A chunk at a time: the embedder holds one chunk's float32 layers, never the whole split.
            for lo in range(0, len(sentences), chunk):
                for i, layers in enumerate(embedder.embed(sentences[lo : lo + chunk]), lo):
                    out[offsets[i] : offsets[i + 1]] = layers.transpose(1, 0, 2)
                bar.update(int(offsets[min(lo + chunk, len(sentences))] - offsets[lo]))
        out.flush()
        del out  # closes the memmap before the rename
        np.save(tmp_offsets, offsets)
    return shape, time.perf_counter() - start


def cmd_features(args) -> None:
    start = time.perf_counter()
    paths = {s: os.path.join(args.data_dir, f"{s}.txt") for s in SPLITS}
    data = {s: read_split(p)[0] for s, p in paths.items()}
    words = None if args.no_token_cache else sorted({w for split in data.values() for s in split for w in s})
    embedder, source = load_embedder(args, words)
    os.makedirs(args.out, exist_ok=True)
    meta_path = os.path.join(args.out, "meta.json")
    if os.path.exists(meta_path):
        os.remove(meta_path)  # until every split is rewritten, the old meta would vouch for mixed files
    meta = {
        **source,
        "data_dir": os.path.abspath(args.data_dir),
        "dtype": "float16",
        "token_cache": words is not None,
        "splits": {},
    }
    for split, sentences in data.items():
        shape, seconds = embed_split(embedder, sentences, os.path.join(args.out, f"{split}.npy"), args.chunk)
        print(
            f"{split}: {len(sentences)} sentences, {shape[0]} tokens -> {shape} in {seconds:.1f} s "
            f"({shape[0] / seconds:,.0f} tokens/s)"
        )
        meta["splits"][split] = {
            "file_sha256": file_sha256(paths[split]),
            "sentences": len(sentences),
            "shape": list(shape),
            "seconds": round(seconds, 2),
        }
    write_json_atomic(meta_path, meta)
    seconds = time.perf_counter() - start
    total = sum(m["shape"][0] for m in meta["splits"].values())
    print(
        f"all splits: {total} tokens in {seconds:.1f} s ({total / seconds:,.0f} tokens/s, biLM loading and token "
        f"cache included); wrote {args.out}/{{train,dev,test}}.npy, .offsets.npy and meta.json"
    )


# ------------------------------------------------------------------------------------------ grid


def load_features(feature_dir: str, data_dir: str, max_sentences: int | None) -> tuple[dict, dict, object]:
    """(splits, meta, the biLM's ``ModelConfig``), the features checked against the data files.

    Per split ``{"words": [n_tokens] lowercased str, "tags": [n_tokens] int32, "offsets": [n + 1] int64,
    "features": [n_tokens, L+1, 2P] float16 (memory-mapped)}``.
    """
    from elmo_jax.config import Options

    meta_path = os.path.join(feature_dir, "meta.json")
    if not os.path.isfile(meta_path):
        raise Fail(f"{meta_path}: not found; {FEATURES_HINT}")
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
        recorded_splits = {s: meta["splits"][s] for s in SPLITS}
        config = Options.from_dict(meta["model"]).model
    except (ValueError, KeyError, TypeError) as e:  # ConfigError is a ValueError
        raise Fail(f"{meta_path}: not a features meta file ({type(e).__name__}: {e}); {FEATURES_HINT}") from None
    splits = {}
    for split in SPLITS:
        path = os.path.join(data_dir, f"{split}.txt")
        words, tags = read_split(path, max_sentences)
        recorded = recorded_splits[split]
        if file_sha256(path) != recorded.get("file_sha256"):
            raise Fail(f"{feature_dir}: features were made from another {path}; {FEATURES_HINT}")
        feature_path = os.path.join(feature_dir, f"{split}.npy")
        try:
            features = np.load(feature_path, mmap_mode="r")
            offsets = np.load(feature_path.replace(".npy", ".offsets.npy"))
        except (OSError, ValueError) as e:
            raise Fail(f"{feature_path}: unreadable ({e}); {FEATURES_HINT}") from None
        if list(features.shape) != recorded["shape"] or len(offsets) != recorded["sentences"] + 1:
            raise Fail(f"{feature_path}: shape {features.shape} does not match {meta_path}; {FEATURES_HINT}")
        offsets = offsets[: len(words) + 1]
        if not np.array_equal(offsets, offsets_of(words)):
            raise Fail(f"{feature_path}: sentence lengths differ from {path}; {FEATURES_HINT}")
        splits[split] = {
            "words": [w.lower() for s in words for w in s],
            "tags": np.array([t for s in tags for t in s], np.int32),
            "offsets": offsets,
            "features": features,
        }
    return splits, meta, config


def build_vocab(words: list[str]) -> dict[str, int]:
    """Words seen at least twice -> ids from 2 (0 = padding, 1 = UNK), most frequent first."""
    kept = [w for w, c in collections.Counter(words).most_common() if c >= 2]
    return {w: i for i, w in enumerate(kept, PAD + 2)}


BUCKETS = (8, 16, 24, 32, 48, 64, 96, 128)


def length_bucket(n: int, buckets=BUCKETS) -> int:
    """Padded time steps: the first bucket >= n, else a multiple of 64.

    Each bucket costs one compile (~5 s on CPU) per model kind and phase (train, eval); with these
    8, Brown's training batches hold ~23 % padding.
    """
    return next((b for b in buckets if n <= b), -(-n // 64) * 64)


def plan_batches(
    lengths: np.ndarray, ids: np.ndarray, budget: int, rng=None, buckets=BUCKETS
) -> list[tuple[int, int, np.ndarray]]:
    """``(time, rows, sentence ids)`` batches of about ``budget`` padded tokens, similar lengths together.

    ``lengths`` ``[n_sentences]``, ``ids`` the sentences to batch. With ``rng``: sentences of equal
    length are grouped differently each time and batches come in random order.
    """
    noise = rng.uniform(0, 1, len(ids)) if rng is not None else np.zeros(len(ids))
    order = ids[np.argsort(lengths[ids] + noise, kind="stable")]
    widths = np.array([length_bucket(n, buckets) for n in lengths[order]])
    batches = []
    for t in np.unique(widths):
        group = order[widths == t]
        rows = max(1, budget // t)
        batches += [(int(t), rows, group[lo : lo + rows]) for lo in range(0, len(group), rows)]
    if rng is not None:
        rng.shuffle(batches)
    return batches


def gather(split: dict, word_ids: np.ndarray, batch: tuple, layers) -> dict:
    """Padded arrays for one batch: ``words/tags [rows, time] int32``, ``mask [rows, time] bool``,
    ``layers [rows, time, K, 2P] float16`` (K = 3 for the mix, 1 for one layer; absent for ``words``)."""
    time_, rows, ids = batch
    lengths = split["offsets"][ids + 1] - split["offsets"][ids]
    r = np.repeat(np.arange(len(ids)), lengths)
    c = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    tok = np.repeat(split["offsets"][ids], lengths) + c
    out = {
        "words": np.zeros((rows, time_), np.int32),
        "tags": np.zeros((rows, time_), np.int32),
        "mask": np.zeros((rows, time_), bool),
    }
    out["words"][r, c] = word_ids[tok]
    out["tags"][r, c] = split["tags"][tok]
    out["mask"][r, c] = True
    if layers is not None:
        feats = split["features"]
        out["layers"] = np.zeros((rows, time_, len(layers), feats.shape[2]), np.float16)
        out["layers"][r, c] = feats[tok[:, None], layers]  # only the layers asked for are read
    return out


def bilstm(hidden: int):
    """A linen biLSTM: ``(x [B, T, D] float32, mask [B, T] bool) -> [B, T, 2 * hidden]``.

    Rows are left-aligned (padding at the end). Both directions run in one ``lax.scan``, and the
    input projections of all steps and both directions are one matmul outside it (``nn.RNN`` over
    ``nn.OptimizedLSTMCell`` does one small matmul per step and direction: ~1.3x slower on CPU). The
    backward direction reads the time-flipped row, so its padding comes first: its state is held at
    zero there. (Flips rather than per-row gathers, whose gradients are scatter-adds, slow on CPU.)
    """
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    class BiLSTM(nn.Module):
        @nn.compact
        def __call__(self, x, mask):
            b, t, _ = x.shape
            gates = nn.Dense(8 * hidden, name="input")(x).reshape(b, t, 2, 4 * hidden)
            gates = jnp.stack([gates[:, :, 0], jnp.flip(gates[:, :, 1], axis=1)])  # [2, B, T, 4H]
            valid = jnp.stack([mask, jnp.flip(mask, axis=1)])[..., None]  # [2, B, T, 1]
            recurrent = self.param("recurrent", nn.initializers.orthogonal(), (2, hidden, 4 * hidden))

            def step(carry, inputs):
                h, c = carry
                g, keep = inputs
                i, f, o, n = jnp.split(g + jnp.einsum("dbh,dhk->dbk", h, recurrent), 4, axis=-1)
                c_new = jax.nn.sigmoid(f + 1.0) * c + jax.nn.sigmoid(i) * jnp.tanh(n)  # +1: forget little at first
                h_new = jax.nn.sigmoid(o) * jnp.tanh(c_new)
                h, c = jnp.where(keep, h_new, h), jnp.where(keep, c_new, c)
                return (h, c), h

            zero = jnp.zeros((2, b, hidden), x.dtype)
            _, hs = jax.lax.scan(step, (zero, zero), (gates.transpose(2, 0, 1, 3), valid.transpose(2, 0, 1, 3)))
            hs = hs.transpose(1, 2, 0, 3)  # [T, 2, B, H] -> [2, B, T, H]
            return jnp.concatenate([hs[0], jnp.flip(hs[1], axis=1)], axis=-1)

    return BiLSTM()


def make_model(kind: str, n_words: int, config, hidden: int, dropout: float):
    """The linen tagger: ``(words [B, T], layers [B, T, K, 2P] float16 | None, mask [B, T]) -> logits [B, T, 12]``.

    ``kind``: ``"words"`` (layers None), ``"elmo"`` (K = L+1, mixed) or ``"layer"`` (K = 1: which
    layer is the caller's choice, so layer0, layer1 and layer2 share one model and its compiles)."""
    import flax.linen as nn
    import jax.numpy as jnp

    from elmo_jax.modules.elmo import Elmo

    class Tagger(nn.Module):
        @nn.compact
        def __call__(self, words, layers, mask, *, deterministic):
            x = nn.Embed(n_words, 100, embedding_init=nn.initializers.normal(0.1))(words)
            parts = [nn.Dropout(dropout)(x, deterministic=deterministic)]
            if kind == "elmo":
                layers = jnp.moveaxis(layers.astype(jnp.float32), 2, 0)  # Elmo wants [L+1, B, T, D]
                elmo = Elmo(config=config, convention="bilm_tf", dropout=dropout, num_output_representations=1)
                parts.append(elmo(layers=layers, mask=mask, deterministic=deterministic)["elmo_representations"][0])
            elif kind == "layer":
                parts.append(nn.Dropout(dropout)(layers[:, :, 0].astype(jnp.float32), deterministic=deterministic))
            x = jnp.concatenate(parts, axis=-1)
            x = bilstm(hidden)(x, mask)
            x = nn.Dropout(dropout)(x, deterministic=deterministic)
            return nn.Dense(len(TAGS))(x)

    return Tagger()


def make_functions(model, lr: float):
    """Jitted ``(init, train_step, count_correct)``, built once per variant and reused by all its runs.

    A constant learning rate: with one epoch or two, a decay (tried: cosine) leaves the embeddings of
    rare words, which see few updates, less trained (-0.4 dev points for ``words``).
    """
    import jax
    import jax.numpy as jnp
    import optax

    tx = optax.chain(optax.clip_by_global_norm(5.0), optax.adam(lr))

    @jax.jit
    def init(key, batch):
        params = model.init(key, batch["words"], batch.get("layers"), batch["mask"], deterministic=True)["params"]
        return params, tx.init(params)

    @jax.jit
    def train_step(params, opt_state, batch, key):
        def loss_fn(p):
            logits = model.apply(
                {"params": p},
                batch["words"],
                batch.get("layers"),
                batch["mask"],
                deterministic=False,
                rngs={"dropout": key},
            )
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tags"])
            return jnp.sum(ce * batch["mask"]) / jnp.maximum(batch["mask"].sum(), 1)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    @jax.jit
    def count_correct(params, batch):
        logits = model.apply({"params": params}, batch["words"], batch.get("layers"), batch["mask"], deterministic=True)
        return jnp.sum((jnp.argmax(logits, -1) == batch["tags"]) & batch["mask"])

    return init, train_step, count_correct


def sentence_lengths(split: dict) -> np.ndarray:
    return split["offsets"][1:] - split["offsets"][:-1]


def accuracy(count_correct, params, split: dict, word_ids: np.ndarray, layers, args) -> float:
    """Fraction of all tokens of ``split`` tagged right (punctuation included)."""
    lengths = sentence_lengths(split)
    correct = 0
    for batch in plan_batches(lengths, np.arange(len(lengths)), args.eval_tokens, buckets=args.buckets):
        correct += int(count_correct(params, gather(split, word_ids, batch, layers)))
    return correct / len(split["tags"])


def train_run(variant: str, fraction: float, seed: int, splits: dict, fns, n_layers: int, args) -> dict:
    """One tagger: train on a seed's ``fraction`` of the training sentences; dev-best params scored on test."""
    import jax
    from tqdm import tqdm

    start = time.perf_counter()
    train = splits["train"]
    lengths = sentence_lengths(train)
    n = len(lengths)
    rng = np.random.default_rng(seed)
    ids = np.sort(rng.permutation(n)[: max(1, round(fraction * n))])  # a prefix of one permutation: nested subsets
    vocab = build_vocab([w for i in ids for w in train["words"][train["offsets"][i] : train["offsets"][i + 1]]])
    word_ids = {s: np.array([vocab.get(w, UNK) for w in d["words"]], np.int32) for s, d in splits.items()}
    layers = None if variant == "words" else list(range(n_layers)) if variant == "elmo" else [int(variant[5:])]
    per_epoch = len(plan_batches(lengths, ids, args.batch_tokens, buckets=args.buckets))
    full_steps = args.epochs * len(plan_batches(lengths, np.arange(n), args.batch_tokens, buckets=args.buckets))
    steps = max(args.epochs * per_epoch, math.ceil(args.min_share * full_steps))
    eval_at = {round(k * steps / args.evals) for k in range(1, args.evals + 1)}

    init, train_step, count_correct = fns
    dummy = {"words": np.zeros((1, 8), np.int32), "mask": np.ones((1, 8), bool)}
    if layers is not None:
        dummy["layers"] = np.zeros((1, 8, len(layers), train["features"].shape[2]), np.float16)
    params, opt_state = init(jax.random.PRNGKey(seed), dummy)
    key = jax.random.PRNGKey(10_000 + seed)
    best = (-1.0, 0, params)
    curve, step = [], 0
    with tqdm(total=steps, desc=f"{variant} {fraction:g} s{seed}", leave=False, unit="step") as bar:
        while step < steps:
            for batch in plan_batches(lengths, ids, args.batch_tokens, rng, args.buckets):
                params, opt_state, loss = train_step(
                    params, opt_state, gather(train, word_ids["train"], batch, layers), jax.random.fold_in(key, step)
                )
                step += 1
                bar.update()
                if step in eval_at:
                    dev = accuracy(count_correct, params, splits["dev"], word_ids["dev"], layers, args)
                    curve.append([step, round(dev, 5), round(float(loss), 4)])
                    bar.set_postfix(dev=f"{100 * dev:.2f}")
                    if dev > best[0]:
                        best = (dev, step, params)
                if step == steps:
                    break
    dev, best_step, params = best
    test = accuracy(count_correct, params, splits["test"], word_ids["test"], layers, args)
    run = {
        "variant": variant,
        "fraction": fraction,
        "seed": seed,
        "train_sentences": len(ids),
        "train_tokens": int(lengths[ids].sum()),
        "vocab": len(vocab) + 2,
        "steps": steps,
        "epochs": round(steps / per_epoch, 2),
        "best_step": best_step,
        "dev_acc": dev,
        "test_acc": test,
        "seconds": round(time.perf_counter() - start, 1),
        "dev_curve": curve,
    }
    if variant == "elmo":
        mix = params["Elmo_0"]["scalar_mix_0"]
        run["mix_weights"] = [round(float(w), 4) for w in jax.nn.softmax(mix["weights"])]
        run["mix_gamma"] = round(float(mix["gamma"]), 4)
    return run


def summarize(runs: list[dict]) -> list[dict]:
    """Mean and sample standard deviation (n - 1; 0 for one seed) over seeds, per (variant, fraction)."""
    groups = collections.defaultdict(list)
    for r in runs:
        groups[(r["variant"], r["fraction"])].append(r)
    rows = []
    for (variant, fraction), rs in groups.items():
        row = {"variant": variant, "fraction": fraction, "seeds": len(rs), "sentences": rs[0]["train_sentences"]}
        for k in ("dev_acc", "test_acc", "seconds"):
            v = np.array([r[k] for r in rs], float)
            row[k] = float(v.mean())
            row[k + "_std"] = float(v.std(ddof=1)) if len(v) > 1 else 0.0
        rows.append(row)
    return rows


def markdown(summary: list[dict], settings: dict, source: str) -> str:
    lines = [
        f"POS tagging, Brown corpus, 12 universal tags, ELMo features from {source}. Accuracy (%) over all "
        f"tokens, punctuation included; mean ± sample sd over {len(settings['seeds'])} seed(s); dev-best "
        f"params scored on test. Tagger: word emb. 100 + ELMo part -> biLSTM {settings['hidden']}/direction; "
        f"{settings['epochs']} epoch(s) at 100 %, smaller fractions >= {settings['min_share']:g}x as many steps.",
        "",
        "| variant | % train | sentences | dev acc | test acc | seconds/run | seeds |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in summary:
        lines.append(
            f"| {r['variant']} | {100 * r['fraction']:g} | {r['sentences']} | "
            f"{100 * r['dev_acc']:.2f} ± {100 * r['dev_acc_std']:.2f} | "
            f"{100 * r['test_acc']:.2f} ± {100 * r['test_acc_std']:.2f} | {r['seconds']:.0f} | {r['seeds']} |"
        )
    return "\n".join(lines) + "\n"


def plot(summary: list[dict], path: str) -> None:
    """Test accuracy vs % of training sentences (log x), error bars = sd over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    from elmo_jax._util.atomic import atomic_path

    fig, ax = plt.subplots(figsize=(5, 3.6))
    for variant, label in (("words", "word embeddings only"), ("elmo", "word emb. + ELMo (learned mix)")):
        rs = sorted((r for r in summary if r["variant"] == variant), key=lambda r: r["fraction"])
        if rs:
            ax.errorbar(
                [100 * r["fraction"] for r in rs],
                [100 * r["test_acc"] for r in rs],
                yerr=[100 * r["test_acc_std"] for r in rs],
                marker="o",
                capsize=3,
                label=label,
            )
    ax.set_xscale("log")
    ax.set_xticks(sorted({100 * r["fraction"] for r in summary}))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    ax.set_xlabel("% of training sentences (log scale)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("Brown POS (universal tags): sample efficiency")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)


def reused_runs(args, settings: dict) -> list[dict]:
    """The runs of ``--reuse-variants`` from ``--reuse``, a grid run with the same settings: the
    word-only tagger never reads the biLM's features, so a new biLM need not retrain it."""
    if not args.reuse_variants:
        return []
    if not args.reuse:
        raise Fail("--reuse-variants needs --reuse RESULTS.json")
    with open(args.reuse, encoding="utf-8") as f:
        old = json.load(f)
    if old["settings"] != json.loads(json.dumps(settings)):
        raise Fail(f"{args.reuse}: its grid settings differ from this one's ({old['settings']} against {settings})")
    if set(args.reuse_variants) - {"words"}:
        raise Fail(f"--reuse-variants: only 'words' does not depend on the biLM, found {args.reuse_variants}")
    runs = [run for run in old["runs"] if run["variant"] in args.reuse_variants]
    print(f"reused {len(runs)} run(s) of {' '.join(args.reuse_variants)} from {args.reuse}")
    return runs


def cmd_grid(args) -> None:
    if any(not 0 < f <= 1 for f in args.fractions):
        raise Fail(f"--fractions must be in (0, 1], found {args.fractions}")
    args.buckets = BUCKETS
    if args.quick:  # seconds, not minutes: few sentences, a tiny tagger, one padded length (one compile)
        args.max_sentences = args.max_sentences or 120
        args.epochs, args.hidden, args.evals, args.batch_tokens, args.buckets = 2, 16, 2, 256, ()
    splits, meta, config = load_features(args.features, args.data_dir, args.max_sentences)
    n_layers = config.n_output_layers
    known = ["words", "elmo"] + [f"layer{k}" for k in range(n_layers)]
    variants = args.variants or known
    if set(variants) - set(known):
        raise Fail(f"unknown variant(s) {sorted(set(variants) - set(known))}: use {' '.join(known)}")
    n_words = len(build_vocab(splits["train"]["words"])) + 2  # every subset's vocabulary fits in the full one's
    settings = {
        k: getattr(args, k)
        for k in (
            "seeds",
            "fractions",
            "epochs",
            "min_share",
            "hidden",
            "dropout",
            "lr",
            "batch_tokens",
            "evals",
            "max_sentences",
        )
    }
    settings.update(word_dim=100, vocab_rows=n_words, lowercase=True, min_count=2)
    features = {k: v for k, v in meta.items() if k != "model"}
    source = f"{meta['run_dir']} step {meta['step']}" if "run_dir" in meta else meta.get("weights", "?")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    runs, start = reused_runs(args, settings), time.perf_counter()
    compiled = {}
    for variant in variants:
        if any(run["variant"] == variant for run in runs):
            continue
        kind = variant if variant in ("words", "elmo") else "layer"
        if kind not in compiled:
            compiled[kind] = make_functions(make_model(kind, n_words, config, args.hidden, args.dropout), args.lr)
        fns = compiled[kind]
        # The curve is words vs elmo; single layers only at the largest fraction (100 % by default).
        for fraction in args.fractions if variant in ("words", "elmo") else [max(args.fractions)]:
            for seed in args.seeds:
                run = train_run(variant, fraction, seed, splits, fns, n_layers, args)
                runs.append(run)
                print(
                    f"{variant:7s} {100 * fraction:5g}% seed {seed}: dev {100 * run['dev_acc']:.2f}  "
                    f"test {100 * run['test_acc']:.2f}  (best step {run['best_step']}/{run['steps']}, "
                    f"{run['epochs']:g} epochs, {run['seconds']:.0f} s)",
                    flush=True,
                )
                write_json_atomic(
                    args.out,
                    {
                        "settings": settings,
                        "features": features,
                        "summary": summarize(runs),
                        "runs": runs,
                        "total_seconds": round(time.perf_counter() - start, 1),
                    },
                )
    summary = summarize(runs)
    table = markdown(summary, settings, source)
    base = os.path.splitext(args.out)[0]
    md_path, png_path = base + ".md", base + "_sample_efficiency.png"
    from elmo_jax._util.atomic import write_text_atomic

    write_text_atomic(md_path, table)
    plot(summary, png_path)
    print(table)
    print(f"wrote {args.out}, {md_path}, {png_path} ({time.perf_counter() - start:.0f} s)")


# ------------------------------------------------------------------------------------------ main


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    f = sub.add_parser("features", help="embed train/dev/test once with the frozen biLM")
    model = f.add_mutually_exclusive_group(required=True)
    model.add_argument("--run-dir", help="an elmo_jax pretraining run (its newest checkpoint)")
    model.add_argument("--options", help="bilm-tf options.json (with --weights)")
    f.add_argument("--weights", help="bilm-tf weights.hdf5 (with --options)")
    f.add_argument("--data-dir", default="experiments/data/brown")
    f.add_argument("--out", default="experiments/data/pos_features")
    f.add_argument("--chunk", type=int, default=4000, help="sentences per embed() call (bounds memory)")
    f.add_argument("--no-token-cache", action="store_true", help="run the char CNN per batch, not once per word")
    g = sub.add_parser("grid", help="train the taggers on cached features")
    g.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    g.add_argument("--fractions", type=float, nargs="+", default=[0.01, 0.1, 1.0])
    g.add_argument("--variants", nargs="+", help="default: words elmo layer0 layer1 layer2")
    g.add_argument("--reuse", help="an earlier grid's results JSON, for --reuse-variants")
    g.add_argument("--reuse-variants", nargs="+", choices=["words"], help="take these runs from --reuse, not retrain")
    g.add_argument("--data-dir", default="experiments/data/brown")
    g.add_argument("--features", default="experiments/data/pos_features")
    g.add_argument("--out", default="experiments/results/pos.json", help="also writes <out>.md and a PNG beside it")
    g.add_argument("--epochs", type=int, default=1, help="epochs at 100 %% (smaller fractions: see --min-share)")
    g.add_argument("--min-share", type=float, default=0.5, help="every run takes >= this x the steps of a 100 %% run")
    g.add_argument("--hidden", type=int, default=64, help="LSTM units per direction")
    g.add_argument("--dropout", type=float, default=0.3, help="on word embeddings, the ELMo part and the biLSTM output")
    g.add_argument("--lr", type=float, default=4e-3, help="Adam learning rate (constant)")
    g.add_argument("--batch-tokens", type=int, default=2048, help="padded tokens per training batch")
    g.add_argument("--eval-tokens", type=int, default=8192, help="padded tokens per evaluation batch")
    g.add_argument("--evals", type=int, default=4, help="dev evaluations per run, evenly spaced in steps")
    g.add_argument("--max-sentences", type=int, help="use only the first N sentences of each split")
    g.add_argument("--quick", action="store_true", help="smoke test: 120 sentences a split, tiny tagger, 2 epochs")
    args = ap.parse_args(argv)
    if args.command == "features" and bool(args.options) != bool(args.weights):
        ap.error("--options and --weights go together")
    if args.command == "grid" and (args.evals < 1 or args.epochs < 1 or (args.max_sentences or 1) < 1):
        ap.error("--evals, --epochs and --max-sentences must be >= 1")
    try:
        cmd_features(args) if args.command == "features" else cmd_grid(args)
    except Fail as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
