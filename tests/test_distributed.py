"""Data parallelism: the device split and the process split do not change the optimisation.

1. ``test_pmap_two_devices_equals_one``: one global batch of 2B rows, one (then a second) train
   step on one device (B' = 2B rows) and on two devices (B rows each): params, optimizer state,
   the carried LSTM rows and the metrics agree. Dropout is on: its keys come from the global row
   ids, so the split must not matter.
2. ``test_multihost_cli_equals_single_process``: the real CLI, ``train --coordinator ...``, in two
   processes with one CPU device each (jax.distributed, gloo collectives), against the same CLI
   in this process with two local devices. Final params, per-step losses and LSTM rows agree.

   The data needs care: with several processes each one streams only its own shards
   (``shard_for_process``) into its own rows, while one process streams all shards, in one seeded
   order per epoch, into all rows. The two layouts give the same global batches only in special
   cases; here one sentence per shard, exactly one window long, and a seed for which the epoch
   order is [0, 1] in every epoch of both directions (found, and checked, by building the batches
   of both layouts with ``LMBatcher``). In general a run's data depends on its process count.

conftest.py gives this process two CPU devices; the worker processes override XLA_FLAGS to one.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import time

import jax
import numpy as np

from elmo_jax import train
from elmo_jax.chars import Vocabulary
from elmo_jax.checkpoint import load_run, replicate_state, unreplicate_state
from elmo_jax.config import CharCNNConfig, LSTMConfig, ModelConfig, Options, TrainConfig
from elmo_jax.data import LMBatcher, TextFiles, shard_for_process

TOL = 1e-5

TINY = ModelConfig(
    char_cnn=CharCNNConfig(embedding_dim=4, filters=((1, 4), (2, 4), (3, 8)), n_highway=1,
                           n_characters=262, max_characters_per_token=10),
    lstm=LSTMConfig(dim=16, projection_dim=8, n_layers=2, cell_clip=3.0, proj_clip=3.0,
                    use_skip_connections=True),
)

TEXT = """the cat sat on the mat .
a dog ran to the red door and back again .
it was cold .
we saw the big red dog near the old mill by the river today .
birds sing .
the old man and the sea went out at dawn with a small boat .
rain fell on the roof all night long .
she read a book .
zebra quagga okapi .
"""
OOV = {"zebra", "quagga", "okapi", "mill"}  # inputs keep their characters, targets become <UNK>


def _two_local_devices() -> None:
    assert jax.process_count() == 1 and jax.local_device_count() == 2, \
        "tests/conftest.py should give this process 2 CPU devices (XLA_FLAGS) before jax is imported"


def _max_diff(a, b) -> float:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))) for x, y in zip(la, lb))


def _assert_trees_close(a, b, what: str, tol: float = TOL) -> None:
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b), what
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape, f"{what}{jax.tree_util.keystr(path)}: {x.shape} vs {y.shape}"
        np.testing.assert_allclose(x, y, rtol=0, atol=tol, err_msg=f"{what}{jax.tree_util.keystr(path)}")


def _words(batch: dict) -> np.ndarray:
    """``[D, 2, B, T, max_chars]``: the input words' char ids, decoded from ``chars``/``inputs``
    (``chars`` is per device, so batches are compared by spelling, not by index)."""
    chars, inputs = batch["chars"], batch["inputs"]
    return np.stack([chars[k][inputs[k]] for k in range(chars.shape[0])])


# -- 1. one process, one device vs two devices ----------------------------------------------------

def _step(step_fn, state: dict, batch: dict) -> tuple[dict, dict]:
    # Host arrays in, host arrays out: every call then has the same (host) input kind and
    # reuses the one compiled executable, and the donated buffers are never ours.
    new, metrics = step_fn(state, batch)
    return jax.device_get(new), jax.device_get(metrics)


def test_pmap_two_devices_equals_one(tmp_path):
    _two_local_devices()
    (tmp_path / "train.txt").write_text(TEXT)
    words = sorted({w for line in TEXT.split("\n") for w in line.split()} - OOV)
    vocab = Vocabulary(["<S>", "</S>", "<UNK>"] + words)
    b, steps = 2, 5
    t = TrainConfig(n_tokens_vocab=len(vocab), batch_size=b, unroll_steps=steps, n_negative_samples_batch=8,
                    dropout=0.1, n_epochs=1, n_train_tokens=100)
    source = TextFiles(str(tmp_path / "train.txt"))
    common = dict(unroll_steps=steps, max_chars=TINY.char_cnn.max_characters_per_token, seed=3)
    one_batcher = LMBatcher(source, vocab, rows_per_device=2 * b, n_devices=1, **common)
    two_batcher = LMBatcher(source, vocab, rows_per_device=b, n_devices=2, **common)

    fresh = jax.device_get(train.init_state(jax.random.PRNGKey(7), TINY, t))
    shared = {k: v for k, v in fresh.items() if k != "lstm"}
    # A non-zero carried state: the rows' state must follow the rows to their device.
    rng = np.random.default_rng(0)
    rows = {"c": rng.normal(size=(2, TINY.lstm.n_layers, 2 * b, TINY.lstm.dim)).astype(np.float32),
            "h": rng.uniform(-1, 1, size=(2, TINY.lstm.n_layers, 2 * b, TINY.lstm.projection_dim)).astype(np.float32)}
    state1 = replicate_state(shared, rows, 1)
    state2 = replicate_state(shared, rows, 2)
    assert state1["lstm"]["c"].shape == (1, 2, TINY.lstm.n_layers, 2 * b, TINY.lstm.dim)
    assert state2["lstm"]["c"].shape == (2, 2, TINY.lstm.n_layers, b, TINY.lstm.dim)
    step_fn1 = train.make_train_step(TINY, t)  # a leading axis of 1: pmap runs it on one device
    step_fn2 = train.make_train_step(TINY, t)

    prev_params = shared["params"]
    cand = dict(seed=11, num_sampled=t.n_negative_samples_batch, vocab_size=t.n_tokens_vocab, fixed=True)
    for step_number in range(2):
        batch1 = train.add_candidates(one_batcher.next(), step=step_number, **cand)
        batch2 = train.add_candidates(two_batcher.next(), step=step_number, **cand)
        # The same global batch: device k's rows are rows k*B..(k+1)*B-1 of the one-device batch.
        split = lambda x: x.reshape(x.shape[:-2] + (2, b, steps)).swapaxes(-4, -3)[0]  # [1,2,2B,T]->[2,2,B,T]
        np.testing.assert_array_equal(_words(batch2),
                                      _words(batch1)[0].reshape(2, 2, b, steps, -1).swapaxes(0, 1))
        np.testing.assert_array_equal(batch2["targets"], split(batch1["targets"]))
        np.testing.assert_array_equal(batch2["rows"].reshape(-1), batch1["rows"].reshape(-1))
        np.testing.assert_array_equal(batch2["rows"], np.arange(2 * b).reshape(2, b))
        np.testing.assert_array_equal(batch2["candidates"][0], batch2["candidates"][1])
        np.testing.assert_array_equal(batch2["candidates"][0], batch1["candidates"][0])

        if step_number == 1:
            # Negative control: with device-local row ids (0..B-1 on both devices) the dropout
            # masks change and so do the results, i.e. this comparison can see the row keys.
            wrong = {**batch2, "rows": np.tile(np.arange(b, dtype=np.int32), (2, 1))}
            bad, _ = _step(step_fn2, state2, wrong)
            _, bad_rows = unreplicate_state(bad)
        # The two layouts compile side by side (a little less wall time on 2 cores).
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            run1 = pool.submit(_step, step_fn1, state1, batch1)
            new2, m2 = _step(step_fn2, state2, batch2)
            new1, m1 = run1.result()
        shared1, rows1 = unreplicate_state(new1)
        shared2, rows2 = unreplicate_state(new2)
        assert rows1["c"].shape == rows2["c"].shape == (2, TINY.lstm.n_layers, 2 * b, TINY.lstm.dim)

        where = f"step {step_number + 1}: "
        _assert_trees_close(shared2, shared1, where + "state")
        _assert_trees_close(rows2, rows1, where + "lstm rows")
        # The replicated parts really are replicated on both devices.
        _assert_trees_close({k: jax.tree_util.tree_map(lambda x: x[1], v) for k, v in new2.items() if k != "lstm"},
                            shared2, where + "device 1 copy", tol=0)
        for k in ("loss_sum_fwd", "loss_sum_bwd", "count", "grad_norm"):
            assert m1[k].shape == (1,) and m2[k].shape == (2,), k
            assert m2[k][0] == m2[k][1], f"{where}{k} differs between devices: {m2[k]}"
            np.testing.assert_allclose(m2[k][0], m1[k][0], rtol=TOL, atol=TOL, err_msg=where + k)
        assert m1["count"][0] == 2 * b * steps
        # The step really moved the parameters and the state (not a vacuous comparison).
        assert _max_diff(shared1["params"], prev_params) > 1e-3
        if step_number == 1:
            assert _max_diff(bad_rows, rows1) > 1e-3, "row ids do not reach the dropout keys"
        prev_params = shared1["params"]
        state1, state2 = new1, new2
    assert int(shared1["step"]) == 2


# -- 2. two processes (jax.distributed) vs one process with two devices ----------------------------

MH_STEPS, MH_T = 3, 6
SHARDS = ("the cat sat on a", "dogs ran to big it")  # MH_T - 1 words each: one sentence per window


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _global_batches(source, vocab, seed, n_steps, per_process: bool) -> list[dict]:
    """The global batches (as spellings) that ``pretrain`` builds with 2 devices in 1 process, or
    with 1 device in each of 2 processes (each reading ``shard_for_process`` shards)."""
    common = dict(rows_per_device=1, unroll_steps=MH_T, max_chars=TINY.char_cnn.max_characters_per_token, seed=seed)
    if per_process:
        batchers = [LMBatcher(source, vocab, n_devices=1, shards=shard_for_process(source, p, 2), first_row=p, **common)
                    for p in range(2)]
    else:
        batchers = [LMBatcher(source, vocab, n_devices=2, shards=shard_for_process(source, 0, 1), first_row=0,
                              **common)]
    out = []
    for _ in range(n_steps):
        parts = [bt.next() for bt in batchers]
        out.append({"words": np.concatenate([_words(p) for p in parts]),
                    "targets": np.concatenate([p["targets"] for p in parts]),
                    "rows": np.concatenate([p["rows"] for p in parts])})
    return out


def _matching_seed(source, vocab) -> int:
    """A seed whose global batches are the same under both process layouts (see module notes).

    The per-process batchers stream process p's shards into its own rows; one process streams all
    shards, in a seeded per-epoch order, into all rows. With one sentence per shard that exactly
    fills a window, row k reads shard k in both layouts iff that order is [0, 1] in every epoch
    (for both directions): a seed for which it is, is found by comparing the batches themselves."""
    for seed in range(1000):
        a = _global_batches(source, vocab, seed, MH_STEPS, per_process=True)
        b = _global_batches(source, vocab, seed, MH_STEPS, per_process=False)
        if all(all(np.array_equal(x[k], y[k]) for k in x) for x, y in zip(a, b)):
            return seed
    raise AssertionError("no seed < 1000 gives both layouts the same batches")


def _train_args(tmp_path, run_dir, seed) -> list[str]:
    return ["train", "--config", str(tmp_path / "options.json"), "--train-files", str(tmp_path / "shard-*.txt"),
            "--vocab", str(tmp_path / "vocab.txt"), "--run-dir", str(run_dir), "--steps", str(MH_STEPS),
            "--seed", str(seed), "--log-every", "1", "--no-progress"]


def _start_workers(tmp_path, seed) -> tuple[list, list]:
    port = _free_port()
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
    env.pop("JAX_COORDINATOR_ADDRESS", None)
    procs, logs = [], []
    for i in range(2):
        log = open(tmp_path / f"worker{i}.log", "w+")
        args = _train_args(tmp_path, tmp_path / "run_mh", seed) + [
            "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)]
        procs.append(subprocess.Popen([sys.executable, "-m", "elmo_jax", *args], env=env, stdout=log,
                                      stderr=subprocess.STDOUT, cwd=tmp_path))
        logs.append(log)
    return procs, logs


def _wait_workers(procs, logs, timeout) -> None:
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    report = []
    for i, (p, log) in enumerate(zip(procs, logs)):
        log.seek(0)
        report.append(f"--- process {i}: exit {p.returncode}\n{log.read()[-3000:]}")
        log.close()
    assert all(p.returncode == 0 for p in procs), "multi-host workers failed:\n" + "\n".join(report)


def test_multihost_cli_equals_single_process(tmp_path, capsys):
    from elmo_jax import cli

    _two_local_devices()
    for i, line in enumerate(SHARDS):
        (tmp_path / f"shard-{i}.txt").write_text(line + "\n")
    words = sorted({w for line in SHARDS for w in line.split()})
    vocab_words = ["<S>", "</S>", "<UNK>", *words, "extra", "words"]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab_words) + "\n")
    vocab = Vocabulary(vocab_words)
    train_cfg = TrainConfig(n_tokens_vocab=len(vocab), batch_size=1, unroll_steps=MH_T, n_negative_samples_batch=6,
                            dropout=0.1, n_epochs=1, n_train_tokens=100)
    Options(model=TINY, train=train_cfg).save(tmp_path / "options.json")

    source = TextFiles(str(tmp_path / "shard-*.txt"))
    assert len(source) == 2
    seed = _matching_seed(source, vocab)

    # Two processes, one device each, through the real CLI (--coordinator ...); meanwhile the same
    # CLI in this process with no --coordinator and two local devices (their compiles overlap).
    procs, logs = _start_workers(tmp_path, seed)
    t0 = time.monotonic()
    try:
        rc = cli.main(_train_args(tmp_path, tmp_path / "run_1p", seed))
    finally:
        _wait_workers(procs, logs, timeout=300 - (time.monotonic() - t0))
    assert rc == 0
    capsys.readouterr()

    opts_mh, vocab_mh, params_mh, step_mh = load_run(str(tmp_path / "run_mh"))
    opts_1p, vocab_1p, params_1p, step_1p = load_run(str(tmp_path / "run_1p"))
    assert step_mh == step_1p == MH_STEPS
    assert opts_mh == opts_1p and vocab_mh.words == vocab_1p.words
    fresh = train.init_state(jax.random.PRNGKey(seed), TINY, train_cfg)["params"]
    assert _max_diff(params_1p, fresh) > 1e-3  # trained, not the init
    _assert_trees_close(params_mh, params_1p, "params")

    # Per-step losses (written by process 0 from psum'd sums) agree too.
    def losses(run):
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return np.array([[json.loads(x)[k] for k in ("step", "loss_fwd", "loss_bwd", "grad_norm")] for x in lines])
    np.testing.assert_allclose(losses("run_mh"), losses("run_1p"), rtol=1e-5, atol=1e-5)
    assert len(losses("run_1p")) == MH_STEPS

    # The carried LSTM rows: process p's file holds global row p; the single process holds both.
    def host_rows(run, p):
        with np.load(tmp_path / run / "host_state" / f"{MH_STEPS}.p{p}.npz") as f:
            return {k: f[f"lstm/{k}"] for k in ("c", "h")}
    mh = [host_rows("run_mh", p) for p in range(2)]
    one = host_rows("run_1p", 0)
    for k in ("c", "h"):
        assert mh[0][k].shape[2] == 1 and one[k].shape[2] == 2
        np.testing.assert_allclose(np.concatenate([mh[0][k], mh[1][k]], axis=2), one[k], rtol=0, atol=TOL,
                                   err_msg=f"lstm {k}")
