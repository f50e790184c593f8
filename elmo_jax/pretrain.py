"""A pretraining run: run directory, resume, the step loop, logging, held-out perplexity, signals.

The train step itself is in ``train.py`` and knows nothing of files; this module is the wrapper
around it (restore-or-init, hooks every N steps, checkpoint on exit), in the levanter/Haiku style.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import time
import warnings
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from elmo_jax import lstm, train
from elmo_jax.chars import Vocabulary
from elmo_jax.checkpoint import CheckpointError, Checkpointer, replicate_state, unreplicate_state, vocab_hash
from elmo_jax.config import ModelConfig, Options, TrainConfig
from elmo_jax.data import LMBatcher, Source, shard_for_process
from elmo_jax.softmax import full_softmax_loss


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
    precision: str = "highest"
    dtype: str = "float32"
    progress: bool = True
    async_save: bool = True
    devices: int | None = None
    """Local devices to use (default: all). Multi-host runs use all of them."""


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
            "format": 1}


def check_compatible(meta: dict, options: Options, vocab: Vocabulary, run_dir: str) -> None:
    """A run dir resumes only the run it holds: same model, same training keys, same vocab."""
    saved = meta["options"]
    now = options.to_dict()
    ignore = {"n_epochs", "n_train_tokens"}  # how long to run may change between sessions
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


def _batch_source(batcher: LMBatcher, train_cfg: TrainConfig, seed: int, first_device: int, fixed: bool):
    def next_batch(step_number: int) -> dict:
        return train.add_candidates(batcher.next(), step=step_number, seed=seed,
                                    num_sampled=train_cfg.n_negative_samples_batch,
                                    vocab_size=train_cfg.n_tokens_vocab, first_device=first_device, fixed=fixed)
    return next_batch


def pretrain(options: Options, vocab: Vocabulary, source: Source, settings: RunSettings,
             heldout: Source | None = None, init_state: dict | None = None,
             on_metrics: Callable[[dict], None] | None = None, fixed_candidates: bool = False) -> dict:
    """Trains (or resumes) into ``settings.run_dir``. Returns the last logged metrics.

    ``init_state``: an unreplicated state to start from instead of a fresh init (fine-tuning).
    """
    t, model = options.train, options.model
    os.makedirs(settings.run_dir, exist_ok=True)
    n_local, n_global = jax.local_device_count(), jax.device_count()
    if settings.devices is not None:
        if jax.process_count() > 1 and settings.devices != n_local:
            raise CheckpointError("a multi-host run uses every local device; drop --devices")
        if not 1 <= settings.devices <= n_local:
            raise CheckpointError(f"--devices {settings.devices}: this process has {n_local} device(s)")
        n_local = n_global = settings.devices
    global_rows = t.batch_size * n_global
    first_device = jax.process_index() * n_local
    ckpt = Checkpointer(settings.run_dir, keep=settings.keep, async_save=settings.async_save)
    epochs = settings.epochs if settings.epochs is not None else (None if settings.steps else t.n_epochs)
    total = settings.steps
    if total is None and epochs is not None:
        total = math.ceil(epochs * t.n_train_tokens / (global_rows * t.unroll_steps))
    meta = ckpt.latest_meta()
    if meta is not None:
        check_compatible(meta, options, vocab, settings.run_dir)
    else:
        if jax.process_index() == 0:
            options.save(os.path.join(settings.run_dir, "options.json"))
            vocab_path = os.path.join(settings.run_dir, "vocab.txt")
            tmp = f"{vocab_path}.tmp-{os.getpid()}"
            with open(tmp, "w", encoding="utf-8") as f:
                f.write("\n".join(vocab.words) + "\n")
            os.replace(tmp, vocab_path)

    shards = shard_for_process(source, jax.process_index(), jax.process_count())
    max_epochs = math.ceil(settings.epochs) if settings.epochs else None
    batcher = LMBatcher(source, vocab, rows_per_device=t.batch_size, unroll_steps=t.unroll_steps,
                        max_chars=model.char_cnn.max_characters_per_token, n_devices=n_local, seed=settings.seed,
                        shards=shards, first_row=first_device * t.batch_size, max_epochs=max_epochs)
    fresh = init_state if init_state is not None else train.init_state(jax.random.PRNGKey(settings.seed), model, t)
    shared_fresh = {k: v for k, v in fresh.items() if k != "lstm"}
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype)
                                      if not isinstance(x, jax.ShapeDtypeStruct) else x, shared_fresh)
    # Which rows and shards a process owns depends on the process and device layout (the data
    # order is a function of seed, data and layout). Resumed on the same layout, the run continues
    # exactly; on another, params and optimizer state carry over and the data position and LSTM
    # rows start afresh (every process decides the same from the shared metadata).
    same_layout = meta is not None and (meta.get("process_count"), meta.get("local_devices")) == \
        (jax.process_count(), n_local)
    restored = ckpt.restore_latest(abstract, with_host=same_layout) if meta is not None else None
    start = 0
    if restored is not None:
        start, shared, host, _ = restored
        if host is not None:
            rows = {k: np.asarray(v) for k, v in host["lstm"].items()}
            batcher.restore(host["data"])
        else:
            warnings.warn(f"{settings.run_dir}: saved by {meta.get('process_count')} process(es) x "
                          f"{meta.get('local_devices')} device(s), resumed on {jax.process_count()} x {n_local}: "
                          f"params and optimizer state restored; data position and LSTM state start afresh")
            rows = jax.device_get(lstm.zero_state(model, t.batch_size * n_local))
        state = replicate_state(shared, rows, n_local)
    else:
        zero_rows = {k: np.zeros((2, model.lstm.n_layers, t.batch_size * n_local, v.shape[-1]), np.float32)
                     for k, v in fresh["lstm"].items()}
        state = replicate_state(jax.device_get(shared_fresh), zero_rows, n_local)
    del fresh, shared_fresh
    # Put the state on the devices the way pmap returns it, so that the first and later steps
    # share one compiled program (host arrays in, device arrays out would compile twice).
    mesh = jax.sharding.Mesh(np.array(jax.local_devices()[:n_local]), (train.AXIS,))
    state = jax.device_put(state, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(train.AXIS)))

    # Real tokens per step, each counted once although both directions learn from it (over an
    # epoch every token is one forward and one backward target): bilm-tf's tokens/s.
    tokens_per_step = global_rows * t.unroll_steps
    if total is not None and start >= total:
        print(f"{settings.run_dir}: already trained to step {start} (asked for {total}); nothing to do")
        ckpt.close()
        return {"step": start}
    dtype = jnp.bfloat16 if settings.dtype == "bfloat16" else jnp.float32
    step_fn = train.make_train_step(model, t, settings.precision, dtype,
                                    jax.local_devices()[:n_local] if settings.devices else None)
    next_batch = _batch_source(batcher, t, settings.seed, first_device, fixed_candidates)
    metrics_path = os.path.join(settings.run_dir, "metrics.jsonl")
    progress = None
    if settings.progress and jax.process_index() == 0:
        from tqdm.auto import tqdm
        progress = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)

    saved = [start]

    def save(step_number: int) -> None:
        if saved[-1] == step_number:  # e.g. a signal arrived on a save step
            return
        saved.append(step_number)
        shared, rows = unreplicate_state(state)
        host = {"lstm": rows, "data": batcher.state()}
        ckpt.save(step_number, shared, host, _meta(options, vocab, global_rows, n_local))

    last: dict = {}
    pending = None  # the previous step's metrics: read after the next step is dispatched
    window = {"loss_sum_fwd": 0.0, "loss_sum_bwd": 0.0, "count": 0.0, "grad_norm": 0.0, "n": 0}
    t_window = time.perf_counter()
    step = start
    with _Stop() as stop:
        while total is None or step < total:
            try:
                batch = next_batch(step)
            except StopIteration:
                break
            state, m = step_fn(state, batch)
            step += 1
            if pending is not None:
                _accumulate(window, pending)
            pending = m
            if step % settings.log_every == 0 or (total is not None and step == total):
                _accumulate(window, pending)
                pending = None
                now = time.perf_counter()
                last = _summarise(window, step, batcher.epoch, tokens_per_step, now - t_window)
                t_window = now
                window = {k: 0.0 for k in window} | {"n": 0}
                if settings.eval_every and heldout is not None and step % settings.eval_every == 0:
                    last.update({f"heldout_{k}": v for k, v in
                                 evaluate(_params0(state), model, vocab, heldout, t.batch_size, t.unroll_steps).items()})
                if jax.process_index() == 0:
                    with open(metrics_path, "a", encoding="utf-8") as f:
                        f.write(json.dumps(last) + "\n")
                if progress is not None:
                    progress.set_postfix(loss=f"{last['loss']:.3f}", ppl=f"{last['perplexity']:.1f}",
                                         tok_s=f"{last['tokens_per_s']:.0f}")
                if on_metrics is not None:
                    on_metrics(last)
            if progress is not None:
                progress.update(1)
            if step % settings.save_every == 0 or stop.requested:
                save(step)
            if stop.requested:
                break
    if pending is not None:
        _accumulate(window, pending)
    save(step)
    ckpt.close()
    if progress is not None:
        progress.close()
    if stop.requested:
        print(f"stopped at step {step}; checkpoint saved in {settings.run_dir}")
    last["step"] = step
    return last


def _params0(state: dict) -> dict:
    return jax.tree_util.tree_map(lambda x: x[0], state["params"])


def _accumulate(window: dict, m: dict) -> None:
    m = jax.device_get(m)
    for k in ("loss_sum_fwd", "loss_sum_bwd", "count", "grad_norm"):
        window[k] += float(np.asarray(m[k])[0])
    window["n"] += 1


def _summarise(w: dict, step: int, epoch: int, tokens_per_step: int, seconds: float) -> dict:
    fwd, bwd = w["loss_sum_fwd"] / w["count"], w["loss_sum_bwd"] / w["count"]
    loss = 0.5 * (fwd + bwd)
    return {"step": step, "epoch": epoch, "loss": loss, "loss_fwd": fwd, "loss_bwd": bwd,
            "perplexity": math.exp(min(loss, 50.0)), "grad_norm": w["grad_norm"] / max(w["n"], 1),
            "tokens_per_s": tokens_per_step * w["n"] / max(seconds, 1e-9), "time": time.time()}


# -- evaluation ---------------------------------------------------------------------------------

def evaluate(params: dict, model: ModelConfig, vocab: Vocabulary, source: Source, batch_size: int = 16,
             unroll_steps: int = 20, reset_state_per_sentence: bool = False, precision: str = "highest") -> dict:
    """Full-softmax perplexities: ``{"perplexity", "perplexity_fwd", "perplexity_bwd", "tokens"}``.

    Default: bilm-tf's protocol, state carried across sentences within each row, one pass over the
    data in file order. The perplexity is ``exp(mean CE)`` over all target tokens with
    ``CE = 0.5 * (CE_fwd + CE_bwd)`` per position (bilm-tf's mean over equal-sized batches is
    the same number). ``reset_state_per_sentence``: every sentence from zero state, alone.
    """
    if reset_state_per_sentence:
        return _evaluate_sentences(params, model, vocab, source, batch_size, precision)
    batcher = LMBatcher(source, vocab, rows_per_device=batch_size, unroll_steps=unroll_steps,
                        max_chars=model.char_cnn.max_characters_per_token, max_epochs=1, shuffle=False)
    step = _eval_fn(model, precision)
    state = lstm.zero_state(model, batch_size)
    sums, count = np.zeros(2), 0
    for batch in batcher:
        b = {k: v[0] for k, v in batch.items()}
        state, ce = step(params, state, b)
        sums += [float(ce["ce_fwd"].sum()), float(ce["ce_bwd"].sum())]
        count += b["targets"][0].size
    if count == 0:
        raise ValueError(f"no complete evaluation window in the held-out data (need at least "
                         f"{batch_size} x {unroll_steps} tokens); lower --batch-size")
    return _perplexities(sums, count)


def _perplexities(sums: np.ndarray, count: int) -> dict:
    fwd, bwd = sums / count
    return {"perplexity": math.exp(0.5 * (fwd + bwd)), "perplexity_fwd": math.exp(fwd),
            "perplexity_bwd": math.exp(bwd), "tokens": int(count)}


_EVAL_CACHE: dict = {}


def _eval_fn(model: ModelConfig, precision: str):
    key = (model, precision)
    if key not in _EVAL_CACHE:
        _EVAL_CACHE[key] = jax.jit(lambda p, s, b: train.eval_step(p, s, b, model=model, precision=precision))
    return _EVAL_CACHE[key]


def _evaluate_sentences(params, model, vocab, source, batch_size, precision) -> dict:
    """Each sentence alone from zero state: inputs ``<S> w..`` -> targets ``w.. </S>`` (and reversed)."""
    from elmo_jax.chars import batch_to_ids

    sentences = [line.split() for i in range(len(source)) for line in source.read(i)]
    sentences.sort(key=len)  # length buckets: little padding; the result does not depend on order
    fn = _sentence_eval_fn(model, precision)
    sums, count = np.zeros(2), 0
    for lo in range(0, len(sentences), batch_size):
        chunk = sentences[lo:lo + batch_size]
        n = max(len(s) for s in chunk) + 1
        n = -(-n // 8) * 8
        rows = len(chunk)
        fwd_in = [["<S>"] + s for s in chunk]
        bwd_in = [["</S>"] + s[::-1] for s in chunk]
        targets = np.zeros((2, batch_size, n), np.int32)
        mask = np.zeros((batch_size, n), bool)
        for r, s in enumerate(chunk):
            targets[0, r, :len(s) + 1] = np.append(vocab.encode(s), vocab.eos)
            targets[1, r, :len(s) + 1] = np.append(vocab.encode(s[::-1]), vocab.bos)
            mask[r, :len(s) + 1] = True
        pad = [[] for _ in range(batch_size - rows)]
        chars = np.stack([batch_to_ids(fwd_in + pad, model.char_cnn.max_characters_per_token, n),
                          batch_to_ids(bwd_in + pad, model.char_cnn.max_characters_per_token, n)])
        ce = np.asarray(fn(params, chars, targets, mask))
        sums += ce.sum(axis=(1, 2))
        count += int(mask.sum())
    return _perplexities(sums, count)


def _sentence_eval_fn(model, precision):
    key = ("sentences", model, precision)
    if key not in _EVAL_CACHE:
        from elmo_jax import char_cnn

        @jax.jit
        def fn(params, chars, targets, mask):
            x = char_cnn.apply(params["bilm"]["char_cnn"], model, chars, precision)  # [2, B, T, P]
            outs, _ = lstm.run(params["bilm"]["lstm"], model, x, mask, None, precision)
            p = model.lstm.projection_dim
            sm = params["softmax"]
            ce = jnp.stack([full_softmax_loss(outs[-1, d].reshape(-1, p), targets[d].reshape(-1), sm["w"], sm["b"],
                                              precision).reshape(mask.shape) for d in range(2)])
            return jnp.where(mask[None], ce, 0.0)
        _EVAL_CACHE[key] = fn
    return _EVAL_CACHE[key]
