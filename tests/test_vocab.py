"""Vocabulary building (elmo_jax.text.vocab): counting, ordering, writing, the sidecar."""

import collections
import json
import os

import pytest
from helpers import FIXTURES

from elmo_jax.config import ConfigError, Options
from elmo_jax.model.vocabulary import VocabError, Vocabulary
from elmo_jax.text.sources import DataError, Lines, TextFiles
from elmo_jax.text.vocab import build_vocab, count_tokens, read_vocab_meta, write_vocab
from elmo_jax.training.setup import _config_keys

SPECIALS = ["<S>", "</S>", "<UNK>"]


@pytest.fixture
def corpus(tmp_path):
    """Three shards. Counts: the 3, cat 2, dog 2, then 1 each: <S> Zebra a apple sat zebra."""
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "a.txt").write_text("the cat sat\nthe dog\n", encoding="utf-8")
    (d / "b.txt").write_text("\n   \na cat <S> the\n", encoding="utf-8")  # blank lines are no sentences
    (d / "c.txt").write_text("dog zebra apple Zebra", encoding="utf-8")  # no final newline
    return d


# Ties in Python string order: uppercase before lowercase, a prefix before its extensions.
EXPECTED = SPECIALS + ["the", "cat", "dog", "Zebra", "a", "apple", "sat", "zebra"]


def test_count_tokens(corpus):
    counts, n_tokens, n_sentences = count_tokens(TextFiles(str(corpus / "*.txt")))
    assert counts == collections.Counter(the=3, cat=2, dog=2, sat=1, a=1, zebra=1, apple=1, Zebra=1, **{"<S>": 1})
    assert n_tokens == 3 + 2 + 4 + 4 == 13
    assert n_sentences == 4


def test_order_and_tie_breaking(corpus):
    counts, _, _ = count_tokens(TextFiles(str(corpus / "*.txt")))
    assert build_vocab(counts) == EXPECTED


def test_order_does_not_depend_on_insertion_order():
    words = ["b", "a", "c", "bb", "B", "x"]
    counts = {w: (2 if w == "x" else 1) for w in words}
    expected = SPECIALS + ["x", "B", "a", "b", "bb", "c"]
    assert build_vocab(counts) == expected
    assert build_vocab(dict(reversed(list(counts.items())))) == expected
    assert build_vocab(collections.Counter(counts)) == expected


def test_min_count(corpus):
    counts, _, _ = count_tokens(TextFiles(str(corpus / "*.txt")))
    assert build_vocab(counts, min_count=1) == EXPECTED
    assert build_vocab(counts, min_count=2) == SPECIALS + ["the", "cat", "dog"]
    assert build_vocab(counts, min_count=3) == SPECIALS + ["the"]
    # No word that often: a vocabulary of the markers alone would train nothing (before: written, silently).
    with pytest.raises(
        VocabError, match=r"^min_count 4: no word is counted that often \(the most frequent, 3 times\)$"
    ):
        build_vocab(counts, min_count=4)
    assert build_vocab(counts, min_count=4, extend=[*SPECIALS, "zebra"]) == SPECIALS + ["zebra"]  # old words kept


def test_max_size_counts_the_specials(corpus):
    counts, _, _ = count_tokens(TextFiles(str(corpus / "*.txt")))
    assert build_vocab(counts, max_size=4) == SPECIALS + ["the"]
    assert build_vocab(counts, max_size=6) == SPECIALS + ["the", "cat", "dog"]
    assert build_vocab(counts, max_size=len(EXPECTED)) == EXPECTED
    assert build_vocab(counts, max_size=1000) == EXPECTED
    assert build_vocab(counts, min_count=2, max_size=5) == SPECIALS + ["the", "cat"]


def test_max_size_with_extend_caps_the_new_words_and_keeps_every_old_one(corpus):
    """(Before: the old words not in the text sorted last and were cut first, against extend's promise.)"""
    counts, _, _ = count_tokens(TextFiles(str(corpus / "*.txt")))
    old = [*SPECIALS, "zebra", "dog"]  # zebra is not in the text
    assert build_vocab(counts, max_size=6, extend=old) == SPECIALS + ["the", "dog", "zebra"]
    assert build_vocab(counts, max_size=5, extend=old) == SPECIALS + ["dog", "zebra"]
    with pytest.raises(VocabError, match="max_size 4 is smaller than extend's 2 words and the 3 specials"):
        build_vocab(counts, max_size=4, extend=old)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"min_count": 0}, "min_count must be an integer >= 1"),
        ({"min_count": -3}, "min_count"),
        ({"min_count": 1.5}, "min_count"),
        ({"max_size": 3}, "max_size must be an integer >= 4"),
        ({"max_size": 0}, "max_size"),
        ({"max_size": 10.0}, "max_size"),
    ],
)
def test_invalid_arguments(kwargs, match):
    with pytest.raises(VocabError, match=match):
        build_vocab({"a": 1}, **kwargs)


def test_build_vocab_given_text_for_its_counts_says_what_gives_them():
    """(Before: AttributeError "'Lines' object has no attribute 'items'".)"""
    with pytest.raises(
        TypeError, match=r"^counts is a Lines; expected a mapping of word to count: elmo_jax.count_tokens"
    ):
        build_vocab(Lines(["a b a"]))  # type: ignore[arg-type]
    assert build_vocab(count_tokens(Lines(["a b a"]))[0]) == ["<S>", "</S>", "<UNK>", "a", "b"]


def test_specials_in_text_first_and_once(tmp_path):
    # The specials are the most frequent "words" here, and <UNK> would sort before them by count.
    (tmp_path / "s.txt").write_text("<UNK> <UNK> <UNK> <S> x </S>\n<UNK> <S> </S> y x\n", encoding="utf-8")
    files = TextFiles(str(tmp_path / "s.txt"))
    counts, n_tokens, n_sentences = count_tokens(files)
    assert counts["<UNK>"] == 4 and counts["<S>"] == 2 and counts["</S>"] == 2  # counted like words
    assert n_tokens == 11 and n_sentences == 2
    words = build_vocab(counts)
    assert words == SPECIALS + ["x", "y"]
    assert build_vocab(counts, max_size=4) == SPECIALS + ["x"]
    write_vocab(words, tmp_path / "vocab.txt", n_tokens, n_sentences, files)
    vocab = Vocabulary.load(tmp_path / "vocab.txt")
    assert (vocab.bos, vocab.eos, vocab.unk) == (0, 1, 2)


def test_write_sidecar_and_load(corpus, tmp_path):
    files = TextFiles(str(corpus / "*.txt"))
    counts, n_tokens, n_sentences = count_tokens(files)
    words = build_vocab(counts)
    path = tmp_path / "out" / "vocab.txt"  # the directory is created
    write_vocab(words, path, n_tokens, n_sentences, files)

    assert path.read_bytes() == ("\n".join(EXPECTED) + "\n").encode("utf-8")
    vocab = Vocabulary.load(path, lm=True)
    assert vocab.words == EXPECTED
    assert (vocab.bos, vocab.eos, vocab.unk) == (0, 1, 2)
    assert list(vocab.encode(["the", "zebra", "giraffe"])) == [3, 10, 2]

    meta = read_vocab_meta(path)
    assert meta == json.loads((tmp_path / "out" / "vocab.txt.json").read_text(encoding="utf-8"))
    # 4 sentences of 3, 2, 4 and 4 words: 13 tokens, 13 + 4 = 17 (input, target) pairs per direction.
    assert meta["n_tokens"] == 13
    assert meta["n_sentences"] == 4
    assert meta["n_train_tokens"] == 17
    assert meta["n_words"] == 11
    assert meta["files"] == [str(corpus / n) for n in ("a.txt", "b.txt", "c.txt")]
    assert sorted(os.listdir(tmp_path / "out")) == ["vocab.txt", "vocab.txt.json"]  # no temp files


def test_write_accepts_file_names_and_overwrites(tmp_path):
    path = tmp_path / "vocab.txt"
    write_vocab(SPECIALS + ["old"], path, 1, 1, ["x.txt"])
    write_vocab(SPECIALS + ["naïve", "東京"], path, 5, 2, ["a.txt", "b.txt"])
    assert Vocabulary.load(path).words == SPECIALS + ["naïve", "東京"]
    meta = read_vocab_meta(path)
    assert (meta["n_train_tokens"], meta["n_words"], meta["files"]) == (7, 5, ["a.txt", "b.txt"])
    assert sorted(os.listdir(tmp_path)) == ["vocab.txt", "vocab.txt.json"]


@pytest.mark.parametrize(
    "words, match",
    [
        (SPECIALS + ["a", "a"], "duplicate"),
        (["<S>", "</S>", "a"], "must contain"),
        (SPECIALS + ["two words"], "single whitespace-free token"),
        (SPECIALS + [""], "single whitespace-free token"),
        (SPECIALS + ["tab\t"], "single whitespace-free token"),
    ],
)
def test_write_rejects_unloadable_words(tmp_path, words, match):
    with pytest.raises(VocabError, match=match):
        write_vocab(words, tmp_path / "vocab.txt", 1, 1, [])
    assert os.listdir(tmp_path) == []


def test_glob_matching_nothing(tmp_path):
    with pytest.raises(DataError, match="no files match"):
        count_tokens(TextFiles(str(tmp_path / "nothing-*.txt")))


def test_empty_files(tmp_path):
    (tmp_path / "e1.txt").write_bytes(b"")
    (tmp_path / "e2.txt").write_bytes(b"\n \n\t\n")
    with pytest.raises(DataError, match=r"no tokens in .*e1\.txt, .*e2\.txt"):
        count_tokens(TextFiles(str(tmp_path / "e*.txt")))


def test_sentences_in_a_list_are_counted_as_pretrain_and_evaluate_take_them():
    """A list of str was an AttributeError ('list' object has no attribute 'read'); a path given
    as a str is refused in one line (its letters would be counted as sentences)."""
    assert count_tokens(["a b", "b c", " "]) == count_tokens(Lines(["a b", "b c", " "]))
    assert count_tokens(["a b", "b c"])[1:] == (4, 2)
    with pytest.raises(TypeError, match=r"^files is a str; expected sentences: TextFiles\(glob\) for files"):
        count_tokens("corpus.txt")


def test_non_utf8_line_skipped_with_warning(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"good words\nbroken \xff\xfe line\nmore good words here\n")
    with pytest.warns(UserWarning, match=r"bad\.txt: line 2: skipped, not UTF-8"):
        counts, n_tokens, n_sentences = count_tokens(TextFiles(str(bad)))
    assert (n_tokens, n_sentences) == (6, 2)
    assert counts == collections.Counter(good=2, words=2, more=1, here=1)


def test_long_line(tmp_path):
    words = [f"w{i % 100}" for i in range(10_000)]
    (tmp_path / "long.txt").write_text(" ".join(words) + "\nshort line\n", encoding="utf-8")
    counts, n_tokens, n_sentences = count_tokens(TextFiles(str(tmp_path / "long.txt")))
    assert (n_tokens, n_sentences) == (10_002, 2)
    assert counts["w0"] == counts["w99"] == 100 and len(counts) == 102


def _write_old(path):
    write_vocab(SPECIALS + ["old"], path, 10, 2, ["old.txt"])
    return path.read_bytes(), (path.parent / "vocab.txt.json").read_bytes()


def test_failed_write_keeps_old_files(tmp_path, monkeypatch):
    path = tmp_path / "vocab.txt"
    old_vocab, old_meta = _write_old(path)

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        write_vocab(SPECIALS + ["new", "words"], path, 100, 20, ["new.txt"])
    monkeypatch.undo()
    assert path.read_bytes() == old_vocab
    assert (tmp_path / "vocab.txt.json").read_bytes() == old_meta
    assert sorted(os.listdir(tmp_path)) == ["vocab.txt", "vocab.txt.json"]  # no temp file left
    assert read_vocab_meta(path)["files"] == ["old.txt"]


def test_failed_sidecar_write_is_noticed(tmp_path, monkeypatch):
    path = tmp_path / "vocab.txt"
    _write_old(path)
    real_replace, calls = os.replace, []

    def second_fails(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError("disk full")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", second_fails)
    with pytest.raises(OSError, match="disk full"):
        write_vocab(SPECIALS + ["new"], path, 100, 20, ["new.txt"])
    monkeypatch.undo()
    assert Vocabulary.load(path).words == SPECIALS + ["new"]
    assert sorted(os.listdir(tmp_path)) == ["vocab.txt", "vocab.txt.json"]
    # The old sidecar describes other data: not returned.
    with pytest.warns(UserWarning, match="does not match"):
        assert read_vocab_meta(path) is None


def test_read_vocab_meta_missing_and_malformed(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(SPECIALS) + "\n", encoding="utf-8")
    assert read_vocab_meta(path) is None
    (tmp_path / "vocab.txt.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(VocabError, match="sidecar"):
        read_vocab_meta(path)
    (tmp_path / "vocab.txt.json").write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(VocabError, match="JSON object"):
        read_vocab_meta(path)
    # A hand-written sidecar without a checksum is taken as it is.
    (tmp_path / "vocab.txt.json").write_text('{"n_train_tokens": 5}', encoding="utf-8")
    assert read_vocab_meta(path) == {"n_train_tokens": 5}


def test_the_vocab_command_counts_the_markers_the_text_s_words_and_the_kept_old_ones(tmp_path, capsys):
    """(Before, with --extend: "17740 tokens (of 2679 distinct)", more kept than there were.)"""
    from elmo_jax.cli import commands

    (tmp_path / "t.txt").write_text("a a b\na c\n")
    (tmp_path / "old.txt").write_text("<S>\n</S>\n<UNK>\nb\nzzz\nqqq\n")
    argv = ["vocab", "--train-files", str(tmp_path / "t.txt"), "--out", str(tmp_path / "v.txt"), "--min-count", "2"]
    assert commands.main([*argv, "--extend", str(tmp_path / "old.txt")]) == 0
    said = capsys.readouterr().out.strip()
    assert said == (
        f"{tmp_path / 'v.txt'}: 7 entries: the 3 markers, 1 of the text's 3 distinct words, 3 more of "
        f"{tmp_path / 'old.txt'}; 5 tokens, 2 sentences, 1 shard(s)"
    )
    assert len((tmp_path / "v.txt").read_text().split()) == 7
    # One of each is said so (before: "1 tokens, 1 sentences").
    (tmp_path / "one.txt").write_text("a\n")
    assert commands.main(["vocab", "--train-files", str(tmp_path / "one.txt"), "--out", str(tmp_path / "w.txt")]) == 0
    assert capsys.readouterr().out.strip().endswith("; 1 token, 1 sentence, 1 shard(s)")


@pytest.mark.parametrize("named", ["as counted", "through a link"])
def test_an_output_that_is_a_counted_file_is_refused_and_the_text_kept(tmp_path, capsys, named):
    """``--out`` named like ``--train-files`` replaced the corpus with its own vocabulary."""
    from elmo_jax.cli import commands

    text = tmp_path / "t.txt"
    text.write_text("a a b\na c\n")
    out = text if named == "as counted" else tmp_path / "link.txt"
    if out != text:
        out.symlink_to(text)
    assert commands.main(["vocab", "--train-files", str(text), "--out", str(out)]) == 2
    also = "" if out == text else f" ({text})"
    assert (
        capsys.readouterr().err == f"elmo-jax vocab: error: {out}: is a text file counted{also}; give another --out\n"
    )
    with pytest.raises(DataError, match=r"is a text file counted.*; give another path$"):
        write_vocab(SPECIALS + ["a"], out, 5, 2, TextFiles(str(text)))
    assert text.read_text() == "a a b\na c\n" and sorted(os.listdir(tmp_path)) == sorted({"t.txt", out.name})


def test_an_output_that_is_a_runs_vocabulary_is_refused(tmp_path, capsys):
    """A run's vocab.txt names its softmax's rows: another one there makes eval and export refuse the run."""
    from elmo_jax.cli import commands

    (tmp_path / "t.txt").write_text("a a b\n")
    run = tmp_path / "run"
    (run / "checkpoints" / "3").mkdir(parents=True)
    (run / "vocab.txt").write_text("<S>\n</S>\n<UNK>\nold\n")
    assert commands.main(["vocab", "--train-files", str(tmp_path / "t.txt"), "--out", str(run / "vocab.txt")]) == 2
    assert capsys.readouterr().err == (
        f"elmo-jax vocab: error: --out {run / 'vocab.txt'}: is the vocabulary of the run in {run}, which its "
        "checkpoints were trained with; give another path\n"
    )
    assert (run / "vocab.txt").read_text() == "<S>\n</S>\n<UNK>\nold\n"
    (run / "checkpoints" / "3").rmdir()  # a run set up and untrained (--steps 0): no checkpoint yet
    assert commands.main(["vocab", "--train-files", str(tmp_path / "t.txt"), "--out", str(run / "vocab.txt")]) == 0
    assert commands.main(["vocab", "--train-files", str(tmp_path / "t.txt"), "--out", str(tmp_path / "vocab.txt")]) == 0


@pytest.mark.parametrize("flag, value", [("--min-count", "0"), ("--max-size", "2")])
def test_the_vocab_command_refuses_its_numbers_before_the_count(tmp_path, capsys, monkeypatch, flag, value):
    """The count reads the whole corpus, minutes on a large one: a typo is said before it."""
    from elmo_jax.cli import commands
    from elmo_jax.text import vocab

    counted = []
    monkeypatch.setattr(vocab, "count_tokens", lambda *a, **k: counted.append(a))
    (tmp_path / "t.txt").write_text("a a b\n")
    argv = ["vocab", "--train-files", str(tmp_path / "t.txt"), "--out", str(tmp_path / "v.txt"), flag, value]
    assert commands.main(argv) == 2
    assert counted == [] and f"error: {flag} must be an integer >= " in capsys.readouterr().err


BOM = b"\xef\xbb\xbf"  # U+FEFF in UTF-8: what Windows editors put at the start of a text file


def test_a_byte_order_mark_is_no_part_of_the_first_word_of_text_or_vocabulary_or_options(tmp_path):
    """Kept, the mark would join the first word: ``\\ufeffthe``, another vocabulary entry."""
    text = b"the cat sat\non the mat\n"
    (tmp_path / "plain.txt").write_bytes(text)
    (tmp_path / "marked.txt").write_bytes(BOM + text)
    plain, marked = (count_tokens(TextFiles(str(tmp_path / f"{n}.txt")))[0] for n in ("plain", "marked"))
    assert marked == plain and plain["the"] == 2, marked
    # Negative control: the mark is there to be dropped (a line split off its file keeps it).
    assert (tmp_path / "marked.txt").read_bytes().decode("utf-8").split()[0] == "\ufeffthe"

    words = "<S>\n</S>\n<UNK>\nthe\n"
    (tmp_path / "v.txt").write_bytes(BOM + words.encode())
    assert Vocabulary.load(tmp_path / "v.txt").words == ["<S>", "</S>", "<UNK>", "the"]

    (tmp_path / "options.json").write_bytes(BOM + (FIXTURES / "allennlp_elmo" / "options.json").read_bytes())
    assert Options.load(tmp_path / "options.json") == Options.load(FIXTURES / "allennlp_elmo" / "options.json")
    # train --config reads which keys the file sets itself, to let them override the preset's.
    keys = _config_keys(str(FIXTURES / "allennlp_elmo" / "options.json"))
    assert keys and _config_keys(str(tmp_path / "options.json")) == keys


def test_utf16_text_is_said_to_be_utf16(tmp_path):
    (tmp_path / "v.txt").write_text("<S>\n</S>\n<UNK>\n", encoding="utf-16")
    with pytest.raises(VocabError, match=r"v.txt: line 1: not UTF-8 \(.*\); it starts as UTF-16 text does: convert"):
        Vocabulary.load(tmp_path / "v.txt")
    # Negative control: other bytes that are not UTF-8 get no such guess.
    (tmp_path / "v.txt").write_bytes(b"<S>\xff\n</S>\n<UNK>\n")
    with pytest.raises(VocabError, match=r"line 1: not UTF-8 \([^)]*\)$"):
        Vocabulary.load(tmp_path / "v.txt")
    # An options.json too (before: not UTF-8 alone).
    options = FIXTURES / "allennlp_elmo" / "options.json"
    (tmp_path / "o.json").write_text(options.read_text(), encoding="utf-16")
    with pytest.raises(ConfigError, match=r"o.json: not an options.json: not UTF-8 text \(.*\); it starts as UTF-16"):
        Options.load(tmp_path / "o.json")
    (tmp_path / "o.json").write_bytes(b"\xff" + options.read_bytes())
    with pytest.raises(ConfigError, match=r"not UTF-8 text \([^)]*\)$"):
        Options.load(tmp_path / "o.json")
