"""Data parallelism over a device mesh: the device split, the process split and a restart on
another mesh do not change the optimisation.

1. ``test_mesh_two_devices_equals_one``: one global batch of 2B rows, two train steps on a mesh of
   one device (2B rows) and of two (B rows each, the softmax split by rows): params, optimizer
   state, the carried LSTM rows and the metrics agree. Dropout is on: its keys come from the
   global row ids, so the split must not matter. The softmax shards really are V_pad / 2 rows, and
   the compiled step gathers or all-reduces nothing that large. So are the state resets at sentence
   starts (``reset_state_prob``).
2. Restarts: 6 steps on 2 devices equal 3 on 2 devices and 3 more on 1 device with twice the rows
   per device; a restart with another global row count keeps params, optimizer state and data
   position with one warning; a run dir of the previous checkpoint format resumes.
3. ``test_multihost_cli_equals_single_process``: the real CLI, ``train --coordinator ...``, in two
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

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings

import jax
import numpy as np
import pytest
from helpers import (
    FIXTURES,
    free_port,
    gpu_candidates,
    multiprocess_env,
    read_never_returns,
    spelled_inputs,
    xla_flags,
)
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from elmo_jax._util.hlo import collectives
from elmo_jax.cli.coordinator import DONE_GRACE, listens
from elmo_jax.config import CharCNNConfig, LSTMConfig, ModelConfig, Options, TrainConfig
from elmo_jax.model.compute import Compute
from elmo_jax.model.layout import BY_BACKEND
from elmo_jax.model.vocabulary import Vocabulary
from elmo_jax.text.sources import TextFiles, shard_for_process
from elmo_jax.training.batches import LMBatcher
from elmo_jax.training.checkpoint import Checkpointer
from elmo_jax.training.global_batches import GlobalBatches
from elmo_jax.training.loop import RunSettings, _restore_or_init, pretrain
from elmo_jax.training.run_dir import abstract_rows, abstract_shared, load_run, read_run, softmax_in_id_order
from elmo_jax.training.setup import saved_steps
from elmo_jax.training.sharded_softmax import RowLayout
from elmo_jax.training.step import AXIS, init_state, make_train_step, put_global, state_shardings

TOL = 1e-5

TINY = ModelConfig(
    char_cnn=CharCNNConfig(
        embedding_dim=4, filters=((1, 4), (2, 4), (3, 8)), n_highway=1, n_characters=262, max_characters_per_token=10
    ),
    lstm=LSTMConfig(dim=16, projection_dim=8, n_layers=2, cell_clip=3.0, proj_clip=3.0, use_skip_connections=True),
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
    assert jax.process_count() == 1 and jax.local_device_count() == 2, (
        "tests/conftest.py should give this process 2 CPU devices (XLA_FLAGS) before jax is imported"
    )


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


def _setup(tmp_path):
    (tmp_path / "train.txt").write_text(TEXT)
    words = sorted({w for line in TEXT.split("\n") for w in line.split()} - OOV)
    vocab = Vocabulary(["<S>", "</S>", "<UNK>"] + words)
    t = TrainConfig(
        n_tokens_vocab=len(vocab),
        batch_size=2,
        unroll_steps=5,
        n_negative_samples_batch=8,
        dropout=0.1,
        n_epochs=1,
        n_train_tokens=100,
    )
    return vocab, t, TextFiles(str(tmp_path / "train.txt"))


def _mesh(n: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:n]), (AXIS,))


# -- 1. one process, one device vs two devices ----------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout", [None, BY_BACKEND["gpu"], gpu_candidates()], ids=["backend", "gpu-layout", "gpu-candidates"]
)
def test_mesh_two_devices_equals_one(tmp_path, layout):
    """Also under the GPU's layout (rows, with the LSTM's hand-written backward pass), and with
    the switches a GPU has yet to time (the wavefront LSTM, the char CNN's max backward), run here."""
    _two_local_devices()
    compute = Compute(layout=layout)
    vocab, t, source = _setup(tmp_path)
    t = TrainConfig(**{**t.__dict__, "reset_state_prob": 0.5})  # resets, like dropout, follow the global rows
    b, steps = t.batch_size, t.unroll_steps
    layout = RowLayout.for_vocab(t.n_tokens_vocab)
    common = dict(unroll_steps=steps, max_chars=TINY.char_cnn.max_characters_per_token, seed=3)
    batchers = {
        1: LMBatcher(source, vocab, rows_per_device=2 * b, n_devices=1, **common),
        2: LMBatcher(source, vocab, rows_per_device=b, n_devices=2, **common),
    }
    configs = {1: TrainConfig(**{**t.__dict__, "batch_size": 2 * b}), 2: t}

    fresh = jax.device_get(init_state(jax.random.PRNGKey(7), TINY, t, rows=2 * b))
    # A non-zero carried state: the rows' state must follow the rows to their device.
    rng = np.random.default_rng(0)
    rows = {
        "c": rng.normal(size=(2, TINY.lstm.n_layers, 2 * b, TINY.lstm.dim)).astype(np.float32),
        "h": rng.uniform(-1, 1, size=(2, TINY.lstm.n_layers, 2 * b, TINY.lstm.projection_dim)).astype(np.float32),
    }
    host_state = fresh.replace(lstm=rows)
    states, fns = {}, {}
    for n in (1, 2):
        shardings = state_shardings(host_state, _mesh(n))
        states[n] = put_global(host_state, shardings)
        fns[n] = make_train_step(TINY, configs[n], _mesh(n), compute=compute)
    # The sharding is real: each device holds V_pad / n softmax rows and accumulators, B rows of LSTM state.
    for part in ("params", "opt"):
        for name, x in getattr(states[2], part)["softmax"].items():
            assert [s.data.shape[0] for s in x.addressable_shards] == [layout.padded // 2] * 2, (part, name)
    assert [s.data.shape[2] for s in states[2].lstm["c"].addressable_shards] == [b, b]

    prev = fresh.params
    feeders = {n: GlobalBatches(batchers[n], configs[n], _mesh(n), seed=11, first_device=0, fixed=True) for n in (1, 2)}
    for step_number in range(2):
        batch = {n: feeders[n].next(step_number) for n in (1, 2)}
        host = {n: jax.device_get(batch[n]) for n in (1, 2)}
        # The same global batch: device k's rows are rows k*B..(k+1)*B-1 of the one-device batch.
        np.testing.assert_array_equal(
            spelled_inputs(host[2]), spelled_inputs(host[1])[0].reshape(2, 2, b, steps, -1).swapaxes(0, 1)
        )
        np.testing.assert_array_equal(host[2]["targets"], host[1]["targets"][0].reshape(2, 2, b, steps).swapaxes(0, 1))
        np.testing.assert_array_equal(host[2]["rows"], np.arange(2 * b).reshape(2, b))
        np.testing.assert_array_equal(host[2]["candidates"][0], host[2]["candidates"][1])
        np.testing.assert_array_equal(host[2]["candidates"][0], host[1]["candidates"][0])
        if step_number == 0:
            ops = collectives(fns[2].lower(states[2], batch[2]).compile().as_text())
            assert {c.op for c in ops} >= {"all-reduce", "all-to-all"}, ops
            shard_size = layout.padded // 2 * TINY.lstm.projection_dim
            big = [c for c in ops if c.op in ("all-gather", "all-reduce") and max(c.sizes) >= shard_size]
            assert not big, f"a softmax-sized operand is gathered or all-reduced: {big}"
        if step_number == 1:
            # Negative control: with device-local row ids (0..B-1 on both devices) the dropout
            # masks change and so do the results, i.e. this comparison can see the row keys.
            local_rows = jax.device_put(np.tile(np.arange(b, dtype=np.int32), (2, 1)), batch[2]["rows"].sharding)
            copy = jax.tree_util.tree_map(lambda x: x.copy(), states[2])
            bad, _ = fns[2](copy, {**batch[2], "rows": local_rows})
            bad_rows = jax.device_get(bad.lstm)
        new, metrics = {}, {}
        for n in (1, 2):
            states[n], metrics[n] = fns[n](states[n], batch[n])
            new[n], metrics[n] = jax.device_get((states[n], metrics[n]))
        where = f"step {step_number + 1}: "
        _assert_trees_close(new[2].shared(), new[1].shared(), where + "state")
        _assert_trees_close(new[2].lstm, new[1].lstm, where + "lstm rows")
        for k in ("loss_sum_fwd", "loss_sum_bwd", "count", "grad_norm"):
            np.testing.assert_allclose(metrics[2][k], metrics[1][k], rtol=TOL, atol=TOL, err_msg=where + k)
        assert metrics[1]["count"] == 2 * b * steps
        # The step really moved the parameters and the state (not a vacuous comparison).
        assert _max_diff(new[1].params, prev) > 1e-3
        if step_number == 1:
            assert _max_diff(bad_rows, new[1].lstm) > 1e-3, "row ids do not reach the dropout keys"
        prev = new[1].params
    assert int(new[2].step) == 2


@pytest.mark.slow
def test_a_draw_of_candidates_follows_its_rows_not_their_device(tmp_path):
    """``rows_per_draw``: one device of 2B rows in 2 draws takes the same steps as 2 devices of
    B rows with a draw each, their own draws (not ``fixed``): bilm-tf's towers on one device.
    The negative control: one draw for all 2B rows takes other steps."""
    _two_local_devices()
    vocab, t, source = _setup(tmp_path)
    b = t.batch_size
    common = dict(unroll_steps=t.unroll_steps, max_chars=TINY.char_cnn.max_characters_per_token, seed=3)
    runs = {  # name: (devices, config)
        "towers": (1, TrainConfig(**{**t.__dict__, "batch_size": 2 * b, "rows_per_draw": b})),
        "devices": (2, t),
        "one draw": (1, TrainConfig(**{**t.__dict__, "batch_size": 2 * b})),
    }
    fresh = jax.device_get(init_state(jax.random.PRNGKey(7), TINY, t, rows=2 * b))
    new, metrics, cands = {}, {}, {}
    for name, (n, config) in runs.items():
        batcher = LMBatcher(source, vocab, rows_per_device=config.batch_size, n_devices=n, **common)
        feeder = GlobalBatches(batcher, config, _mesh(n), seed=11, first_device=0, fixed=False)
        state = put_global(fresh, state_shardings(fresh, _mesh(n)))
        step = make_train_step(TINY, config, _mesh(n))
        for step_number in range(2):
            batch = feeder.next(step_number)
            if step_number == 0:
                cands[name] = jax.device_get(batch["candidates"])
            state, m = step(state, batch)
        feeder.close()
        new[name], metrics[name] = jax.device_get((state, m))
    # [D, 2, G, S]: the two global draws, on one device or one on each.
    assert cands["towers"].shape[:3] == (1, 2, 2) and cands["devices"].shape[:3] == (2, 2, 1)
    np.testing.assert_array_equal(cands["towers"][0].swapaxes(0, 1), cands["devices"][:, :, 0])
    assert not np.array_equal(cands["devices"][0], cands["devices"][1])
    _assert_trees_close(new["towers"].shared(), new["devices"].shared(), "state")
    _assert_trees_close(new["towers"].lstm, new["devices"].lstm, "lstm rows")
    for k in ("loss_sum_fwd", "loss_sum_bwd", "grad_norm"):
        np.testing.assert_allclose(metrics["towers"][k], metrics["devices"][k], rtol=TOL, atol=TOL, err_msg=k)
    assert _max_diff(new["one draw"].params, new["towers"].params) > 1e-3


def test_the_collective_check_can_fail():
    """``hlo.collectives`` sees a gathered softmax shard (the control for the check above)."""
    _two_local_devices()
    mesh = _mesh(2)
    gather = jax.jit(
        jax.shard_map(
            lambda w: jax.lax.all_gather(w, AXIS, tiled=True),
            mesh=mesh,
            in_specs=P(AXIS),
            out_specs=P(),
            check_vma=False,
        )
    )
    w = jax.device_put(np.zeros((3072, 8), np.float32), NamedSharding(mesh, P(AXIS)))
    ops = collectives(gather.lower(w).compile().as_text())
    assert any(c.op == "all-gather" and max(c.sizes) >= 1536 * 8 for c in ops), ops


# -- 2. restarts on another mesh --------------------------------------------------------------------


def _settings(run_dir, steps, devices, **kw) -> RunSettings:
    return RunSettings(
        run_dir=str(run_dir),
        steps=steps,
        devices=devices,
        save_every=3,
        log_every=1,
        seed=5,
        progress=False,
        async_save=False,
        **kw,
    )


def _rows_and_position(run_dir, step):
    model = Options.load(run_dir / "options.json").model
    ckpt = Checkpointer(str(run_dir), async_save=False)
    options = Options.load(run_dir / "options.json")
    _, rows, host, _ = ckpt.restore(
        step, lambda m: (abstract_shared(options, m), abstract_rows(model, m["global_rows"]))
    )
    ckpt.close()
    return jax.device_get(rows), host["data"]


@pytest.mark.slow
def test_restart_on_one_device_with_twice_the_rows_continues_exactly(tmp_path):
    _two_local_devices()
    vocab, t, source = _setup(tmp_path)
    two = Options(model=TINY, train=t)
    one = Options(model=TINY, train=TrainConfig(**{**t.__dict__, "batch_size": 2 * t.batch_size}))
    pretrain(two, vocab, source, _settings(tmp_path / "straight", 6, 2), fixed_candidates=True)
    pretrain(two, vocab, source, _settings(tmp_path / "moved", 3, 2), fixed_candidates=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # same global rows: nothing restarts, nothing to warn about
        pretrain(one, vocab, source, _settings(tmp_path / "moved", 6, 1), fixed_candidates=True)
    a, b = read_run(str(tmp_path / "straight")), read_run(str(tmp_path / "moved"))
    assert a[3] == b[3] == 6
    _assert_trees_close(b[2], a[2], "params and optimizer state ")
    rows_a, data_a = _rows_and_position(tmp_path / "straight", 6)
    rows_b, data_b = _rows_and_position(tmp_path / "moved", 6)
    _assert_trees_close(rows_b, rows_a, "lstm rows ")
    for d in ("dir0", "dir1"):
        for k in ("position", "buffer_lengths", "buffer_targets"):
            np.testing.assert_array_equal(data_b[d][k], data_a[d][k], err_msg=f"{d}/{k}")
    losses = [
        [json.loads(l)["loss"] for l in (tmp_path / r / "metrics.jsonl").read_text().splitlines()]
        for r in ("straight", "moved")
    ]
    np.testing.assert_allclose(losses[1], losses[0], rtol=TOL)


@pytest.mark.slow
def test_restart_with_another_row_count_keeps_state_and_position_with_one_warning(tmp_path):
    _two_local_devices()
    vocab, t, source = _setup(tmp_path)
    options = Options(model=TINY, train=t)
    run_dir = tmp_path / "run"
    pretrain(options, vocab, source, _settings(run_dir, 3, 2))
    saved = read_run(str(run_dir))[2]
    _, data = _rows_and_position(run_dir, 3)

    # The same options on one device: B global rows instead of 2B.
    mesh = _mesh(1)
    global_rows = t.batch_size
    shardings = state_shardings(jax.eval_shape(lambda: init_state(jax.random.PRNGKey(0), TINY, t)), mesh)
    batcher = LMBatcher(
        source,
        vocab,
        rows_per_device=t.batch_size,
        unroll_steps=t.unroll_steps,
        max_chars=TINY.char_cnn.max_characters_per_token,
        seed=5,
    )
    ckpt = Checkpointer(str(run_dir), async_save=False)
    with pytest.warns(UserWarning) as caught:
        start, state, capacity, *_ = _restore_or_init(
            ckpt, ckpt.latest_meta(), options, _settings(run_dir, 4, 1), shardings, global_rows, batcher, None
        )
    ckpt.close()
    assert len(caught) == 1 and "with 4 rows, resumed by 1 with 2" in str(caught[0].message), [
        str(w.message) for w in caught
    ]
    assert "the data position (epoch" in str(caught[0].message)
    assert start == 3 and capacity == 0  # another mesh size: planned afresh
    layout = RowLayout.for_vocab(t.n_tokens_vocab)
    restored = softmax_in_id_order(jax.device_get(state.shared()), layout)
    _assert_trees_close(restored, saved, "restored ", tol=0)
    assert state.lstm["c"].shape[2] == global_rows and not np.any(np.asarray(state.lstm["c"]))
    for d, stream in enumerate(batcher.streams):
        assert [stream.epoch, stream.shard_pos, stream.sentence_pos] == data[f"dir{d}"]["position"].tolist()
        assert all(not buf for buf in stream.buffers)
    # And it trains on from there.
    assert pretrain(options, vocab, source, _settings(run_dir, 4, 1))["step"] == 4


@pytest.mark.slow
def test_a_run_dir_of_the_previous_format_resumes(tmp_path):
    """A run dir written before the mesh (format 1, see tests/fixtures/format1_run.README) resumes
    on today's code: 2 steps there + 1 here equal 3 steps of the old code within 1e-5."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(FIXTURES / "format1_run", run_dir)
    options = Options.load(run_dir / "options.json", saved=True)  # its own record: no key means 0.0
    vocab = Vocabulary.load(run_dir / "vocab.txt")
    assert Checkpointer(str(run_dir), async_save=False).latest_meta()["format"] == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same layout: its data position and LSTM rows restore
        pretrain(
            options,
            vocab,
            TextFiles(str(FIXTURES / "bilm_tf_train" / "data.txt")),
            RunSettings(run_dir=str(run_dir), steps=3, seed=4, progress=False, devices=1, async_save=False),
        )
    _, _, params, step = load_run(str(run_dir))
    assert step == 3
    with np.load(FIXTURES / "format1_run_step3_params.npz") as f:
        expected = {k: f[k] for k in f.files}
    got = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(params)}
    assert got.keys() == expected.keys()
    for k in got:
        np.testing.assert_allclose(got[k], expected[k], rtol=0, atol=TOL, err_msg=k)


# -- 3. two processes (jax.distributed) vs one process with two devices ----------------------------

MH_STEPS, MH_T = 3, 6
SHARDS = ("the cat sat on a", "dogs ran to big it")  # MH_T - 1 words each: one sentence per window


def _global_batches(source, vocab, seed, n_steps, per_process: bool) -> list[dict]:
    """The global batches (as spellings) that ``pretrain`` builds with 2 devices in 1 process, or
    with 1 device in each of 2 processes (each reading ``shard_for_process`` shards)."""
    common = dict(rows_per_device=1, unroll_steps=MH_T, max_chars=TINY.char_cnn.max_characters_per_token, seed=seed)
    if per_process:
        batchers = [
            LMBatcher(source, vocab, n_devices=1, shards=shard_for_process(source, p, 2), first_row=p, **common)
            for p in range(2)
        ]
    else:
        batchers = [
            LMBatcher(source, vocab, n_devices=2, shards=shard_for_process(source, 0, 1), first_row=0, **common)
        ]
    out = []
    for _ in range(n_steps):
        parts = [bt.next() for bt in batchers]
        out.append(
            {
                "words": np.concatenate([spelled_inputs(p) for p in parts]),
                "targets": np.concatenate([p["targets"] for p in parts]),
                "rows": np.concatenate([p["rows"] for p in parts]),
            }
        )
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
    return [
        "train",
        "--config",
        str(tmp_path / "options.json"),
        "--train-files",
        str(tmp_path / "shard-*.txt"),
        "--vocab",
        str(tmp_path / "vocab.txt"),
        "--run-dir",
        str(run_dir),
        "--steps",
        str(MH_STEPS),
        "--seed",
        str(seed),
        "--log-every",
        "1",
        "--no-progress",
    ]


@pytest.fixture(scope="module")
def worker_cache(tmp_path_factory):
    """One persistent compilation cache for every worker process of this module: the scenarios
    share the model and shapes, so only the first compiles."""
    return str(tmp_path_factory.mktemp("xla_cache"))


@pytest.fixture(scope="module")
def saved_2_and_4(tmp_path_factory, worker_cache):
    """The run dir of a 2-process run of ``_scenario`` to step 4 with checkpoints 2 and 4: made
    once, and copied by each test that resumes it (``_resumed_to_6``)."""
    where = tmp_path_factory.mktemp("saved_2_and_4")
    run_dir, args = _scenario(where, SHARDS, stop=["--steps", "4"])
    _wait_workers(*_start_workers(where, 0, args[:-2] + ["--save-every", "2"], worker_cache), timeout=240)
    assert Checkpointer(run_dir, read_only=True).steps() == [2, 4]
    return run_dir


def _resumed_to_6(tmp_path, saved) -> tuple[pathlib.Path, list[str]]:
    """A copy of ``saved`` (``saved_2_and_4``) in ``tmp_path``, and the command that resumes it to step 6."""
    run_dir, args = _scenario(tmp_path, SHARDS, stop=["--steps", "6"])
    shutil.copytree(saved, run_dir)
    return run_dir, args[:-2] + ["--save-every", "2"]


# Process 1's host code fails once step 3 is logged (the CLI, with one function patched).
FAIL_AT_STEP_3 = """
import sys
from elmo_jax import cli
from elmo_jax.training import hooks
real = hooks.summarise
def failing(sums, n, step, *args):
    if step >= 3:
        raise RuntimeError("injected failure in host code")
    return real(sums, n, step, *args)
hooks.summarise = failing
sys.exit(cli.main(sys.argv[1:]))
"""


# Both processes log a non-finite loss from step 4 on, as a diverged run would.
NAN_FROM_STEP_4 = """
import sys
from elmo_jax import cli
from elmo_jax.training import hooks
real = hooks.summarise
def diverged(sums, n, step, *args):
    record = real(sums, n, step, *args)
    if step >= 4:
        record["loss"] = float("nan")
    return record
hooks.summarise = diverged
sys.exit(cli.main(sys.argv[1:]))
"""


# Process 1 reaches the run's saved options 5 s after process 0 (the CLI, one function wrapped).
LATE_TO_SAVED_OPTIONS = """
import sys, time
from elmo_jax import cli
from elmo_jax.training import setup
real = setup._options_for_run
def late(*args, **kwargs):
    time.sleep(5)
    return real(*args, **kwargs)
setup._options_for_run = late
sys.exit(cli.main(sys.argv[1:]))
"""


# Process 1's Orbax read of step 4's state fails, as where its shards are damaged (the CLI, with
# Orbax's item handler patched); process 0 reads it.
ORBAX_READ_OF_STEP_4_FAILS = """
import sys
import orbax.checkpoint as ocp
from elmo_jax import cli
real = ocp.CompositeCheckpointHandler.restore
def damaged(self, directory, *args, **kwargs):
    items = kwargs.get("args") if "args" in kwargs else (args[0] if args else None)
    if str(directory).rstrip("/").endswith("/4") and items is not None and "state" in items.keys():
        raise ValueError("injected: step 4's shards are damaged on this process")
    return real(self, directory, *args, **kwargs)
ocp.CompositeCheckpointHandler.restore = damaged
sys.exit(cli.main(sys.argv[1:]))
"""

# Orbax's own code raises on process 1 in its restore of step 4's state, before its read (as the
# step's directory missing there, or unreadable, would).
ORBAX_RESTORE_OF_STEP_4_RAISES = """
import errno, sys
import orbax.checkpoint as ocp
from elmo_jax import cli
real = ocp.CheckpointManager.restore
def failing(self, step, *args, **kwargs):
    if step == 4 and "state" in kwargs["args"].keys():
        raise OSError(errno.EIO, "Input/output error")
    return real(self, step, *args, **kwargs)
ocp.CheckpointManager.restore = failing
sys.exit(cli.main(sys.argv[1:]))
"""


# Process 1 lists no step for its first {hidden} s, as a host whose NFS attribute cache still
# holds the directory from before the steps were committed.
STEPS_LISTED_LATE = """
import sys, time
import orbax.checkpoint as ocp
from elmo_jax import cli
real = ocp.CheckpointManager.all_steps
since = []
def late(self, *args, **kwargs):
    since.append(since[0] if since else time.monotonic())
    steps = real(self, *args, **kwargs)
    return [] if time.monotonic() - since[0] < {hidden} else steps
ocp.CheckpointManager.all_steps = late
sys.exit(cli.main(sys.argv[1:]))
"""

# Process 1's host file of step 4 cannot be written (an I/O error); process 0's can.
HOST_FILE_OF_STEP_4_FAILS = """
import errno, sys
import numpy as np
from elmo_jax import cli
real = np.savez
def failing(file, *args, **kwargs):
    if "4.p1" in str(file):
        raise OSError(errno.EIO, "Input/output error")
    return real(file, *args, **kwargs)
np.savez = failing
sys.exit(cli.main(sys.argv[1:]))
"""

# Process 1's array writes of step 4 fail in Orbax's background commit; process 0's go through.
ARRAY_WRITES_OF_STEP_4_FAIL = """
import errno, json, sys
from orbax.checkpoint._src.serialization import serialization
from elmo_jax import cli
real = serialization.async_serialize_from_host
async def failing(rslices, spec, *args, **kwargs):
    if "/4.orbax-checkpoint-tmp" in json.dumps(spec, default=str):
        raise OSError(errno.EIO, "Input/output error")
    return await real(rslices, spec, *args, **kwargs)
serialization.async_serialize_from_host = failing
sys.exit(cli.main(sys.argv[1:]))
"""

# The blocking phase of Orbax's save of step 4's arrays (before their writes go to the background)
# fails on process 1. This is past the directory barriers of Orbax's composite handler: before
# them, or between them, a failure on one process still aborts both (docs/faults.md).
BLOCKING_SAVE_OF_STEP_4_FAILS = """
import errno, sys
import orbax.checkpoint as ocp
from elmo_jax import cli
real = ocp.StandardCheckpointHandler.async_save
async def failing(self, directory, *args, **kwargs):
    if "/4.orbax-checkpoint-tmp" in str(directory):
        raise OSError(errno.EIO, "Input/output error")
    return await real(self, directory, *args, **kwargs)
ocp.StandardCheckpointHandler.async_save = failing
sys.exit(cli.main(sys.argv[1:]))
"""

# Process 0, Orbax's primary, cannot make step 4's temporary directory (it does so in the
# background, and the other processes' writes wait for its word that it did). Any write of step 4
# that still starts on process 0 after that is said: it would land in the directory being removed.
STEP_4_DIRECTORY_FAILS_ON_PROCESS_0 = """
import errno, sys, threading
from orbax.checkpoint._src.futures import future
from orbax.checkpoint._src.path import atomicity
from elmo_jax import cli
real, run_sync = atomicity._create_paths, future.asyncio_utils.run_sync
failed = []
async def failing(tmp_paths, *args, **kwargs):
    if sys.argv[sys.argv.index("--process-id") + 1] == "0" and any(
        "/4.orbax-checkpoint-tmp" in str(p.get()) for p in tmp_paths
    ):
        failed.append(True)
        raise OSError(errno.EIO, "Input/output error")
    return await real(tmp_paths, *args, **kwargs)
def saying_late_writes(coro):
    if failed and isinstance(threading.current_thread(), future._SignalingThread):
        print("write after the failure:", coro.__qualname__, flush=True)
    return run_sync(coro)
atomicity._create_paths = failing
future.asyncio_utils.run_sync = saying_late_writes
sys.exit(cli.main(sys.argv[1:]))
"""

# Orbax's own code raises on one process inside its save of step 4, before its first barrier (as
# its argument checks or its clean-up of an earlier save's temporary directories would), or between
# its barriers (where it names the step's directory): the other waits at the next barrier.
ORBAX_SAVE_OF_STEP_4_RAISES = """
import errno, sys
import orbax.checkpoint as ocp
from elmo_jax import cli
real = ocp.CheckpointManager.{method}
def failing(self, step, *args, **kwargs):
    if step == 4 and sys.argv[sys.argv.index("--process-id") + 1] == "{failing}":
        raise OSError(errno.EIO, "Input/output error")
    return real(self, step, *args, **kwargs)
ocp.CheckpointManager.{method} = failing
sys.exit(cli.main(sys.argv[1:]))
"""


def _start_workers(
    tmp_path,
    seed,
    args: list[str] | None = None,
    cache: str = "none",
    process_1: list[str] | None = None,
    both: list[str] | None = None,
    n: int = 2,
    ids_from: str = "flags",
) -> tuple[list, list]:
    """``n`` CLI processes with one CPU device each (``args``: the train command, default
    ``_train_args`` into run_mh; ``process_1``: how process 1 runs the CLI instead of
    ``-m elmo_jax``; ``both``: how all do; ``ids_from``: ``flags``, or ``slurm`` for the
    coordinator's port and the process ids in the environment of a SLURM job step instead)."""
    port = free_port()
    env = multiprocess_env(dict(os.environ, XLA_FLAGS=xla_flags(1), JAX_PLATFORMS="cpu", ELMO_JAX_COMPILE_CACHE=cache))
    env.pop("JAX_COORDINATOR_ADDRESS", None)
    procs, logs = [], []
    base = args or _train_args(tmp_path, tmp_path / "run_mh", seed)
    for i in range(n):
        log = open(tmp_path / f"worker{i}.log", "w+")
        args, env_i = list(base), env
        if ids_from == "flags":
            args += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(n), "--process-id", str(i)]
        else:
            env_i = env | {"SLURM_JOB_ID": "1", "SLURM_STEP_NODELIST": "127.0.0.1", "SLURM_NTASKS": str(n)}
            env_i |= {"SLURM_PROCID": str(i), "SLURM_LOCALID": str(i), "JAX_COORDINATOR_PORT": str(port)}
        runner = both or (process_1 if i == 1 and process_1 else ["-m", "elmo_jax"])
        procs.append(
            subprocess.Popen(
                [sys.executable, *runner, *args],
                env=env_i,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=tmp_path,
            )
        )
        logs.append(log)
    return procs, logs


def _when_said(proc, log, text: str, timeout: float) -> float:
    """The ``time.monotonic()`` at which ``text`` first showed in a worker's ``log`` (to 0.05 s),
    or at which the worker exited without it, or ``timeout`` s passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if text in pathlib.Path(log.name).read_text(errors="replace"):
            break
        time.sleep(0.05)
    return time.monotonic()


def _wait_workers(procs, logs, timeout, expect_ok: bool = True, expect: int = 0) -> list[str]:
    """The workers' logs once they exit (killed at ``timeout`` s); with ``expect_ok``, each must
    exit ``expect``."""
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
    report, texts = [], []
    for i, (p, log) in enumerate(zip(procs, logs)):
        log.seek(0)
        texts.append(log.read())
        report.append(f"--- process {i}: exit {p.returncode}\n{texts[-1][-3000:]}")
        log.close()
    if expect_ok:
        assert all(p.returncode == expect for p in procs), "multi-host workers failed:\n" + "\n".join(report)
    return texts


@pytest.mark.slow
def test_multihost_cli_equals_single_process(tmp_path, capsys):
    from elmo_jax import cli

    _two_local_devices()
    for i, line in enumerate(SHARDS):
        (tmp_path / f"shard-{i}.txt").write_text(line + "\n")
    words = sorted({w for line in SHARDS for w in line.split()})
    vocab_words = ["<S>", "</S>", "<UNK>", *words, "extra", "words"]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab_words) + "\n")
    vocab = Vocabulary(vocab_words)
    train_cfg = TrainConfig(
        n_tokens_vocab=len(vocab),
        batch_size=1,
        unroll_steps=MH_T,
        n_negative_samples_batch=6,
        dropout=0.1,
        n_epochs=1,
        n_train_tokens=100,
    )
    Options(model=TINY, train=train_cfg).save(tmp_path / "options.json")

    source = TextFiles(str(tmp_path / "shard-*.txt"))
    assert len(source) == 2
    seed = _matching_seed(source, vocab)

    # Two processes, one device each, through the real CLI (--coordinator ...); meanwhile the same
    # CLI in this process with no --coordinator and two local devices (their compiles overlap).
    # Their ids and coordinator come from a SLURM job step's environment, not the flags (``srun``):
    # one run, and process 0 keeps jax's coordination service apart all the same. (Before
    # ``from_cluster``, each process ran alone; with --coordinator, process 0 left it to jax.)
    procs, logs = _start_workers(tmp_path, seed, ids_from="slurm")
    deadline = time.monotonic() + 60
    while _keeper_of(procs[0]) is None and procs[0].poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _keeper_of(procs[0]) is not None, "process 0 keeps no coordination service apart"
    t0 = time.monotonic()
    try:
        rc = cli.main(_train_args(tmp_path, tmp_path / "run_1p", seed))
    finally:
        texts = _wait_workers(procs, logs, timeout=300 - (time.monotonic() - t0))
    assert rc == 0
    capsys.readouterr()
    said = re.search(r"^process 0 of 2, from SLURM's environment \(coordinator (127\.0\.0\.1:\d+)\)$", texts[0], re.M)
    assert said is not None, texts[0][-3000:]
    # Process 0's service (elmo_jax.cli.coordinator) lets go of the port once both ended well.
    address = said[1]
    deadline = time.monotonic() + DONE_GRACE + 5
    while listens(address) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not listens(address)

    opts_mh, vocab_mh, params_mh, step_mh = load_run(str(tmp_path / "run_mh"))
    opts_1p, vocab_1p, params_1p, step_1p = load_run(str(tmp_path / "run_1p"))
    assert step_mh == step_1p == MH_STEPS
    assert opts_mh == opts_1p and vocab_mh.words == vocab_1p.words
    fresh = init_state(jax.random.PRNGKey(seed), TINY, train_cfg).params
    assert _max_diff(params_1p["bilm"], fresh["bilm"]) > 1e-3  # trained, not the init
    _assert_trees_close(params_mh, params_1p, "params")

    # Per-step losses (written by process 0 from psum'd sums) agree too.
    def losses(run):
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return np.array([[json.loads(x)[k] for k in ("step", "loss_fwd", "loss_bwd", "grad_norm")] for x in lines])

    np.testing.assert_allclose(losses("run_mh"), losses("run_1p"), rtol=1e-5, atol=1e-5)
    assert len(losses("run_1p")) == MH_STEPS

    # The carried LSTM rows: one global array in both checkpoints (the two processes wrote a row each).
    rows_mh, _ = _rows_and_position(tmp_path / "run_mh", MH_STEPS)
    rows_1p, _ = _rows_and_position(tmp_path / "run_1p", MH_STEPS)
    assert rows_mh["c"].shape[2] == rows_1p["c"].shape[2] == 2
    _assert_trees_close(rows_mh, rows_1p, "lstm rows ")
    assert _max_diff(rows_1p, jax.tree_util.tree_map(np.zeros_like, rows_1p)) > 1e-3


def _scenario(tmp_path, shards, n_train_tokens: int = 100, stop: list[str] = ("--steps", "100000")):
    """Shard files, vocabulary and options for a 2-process run of TINY, one row per process;
    returns the run dir and the train command (no checkpoint before the stop)."""
    for i, line in enumerate(shards):
        (tmp_path / f"shard-{i}.txt").write_text(line + "\n")
    vocab_words = ["<S>", "</S>", "<UNK>", *sorted({w for line in shards for w in line.split()})]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab_words) + "\n")
    train_cfg = TrainConfig(
        n_tokens_vocab=len(vocab_words),
        batch_size=1,
        unroll_steps=MH_T,
        n_negative_samples_batch=6,
        n_epochs=1,
        n_train_tokens=n_train_tokens,
    )
    Options(model=TINY, train=train_cfg).save(tmp_path / "options.json")
    run_dir = tmp_path / "run"
    args = _train_args(tmp_path, run_dir, 0)
    at = args.index("--steps")
    return run_dir, args[:at] + list(stop) + args[at + 2 :] + ["--save-every", "100000"]


def _wait_for_metrics(run_dir, procs, lines: int) -> None:
    """Until process 0 has logged ``lines`` steps, or a worker has exited."""
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= lines):
        if any(p.poll() is not None for p in procs):
            return
        time.sleep(0.2)


def _wait_for_a_checkpoint(run_dir, procs) -> None:
    """Until a step is saved in ``run_dir``, or a worker has exited."""
    deadline = time.monotonic() + 240
    while not saved_steps(str(run_dir)) and time.monotonic() < deadline and all(p.poll() is None for p in procs):
        time.sleep(0.2)


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_at_the_same_step(tmp_path, capsys, worker_cache):
    """A scheduler preempts one host: both processes agree on the step, save it and exit 143
    (128 + SIGTERM, the signalled one's, on both: the run has not ended); the run resumes from
    that step."""
    from elmo_jax import cli

    _two_local_devices()
    run_dir, args = _scenario(tmp_path, SHARDS)
    procs, logs = _start_workers(tmp_path, 0, args, worker_cache)
    _wait_for_metrics(run_dir, procs, 3)
    assert all(p.poll() is None for p in procs), "a worker stopped early"
    procs[1].send_signal(signal.SIGTERM)  # process 1 only
    t0 = time.monotonic()
    texts = _wait_workers(procs, logs, timeout=60, expect=128 + signal.SIGTERM)
    assert time.monotonic() - t0 < 60
    stopped = [[l for l in text.splitlines() if l.startswith("stopped at step")] for text in texts]
    assert all(len(x) == 1 for x in stopped), texts
    steps = [int(x[0].split()[3].rstrip(";")) for x in stopped]
    assert steps[0] == steps[1] >= 3, steps
    # Process 0 says that the signal was another's (before: the same line as process 1's own).
    assert "(another process was signalled); checkpoint saved" in stopped[0][0], stopped
    assert "another process" not in stopped[1][0], stopped
    step = steps[0]
    assert load_run(str(run_dir))[3] == step
    assert all((run_dir / "host_state" / f"{step}.p{p}.npz").exists() for p in range(2))
    # A restart (here one process with both devices) resumes from that step.
    assert cli.main(args[: args.index("--steps")] + ["--steps", str(step + 1)] + args[args.index("--steps") + 2 :]) == 0
    assert f"from step {step}" in capsys.readouterr().out
    assert load_run(str(run_dir))[3] == step + 1


@pytest.mark.slow
def test_one_process_out_of_data_first_stops_both_at_the_same_step(tmp_path, worker_cache):
    """--epochs 1 and each process reads its own shards: process 1's ends after 2 windows,
    process 0's after 8. Both save step 2 and exit 0.

    Process 1 also reaches the run's saved options 5 s late. Whether a run dir has checkpoints is
    agreed, not looked up by each process alone: a process that looked late used to find the
    checkpoints/ folder the other had just made for the fresh run, open it, and mismatch the
    other's collective (seen in CI). Without the agreement in ``saved_options`` this test fails so."""
    long_shard = "\n".join(SHARDS * 4)  # 8 sentences, one window each
    run_dir, args = _scenario(
        tmp_path, [long_shard, SHARDS[1] + "\n" + SHARDS[0]], n_train_tokens=10_000, stop=["--epochs", "1"]
    )
    procs, logs = _start_workers(tmp_path, 0, args, worker_cache, process_1=["-c", LATE_TO_SAVED_OPTIONS])
    texts = _wait_workers(procs, logs, timeout=240)
    assert "end of data at step 2" in texts[0], texts[0]
    finals = [json.loads([l for l in t.splitlines() if l.startswith("{")][-1]) for t in texts]
    assert [f["step"] for f in finals] == [2, 2], finals
    assert load_run(str(run_dir))[3] == 2
    assert all((run_dir / "host_state" / f"2.p{p}.npz").exists() for p in range(2))


@pytest.mark.slow
def test_an_exception_in_one_process_stops_both_with_the_last_step_saved(tmp_path, worker_cache):
    """Process 1's host code raises after step 3: both save step 3 at the next boundary and exit
    non-zero within 60 s, process 1 with its own error, process 0 saying a peer failed."""
    run_dir, args = _scenario(tmp_path, SHARDS)
    procs, logs = _start_workers(tmp_path, 0, args, worker_cache, process_1=["-c", FAIL_AT_STEP_3])
    _wait_for_metrics(run_dir, procs, 3)
    t0 = time.monotonic()
    texts = _wait_workers(procs, logs, timeout=60, expect_ok=False)
    assert time.monotonic() - t0 < 60
    assert [p.returncode for p in procs] == [1, 1], texts
    assert "injected failure in host code" in texts[1]
    assert "another process failed: stopped at step 3" in texts[0], texts[0]
    assert load_run(str(run_dir))[3] == 3
    assert all((run_dir / "host_state" / f"3.p{p}.npz").exists() for p in range(2))


@pytest.mark.slow
def test_a_divergence_stops_both_processes_at_the_same_step_with_the_same_line(tmp_path, worker_cache):
    """Every process reads the same replicated loss, so each decides alike with no extra
    collective; process 0 sets the bad checkpoint aside, and both name the same newest one."""
    run_dir, args = _scenario(tmp_path, SHARDS)
    args = args[:-2] + ["--save-every", "1"]
    procs, logs = _start_workers(tmp_path, 0, args, worker_cache, both=["-c", NAN_FROM_STEP_4])
    texts = _wait_workers(procs, logs, timeout=240, expect_ok=False)
    assert [p.returncode for p in procs] == [1, 1], texts
    lines = [[l for l in t.splitlines() if "error:" in l] for t in texts]
    assert lines[0] == lines[1] and len(lines[0]) == 1, lines
    assert (
        "the training loss diverged at step 4: loss nan, not finite; step(s) 3, saved after the last healthy "
        "step 2, were moved to"
        in lines[0][0]
        and "the newest checkpoint is step 2" in lines[0][0]
    )
    assert load_run(str(run_dir))[3] == 2
    assert (run_dir / "diverged" / "3" / "checkpoint").is_dir()
    assert sorted(p.name for p in (run_dir / "diverged" / "3").glob("*.npz")) == ["3.p0.npz", "3.p1.npz"]


@pytest.mark.slow
def test_a_process_left_alone_at_start_says_what_is_missing_in_one_line(tmp_path):
    """Processes 0 and 1 of 3 started (process 2 never comes), and a process 1 started with no
    coordinator at its address: each stops after --init-timeout with one line naming the
    coordinator and what to do, exit 1. Process 0, the coordinator, waits a little longer: when it
    did not, a clean-clone run of the suite saw process 1 find it gone and say that nothing
    answered there. (Before, jax.distributed aborted each one from C++ at its initialization
    timeout, 300 s by default: SIGABRT, with a stack trace saying "another task died".)"""
    _, args = _scenario(tmp_path, (*SHARDS, "a third shard"))
    env = dict(os.environ, XLA_FLAGS=xla_flags(1), JAX_PLATFORMS="cpu")
    shared, alone = free_port(), free_port()
    procs = []
    for port, i in ((shared, 0), (shared, 1), (alone, 1)):
        where = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "3", "--process-id", str(i)]
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "elmo_jax", *args, *where, "--init-timeout", "3"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                cwd=tmp_path,
            )
        )
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [1, 1, 1], outs
    for out in outs:
        assert len(out.strip().splitlines()) == 1 and "Terminating" not in out, out
    joined = "not all of the 3 processes joined the run within 3 s; start each one with the same"
    assert f"127.0.0.1:{shared}: {joined}" in outs[0] and f"127.0.0.1:{shared}: {joined}" in outs[1], outs
    assert "no coordinator answered there within 3 s (process 0 starts it); start process 0" in outs[2], outs


@pytest.mark.slow
def test_a_process_told_another_process_count_stops_both_in_one_line(tmp_path):
    """Process 1 started with --num-processes 3 joins process 0's run of 2 all the same: jax counts
    the service's processes. (Before, both trained, process 1 on the shards of a run of 3.) It
    stops with the line, and process 0 hears of it and stops too."""
    _, args = _scenario(tmp_path, (*SHARDS, "a third shard"))
    env = dict(os.environ, XLA_FLAGS=xla_flags(1), JAX_PLATFORMS="cpu")
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "elmo_jax", *args, "--coordinator", f"127.0.0.1:{port}", "--num-processes", n,
             "--process-id", i, "--heartbeat-timeout", "10"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
        )
        for n, i in (("2", "0"), ("3", "1"))
    ]  # fmt: skip
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [1, 2], outs
    line = "elmo-jax train: error: --num-processes 3, but the run has 2 processes (process 0's --num-processes): "
    assert line + "give every process the same" in outs[1], outs[1]
    assert "Traceback" not in outs[0] + outs[1] and "process 1" in outs[0].strip().splitlines()[-1], outs[0]


@pytest.mark.slow
def test_a_killed_process_stops_the_others_in_one_line_naming_it_and_the_step_to_resume(tmp_path, worker_cache):
    """SIGKILL leaves no chance to agree or save. Process 2 of 3 is killed once step 4 is saved:
    the others stop within about --heartbeat-timeout, each with one line naming process 2 and step
    4, exit 1 (had process 0, the coordinator, left first, jax would have ended process 1 from C++:
    SIGABRT); the same command on all three resumes from step 4.
    (Before, jax.distributed aborted both from C++ at its heartbeat timeout, with a stack trace
    saying that "another task died".)"""
    shards = (*SHARDS, "a third shard")
    run_dir, args = _scenario(tmp_path, shards)
    args = args[:-2] + ["--save-every", "4", "--heartbeat-timeout", "5"]
    procs, logs = _start_workers(tmp_path, 0, args, worker_cache, n=3)
    _wait_for_a_checkpoint(run_dir, procs)
    assert all(p.poll() is None for p in procs), "a worker stopped early"
    procs[2].kill()
    t0 = time.monotonic()
    texts = _wait_workers(procs, logs, timeout=60, expect_ok=False)
    assert time.monotonic() - t0 < 30
    assert [p.returncode for p in procs] == [1, 1, -signal.SIGKILL], texts
    saved = saved_steps(str(run_dir))
    assert saved and saved[0] == 4, saved
    for text in texts[:2]:
        assert "Terminating" not in text and "Traceback" not in text, text[-3000:]
        line = text.strip().splitlines()[-1]
        assert line.startswith(
            "elmo-jax train: error: process 2 of 3 stopped answering: no word from it for 5 s (--heartbeat-timeout)"
        ), text[-3000:]
        assert line.endswith(f"restart every process with the same command to resume from step {saved[-1]}"), line

    at = args.index("--steps")
    again = [*args[:at], "--steps", str(saved[-1] + 2), *args[at + 2 :]]
    texts = _wait_workers(*_start_workers(tmp_path, 0, again, worker_cache, n=3), timeout=240)
    assert f"resuming {run_dir} from step {saved[-1]} " in texts[0], texts[0][-3000:]


def _keeper_of(proc: subprocess.Popen) -> int | None:
    """The pid of process 0's child that keeps jax's coordination service
    (``elmo_jax.cli.coordinator``), or None."""
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read()
        except (OSError, ValueError):
            continue
        if ppid == proc.pid and b"elmo_jax.cli.coordinator" in command:
            return int(entry)
    return None


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (an orphan that has exited may stay a zombie until init reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("service", ["kept apart", "killed too"])
def test_a_killed_process_0_stops_the_others_in_one_line_and_the_run_resumes(tmp_path, worker_cache, service):
    """Process 0 is killed once step 4 is saved (SIGKILL, as the out-of-memory killer does). Its
    child keeps jax's coordination service (``elmo_jax.cli.coordinator``), so process 1 finds it
    silent within about --heartbeat-timeout and stops with one line naming process 0 and step 4,
    exit 1; the service then lets go, and the same command on both resumes from step 4.
    The negative control kills the service too, as when jax ran it inside process 0: jax then ends
    process 1 at once from C++ (SIGABRT, "the leader task died"), before any Python can speak."""
    run_dir, args = _scenario(tmp_path, SHARDS)
    args = args[:-2] + ["--save-every", "4", "--heartbeat-timeout", "5"]
    procs, logs = _start_workers(tmp_path, 0, args, worker_cache)
    _wait_for_a_checkpoint(run_dir, procs)
    keeper = _keeper_of(procs[0])
    assert all(p.poll() is None for p in procs) and keeper is not None
    procs[0].kill()
    if service == "killed too":
        os.kill(keeper, signal.SIGKILL)
    t0 = time.monotonic()
    texts = _wait_workers(procs, logs, timeout=60, expect_ok=False)
    if service == "killed too":
        assert time.monotonic() - t0 < 15
        assert procs[1].returncode == -signal.SIGABRT, texts[1][-3000:]
        assert "Terminating process because the JAX distributed service detected fatal errors" in texts[1]
        return
    assert time.monotonic() - t0 < 30
    assert procs[1].returncode == 1, texts[1][-3000:]
    assert "Terminating" not in texts[1] and "Traceback" not in texts[1], texts[1][-3000:]
    saved = saved_steps(str(run_dir))
    assert saved and saved[0] == 4, saved
    line = texts[1].strip().splitlines()[-1]
    assert line.startswith(
        "elmo-jax train: error: process 0 of 2 stopped answering: no word from it for 5 s (--heartbeat-timeout)"
    ), texts[1][-3000:]
    assert line.endswith(f"restart every process with the same command to resume from step {saved[-1]}"), line
    deadline = time.monotonic() + 10  # the service lets go once process 1, its last client, has left
    while _alive(keeper) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(keeper)

    at = args.index("--steps")
    again = [*args[:at], "--steps", str(saved[-1] + 2), *args[at + 2 :]]
    texts = _wait_workers(*_start_workers(tmp_path, 0, again, worker_cache), timeout=240)
    assert f"resuming {run_dir} from step {saved[-1]} " in texts[0], texts[0][-3000:]


# Process 1 cannot read a file the others can, after jax.distributed has started (the CLI, with
# one function patched): a shared file system not mounted on its host.
UNREAD_ON_PROCESS_1 = """
import sys
from elmo_jax import cli
from elmo_jax.training import setup
def unread(*args, **kwargs):
    raise FileNotFoundError(2, "No such file or directory", "/elmo-jax-test-missing-vocab.txt")
setup._options_for_run = unread
sys.exit(cli.main(sys.argv[1:]))
"""

# Process 1's device fails at its 7th step with XLA's error {xla!r}, the others' do not.
DEVICE_ERROR_ON_PROCESS_1 = """
import sys, jax
from elmo_jax import cli
from elmo_jax.training import loop
real_make = loop.make_train_step
calls = [0]
def make(*args, **kwargs):
    real = real_make(*args, **kwargs)
    def step(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 7:
            raise jax.errors.JaxRuntimeError({xla!r})
        return real(*args, **kwargs)
    return step
loop.make_train_step = make
sys.exit(cli.main(sys.argv[1:]))
"""
OUT_OF_MEMORY = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4.00GiB."
ILLEGAL_ADDRESS = "INTERNAL: CUDA error: an illegal memory access was encountered"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("program", "code", "said"),
    [
        (UNREAD_ON_PROCESS_1, 2, "/elmo-jax-test-missing-vocab.txt: does not exist"),
        (
            DEVICE_ERROR_ON_PROCESS_1.format(xla=OUT_OF_MEMORY),
            1,
            "{run}: the device ran out of memory (RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
            "4.00GiB.); --batch-size 1 rows per device is more than it holds: lower --batch-size, or spread the "
            "rows over more devices; step(s) 5 are intact: rerun with a lower --batch-size to resume from step 5",
        ),
        (
            DEVICE_ERROR_ON_PROCESS_1.format(xla=ILLEGAL_ADDRESS),
            1,
            "{run}: the device failed during the run (INTERNAL: CUDA error: an illegal memory access was "
            "encountered); step(s) 5 are intact: check the device (nvidia-smi, on a GPU); once it works, rerun the "
            "same command to resume from step 5",
        ),
    ],
    ids=["before-training", "out-of-memory-in-a-step", "device-failed-in-a-step"],
)
def test_a_process_failing_alone_stops_the_others_with_its_line(tmp_path, worker_cache, program, code, said):
    """Process 1 of 3 stops with its one-line error where no agreement carries it: before
    training, out of device memory in a step, or its device failed in a step (which first waits
    to see that no peer died: XLA's words for a collective that lost its peer may read as a device
    failure). Processes 0 and 2, waiting in a collective, stop
    too, within seconds, with one line quoting process 1's; all three leave through jax's shutdown
    barrier. (Before, with 2 processes: before training, process 0's collective timed out 30 s
    later with a traceback from inside jax; in a step, it waited in the step's collective past the
    test's 120 s.)"""
    run_dir, args = _scenario(tmp_path, (*SHARDS, "a third shard"))
    args = args[:-2] + ["--save-every", "5", "--heartbeat-timeout", "20"]
    procs, logs = _start_workers(tmp_path, 0, args, worker_cache, process_1=["-c", program], n=3)
    said_at = _when_said(procs[1], logs[1], "error:", timeout=120)
    texts = _wait_workers(procs, logs, timeout=120, expect_ok=False)
    # Within seconds of process 1's line, not at the --heartbeat-timeout (20 s) or a collective's
    # timeout; timed from that line, since the start-up's compiles take longer on a slow machine.
    assert time.monotonic() - said_at < 15  # 0.7 to 6.5 s on the 2-core EPYC
    assert [p.returncode for p in procs] == [1, code, 1], texts
    said = said.format(run=run_dir)
    [line] = [x for x in texts[1].splitlines() if "error" in x]
    assert line == f"elmo-jax train: error: {said}", texts[1]
    for text in texts[0], texts[2]:
        [line] = [x for x in text.splitlines() if "error" in x]
        # Process 1's own advice goes for every process; a line without any gets some.
        follow = (
            " (every process alike)"
            if code == 1
            else "; once its cause is fixed, restart every process with the same command"
        )
        assert line == f"elmo-jax train: error: process 1 of 3 stopped with an error: {said}{follow}", text
    assert not any("Traceback" in text or "Terminating" in text for text in texts), texts


@pytest.mark.slow
def test_a_suspend_of_the_whole_run_longer_than_the_timeouts_is_survived(tmp_path, worker_cache):
    """A scheduler suspends the job (SIGSTOP to every process, as SLURM's suspend does: process 0's
    keeper of the coordination service too) for 18 s, past --heartbeat-timeout 2 and past jax's
    own heartbeat timeout (14 s): once resumed, no process takes another for dead (each watch
    leaves out the time it could not run), and the run goes on until SIGTERM stops it with its
    checkpoint. (Before: both stopped, each saying process 0 had stopped answering; later, past
    jax's timeout, jax's service ended both from C++ as it woke: its own timeout is now a day,
    ``multihost.SERVICE_HEARTBEAT``, and tests/probe_suspend.py tries longer suspends.)"""
    run_dir, args = _scenario(tmp_path, SHARDS)
    args = args[:-2] + ["--save-every", "4", "--heartbeat-timeout", "2"]
    procs, logs = _start_workers(tmp_path, 0, args, worker_cache)
    _wait_for_a_checkpoint(run_dir, procs)
    every = [_keeper_of(procs[0]), *(p.pid for p in procs)]
    assert None not in every
    for pid in every:
        os.kill(pid, signal.SIGSTOP)
    time.sleep(2 * 2 + 10 + 4)  # past jax's client heartbeat timeout (multihost.JAX_HEARTBEAT_FACTOR)
    for pid in every:
        os.kill(pid, signal.SIGCONT)
    time.sleep(4)  # two timeouts: a death would have been said by now
    assert all(p.poll() is None for p in procs), "a worker stopped after the suspend"
    for p in procs:
        p.send_signal(signal.SIGTERM)
    texts = _wait_workers(procs, logs, timeout=60, expect=128 + signal.SIGTERM)
    for text in texts:
        assert "stopped answering" not in text and "Traceback" not in text, text[-3000:]
    # Each process is signalled, one after the other: one may stop on the other's signal first.
    said = r"^stopped at step (\d+)( \(another process was signalled\))?; checkpoint saved"
    stopped = [int(re.search(said, t, re.M)[1]) for t in texts]  # type: ignore[index]
    assert stopped[0] == stopped[1] > 4, stopped


@pytest.mark.slow
def test_a_process_stuck_alone_stops_every_process_each_with_its_stacks(tmp_path, worker_cache):
    """Process 1's reader never returns; process 0 waits in the next step's agreement. Nothing
    raises and jax's heartbeats go on. After --stall-timeout, each process writes its threads'
    stacks (process 1's show the hanging reader), says so in one line, and both exit 1 through jax's
    shutdown barrier. (Without the watch, both wait for ever: test_faults.py has that control.)"""
    run_dir, args = _scenario(tmp_path, SHARDS)
    # The watch is armed from the start: its timeout covers the first step's compile, here two
    # processes compiling at once on the suite's two cores, beside whatever else the machine runs.
    args = args[:-2] + ["--save-every", "5", "--stall-timeout", "10"]
    procs, logs = _start_workers(tmp_path, 0, args, worker_cache, process_1=["-c", read_never_returns()])
    texts = _wait_workers(procs, logs, timeout=120, expect_ok=False)
    assert [p.returncode for p in procs] == [1, 1], texts
    assert not any("Traceback" in text or "Terminating" in text for text in texts), texts
    intact = saved_steps(str(run_dir))
    lines = [[x for x in text.splitlines() if "error" in x] for text in texts]
    # Both stop in the same step: process 0 waits in its agreement for process 1's batch.
    stuck = re.search(r" while (running step (\d+)): ", "".join(lines[0]))
    assert stuck and int(stuck[2]) > intact[-1], lines
    for i, text in enumerate(texts):
        assert lines[i] == [
            f"elmo-jax train: error: {run_dir}: process {i} of 2: no progress for 10 s (--stall-timeout) while "
            f"{stuck[1]}: "
            "the run is stuck (a read that never returns, a deadlock, a device that no longer answers); every "
            f"thread's stack is in {run_dir / f'stalled.p{i}.txt'}; step(s) {', '.join(map(str, intact))} are "
            f"intact: restart every process with the same command to resume from step {intact[-1]}"
        ], text
    assert "in next_batch_or_hang" in (run_dir / "stalled.p1.txt").read_text()
    assert "in next_batch_or_hang" not in (run_dir / "stalled.p0.txt").read_text()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "failing"),
    [
        pytest.param("save", 1, id="before-its-barriers"),
        pytest.param("_get_write_step_directory", 0, id="between-them-on-the-primary"),
    ],
)
def test_a_save_that_orbax_fails_on_one_process_stops_both_in_one_line_each(tmp_path, worker_cache, method, failing):
    """Orbax's own code raises inside its save of step 4 on one process only, while the other waits
    at one of Orbax's barriers. The failing process says its error and enters no other collective;
    the other's peer watch stops it with that error. Both exit 1 with one line each, within
    seconds, and step 4 is not committed.

    Before (the negative control, with ``Checkpointer.alone`` never set): the failing process's
    next collective met the other's barrier, and gloo ended the other from C++ (exit -6, a
    mismatched collective), while the failing one waited out its peer watch."""
    run_dir, args = _scenario(tmp_path, SHARDS, stop=["--steps", "8"])
    args = args[:-2] + ["--save-every", "2", "--heartbeat-timeout", "5"]  # the peer watch's grace: 5 s
    t0 = time.monotonic()
    injected = ORBAX_SAVE_OF_STEP_4_RAISES.format(method=method, failing=failing)
    procs, logs = _start_workers(tmp_path, 0, args, worker_cache, both=["-c", injected])
    texts = _wait_workers(procs, logs, timeout=240, expect_ok=False)
    assert time.monotonic() - t0 < 90, texts
    assert [p.returncode for p in procs] == [1, 1], texts
    lines = [[l for l in t.splitlines() if "error:" in l] for t in texts]
    assert all(len(x) == 1 for x in lines), lines
    said = (
        f"{run_dir}: step 4 not saved: OSError: [Errno 5] Input/output error; step(s) 2 are intact; once the cause "
        "is fixed, rerun the same command to resume from step 2"
    )
    assert lines[failing] == [f"elmo-jax train: error: {said}"], lines
    assert lines[1 - failing] == [
        f"elmo-jax train: error: process {failing} of 2 stopped with an error: {said} (every process alike)"
    ], lines
    assert not any("Traceback" in t or "mismatch" in t for t in texts), texts
    assert Checkpointer(run_dir, read_only=True).steps() == [2]


@pytest.mark.slow
def test_every_worker_keeps_its_train_step_in_the_compile_cache(saved_2_and_4, worker_cache):
    """The suite's own harness (``helpers.multiprocess_env``): jax writes the persistent cache from
    process 0 only, and on this CPU process 1's train step has a key of its own, so without the
    harness's ``cache_every_process`` it compiled afresh in every scenario, the others waiting."""
    steps = sorted(p.name for p in pathlib.Path(worker_cache).glob("jit_per_device-*"))
    assert len(steps) >= 2, steps


@pytest.mark.slow
def test_a_host_file_damaged_on_one_process_makes_both_resume_from_the_same_step(tmp_path, worker_cache, saved_2_and_4):
    """Step 4's host file of process 1 is damaged, process 0's is sound: both processes fall back
    to step 2 together, step 4 is set aside once, and the run goes on to step 6. (Before they
    agreed, process 0 resumed from step 4 and process 1 from step 2, and both aborted in a
    mismatched collective.)"""
    run_dir, args = _resumed_to_6(tmp_path, saved_2_and_4)
    (run_dir / "host_state" / "4.p1.npz").write_bytes(b"garbage")
    texts = _wait_workers(*_start_workers(tmp_path, 0, args, worker_cache), timeout=240)
    assert f"resuming {run_dir} from step 2 " in texts[0], texts[0][-3000:]  # the lead process says it
    assert "checkpoint 4 is unreadable (another process could not read it)" in texts[0], texts[0][-3000:]
    assert "checkpoint 4 is unreadable (ValueError: " in texts[1], texts[1][-3000:]
    assert load_run(str(run_dir))[3] == 6
    assert sorted(p.name for p in (run_dir / "unreadable" / "4").iterdir()) == ["4.p0.npz", "4.p1.npz", "checkpoint"]


@pytest.mark.slow
def test_a_step_listed_late_on_one_host_is_waited_for_and_both_resume_from_it(tmp_path, worker_cache, saved_2_and_4):
    """Steps 2 and 4 are saved, but process 1 lists them only after 3 s (a host whose view of a
    shared file system lags): both processes agree on step 4, process 1 waits until it lists it,
    and both resume from it. (The negative control, each process reading its own newest: process
    1 found no checkpoint while process 0 read step 4, and Orbax's barriers failed on both with a
    traceback, "sync_global_devices name mismatch". With only step 4 hidden and only the restore
    unagreed, process 1 resumed from step 2, and both hung in mismatched collectives.)"""
    run_dir, args = _resumed_to_6(tmp_path, saved_2_and_4)
    late = STEPS_LISTED_LATE.format(hidden=3)
    texts = _wait_workers(*_start_workers(tmp_path, 0, args, worker_cache, process_1=["-c", late]), timeout=240)
    assert f"resuming {run_dir} from step 4 " in texts[0], texts[0][-3000:]
    assert "unreadable" not in texts[0] + texts[1], texts
    assert load_run(str(run_dir))[3] == 6


@pytest.mark.slow
@pytest.mark.parametrize(
    ("injected", "said"),
    [
        pytest.param(ORBAX_READ_OF_STEP_4_FAILS, "ValueError: injected: step 4's shards are damaged", id="its-read"),
        pytest.param(ORBAX_RESTORE_OF_STEP_4_RAISES, "OSError: [Errno 5] Input/output error", id="before-its-read"),
    ],
)
def test_an_orbax_read_failing_on_one_process_makes_both_fall_back_at_once(
    tmp_path, worker_cache, saved_2_and_4, injected, said
):
    """Step 4's Orbax restore fails on process 1 only, in its read or in Orbax's own code before
    it: both fall back to step 2 together, within seconds. (Before, the failing process skipped
    Orbax's restore barrier and went on alone: with the read, it died in a mismatched collective,
    sync_global_devices in ``set_aside``, with a traceback, while process 0 waited at the barrier
    until the test killed both after 240 s. The negative control of ``before-its-read``, without
    the barrier passed in ``_reach_the_barrier_on_failure``: process 1's agreement met process 0's
    barrier, which failed there with jax's "sync_global_devices name mismatch", taken for a
    damaged step 4; the fall-back was agreed only because the two collectives' shapes happened to
    fit.)"""
    run_dir, args = _resumed_to_6(tmp_path, saved_2_and_4)
    t0 = time.monotonic()
    procs, logs = _start_workers(tmp_path, 0, args, worker_cache, process_1=["-c", injected])
    texts = _wait_workers(procs, logs, timeout=240)
    assert time.monotonic() - t0 < 90, texts[0][-3000:]
    assert f"resuming {run_dir} from step 2 " in texts[0], texts[0][-3000:]
    assert "checkpoint 4 is unreadable (another process could not read it)" in texts[0], texts[0][-3000:]
    assert f"checkpoint 4 is unreadable ({said}" in texts[1], texts[1][-3000:]
    assert load_run(str(run_dir))[3] == 6


@pytest.mark.slow
@pytest.mark.parametrize(
    ("injected", "failing"),
    [
        pytest.param(HOST_FILE_OF_STEP_4_FAILS, 1, id="host-file"),
        pytest.param(ARRAY_WRITES_OF_STEP_4_FAIL, 1, id="array-writes-in-orbax-background"),
        pytest.param(BLOCKING_SAVE_OF_STEP_4_FAILS, 1, id="orbax-blocking-phase"),
        pytest.param(STEP_4_DIRECTORY_FAILS_ON_PROCESS_0, 0, id="step-directory-on-the-primary"),
    ],
)
def test_a_save_failing_on_one_process_stops_both_in_one_line_each(tmp_path, worker_cache, injected, failing):
    """Step 4's save fails on one process only: in its host file, in Orbax's background writes, in
    Orbax's blocking phase, or where the primary makes the step's directory. Both processes stop
    with one line each and exit 1, within seconds; step 4 is not committed, and the same command
    resumes from step 2.

    Before (the negative controls): with the host file, process 1 skipped Orbax's save alone, and
    both aborted in a mismatched collective, with gloo's and XLA's traces; with the blocking phase,
    both aborted too (exit -6). With the background writes or the directory, both were still
    running when the test killed them at 240 s: process 0 waited at Orbax's commit barrier, or
    process 1's writes waited for the directory. Without the release of those writes, the run
    ended only after their 300 s, in 311 s."""
    run_dir, args = _scenario(tmp_path, SHARDS, stop=["--steps", "6"])
    args = args[:-2] + ["--save-every", "2"]
    t0 = time.monotonic()
    how = {"process_1": ["-c", injected]} if failing == 1 else {"both": ["-c", injected]}
    procs, logs = _start_workers(tmp_path, 0, args, worker_cache, **how)
    texts = _wait_workers(procs, logs, timeout=240, expect_ok=False)
    assert time.monotonic() - t0 < 90, texts
    assert [p.returncode for p in procs] == [1, 1], texts
    lines = [[l for l in t.splitlines() if "error:" in l] for t in texts]
    assert all(len(x) == 1 for x in lines), lines
    intact = "step(s) 2 are intact; once the cause is fixed, rerun the same command to resume from step 2"
    assert f"step 4 not saved: OSError: [Errno 5] Input/output error; {intact}" in lines[failing][0], lines
    assert f"step 4 not saved: another process could not save it; {intact}" in lines[1 - failing][0], lines
    assert not any("Traceback" in t or "mismatch" in t for t in texts), texts
    assert not any("write after the failure" in t for t in texts), texts
    assert Checkpointer(run_dir, read_only=True).steps() == [2]
    assert not list((run_dir / "checkpoints").glob("4*")), "the failed step's partial files are removed"
    if injected is HOST_FILE_OF_STEP_4_FAILS:  # the rerun is the same whatever failed
        texts = _wait_workers(*_start_workers(tmp_path, 0, args, worker_cache), timeout=240)
        assert f"resuming {run_dir} from step 2 " in texts[0], texts[0][-3000:]
        assert load_run(str(run_dir))[3] == 6
