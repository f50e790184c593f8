"""Held-out perplexity under the full softmax: both protocols, one device program.

Two protocols, as in the references:

- carried (bilm-tf's ``test.py``): the held-out text is dealt into ``batch_size`` row streams in
  file order, ``unroll_steps`` tokens at a time, and each row's LSTM state is carried from one
  window to the next across sentence boundaries;
- per sentence: every sentence alone from zero state, ``<S> w..`` -> ``w.. </S>`` (and reversed).
  The sentences are packed whole into the row streams, and the state is reset where each starts
  (``lstm.run``'s ``resets``), so that this protocol too runs one window shape, with padding
  only at the streams' ends.

Both feed the same step: a window of rows with a mask (padding rows; the streams' ends) and the
LSTM state carried in and out. The rows are split over the devices of a mesh for the char-CNN
and the LSTM; the top-layer outputs are then all-gathered, and each device scores every position
against its own contiguous share of the softmax rows, ``block`` rows at a time
(``softmax.full_softmax_loss``), so that no ``[positions, V]`` logits ever exist. A training
state's softmax, in ``RowLayout`` slot order and already split by rows, is used where it lies.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from elmo_jax._util.arguments import about
from elmo_jax._util.device_memory import CHECK_THE_DEVICE, device_error
from elmo_jax._util.lpt import longest_first
from elmo_jax._util.terminal import bar_size
from elmo_jax.config import ModelConfig, check_counts
from elmo_jax.model import lstm
from elmo_jax.model.compute import Compute
from elmo_jax.model.vocabulary import Vocabulary
from elmo_jax.text.sources import DataError, Source, as_source
from elmo_jax.training.batches import LMBatcher, WordTable, split_over_devices
from elmo_jax.training.sharded_softmax import RowLayout
from elmo_jax.training.softmax import full_softmax_loss
from elmo_jax.training.step import AXIS, make_zero_rows, put_global, token_vectors

# Rows of the softmax scored at once per device: logits of [2 x rows x steps, BLOCK] float32 are
# 84 MB at bilm-tf's 128 x 20, whatever the vocabulary.
BLOCK = 4096
IN_FLIGHT = 4  # windows dispatched ahead of the last one known scored


def _check_arguments(params, model, vocab, source, layout: RowLayout | None = None) -> Source:
    """``evaluate``'s arguments, each said in one line where it is not what it takes; a list of
    sentences (str) is taken as ``Lines``."""
    if not isinstance(model, ModelConfig):
        hint = ": give options.model" if hasattr(model, "model") else ""
        raise TypeError(f"model is a {type(model).__name__}; expected a ModelConfig{hint}")
    if not isinstance(params, Mapping) or not {"bilm", "softmax"} <= set(params):
        got = sorted(params) if isinstance(params, Mapping) else type(params).__name__
        raise TypeError(
            f"params must be a run's {{'bilm': ..., 'softmax': ...}} (load_run gives them), got {got}: "
            "perplexity needs the softmax"
        )
    if not isinstance(vocab, Vocabulary):
        raise TypeError(f"vocab is a {type(vocab).__name__}; expected a Vocabulary (load_run gives the run's)")
    rows = getattr(params["softmax"].get("w"), "shape", (None,))[0] if isinstance(params["softmax"], Mapping) else None
    words = layout.vocab_size if layout is not None else rows
    if words != len(vocab):  # ids past the softmax's rows would read rows that are not there
        raise about(
            ValueError(
                f"vocab ({vocab.source}) has {len(vocab)} words but the softmax scores {words}: give the vocabulary "
                "these params were trained with (load_run gives a run's)"
            ),
            "vocab",
        )
    return as_source(source, "source")


def evaluate(
    params: dict,
    model: ModelConfig,
    vocab: Vocabulary,
    source: Source,
    *,
    batch_size: int = 16,
    unroll_steps: int = 20,
    reset_state_per_sentence: bool = False,
    compute: Compute = Compute(),
    layout: RowLayout | None = None,
    mesh: Mesh | None = None,
    block: int = BLOCK,
    scored: np.ndarray | None = None,
    progress: bool = False,
) -> dict:
    """Full-softmax perplexities: ``{"perplexity", "perplexity_fwd", "perplexity_bwd", "tokens",
    "unk_rate"}`` of ``source``'s sentences (``TextFiles``, ``Lines``, ``TfdsSource``, or a list of
    str, one whitespace-tokenized sentence each).

    ``perplexity`` is ``exp(mean CE)`` over all target tokens with ``CE = 0.5 * (CE_fwd +
    CE_bwd)`` per position (bilm-tf's mean over equal-sized batches is the same number).
    ``batch_size`` is the number of row streams and ``unroll_steps`` a window's length, whatever
    the number of devices: the carried protocol's result depends on both (the per-sentence
    protocol's on neither), never on the devices.

    ``params["softmax"]`` (``w [V, P]``, ``b [V]``) is in id order (``run_dir.load_run``), or in
    ``layout``'s slot order (a training state's ``[V_pad, P]``, padding slots ignored).
    ``mesh``: a 1-D mesh over ``"data"``; default, that of a softmax already split over one, else
    every device. Multi-process: every process calls this with the same text and params.

    ``scored``: ``[V]`` bool, the target ids that count (default: all). Models with different
    vocabularies are comparable only on targets every one of them can name: the others still
    feed the LSTM as inputs, but their losses are left out (``tokens`` counts per direction's
    mean). ``unk_rate``: the share of target positions that are ``<UNK>`` in ``vocab``.
    ``compute``: the biLM's matmul precision, compute dtype and layout (``elmo_jax.model.compute``;
    default: float32, the references' numbers). ``progress``: a tqdm bar on stderr (process 0's)
    over the windows as they are scored.
    """
    source = _check_arguments(params, model, vocab, source, layout)
    evaluator = HeldoutEvaluator(
        model,
        vocab,
        source,
        mesh or _mesh_of(params["softmax"]["w"]),
        batch_size=batch_size,
        unroll_steps=unroll_steps,
        reset_state_per_sentence=reset_state_per_sentence,
        compute=compute,
        layout=layout,
        block=block,
        scored=scored,
    )
    bar = tqdm(
        total=len(evaluator.windows),
        unit="window",
        disable=not progress or jax.process_index() != 0,
        **bar_size(sys.stderr),
    )
    try:
        with bar:
            return evaluator(params, on_window=bar.update)
    except jax.errors.JaxRuntimeError as e:
        error = device_error(
            e,
            out_of_memory_said=lambda xla: (
                f"the device ran out of memory ({xla}); batch_size {batch_size} rows is more than it holds: lower "
                "batch_size (the perplexity with carried state depends on it: compare models at one batch_size)"
            ),
            knob="batch_size",
            failed_said=lambda xla: f"the device failed ({xla}); {CHECK_THE_DEVICE} rerun",
        )
        if error is None:
            raise
    raise error  # outside the clause: XLA's traceback is not the message


def _names(source: Source) -> str:
    return ", ".join(source.name(i) for i in range(min(len(source), 3))) + (", ..." if len(source) > 3 else "")


def no_sentence(source: Source, *, training: bool = False) -> DataError:
    """The error for training (or held-out) text with no sentence at all: empty, or blank lines."""
    text, to = ("training text", "train on") if training else ("held-out text", "score")
    return DataError(f"the {text} ({_names(source)}) has no sentence to {to}; give a file with text in it")


def too_little_text(
    source: Source, batch_size: int, unroll_steps: int, *, per_sentence: bool = False, training: bool = False
) -> DataError:
    """The error for held-out text that fills no window of the carried protocol (empty, too short,
    or too few sentences for the rows). ``per_sentence``: the caller can offer that protocol,
    which packs any text into its windows. ``training``: training text that filled no step's
    window (``batch_size``: the rows of one process's devices together)."""
    text, window_of = ("training text", "training step") if training else ("held-out text", "evaluation window")
    lengths = [len(line.split()) for i in range(len(source)) for line in source.read(i)]
    if not lengths:
        return no_sentence(source, training=training)
    pairs = sum(lengths) + len(lengths)  # each sentence also predicts its end marker
    said = f"{len(lengths)} sentence{'' if len(lengths) == 1 else 's'}, {sum(lengths)} tokens"
    window = f"{batch_size} row{'' if batch_size == 1 else 's'} x {unroll_steps} tokens"
    if pairs >= batch_size * unroll_steps:
        # bilm-tf's protocol: a row takes whole sentences in turn, so a few long ones fill a few rows.
        why = f"fills no {window_of} ({window}): each row reads whole sentences, and none are left for the last rows"
    else:
        why = f"is smaller than one {window_of} ({window})"
    knob = "batch_size" if batch_size > 1 else "unroll_steps"  # one row already: only shorter ones can help
    also = ", or reset_state_per_sentence (it packs any text)" if per_sentence else ""
    also += ", or steps, which read the text again as often as they need" if training else ""
    return about(
        DataError(f"the {text} ({_names(source)}: {said}) {why}; give more text or a smaller {knob}{also}"),
        knob,
        *(["reset_state_per_sentence"] if per_sentence else []),
        *(["steps"] if training else []),
    )


class HeldoutEvaluator:
    """``evaluate`` built once and run on many states: the held-out perplexity of a training run.

    Built once: the held-out text dealt into windows (host arrays in each device's layout, with
    their score masks and counts), the compiled step (``_step_fn``, cached per model, mesh and
    compute), the zero LSTM state and the softmax's validity mask on the mesh. A call places
    the params and runs the windows. Arguments as ``evaluate``'s; ``layout`` and ``block`` fix
    the softmax table's shape, so every call's params must have it.
    """

    def __init__(
        self,
        model: ModelConfig,
        vocab: Vocabulary,
        source: Source,
        mesh: Mesh,
        *,
        batch_size: int,
        unroll_steps: int,
        reset_state_per_sentence: bool = False,
        compute: Compute = Compute(),
        layout: RowLayout | None = None,
        block: int = BLOCK,
        scored: np.ndarray | None = None,
    ):
        check_counts(1, batch_size=batch_size, unroll_steps=unroll_steps, block=block)  # 0 would deal windows for ever
        self.mesh, self.layout = mesh, layout
        n_dev = mesh.size
        self.by_row, self.everywhere = NamedSharding(mesh, P(AXIS)), NamedSharding(mesh, P())
        self.block_limit = block
        padded = -(-batch_size // n_dev) * n_dev
        self.zero = make_zero_rows(model, padded, NamedSharding(mesh, P(None, None, AXIS)))()
        self.model, self.compute = model, compute
        if reset_state_per_sentence:
            table = WordTable(vocab, model.char_cnn.max_characters_per_token)
            windows = _sentences(source, vocab, table, batch_size, unroll_steps)
        else:
            batcher = LMBatcher(
                source,
                vocab,
                rows_per_device=batch_size,
                unroll_steps=unroll_steps,
                max_chars=model.char_cnn.max_characters_per_token,
                max_epochs=1,
                shuffle=False,
            )
            table, windows = batcher.table, _windows(batcher)
        to_rows = (lambda ids: ids) if layout is None else (lambda ids: layout.slots(ids).astype(np.int32))
        self.windows, self.count, unks, positions = [], np.zeros(2), 0, 0
        for inputs, targets, mask, resets in windows:
            unks += int((mask[None] & (targets == vocab.unk)).sum())
            positions += 2 * int(mask.sum())
            score = np.broadcast_to(mask[None], targets.shape) if scored is None else mask[None] & scored[targets]
            extra = padded - inputs.shape[1]  # rows that read nothing, so that each device has as many
            inputs, targets = (np.pad(x, ((0, 0), (0, extra), (0, 0))) for x in (inputs, targets))
            mask = np.pad(mask, ((0, extra), (0, 0)))
            score = np.pad(score, ((0, 0), (0, extra), (0, 0)))
            targets = to_rows(targets).astype(np.int32)
            local = split_over_devices(table, inputs, targets, n_dev)
            local = {
                "chars": local["chars"],
                "inputs": local["inputs"],
                "mask": mask.reshape(n_dev, padded // n_dev, -1),
            }
            if resets is not None:
                resets = np.pad(resets, ((0, 0), (0, extra), (0, 0)))
                local["resets"] = resets.reshape(2, n_dev, padded // n_dev, -1).transpose(1, 0, 2, 3)
            self.windows.append((local, (targets, score)))
            self.count += score.sum(axis=(1, 2))
        if self.count.min() == 0 and not reset_state_per_sentence:
            raise too_little_text(source, batch_size, unroll_steps, per_sentence=True)
        if self.count.min() == 0:  # any text fills the packed windows: there is none, or none scored
            said = (
                "no target among the scored ids; score more ids, or give other text"
                if scored is not None
                else "no sentence to score; give a file with text in it"
            )
            raise DataError(f"the held-out text ({_names(source)}) has {said}")
        self.unk_rate = unks / max(positions, 1)

    def __call__(self, params: dict, on_window: Callable[[], None] | None = None) -> dict:
        """``{"perplexity", "perplexity_fwd", "perplexity_bwd", "tokens", "unk_rate"}`` of ``params``
        (``on_window``: called as each window is scored, a sign of progress)."""
        w, b, valid, rows = _softmax_table(params["softmax"], self.layout, self.mesh.size, self.block_limit)
        block = _divisor_at_most(rows // self.mesh.size, self.block_limit)
        placed = {
            "bilm": _place(params["bilm"], self.everywhere),
            "softmax": {"w": _place(w, self.by_row), "b": _place(b, self.by_row)},
        }
        valid = put_global(valid, self.by_row)
        step = _step_fn(self.model, self.mesh, block, compute=self.compute)
        state, sums = self.zero, []
        for local, everywhere in self.windows:
            state, s = step(
                placed, valid, state, put_global(local, self.by_row), put_global(everywhere, self.everywhere)
            )
            sums.append(s)  # read back at the end: the host puts the next window meanwhile
            if len(sums) > IN_FLIGHT:
                # Without a bound the host ran ahead through every window, putting each window's
                # text on the device at once, and "scored" said only that it was dispatched.
                sums[-IN_FLIGHT - 1].block_until_ready()
            if on_window is not None:
                on_window()
        fwd, bwd = np.sum([np.asarray(s.addressable_data(0), np.float64) for s in sums], axis=0) / self.count
        return {
            "perplexity": math.exp(0.5 * (fwd + bwd)),
            "perplexity_fwd": math.exp(fwd),
            "perplexity_bwd": math.exp(bwd),
            "tokens": int(self.count.mean()),
            "unk_rate": self.unk_rate,
        }


def _mesh_of(w) -> Mesh:
    sharding = getattr(w, "sharding", None)
    if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh) and sharding.mesh.axis_names == (AXIS,):
        return sharding.mesh
    return Mesh(np.array(jax.devices()), (AXIS,))


def _divisor_at_most(n: int, limit: int) -> int:
    return max(k for k in range(1, min(n, limit) + 1) if n % k == 0)


def _softmax_table(softmax: dict, layout: RowLayout | None, n_dev: int, block: int):
    """``(w, b, valid, rows)``: a table whose ``rows`` split evenly over ``n_dev`` devices into
    shares with a divisor near ``block``, and which of its rows are words."""
    if layout is not None:  # RowLayout pads to a multiple of 3,072: shares of 3,072 / n_dev rows
        return softmax["w"], softmax["b"], layout.valid(), softmax["w"].shape[0]
    v = softmax["w"].shape[0]
    share = -(-v // n_dev)
    share = -(-share // 8) * 8 if share <= block else -(-share // block) * block
    rows = share * n_dev
    w, b = np.asarray(softmax["w"]), np.asarray(softmax["b"])
    w = np.concatenate([w, np.zeros((rows - v, w.shape[1]), w.dtype)])
    b = np.concatenate([b, np.zeros(rows - v, b.dtype)])
    return w, b, np.arange(rows) < v, rows


def _place(tree, sharding):
    """Arrays already on devices are resharded there (a no-op when in place); host arrays are put."""
    return jax.tree_util.tree_map(
        lambda x: jax.device_put(x, sharding) if isinstance(x, jax.Array) else put_global(x, sharding), tree
    )


@functools.lru_cache(maxsize=8)  # bounded, as make_train_step: each entry holds a mesh and its compiled programs
def _step_fn(model: ModelConfig, mesh: Mesh, block: int, *, compute: Compute = Compute()):
    """``(params, valid, lstm_state, local, (targets, score)) -> (lstm_state, CE sums [2])``,
    jitted over ``mesh``: ``local`` is each device's rows (``split_over_devices``, their mask
    and, per sentence, their resets), ``targets [2, rows, T]`` (rows of the table) and
    ``score [2, rows, T]`` (the positions that count) are all rows, on every device."""
    p = model.lstm.projection_dim

    def per_device(params, valid, state, local, everywhere):
        local = {k: x[0] for k, x in local.items()}
        targets, score = everywhere
        x = token_vectors(params["bilm"], model, local, compute=compute)
        outs, state = lstm.run(
            params["bilm"]["lstm"], model, x, local["mask"], state, compute=compute, resets=local.get("resets")
        )
        # Every device scores every position against its share of the softmax rows.
        h = jax.lax.all_gather(outs[-1], AXIS, axis=1, tiled=True)  # [2, rows, T, P]
        sm = params["softmax"]
        bias = jnp.where(valid, sm["b"], -jnp.inf)
        ce = full_softmax_loss(
            h.reshape(-1, p),
            targets.reshape(-1),
            sm["w"],
            bias,
            precision=compute.precision,
            block=block,
            axis_name=AXIS,
        )
        return state, jnp.where(score, ce.reshape(targets.shape), 0.0).sum(axis=(1, 2))

    in_specs = ({"bilm": P(), "softmax": P(AXIS)}, P(AXIS), P(None, None, AXIS), P(AXIS), P())
    return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=in_specs, out_specs=(P(None, None, AXIS), P())))


def _windows(batcher: LMBatcher):
    """The carried protocol's windows: ``inputs``, ``targets [2, rows, steps]``, ``mask [rows, steps]``
    and no resets."""
    while True:
        try:
            inputs, targets = batcher.window()
        except StopIteration:
            return
        yield inputs, targets, np.ones(inputs.shape[1:], bool), None


def _sentences(source: Source, vocab: Vocabulary, table: WordTable, rows: int, steps: int):
    """The per-sentence protocol's windows: the sentences packed whole into ``rows`` streams,
    each ``<S> w..`` (``</S> ..w`` backward) starting from zero state by a reset, and dealt
    ``steps`` tokens a window as the carried protocol's are: one window shape, not a compiled
    program per sentence length, and no padding but the streams' ends (longest first, each to
    the shortest stream).
    Yields ``inputs``, ``targets [2, rows, steps]``, ``mask [rows, steps]``, ``resets [2, rows, steps]``."""
    sentences = [line.split() for i in range(len(source)) for line in source.read(i)]
    row, first, longest = longest_first([len(s) + 1 for s in sentences], rows)  # each with its <S>
    total = -(-longest // steps) * steps
    inputs, targets = np.zeros((2, rows, total), np.int64), np.zeros((2, rows, total), np.int64)
    resets, mask = np.zeros((2, rows, total), bool), np.zeros((rows, total), bool)
    for s, r, at in zip(sentences, row, first):
        m = len(s) + 1
        ids = table.input_ids(s)  # looked up once: the backward stream is its reverse
        for d, (seq, start, end) in enumerate(((ids, vocab.bos, vocab.eos), (ids[::-1], vocab.eos, vocab.bos))):
            inputs[d, r, at : at + m] = np.append(start, seq)
            targets[d, r, at : at + m] = np.append(table.targets(seq), end)
        resets[:, r, at] = True
        mask[r, at : at + m] = True
    for lo in range(0, total, steps):
        yield (
            inputs[..., lo : lo + steps],
            targets[..., lo : lo + steps],
            mask[:, lo : lo + steps],
            resets[..., lo : lo + steps],
        )
