"""A pretraining run: run directory, resume, the step loop, logging, held-out perplexity, signals.

The train step itself is in ``step.py`` and knows nothing of files; this module is the wrapper
around it (restore-or-init, hooks every N steps, checkpoint on exit), in the levanter/Haiku style.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import numbers
import os
import socket
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any, cast

import jax
import numpy as np
from etils import epath
from jax.sharding import Mesh, NamedSharding

from elmo_jax import policy
from elmo_jax._util.arguments import about
from elmo_jax._util.atomic import is_local
from elmo_jax._util.device_memory import CHECK_THE_DEVICE, device_error
from elmo_jax._util.lock import FileLock, Held
from elmo_jax._util.paths import check_dir_to_make, check_writable, same_path
from elmo_jax._util.processes import agree_max
from elmo_jax.config import ConfigError, Options, TrainConfig, check_counts, saved_reset_state_prob
from elmo_jax.model.compute import Compute
from elmo_jax.model.vocabulary import VocabError, Vocabulary
from elmo_jax.text.sources import (
    DataError,
    NoSentences,
    Source,
    as_source,
    data_changes,
    fingerprint,
    shard_for_process,
)
from elmo_jax.training.batches import AHEAD_WORDS, LMBatcher
from elmo_jax.training.checkpoint import Checkpointer, CheckpointError, SaveFailed, checkpoint_bytes, vocab_hash
from elmo_jax.training.evaluate import HeldoutEvaluator, no_sentence, too_little_text
from elmo_jax.training.global_batches import GlobalBatches, PeerFailed, StopTogether
from elmo_jax.training.hooks import (
    Diverged,
    DivergenceGuard,
    MetricsFile,
    MetricsWindow,
    Progress,
    SignalStop,
    Stopped,
    logged,
)
from elmo_jax.training.orbax_log import orbax_log
from elmo_jax.training.run_dir import (
    abstract_rows,
    abstract_shared,
    check_run_vocab,
    softmax_in_slot_order,
    write_vocab_file,
)
from elmo_jax.training.sharded_softmax import LayoutError, RowLayout
from elmo_jax.training.step import (
    AXIS,
    TrainState,
    make_init,
    make_train_step,
    make_zero_rows,
    put_global,
    state_shardings,
)
from elmo_jax.training.step import init_state as init_train_state  # pretrain() takes an init_state argument

SEEDS = 2**32  # the seeds a run takes: 0 to SEEDS - 1


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """How to run (not what to train: that is ``Options``). Checked when made: a value out of its
    range is a ``ConfigError`` that names the field, before anything is read or written."""

    run_dir: str
    steps: int | None = None
    """Stop after this many steps in total (counting resumed ones)."""
    epochs: float | None = None
    """Stop after this many passes over the data (default: ``n_epochs`` from the options)."""
    seed: int | None = None
    """Initial weights, data order, dropout, sampled candidates: 0 to ``SEEDS - 1``. None: a resumed
    run's own (what its checkpoints record), else 0. A resumed run keeps its seed: another one would
    deal the rest of the epoch from another shuffle at the saved position (refused, but with
    ``new_data``)."""
    save_every: int = 500
    keep: int = 3
    eval_every: int | None = None
    """Held-out perplexity every this many steps, a multiple of ``log_every`` (0: never). None:
    with held-out text, at every ``save_every`` steps (rounded up to a multiple of ``log_every``),
    so that held-out text given is never ignored; without it, never."""
    log_every: int = 10
    precision: str | None = None
    """Matmul policy (``elmo_jax.policy``). None: ``policy.training_default``, bfloat16 on a TPU or
    a GPU of compute capability 8.0 and up, float32 on older GPUs (T4, V100) and on a CPU."""
    progress: bool = True
    async_save: bool = True
    devices: int | None = None
    """Local devices to use (default: all). Multi-host runs use all of them."""
    prefetch: int = 2
    """Host batches built ahead in a thread (0: built in the loop); see ``GlobalBatches``."""
    host_workers: int = 0
    """Processes drawing the sampled candidates ahead (0: drawn with the batch). On 2 cores,
    since the sampler's faster first-draw pass, neither 1 nor 2 workers beat the default
    (``bench_train.py --pipeline-only``: 4.0-6.0 and 5.5-6.0 against 4.2-5.3 ms a step), hence
    0 until a GPU host is measured."""
    parse_ahead: bool = False
    """Each direction's next shard parsed ahead in a loader process, once a shard of at least
    ``batches.AHEAD_WORDS`` words is met (``LMBatcher``'s ``load_ahead_words``): about 3 s of the
    host's time per direction and 1B Word shard, otherwise spent while the device waits. Like
    ``host_workers``, it starts a process with "spawn": a script that calls ``pretrain`` needs its
    ``if __name__ == "__main__":`` guard. ``elmo-jax train`` turns it on."""
    on_divergence: str = "stop"
    """What a diverged training loss does (``hooks.DivergenceGuard``): "stop" the run, with no
    checkpoint of the diverged state left as the newest; or "warn" once and train on."""
    divergence_margin: float = 1.0
    """Nats above ln V (a uniform guess) that count as diverged."""
    divergence_patience: int = 3
    """Logged steps in a row above that before the guard acts (a non-finite loss acts at once)."""
    new_data: bool = False
    """Resume the weights and optimizer state on training data other than the run's: the data
    position starts afresh on it (continued pretraining within one run dir). Without it, a resume
    on changed data is refused."""

    def __post_init__(self):
        if isinstance(self.run_dir, os.PathLike):  # a pathlib.Path, kept as the str every reader takes
            object.__setattr__(self, "run_dir", os.fspath(self.run_dir))
        if not isinstance(self.run_dir, str) or not self.run_dir:
            raise about(ConfigError(f"run_dir must be a directory's path; got {self.run_dir!r}"), "run_dir")
        if self.precision is not None and self.precision not in policy.POLICIES:
            raise about(
                ConfigError(f"precision must be one of {', '.join(policy.POLICIES)}; got {self.precision!r}"),
                "precision",
            )
        check_counts(
            1,
            save_every=self.save_every,
            keep=self.keep,
            log_every=self.log_every,
            divergence_patience=self.divergence_patience,
        )
        check_counts(0, prefetch=self.prefetch, host_workers=self.host_workers)
        check_counts(0, optional=True, seed=self.seed)
        if self.seed is not None and self.seed >= SEEDS:
            # jax.random.PRNGKey keeps 32 bits (without x64): a larger seed would init and drop out
            # as seed % 2**32 does while numpy shuffled and drew by the whole number.
            raise about(ConfigError(f"seed must be below 2**32 ({SEEDS}); got {self.seed}"), "seed")
        check_counts(1, optional=True, devices=self.devices)
        check_counts(0, optional=True, eval_every=self.eval_every, steps=self.steps)  # 0 steps: nothing to do
        if self.eval_every and self.eval_every % self.log_every:
            raise about(
                ConfigError(
                    f"eval_every {self.eval_every} is not a multiple of log_every "
                    f"{self.log_every} (held-out perplexity is computed at logged steps)"
                ),
                "eval_every",
                "log_every",
            )
        if self.epochs is not None and self.steps is not None:  # (unchecked: epochs ignored, silently)
            raise about(ConfigError("give steps or epochs, not both: each sets where the run stops"), "steps", "epochs")
        if self.epochs is not None and (
            isinstance(self.epochs, bool)
            or not isinstance(self.epochs, numbers.Real)
            or not 0 <= self.epochs < math.inf
        ):
            raise about(ConfigError(f"epochs must be a finite number >= 0; got {self.epochs!r}"), "epochs")
        if self.on_divergence not in DivergenceGuard.MODES:
            raise about(
                ConfigError(
                    f"on_divergence must be one of {', '.join(DivergenceGuard.MODES)}; got {self.on_divergence!r}"
                ),
                "on_divergence",
            )


def options_for_vocab(options: Options, vocab: Vocabulary, n_train_tokens: int | None, strict: bool = True) -> Options:
    """Fills the training keys that follow from the data; refuses a config that does not fit it
    (``strict``: the options' own ``n_tokens_vocab`` must be the vocabulary's size). Options
    without training keys get bilm-tf's recipe for every model (128 rows, 8,192 negatives, 10
    epochs); ``elmo-jax train --config tiny`` trains the tiny preset with a CPU-sized one
    (``setup.TRAIN_DEFAULTS``: 32 rows, 1,024 negatives, 1 epoch): give ``Options(model, train)``
    for that.

    ``n_train_tokens``: tokens + sentences of the training text, in which epochs are counted
    (``count_tokens`` gives both; ``elmo-jax vocab`` writes them beside the vocabulary). None keeps
    the options' own count; options without training keys then have none (null), and a run of
    them takes ``steps``, not epochs. (Before, they took bilm-tf's 1B Word count, 768,648,884: an
    epoch of a small corpus was planned as millions of steps.)"""
    _check_vocab_type(vocab)
    # Without training keys, bilm-tf's recipe for this vocabulary (a small one samples what it has).
    train_cfg = options.train or TrainConfig(
        n_tokens_vocab=len(vocab), n_negative_samples_batch=min(TrainConfig.n_negative_samples_batch, len(vocab) // 2)
    )
    if strict and options.train is not None and train_cfg.n_tokens_vocab != len(vocab):
        raise about(
            CheckpointError(
                f"the options say n_tokens_vocab {train_cfg.n_tokens_vocab} but {vocab.source} has "
                f"{len(vocab)} tokens; they must agree: set n_tokens_vocab to {len(vocab)} in the options, or give "
                f"the vocab of {train_cfg.n_tokens_vocab} tokens they were written for"
            ),
            "vocab",
        )
    changes: dict[str, Any] = {"n_tokens_vocab": len(vocab)}
    if n_train_tokens:
        changes["n_train_tokens"] = int(n_train_tokens)
    elif options.train is None:  # the recipe's count is 1B Word's, not this text's
        changes["n_train_tokens"] = None
    if train_cfg.n_negative_samples_batch >= len(vocab):
        # A small corpus with a small vocabulary: sample what there is to sample.
        changes["n_negative_samples_batch"] = max(1, len(vocab) // 2)
    return Options(model=options.model.with_shifted_chars(), train=dataclasses.replace(train_cfg, **changes))


def _meta(run: _Run, scored: Scored) -> dict:
    options = run.options
    return {
        # The run's held-out text, given in this session or an earlier one: what a resume without
        # it, or with other text, is warned of, and what the command line's hints name.
        "heldout_files": scored.names,
        "heldout_data": scored.data,
        "options": options.to_dict(),
        "seed": run.seed,
        "vocab_sha256": vocab_hash(run.vocab),
        "vocab_size": len(run.vocab),
        "global_rows": run.global_rows,
        "process_count": jax.process_count(),
        "local_devices": run.n_local,
        "softmax_layout": RowLayout.for_vocab(options.training.n_tokens_vocab).to_dict(),
        "train_files": run.data,
        # The step this data stream began at: 0, or the first step of a new_data session, from
        # which --epochs counts passes over its text.
        "data_from": run.data_from,
    }


def check_same_data(meta: dict, now: list[dict] | None, run_dir: str) -> None:
    """A run resumes on the data it saved its position in: the same files, as ``sources.fingerprint``
    sees them (``now``; a run dir saved before the files were recorded is not checked)."""
    saved = meta.get("train_files")
    if saved is None or now is None:
        return
    changes = data_changes(saved, now)
    if changes:
        more = f" and {len(changes) - 3} more" if len(changes) > 3 else ""
        raise about(
            DataError(
                f"the training data differs from what {run_dir} was saved with ({'; '.join(changes[:3])}"
                f"{more}): its data position would land in other text. Give the same files, or "
                f"new_data to keep the weights and optimizer and start the data position afresh"
            ),
            "new_data",
        )


def _run_seed(meta: dict | None, settings: RunSettings) -> int:
    """``settings.seed``, else the resumed run's own (checkpoints before it was recorded: 0); a
    seed other than the run's own is refused, but with ``new_data``, whose data starts afresh."""
    saved = None if meta is None else meta.get("seed")
    if settings.seed is None:
        return 0 if saved is None else saved
    if saved is not None and settings.seed != saved and not settings.new_data:
        raise about(
            CheckpointError(
                f"{settings.run_dir} was trained with seed {saved}, and a resumed run keeps it (another one deals "
                f"the rest of the epoch from another shuffle): leave seed out, or give {saved}"
            ),
            "seed",
        )
    return settings.seed


def check_compatible(meta: dict, options: Options, vocab: Vocabulary, run_dir: str) -> None:
    """A run dir resumes only the run it holds: same model, same training keys, same vocab."""
    saved = {**meta["options"], "reset_state_prob": saved_reset_state_prob(meta["options"])}
    now = options.to_dict()
    # How long to run may change between sessions, and so may the rows per device (with the device
    # count: the global row count decides what resumes exactly, see _restore_or_init), and the
    # learning rate (lowered after a divergence; Adagrad's accumulators do not depend on it), and
    # with the rows how many of them share a draw of candidates (the state does not depend on it).
    ignore = {"n_epochs", "n_train_tokens", "batch_size", "learning_rate", "rows_per_draw"}
    diffs = []
    for section in ("lstm", "char_cnn"):
        for k in sorted(set(saved[section]) | set(now[section])):
            if saved[section].get(k) != now[section].get(k):
                diffs.append(f"{section}.{k}: saved {saved[section].get(k)!r}, now {now[section].get(k)!r}")
    for k in sorted((set(saved) | set(now)) - {"lstm", "char_cnn"} - ignore):
        if saved.get(k) != now.get(k):
            diffs.append(f"{k}: saved {saved.get(k)!r}, now {now.get(k)!r}")
    if diffs:
        raise about(
            CheckpointError(
                f"{run_dir} holds a run with different options ({'; '.join(diffs[:4])}); "
                f"use another run_dir or the same options"
            ),
            "run_dir",
        )
    if same_path(vocab.source, os.path.join(run_dir, "vocab.txt")):  # the run's own file, replaced
        check_run_vocab(vocab, meta, run_dir)
    if meta["vocab_sha256"] != vocab_hash(vocab):
        raise about(
            CheckpointError(
                f"{run_dir} was trained with a different vocabulary than {vocab.source}; "
                f"fine-tune into a new run_dir instead, starting from this one (init_from)"
            ),
            "run_dir",
            "init_from",
        )


def _restore_or_init(
    ckpt: Checkpointer,
    meta: dict | None,
    options: Options,
    settings: RunSettings,
    shardings: TrainState,
    global_rows: int,
    batcher: LMBatcher,
    init_state: dict | None,
) -> tuple[int, TrainState, int, dict | None, int]:
    """(start step, state on the mesh, fetch capacity, metrics window, data_from): the newest
    readable checkpoint, else ``init_state``, else a fresh init. The capacity is the saved run's
    last one where this run has its data and mesh size, else 0 (planned from the first batch). The
    window is the saved ``MetricsWindow.saved()`` (None: none saved, or a fresh start).
    ``data_from`` is the step the session's text began at (``_Run.data_from``).

    A checkpoint is global arrays, so it restores onto any mesh whose size divides the padded
    softmax. Resumed with the same number of processes and global rows the run continues exactly;
    with another row count the data position (epoch, shard, sentence) is kept and the rows'
    buffered text and LSTM state start afresh; with another number of processes (whose shards
    differ) the data starts afresh too, as it does under ``settings.new_data``. Every process
    decides the same from the shared metadata.
    """
    t, model = options.training, options.model
    layout = RowLayout.for_vocab(t.n_tokens_vocab)
    rows_sharding = shardings.lstm
    zero_rows = make_zero_rows(model, global_rows, rows_sharding["h"])
    restored = None
    if meta is not None:
        keep_data = meta.get("process_count") == jax.process_count() and not settings.new_data
        abstract = _restore_targets(options, shardings, global_rows, keep_data)
        # Unreadable newer checkpoints are moved aside: this run saves those steps again.
        restored = ckpt.restore_latest(abstract, with_host=keep_data, set_aside="unreadable")
        if restored is None:  # not a fresh start unasked: the weights (or an init_from source's) would be lost silently
            raise CheckpointError(
                f"{settings.run_dir}: none of its checkpoints is readable (each moved to "
                f"{os.path.join(settings.run_dir, 'unreadable')}, the warnings say why); rerun the same "
                "command to start the run afresh (from init_from when it is given)"
            )
    if restored is None:
        key = jax.random.PRNGKey(cast(int, settings.seed))  # decided by _open_run
        if init_state is None:
            return 0, make_init(model, t, cast(NamedSharding, shardings.step).mesh, global_rows)(key), 0, None, 0
        shared = put_global(softmax_in_slot_order(init_state, layout), shardings.shared())
        return 0, TrainState(**shared, lstm=zero_rows()), 0, None, 0
    start, shared, rows, host, saved = restored
    crossed = another_stream(saved, cast(dict, meta))  # a restore happens only with meta
    if crossed is not None:  # an older step, from before a new_data session: its position is in other text
        host = rows = None
    if saved.get("format", 1) == 1:
        shared = put_global(softmax_in_slot_order(jax.device_get(shared), layout), shardings.shared())
        if host is not None and saved.get("global_rows") == global_rows:
            rows = {
                k: jax.make_array_from_process_local_data(
                    rows_sharding[k], np.asarray(v), (2, v.shape[1], global_rows, v.shape[3])
                )
                for k, v in host["lstm"].items()
            }
    capacity = 0
    if host is not None:
        batcher.restore(host["data"])
        # The unbroken run planned the next batch's fetch with the capacity it had grown to; from
        # 0 a resumed run could pick a smaller one, another program whose float sums differ. The
        # capacity is rows per owner, so it carries over only to a mesh of the size it was saved on.
        saved_mesh = saved.get("process_count", 0) * saved.get("local_devices", 0)
        if saved_mesh == cast(NamedSharding, shardings.step).mesh.size:
            capacity = int(host.get("fetch", {}).get("capacity", 0))
    _say_what_resumed(settings, saved, start, global_rows, host is not None, rows is not None, batcher, crossed)
    window = host.get("metrics") if host is not None else None  # none in checkpoints before it was kept
    # Another text from this step on (new_data, or the replay of a new_data session begun after
    # it); else the saved stream's own start (0 in checkpoints from before it was kept).
    data_from = start if settings.new_data or crossed is not None else int(saved.get("data_from", 0))
    state = TrainState(**shared, lstm=rows if rows is not None else zero_rows())
    return start, state, capacity, window, data_from


def _restore_targets(options: Options, shardings: TrainState, global_rows: int, keep_data: bool) -> Callable:
    """``abstract(meta)`` for ``Checkpointer.restore_latest``: the shared state onto the mesh, and
    the LSTM rows where they fit (same global rows, same data)."""

    def abstract(m: dict):
        if m.get("format", 1) == 1:  # read onto one device, converted by _restore_or_init
            return abstract_shared(options, m), None
        target = jax.tree_util.tree_map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            abstract_shared(options, m),
            shardings.shared(),
        )
        same_rows = keep_data and m.get("global_rows") == global_rows
        return target, abstract_rows(options.model, global_rows, shardings.lstm) if same_rows else None

    return abstract


def another_stream(saved: dict, newest: dict) -> str | None:
    """Why the data position in ``saved``, the metadata of the step a resume restored, is not one of
    the run's newest checkpoint (``newest``): the newer steps were unreadable and a new_data session
    with another seed or other files began after ``saved``'s. None: the same stream of text.
    Checkpoints saved before the seed (or the files) were recorded are not told apart by it."""
    if "seed" in saved and "seed" in newest and saved["seed"] != newest["seed"]:
        return f"was saved with seed {saved['seed']}, not {newest['seed']}"
    before, now = saved.get("train_files"), newest.get("train_files")
    changes = data_changes(before, now) if before is not None and now is not None else []
    if changes:
        return f"was saved with other training files ({'; '.join(changes[:2])})"
    return None


def _say_what_resumed(settings: RunSettings, saved: dict, start: int, global_rows: int, data: bool, rows: bool,
                      batcher: LMBatcher, crossed: str | None) -> None:  # fmt: skip
    """One line when a resume is not exact: what was restored and what starts afresh (``crossed``:
    ``another_stream``'s reason)."""
    where = (
        f"{settings.run_dir}: step {start} was saved by {saved.get('process_count')} process(es) with "
        f"{saved.get('global_rows')} rows, resumed by {jax.process_count()} with {global_rows}: params and "
        f"optimizer state restored"
    )
    if settings.new_data:
        if jax.process_index() == 0:
            print(f"{where}; new training data (new_data): the data position and the LSTM state start afresh")
    elif crossed is not None:
        warnings.warn(
            f"{settings.run_dir}: step {start}, older than the newest checkpoint, {crossed} (a new_data session "
            f"began after it): params and optimizer state restored; the data position and the LSTM state start "
            f"afresh, as that session started them",
            stacklevel=3,
        )
    elif not data:
        warnings.warn(
            f"{where}; the data starts afresh (shards are dealt per process) and so does the LSTM state", stacklevel=3
        )
    elif not rows:
        warnings.warn(
            f"{where}, and the data position (epoch {batcher.epoch}); the rows' buffered text and "
            f"LSTM state start afresh",
            stacklevel=3,
        )


def _recipe(t: TrainConfig, meta: dict | None) -> str:
    """The start line's word on the recipe's choices that are not bilm-tf's defaults: the
    sentence-start resets, and how many rows share a draw of candidates when that is asked."""
    rows = f"{t.rows_per_draw} row{'s' if t.rows_per_draw > 1 else ''}"
    draws = f", a candidate draw per {rows} ({t.draws_per_device} a device)" if t.rows_per_draw else ""
    if not t.reset_state_prob:
        older = meta is not None and "reset_state_prob" not in meta["options"]
        return (
            "reset_state_prob 0, bilm-tf's recipe"
            + (": this run dir predates the 0.1 default, and a run keeps its recipe" if older else "")
            + draws
        )
    return f"reset_state_prob {t.reset_state_prob:g}{draws}"


def saved_options(run_dir: str) -> dict | None:
    """The options dict (bilm-tf's layout) the newest readable checkpoint of ``run_dir`` was saved
    with, or None when it has none.

    In a multi-host run every process must open the checkpoints (a collective) or none: each looks,
    then all agree. Looking alone raced: a process that had gone on to make ``checkpoints/`` for a
    fresh run made another, still looking, open it, and their next collectives mismatched."""
    if not agree_max([int(epath.Path(run_dir, "checkpoints").is_dir())])[0]:
        return None
    ckpt = Checkpointer(run_dir, read_only=True)
    try:
        meta = ckpt.latest_meta()
    finally:
        ckpt.close()
    return None if meta is None else meta["options"]


def _check_evaluation(settings: RunSettings, heldout: Source | None, vocab: Vocabulary, options: Options) -> None:
    """Held-out evaluation that could never run fails now, not silently hours later."""
    if settings.eval_every and heldout is not None:
        check_heldout_fills_a_window(heldout, vocab, options.training.batch_size, options.training.unroll_steps)


def check_heldout_fills_a_window(heldout: Source, vocab: Vocabulary, batch_size: int, unroll_steps: int) -> None:
    """A ``DataError`` when ``heldout`` fills no evaluation window of ``batch_size`` rows x
    ``unroll_steps`` tokens. Which words ``vocab`` holds does not change how the text is dealt: a
    caller may check before the vocabulary exists, with the markers alone."""
    probe = LMBatcher(
        heldout, vocab, rows_per_device=batch_size, unroll_steps=unroll_steps, max_chars=50, max_epochs=1, shuffle=False
    )
    try:
        probe.next()
    except (StopIteration, NoSentences):
        raise too_little_text(heldout, batch_size, unroll_steps) from None


@dataclasses.dataclass
class _Run:
    """One session of a run, as decided before its first step."""

    options: Options
    vocab: Vocabulary
    settings: RunSettings
    mesh: Mesh
    n_local: int
    """Devices of this process in the mesh."""
    global_rows: int
    first_device: int
    """The global index of this process's first device (its rows come after those before it)."""
    shards: list[int]
    """The data shards this process reads."""
    total: int | None
    """The step to stop at (None: at the end of the data)."""
    ckpt: Checkpointer
    meta: dict | None
    """The newest checkpoint's metadata (None: a fresh run)."""
    data: list[dict] | None
    """The training files as ``sources.fingerprint`` records them."""
    lock: FileLock | None = None
    """The run dir's, held by process 0 for the session (``_lock_run_dir``)."""
    data_from: int = 0
    """The step the run's current text began at (set by ``_started``): epochs count from it."""

    @property
    def lead(self) -> bool:
        return jax.process_index() == 0

    @property
    def seed(self) -> int:
        """The session's seed: ``settings.seed`` as ``_open_run`` decided it, never None."""
        return cast(int, self.settings.seed)


def _planned_steps(settings: RunSettings, t: TrainConfig, global_rows: int) -> int | None:
    """The step to stop at: ``steps``, else ``epochs`` (else the options' ``n_epochs``) counted in
    the options' tokens (from step 0: ``_train`` adds the step a new_data session's text began
    at); None: at the end of the data."""
    epochs = settings.epochs if settings.epochs is not None else (None if settings.steps else t.n_epochs)
    if settings.steps is None and epochs is not None:
        if t.n_train_tokens is None:
            raise about(
                ConfigError(
                    "the options give no token count (n_train_tokens is null), so epochs cannot be counted; give "
                    "steps, or n_train_tokens (tokens + sentences of the training text: count_tokens gives both)"
                ),
                "steps",
                "n_train_tokens",
            )
        return math.ceil(epochs * t.n_train_tokens / (global_rows * t.unroll_steps))
    return settings.steps


def run_devices(settings: RunSettings) -> tuple[int, list]:
    """This process's device count and the devices of the run's mesh (``settings.devices``, or all);
    a count this process cannot give is refused (``setup.train`` asks before its vocabulary pass)."""
    n_local = jax.local_device_count()
    if settings.devices is None:
        return n_local, jax.devices()
    if jax.process_count() > 1 and settings.devices != n_local:
        raise about(CheckpointError("a multi-host run uses every local device; leave devices unset"), "devices")
    if not 1 <= settings.devices <= n_local:
        raise about(CheckpointError(f"devices {settings.devices}: this process has {n_local} device(s)"), "devices")
    return settings.devices, jax.local_devices()[: settings.devices]


def _open_run(options: Options, vocab: Vocabulary, source: Source, settings: RunSettings) -> _Run:
    """Devices, mesh and run dir: everything a bad argument or a mismatched run dir can stop,
    checked on every process before anything waits for the others (Orbax syncs them)."""
    t = options.training
    data = _fingerprint(source, settings.run_dir)
    n_local, devices = run_devices(settings)
    shards = shard_for_process(source, jax.process_index(), jax.process_count())
    mesh = Mesh(np.array(devices), (AXIS,))
    try:
        RowLayout.for_vocab(t.n_tokens_vocab).rows_per_device(mesh.size)
    except LayoutError as e:
        raise CheckpointError(str(e)) from None
    global_rows = t.batch_size * mesh.size
    total = _planned_steps(settings, t, global_rows)  # epochs nothing counts: refused before the run dir is made
    check_dir_to_make(settings.run_dir)
    epath.Path(settings.run_dir).mkdir(parents=True, exist_ok=True)  # a gs:// run dir too
    check_writable(
        settings.run_dir, *(os.path.join(settings.run_dir, p) for p in ("checkpoints", "host_state", "metrics.jsonl"))
    )
    # Before the checkpoint manager opens: a writer's deletes the unfinished saves it finds.
    lock = _lock_run_dir(settings.run_dir)
    ckpt = None
    try:
        ckpt = Checkpointer(settings.run_dir, keep=settings.keep, async_save=settings.async_save)
        meta = ckpt.latest_meta()
        settings = dataclasses.replace(settings, seed=_run_seed(meta, settings))
        if meta is not None:
            check_compatible(meta, options, vocab, settings.run_dir)
            if not settings.new_data:
                check_same_data(meta, data, settings.run_dir)
            if jax.process_index() == 0:
                _mend_run_files(settings.run_dir, meta, vocab, options)
        elif jax.process_index() == 0:
            options.save(os.path.join(settings.run_dir, "options.json"))
            write_vocab_file(os.path.join(settings.run_dir, "vocab.txt"), vocab)
    except BaseException:
        if ckpt is not None:
            ckpt.close()
        if lock is not None:
            lock.release()
        raise
    return _Run(
        options,
        vocab,
        settings,
        mesh,
        n_local,
        global_rows,
        jax.process_index() * n_local,
        shards,
        total,
        ckpt,
        meta,
        data,
        lock,
    )


def _fingerprint(source: Source, run_dir: str) -> list[dict] | None:
    """``sources.fingerprint`` of the training text, which reads each file's ends: text that is not
    there stops before the run dir is made, in words that say when the run's own text was emptied."""
    try:
        return fingerprint(source)
    except NoSentences:
        error = no_sentence(source, training=True)
        if epath.Path(run_dir, "options.json").exists():  # a run was trained here, on text
            error = DataError(
                f"{error}; {run_dir} was trained on text: if these are its files, they were emptied since"
            )
        raise error from None


def _mend_run_files(run_dir: str, meta: dict, vocab: Vocabulary, options: Options) -> None:
    """A resumed run's options.json and vocab.txt, which eval, embed and export read, written
    again (with a warning) when they are gone or unreadable or hold another vocabulary: the
    checkpoint's options and the vocabulary it was checked against are the run's own. options.json
    also follows ``options``, this session's, when it changes the recipe (the start line says how)."""
    options_path, vocab_path = os.path.join(run_dir, "options.json"), os.path.join(run_dir, "vocab.txt")
    try:
        if Options.load(options_path, saved=True) != options:
            options.save(options_path)
    except ConfigError as e:
        Options.from_dict(meta["options"], where=options_path, saved=True).save(options_path)
        print(f"warning: {e}; wrote it again from the newest checkpoint's options", file=sys.stderr)
    try:
        same = vocab_hash(Vocabulary.load(vocab_path)) == meta["vocab_sha256"]
        why = "holds another vocabulary than the run's"
    except VocabError as e:
        same, why = False, str(e).removeprefix(f"{vocab_path}: ")
    if not same:
        write_vocab_file(vocab_path, vocab)
        print(f"warning: {vocab_path}: {why}; wrote it again from {vocab.source}", file=sys.stderr)


def _lock_run_dir(run_dir: str) -> FileLock | None:
    """The run dir's lock (``RUN/.lock``), taken by process 0, or ``CheckpointError`` naming the
    process that holds it. Two sessions in one run dir at once would save the same steps over each
    other, and the second one's checkpoint manager, as it opens, would delete the first one's saves
    in flight. None on the other processes, which share process 0's run, and for a run dir in an
    object store (``gs://``), which has no locks."""
    if jax.process_index() != 0 or not is_local(run_dir):
        return None
    lock = FileLock(os.path.join(run_dir, ".lock"), wait=False)
    since = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    try:
        lock.acquire(note=f"process {os.getpid()} on {socket.gethostname()}, training since {since}")
    except Held as e:
        raise about(
            CheckpointError(
                f"{run_dir}: another session is training in this run dir ({e.note}); wait for it to end or stop "
                "it, or give another run_dir"
            ),
            "run_dir",
        ) from None
    return lock


def pretrain(
    options: Options,
    vocab: Vocabulary,
    source: Source,
    settings: RunSettings,
    *,
    heldout: Source | None = None,
    init_state: dict | None = None,
    on_metrics: Callable[[dict], None] | None = None,
    fixed_candidates: bool = False,
    on_progress: Callable[[str], None] | None = None,
    init_from: str | None = None,
) -> dict:
    """Trains (or resumes) into ``settings.run_dir``. Returns the last logged metrics.

    SIGINT (Ctrl-C, a notebook's interrupt), SIGTERM or SIGHUP stop it at the next step boundary:
    it saves that step, then raises ``hooks.Stopped`` (a ``KeyboardInterrupt``, holding the step
    and the metrics), so that a return always means the run reached its end (steps, epochs or the
    end of the data). The same call resumes.

    ``source``: the training text; ``heldout``: text scored under the full softmax every
    ``settings.eval_every`` steps (``evaluate``'s carried protocol). ``fixed_candidates``: every
    device draws device 0's sampled candidates (for tests that compare device layouts).
    ``init_state``: a shared state, softmax in id order (``warmstart.finetune_state``), to start
    from instead of a fresh init (fine-tuning); ``init_from`` names where it came from (a path, a
    released model) for the start line. ``on_metrics``: called with each logged record.
    ``on_progress``: called with what the run does next (``"running step 12"``), before the
    restore, at each step boundary, each held-out window and the last save (``hooks.Progress``).
    """
    source = as_source(source, "source")
    heldout = None if heldout is None else as_source(heldout, "heldout")
    _check_vocab_fits(options, vocab)
    if not isinstance(settings, RunSettings):  # a run dir's path, say (unchecked: an AttributeError)
        raise about(
            TypeError(f"settings is a {type(settings).__name__}; expected a RunSettings (RunSettings(run_dir=...))"),
            "settings",
        )
    if settings.precision:  # tf32 off a GPU: refused before the run dir is made
        try:
            policy.check(settings.precision)
        except ValueError as e:
            raise about(ConfigError(str(e)), "precision") from None
    if heldout is None:  # so that eval_every > 0 says that the run evaluates (its start line says so)
        settings = dataclasses.replace(settings, eval_every=0)
    elif settings.eval_every is None:
        settings = dataclasses.replace(
            settings, eval_every=-(-settings.save_every // settings.log_every) * settings.log_every
        )
    _check_evaluation(settings, heldout, vocab, options)
    run = _open_run(options, vocab, source, settings)
    with _orbax_log(settings.run_dir, failed=lambda: run.ckpt.orbax_failed):
        try:
            origin = None if init_state is None else (init_from or "the given initial state")
            return _train(run, source, heldout, init_state, origin, fixed_candidates, on_metrics, on_progress)
        except Diverged as e:
            raise about(
                Diverged(_set_aside_diverged(run, e), e.step, e.last_good), "learning_rate", "on_divergence"
            ) from None
        except jax.errors.JaxRuntimeError as e:
            # Raised below, outside this clause: XLA's traceback is not the message, and its
            # frames hold the run's device arrays.
            run_dir, rows = run.settings.run_dir, run.options.training.batch_size
            error = device_error(
                e,
                out_of_memory_said=lambda xla: (
                    f"{run_dir}: the device ran out of memory ({xla}); batch_size {rows} rows per device is more "
                    "than it holds: lower batch_size, or spread the rows over more devices"
                    + _intact(run, "rerun with a lower batch_size")
                ),
                knob="batch_size",
                failed_said=lambda xla: (
                    f"{run_dir}: the device failed during the run ({xla})"
                    + _intact(run, f"{CHECK_THE_DEVICE} rerun the same command")
                ),
            )
            if error is None:
                raise
        finally:
            try:
                run.ckpt.close()  # its saves in flight complete before the run dir's lock goes
            finally:
                if run.lock is not None:
                    run.lock.release()
    raise error


def _check_vocab_type(vocab: Any) -> None:
    if not isinstance(vocab, Vocabulary):
        raise TypeError(
            f"vocab is a {type(vocab).__name__}; expected a Vocabulary (Vocabulary.load(path), or build_vocab(counts))"
        )


def _check_vocab_fits(options: Options, vocab: Vocabulary) -> None:
    """The softmax has a row per word: options made for another vocabulary would train rows that
    no word names, or words that no row scores (``options_for_vocab`` makes them fit)."""
    if not isinstance(options, Options) or options.train is None:
        got = type(options).__name__ if not isinstance(options, Options) else "Options without training keys"
        raise TypeError(
            f"options is {got}; expected training Options: options_for_vocab(options, vocab, n_train_tokens)"
        )
    _check_vocab_type(vocab)
    if options.train.n_tokens_vocab != len(vocab):
        raise about(
            ConfigError(
                f"the options' n_tokens_vocab is {options.train.n_tokens_vocab} but the vocab ({vocab.source}) has "
                f"{len(vocab)} words: the softmax has a row per word; make the options for this vocab with "
                "options_for_vocab(options, vocab, n_train_tokens)"
            ),
            "vocab",
        )


def _intact(run: _Run, then: str) -> str:
    """What a run stopped by its device keeps: ``"; step(s) 10, 20 are intact: {then} to resume from
    step 20"``, once a save in flight has completed (kept if it does)."""
    with contextlib.suppress(Exception):
        run.ckpt.wait()
    steps = run.ckpt.steps()
    if not steps:
        return "; no checkpoint was saved before it"
    return f"; step(s) {', '.join(map(str, steps))} are intact: {then} to resume from step {steps[-1]}"


def _orbax_log(run_dir: str, failed: Callable[[], bool]):
    """``orbax_log`` into ``run_dir/orbax.log`` during a run (a gs:// run dir keeps the default),
    so that hundreds of lines do not bury the one line a run stops with."""
    if not is_local(run_dir):
        return contextlib.nullcontext()
    name = "orbax.log" if jax.process_count() == 1 else f"orbax.p{jax.process_index()}.log"
    return orbax_log(os.path.join(run_dir, name), failed)


def _set_aside_diverged(run: _Run, e: Diverged) -> str:
    """Moves the checkpoints saved after ``e.last_good`` out of the run's way; the message to stop with."""
    moved = run.ckpt.set_aside(after=e.last_good, folder="diverged")
    newest = run.ckpt.steps()[-1] if run.ckpt.steps() else None
    said = f"{e}; "
    if moved:
        said += (
            f"step(s) {', '.join(map(str, moved))}, saved after the last healthy step {e.last_good}, were "
            f"moved to {os.path.join(run.ckpt.shown, 'diverged')}; "
        )
    if newest is None:
        return said + "no checkpoint was saved before it: start again with a lower learning_rate"
    return said + (
        f"the newest checkpoint is step {newest}: rerun with a lower learning_rate to resume from it "
        f"(or on_divergence 'warn' to train on regardless)"
    )


def _started(
    run: _Run, batcher: LMBatcher, init_state: dict | None, on_progress: Callable[[str], None] | None
) -> tuple[_Run, int, TrainState, int, dict | None]:
    """``_restore_or_init`` for ``run``, which comes back with the step its text began at and its
    total counted from it: (run, start step, state, fetch capacity, metrics window)."""
    t = run.options.training
    abstract = jax.eval_shape(lambda: init_train_state(jax.random.PRNGKey(0), run.options.model, t, run.global_rows))
    shardings = state_shardings(abstract, run.mesh)
    if on_progress is not None:
        on_progress(
            f"restoring the newest checkpoint in {run.settings.run_dir}"
            if run.meta is not None
            else "initialising the model"
        )
    start, state, capacity, window, data_from = _restore_or_init(
        run.ckpt, run.meta, run.options, run.settings, shardings, run.global_rows, batcher, init_state
    )
    # Epochs (not steps) count passes over the text the run trains on now: a new_data session's
    # from its first step (counted from step 0 of the run, a run at step 100,000 given new text
    # with --epochs 3 would be "already trained").
    epochs_from = data_from if run.settings.steps is None and run.total is not None else 0
    total = None if run.total is None else run.total + epochs_from
    return dataclasses.replace(run, data_from=data_from, total=total), start, state, capacity, window


def _train(
    run: _Run,
    source: Source,
    heldout: Source | None,
    init_state: dict | None,
    origin: str | None,
    fixed_candidates: bool,
    on_metrics: Callable[[dict], None] | None,
    on_progress: Callable[[str], None] | None,
) -> dict:
    """Restore or init, the hooks, the loop, the last save: ``pretrain`` on an open run. ``origin``
    names ``init_state``'s source (None with a fresh init)."""
    settings, t, model = run.settings, run.options.training, run.options.model
    batcher = _batcher(run, source)
    run, start, state, capacity, saved_window = _started(run, batcher, init_state, on_progress)
    if run.total is not None and start >= run.total:
        if start == 0:  # a new run asked for no step: it is set up (options, vocabulary), untrained
            print(f"{settings.run_dir}: set up and untrained: 0 steps planned; nothing to do")
        else:
            print(f"{settings.run_dir}: already trained to step {start} (asked for {run.total}); nothing to do")
        return {**logged(os.path.join(settings.run_dir, "metrics.jsonl"), start), "step": start}
    scored = _scored_files(run, heldout, start)
    compute = _announce(run, start, batcher, state, origin)
    step_fn = make_train_step(model, t, run.mesh, compute=compute)
    batches = GlobalBatches(
        batcher, t, run.mesh, run.seed, run.first_device, fixed_candidates,
        prefetch=settings.prefetch, workers=settings.host_workers, capacity=capacity,
    )  # fmt: skip
    guard = DivergenceGuard(
        t.n_tokens_vocab, start, settings.divergence_margin, settings.divergence_patience, settings.on_divergence
    )
    progress = Progress(settings.progress and run.lead, run.total, start, on_progress)
    window = MetricsWindow(run.global_rows * t.unroll_steps)
    if saved_window is not None:
        window.resume(saved_window)
    save = _Saver(run, batches, guard, window, start, scored)
    on_log = _on_log(run, heldout, guard, progress, start, on_metrics)
    step, state, reason, error, signum = _steps(
        step_fn, state, batches, start, run.total, settings, window, on_log, save, progress
    )
    batches.close()  # the batches built ahead are not needed; data_state() stays
    progress.close()
    progress.beat(f"saving step {step}, the last")
    # Text that began this session (a fresh run's, a new_data session's) and filled no step, or
    # held no sentence at all (blank lines only).
    failed = error or batches.error
    if step == start == run.data_from and (isinstance(failed, NoSentences) or (reason == "end of data" and not failed)):
        raise _no_first_step(run, source)
    if step == start and reason == "end of data" and not failed:
        # A rerun of a run whose data ended short of its planned total (rows take whole sentences,
        # so the last window of an epoch may not fill): nothing was run, nothing is saved again.
        print(f"{settings.run_dir}: its data ended at step {start} (planned {run.total}); nothing to do")
        return {**logged(os.path.join(settings.run_dir, "metrics.jsonl"), start), "step": start}
    said = _finish(run, step, state, reason, failed, save)
    # A session that stops between logged steps (a signal, the end of the data; the last step of a
    # total is logged) ends with the metrics of its steps since the last logged one, not with that
    # one's under this step's number.
    last = window.close(step, batches.epoch()) if window.n else {**window.last, "step": step}
    if reason in ("signal", "another's signal"):
        raise Stopped(said, step, signum, reason == "signal", last)
    return last


def _no_first_step(run: _Run, source: Source) -> DataError:
    """The error for training text that ended before the first step (under epochs: ``steps``
    read it again instead), said as held-out text that fills no window is."""
    t = run.options.training
    if jax.process_count() == 1:
        return too_little_text(source, t.batch_size * run.n_local, t.unroll_steps, training=True)
    return about(
        DataError(
            f"the training text of one process (each reads its own shards: {t.batch_size} rows x {t.unroll_steps} "
            "tokens per device) ended before the first step; give more text, or a smaller batch_size"
        ),
        "batch_size",
    )


@dataclasses.dataclass(frozen=True)
class Scored:
    """The held-out text a run's checkpoints record: its first 20 names, and its files as
    ``sources.fingerprint`` sees them (None: not recorded, or a source that cannot say)."""

    names: list[str] | None = None
    data: list[dict] | None = None


def _scored_files(run: _Run, heldout: Source | None, start: int) -> Scored:
    """The held-out text the run's checkpoints name: this session's, else the earlier session's,
    with a warning that this one scores none, or scores other text (the held-out perplexity in
    metrics.jsonl changes what it measures at ``start``)."""
    meta = run.meta or {}
    saved = Scored(meta.get("heldout_files"), meta.get("heldout_data"))
    if heldout is not None:
        data = None
        with contextlib.suppress(NoSentences):  # blank text is refused where it is to be scored
            data = fingerprint(heldout)
        now = Scored([heldout.name(i) for i in range(min(len(heldout), 20))], data)
        if saved.names and run.lead and (changes := _heldout_changes(saved, now)):
            print(
                f"warning: {run.settings.run_dir} scored other held-out text before ({'; '.join(changes[:3])}): "
                f"heldout_perplexity in its metrics.jsonl measures this text from step {start} on",
                file=sys.stderr,
            )
        return now
    if saved.names and run.lead:
        names = ", ".join(saved.names[:2]) + (", ..." if len(saved.names) > 2 else "")
        print(
            f"warning: {run.settings.run_dir} scored held-out text ({names}) in an earlier session; this one "
            "scores none: give the held-out files again to go on scoring them",
            file=sys.stderr,
        )
    return saved


def _heldout_changes(saved: Scored, now: Scored) -> list[str]:
    """How ``now``'s held-out text differs from ``saved``'s: by the files' contents where both were
    recorded (a checkpoint of an earlier version records names only), else by their names."""
    if saved.data is not None and now.data is not None:
        return data_changes(saved.data, now.data)
    before, after = [os.path.basename(n) for n in saved.names or []], [os.path.basename(n) for n in now.names or []]
    return [] if before == after else [f"{', '.join(before[:2])} then, {', '.join(after[:2])} now"]


def _batcher(run: _Run, source: Source) -> LMBatcher:
    """This process's rows of the run's data."""
    settings, t = run.settings, run.options.training
    return LMBatcher(
        source, run.vocab, rows_per_device=t.batch_size, unroll_steps=t.unroll_steps,
        max_chars=run.options.model.char_cnn.max_characters_per_token, n_devices=run.n_local, seed=run.seed,
        shards=run.shards, first_row=run.first_device * t.batch_size,
        max_epochs=math.ceil(settings.epochs) if settings.epochs else None,
        load_ahead_words=AHEAD_WORDS if settings.parse_ahead else None,
    )  # fmt: skip


def _announce(run: _Run, start: int, batcher: LMBatcher, state: TrainState, origin: str | None) -> Compute:
    """The matmul policy (asked for, or the device's native fast one), the start line that names
    it and why, and the free-space check; returns the step's ``Compute``."""
    settings = run.settings
    if settings.precision:
        matmuls, why = policy.check(settings.precision), "asked for"
    else:  # bfloat16 only where the device's tensor cores have it
        matmuls, why = policy.training_default()
    if run.lead:
        print(_start_line(run, start, batcher, f"{matmuls} matmuls [{why}]", origin))
        short = run.ckpt.check_space(settings.keep, checkpoint_bytes(state.shared(), state.lstm))
        if short is not None:
            print(f"warning: {short}", file=sys.stderr)
    return Compute.from_policy(matmuls)


def _finish(run: _Run, step: int, state: TrainState, reason: str | None, mine: BaseException | None,
            save: _Saver) -> str:  # fmt: skip
    """The last save, then why the loop stopped: this process's own error (raised after the save,
    so the last sound state is on disk), a peer's, a signal or the end of the data. Returns the
    line said (none at the run's end)."""
    if isinstance(mine, Diverged):  # every process decides it alike, from the same replicated loss
        raise mine
    if isinstance(mine, SaveFailed) and jax.process_count() == 1:
        raise mine  # a last save would fail alike (with more processes, it is a collective: all go)
    saved = save(step, state)  # every process reaches this at the same step
    if mine is not None:
        raise mine
    run_dir = run.settings.run_dir
    where = f"checkpoint saved in {run_dir}"
    if reason in ("signal", "another's signal"):  # stopped short of the run's end: say how it goes on
        # Again with --new-data, the data position would start afresh on text already trained on.
        where += "; the same command " + ("without --new-data " if run.settings.new_data else "") + "resumes from it"
    if not saved:
        newest = run.ckpt.steps()[-1] if run.ckpt.steps() else 0
        where = f"not saved, the newest logged loss being above the divergence threshold: {run_dir} resumes from step {newest}"
    if reason == "error":
        raise PeerFailed(f"another process failed: stopped at step {step}; {where}")
    said = ""
    if reason == "signal":
        said = f"stopped at step {step}; {where}"
    if reason == "another's signal":
        said = f"stopped at step {step} (another process was signalled); {where}"
    if reason == "end of data":  # under --epochs, the first process to read all its shards ends the epoch
        said = f"end of data at step {step}; {where}"
    if said:
        print(said)
    return said


class _Saver:
    """Saves the state at a step, once per step (a signal may arrive on a save step), and not
    while the divergence guard suspects the newest logged loss (a diverged state must not become
    the newest checkpoint). Returns whether the step is on disk (or on its way there)."""

    def __init__(
        self,
        run: _Run,
        batches: GlobalBatches,
        guard: DivergenceGuard,
        window: MetricsWindow,
        start: int,
        scored: Scored,
    ):
        self.run, self.batches, self.guard, self.window, self.last = run, batches, guard, window, start
        self.meta = _meta(run, scored)

    def __call__(self, step: int, state: TrainState) -> bool:
        if self.last == step:
            return True
        if self.guard.suspect and self.guard.mode == "stop":
            return False
        self.last = step
        host = {
            "data": self.batches.data_state(),
            "fetch": {"capacity": np.int64(self.batches.capacity)},
            "metrics": self.window.saved(),
        }
        self.run.ckpt.save(step, state.shared(), state.lstm, host, self.meta)
        return True

    def alone(self) -> bool:
        """Whether a save failed on this process alone inside Orbax, out of step with the others."""
        return self.run.ckpt.alone


def _on_log(
    run: _Run,
    heldout: Source | None,
    guard: DivergenceGuard,
    progress: Progress,
    start: int,
    on_metrics: Callable[[dict], None] | None,
) -> Callable[[int, TrainState, dict], None]:
    """What happens at a logged step, in order: held-out perplexity into the record, the record
    to metrics.jsonl, the progress bar and ``on_metrics``, then the divergence guard (after the
    record is written, so that the run's log shows what the guard saw)."""
    settings, t = run.settings, run.options.training
    metrics = MetricsFile(os.path.join(settings.run_dir, "metrics.jsonl"), start) if run.lead else None
    # Held-out perplexity in float32 (the references' numbers), whatever the training's policy.
    evaluator = (
        HeldoutEvaluator(
            run.options.model,
            run.vocab,
            heldout,
            run.mesh,
            batch_size=t.batch_size,
            unroll_steps=t.unroll_steps,
            layout=RowLayout.for_vocab(t.n_tokens_vocab),
        )
        if settings.eval_every and heldout is not None
        else None
    )

    def on_log(step: int, state: TrainState, record: dict) -> None:
        if evaluator is not None and step % (settings.eval_every or 1) == 0:
            windows = itertools.count(1)
            progress.beat(f"evaluating the held-out data at step {step} (its first window)")
            scores = evaluator(
                state.params,
                lambda: progress.beat(f"evaluating the held-out data at step {step} (after window {next(windows)})"),
            )
            record.update({f"heldout_{k}": v for k, v in scores.items()})
        if metrics is not None:
            metrics.add(record)
        progress.show(record)
        if on_metrics is not None:
            on_metrics(record)
        why = guard.check(record)
        if why is not None and run.lead:
            print(
                f"warning: {settings.run_dir}: the training loss diverged at step {step} ({why}); training on "
                f"(on_divergence 'warn')",
                file=sys.stderr,
            )

    return on_log


def _steps(
    step_fn: Callable,
    state: TrainState,
    batches: GlobalBatches,
    start: int,
    total: int | None,
    settings: RunSettings,
    window: MetricsWindow,
    on_log: Callable,
    save: _Saver,
    progress: Progress,
) -> tuple[int, TrainState, str | None, BaseException | None, int]:
    """The loop: ``(last step, state, why it stopped early, this process's own error, the signal's
    number)``; the signal is 0 unless one stopped it, here or on another process.

    A failure in host code (a hook, a save) does not stop this process alone: it is kept and
    passed to the next ``batches.next``, so that every process stops at the same step boundary
    and saves there together (``GlobalBatches``). Except a save that Orbax's own code failed on
    this process alone (``Checkpointer.alone``): raised at once, as no collective may follow it."""
    step, reason, error, signum = start, None, None, 0
    with SignalStop() as stop:
        while total is None or step < total:
            try:
                batch = batches.next(step, "error" if error else "signal" if stop.requested else None, stop.signum)
            except StopTogether as e:
                # A signal to another process only: this one's line says so, or it reads as its own.
                reason = "another's signal" if e.reason == "signal" and not stop.requested else e.reason
                signum = stop.signum or e.signum
                break
            state, m = step_fn(state, batch)
            step += 1
            try:
                window.add(m)
                if step % settings.log_every == 0 or step == total:
                    on_log(step, state, window.close(step, batches.epoch()))
                    window.restart_clock()
                if step % settings.save_every == 0:
                    progress.beat(f"saving step {step}")  # a save waits for the one before it to commit
                    save(step, state)
                progress.update()
            except Exception as e:
                if save.alone():  # out of step with the others' collectives: it enters no other one
                    raise
                error = e
    window.flush()  # the last step's metrics, read
    if reason == "end of data" and window.n:
        # The data's last step ends the run as a total's last step does: logged, so that
        # metrics.jsonl ends with it and a rerun has its record to show. Its epochs are all done
        # (the position saved is the last window's, before the stream found its end).
        try:
            on_log(step, state, window.close(step, math.ceil(settings.epochs or batches.epoch())))
        except Exception as e:  # noqa: BLE001 - kept as the loop keeps a hook's: the last save comes first
            error = e
    return step, state, reason, error, signum


def _learning_rate_change(run: _Run) -> str:
    was, now = (run.meta or {}).get("options", {}).get("learning_rate"), run.options.training.learning_rate
    return f", learning rate {was:g} -> {now:g}" if was is not None and was != now else ""


def _start_line(run: _Run, start: int, batcher: LMBatcher, matmuls: str, origin: str | None) -> str:
    until = f" to step {run.total}" if run.total is not None else ""
    until += f" ({matmuls}, {_recipe(run.options.training, run.meta)}{_learning_rate_change(run)})"
    if every := run.settings.eval_every:
        until += f"; held-out perplexity every {every} steps"
        if run.total is not None and (first := (start // every + 1) * every) > run.total:
            until += f" (none in this session: the first would be at step {first})"
    if start:
        stream = batcher.streams[0]
        return (
            f"resuming {run.settings.run_dir} from step {start} (epoch {batcher.epoch}, shard "
            f"{stream.shard_pos + 1} of {len(stream.shards)}){until}"
        )
    return f"starting {run.settings.run_dir} from {origin or 'scratch'}{until}"
