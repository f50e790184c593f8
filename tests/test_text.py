"""Sentence splitting and tokenization rules (elmo_jax.text.tokenize), and the bundled sample corpus."""

import os
import pathlib
import re

import pytest

from elmo_jax.text.tokenize import format_sentence, normalize_text, split_sentences, tokenize, tokenize_text

SAMPLE = pathlib.Path(__file__).resolve().parents[1] / "elmo_jax" / "data" / "sample"


# --- split_sentences ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("", []),
        ("   \n\n \t ", []),
        ("One. Two! Three? Four", ["One.", "Two!", "Three?", "Four"]),
        ("Really?! Yes... OK.", ["Really?!", "Yes...", "OK."]),
        ("It was 5 p.m. and late. we stayed.", ["It was 5 p.m. and late. we stayed."]),  # lowercase: no split
        ("It cost $1,000.50 in 2020. It rose.", ["It cost $1,000.50 in 2020.", "It rose."]),
        ("It rose in 1999. 2000 was worse.", ["It rose in 1999.", "2000 was worse."]),
    ],
)
def test_split_basic(text, expected):
    assert split_sentences(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "Mr. Smith met Mrs. Jones and Dr. Brown.",
        "Ms. Lee walked down St. James Street with Gen. Grant.",
        "Sen. Byrd and Gov. Brown and Lt. Dan agreed.",
        "The U.S. Senate and the U.N. Charter, e.g. Article 51.",
        "J. Edgar Hoover and John F. Kennedy spoke.",
        "See No. 5 and Vol. 3 on Jan. 20 this year.",
        "(Mr. Smith agreed.)",
    ],
)
def test_split_abbreviations(text):
    assert split_sentences(text) == [text]


def test_split_number_abbreviation_needs_a_digit():
    # "No." before a capital is the word "No", not "number".
    assert split_sentences("He said No. Then he left.") == ["He said No.", "Then he left."]
    # Words that merely end in an abbreviation's letters still end sentences.
    assert split_sentences("It was the best Dr. Who. Then it ended.") == ["It was the best Dr. Who.", "Then it ended."]
    assert split_sentences("Apples, pears, etc. The rest.") == ["Apples, pears, etc.", "The rest."]


def test_split_quotes_and_brackets():
    text = 'He said, "Stop." Then he left. "Why?" she asked. (Applause.) Thank you.'
    assert split_sentences(text) == [
        'He said, "Stop."',
        "Then he left.",
        '"Why?" she asked.',
        "(Applause.)",
        "Thank you.",
    ]
    curly = "He said, \u201cStop.\u201d \u201cWhy?\u201d \u2018Fine.\u2019 Done."
    assert split_sentences(curly) == ["He said, \u201cStop.\u201d", "\u201cWhy?\u201d", "\u2018Fine.\u2019", "Done."]


def test_split_line_breaks_and_whitespace():
    text = "  First line  without\tstop\nsecond line.\r\n\r\nThird\u00a0  para.\u2029Fourth "
    assert split_sentences(text) == ["First line without stop", "second line.", "Third para.", "Fourth"]


def test_split_unicode_capitals():
    assert split_sentences("Il est parti. \u00c9milie est restée.") == ["Il est parti.", "\u00c9milie est restée."]


# --- tokenize ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sentence, expected",
    [
        ("", []),
        ("   ", []),
        ("Hello world.", ["Hello", "world", "."]),
        (
            "Yes, no; maybe: (sure) [ok] {fine}!",
            ["Yes", ",", "no", ";", "maybe", ":", "(", "sure", ")", "[", "ok", "]", "{", "fine", "}", "!"],
        ),
        ("Why?", ["Why", "?"]),
    ],
)
def test_tokenize_punctuation(sentence, expected):
    assert tokenize(sentence) == expected


@pytest.mark.parametrize(
    "sentence, expected",
    [
        ("I don't know.", ["I", "do", "n't", "know", "."]),
        ("We can't, won't, shouldn't.", ["We", "ca", "n't", ",", "wo", "n't", ",", "should", "n't", "."]),
        (
            "It's what we're, they've, you'll, I'd, I'm.",
            [
                "It",
                "'s",
                "what",
                "we",
                "'re",
                ",",
                "they",
                "'ve",
                ",",
                "you",
                "'ll",
                ",",
                "I",
                "'d",
                ",",
                "I",
                "'m",
                ".",
            ],
        ),
        ("DON'T He'd've", ["DO", "N'T", "He", "'d", "'ve"]),
        ("The nation's and the U.S.'s role", ["The", "nation", "'s", "and", "the", "U.S.", "'s", "role"]),
        ("the states' rights", ["the", "states", "'", "rights"]),
        ("at o'clock O'Neill said", ["at", "o'clock", "O'Neill", "said"]),
        ("in the '90s 'tis 'em", ["in", "the", "'90s", "'tis", "'em"]),
    ],
)
def test_tokenize_clitics(sentence, expected):
    assert tokenize(sentence) == expected


@pytest.mark.parametrize(
    "sentence, expected",
    [
        (
            "It cost $1,000.50 or 3.5% more, 10:30 a.m.",
            ["It", "cost", "$", "1,000.50", "or", "3.5", "%", "more", ",", "10:30", "a.m.", "."],
        ),
        ("Count: 1,2,3 and 2,000,000 people", ["Count", ":", "1,2,3", "and", "2,000,000", "people"]),
        ("yes,no and ratio 3:1", ["yes", ",", "no", "and", "ratio", "3:1"]),
        ("In 1999.", ["In", "1999", "."]),
    ],
)
def test_tokenize_numbers(sentence, expected):
    assert tokenize(sentence) == expected


@pytest.mark.parametrize(
    "sentence, expected",
    [
        (
            "Mr. Smith of the U.S. Senate met Dr. Jones.",
            ["Mr.", "Smith", "of", "the", "U.S.", "Senate", "met", "Dr.", "Jones", "."],
        ),
        ("He lives in the U.S.", ["He", "lives", "in", "the", "U.S.", "."]),
        ("Apples, pears, etc.", ["Apples", ",", "pears", ",", "etc.", "."]),
        ("He works for Acme Inc. now", ["He", "works", "for", "Acme", "Inc.", "now"]),
        ("We chose plan B.", ["We", "chose", "plan", "B", "."]),
        # Abbreviations before a number (rule 4) are words at the end: before, "no. ." and "art. .".
        ("He said no.", ["He", "said", "no", "."]),
        ("It came in Jan.", ["It", "came", "in", "Jan", "."]),
        ("See No. 5 on p. 12 now.", ["See", "No.", "5", "on", "p.", "12", "now", "."]),
        ("Wait... what?", ["Wait", "...", "what", "?"]),
        ("Wait\u2026", ["Wait", "..."]),
    ],
)
def test_tokenize_abbreviations_and_periods(sentence, expected):
    assert tokenize(sentence) == expected


@pytest.mark.parametrize(
    "sentence, expected",
    [
        ('He said "Stop."', ["He", "said", '"', "Stop", ".", '"']),
        ("He said \u201cStop.\u201d", ["He", "said", '"', "Stop", ".", '"']),
        ("\u2018Hello,\u2019 he said.", ["'", "Hello", ",", "'", "he", "said", "."]),
        ("We can\u2019t \u201cwin\u201d", ["We", "ca", "n't", '"', "win", '"']),
        ("(It ended.)", ["(", "It", "ended", ".", ")"]),
    ],
)
def test_tokenize_quotes(sentence, expected):
    assert tokenize(sentence) == expected


@pytest.mark.parametrize(
    "sentence, expected",
    [
        ("peace--and war", ["peace", "--", "and", "war"]),
        ("peace -- and war", ["peace", "--", "and", "war"]),
        ("peace\u2014and war", ["peace", "--", "and", "war"]),
        ("peace \u2013 and war", ["peace", "--", "and", "war"]),
        ("peace\u2014\u2014and -\u2013 war", ["peace", "--", "and", "--", "war"]),
        ("from 1943\u20131948", ["from", "1943-1948"]),
        (
            "a well-known, long-term U.S.-Soviet 10-year plan",
            ["a", "well-known", ",", "long-term", "U.S.-Soviet", "10-year", "plan"],
        ),
        ("Al\u2011Baghdadi x - y", ["Al-Baghdadi", "x", "-", "y"]),
    ],
)
def test_tokenize_dashes_and_hyphens(sentence, expected):
    assert tokenize(sentence) == expected


def test_tokenize_unicode():
    assert tokenize("Nicol\u00e1s Maduro and na\u00efve Z\u00fcrich caf\u00e9s.") == [
        "Nicol\u00e1s",
        "Maduro",
        "and",
        "na\u00efve",
        "Z\u00fcrich",
        "caf\u00e9s",
        ".",
    ]
    # Decomposed accents are composed (NFC); soft hyphens and zero-width spaces are removed.
    assert tokenize("cafe\u0301 co\u00adoperate a\u200bb") == ["caf\u00e9", "cooperate", "ab"]
    assert tokenize("\u00a0Hi\u3000there\u00a0") == ["Hi", "there"]


def test_tokenize_takes_one_str_and_says_so():
    """(Before: unicodedata's "normalize() argument 2 must be str, not list".)"""
    with pytest.raises(TypeError, match=r"^sentence is a list; expected one str: \[tokenize\(s\) for s in sentences\]"):
        tokenize(["a b"])  # type: ignore[arg-type]
    assert [tokenize(s) for s in ["a b", "c."]] == [["a", "b"], ["c", "."]]
    # tokenize_text too (before: "'list' object has no attribute 'splitlines'").
    with pytest.raises(TypeError, match=r"^text is a list; expected one str"):
        tokenize_text(["a. b."])  # type: ignore[arg-type]
    assert tokenize_text("The cat sat. The dog ran.") == [["The", "cat", "sat", "."], ["The", "dog", "ran", "."]]


def test_tokens_are_clean_and_deterministic():
    text = (
        "\u201cWe can\u2019t stop,\u201d said Mr. Smith of the U.S. Senate\u2014again. It's 1,000.50! "
        "(Applause.) Why? 'Tis the '90s' rock... \u2026"
    )
    first = tokenize_text(text)
    assert first == tokenize_text(text)
    assert all(t and not any(c.isspace() for c in t) for s in first for t in s)
    assert format_sentence(first[0]) == '" We ca n\'t stop , " said Mr. Smith of the U.S. Senate -- again .'
    assert normalize_text(" \u201cA\u2019s\u201d \u2026 ") == '"A\'s" ...'


# --- the bundled sample ------------------------------------------------------------------------


def _lines(name):
    path = SAMPLE / name
    assert path.is_file(), f"{path} is missing: run python experiments/make_sample.py"
    raw = path.read_bytes()
    assert raw, f"{path} is empty"
    text = raw.decode("utf-8")  # raises if not UTF-8
    assert text.endswith("\n") and "\r" not in text
    return text[:-1].split("\n")


@pytest.fixture(scope="module")
def sample():
    return {name: _lines(name) for name in ("train.txt", "heldout.txt")}


def test_sample_format(sample):
    for name, lines in sample.items():
        assert len(lines) > 100, name
        for i, line in enumerate(lines):
            where = f"{name}:{i + 1}"
            assert line, f"{where}: empty line"
            assert line == line.strip(), f"{where}: leading or trailing whitespace"
            assert "  " not in line and "\t" not in line, f"{where}: tokens not separated by single spaces"
        assert len(set(lines)) == len(lines), f"{name}: duplicate sentences"


def test_sample_train_and_heldout_share_no_line(sample):
    assert not set(sample["train.txt"]) & set(sample["heldout.txt"])


def test_sample_sizes(sample):
    tokens = {name: sum(len(line.split(" ")) for line in lines) for name, lines in sample.items()}
    share = tokens["heldout.txt"] / (tokens["train.txt"] + tokens["heldout.txt"])
    assert 0.03 < share < 0.15
    assert sum((SAMPLE / name).stat().st_size for name in sample) < 3_000_000
    assert (SAMPLE / "README.md").is_file()


def test_sample_is_a_fixed_point_of_the_tokenizer(sample):
    # Re-tokenizing a bundled line gives it back: the sample is in the form tokenize() produces.
    for name, lines in sample.items():
        for line in lines:
            assert format_sentence(tokenize(line)) == line, f"{name}: {line!r}"


def test_data_changes_say_files_gone_before_the_many_new_ones():
    """(Before: one entry a file, new ones first, so "p0.txt is new; p1.txt is new; p2.txt is new
    and 2 more" hid that the training file itself was gone.)"""
    from elmo_jax.text.sources import data_changes

    def files(*names, size=10):
        return [{"name": n, "size": size, "sha256_ends": "x"} for n in names]

    saved = files("train.txt", "kept.txt")
    now = files("kept.txt", "p0.txt", "p1.txt", "p2.txt", "p3.txt")
    assert data_changes(saved, now) == ["train.txt is gone", "p0.txt, p1.txt, p2.txt and 1 more are new"]
    assert data_changes(saved, files("train.txt", "kept.txt", size=11)) == [
        "kept.txt changed size (10 -> 11 bytes)",
        "train.txt changed size (10 -> 11 bytes)",
    ]
    assert data_changes(saved, saved) == []


def test_the_splitter_and_the_tokenizer_agree_on_a_number_abbreviation_that_ends_a_sentence():
    assert tokenize_text("He said no. Then he left.") == [["He", "said", "no", "."], ["Then", "he", "left", "."]]


def test_a_pipe_or_a_device_given_as_a_file_is_named_for_what_it_is(tmp_path):
    """(Before: "/dev/fd/63: is a directory, not a file" for a pipe given to embed, and "no files
    match /dev/fd/63" for one given as training files, a path that is there.)"""
    from elmo_jax._util.paths import fault
    from elmo_jax.text.sources import DataError, TextFiles

    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    said = "is a pipe, not a file: it can be read only once, and this reads it more than once; save it to a file first"
    assert fault(pipe, "file") == (str(pipe), said)
    with pytest.raises(DataError, match=f"^{re.escape(str(pipe))}: is a pipe, not a file"):
        TextFiles(str(pipe))
    assert fault("/dev/null", "file") == ("/dev/null", "is a character device, not a file; give a file")
    assert fault(tmp_path, "file") == (str(tmp_path), "is a directory, not a file")  # negative control
