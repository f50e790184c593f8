"""A pretraining run: run directory, resume, the step loop, logging, held-out perplexity, signals.

The train step itself is in ``step.py`` and knows nothing of files; this module is the wrapper
around it (restore-or-init, hooks every N steps, checkpoint on exit), in the levanter/Haiku style.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import signal
import time
import warnings
import weakref
from typing import Callable

import jax
import numpy as np
from etils import epath
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from elmo_jax import policy
from elmo_jax._util.atomic import is_local, open_binary, write_bytes_atomic
from elmo_jax.config import ConfigError, Options, TrainConfig, saved_reset_state_prob
from elmo_jax.model import lstm
from elmo_jax.model.compute import Compute
from elmo_jax.model.vocabulary import Vocabulary
from elmo_jax.text.sources import DataError, Source, shard_for_process
from elmo_jax.training.batches import LMBatcher
from elmo_jax.training.checkpoint import CheckpointError, Checkpointer, vocab_hash
from elmo_jax.training.evaluate import evaluate
from elmo_jax.training.prefetch import HostBatch, HostPipeline, Prefetcher
from elmo_jax.training.run_dir import abstract_rows, abstract_shared, softmax_in_slot_order, write_vocab_file
from elmo_jax.training.sharded_softmax import LayoutError, RowLayout
from elmo_jax.training.step import (AXIS, BATCH_KEYS, TrainState, make_train_step, plan_batch, put_global,
                                    state_shardings)
from elmo_jax.training.step import init_state as init_train_state  # pretrain() takes an init_state argument


@dataclasses.dataclass
class RunSettings:
    """How to run (not what to train: that is ``Options``)."""

    run_dir: str
    steps: int | None = None
    """Stop after this many steps in total (counting resumed ones)."""
    epochs: float | None = None
    """Stop after this many passes over the data (default: ``n_epochs`` from the options)."""
    seed: int = 0
    save_every: int = 500
    keep: int = 3
    eval_every: int = 0
    log_every: int = 10
    precision: str | None = None
    """Matmul policy (``elmo_jax.policy``): None is bfloat16 on a GPU or TPU, float32 on a CPU."""
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


def options_for_vocab(options: Options, vocab: Vocabulary, n_train_tokens: int | None,
                      strict: bool = True) -> Options:
    """Fills the training keys that follow from the data; refuses a config that does not fit it
    (``strict``: the options' own ``n_tokens_vocab`` must be the vocabulary's size)."""
    train_cfg = options.train or TrainConfig(n_tokens_vocab=len(vocab))
    if strict and options.train is not None and train_cfg.n_tokens_vocab != len(vocab):
        raise CheckpointError(f"the options say n_tokens_vocab {train_cfg.n_tokens_vocab} but {vocab.source} has "
                              f"{len(vocab)} tokens; they must agree")
    changes = {"n_tokens_vocab": len(vocab)}
    if n_train_tokens:
        changes["n_train_tokens"] = int(n_train_tokens)
    if train_cfg.n_negative_samples_batch >= len(vocab):
        # A small corpus with a small vocabulary: sample what there is to sample.
        changes["n_negative_samples_batch"] = max(1, len(vocab) // 2)
    model = options.model
    if model.char_cnn.n_characters != 262:
        model = dataclasses.replace(model, char_cnn=dataclasses.replace(model.char_cnn, n_characters=262))
    return Options(model=model, train=dataclasses.replace(train_cfg, **changes))


def _meta(options: Options, vocab: Vocabulary, global_rows: int, n_local: int) -> dict:
    return {"options": options.to_dict(), "vocab_sha256": vocab_hash(vocab), "vocab_size": len(vocab),
            "global_rows": global_rows, "process_count": jax.process_count(), "local_devices": n_local,
            "softmax_layout": RowLayout.for_vocab(options.train.n_tokens_vocab).to_dict()}


def check_compatible(meta: dict, options: Options, vocab: Vocabulary, run_dir: str) -> None:
    """A run dir resumes only the run it holds: same model, same training keys, same vocab."""
    saved = {**meta["options"], "reset_state_prob": saved_reset_state_prob(meta["options"])}
    now = options.to_dict()
    # How long to run may change between sessions, and so may the rows per device (with the device
    # count: the global row count decides what resumes exactly, see _restore_or_init).
    ignore = {"n_epochs", "n_train_tokens", "batch_size"}
    diffs = []
    for section in ("lstm", "char_cnn"):
        for k in sorted(set(saved[section]) | set(now[section])):
            if saved[section].get(k) != now[section].get(k):
                diffs.append(f"{section}.{k}: saved {saved[section].get(k)!r}, now {now[section].get(k)!r}")
    for k in sorted((set(saved) | set(now)) - {"lstm", "char_cnn"} - ignore):
        if saved.get(k) != now.get(k):
            diffs.append(f"{k}: saved {saved.get(k)!r}, now {now.get(k)!r}")
    if diffs:
        raise CheckpointError(f"{run_dir} holds a run with different options ({'; '.join(diffs[:4])}); "
                              f"use another --run-dir or the same options")
    if meta["vocab_sha256"] != vocab_hash(vocab):
        raise CheckpointError(f"{run_dir} was trained with a different vocabulary than {vocab.source}; "
                              f"fine-tune into a new run dir instead (--init-from)")


class _MetricsFile:
    """``metrics.jsonl``: one JSON line per logged step, written by process 0.

    A run resumed from step ``start`` drops the lines of later steps (logged before a crash, after
    the checkpoint it resumes from): those steps run and log again, and each step is logged once.
    Lines that are not JSON objects with a step are kept as they are.

    A local file is appended to. An object store (``gs://``) has no append: the whole file is
    rewritten, as one object write, at each log from the lines held here. That is O(lines) per log,
    but small: a 100k-step run logged every 100 steps has 1,000 lines, ~0.3 MB.
    """

    def __init__(self, path: str, start: int):
        self.path, self.local = path, is_local(path)
        try:
            with open_binary(path) as f:
                raw = f.read()
        except FileNotFoundError:
            raw = b""
        lines = raw.splitlines()  # bytes: whatever is there is kept byte for byte
        self.lines = [line for line in lines if not _logged_after(line, start)]
        torn = raw and not raw.endswith(b"\n")  # a crash mid-append: the next line must not join it
        if len(self.lines) < len(lines) or torn:
            self._rewrite()
        if self.local:
            self.lines = []  # appended to: nothing to hold

    def add(self, record: dict) -> None:
        line = json.dumps(record).encode("utf-8")
        if self.local:
            with open(self.path, "ab") as f:
                f.write(line + b"\n")
        else:
            self.lines.append(line)
            self._rewrite()

    def _rewrite(self) -> None:
        write_bytes_atomic(self.path, b"".join(line + b"\n" for line in self.lines))


def _logged_after(line: bytes, start: int) -> bool:
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):  # not JSON (UnicodeDecodeError is a ValueError), not an object
        return False
    return isinstance(step, int) and step > start


class _Stop:
    """SIGTERM/SIGINT ask the loop to save and stop at the next step boundary."""

    def __init__(self):
        self.requested = False
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. inside a notebook worker)
                pass
        return self

    def _handle(self, signum, frame):
        if self.requested:  # a second Ctrl-C: stop now
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _agree_max(values: list[int]) -> list[int]:
    """The element-wise max over processes (every process must feed the same shapes)."""
    if jax.process_count() == 1:
        return list(values)
    from jax.experimental import multihost_utils

    return [int(x) for x in np.max(multihost_utils.process_allgather(np.asarray(values, np.int64)), axis=0)]


class StopTogether(Exception):
    """All processes agreed to stop at this step boundary; ``reason`` says why (the strongest
    reason any process had: an error, then a signal, then the end of the data)."""

    REASONS = (None, "end of data", "signal", "error")

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class PeerFailed(RuntimeError):
    """Another process failed; this one saved the agreed step and stops too."""


class GlobalBatches:
    """The step's global batch: this process's rows from the batcher, candidates, the fetch plan,
    and what all processes must agree on at every step boundary. One small all-gather per step
    (multi-process runs only) carries the distinct-word count, the fetch capacity (which only
    grows) and whether any process wants to stop, so that every stop happens at the same step on
    every process and no process is left waiting in a collective of a step the others skipped.

    ``prefetch``: host batches (``prefetch.HostPipeline``) built ahead in a background thread,
    while the device runs the step before, and copied to the devices there (0: built in ``next``,
    on the loop's thread). The agreement stays on the loop's thread, once per step in step order;
    a batch it changes (another process needs more words or capacity) is planned and copied again.
    ``workers``: processes that draw the candidates ahead (``prefetch.CandidatePool``; 0: drawn
    where the batch is built, the default, as ``RunSettings.host_workers``). ``close()``
    stops both; so does dropping the object.

    The batcher runs ahead of the loop: a checkpoint saves ``data_state()``, not
    ``batcher.state()``.
    """

    def __init__(self, batcher: LMBatcher, train_cfg: TrainConfig, mesh: Mesh, seed: int, first_device: int,
                 fixed: bool, prefetch: int = 2, workers: int = 0):
        self.batcher, self.train, self.mesh, self.seed = batcher, train_cfg, mesh, seed
        self.first_device, self.fixed, self.capacity = first_device, fixed, 0
        self.sharding = NamedSharding(mesh, P(AXIS))
        self.error: BaseException | None = None  # this process's own failure, re-raised after the save
        self.prefetch = prefetch
        # Built ahead, a batch is copied to the devices ahead too: in the loop's thread each copy
        # waits for the GIL, which the builder's Python code holds more often than not.
        self.host = HostPipeline(batcher, train_cfg, mesh.size, seed, first_device, fixed, workers,
                                 keep_state=prefetch > 0,
                                 to_device=functools.partial(_global_arrays, self.sharding, mesh.size) if prefetch
                                 else None)
        self._prefetcher: Prefetcher | None = None  # started by the first next(): it knows the first step
        self._snapshot: list | None = None  # batcher.snapshot() after the last batch taken
        # What to stop, in order; the finaliser holds the list, not self, so dropping self stops them.
        self._parts: list = [self.host]
        self._closer = weakref.finalize(self, _close_all, self._parts)

    def next(self, step_number: int, stopping: str | None = None) -> dict:
        """The global batch of ``step_number``; raises ``StopTogether`` if any process stops here.

        ``stopping``: this process's own reason to stop (``StopTogether.REASONS``). An exception
        while building the batch is one too (kept in ``self.error``). Called once per step, in
        step order."""
        n, local, capacity, arrays = self.mesh.size, None, 0, None
        if stopping is None:
            try:
                item = self._take(step_number)
            except Exception as e:  # noqa: BLE001 - e.g. the prefetch thread is gone
                item = HostBatch(step_number, error=e)
            if item.data_snapshot is not None:
                self._snapshot = item.data_snapshot
            if isinstance(item.error, StopIteration):
                stopping = "end of data"
            elif item.error is not None:  # every process must hear of it before it stops
                stopping, self.error = "error", item.error
            else:
                # A batch built ahead may have been planned before the last agreement.
                local, capacity, arrays = item.batch, max(item.capacity, self.capacity), item.arrays
        words = local["chars"].shape[1] if local is not None else 0
        words, capacity, reason = _agree_max([words, capacity, StopTogether.REASONS.index(stopping)])
        if reason:
            raise StopTogether(StopTogether.REASONS[reason])
        if local["fetch"].shape[-1] != capacity:  # another process needs more: plan again with its capacity
            local, _ = plan_batch(local, self.train.n_tokens_vocab, n, capacity)
            arrays = None
        self.capacity = self.host.agreed = capacity
        if words != local["chars"].shape[1]:
            local["chars"] = np.pad(local["chars"], ((0, 0), (0, words - local["chars"].shape[1]), (0, 0)))
            arrays = None
        return arrays if arrays is not None else _global_arrays(self.sharding, n, local)

    def _take(self, step_number: int) -> HostBatch:
        if not self.prefetch:
            return self.host.build(step_number)
        if self._prefetcher is None:
            self._snapshot = self.batcher.snapshot()  # before the thread moves the batcher on
            self._prefetcher = Prefetcher(self.host.build, step_number, self.prefetch)
            self._parts.insert(0, self._prefetcher)  # stopped before the pool it draws from
        item = self._prefetcher.take()
        if item.step != step_number:
            raise RuntimeError(f"asked for the batch of step {step_number}, but the next one prefetched is of step "
                               f"{item.step}: GlobalBatches.next must be called once per step, in order")
        return item

    def data_state(self) -> dict:
        """The batcher's state after the last batch ``next`` took (what a checkpoint of the steps
        taken so far holds; with prefetch the batcher itself is further on)."""
        if self._prefetcher is None:
            return self.batcher.state()
        return self.batcher.state(self._snapshot)

    def epoch(self) -> int:
        """The batcher's epoch after the last batch ``next`` took (the one to log)."""
        if self._prefetcher is None:
            return self.batcher.epoch
        return LMBatcher.epoch_of(self._snapshot)

    def close(self) -> None:
        """Stops the prefetch thread and the candidate workers (idempotent)."""
        self._closer()


def _global_arrays(sharding: NamedSharding, n: int, local: dict) -> dict:
    """This process's host batch ``[D, ...]`` -> the step's global arrays ``[n, ...]``."""
    # One call for the whole dict: jax transfers its arrays as one batch (in one process, a single
    # device_put) instead of paying a call's Python overhead per array.
    local = {k: local[k] for k in BATCH_KEYS}
    shapes = {k: (n,) + v.shape[1:] for k, v in local.items()}
    return jax.make_array_from_process_local_data(sharding, local, shapes)


def _close_all(parts: list) -> None:
    for part in parts:
        part.close()


def _restore_or_init(ckpt: Checkpointer, meta: dict | None, options: Options, settings: RunSettings,
                     shardings: TrainState, global_rows: int, batcher: LMBatcher,
                     init_state: dict | None) -> tuple[int, TrainState]:
    """(start step, state on the mesh): the newest readable checkpoint, else ``init_state``, else a
    fresh init.

    A checkpoint is global arrays, so it restores onto any mesh whose size divides the padded
    softmax. Resumed with the same number of processes and global rows the run continues exactly;
    with another row count the data position (epoch, shard, sentence) is kept and the rows'
    buffered text and LSTM state start afresh; with another number of processes (whose shards
    differ) the data starts afresh too. Every process decides the same from the shared metadata.
    """
    t, model = options.train, options.model
    layout = RowLayout.for_vocab(t.n_tokens_vocab)
    rows_sharding = shardings.lstm
    zero_rows = jax.jit(lambda: lstm.zero_state(model, global_rows), out_shardings=rows_sharding)
    restored = None
    if meta is not None:
        same_procs = meta.get("process_count") == jax.process_count()

        def abstract(m: dict):
            if m.get("format", 1) == 1:  # read onto one device, converted below
                return abstract_shared(options, m), None
            target = jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                            abstract_shared(options, m), shardings.shared())
            return target, abstract_rows(model, global_rows, rows_sharding) if m.get("global_rows") == global_rows \
                else None

        restored = ckpt.restore_latest(abstract, with_host=same_procs)
    if restored is None:
        key = jax.random.PRNGKey(settings.seed)
        if init_state is None:
            return 0, jax.jit(lambda: init_train_state(key, model, t, global_rows), out_shardings=shardings)()
        shared = put_global(softmax_in_slot_order(init_state, layout), shardings.shared())
        return 0, TrainState(**shared, lstm=zero_rows())
    start, shared, rows, host, saved = restored
    if saved.get("format", 1) == 1:
        shared = put_global(softmax_in_slot_order(jax.device_get(shared), layout), shardings.shared())
        if host is not None and saved.get("global_rows") == global_rows:
            rows = {k: jax.make_array_from_process_local_data(rows_sharding[k], np.asarray(v), (2, v.shape[1], global_rows, v.shape[3]))
                    for k, v in host["lstm"].items()}
    if host is not None:
        batcher.restore(host["data"])
    where = f"{settings.run_dir}: step {start} was saved by {saved.get('process_count')} process(es) with " \
            f"{saved.get('global_rows')} rows, resumed by {jax.process_count()} with {global_rows}: params and " \
            f"optimizer state restored"
    if host is None:
        warnings.warn(f"{where}; the data starts afresh (shards are dealt per process) and so does the LSTM state")
    elif rows is None:
        warnings.warn(f"{where}, and the data position (epoch {batcher.epoch}); the rows' buffered text and "
                      f"LSTM state start afresh")
    return start, TrainState(**shared, lstm=rows if rows is not None else zero_rows())


def _recipe(t: TrainConfig, meta: dict | None) -> str:
    """The start line's word on sentence-start resets, the one recipe choice that is not bilm-tf's."""
    if not t.reset_state_prob:
        older = meta is not None and "reset_state_prob" not in meta["options"]
        return "reset_state_prob 0, bilm-tf's recipe" + (
            ": this run dir predates the 0.1 default, and a run keeps its recipe" if older else "")
    return f"reset_state_prob {t.reset_state_prob:g}"


def saved_options(run_dir: str) -> dict | None:
    """The options dict (bilm-tf's layout) the newest readable checkpoint of ``run_dir`` was saved
    with, or None when it has none."""
    if not epath.Path(run_dir, "checkpoints").is_dir():
        return None
    ckpt = Checkpointer(run_dir, read_only=True)
    try:
        meta = ckpt.latest_meta()
    finally:
        ckpt.close()
    return None if meta is None else meta["options"]


def _check_evaluation(settings: RunSettings, heldout: Source | None, vocab: Vocabulary, options: Options) -> None:
    """Held-out evaluation that could never run fails now, not silently hours later."""
    if not settings.eval_every:
        return
    if settings.eval_every % settings.log_every:
        raise ConfigError(f"--eval-every {settings.eval_every} is not a multiple of --log-every {settings.log_every} "
                          f"(held-out perplexity is computed at logged steps)")
    if heldout is None:
        return
    t = options.train
    probe = LMBatcher(heldout, vocab, rows_per_device=t.batch_size, unroll_steps=t.unroll_steps,
                      max_chars=options.model.char_cnn.max_characters_per_token, max_epochs=1, shuffle=False)
    try:
        probe.next()
    except StopIteration:
        names = ", ".join(heldout.name(i) for i in range(min(len(heldout), 3)))
        raise DataError(f"the held-out text ({names}) is smaller than one evaluation batch ({t.batch_size} rows x "
                        f"{t.unroll_steps} tokens); give more text or a smaller --batch-size") from None


def pretrain(options: Options, vocab: Vocabulary, source: Source, settings: RunSettings,
             heldout: Source | None = None, init_state: dict | None = None,
             on_metrics: Callable[[dict], None] | None = None, fixed_candidates: bool = False) -> dict:
    """Trains (or resumes) into ``settings.run_dir``. Returns the last logged metrics.

    ``init_state``: a shared state, softmax in id order (``warmstart.finetune_state``), to start
    from instead of a fresh init (fine-tuning).
    """
    t, model = options.train, options.model
    _check_evaluation(settings, heldout, vocab, options)
    epath.Path(settings.run_dir).mkdir(parents=True, exist_ok=True)  # a gs:// run dir too
    n_local, devices = jax.local_device_count(), jax.devices()
    if settings.devices is not None:
        if jax.process_count() > 1 and settings.devices != n_local:
            raise CheckpointError("a multi-host run uses every local device; drop --devices")
        if not 1 <= settings.devices <= n_local:
            raise CheckpointError(f"--devices {settings.devices}: this process has {n_local} device(s)")
        n_local, devices = settings.devices, jax.local_devices()[:settings.devices]
    # Before anything that waits for the other processes (Orbax syncs them): all refuse alike.
    shards = shard_for_process(source, jax.process_index(), jax.process_count())
    mesh = Mesh(np.array(devices), (AXIS,))
    layout = RowLayout.for_vocab(t.n_tokens_vocab)
    try:
        layout.rows_per_device(mesh.size)
    except LayoutError as e:
        raise CheckpointError(str(e)) from None
    global_rows = t.batch_size * mesh.size
    first_device = jax.process_index() * n_local
    ckpt = Checkpointer(settings.run_dir, keep=settings.keep, async_save=settings.async_save)
    epochs = settings.epochs if settings.epochs is not None else (None if settings.steps else t.n_epochs)
    total = settings.steps
    if total is None and epochs is not None:
        total = math.ceil(epochs * t.n_train_tokens / (global_rows * t.unroll_steps))
    meta = ckpt.latest_meta()
    if meta is not None:
        check_compatible(meta, options, vocab, settings.run_dir)
    elif jax.process_index() == 0:
        options.save(os.path.join(settings.run_dir, "options.json"))
        write_vocab_file(os.path.join(settings.run_dir, "vocab.txt"), vocab)

    max_epochs = math.ceil(settings.epochs) if settings.epochs else None
    batcher = LMBatcher(source, vocab, rows_per_device=t.batch_size, unroll_steps=t.unroll_steps,
                        max_chars=model.char_cnn.max_characters_per_token, n_devices=n_local, seed=settings.seed,
                        shards=shards, first_row=first_device * t.batch_size, max_epochs=max_epochs)
    abstract = jax.eval_shape(lambda: init_train_state(jax.random.PRNGKey(0), model, t, global_rows))
    shardings = state_shardings(abstract, mesh)
    start, state = _restore_or_init(ckpt, meta, options, settings, shardings, global_rows, batcher, init_state)

    # Real tokens per step, each counted once although both directions learn from it (over an
    # epoch every token is one forward and one backward target): bilm-tf's tokens/s.
    tokens_per_step = global_rows * t.unroll_steps
    if total is not None and start >= total:
        print(f"{settings.run_dir}: already trained to step {start} (asked for {total}); nothing to do")
        ckpt.close()
        return {"step": start}
    matmuls = policy.check(settings.precision or policy.default_for_training())
    if jax.process_index() == 0:
        until = f" to step {total}" if total is not None else ""
        until += f" ({matmuls} matmuls, {_recipe(t, meta)})"
        if start:
            stream = batcher.streams[0]
            print(f"resuming {settings.run_dir} from step {start} (epoch {batcher.epoch}, shard "
                  f"{stream.shard_pos + 1} of {len(stream.shards)}){until}")
        else:
            how = "from scratch" if init_state is None else "from the given initial state"
            print(f"starting {settings.run_dir} {how}{until}")
    step_fn = make_train_step(model, t, mesh, compute=Compute.from_policy(matmuls))
    batches = GlobalBatches(batcher, t, mesh, settings.seed, first_device, fixed_candidates,
                            prefetch=settings.prefetch, workers=settings.host_workers)
    metrics = _MetricsFile(os.path.join(settings.run_dir, "metrics.jsonl"), start) if jax.process_index() == 0 \
        else None
    progress = None
    if settings.progress and jax.process_index() == 0:
        from tqdm.auto import tqdm
        progress = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)

    saved = [start]

    def save(step_number: int) -> None:
        if saved[-1] == step_number:  # e.g. a signal arrived on a save step
            return
        saved.append(step_number)
        ckpt.save(step_number, state.shared(), state.lstm, {"data": batches.data_state()},
                  _meta(options, vocab, global_rows, n_local))

    last: dict = {}
    pending = None  # the previous step's metrics: read after the next step is dispatched
    window = {"loss_sum_fwd": 0.0, "loss_sum_bwd": 0.0, "count": 0.0, "grad_norm": 0.0, "n": 0}
    # tokens_per_s is step time only: the session's first step (first batch, compile, first run)
    # is reported apart as the first line's startup_s, and each log's own work is off the clock.
    startup = first_run = None
    timed = 0  # this window's steps on the clock
    t_window = time.perf_counter()
    step = start
    reason, error = None, None  # why the loop stopped early; this process's own failure in host code
    with _Stop() as stop:
        while total is None or step < total:
            try:
                batch = batches.next(step, "error" if error else "signal" if stop.requested else None)
            except StopTogether as e:
                reason = e.reason
                break
            state, m = step_fn(state, batch)
            step += 1
            try:  # host code: a failure stops every process at the next boundary, after a save
                if first_run is None:
                    # jit compiles inside the call but runs asynchronously: wait for this one run.
                    t_run = time.perf_counter()
                    jax.block_until_ready(m)
                    now = time.perf_counter()
                    startup, first_run, t_window = now - t_window, now - t_run, now
                else:
                    timed += 1
                if pending is not None:
                    _accumulate(window, pending)
                pending = m
                if step % settings.log_every == 0 or (total is not None and step == total):
                    _accumulate(window, pending)
                    pending = None
                    # A window of the first step alone has only that step's run to time.
                    n, seconds = (timed, time.perf_counter() - t_window) if timed else (1, first_run)
                    last = _summarise(window, step, batches.epoch(), tokens_per_step * n, seconds)
                    if startup is not None:
                        last["startup_s"], startup = startup, None
                    window = {k: 0.0 for k in window} | {"n": 0}
                    if settings.eval_every and heldout is not None and step % settings.eval_every == 0:
                        last.update({f"heldout_{k}": v for k, v in
                                     evaluate(state.params, model, vocab, heldout, batch_size=t.batch_size,
                                              unroll_steps=t.unroll_steps, layout=layout).items()})
                    if metrics is not None:
                        metrics.add(last)
                    if progress is not None:
                        progress.set_postfix(loss=f"{last['loss']:.3f}", ppl=f"{last['perplexity']:.1f}",
                                             tok_s=f"{last['tokens_per_s']:.0f}")
                    if on_metrics is not None:
                        on_metrics(last)
                    t_window, timed = time.perf_counter(), 0
                if progress is not None:
                    progress.update(1)
                if step % settings.save_every == 0:
                    save(step)
            except Exception as e:  # noqa: BLE001
                error = e
    if pending is not None:
        _accumulate(window, pending)
    batches.close()  # the batches built ahead are not needed; data_state() stays
    save(step)  # every process reaches this at the same step
    ckpt.close()
    if progress is not None:
        progress.close()
    mine = error or batches.error
    if mine is not None:  # after the save: the last sound state is on disk
        raise mine
    if reason == "error":
        raise PeerFailed(f"another process failed: stopped at step {step}; checkpoint saved in {settings.run_dir}")
    if reason == "signal":
        print(f"stopped at step {step}; checkpoint saved in {settings.run_dir}")
    if reason == "end of data":  # under --epochs, the first process to read all its shards ends the epoch
        print(f"end of data at step {step}; checkpoint saved in {settings.run_dir}")
    last["step"] = step
    return last


def _accumulate(window: dict, m: dict) -> None:
    for k in ("loss_sum_fwd", "loss_sum_bwd", "count", "grad_norm"):
        window[k] += float(np.asarray(m[k].addressable_data(0)))  # replicated: any local copy
    window["n"] += 1


def _summarise(w: dict, step: int, epoch: int, tokens: int, seconds: float) -> dict:
    fwd, bwd = w["loss_sum_fwd"] / w["count"], w["loss_sum_bwd"] / w["count"]
    loss = 0.5 * (fwd + bwd)
    return {"step": step, "epoch": epoch, "loss": loss, "loss_fwd": fwd, "loss_bwd": bwd,
            "perplexity": math.exp(min(loss, 50.0)), "grad_norm": w["grad_norm"] / max(w["n"], 1),
            "tokens_per_s": tokens / max(seconds, 1e-9), "time": time.time()}
