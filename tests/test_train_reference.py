"""Training and evaluation against references written here from bilm-tf's model and training code.

- held-out perplexity (``evaluate``) against a float64 numpy biLM, stream dealing and all;
- the sparse softmax update of ``train_step`` against dense Adagrad on the full ``[V, P]``;
- the compiled train step holds no ``[V, P]`` temporary.

The numpy code below re-derives the math from the spec; only char ids (``token_to_ids``) and the
weights come from the project.
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import gpu_candidates

from elmo_jax.config import CharCNNConfig, LSTMConfig, ModelConfig, Options, TrainConfig
from elmo_jax.model import char_cnn, lstm
from elmo_jax.model.compute import Compute
from elmo_jax.model.layout import BY_BACKEND
from elmo_jax.model.vocabulary import Vocabulary, token_to_ids
from elmo_jax.text.sources import Lines, TextFiles
from elmo_jax.training.batches import LMBatcher
from elmo_jax.training.evaluate import IN_FLIGHT, evaluate
from elmo_jax.training.run_dir import softmax_in_id_order, softmax_in_slot_order
from elmo_jax.training.sharded_softmax import RowLayout
from elmo_jax.training.softmax import sampled_softmax_loss
from elmo_jax.training.step import BATCH_KEYS, TrainState, init_state, prepare_batch, train_step

MODEL = ModelConfig(
    char_cnn=CharCNNConfig(embedding_dim=4, filters=((1, 4), (2, 4), (3, 8)), n_highway=1, max_characters_per_token=10),
    lstm=LSTMConfig(dim=16, projection_dim=8, n_layers=2, cell_clip=3.0, proj_clip=3.0, use_skip_connections=True),
)

# One vocabulary size for the eval and the train tests: a single (slow, op-by-op) init_state.
V = 50
LAYOUT = RowLayout.for_vocab(V)
EVAL_VOCAB = ["<S>", "</S>", "<UNK>", "the", "cat", "sat", "on", "mat", "a", "dog", "ran", "home"]
EVAL_VOCAB += [f"filler{k}" for k in range(V - len(EVAL_VOCAB))]
# A blank line (skipped), OOV words ("extraordinarily" is also longer than the 8 bytes a token
# keeps at max_characters_per_token 10; "café" and "big" are OOV too), repeated words.
EVAL_TEXT = """the cat sat on the mat
a dog ran
the extraordinarily big dog sat
home

a cat ran home on the mat
café the dog
the the the
dog
on a mat a cat sat
"""


# -- the numpy reference ------------------------------------------------------------------------


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _to_np(tree):
    return jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), tree)


class NumpyBiLM:
    """Char CNN (spec 2), TF LSTMCell stacks (spec 3) and the full softmax, in float64."""

    def __init__(self, params, model: ModelConfig):
        self.p = _to_np(params)
        self.model = model
        self._vectors = {}
        self.clipped = {"cell": 0, "proj": 0}

    def token_vector(self, word: str) -> np.ndarray:
        if word not in self._vectors:
            c, p = self.model.char_cnn, self.p["bilm"]["char_cnn"]
            ids = token_to_ids(word, c.max_characters_per_token)
            x = p["char_embed"][ids]  # [chars, E]
            feats = []
            for layer, (width, n) in zip(p["conv"], c.filters):
                positions = len(ids) - width + 1
                y = np.zeros((positions, n))
                for k in range(width):  # VALID convolution: y[t] = sum_k x[t + k] @ w[k]
                    y += x[k : k + positions] @ layer["w"][k]
                feats.append((y + layer["b"]).max(axis=0))
            h = np.concatenate(feats)
            h = np.maximum(h, 0.0) if c.activation == "relu" else np.tanh(h)
            f = h.shape[0]
            for layer in p["highway"]:
                w_carry, w_transform = layer["w"][:, :f], layer["w"][:, f:]
                b_carry, b_transform = layer["b"][:f], layer["b"][f:]
                g = _sigmoid(h @ w_carry + b_carry)
                t = np.maximum(h @ w_transform + b_transform, 0.0)
                h = g * t + (1.0 - g) * h
            self._vectors[word] = h @ p["proj"]["w"] + p["proj"]["b"]
        return self._vectors[word]

    def zero_state(self):
        l = self.model.lstm
        return [(np.zeros(l.dim), np.zeros(l.projection_dim)) for _ in range(l.n_layers)]

    def _cell(self, layer, d, x, c, h):
        l = self.model.lstm
        z = x @ layer["w_x"][d] + h @ layer["w_h"][d] + layer["b"][d]
        i, j, f, o = np.split(z, 4)
        c = _sigmoid(f + 1.0) * c + _sigmoid(i) * np.tanh(j)
        self.clipped["cell"] += int(np.sum(np.abs(c) > l.cell_clip))
        c = np.clip(c, -l.cell_clip, l.cell_clip)
        h = (_sigmoid(o) * np.tanh(c)) @ layer["w_proj"][d]
        self.clipped["proj"] += int(np.sum(np.abs(h) > l.proj_clip))
        h = np.clip(h, -l.proj_clip, l.proj_clip)
        return c, h

    def step(self, d: int, word: str, state):
        """One input word through direction ``d``'s stack: (top output, new state)."""
        x, new_state = self.token_vector(word), []
        for k, (layer, (c, h)) in enumerate(zip(self.p["bilm"]["lstm"], state)):
            c, h = self._cell(layer, d, x, c, h)
            new_state.append((c, h))
            x = h + x if (self.model.lstm.use_skip_connections and k > 0) else h
        return x, new_state

    def cross_entropy(self, top: np.ndarray, target: int) -> float:
        logits = self.p["softmax"]["w"] @ top + self.p["softmax"]["b"]
        m = logits.max()
        return float(m + np.log(np.exp(logits - m).sum()) - logits[target])


def direction_pairs(sentence: list[str], d: int) -> list[tuple[str, str]]:
    """(input word, target word) pairs: ``<S> w1..wn -> w1..wn </S>``, or reversed, markers swapped."""
    if d == 0:
        return list(zip(["<S>"] + sentence, sentence + ["</S>"]))
    rev = sentence[::-1]
    return list(zip(["</S>"] + rev, rev + ["<S>"]))


def deal_windows(sentences: list[list[str]], d: int, rows: int, steps: int):
    """Complete windows ``[rows][steps]`` of pairs: row r, in row order, takes the next whole
    sentence (file order) while it holds fewer than ``steps`` pairs; leftovers carry over."""
    pending = iter(sentences)
    buffers = [[] for _ in range(rows)]
    windows = []
    while True:
        for r in range(rows):
            while len(buffers[r]) < steps:
                s = next(pending, None)
                if s is None:
                    return windows
                buffers[r].extend(direction_pairs(s, d))
        windows.append([b[:steps] for b in buffers])
        buffers = [b[steps:] for b in buffers]


def word_ids(vocab_words: list[str]):
    index = {w: i for i, w in enumerate(vocab_words)}
    return lambda w: index.get(w, index["<UNK>"])


# -- 1. perplexity ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fresh_state():
    """``init_state`` for MODEL and V words, 2 rows (host arrays, the softmax in id order)."""
    tc = TrainConfig(n_tokens_vocab=V, batch_size=2, n_negative_samples_batch=8)
    state = jax.device_get(init_state(jax.random.PRNGKey(1), MODEL, tc))
    return {**softmax_in_id_order(state.shared(), LAYOUT), "lstm": state.lstm}


def _perturbed_params(state, seed: int = 0):
    """Init params with every leaf nudged (non-zero biases) and W_P scaled up, so that both clips
    are active somewhere in the test text. (Scaling all LSTM weights up makes the recurrence
    chaotic: float32 round-off then grows to 1e-3 over 40 steps, a test artefact, not a bug.)"""
    params = state["params"]
    rng = np.random.default_rng(seed)
    params = jax.tree_util.tree_map(lambda x: np.asarray(x + 0.3 * rng.standard_normal(x.shape), np.float32), params)
    for layer in params["bilm"]["lstm"]:
        layer["w_proj"] = layer["w_proj"] * np.float32(3.0)
    return params


@pytest.fixture(scope="module")
def eval_setup(tmp_path_factory, fresh_state):
    d = tmp_path_factory.mktemp("eval")
    (d / "vocab.txt").write_text("\n".join(EVAL_VOCAB) + "\n", encoding="utf-8")
    (d / "heldout.txt").write_text(EVAL_TEXT, encoding="utf-8")
    vocab = Vocabulary.load(d / "vocab.txt")
    params = _perturbed_params(fresh_state)
    sentences = [line.split() for line in EVAL_TEXT.splitlines() if line.strip()]
    return vocab, params, TextFiles(str(d / "heldout.txt")), sentences


def test_evaluate_matches_numpy_stateful_streams(eval_setup):
    vocab, params, source, sentences = eval_setup
    rows, steps = 2, 3
    ref = NumpyBiLM(params, MODEL)
    to_id = word_ids(EVAL_VOCAB)
    sums, counts = [], []
    for d in range(2):
        windows = deal_windows(sentences, d, rows, steps)
        states = [ref.zero_state() for _ in range(rows)]  # carried per row across windows
        total = 0.0
        for window in windows:
            for r in range(rows):
                for word, target in window[r]:
                    top, states[r] = ref.step(d, word, states[r])
                    total += ref.cross_entropy(top, to_id(target))
        sums.append(total)
        counts.append(len(windows) * rows * steps)
    assert counts[0] == counts[1] and counts[0] >= 5 * rows * steps  # several windows, state carried
    assert ref.clipped["cell"] > 0 and ref.clipped["proj"] > 0, ref.clipped  # both clips exercised
    fwd, bwd = sums[0] / counts[0], sums[1] / counts[1]

    got = evaluate(params, MODEL, vocab, source, batch_size=rows, unroll_steps=steps)
    assert got["tokens"] == counts[0]
    assert got["perplexity_fwd"] == pytest.approx(np.exp(fwd), rel=1e-5)
    assert got["perplexity_bwd"] == pytest.approx(np.exp(bwd), rel=1e-5)
    assert got["perplexity"] == pytest.approx(np.exp(0.5 * (fwd + bwd)), rel=1e-5)
    # A training state's softmax, in slot order with padding slots (given non-zero weights here,
    # so that only the mask keeps them out), gives the same numbers.
    sm = params["softmax"]
    stored = {"w": LAYOUT.to_stored(sm["w"], fill=1.0), "b": LAYOUT.to_stored(sm["b"], fill=5.0)}
    slot_order = evaluate(
        {**params, "softmax": stored}, MODEL, vocab, source, batch_size=rows, unroll_steps=steps, layout=LAYOUT
    )
    for k in ("perplexity_fwd", "perplexity_bwd"):
        assert slot_order[k] == pytest.approx(got[k], rel=1e-6)


def test_evaluate_s_bar_counts_its_windows_and_changes_no_number(eval_setup, capsys):
    """``progress``: a bar on stderr over the windows, as many as the reference deals; the
    numbers are those without it. There are more windows than ``IN_FLIGHT``, so the bound on the
    windows dispatched ahead is reached. Negative control: without ``progress``, nothing said."""
    vocab, params, source, sentences = eval_setup
    windows = len(deal_windows(sentences, 0, 2, 3))
    assert windows > IN_FLIGHT
    quiet = evaluate(params, MODEL, vocab, source, batch_size=2, unroll_steps=3)
    assert capsys.readouterr().err == ""
    assert evaluate(params, MODEL, vocab, source, batch_size=2, unroll_steps=3, progress=True) == quiet
    assert f"{windows}/{windows} [" in capsys.readouterr().err


def test_evaluate_takes_a_list_of_sentences_and_says_what_else_it_was_given(eval_setup):
    """(Before: a list of str raised AttributeError "'list' object has no attribute 'read'" from
    the batcher; the options for their model, "'Options' object has no attribute 'lstm'"; the
    biLM's params alone, KeyError 'softmax'.)"""
    vocab, params, source, _ = eval_setup
    as_files = evaluate(params, MODEL, vocab, source, batch_size=2, unroll_steps=3)
    assert evaluate(params, MODEL, vocab, EVAL_TEXT.splitlines(), batch_size=2, unroll_steps=3) == as_files
    refused = [
        ((params, MODEL, vocab, "heldout.txt"), "source is a str; expected sentences: TextFiles(glob) for files"),
        ((params, Options(model=MODEL), vocab, source), "model is a Options; expected a ModelConfig: give options.model"),
        ((params["bilm"], MODEL, vocab, source), "params must be a run's {'bilm': ..., 'softmax': ...} (load_run gives"),
        ((params, MODEL, EVAL_VOCAB, source), "vocab is a list; expected a Vocabulary (load_run gives the run's)"),
    ]  # fmt: skip
    for args, said in refused:
        with pytest.raises(TypeError) as e:
            evaluate(*args, batch_size=2, unroll_steps=3)
        assert str(e.value).startswith(said), str(e.value)
    # A vocabulary of other words than the softmax scores (before: a perplexity of ids past its rows).
    other = Vocabulary([*vocab.words, "extra"], source="other.txt")
    with pytest.raises(ValueError) as e:
        evaluate(params, MODEL, other, source, batch_size=2, unroll_steps=3)
    assert str(e.value).startswith(f"vocab (other.txt) has {len(vocab) + 1} words but the softmax scores {len(vocab)}")
    # Lines of one str: its letters would be the sentences (before: a perplexity of 831 over
    # one-letter sentences, where the sentence itself gives another).
    for text, said in (
        ("The cat sat .", "lines is a str; expected a list of str"),
        (["a", 3], "lines holds a int (3)"),
    ):
        with pytest.raises(TypeError, match=re.escape(said)):
            Lines(text)  # type: ignore[arg-type]
    assert Lines(line for line in ("The cat sat .", " ")).lines == ["The cat sat ."]


@pytest.mark.parametrize("steps", [3, 20])
def test_evaluate_matches_numpy_reset_per_sentence(eval_setup, steps):
    """Sentences packed into 3 streams: windows of 3 tokens cut through sentences (the state
    carried over, reset at each start), windows of 20 hold several whole (padding at the end)."""
    vocab, params, source, sentences = eval_setup
    ref = NumpyBiLM(params, MODEL)
    to_id = word_ids(EVAL_VOCAB)
    # `scored`: only targets outside this set count (e.g. words another model's vocabulary lacks);
    # <UNK> among them.
    skip = {to_id("the"), to_id("<UNK>"), to_id("</S>")}
    sums, count, kept_sums, kept, unks = np.zeros(2), 0, np.zeros(2), np.zeros(2), 0
    for s in sentences:
        for d in range(2):
            state = ref.zero_state()  # every sentence alone, from zero state
            for word, target in direction_pairs(s, d):
                top, state = ref.step(d, word, state)
                ce = ref.cross_entropy(top, to_id(target))
                sums[d] += ce
                unks += to_id(target) == to_id("<UNK>")
                if to_id(target) not in skip:
                    kept_sums[d] += ce
                    kept[d] += 1
        count += len(s) + 1
    fwd, bwd = sums / count
    assert unks > 0 and kept.min() < count

    got = evaluate(params, MODEL, vocab, source, batch_size=3, unroll_steps=steps, reset_state_per_sentence=True)
    assert got["tokens"] == count
    assert got["perplexity_fwd"] == pytest.approx(np.exp(fwd), rel=1e-5)
    assert got["perplexity_bwd"] == pytest.approx(np.exp(bwd), rel=1e-5)
    assert got["perplexity"] == pytest.approx(np.exp(0.5 * (fwd + bwd)), rel=1e-5)
    assert got["unk_rate"] == pytest.approx(unks / (2 * count))
    scored = np.ones(len(EVAL_VOCAB), bool)
    scored[list(skip)] = False
    part = evaluate(
        params, MODEL, vocab, source, batch_size=3, unroll_steps=steps, reset_state_per_sentence=True, scored=scored
    )
    fwd, bwd = kept_sums / kept
    assert part["perplexity_fwd"] == pytest.approx(np.exp(fwd), rel=1e-5)
    assert part["perplexity_bwd"] == pytest.approx(np.exp(bwd), rel=1e-5)
    assert part["perplexity"] == pytest.approx(np.exp(0.5 * (fwd + bwd)), rel=1e-5)


def test_per_sentence_evaluation_of_no_text_says_so(eval_setup):
    """Packed windows hold any text: only none (or none scored) is left to refuse, and a smaller
    batch_size, the carried protocol's advice, cannot help there."""
    from elmo_jax.text.sources import DataError, Lines

    vocab, params, _, _ = eval_setup
    with pytest.raises(DataError, match=r"^the held-out text \(<lines>\) has no sentence to score; give a file"):
        evaluate(params, MODEL, vocab, Lines([" "]), batch_size=3, reset_state_per_sentence=True)
    none = np.zeros(len(EVAL_VOCAB), bool)
    with pytest.raises(DataError, match=r"has no target among the scored ids; score more ids, or give other text$"):
        evaluate(params, MODEL, vocab, Lines(["the cat"]), batch_size=3, reset_state_per_sentence=True, scored=none)


@pytest.mark.parametrize("reset", [False, True])
def test_evaluate_is_the_same_on_one_or_two_devices_in_any_block_size(eval_setup, reset):
    """Rows split over the devices (3 rows on 2: one padding row), softmax rows split too, and
    scored 8 at a time or all at once: one number."""
    from jax.sharding import Mesh

    vocab, params, source, _ = eval_setup
    one = Mesh(np.array(jax.devices()[:1]), ("data",))
    two = Mesh(np.array(jax.devices()[:2]), ("data",))
    kw = dict(batch_size=3, unroll_steps=4, reset_state_per_sentence=reset)
    a = evaluate(params, MODEL, vocab, source, mesh=one, **kw)
    b = evaluate(params, MODEL, vocab, source, mesh=two, block=8, **kw)
    assert a["tokens"] == b["tokens"] > 0
    for k in ("perplexity_fwd", "perplexity_bwd"):
        assert b[k] == pytest.approx(a[k], rel=1e-6)


# -- 2. sparse softmax update == dense Adagrad ---------------------------------------------------

TRAIN_WORDS = ["<S>", "</S>", "<UNK>"] + [f"w{k}" for k in range(3, V)]
# Frequent low ids (likely candidates too) and repeats, so targets hit candidates and repeat.
TRAIN_TEXT = """w3 w4 w3 w40
w5 w3 w41 w3 w4
w42 w6 w43
w3 w44 w7 w3 unknownword
w45 w4 w46 w5
w3 w3 w47
"""


def _train_batch(tmp_path, tc: TrainConfig, step: int = 0):
    (tmp_path / "train.txt").write_text(TRAIN_TEXT, encoding="utf-8")
    vocab = Vocabulary(TRAIN_WORDS)
    batcher = LMBatcher(
        TextFiles(str(tmp_path / "train.txt")),
        vocab,
        rows_per_device=tc.batch_size,
        unroll_steps=tc.unroll_steps,
        max_chars=MODEL.char_cnn.max_characters_per_token,
        seed=3,
    )
    batch, _ = prepare_batch(batcher.next(), step=step, seed=5, train=tc, n_devices=1, fixed=True)
    return {k: jnp.asarray(v[0]) for k, v in batch.items()}  # device 0


def _reference_step(state, batch, tc: TrainConfig):
    """jax.grad w.r.t. the full softmax, global-norm clip over everything, optax Adagrad."""
    targets, cands = batch["targets"], batch["candidates"]
    n_pos = targets.shape[1] * targets.shape[2]
    p = MODEL.lstm.projection_dim

    def loss_fn(params):
        sm = params["softmax"]
        x = char_cnn.apply(params["bilm"]["char_cnn"], MODEL, batch["chars"])[batch["inputs"]]
        outs, new_lstm = lstm.run(params["bilm"]["lstm"], MODEL, x, jnp.ones(targets.shape[1:], bool), state["lstm"])
        per_dir = []
        for d in range(2):
            # bilm-tf's towers: each group of rows_per_draw rows is scored against its own draw,
            # and the towers' mean losses are averaged.
            groups = []
            for g, rows in enumerate(np.split(np.arange(targets.shape[1]), tc.draws_per_device)):
                t = targets[d, rows].reshape(-1)
                c = cands[d, g]
                groups.append(
                    sampled_softmax_loss(
                        outs[-1, d, rows].reshape(t.size, p),
                        t,
                        sm["w"][t],
                        sm["b"][t],
                        c,
                        sm["w"][c],
                        sm["b"][c],
                        batch["num_tries"][d, g],
                        tc.n_tokens_vocab,
                    ).mean()
                )
            per_dir.append(sum(groups) / len(groups))
        return 0.5 * (per_dir[0] + per_dir[1]) * tc.unroll_steps, (jnp.stack(per_dir), new_lstm)

    params = state["params"]
    grads, (per_dir, new_lstm) = jax.grad(loss_fn, has_aux=True)(params)
    norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree_util.tree_leaves(grads)))
    grads = jax.tree_util.tree_map(lambda g: g * jnp.minimum(1.0, tc.all_clip_norm_val / norm), grads)
    opt = optax.adagrad(tc.learning_rate, initial_accumulator_value=1.0, eps=0.0)
    updates, opt_state = opt.update(grads, opt.init(params), params)
    return optax.apply_updates(params, updates), opt_state[0].sum_of_squares, norm, per_dir * n_pos, new_lstm


# The backend's layout, the GPU's, and the GPU's with the switches a GPU has yet to time, run here.
EVERY_LAYOUT = pytest.mark.parametrize(
    "layout",
    [
        None,
        pytest.param(BY_BACKEND["gpu"], marks=pytest.mark.slow),
        pytest.param(gpu_candidates(), marks=pytest.mark.slow),
    ],
    ids=["backend", "gpu-layout", "gpu-candidates"],
)


@EVERY_LAYOUT
@pytest.mark.parametrize("rows_per_draw", [0, 1], ids=["one-draw", "draw-per-row"])
def test_sparse_softmax_update_equals_dense_adagrad(tmp_path, fresh_state, layout, rows_per_draw):
    """Also under the GPU's layout (batch-major, unrolled scan, one char-CNN block), and with the
    switches a GPU has yet to time, run here; and with a draw of candidates per row, as bilm-tf
    draws per GPU tower (here 2 towers of 1 row)."""
    # A small clip so that clipping is active: then the norm (which must count a row that is
    # both target and candidate once, with its summed gradient) scales every update.
    tc = TrainConfig(
        n_tokens_vocab=V,
        batch_size=2,
        unroll_steps=5,
        n_negative_samples_batch=8,
        dropout=0.0,
        all_clip_norm_val=0.5,
        learning_rate=0.2,
        reset_state_prob=0.0,
        rows_per_draw=rows_per_draw,
    )  # bilm-tf's recipe: the reference carries the state
    batch = _train_batch(tmp_path, tc)
    targets, cands = np.asarray(batch["targets"]), np.asarray(batch["candidates"])
    assert cands.shape == (2, tc.draws_per_device, tc.n_negative_samples_batch)
    if rows_per_draw:
        assert not np.array_equal(cands[:, 0], cands[:, 1]), "want two different draws"
    for d in range(2):
        assert set(targets[d].ravel()) & set(cands[d].ravel()), "want an accidental hit"
        assert len(np.unique(targets[d])) < targets[d].size, "want duplicate targets"
    touched = np.union1d(targets.ravel(), cands.ravel())
    untouched = np.setdiff1d(np.arange(V), touched)
    assert len(untouched) >= 10

    state = jax.tree_util.tree_map(jnp.asarray, fresh_state)
    assert state["lstm"]["c"].shape[2] == tc.batch_size
    # A non-zero carried state, as after an earlier window.
    rng = np.random.default_rng(0)
    state["lstm"] = jax.tree_util.tree_map(
        lambda x: jnp.asarray(rng.uniform(-1, 1, x.shape), jnp.float32), state["lstm"]
    )
    # Accumulators are 1.0 at init; keep them so, but make the softmax bias non-zero.
    state["params"]["softmax"]["b"] = jnp.asarray(rng.normal(0, 0.5, V), jnp.float32)
    old = jax.device_get(state)

    ref_params, ref_acc, ref_norm, ref_loss_sums, ref_lstm = jax.jit(functools.partial(_reference_step, tc=tc))(
        state, batch
    )
    # The step works on the softmax in slot order (padding slots included); the reference in id order.
    stored = softmax_in_slot_order(jax.device_get({k: v for k, v in state.items() if k != "lstm"}), LAYOUT)
    step = jax.jit(functools.partial(train_step, model=MODEL, train=tc, axis_name=None, compute=Compute(layout=layout)))
    new_stored, metrics = step(TrainState(**stored, lstm=state["lstm"]), batch)
    new_stored, metrics = jax.device_get((new_stored, metrics))
    pad = ~LAYOUT.valid()
    for part, fill in (("params", 0.0), ("opt", 1.0)):  # padding slots: never touched
        for name in ("w", "b"):
            np.testing.assert_array_equal(getattr(new_stored, part)["softmax"][name][pad], fill)
    new = {**softmax_in_id_order(new_stored.shared(), LAYOUT), "lstm": new_stored.lstm}
    ref_params, ref_acc = jax.device_get((ref_params, ref_acc))

    assert float(metrics["grad_norm"]) > tc.all_clip_norm_val  # clipping active
    assert float(metrics["grad_norm"]) == pytest.approx(float(ref_norm), rel=1e-5)
    np.testing.assert_allclose([metrics["loss_sum_fwd"], metrics["loss_sum_bwd"]], ref_loss_sums, rtol=1e-6)
    assert int(new["step"]) == 1

    def close(a, b):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)

    jax.tree_util.tree_map(close, new["params"], ref_params)
    close(new["opt"]["softmax"]["w"], ref_acc["softmax"]["w"])
    close(new["opt"]["softmax"]["b"], ref_acc["softmax"]["b"])
    jax.tree_util.tree_map(close, new["opt"]["bilm"][0].sum_of_squares, ref_acc["bilm"])
    jax.tree_util.tree_map(close, new["lstm"], jax.device_get(ref_lstm))
    if rows_per_draw:
        # Negative control: one draw for both rows (the first) is another update, which the
        # comparison above would have seen.
        one_draw = {**batch, "candidates": batch["candidates"][:, :1], "num_tries": batch["num_tries"][:, :1]}
        one_tc = dataclasses.replace(tc, rows_per_draw=0)
        wrong = jax.jit(functools.partial(_reference_step, tc=one_tc))(state, one_draw)[0]
        assert np.abs(np.asarray(wrong["softmax"]["w"]) - ref_params["softmax"]["w"]).max() > 1e-4

    # Every touched row moved and its accumulator grew; untouched rows are bit-identical.
    for name in ("w", "b"):
        new_w, old_w = new["params"]["softmax"][name], old["params"]["softmax"][name]
        acc = new["opt"]["softmax"][name]
        np.testing.assert_array_equal(new_w[untouched], old_w[untouched])
        np.testing.assert_array_equal(acc[untouched], 1.0)
        assert np.all((acc[touched] > 1.0).reshape(len(touched), -1).any(axis=1))
        assert np.all((new_w[touched] != old_w[touched]).reshape(len(touched), -1).any(axis=1))


@EVERY_LAYOUT
def test_with_jax_enable_x64_the_state_and_a_step_stay_float32(tmp_path, layout):
    """A process with ``jax_enable_x64`` on (a notebook that needs float64 elsewhere) trains as any
    other: before, the initialisers drew float64 (46 of the state's leaves), so the whole run went
    at float64's speed and memory, and saved float64 checkpoints. Under every layout: the
    wavefront's skip mask was float64 there, and its scan refused the float64 carry it made."""
    tc = TrainConfig(n_tokens_vocab=V, batch_size=2, unroll_steps=5, n_negative_samples_batch=8)
    with jax.enable_x64(True):
        state = init_state(jax.random.PRNGKey(1), MODEL, tc)
        batch = _train_batch(tmp_path, tc)
        step = jax.jit(
            functools.partial(train_step, model=MODEL, train=tc, axis_name=None, compute=Compute(layout=layout))
        )
        new, metrics = step(state, batch)
        for tree in (state, new, metrics):
            kinds = {str(x.dtype) for x in jax.tree_util.tree_leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)}
            assert kinds == {"float32"}, kinds
        assert jnp.zeros(()).dtype == jnp.float64  # the control: x64 is on here


# -- 3. no dense [V, P] temporary ------------------------------------------------------------------


@pytest.mark.slow
def test_compiled_step_has_no_dense_softmax_temporary():
    v, p = 200_000, 16
    # The smallest model with P = 16: the question is the softmax, and compiles cost seconds here.
    model = ModelConfig(
        char_cnn=CharCNNConfig(embedding_dim=4, filters=((1, p),), n_highway=0, max_characters_per_token=10),
        lstm=LSTMConfig(dim=16, projection_dim=p, n_layers=1, cell_clip=3.0, proj_clip=3.0),
    )
    tc = TrainConfig(n_tokens_vocab=v, batch_size=2, unroll_steps=4, n_negative_samples_batch=64, dropout=0.1)
    state = jax.eval_shape(lambda: init_state(jax.random.PRNGKey(0), model, tc))
    b, t, s, c = tc.batch_size, tc.unroll_steps, tc.n_negative_samples_batch, model.char_cnn.max_characters_per_token
    i32 = jnp.int32
    batch = {
        "chars": jax.ShapeDtypeStruct((64, c), i32),
        "inputs": jax.ShapeDtypeStruct((2, b, t), i32),
        "targets": jax.ShapeDtypeStruct((2, b, t), i32),
        "rows": jax.ShapeDtypeStruct((b,), i32),
        "starts": jax.ShapeDtypeStruct((2, b, t), bool),
        "candidates": jax.ShapeDtypeStruct((2, 1, s), i32),
        "num_tries": jax.ShapeDtypeStruct((2, 1), jnp.float32),
        "fetch": jax.ShapeDtypeStruct((1, 2 * s + 2 * b * t), i32),
        "cand_index": jax.ShapeDtypeStruct((2, 1, s), i32),
        "target_index": jax.ShapeDtypeStruct((2, b, t), i32),
    }
    step = jax.jit(functools.partial(train_step, model=model, train=tc, axis_name=None), donate_argnums=0)
    compiled = step.lower(state, batch).compile()
    dense = v * p * 4
    mem = compiled.memory_analysis()
    assert mem is not None, "memory_analysis unavailable on this backend"
    assert mem.temp_size_in_bytes < dense / 2, (mem.temp_size_in_bytes, dense)
    # Donation: the [V, P] weights and accumulators are updated in place, not copied to new outputs.
    assert mem.output_size_in_bytes - mem.alias_size_in_bytes < dense / 2, mem

    # The check can fail: a step with a dense softmax gradient, applied in place to the same
    # donated state, needs a [V, P] temporary (the gradient) and shows it.
    def dense_softmax_step(state, batch):
        n = b * t

        def loss(sm):
            h = jnp.broadcast_to(batch["num_tries"][0, 0], (n, p))
            total = 0.0
            for d in range(2):
                tg, cd = batch["targets"][d].reshape(n), batch["candidates"][d, 0]
                total += sampled_softmax_loss(
                    h, tg, sm["w"][tg], sm["b"][tg], cd, sm["w"][cd], sm["b"][cd], batch["num_tries"][d, 0], v
                ).mean()
            return total

        sm = state.params["softmax"]
        g = jax.grad(loss)(sm)
        acc = jax.tree_util.tree_map(lambda a, gg: a + gg * gg, state.opt["softmax"], g)
        new = jax.tree_util.tree_map(lambda w, gg, a: w - tc.learning_rate * gg * jax.lax.rsqrt(a), sm, g, acc)
        return state.replace(params={**state.params, "softmax": new}, opt={**state.opt, "softmax": acc})

    control = jax.jit(dense_softmax_step, donate_argnums=0).lower(state, batch).compile().memory_analysis()
    assert control.temp_size_in_bytes >= dense, control


# -- 5. zero-state starts in training ------------------------------------------------------------


@pytest.mark.parametrize("prob", [pytest.param(0.0, marks=pytest.mark.slow), 1.0])
def test_reset_state_prob_starts_sentences_from_zero_state(tmp_path, prob):
    """With ``reset_state_prob`` 1 every sentence start zeroes the carried state, so a window
    whose rows all open with a sentence does not depend on the state carried into it; with 0
    (bilm-tf) it does. Dropout on: resets and dropout draw from the same row keys, apart."""
    (tmp_path / "vocab.txt").write_text("\n".join(EVAL_VOCAB) + "\n", encoding="utf-8")
    (tmp_path / "text.txt").write_text(EVAL_TEXT, encoding="utf-8")
    vocab = Vocabulary.load(tmp_path / "vocab.txt")
    tc = TrainConfig(
        n_tokens_vocab=V, batch_size=2, unroll_steps=5, n_negative_samples_batch=8, dropout=0.1, reset_state_prob=prob
    )
    batcher = LMBatcher(
        TextFiles(str(tmp_path / "text.txt")),
        vocab,
        rows_per_device=2,
        unroll_steps=5,
        max_chars=MODEL.char_cnn.max_characters_per_token,
        seed=0,
    )
    host, _ = prepare_batch(batcher.next(), step=0, seed=0, train=tc, n_devices=1)
    batch = {k: host[k][0] for k in BATCH_KEYS}
    assert batch["starts"][:, :, 0].all()  # a fresh batcher's rows open with <S> (backward: </S>)
    state = init_state(jax.random.PRNGKey(0), MODEL, tc)
    rng = np.random.default_rng(0)
    carried = {k: jnp.asarray(rng.uniform(-1, 1, x.shape), jnp.float32) for k, x in state.lstm.items()}
    step = jax.jit(functools.partial(train_step, model=MODEL, train=tc, axis_name=None))
    losses = [
        np.asarray([m["loss_sum_fwd"], m["loss_sum_bwd"]])
        for m in (step(state, batch)[1], step(state.replace(lstm=carried), batch)[1])
    ]
    if prob == 1.0:
        np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)
    else:
        assert np.abs(losses[0] - losses[1]).min() > 1e-3
