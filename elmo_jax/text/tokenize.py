"""Sentence splitting and tokenization for English training text (pure Python, deterministic).

These are the rules that turned the bundled sample (``elmo_jax/data/sample/``) into one
tokenized sentence per line, and the rules to use for any other corpus meant to be comparable
with it. They are deliberately simple: no model, no dictionary beyond the short abbreviation
lists below, and the same input always gives the same output. The output resembles the
tokenization of the 1B Word Benchmark (lm1b) and the Penn Treebank (PTB), which ELMo's published
models were trained on, but it is not byte-identical to either.

Sentence splitting, :func:`split_sentences`
-------------------------------------------

1. Every line break (``\\n``, ``\\r\\n``, ``\\r``, and the other breaks ``str.splitlines``
   knows, e.g. U+2029 paragraph separator) ends a sentence. Blank lines are dropped.
2. Inside a line, whitespace runs (tabs, no-break spaces, ...) become one space and the ends are
   stripped.
3. A sentence ends after ``.``, ``!``, ``?`` or ``…`` (or a run of them, e.g. ``?!`` or ``...``),
   optionally followed by closing quotes or brackets (``" ' ” ’ » ) ] }``), when whitespace
   follows and the next character is an uppercase letter, a digit, or an opening quote or
   bracket (``" ' “ ‘ « ( [ {``). A lowercase next character never starts a sentence.
4. A lone ``.`` directly followed by whitespace does *not* end a sentence when the word before it
   is

   * a title or other abbreviation that precedes a name: one of :data:`TITLES` (Mr., Mrs., Ms.,
     Dr., St., Gen., Sen., Gov., ...), compared case-insensitively;
   * an abbreviation that precedes a number, one of :data:`NUMBER_ABBREVIATIONS` (No., Vol.,
     p., pp., Jan., ..., Dec.), when the next character is a digit (``No. 5``, ``Jan. 20``);
   * a single uppercase letter, i.e. an initial (``J. Edgar Hoover``);
   * a dotted initialism (``U.S.``, ``U.N.``, ``D.C.``, ``e.g.``, ``i.e.``, ``U.S.S.R.``).

   So ``... the U.S. Senate`` stays one sentence, and so does ``... in Washington, D.C. Then``:
   the rules prefer missing a rare boundary to cutting "U.S. Army" in two.

Tokenization, :func:`tokenize`
------------------------------

The input is one sentence; the output is its list of tokens (no empty strings, no whitespace).

1. Characters are normalised: Unicode NFC; curly single quotes ``‘ ’ ‚ ‛`` become ``'``; curly
   double quotes ``“ ” „ ‟`` and guillemets ``« »`` become ``"``; ``…`` becomes ``...``; the
   Unicode hyphens U+2010 and U+2011 become ``-``; soft hyphens and zero-width characters are
   deleted; whitespace runs become one space.
2. Dashes: an em dash ``—``, a horizontal bar ``―``, a spaced en dash (`` – ``) and any run of
   two or more dash characters (``--``, ``---``, ``——``, ``–-``) become the separate token
   ``--``. An unspaced en dash (``1943–1948``) becomes ``-`` and stays inside its word.
3. These are always split off as tokens of their own: ``; ! ? ( ) [ ] { } " $ %`` and a run of
   two or more periods (``...``).
4. ``,`` and ``:`` are split off unless they sit between two digits, so ``1,000.50``, ``10:30``
   and ``2,000,000`` stay whole while ``yes,no`` becomes ``yes , no``.
5. Hyphens inside a word are kept: ``well-known``, ``10-year``, ``U.S.-Soviet``. A single
   free-standing ``-`` stays ``-``.
6. Apostrophes (after step 1 all are ``'``):

   * clitics are split from the word before them, case-insensitively: ``n't``, ``'s``, ``'re``,
     ``'ve``, ``'ll``, ``'d``, ``'m`` (``don't`` -> ``do n't``, ``can't`` -> ``ca n't``,
     ``won't`` -> ``wo n't``, ``it's`` -> ``it 's``, ``he'd've`` -> ``he 'd 've``);
   * a ``'`` at the start of a word is an opening quote and split off, except in ``'em``,
     ``'tis``, ``'twas``, ``'til``, ``'cause``, ``'round`` and before a digit (``'90s``);
   * a ``'`` at the end of a word is split off (closing quote, or plural possessive as in
     PTB: ``states'`` -> ``states '``);
   * a ``'`` inside a word stays (``o'clock``, ``O'Neill``).

7. The sentence-final period, the last ``.`` of the sentence before any closing quotes or
   brackets, becomes a token of its own: ``It ended.`` -> ``It ended .``. When the last word is
   an abbreviation (a dotted initialism such as ``U.S.``, a word from :data:`TITLES`, or one of
   :data:`FINAL_ABBREVIATIONS` such as ``etc.``), the word keeps its period and a ``.`` token is
   added after it, as in PTB: ``... in the U.S.`` -> ``... in the U.S. .``. A word of
   :data:`NUMBER_ABBREVIATIONS` is an abbreviation only before a number (rule 4), so at the end
   it is a word: ``He said no.`` -> ``He said no .``. Any other period is left where it is:
   abbreviations (``Mr.``, ``Inc.``) and numbers (``3.5``) stay whole.

:func:`normalize_text` applies step 1 alone; :func:`tokenize_text` chains the splitter and the
tokenizer; :func:`format_sentence` joins tokens with single spaces (the on-disk format: one
sentence per line).
"""

from __future__ import annotations

import re
import unicodedata

__all__ = [
    "TITLES",
    "NUMBER_ABBREVIATIONS",
    "FINAL_ABBREVIATIONS",
    "CLITICS",
    "normalize_text",
    "split_sentences",
    "tokenize",
    "tokenize_text",
    "format_sentence",
]

TITLES = frozenset(
    {
        "mr",
        "mrs",
        "ms",
        "messrs",
        "mme",
        "dr",
        "prof",
        "rev",
        "hon",
        "st",
        "mt",
        "ft",
        "gen",
        "col",
        "lt",
        "capt",
        "cmdr",
        "sgt",
        "maj",
        "adm",
        "gov",
        "sen",
        "rep",
        "pres",
        "supt",
        "vs",
    }
)
"""Abbreviations (lowercase, without the period) that precede a name and so never end a sentence."""

NUMBER_ABBREVIATIONS = frozenset(
    {
        "no",
        "nos",
        "vol",
        "vols",
        "p",
        "pp",
        "art",
        "sec",
        "ch",
        "fig",
        "jan",
        "feb",
        "mar",
        "apr",
        "jun",
        "jul",
        "aug",
        "sep",
        "sept",
        "oct",
        "nov",
        "dec",
    }
)
"""Abbreviations (lowercase, without the period) that never end a sentence before a digit."""

FINAL_ABBREVIATIONS = frozenset({"etc", "inc", "co", "corp", "ltd", "jr", "sr", "bros"})
"""Abbreviations that may end a sentence; at the very end they keep their period and get a ``.`` token."""

CLITICS = ("n't", "'s", "'re", "'ve", "'ll", "'d", "'m")
"""Word endings split off as tokens of their own (compared case-insensitively)."""

# --- character normalisation -------------------------------------------------------------------

_CHAR_MAP = str.maketrans(
    {
        "\u2018": "'",
        "\u2019": "'",
        "\u201a": "'",
        "\u201b": "'",
        "\u201c": '"',
        "\u201d": '"',
        "\u201e": '"',
        "\u201f": '"',
        "\u00ab": '"',
        "\u00bb": '"',
        "\u2026": "...",
        "\u2010": "-",
        "\u2011": "-",
        "\u00ad": None,
        "\u200b": None,
        "\u200c": None,
        "\u200d": None,
        "\u2060": None,
        "\ufeff": None,
    }
)


def _squash_spaces(text: str) -> str:
    return " ".join(text.split())


def normalize_text(text: str) -> str:
    """Tokenizer step 1: NFC, plain quotes, ``...`` for ``…``, ASCII hyphens, one space per gap."""
    return _squash_spaces(unicodedata.normalize("NFC", text).translate(_CHAR_MAP))


# --- sentence splitting ------------------------------------------------------------------------

_OPENERS = "\"'\u201c\u2018\u00ab([{"
_CLOSERS = "\"'\u201d\u2019\u00bb)]}"
_BOUNDARY = re.compile(r"([.!?\u2026]+)([" + re.escape(_CLOSERS) + r"]*)\s+")
_INITIALISM = re.compile(r"(?:[^\W\d_]\.)+[^\W\d_]")  # U.S / e.g / D.C (the final period excluded)


def _is_abbreviation(word: str, next_char: str) -> bool:
    """Whether ``word`` + ``"."`` is an abbreviation that does not end a sentence before ``next_char``."""
    word = word.lstrip(_OPENERS)
    low = word.lower()
    if low in TITLES:
        return True
    if low in NUMBER_ABBREVIATIONS and next_char.isdigit():
        return True
    if len(word) == 1 and word.isupper():
        return True
    return _INITIALISM.fullmatch(word) is not None


def _split_line(line: str) -> list[str]:
    sentences, start = [], 0
    for m in _BOUNDARY.finditer(line):
        if m.end() >= len(line):
            break  # trailing whitespace only (cannot happen after squashing; kept for safety)
        nxt = line[m.end()]
        if not (nxt.isupper() or nxt.isdigit() or nxt in _OPENERS):
            continue
        if m.group(1) == "." and not m.group(2):
            word = line[: m.start()].rsplit(" ", 1)[-1]
            if _is_abbreviation(word, nxt):
                continue
        sentences.append(line[start : m.end()].strip())
        start = m.end()
    sentences.append(line[start:].strip())
    return [s for s in sentences if s]


def split_sentences(text: str) -> list[str]:
    """Split ``text`` into sentences by the rules in the module docstring.

    Returns the sentences in order, each with its whitespace normalised (single spaces, no
    leading or trailing space); characters are otherwise unchanged. Empty input gives ``[]``.
    """
    out: list[str] = []
    for line in text.splitlines():
        line = _squash_spaces(line)
        if line:
            out.extend(_split_line(line))
    return out


# --- tokenization ------------------------------------------------------------------------------

_DASH_CHARS = "-\u2012\u2013\u2014\u2015"
_DASH_RUN = re.compile("[" + _DASH_CHARS + "]{2,}|[\u2014\u2015]|(?:(?<=\\s)|^)\u2013|\u2013(?=\\s|$)")
_ALWAYS_SPLIT = re.compile(r"(\.{2,}|[;!?()\[\]{}\"$%])")
_COMMA_COLON = re.compile(r"(?<![0-9])[,:]|[,:](?![0-9])")
_LEAD_APOSTROPHE_OK = re.compile(r"'(?:[0-9]|(?:em|tis|twas|til|cause|round)(?![^\W_]))", re.IGNORECASE)
_CLITIC = re.compile(r"(.*[^\W_].*?)(n't|'s|'re|'ve|'ll|'d|'m)", re.IGNORECASE | re.DOTALL)
_CLOSING_TOKENS = frozenset({'"', "'", ")", "]", "}"})


def _split_clitics(word: str) -> list[str]:
    tail: list[str] = []
    while True:
        m = _CLITIC.fullmatch(word)
        if m is None:
            break
        stem, clitic = m.group(1), m.group(2)
        if clitic.lower() == "n't" and stem.endswith("'"):
            break  # "'n't"-like oddities: leave alone
        tail.insert(0, clitic)
        word = stem
    return [word] + tail


def _split_apostrophes(chunk: str) -> list[str]:
    if chunk == "'" or chunk.lower() in CLITICS:
        return [chunk]
    head: list[str] = []
    tail: list[str] = []
    while chunk.startswith("'") and not _LEAD_APOSTROPHE_OK.match(chunk) and chunk.lower() not in CLITICS:
        head.append("'")
        chunk = chunk[1:]
    while chunk.endswith("'") and len(chunk) > 1:
        tail.insert(0, "'")
        chunk = chunk[:-1]
    if chunk == "'":
        return head + ["'"] + tail
    return head + (_split_clitics(chunk) if chunk else []) + tail


def _is_final_abbreviation(word: str) -> bool:
    stem = word[:-1]
    if _INITIALISM.fullmatch(stem):
        return True
    low = stem.lower()
    # Not NUMBER_ABBREVIATIONS: they are abbreviations before a number (the splitter's rule 4), and
    # at the end of a sentence none follows. There they are mostly words: "He said no." ends "no .".
    return low in TITLES or low in FINAL_ABBREVIATIONS


def tokenize(sentence: str) -> list[str]:
    """Tokenize one sentence by the rules in the module docstring.

    >>> tokenize("“We can’t stop,” said Mr. Smith of the U.S. Senate—again.")
    ['"', 'We', 'ca', "n't", 'stop', ',', '"', 'said', 'Mr.', 'Smith', 'of', 'the', 'U.S.', 'Senate', '--', 'again', '.']
    """
    if not isinstance(sentence, str):  # (unchecked: unicodedata's "argument 2 must be str, not list")
        raise TypeError(
            f"sentence is a {type(sentence).__name__}; expected one str: [tokenize(s) for s in sentences] "
            "for many, tokenize_text for a text"
        )
    s = unicodedata.normalize("NFC", sentence).translate(_CHAR_MAP)
    s = _DASH_RUN.sub(" -- ", s)
    s = s.replace("\u2013", "-").replace("\u2012", "-")
    s = _ALWAYS_SPLIT.sub(r" \1 ", s)
    s = _COMMA_COLON.sub(lambda m: f" {m.group(0)} ", s)
    tokens: list[str] = []
    for chunk in s.split():
        tokens.extend(_split_apostrophes(chunk))
    # Sentence-final period: the last token that is not a closing quote or bracket.
    i = len(tokens) - 1
    while i >= 0 and tokens[i] in _CLOSING_TOKENS:
        i -= 1
    if i >= 0:
        word = tokens[i]
        if len(word) > 1 and word.endswith(".") and not word.endswith(".."):
            if _is_final_abbreviation(word):
                tokens.insert(i + 1, ".")
            else:  # the word may end in a clitic or apostrophe now: "it's." -> it 's .
                tokens[i : i + 1] = _split_apostrophes(word[:-1]) + ["."]
    return tokens


def tokenize_text(text: str) -> list[list[str]]:
    """:func:`split_sentences` then :func:`tokenize` on each sentence (sentences with no tokens dropped)."""
    if not isinstance(text, str):  # (unchecked: "'list' object has no attribute 'splitlines'")
        raise TypeError(
            f"text is a {type(text).__name__}; expected one str: [tokenize(s) for s in sentences] for sentences "
            "already split, '\n'.join(texts) for several texts"
        )
    return [t for t in (tokenize(s) for s in split_sentences(text)) if t]


def format_sentence(tokens: list[str]) -> str:
    """The on-disk form of a tokenized sentence: tokens joined by single spaces."""
    return " ".join(tokens)
