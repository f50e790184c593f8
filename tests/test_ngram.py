"""The Kneser-Ney baseline (experiments/ngram.py): hand-worked probabilities, normalisation, the
biLM's event definition in both directions, and the command line."""

import itertools
import json
import math
import pathlib
import random
import subprocess
import sys

import ngram
import pytest
from ngram import KneserNey, encode_sentence, estimate_discounts

from elmo_jax.model.vocabulary import Vocabulary

ROOT = pathlib.Path(__file__).resolve().parents[1]

# The toy vocabulary: ids U=<UNK> 0, S=<S> 1, E=</S> 2, a 3, b 4, c 5 (markers not at the top, as
# in some public vocabularies). Forward support: {U, E, a, b, c}, 5 tokens.
WORDS = ["<UNK>", "<S>", "</S>", "a", "b", "c"]
U, S, E, A, B, C = range(6)
VOCAB = Vocabulary(WORDS)
TEXT = ["a b", "a b c", "b a", "c x"]  # x is out of vocabulary: <UNK>
SENTS = [encode_sentence(line.split(), VOCAB) for line in TEXT]


def close(x, y, tol=1e-12):
    return abs(x - y) <= tol


def test_toy_corpus_encoding():
    assert SENTS == [[A, B], [A, B, C], [B, A], [C, U]]


def test_estimate_discounts():
    # n1..n4 = 5, 3, 2, 1: Y = 5/11; D1 = 1 - 2Y(3/5) = 5/11; D2 = 2 - 3Y(2/3) = 12/11;
    # D3+ = 3 - 4Y(1/2) = 23/11. All inside (0, c): used as they are.
    assert all(map(close, estimate_discounts(5, 3, 2, 1), (5 / 11, 12 / 11, 23 / 11)))
    # n3 = 0: D2 = 2 (not < 2) and D3+ undefined -> fallbacks 1 and 1.5; D1 = Y = 9/13.
    assert all(map(close, estimate_discounts(9, 2, 0, 0), (9 / 13, 1.0, 1.5)))
    # D2 = 2 - 3(1/3)(10/1) = -8 < 0 -> 1; n4 = 0: D3+ = 3 (not < 3) -> 1.5.
    assert all(map(close, estimate_discounts(1, 1, 10, 0), (1 / 3, 1.0, 1.5)))
    assert estimate_discounts(0, 0, 0, 0) == ngram.FALLBACK_DISCOUNTS


# Forward events, order 2:
#   "a b"  : S->a a->b b->E        "a b c": S->a a->b b->c c->E
#   "b a"  : S->b b->a a->E        "c x"  : S->c c->U U->E
# Level 2 (raw bigram counts), per context (T = total):
#   S: a 2, b 1, c 1 (T 4)   a: b 2, E 1 (T 3)   b: E 1, c 1, a 1 (T 3)   c: E 1, U 1 (T 2)   U: E 1 (T 1)
#   n1 = 9, n2 = 2, n3 = n4 = 0: Y = 9/13, D1 = 1 - 2(9/13)(2/9) = 9/13,
#   D2 = 2 - 3Y*0/2 = 2 is not < 2 -> fallback 1, D3+ (n3 = 0) -> fallback 1.5.
# Level 1 (continuation counts: distinct left neighbours):
#   a {S, b} 2, b {S, a} 2, c {S, b} 2, E {a, b, c, U} 4, U {c} 1; T = 11
#   n1 = 1, n2 = 3, n3 = 0, n4 = 1: Y = 1/7, D1 = 1 - 2(1/7)(3/1) = 1/7, D2 = 2 -> 1, D3+ -> 1.5.
#   Discounted mass m1 = 1/7 (U) + 3 * 1 (a, b, c) + 1.5 (E); P1(w) = (c - D(c) + m1 / 5) / 11.
D1_UNI = 1 / 7
M1 = 1 / 7 + 3 * 1.0 + 1.5
P1 = {
    A: (2 - 1 + M1 / 5) / 11,
    B: (2 - 1 + M1 / 5) / 11,
    C: (2 - 1 + M1 / 5) / 11,
    E: (4 - 1.5 + M1 / 5) / 11,
    U: (1 - D1_UNI + M1 / 5) / 11,
}


def test_hand_worked_order2():
    m = KneserNey(2, 6, S, E).fit(SENTS)
    assert close(sum(P1.values()), 1.0)
    assert m.count_of_counts == [(1, 3, 0, 1), (9, 2, 0, 0)]
    assert all(map(close, m.discounts[0], (1 / 7, 1.0, 1.5)))
    assert all(map(close, m.discounts[1], (9 / 13, 1.0, 1.5)))
    d1 = 9 / 13
    # Seen pair, count 2 (D2 = 1); context a passes m = D2 + D1 = 1 + 9/13 down.
    assert close(m.prob(B, [A]), (2 - 1 + (1 + d1) * P1[B]) / 3)
    # Unseen pair in a seen context: only the backed-off share.
    assert close(m.prob(C, [A]), (1 + d1) * P1[C] / 3)
    # Sentence start: context S (a 2, b 1, c 1), m = 1 + 2 * 9/13; [] is the same context.
    assert close(m.prob(A, [S]), (2 - 1 + (1 + 2 * d1) * P1[A]) / 4)
    assert m.prob(A, []) == m.prob(A, [S])
    assert close(m.prob(E, [U]), (1 - d1 + d1 * P1[E]) / 1)
    # Context E is never seen: full backoff (weight 1) to the unigram level.
    assert close(m.prob(B, [E]), P1[B])
    # Only the last order - 1 tokens of a longer context count.
    assert m.prob(B, [C, S, A]) == m.prob(B, [A])
    assert m.prob(S, [A]) == 0.0


# Forward events, order 3 (contexts padded S S):
#   S S->a  S a->b  a b->E  |  S S->a  S a->b  a b->c  b c->E  |  S S->b  S b->a  b a->E  |  S S->c  S c->U  c U->E
# Level 3 (raw): SS: a 2, b 1, c 1 (T 4)  Sa: b 2 (T 2)  ab: E 1, c 1 (T 2)  bc: E 1  Sb: a 1  ba: E 1  Sc: U 1  cU: E 1
#   n1 = 9, n2 = 2 -> discounts (9/13, 1, 1.5) as at order 2.
# Level 2 from the distinct trigrams: +1 per distinct left extension, except that a trigram S S w
#   hands its raw count to the pad-led bigram S w (its only extension is more padding):
#   S: a 2, b 1, c 1 (T 4, m = 1 + 2 D1)   a: b 1, E 1 (T 2, m = 2 D1)   b: E 1, c 1, a 1 (T 3, m = 3 D1)
#   c: E 1, U 1 (T 2)   U: E 1 (T 1).   (The raw count of a b is 2, its continuation count 1.)
#   n1 = 10, n2 = 1, n3 = 0: Y = 10/12 = 5/6, D1 = 1 - 2(5/6)(1/10) = 5/6, D2 -> 1, D3+ -> 1.5.
# Level 1: the distinct left neighbours of the level-2 bigrams, the same sets as at order 2: P1 above.
def test_hand_worked_order3():
    m = KneserNey(3, 6, S, E).fit(SENTS)
    assert m.count_of_counts == [(1, 3, 0, 1), (10, 1, 0, 0), (9, 2, 0, 0)]
    assert all(map(close, m.discounts[1], (5 / 6, 1.0, 1.5)))
    assert all(map(close, m.discounts[2], (9 / 13, 1.0, 1.5)))
    d2, d3 = 5 / 6, 9 / 13
    p2 = {
        ("a", B): (1 - d2 + 2 * d2 * P1[B]) / 2,
        ("a", A): (0 + 2 * d2 * P1[A]) / 2,
        ("b", E): (1 - d2 + 3 * d2 * P1[E]) / 3,
        ("b", U): (0 + 3 * d2 * P1[U]) / 3,
        ("S", A): (2 - 1 + (1 + 2 * d2) * P1[A]) / 4,
    }
    # S a -> b: count 2 (D2 = 1), the context's only word: m = 1.
    assert close(m.prob(B, [S, A]), (2 - 1 + 1.0 * p2["a", B]) / 2)
    assert m.prob(B, [A]) == m.prob(B, [S, A])  # left-padded: a starts the sentence
    # a b -> E: count 1 of T 2, m = 2 * 9/13.
    assert close(m.prob(E, [A, B]), (1 - d3 + 2 * d3 * p2["b", E]) / 2)
    # a b -> U: unseen word, seen context, seen lower context.
    assert close(m.prob(U, [A, B]), 2 * d3 * p2["b", U] / 2)
    # c a: unseen trigram context -> weight 1 to level 2 context a, where a is unseen.
    assert close(m.prob(A, [C, A]), p2["a", A])
    # S S -> a: count 2 of T 4, m = 1 + 2 * 9/13, lower context S with raw counts.
    assert close(m.prob(A, [S, S]), (2 - 1 + (1 + 2 * d3) * p2["S", A]) / 4)
    # E E: unseen at levels 3 and 2 -> the unigram level.
    assert close(m.prob(B, [E, E]), P1[B])


def test_fixed_discounts():
    m = KneserNey(2, 6, S, E, discounts=(0.5, 1.0, 1.5)).fit(SENTS)
    assert m.discounts == [(0.5, 1.0, 1.5)] * 2
    # Level 1 with D1 = 0.5: m1 = 0.5 + 3 + 1.5 = 5; P1(b) = (2 - 1 + 5/5) / 11 = 2/11.
    assert close(m.prob(B, [A]), (2 - 1 + (1 + 0.5) * 2 / 11) / 3)
    with pytest.raises(ValueError):
        KneserNey(2, 6, S, E, discounts=(1.5, 1.0, 1.5))  # D1 > 1


def random_corpus(seed, n=40):
    rng = random.Random(seed)
    words = "a b c d e f g".split()  # f, g out of vocabulary
    return [
        encode_sentence([rng.choice(words[: rng.randint(2, 7)]) for _ in range(rng.randint(1, 6))], VOCAB8)
        for _ in range(n)
    ]


VOCAB8 = Vocabulary(["a", "</S>", "b", "<S>", "c", "<UNK>", "d", "e"])


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("order", [2, 3, 4])
def test_normalised_over_support(order, backward):
    v = VOCAB8
    m = KneserNey(order, len(v), v.bos, v.eos, backward=backward).fit(random_corpus(order))
    pad = v.eos if backward else v.bos
    assert m.pad == pad and m.end == (v.bos if backward else v.eos)
    support = list(m.support)
    assert sorted(support + [pad]) == list(range(len(v)))
    kinds = set()
    for h in itertools.product(range(len(v)), repeat=order - 1):
        # j: the context's longest seen suffix is h[j:] (0: seen at the top level, order - 1: only
        # the unigram level), i.e. j levels back off fully.
        kinds.add(next(j for j in range(order) if h[j:] in m.totals[order - 1 - j]))
        probs = [m.prob(w, h) for w in support]
        assert abs(sum(probs) - 1.0) < 1e-9, h
        assert min(probs) > 0.0
        assert m.prob(pad, h) == 0.0
    assert kinds >= {0, 1, order - 1}


def manual_nll(m, sentences, pad, end):
    """-sum log P of the biLM's events, written out independently of KneserNey.events."""
    total, n = 0.0, 0
    for s in sentences:
        words = s[::-1] if m.backward else s
        seq = [pad] * (m.order - 1) + words
        for i, w in enumerate(words + [end]):
            total -= math.log(m.prob(w, seq[i : i + m.order - 1]))
            n += 1
    return total, n


def test_oov_and_perplexity():
    assert encode_sentence(["a", "zzz", "<S>", "</S>", "<UNK>"], VOCAB) == [A, U, U, U, U]
    heldout = [encode_sentence(line.split(), VOCAB) for line in ["a zzz b", "c", "qq a b c a"]]
    for backward in (False, True):
        m = KneserNey(3, 6, S, E, backward=backward).fit(SENTS)
        pad, end = (E, S) if backward else (S, E)
        # "a zzz": zzz is <UNK>, with <UNK>'s probability.
        if not backward:
            assert m.events(heldout[0])[1] == ((S, A), U)
        assert m.nll([encode_sentence(["a", "zzz"], VOCAB)]) == m.nll([[A, U]])
        total, n = m.nll(heldout)
        assert n == 3 + 1 + 5 + 3
        want, want_n = manual_nll(m, heldout, pad, end)
        assert n == want_n and close(total, want, 1e-9)
        assert close(m.perplexity(heldout), math.exp(want / want_n), 1e-9)
    with pytest.raises(ValueError, match="padding marker"):
        KneserNey(2, 6, S, E).fit([[A, S]])


@pytest.mark.parametrize("order", [2, 3, 4])
def test_backward_is_forward_on_reversed_sentences(order):
    v = VOCAB8
    train, heldout = random_corpus(10), random_corpus(11, 10)
    bwd = KneserNey(order, len(v), v.bos, v.eos, backward=True).fit(train)
    ref = KneserNey(order, len(v), bos_id=v.eos, eos_id=v.bos).fit([s[::-1] for s in train])
    assert bwd.counts == ref.counts and bwd.discounts == ref.discounts
    assert list(bwd.support) == list(ref.support)
    for h in itertools.product(range(len(v)), repeat=order - 1):
        for w in range(len(v)):
            assert bwd.prob(w, h) == ref.prob(w, h)
    assert bwd.nll(heldout) == ref.nll([s[::-1] for s in heldout])
    # and not the forward model
    assert bwd.nll(heldout) != KneserNey(order, len(v), v.bos, v.eos).fit(train).nll(heldout)


# -- command line ---------------------------------------------------------------------------------


@pytest.fixture
def files(tmp_path):
    (tmp_path / "vocab.txt").write_text("\n".join(WORDS) + "\n", encoding="utf-8")
    (tmp_path / "train1.txt").write_text("a b\n\na b c\n", encoding="utf-8")
    (tmp_path / "train2.txt").write_text("  \nb a\nc x", encoding="utf-8")
    (tmp_path / "heldout.txt").write_text("a zzz b\nc\n", encoding="utf-8")
    return tmp_path


def run_main(d, *extra, train="train*.txt", vocab="vocab.txt"):
    return ngram.main(
        [
            "--vocab",
            str(d / vocab),
            "--train",
            str(d / train),
            "--heldout",
            str(d / "heldout.txt"),
            "--out",
            str(d / "results" / "ngram.json"),
            *extra,
        ]
    )


def test_cli_writes_json_and_table(files, capsys):
    assert run_main(files, "--order", "2", "3") == 0
    out = capsys.readouterr().out
    assert "ppl fwd" in out and "OOV 25.00%" in out  # zzz: 1 of 4 held-out words
    data = json.loads((files / "results" / "ngram.json").read_text())
    assert list((files / "results").iterdir()) == [files / "results" / "ngram.json"]  # no temp file left
    assert data["train"]["sentences"] == 4 and len(data["train"]["files"]) == 2
    assert data["heldout"]["events"] == 4 + 2
    assert [r["order"] for r in data["results"]] == [2, 3]
    heldout = [[A, U, B], [C]]
    for r in data["results"]:
        assert r["events"] == 6
        fwd = KneserNey(r["order"], 6, S, E).fit(SENTS).perplexity(heldout)
        bwd = KneserNey(r["order"], 6, S, E, backward=True).fit(SENTS).perplexity(heldout)
        assert close(r["perplexity_fwd"], fwd, 1e-9) and close(r["perplexity_bwd"], bwd, 1e-9)
        assert close(r["perplexity"], math.exp(0.5 * (r["nll_fwd"] + r["nll_bwd"])), 1e-9)
        assert f"{r['perplexity']:.2f}" in out


def test_cli_bad_input(files, capsys):
    (files / "empty.txt").write_text("\n \n", encoding="utf-8")
    (files / "novocab.txt").write_text("<S>\n</S>\na\n", encoding="utf-8")
    for kwargs, needle in [({"train": "empty.txt"}, "empty.txt"), ({"vocab": "novocab.txt"}, "novocab.txt")]:
        assert run_main(files, **kwargs) == 2
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1, err
    # The real script: a glob that matches nothing exits 2 with one line, no traceback.
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "experiments" / "ngram.py"),
            "--vocab",
            str(files / "vocab.txt"),
            "--train",
            str(files / "nothing*.txt"),
            "--heldout",
            str(files / "heldout.txt"),
            "--out",
            str(files / "o.json"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "nothing*.txt" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert not (files / "o.json").exists()
