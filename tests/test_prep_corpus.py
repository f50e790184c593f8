"""experiments/prep_corpus.py on small stand-ins for the fetched packages, built here."""

import io
import json
import pathlib
import struct
import tarfile
import zipfile
import zlib

import prep_corpus
import pytest

from elmo_jax.config import Options
from elmo_jax.model.vocabulary import Vocabulary


def _tar(path: pathlib.Path, files: dict[str, str]) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode("utf-8")
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _zText(module: pathlib.Path, testament: str, verses: list[str], per_block: int = 2) -> None:
    """A SWORD zText testament: verses packed ``per_block`` to a zlib block."""
    module.mkdir(parents=True, exist_ok=True)
    bzs, bzv, bzz = b"", b"", b""
    for b in range(0, len(verses), per_block):
        raw, offsets = b"", []
        for v in verses[b : b + per_block]:
            data = v.encode("utf-8")
            offsets.append((len(raw), len(data)))
            raw += data
        packed = zlib.compress(raw)
        bzs += struct.pack("<III", len(bzz), len(packed), len(raw))
        bzz += packed
        bzv += b"".join(struct.pack("<IIH", b // per_block, o, n) for o, n in offsets)
    for ext, data in (("bzs", bzs), ("bzv", bzv), ("bzz", bzz)):
        (module / f"{testament}.{ext}").write_bytes(data)


BROWN = {
    # last digit 0 -> train, 8 -> dev, 9 -> test
    "package/ca10": "\n\tThe/at Fulton/np-tl jury/nn said/vbd ``/`` no/at ''/'' ./.\n\n\tIt/pps ended/vbd ./.\n",
    "package/ca18": "\n\tA/at dev/nn sentence/nn ./.\n",
    "package/ca19": "\n\tIt/pps ended/vbd ./.\n\tMonday/nr-tl came/vbd ./.\n",
}
TAG_MAP = "AT\tDET\nNP\tNOUN\nNP-TL\tNOUN\nNN\tNOUN\nVBD\tVERB\n``\t.\n''\t.\n.\t.\nPPS\tPRON\nNR\tNOUN\n"


@pytest.fixture()
def fake_packages(tmp_path):
    cache, web = tmp_path / "cache", tmp_path / "web"
    cache.mkdir()
    sotu = {
        f"package/data/{year}_someone_party.json": json.dumps(
            {
                "year": year,
                "name": "x",
                "party": "y",
                "text": f"Address of {year}. We met the Congress. (Applause.) The year was good.",
            }
        )
        for year in (1944, 1950, 1955)
    }
    _tar(cache / prep_corpus.SOTU_TARBALL, sotu)
    _tar(cache / prep_corpus.BROWN_TARBALL, BROWN)
    nlp = [f"Sentence number {i} is here." for i in range(40)] + ["We met the Congress."]
    _tar(
        cache / prep_corpus.NLP_TARBALL,
        {"package/builds/doc-0.json": json.dumps(nlp[:20]), "package/builds/doc-1.json": json.dumps(nlp[20:])},
    )
    with zipfile.ZipFile(cache / prep_corpus.SELKIE_WHEEL, "w") as z:
        z.writestr(prep_corpus.TAG_MAP_MEMBER, TAG_MAP)
    books = []
    for b in range(1, 7):  # book 5 is held out
        books.append(f'<div osisID="B{b}" sID="g{b}" type="book"/><title type="main">Book {b}</title>')
        books.append(f'<chapter n="1" osisID="B{b}.1" sID="B{b}.1"/>')
        # Non-ASCII text before a verse boundary: offsets in the index count bytes.
        books.append(f'<w lemma="strong:G1">Café</w> naïve verse of book {b}.<note placement="foot">a note</note>')
        books.append(f"Another verse of book {b}, with “quotes”.")
    _zText(web / prep_corpus.WEB_MODULE, "nt", books)
    return cache, web, tmp_path / "out"


def test_prep_writes_disjoint_splits_vocab_options_and_tags(fake_packages, monkeypatch, capsys):
    cache, web, out = fake_packages
    monkeypatch.setattr(prep_corpus, "SOTU_MIN_YEAR", 1945)
    monkeypatch.setattr(prep_corpus, "MIN_COUNT", 1)
    monkeypatch.setattr(prep_corpus, "SHARD_LINES", 7)
    assert prep_corpus.main(["--cache-dir", str(cache), "--web-dir", str(web), "--out", str(out)]) == 0

    shards = sorted((out / "lm" / "train").glob("shard-*.txt"))
    assert len(shards) > 1
    train = [line for s in shards for line in s.read_text().splitlines()]
    heldout = (out / "lm" / "heldout.txt").read_text().splitlines()
    assert len(train) == len(set(train)) and len(heldout) == len(set(heldout))  # deduplicated
    assert not set(train) & set(heldout)
    # SOTU: 1944 is before the first year, 1955 is held out, 1950 is train; the repeated
    # sentence is kept once (train), the stage direction removed.
    assert "Address of 1950 ." in train and "Address of 1955 ." in heldout
    assert not any("1944" in line for line in train + heldout)
    assert train.count("We met the Congress .") == 1 and "We met the Congress ." not in heldout
    assert not any("Applause" in line for line in train)
    # nlp-corpus: every 20th sentence is held out.
    assert "Sentence number 19 is here ." in heldout and "Sentence number 18 is here ." in train
    # Bible: markup and notes gone, byte offsets decoded right, book 5 held out.
    assert "Café naïve verse of book 2 ." in train
    assert 'Another verse of book 5 , with " quotes " .' in heldout
    assert not any("<" in line or "note" in line for line in train + heldout)
    # Brown: train text in pretraining (quotes normalised); dev and test sentences never, even when
    # a train file has the same sentence ("It ended .").
    assert 'The Fulton jury said " no " .' in train
    assert "A dev sentence ." not in train + heldout and "It ended ." not in train + heldout

    vocab = Vocabulary.load(out / "lm" / "vocab.txt")
    options = Options.load(out / "lm" / "options.json")
    assert options.train.n_tokens_vocab == len(vocab)
    assert options.train.n_train_tokens == sum(len(line.split()) for line in train)

    brown = {k: (out / "brown" / f"{k}.txt").read_text().splitlines() for k in ("train", "dev", "test")}
    assert brown["train"][0] == 'The/DET Fulton/NOUN jury/NOUN said/VERB "/. no/DET "/. ./.'
    assert brown["test"] == ["It/PRON ended/VERB ./.", "Monday/NOUN came/VERB ./."]  # nr-tl -> NR
    stats = json.loads((out / "stats.json").read_text())
    assert stats["brown"]["test"] == {"sentences": 2, "tokens": 6}
    assert "pretraining text:" in capsys.readouterr().out


def test_unmapped_brown_tag_is_a_one_line_error(fake_packages):
    cache, web, out = fake_packages
    _tar(cache / prep_corpus.BROWN_TARBALL, {"package/ca10": "\n\tThe/at odd/zz ./.\n"})
    with pytest.raises(SystemExit) as e:
        prep_corpus.main(["--cache-dir", str(cache), "--web-dir", str(web), "--out", str(out)])
    assert str(e.value) == f"prep_corpus: {prep_corpus.BROWN_TARBALL}:package/ca10:2: tag 'zz' is not in en-brown.map"


def test_missing_package_names_the_fetch_script(tmp_path):
    with pytest.raises(SystemExit) as e:
        prep_corpus.main(["--cache-dir", str(tmp_path), "--web-dir", str(tmp_path), "--out", str(tmp_path / "o")])
    assert "run `bash experiments/fetch_data.sh` first" in str(e.value)
