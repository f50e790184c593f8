import re

import numpy as np
import pytest
from helpers import FIXTURES

from elmo_jax.model.vocabulary import VocabError, Vocabulary, batch_to_ids, token_to_ids, words_to_ids


def padded(prefix, width=50, pad=261):
    return prefix + [pad] * (width - len(prefix))


# The published indexer cases of AllenNLP's ELMoTokenCharactersIndexer tests (shifted ids).
def test_published_indexer_cases():
    assert token_to_ids("<S>").tolist() == padded([259, 257, 260])
    assert token_to_ids("</S>").tolist() == padded([259, 258, 260])
    assert token_to_ids(chr(256) + "t").tolist() == padded([259, 197, 129, 117, 260])


def test_plain_word_and_shift():
    assert token_to_ids("abc").tolist() == padded([259, 98, 99, 100, 260])
    assert token_to_ids("abc").dtype == np.int32


def test_empty_string_token_is_just_word_boundaries():
    assert token_to_ids("").tolist() == padded([259, 260])


def test_long_token_is_cut_at_max_minus_two_bytes():
    ids = token_to_ids("x" * 100)
    assert ids.tolist() == [259] + [121] * 48 + [260]


def test_cut_inside_a_multibyte_character_keeps_leading_bytes():
    word = "a" * 47 + "é"  # 'é' is 2 bytes; only its first byte fits in 48
    ids = token_to_ids(word)
    assert ids[48] == 0xC3 + 1 and ids[49] == 260


@pytest.mark.parametrize("word", ["東京", "🙂", "e\u0301", "naïve", "\u200b"])
def test_any_unicode_is_its_utf8_bytes(word):
    data = word.encode("utf-8")
    assert token_to_ids(word).tolist() == padded([259] + [b + 1 for b in data] + [260])


def test_lone_surrogate_is_ignored_not_an_error():
    assert token_to_ids("a\udcff").tolist() == padded([259, 98, 260])


def test_max_characters_per_token_10():
    assert token_to_ids("abcdefghijkl", 10).tolist() == [259, 98, 99, 100, 101, 102, 103, 104, 105, 260]
    assert token_to_ids("<S>", 10).tolist() == [259, 257, 260] + [261] * 7
    assert token_to_ids("ab", 10).tolist() == [259, 98, 99, 260] + [261] * 6


@pytest.mark.parametrize("max_chars", [3, 4, 10, 50])
def test_words_to_ids_gives_each_word_its_token_to_ids_row(max_chars):
    """The whole-array path (a 793k-word vocabulary goes through it at each run's start) against
    the per-token one the published cases check: markers (whole even where their letters would be
    cut), the empty word, cuts inside a multi-byte character, lone surrogates, NUL bytes in a word."""
    words = ["<S>", "</S>", "<UNK>", "", "x" * 100, "a" * 47 + "é", "東京", "🙂", "e\u0301", "a\udcff"]
    words += ["\x00", "a\x00\x00", "<S>\x00", "<S", "the", "<S>", "naïve"]
    ids = words_to_ids(words, max_chars)
    assert ids.shape == (len(words), max_chars) and ids.dtype == np.int32
    np.testing.assert_array_equal(ids, np.stack([token_to_ids(w, max_chars) for w in words]))
    assert words_to_ids([], max_chars).shape == (0, max_chars)


def test_batch_to_ids_pads_with_zero_rows():
    ids = batch_to_ids([["a", "b", "a"], [], ["c"]])
    assert ids.shape == (3, 3, 50) and ids.dtype == np.int32
    np.testing.assert_array_equal(ids[0, 0], ids[0, 2])
    np.testing.assert_array_equal(ids[0], words_to_ids(["a", "b", "a"]))
    assert not ids[1].any()
    assert not ids[2, 1:].any() and (ids[2, 0] == token_to_ids("c")).all()


def test_batch_to_ids_shapes_for_edge_batches():
    assert batch_to_ids([[]]).shape == (1, 1, 50)
    assert batch_to_ids([]).shape == (0, 1, 50)
    assert batch_to_ids([["a"]], max_chars=10, min_length=4).shape == (1, 4, 10)
    assert batch_to_ids([["w"] * 500]).shape == (1, 500, 50)


def test_vocabulary_specials_anywhere():
    # The public fixtures put the specials at different lines.
    for path in ("allennlp_elmo/vocab_test.txt", "bilm_tf_data/vocab_test.txt", "bilm_tf_train/vocab.txt"):
        v = Vocabulary.load(FIXTURES / path)
        assert v.words[v.bos] == "<S>" and v.words[v.eos] == "</S>" and v.words[v.unk] == "<UNK>"
        assert v.word_to_id("never-seen-word") == v.unk
    v = Vocabulary.load(FIXTURES / "bilm_tf_data/vocab_test.txt")
    assert (v.eos, v.bos, v.unk) == (0, 1, 2)
    assert v.encode(["the", "zzzz"]).tolist() == [3, 2]


def test_lm_vocabulary_must_have_the_specials():
    path = FIXTURES / "bilm_tf_model/vocab_test.txt"  # has <S> and </S> but no <UNK>
    with pytest.raises(VocabError, match=r"vocab_test.txt: a language-model vocabulary must contain \['<UNK>'\]"):
        Vocabulary.load(path)
    plain = Vocabulary.load(path, lm=False)
    assert plain.unk == -1 and plain.word_to_id("zzzz") == -1
    assert plain.char_ids().shape == (len(plain), 50)


def test_bad_vocabulary_files(tmp_path):
    p = tmp_path / "v.txt"
    p.write_bytes(b"<S>\n</S>\n<UNK>\nok\n\xff\xfe\n")
    with pytest.raises(VocabError, match="v.txt: line 5: not UTF-8"):
        Vocabulary.load(p)
    p.write_text("<S>\n</S>\n<UNK>\n\nword\n")
    with pytest.raises(VocabError, match="v.txt: line 4: empty line"):
        Vocabulary.load(p)
    p.write_text("<S>\n</S>\n<UNK>\nword\nword\n")
    with pytest.raises(VocabError, match="v.txt: line 5: duplicate token 'word' \\(first at line 4\\)"):
        Vocabulary.load(p)
    p.write_text("")
    with pytest.raises(VocabError, match="v.txt: vocabulary file is empty"):
        Vocabulary.load(p)
    with pytest.raises(VocabError, match="vocabulary file not found"):
        Vocabulary.load(tmp_path / "missing.txt")


def test_a_vocabulary_made_from_a_str_or_with_a_token_not_a_str_is_refused():
    """(Before: a str was read as its letters, a word list of one-letter words or a complaint that
    <S>, </S> and <UNK> were missing; an int token was taken, a word no text can hold.)"""
    with pytest.raises(VocabError, match=r"^vocabulary: words is one str \('<S> </S> <UNK> a'\); expected a list"):
        Vocabulary("<S> </S> <UNK> a")
    with pytest.raises(VocabError, match="^vocabulary: line 4: token 3 has type int; expected str$"):
        Vocabulary(["<S>", "</S>", "<UNK>", 3])  # type: ignore[list-item]
    assert len(Vocabulary(("<S>", "</S>", "<UNK>", "a"))) == 4  # any sequence of str


def test_token_to_ids_refuses_a_token_not_a_str_or_too_few_chars():
    """(Before: an int was an AttributeError out of ``.encode``; ``max_chars`` 2 kept only the
    begin and end of word, dropping every byte of the word, and 2 for ``<S>`` a broadcasting error.)"""
    with pytest.raises(TypeError, match="^token 3 has type int; expected str$"):
        token_to_ids(3)  # type: ignore[arg-type]
    for bad in (2, 0, 2.5):
        with pytest.raises(
            ValueError,
            match=re.escape(f"max_chars must be an integer >= 3 (begin and end of word, and a byte); got {bad!r}"),
        ):
            token_to_ids("abc", bad)  # type: ignore[arg-type]
    assert token_to_ids("abc", 3).tolist() == [259, 98, 260] and token_to_ids("<S>", 3).tolist() == [259, 257, 260]
