"""Pretraining end to end: bilm-tf's training check, resume, export/fine-tune, bad input."""

import contextlib
import dataclasses
import errno
import json
import logging
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings

import h5py
import jax
import numpy as np
import pytest
from helpers import AS_FROM_A_TERMINAL, FIXTURES, free_port, run_elmo_jax, xla_flags
from jax.sharding import Mesh
from test_config import BILM_TF_TRAIN_OPTIONS

from elmo_jax import cli
from elmo_jax._util.arguments import arguments_of
from elmo_jax._util.device_memory import DeviceFailed, OutOfDeviceMemory
from elmo_jax.cli.commands import bundled_sample
from elmo_jax.compat.hdf5 import load_hdf5
from elmo_jax.config import ConfigError, Options, preset
from elmo_jax.model.vocabulary import VocabError, Vocabulary
from elmo_jax.text.sources import TextFiles
from elmo_jax.text.vocab import build_vocab, count_tokens
from elmo_jax.training import loop
from elmo_jax.training.batches import LMBatcher, bucket_size
from elmo_jax.training.checkpoint import Checkpointer, CheckpointError
from elmo_jax.training.evaluate import evaluate
from elmo_jax.training.global_batches import GlobalBatches
from elmo_jax.training.loop import RunSettings, options_for_vocab, pretrain
from elmo_jax.training.run_dir import abstract_rows, abstract_shared, export_run, load_run, read_run
from elmo_jax.training.setup import saved_steps
from elmo_jax.training.sharded_softmax import MIN_CAPACITY
from elmo_jax.training.step import AXIS, init_state, make_train_step, state_shardings
from elmo_jax.training.warmstart import finetune_state

TRAIN = FIXTURES / "bilm_tf_train"


def bilm_tf_options(**train_changes) -> Options:
    d = json.loads(json.dumps(BILM_TF_TRAIN_OPTIONS))
    d.update(train_changes)
    return Options.from_dict(d)


@contextlib.contextmanager
def step_programs():
    """The train-step programs lowered inside the block. A new program is lowered once, whether
    it then comes from the persistent compile cache or is compiled; steps made before the block
    are dropped, so that a program another test made counts too."""
    make_train_step.cache_clear()
    names = []

    def listen(event, seconds, fun_name="", **_):
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration" and fun_name == "jit(per_device)":
            names.append(fun_name)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


@pytest.mark.slow
def test_bilm_tf_training_check_reaches_perplexity_below_20(tmp_path):
    """bilm-tf's test_training: 50 epochs on its 5-line fixture, then full-softmax perplexity < 20."""
    vocab = Vocabulary.load(TRAIN / "vocab.txt")
    options = options_for_vocab(bilm_tf_options(), vocab, None)
    settings = RunSettings(
        run_dir=str(tmp_path / "run"),
        seed=0,
        save_every=10**6,
        log_every=50,
        progress=False,
        devices=1,
        async_save=False,
    )
    with step_programs() as programs:
        pretrain(options, vocab, TextFiles(str(TRAIN / "data.txt")), settings)
    _, _, params, step = load_run(settings.run_dir)
    assert step == -(-50 * 134 // (2 * 10))
    assert len(programs) == 1  # all 335 steps: the fetch capacity kept its first size
    # bilm-tf's test() runs batch 1, one token at a time, state carried.
    result = evaluate(params, options.model, vocab, TextFiles(str(TRAIN / "data.txt")), batch_size=1, unroll_steps=1)
    assert result["perplexity"] < 20, result
    assert result["tokens"] == 134 + 5  # every (input, target) pair, once


def _write_tiny_options(path: pathlib.Path) -> pathlib.Path:
    """bilm-tf's keys (no reset_state_prob) for ``bilm_tf_options(batch_size=2, unroll_steps=5)``:
    the tests that train either share one compiled step per device count."""
    opts = json.loads(json.dumps(BILM_TF_TRAIN_OPTIONS))
    opts.update(batch_size=2, unroll_steps=5)
    path.write_text(json.dumps(opts))
    return path


def _tiny_train(tmp_path: pathlib.Path, *flags: str) -> list[str]:
    """``elmo-jax train``'s arguments for the tiny options (written to ``tmp_path``) on bilm-tf's
    training fixture, without a progress bar, then ``flags``."""
    options = _write_tiny_options(tmp_path / "options.json")
    data = ["--train-files", str(TRAIN / "data.txt"), "--vocab", str(TRAIN / "vocab.txt")]
    return ["train", "--config", str(options), *data, "--no-progress", *flags]


def _cli(*args, check=True):
    r = run_elmo_jax(*args, devices=2, PYTHONWARNINGS="default")
    if check and r.returncode != 0:
        raise AssertionError(f"exit {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r


def _host_state(run_dir, step):
    """The data position (this process's file) and the LSTM rows (in the Orbax checkpoint), flat."""
    with np.load(pathlib.Path(run_dir) / "host_state" / f"{step}.p0.npz") as f:
        out = {k: f[k] for k in f.files}
    model = Options.load(pathlib.Path(run_dir) / "options.json").model
    ckpt = Checkpointer(str(run_dir), async_save=False)
    _, rows, _, _ = ckpt.restore(
        step,
        lambda m: (
            abstract_shared(Options.load(pathlib.Path(run_dir) / "options.json"), m),
            abstract_rows(model, m["global_rows"]),
        ),
        with_host=False,
    )
    ckpt.close()
    return {**out, **{f"lstm/{k}": np.asarray(v) for k, v in rows.items()}}


@pytest.mark.slow
def test_resume_in_a_new_process_sees_exactly_the_same_run(tmp_path):
    options = _write_tiny_options(tmp_path / "options.json")
    common = [
        "train",
        "--config",
        str(options),
        "--train-files",
        str(TRAIN / "data.txt"),
        "--vocab",
        str(TRAIN / "vocab.txt"),
        "--log-every",
        "1",
        "--save-every",
        "3",
        "--no-progress",
    ]
    assert cli.main([*common, "--run-dir", str(tmp_path / "straight"), "--steps", "6"]) == 0
    assert cli.main([*common, "--run-dir", str(tmp_path / "resumed"), "--steps", "3"]) == 0
    _cli(*common, "--run-dir", str(tmp_path / "resumed"), "--steps", "6")  # the restart: a new process
    _, _, a, step_a = load_run(str(tmp_path / "straight"))
    _, _, b, step_b = load_run(str(tmp_path / "resumed"))
    assert step_a == step_b == 6
    # Bit for bit: the batches' out-of-vocabulary words (numbered by each process as met) are
    # encoded in spelling order, and the fetch capacity is resumed, so every float sum is the same.
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(x, y)
    ha, hb = _host_state(tmp_path / "straight", 6), _host_state(tmp_path / "resumed", 6)
    # (Buffered input ids of out-of-vocabulary words are process-local; their targets are not.)
    for k in (
        "lstm/c",
        "lstm/h",
        "data/dir0/position",
        "data/dir1/position",
        "data/dir0/buffer_targets",
        "data/dir1/buffer_lengths",
        "fetch/capacity",
    ):
        np.testing.assert_array_equal(ha[k], hb[k])
    ma = [json.loads(l) for l in (tmp_path / "straight/metrics.jsonl").read_text().splitlines()]
    mb = [json.loads(l) for l in (tmp_path / "resumed/metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in mb] == [1, 2, 3, 4, 5, 6]
    for x, y in zip(ma, mb):
        for k in ("loss_fwd", "loss_bwd", "grad_norm"):
            assert x[k] == y[k], (k, x, y)


@pytest.mark.slow
def test_a_run_on_two_devices_compiles_its_step_once(tmp_path):
    """The step's shapes (the distinct-word bucket, the fetch capacity) keep their first size for
    40 steps. (Before the fetch capacity had headroom it grew here, and the run compiled twice.)"""
    vocab = Vocabulary.load(TRAIN / "vocab.txt")
    options = options_for_vocab(bilm_tf_options(batch_size=2, unroll_steps=5), vocab, None)
    with step_programs() as programs:
        pretrain(
            options,
            vocab,
            TextFiles(str(TRAIN / "data.txt")),
            RunSettings(
                run_dir=str(tmp_path / "run"),
                steps=40,
                log_every=10,
                save_every=10**6,
                progress=False,
                devices=2,
                async_save=False,
            ),
        )
    assert len(programs) == 1


def test_a_second_run_in_a_process_compiles_nothing_even_with_another_seed(tmp_path):
    """A notebook's second run, with another seed, or a resume: its init is the same program (the
    key is its argument, not a constant), cached in the process as the step is, and so are the
    zero LSTM states of a resume and of the held-out evaluator; the init draws what the program
    with the key as a constant drew. (Before: the init, or the zero state, was traced, lowered
    and compiled again each run: the init was 1.2 s of a 1.5 s run here.)"""
    from helpers import compiled_programs

    vocab = Vocabulary.load(TRAIN / "vocab.txt")
    options = options_for_vocab(bilm_tf_options(batch_size=2, unroll_steps=5), vocab, None)

    def run(seed: int, steps: int = 2) -> None:
        settings = RunSettings(
            run_dir=str(tmp_path / str(seed)), steps=steps, seed=seed, log_every=2, eval_every=2, progress=False,
            devices=1, async_save=False,
        )  # fmt: skip
        pretrain(
            options, vocab, TextFiles(str(TRAIN / "data.txt")), settings, heldout=TextFiles(str(TRAIN / "data.txt"))
        )

    run(0)
    run(0, steps=4)  # a first resume: the checkpoint's check for damaged values compiles once
    with compiled_programs() as compiled:  # the persistent cache off: a program made again compiles
        run(1)  # a fresh run, another seed
        run(0, steps=6)  # a resume
    assert compiled == []
    from elmo_jax.training.step import init_state, make_init, state_shardings

    mesh = Mesh(np.array(jax.devices()[:1]), (AXIS,))
    key, t = jax.random.PRNGKey(5), options.training
    shardings = state_shardings(jax.eval_shape(lambda: init_state(key, options.model, t, 2)), mesh)
    constant = jax.jit(lambda: init_state(key, options.model, t, 2), out_shardings=shardings)()
    drawn = make_init(options.model, t, mesh, 2)(key)
    for x, y in zip(jax.tree_util.tree_leaves(constant), jax.tree_util.tree_leaves(drawn)):
        np.testing.assert_array_equal(x, y)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run") / "r"
    vocab = Vocabulary.load(TRAIN / "vocab.txt")
    options = options_for_vocab(bilm_tf_options(batch_size=2, unroll_steps=5), vocab, None)
    pretrain(
        options,
        vocab,
        TextFiles(str(TRAIN / "data.txt")),
        RunSettings(run_dir=str(run_dir), steps=4, save_every=2, progress=False, devices=1, async_save=False),
    )
    return run_dir, options, vocab


def assert_export_holds(export_dir, params: dict, model) -> None:
    """The exported weights.hdf5 and softmax.hdf5 hold exactly ``params`` (id order)."""
    config, bilm = load_hdf5(export_dir / "options.json", export_dir / "weights.hdf5")
    assert config == model
    for x, y in zip(jax.tree_util.tree_leaves(params["bilm"]), jax.tree_util.tree_leaves(bilm)):
        np.testing.assert_array_equal(np.asarray(x), y)
    with h5py.File(export_dir / "softmax.hdf5", "r") as f:
        np.testing.assert_array_equal(f["softmax/W"][...], params["softmax"]["w"])


def _poison_newest(run_dir) -> int:
    """Saves the newest checkpoint again with one NaN in its char embedding, as a disk that
    flipped bytes inside a chunk decodes it; returns its step."""
    options = Options.load(pathlib.Path(run_dir) / "options.json")
    ckpt = Checkpointer(str(run_dir), async_save=False)
    step = max(ckpt.steps())
    state, rows, host, meta = ckpt.restore(
        step, lambda m: (abstract_shared(options, m), abstract_rows(options.model, m["global_rows"]))
    )
    ckpt.close()
    embed = state["params"]["bilm"]["char_cnn"]["char_embed"]
    state["params"]["bilm"]["char_cnn"]["char_embed"] = embed.at[7, 3].set(np.nan)
    shutil.rmtree(pathlib.Path(run_dir) / "checkpoints" / str(step))
    ckpt = Checkpointer(str(run_dir), async_save=False)
    ckpt.save(step, state, rows, host, meta)
    ckpt.close()
    return step


def test_evaluate_refuses_counts_out_of_range_in_one_line_naming_them(trained_run):
    """block 0 ended in a ZeroDivisionError and -1 in max()'s ValueError, from inside the softmax's
    table; the control (block 1, the smallest taken) scores the same text."""
    run_dir, options, vocab = trained_run
    params = load_run(str(run_dir))[2]
    text, counts = ["the cat sat"], dict(batch_size=1, unroll_steps=2)
    for name, bad in (("block", 0), ("block", -1), ("block", 2.5), ("batch_size", 0), ("unroll_steps", -2)):
        with pytest.raises(ConfigError, match=rf"^{name} must be an integer >= 1; got {bad}$") as e:
            evaluate(params, options.model, vocab, text, **{**counts, name: bad})
        assert arguments_of(e.value) == (name,)
    assert evaluate(params, options.model, vocab, text, **counts, block=1)["tokens"] == 4


def test_a_checkpoint_holding_nan_is_unreadable_to_eval_export_and_the_resume(trained_run, tmp_path):
    """Not a NaN perplexity, a NaN in the exported weights, or a resume that diverges at once and
    blames the learning rate: the checkpoint is named unreadable, and the older one is used."""
    run_dir, options, vocab = trained_run
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    step = _poison_newest(copy)
    said = (
        f"{copy}: checkpoint {step} is unreadable (its state/params/bilm/char_cnn/char_embed holds NaN or inf values)"
    )
    with pytest.raises(CheckpointError) as e:
        load_run(str(copy), step)
    assert str(e.value) == said
    with pytest.warns(UserWarning, match=re.escape(said[:-1] + "); falling back to an older one")):
        _, _, params, read = load_run(str(copy))
    assert read == step - 2 and np.isfinite(params["bilm"]["char_cnn"]["char_embed"]).all()
    settings = RunSettings(run_dir=str(copy), steps=step + 1, progress=False, devices=1, async_save=False)
    with pytest.warns(UserWarning, match="holds NaN or inf values"):
        last = pretrain(options, vocab, TextFiles(str(TRAIN / "data.txt")), settings)
    assert last["step"] == step + 1 and np.isfinite(last["loss"])


@pytest.mark.parametrize("change", ["fewer words", "another order"])
def test_a_replaced_vocab_txt_is_refused_by_eval_and_export_not_by_the_embedder(trained_run, tmp_path, capsys, change):
    """The softmax's rows are the trained vocabulary's words in its order: scored or exported
    against another vocab.txt (``elmo-jax vocab --out RUN/vocab.txt`` by mistake), the numbers
    are wrong without a word (a perplexity of 10^5, an 11-line vocab.txt beside 17,478 rows).
    The biLM alone (embed, from_checkpoint) needs no vocabulary and still reads the run."""
    from elmo_jax import Embedder

    run_dir, options, vocab = trained_run
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    words = vocab.words[:3] + (vocab.words[3:10] if change == "fewer words" else sorted(vocab.words[3:]))
    assert words != vocab.words
    (copy / "vocab.txt").write_text("\n".join(words) + "\n", encoding="utf-8")
    said = (
        f"{copy / 'vocab.txt'}: not the vocabulary {copy} was trained with ({len(words)} words; its checkpoints "
        f"have {len(vocab)}, or other words or another order): put the run's own vocab.txt back (an export of the "
        "run holds a copy)"
    )
    for read in (lambda: load_run(str(copy)), lambda: export_run(str(copy), str(tmp_path / "export"))):
        with pytest.raises(CheckpointError) as e:
            read()
        assert str(e.value) == said
    assert not (tmp_path / "export").exists()
    assert cli.main(["eval", "--run-dir", str(copy), "--files", str(TRAIN / "data.txt")]) == 2
    assert capsys.readouterr().err == f"elmo-jax eval: error: {said}\n"
    assert Embedder.from_checkpoint(str(copy)).embed([["a", "b"]])[0].shape[1] == 2
    if change == "another order":  # a resume reading it is told the same (before: to fine-tune from the run)
        settings = RunSettings(run_dir=str(copy), steps=5, progress=False, devices=1, async_save=False)
        with pytest.raises(CheckpointError) as e:
            pretrain(options, Vocabulary.load(copy / "vocab.txt"), TextFiles(str(TRAIN / "data.txt")), settings)
        assert str(e.value) == said
    # Nor a vocab.txt at all (before: "vocab.txt: vocabulary file not found").
    (copy / "vocab.txt").unlink()
    assert Embedder.from_checkpoint(str(copy)).embed([["a", "b"]])[0].shape[1] == 2


@pytest.mark.slow
def test_a_resumed_run_keeps_its_seed_and_refuses_another(tmp_path):
    """The data order, the dropout and the candidates follow the seed: resumed with another, the
    rest of the epoch was dealt from another shuffle at the saved position, without a word.
    Left out, the run's own seed is used (before: 0), so the resume equals the unbroken run."""
    vocab = Vocabulary.load(TRAIN / "vocab.txt")
    options = options_for_vocab(bilm_tf_options(batch_size=2, unroll_steps=5), vocab, None)
    source = TextFiles(str(TRAIN / "data.txt"))

    def run(name, steps, seed, **kw):
        settings = RunSettings(
            run_dir=str(tmp_path / name), steps=steps, seed=seed, save_every=2, progress=False, devices=1,
            async_save=False, **kw,
        )  # fmt: skip
        return pretrain(options, vocab, source, settings)

    run("broken", 2, 3)
    with pytest.raises(CheckpointError) as e:
        run("broken", 4, 5)
    assert str(e.value) == (
        f"{tmp_path / 'broken'} was trained with seed 3, and a resumed run keeps it (another one deals the rest of "
        "the epoch from another shuffle): leave seed out, or give 3"
    )
    assert saved_steps(str(tmp_path / "broken")) == [2]
    run("broken", 4, None)
    run("unbroken", 4, 3)
    _, _, resumed, _ = load_run(str(tmp_path / "broken"))
    _, _, unbroken, _ = load_run(str(tmp_path / "unbroken"))
    for x, y in zip(jax.tree_util.tree_leaves(resumed), jax.tree_util.tree_leaves(unbroken)):
        np.testing.assert_array_equal(x, y)
    shutil.copytree(tmp_path / "broken", tmp_path / "replay")
    assert run("broken", 6, 7, new_data=True)["step"] == 6  # the data starts afresh: any seed
    # Step 6, the new_data session's, unreadable: the resume falls back to step 4, whose data
    # position is in seed 3's shuffle. It starts the data afresh, as the session did (before: it
    # went on from step 4's position and LSTM state, under seed 7).
    for f in (tmp_path / "broken" / "checkpoints" / "6").rglob("*"):
        if f.is_file() and "state" in str(f) and f.stat().st_size > 0:
            f.write_bytes(b"garbage")
    said = "step 4, older than the newest checkpoint, was saved with seed 3, not 7 (a new_data session began"
    with pytest.warns(UserWarning, match=re.escape(said)):
        assert run("broken", 8, None)["step"] == 8
    run("replay", 8, 7, new_data=True)
    _, _, fallen_back, _ = load_run(str(tmp_path / "broken"))
    _, _, replayed, _ = load_run(str(tmp_path / "replay"))
    for x, y in zip(jax.tree_util.tree_leaves(fallen_back), jax.tree_util.tree_leaves(replayed)):
        np.testing.assert_array_equal(x, y)


def test_a_step_before_a_new_data_session_is_told_apart_by_its_seed_or_files():
    files = [{"name": "a.txt", "size": 10, "sha256_ends": "x"}]
    other = [{"name": "b.txt", "size": 10, "sha256_ends": "x"}]
    newest = {"seed": 7, "train_files": files}
    assert loop.another_stream(dict(newest), newest) is None
    assert loop.another_stream({"seed": 3, "train_files": files}, newest) == "was saved with seed 3, not 7"
    assert loop.another_stream({"seed": 7, "train_files": other}, newest) == (
        "was saved with other training files (b.txt is gone; a.txt is new)"
    )
    # Saved before the seed and the files were recorded: nothing to tell it apart by.
    assert loop.another_stream({}, newest) is None


def test_export_then_import_round_trips_exactly(trained_run, tmp_path):
    run_dir, options, vocab = trained_run
    paths = export_run(str(run_dir), str(tmp_path / "export")).paths
    assert [os.path.basename(p) for p in paths] == ["options.json", "weights.hdf5", "softmax.hdf5", "vocab.txt"]
    _, _, params, _ = load_run(str(run_dir))
    assert_export_holds(tmp_path / "export", params, options.model)
    assert Options.load(tmp_path / "export/options.json").train == options.train
    # Importing the export for fine-tuning with the same vocab restores every weight. Its Adagrad
    # restarts at 1.0: bilm-tf's rate is said to be too high for it (elmo-jax train picks 0.05 itself).
    with pytest.warns(UserWarning, match=r"export: has no optimizer state .* learning_rate 0.2 makes the first"):
        state = finetune_state(str(tmp_path / "export"), options, vocab)
    lower = dataclasses.replace(options, train=dataclasses.replace(options.train, learning_rate=0.05))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        finetune_state(str(tmp_path / "export"), lower, vocab)
    np.testing.assert_array_equal(state["params"]["softmax"]["w"], params["softmax"]["w"])
    for x, y in zip(jax.tree_util.tree_leaves(state["params"]["bilm"]), jax.tree_util.tree_leaves(params["bilm"])):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
def test_finetune_with_a_new_vocab_keeps_shared_rows_and_accumulators(trained_run, tmp_path):
    run_dir, options, vocab = trained_run
    new_words = ["<S>", "</S>", "<UNK>", "brand-new", *[w for w in vocab.words[3:] if w != "the"][::-1], "another"]
    new_vocab = Vocabulary(new_words, source="new")
    new_options = options_for_vocab(options, new_vocab, None, strict=False)  # the new vocab sets V
    state = finetune_state(str(run_dir), new_options, new_vocab, seed=5)
    old = read_run(str(run_dir))[2]
    for i, w in enumerate(new_vocab.words):
        if w in vocab:
            j = vocab.word_to_id(w)
            np.testing.assert_array_equal(state["params"]["softmax"]["w"][i], old["params"]["softmax"]["w"][j])
            np.testing.assert_array_equal(state["opt"]["softmax"]["w"][i], old["opt"]["softmax"]["w"][j])
            assert state["opt"]["softmax"]["b"][i] == old["opt"]["softmax"]["b"][j]
        else:
            assert (state["opt"]["softmax"]["w"][i] == 1.0).all() and state["params"]["softmax"]["b"][i] == 0.0
    assert int(state["step"]) == 0
    # It trains from there.
    pretrain(
        new_options,
        new_vocab,
        TextFiles(str(TRAIN / "data.txt")),
        RunSettings(run_dir=str(tmp_path / "ft"), steps=2, progress=False, devices=1, async_save=False),
        init_state=state,
    )
    assert load_run(str(tmp_path / "ft"))[3] == 2


@pytest.mark.slow
def test_cli_init_from_starts_a_new_run_from_another_run(trained_run, tmp_path):
    run_dir, options, vocab = trained_run
    options.save(tmp_path / "options.json")
    assert (
        cli.main(
            [
                "train",
                "--config",
                str(tmp_path / "options.json"),
                "--train-files",
                str(TRAIN / "data.txt"),
                "--vocab",
                str(TRAIN / "vocab.txt"),
                "--run-dir",
                str(tmp_path / "ft"),
                "--steps",
                "1",
                "--devices",
                "1",
                "--seed",
                "1",
                "--no-progress",
                "--init-from",
                str(run_dir),
            ]
        )
        == 0
    )
    _, _, source, _ = load_run(str(run_dir))
    _, _, new, step = load_run(str(tmp_path / "ft"))
    assert step == 1
    lr = options.train.learning_rate
    # One Adagrad step (accumulators >= 1) moves each weight by less than the learning rate...
    for x, y in zip(jax.tree_util.tree_leaves(new), jax.tree_util.tree_leaves(source)):
        assert np.max(np.abs(np.asarray(x) - np.asarray(y))) < lr
    # ...while a fresh seed-1 init is far from the source: the run really started from it.
    init = init_state(jax.random.PRNGKey(1), options.model, options.train).params["bilm"]
    assert (
        max(
            float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
            for x, y in zip(jax.tree_util.tree_leaves(init), jax.tree_util.tree_leaves(source["bilm"]))
        )
        > 2 * lr
    )


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(trained_run, tmp_path, capsys, monkeypatch):
    run_dir, options, vocab = trained_run
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    # A crash mid-save leaves Orbax's temporary directory: never loaded.
    (copy / "checkpoints" / "6.orbax-checkpoint-tmp-1234").mkdir()
    # And the newest committed step is damaged on disk.
    for f in (copy / "checkpoints" / "4").rglob("*"):
        if f.is_file() and "state" in str(f) and f.stat().st_size > 0:
            f.write_bytes(b"garbage")
    with pytest.warns(UserWarning, match="checkpoint 4 is unreadable"):
        _, _, _, step = load_run(str(copy))
    assert step == 2
    # An export says which step it wrote: the one before the damaged one (before: only its files).
    with pytest.warns(UserWarning, match="checkpoint 4 is unreadable"):
        assert cli.main(["export", "--run-dir", str(copy), "--out-dir", str(tmp_path / "export")]) == 0
    said = capsys.readouterr().out.splitlines()[-1]
    assert said.startswith(f"wrote {tmp_path / 'export' / 'options.json'}, ") and said.endswith(f": step 2 of {copy}")
    assert export_run(str(copy), str(tmp_path / "export4"), step=2).step == 2
    # Past the damaged step: the run saves step 4 again (it once crashed there, on every rerun).
    # A run dir given relative is named as given, as the run's other lines name it (before: its
    # absolute path, in this warning alone).
    monkeypatch.chdir(tmp_path)
    with pytest.warns(UserWarning) as warned:
        last = pretrain(
            options,
            vocab,
            TextFiles(str(TRAIN / "data.txt")),
            RunSettings(run_dir="copy", steps=5, progress=False, devices=1, async_save=False),
        )
    said = [str(w.message) for w in warned if "unreadable" in str(w.message)]
    assert len(said) == 1 and re.fullmatch(
        r"copy: checkpoint 4 is unreadable \(.+\); moved to copy/unreadable/4; falling back to an older one", said[0]
    ), said
    assert last["step"] == 5
    assert load_run(str(copy))[3] == 5


@pytest.mark.parametrize("damaged", ["state/_METADATA", "meta/metadata", "state/array_metadatas/process_0"])
def test_a_damaged_json_file_of_a_checkpoint_is_named_by_it(trained_run, tmp_path, damaged):
    """Orbax reads these with json and passes its words on, naming no file; the innermost of
    them was json's scanner's ``StopIteration: 0`` (before: the whole reason given)."""
    run_dir, _, _ = trained_run
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    (copy / "checkpoints" / "4" / damaged).write_bytes(b"garbage")
    with pytest.warns(UserWarning, match=re.escape(f"checkpoint 4 is unreadable (its {damaged} is not valid JSON")):
        assert load_run(str(copy))[3] == 2


def test_a_checkpoint_missing_an_orbax_file_is_named_by_it(trained_run, tmp_path):
    """Without state/_METADATA Orbax cannot rebuild the tree and says 'Expected tuple, got [...]'
    with a repr of the whole restore target (300 characters of it in the line). The line names
    the missing file instead."""
    run_dir, _, _ = trained_run
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    (copy / "checkpoints" / "4" / "state" / "_METADATA").unlink()
    with pytest.raises(CheckpointError) as e:
        load_run(str(copy), 4)
    assert str(e.value) == f"{copy}: checkpoint 4 is unreadable (its state/_METADATA missing)"
    with pytest.warns(UserWarning, match=r"checkpoint 4 is unreadable \(its state/_METADATA missing\); falling back"):
        assert load_run(str(copy))[3] == 2


@pytest.mark.parametrize("damage", ["missing", "not JSON"])
def test_a_step_without_orbax_s_own_metadata_file_resumes_without_its_warning(trained_run, tmp_path, caplog, damage):
    """Orbax reads around a missing or damaged _CHECKPOINT_METADATA (its save times) and says so
    through absl, a stray 'WARNING:absl:Metadata file does not exist' on the console of a resume
    that is fine; or, damaged, 'ERROR:absl:Failed to json parse Metadata file' with the file's
    whole content, once each time a checkpoint manager opens (three times a resume)."""
    run_dir, options, vocab = trained_run
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    orbax_own = copy / "checkpoints" / "4" / "_CHECKPOINT_METADATA"
    if damage == "missing":
        orbax_own.unlink()
    else:
        orbax_own.write_bytes(b"{garbage\n\x00")
    caplog.set_level(logging.INFO)
    settings = RunSettings(run_dir=str(copy), steps=5, progress=False, devices=1, async_save=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no checkpoint is unreadable: step 4 resumes
        assert pretrain(options, vocab, TextFiles(str(TRAIN / "data.txt")), settings)["step"] == 5
    assert [r.getMessage() for r in caplog.records if r.name == "absl" and r.levelno >= logging.WARNING] == []


def test_a_run_with_no_readable_checkpoint_stops_and_the_rerun_starts_afresh(trained_run, tmp_path):
    """Before: it started from fresh weights there and then, unasked (and without the init_from
    source, which a run dir with checkpoints does not read), the warnings saying it fell back to
    an older checkpoint."""
    run_dir, options, vocab = trained_run
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    for f in (copy / "checkpoints").rglob("*"):
        if f.is_file() and "state" in str(f) and f.stat().st_size > 0:
            f.write_bytes(b"garbage")
    settings = RunSettings(run_dir=str(copy), steps=5, progress=False, devices=1, async_save=False)
    args = (options, vocab, TextFiles(str(TRAIN / "data.txt")), settings)
    with pytest.warns(UserWarning) as said, pytest.raises(CheckpointError, match="none of its checkpoints is readable"):
        pretrain(*args)
    unreadable = [str(w.message) for w in said if "is unreadable" in str(w.message)]
    assert [m.rsplit("; ", 1)[1] for m in unreadable] == ["falling back to an older one", "no older one is readable"]
    assert sorted(p.name for p in (copy / "unreadable").iterdir()) == ["2", "4"]
    assert pretrain(*args)["step"] == 5  # the rerun: afresh


def test_a_step_that_this_process_never_lists_stops_the_resume_in_one_line(trained_run, monkeypatch):
    """As process 1 of 2, when another process lists a newer step than any this one ever lists
    (its view of the run dir is not the others'): after ``VISIBLE_WAIT`` looks, one line. (The
    wait that ends well, with two processes, is test_distributed.py's.)"""
    from elmo_jax.training import checkpoint

    run_dir, _, _ = trained_run
    ckpt = Checkpointer(run_dir, read_only=True)
    theirs = ckpt.steps()[-1] + 2
    monkeypatch.setattr(checkpoint.jax, "process_count", lambda: 2)
    # The other process lists ``theirs``, and says so in every agreement.
    monkeypatch.setattr(checkpoint, "agree_max", lambda values: [max(values[0], theirs)])
    monkeypatch.setattr(checkpoint, "VISIBLE_WAIT", 2)
    reloads = []
    monkeypatch.setattr(ckpt.manager, "reload", lambda: reloads.append(1))
    with pytest.raises(CheckpointError) as said:
        ckpt.restore_latest(lambda meta: None)
    assert str(said.value) == (
        f"{ckpt.run_dir}: checkpoint {theirs} is listed on some hosts but not on all of them after 2 s: every "
        "process must see the run dir alike (a shared file system, mounted on every host without a long attribute "
        "cache); check the mounts, then restart every process"
    )
    assert len(reloads) == 2  # it looked again, once a second


def test_a_resumed_run_plans_its_batches_with_the_fetch_capacity_it_saved(trained_run):
    """From capacity 0 a resumed run could plan a smaller fetch than the unbroken run had grown to
    (another program, other float sums); a checkpoint keeps the capacity, for a mesh of the size its meta names."""
    run_dir, options, vocab = trained_run
    with np.load(run_dir / "host_state" / "4.p0.npz") as f:
        assert f["fetch/capacity"] == MIN_CAPACITY
    t = options.training
    batcher = LMBatcher(
        TextFiles(str(TRAIN / "data.txt")),
        vocab,
        rows_per_device=t.batch_size,
        unroll_steps=t.unroll_steps,
        max_chars=options.model.char_cnn.max_characters_per_token,
    )
    mesh = Mesh(np.array(jax.devices()[:1]), (AXIS,))
    shardings = state_shardings(jax.eval_shape(lambda: init_state(jax.random.PRNGKey(0), options.model, t)), mesh)
    ckpt = Checkpointer(str(run_dir), read_only=True)
    try:
        start, _, capacity, *_ = loop._restore_or_init(
            ckpt, ckpt.latest_meta(), options, RunSettings(run_dir=str(run_dir)), shardings, t.batch_size, batcher, None
        )
    finally:
        ckpt.close()
    assert (start, capacity) == (4, MIN_CAPACITY)
    # The batches start at the capacity given, which only grows (here one larger than any need).
    for given in (0, 2 * MIN_CAPACITY):
        batches = GlobalBatches(batcher, t, mesh, 0, 0, False, prefetch=0, capacity=given)
        assert batches.next(start + 1)["fetch"].shape[-1] == max(given, MIN_CAPACITY)
        batches.close()


@pytest.mark.parametrize(
    "error",
    [
        PermissionError(13, "Permission denied", "state/d/fe21"),
        ValueError("PERMISSION_DENIED: Error opening file: state/d/fe21 [os_error_code='13']"),  # tensorstore's
    ],
    ids=["os", "tensorstore"],
)
def test_a_checkpoint_denied_to_this_user_stops_the_run_and_moves_nothing(trained_run, tmp_path, monkeypatch, error):
    """Not readable is not damaged: falling back (and moving step 4 aside) would lose its steps."""
    run_dir, options, vocab = trained_run
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    real = Checkpointer.restore

    def fails_at_4(raised: Exception):
        def restore(self, step, *args, **kwargs):
            if step == 4:
                raise raised
            return real(self, step, *args, **kwargs)

        return restore

    monkeypatch.setattr(Checkpointer, "restore", fails_at_4(error))
    settings = RunSettings(run_dir=str(copy), steps=5, progress=False, devices=1, async_save=False)
    with pytest.raises(
        CheckpointError, match=r"checkpoint 4 cannot be read, access denied \((PermissionError|ValueError): "
    ) as e:
        pretrain(options, vocab, TextFiles(str(TRAIN / "data.txt")), settings)
    assert str(e.value).endswith(
        "nothing was moved: give this user access to the run dir (or run as its owner) and rerun"
    )
    assert Checkpointer(str(copy), read_only=True).steps() == [2, 4] and not (copy / "unreadable").exists()
    if isinstance(error, ValueError):
        return  # the negative control below, once
    # Negative control: damage (no permission error of the OS) falls back past step 4, as before.
    monkeypatch.setattr(Checkpointer, "restore", fails_at_4(ValueError("OUT_OF_RANGE: Error reading")))
    with pytest.warns(UserWarning, match="checkpoint 4 is unreadable"):
        assert pretrain(options, vocab, TextFiles(str(TRAIN / "data.txt")), settings)["step"] == 5
    assert (copy / "unreadable" / "4").is_dir()


@pytest.mark.parametrize(
    "xla, raised, said",
    [
        (
            "RESOURCE_EXHAUSTED: Out of memory while allocating",
            OutOfDeviceMemory,
            "restoring checkpoint 4 ran the devices out",
        ),
        (
            "INTERNAL: CUDA error: an illegal memory access",
            DeviceFailed,
            "the device failed while restoring checkpoint 4",
        ),
    ],
    ids=["out-of-memory", "device-failed"],
)
def test_a_restore_the_device_fails_stops_in_one_line_and_moves_nothing(
    trained_run, tmp_path, monkeypatch, xla, raised, said
):
    """Not the files' fault: falling back would move good checkpoints aside (and a fresh start on
    the same device would fail alike); a rerun on a device that works resumes from step 4."""
    run_dir, options, vocab = trained_run
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    xla_error = type("JaxRuntimeError", (RuntimeError,), {})  # what jax raises, by its name

    def restore(self, step, *args, **kwargs):
        raise xla_error(xla)

    monkeypatch.setattr(Checkpointer, "restore", restore)
    settings = RunSettings(run_dir=str(copy), steps=5, progress=False, devices=1, async_save=False)
    with pytest.raises(raised, match=f"^{re.escape(str(copy))}: {said} .*; nothing was moved"):
        pretrain(options, vocab, TextFiles(str(TRAIN / "data.txt")), settings)
    assert Checkpointer(str(copy), read_only=True).steps() == [2, 4] and not (copy / "unreadable").exists()


def test_a_run_dir_holding_another_config_is_refused(trained_run, tmp_path):
    run_dir, options, vocab = trained_run
    other = options_for_vocab(bilm_tf_options(batch_size=2, unroll_steps=5, dropout=0.2), vocab, None)
    with pytest.raises(CheckpointError, match=r"holds a run with different options \(dropout: saved 0.1, now 0.2\)"):
        pretrain(
            other,
            vocab,
            TextFiles(str(TRAIN / "data.txt")),
            RunSettings(run_dir=str(run_dir), steps=8, progress=False, devices=1),
        )
    bigger = Vocabulary(vocab.words + ["extra"], source="bigger")
    with pytest.raises(CheckpointError, match=r"different options \(n_tokens_vocab: saved 32, now 33\)"):
        pretrain(
            options_for_vocab(options, bigger, None, strict=False),
            bigger,
            TextFiles(str(TRAIN / "data.txt")),
            RunSettings(run_dir=str(run_dir), steps=8, progress=False, devices=1),
        )
    reordered = Vocabulary(vocab.words[:3] + vocab.words[3:][::-1], source="reordered")  # same size, other ids
    with pytest.raises(CheckpointError, match="different vocabulary"):
        pretrain(
            options,
            reordered,
            TextFiles(str(TRAIN / "data.txt")),
            RunSettings(run_dir=str(run_dir), steps=8, progress=False, devices=1),
        )


def test_a_resumed_run_without_a_config_counts_its_epochs_with_its_own_options(trained_run, tmp_path):
    """No config and a vocabulary without a token-count sidecar: the run's own options hold the
    count (before: refused for want of one, as if it were a new run of the tiny preset)."""
    from elmo_jax.training.setup import TrainSpec, train

    run_dir, options, _ = trained_run
    copy = tmp_path / "r"
    shutil.copytree(run_dir, copy)
    epochs = 4 * 10 / options.training.n_train_tokens  # 4 steps of 2 rows x 5 tokens: where the run is
    settings = RunSettings(run_dir=str(copy), epochs=epochs, progress=False, devices=1)
    out = train(TrainSpec(vocab=str(TRAIN / "vocab.txt")), TextFiles(str(TRAIN / "data.txt")), settings)
    assert out["step"] == 4


def test_a_vocabulary_counted_on_other_text_gives_no_epoch_of_this_one(tmp_path):
    """A vocabulary's sidecar counts the text it was built from: for other training text its count
    is no epoch (before: taken without a word, and a vocabulary of a 200-line slice made a 1-epoch
    run of the whole text stop after 1 % of it)."""
    from elmo_jax.text.vocab import write_vocab
    from elmo_jax.training.setup import TrainSpec, train

    opts = json.loads(_write_tiny_options(tmp_path / "with_count.json").read_text())
    del opts["n_train_tokens"]
    (tmp_path / "options.json").write_text(json.dumps(opts))
    whole = TRAIN / "data.txt"
    (tmp_path / "part.txt").write_text("".join(whole.read_text().splitlines(keepends=True)[:3]))
    words = Vocabulary.load(TRAIN / "vocab.txt").words
    counts = {}
    for name, counted in (("whole", str(whole)), ("part", str(tmp_path / "part.txt"))):
        _, n_tokens, n_sentences = count_tokens(TextFiles(counted))
        write_vocab(words, tmp_path / f"{name}-vocab.txt", n_tokens, n_sentences, TextFiles(counted))
        counts[name] = n_tokens + n_sentences

    def run(vocab: str, **stop):
        settings = RunSettings(run_dir=str(tmp_path / vocab), progress=False, devices=1, async_save=False, **stop)
        spec = TrainSpec(config=str(tmp_path / "options.json"), vocab=str(tmp_path / f"{vocab}-vocab.txt"))
        return train(spec, TextFiles(str(whole)), settings, say=lambda *_: None)

    with (
        pytest.warns(
            UserWarning, match=r"part-vocab.txt.json counts other text than the training files \(it counted 1"
        ),
        pytest.raises(ConfigError, match=r"part-vocab.txt.json counts other text than the training files and config"),
    ):
        run("part", epochs=1)
    # Negative control: the training text's own count is its epoch.
    assert counts["whole"] != counts["part"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        run("whole", steps=1)
    assert json.loads((tmp_path / "whole" / "options.json").read_text())["n_train_tokens"] == counts["whole"]


def test_a_run_started_without_a_token_count_saves_none_and_its_resume_counts_no_epochs(tmp_path):
    """Steps on text never counted (a vocabulary without its sidecar, a config without
    n_train_tokens): the run saves null, where it saved the recipe's 1B Word count, in which its
    resume then counted epochs (one epoch of 2 x 5 tokens a step: 76,864,889 steps)."""
    from elmo_jax.training.setup import TrainSpec, train

    opts = json.loads(_write_tiny_options(tmp_path / "with_count.json").read_text())
    del opts["n_train_tokens"]
    (tmp_path / "options.json").write_text(json.dumps(opts))
    run_dir, source = tmp_path / "run", TextFiles(str(TRAIN / "data.txt"))
    spec = TrainSpec(config=str(tmp_path / "options.json"), vocab=str(TRAIN / "vocab.txt"))  # no sidecar

    def settings(**stop):
        return RunSettings(run_dir=str(run_dir), progress=False, devices=1, async_save=False, **stop)

    assert train(spec, source, settings(steps=2), say=lambda *_: None)["step"] == 2
    assert json.loads((run_dir / "options.json").read_text())["n_train_tokens"] is None
    for resumed in (spec, TrainSpec(vocab=spec.vocab)):  # its config again, or its own options
        with pytest.raises(ConfigError) as e:
            train(resumed, source, settings(epochs=1), say=lambda *_: None)
        assert f"nor does the run in {run_dir}, so epochs cannot be counted" in str(e.value)
        assert arguments_of(e.value) == ("config", "n_train_tokens", "steps")
    assert saved_steps(str(run_dir)) == [2]
    assert train(TrainSpec(vocab=spec.vocab), source, settings(steps=4), say=lambda *_: None)["step"] == 4
    assert loop.saved_options(str(run_dir))["n_train_tokens"] is None  # the newest checkpoint's record
    # A library caller's options with no count: steps run, epochs are refused in one line.
    options = Options.load(run_dir / "options.json", saved=True)
    with pytest.raises(ConfigError, match="n_train_tokens is null"):
        pretrain(options, Vocabulary.load(TRAIN / "vocab.txt"), source, settings(epochs=1))
    # The run's options.json as a new run's config: its null is no count either (before: the new
    # run was refused by the loop, in words about a run started for a number of steps).
    other = RunSettings(run_dir=str(tmp_path / "other"), epochs=1, progress=False, devices=1)
    with pytest.raises(ConfigError, match="has no token-count sidecar"):
        train(TrainSpec(config=str(run_dir / "options.json"), vocab=spec.vocab), source, other, say=lambda *_: None)
    # A count given once is the run's: resumed with its config again (which has none), it counts
    # its epochs in it (before: refused, as if it had never been given). 60 tokens: 6 steps an epoch.
    assert train(dataclasses.replace(spec, n_train_tokens=60), source, settings(steps=5))["step"] == 5
    assert loop.saved_options(str(run_dir))["n_train_tokens"] == 60
    assert train(spec, source, settings(epochs=1), say=lambda *_: None)["step"] == 6


def test_non_utf8_lines_are_skipped_with_a_warning_and_long_lines_work(tmp_path):
    f = tmp_path / "data.txt"
    f.write_bytes(b"the cat sat\nbad \xff\xfe line\n" + (" ".join(["word"] * 10_000)).encode() + b"\n")
    with pytest.warns(UserWarning, match=r"data.txt: line 2: skipped, not UTF-8"):
        lines = TextFiles(str(f)).read(0)
    assert len(lines) == 2
    latin1 = tmp_path / "latin1.txt"  # every line not UTF-8: one warning for the file, not one a line
    latin1.write_bytes("café au lait\nthe cat\nnaïve\ncrème\n".encode("latin-1"))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert TextFiles(str(latin1)).read(0) == ["the cat"]
    assert [str(w.message) for w in said] == [
        f"{latin1}: line 1: skipped, not UTF-8 (invalid continuation byte at byte 3); and 2 more line(s) so"
    ]
    # The other line breaks (\r, U+2028, form feed, ...) split sentences whether or not a line
    # elsewhere in the file is skipped.
    text = "a b\rc d\u2028e\x0cf\r\ng\x85h\n\u2029i\n"
    (tmp_path / "breaks.txt").write_text(text, encoding="utf-8", newline="")
    (tmp_path / "breaks_bad.txt").write_bytes(text.encode() + b"bad \xff\n")
    clean = TextFiles(str(tmp_path / "breaks.txt")).read(0)
    assert clean == ["a b", "c d", "e", "f", "g", "h", "i"]
    with pytest.warns(UserWarning, match=r"breaks_bad.txt: line 4: skipped"):  # lines numbered by \n
        assert TextFiles(str(tmp_path / "breaks_bad.txt")).read(0) == clean
    vocab = Vocabulary(["<S>", "</S>", "<UNK>", "the", "word"])
    batcher = LMBatcher(
        TextFiles(str(f)), vocab, rows_per_device=1, unroll_steps=50, max_chars=10, max_epochs=1, shuffle=False
    )
    with pytest.warns(UserWarning):
        batches = list(batcher)
    assert len(batches) == (10_000 + 1 + 3 + 1) // 50
    assert batches[1]["targets"][0, 0, 0].tolist() == [4] * 50


def test_stream_windows_follow_bilm_tf(tmp_path):
    f = tmp_path / "data.txt"
    f.write_text("a b\nc\n")
    vocab = Vocabulary(["<S>", "</S>", "<UNK>", "a", "b"])
    batcher = LMBatcher(
        TextFiles(str(f)), vocab, rows_per_device=1, unroll_steps=5, max_chars=10, max_epochs=1, shuffle=False
    )
    batch = batcher.next()
    words = np.array(batcher.table.words)
    chars_words = batch["chars"][0]
    inputs = [
        words[np.flatnonzero((batcher.table.chars[:, :10] == c).all(1))[0]]
        for c in chars_words[batch["inputs"][0, 0, 0]]
    ]
    assert inputs == ["<S>", "a", "b", "<S>", "c"]
    assert batch["targets"][0, 0, 0].tolist() == [3, 4, 1, 2, 1]  # a b </S> <UNK>(c) </S>
    assert batch["targets"][0, 1, 0].tolist() == [4, 3, 0, 2, 0]  # reversed, markers swapped: b a <S> c <S>


def test_blank_shards_that_close_one_epoch_and_open_the_next_do_not_end_the_text(tmp_path):
    """Blank files beside one with text are allowed; under the shuffled order of each epoch the
    blank ones can both end an epoch and begin the next, which a search bounded by the file count
    took for text with no sentence. Over many epochs and seeds every window fills; text that is
    gone altogether (the negative control) still says so."""
    from elmo_jax.text.sources import NoSentences

    (tmp_path / "a.txt").write_text("a b\nb a\n")
    for name in ("b.txt", "c.txt", "d.txt"):
        (tmp_path / name).write_text("\n")
    source = TextFiles(str(tmp_path / "*.txt"))
    vocab = Vocabulary(["<S>", "</S>", "<UNK>", "a", "b"])
    for seed in range(6):
        batcher = LMBatcher(source, vocab, rows_per_device=1, unroll_steps=3, max_chars=10, seed=seed, max_epochs=40)
        n = sum(1 for _ in batcher)
        assert n == 40 * 6 // 3, (seed, n)  # each epoch: 2 sentences of 2 words and their markers
    batcher = LMBatcher(source, vocab, rows_per_device=1, unroll_steps=3, max_chars=10, seed=0)
    batcher.next()
    (tmp_path / "a.txt").write_text("\n")  # emptied during the run
    with pytest.raises(NoSentences, match=r"^no sentences in .*a\.txt"):
        for _ in range(10):
            batcher.next()


def test_distinct_word_buckets_are_few_and_waste_little_of_the_char_cnn():
    sizes = [bucket_size(n) for n in range(1, 8193)]
    assert all(s >= n for n, s in enumerate(sizes, 1))
    assert set(sizes) == {64, 128, 256, 512, 1024, *range(1280, 8193, 256)}
    # 128 rows x 20 of the bundled sample (real text): the char CNN's padding rows, with these
    # buckets and with multiples of 1024 (the negative control: a quarter of its rows).
    source = TextFiles(bundled_sample()[0])
    vocab = Vocabulary(build_vocab(count_tokens(source)[0]))
    batcher = LMBatcher(source, vocab, rows_per_device=128, unroll_steps=20, max_chars=50, seed=0)
    counts = np.array([len(np.unique(batcher.next()["inputs"])) for _ in range(8)])
    assert (counts > 1024).all(), counts  # the case the multiples of 256 are for

    def waste(bucket):
        return 1 - counts.sum() / sum(bucket(int(n)) for n in counts)

    assert waste(bucket_size) < 0.15 < 0.2 < waste(lambda n: -(-n // 1024) * 1024), counts


def test_tfds_source_through_data_source_with_mock_data(tmp_path):
    import tensorflow_datasets as tfds

    from elmo_jax.text.sources import DataError, TfdsSource, open_source
    from elmo_jax.text.vocab import build_vocab, count_tokens

    with tfds.testing.mock_data(num_examples=24):
        assert isinstance(open_source("tfds:lm1b/train"), TfdsSource)
        source = TfdsSource("lm1b", "train", n_shards=3)
        lines = [line for i in range(len(source)) for line in source.read(i)]
        assert len(source) == 3 and len(lines) == 24 and all(isinstance(l, str) for l in lines)
        assert source.name(1) == "tfds:lm1b/train[8:16]"
        counts, n_tokens, n_sentences = count_tokens(source)
        vocab = Vocabulary(build_vocab(counts))
        batcher = LMBatcher(source, vocab, rows_per_device=2, unroll_steps=4, max_chars=10, n_devices=2, seed=1)
        batch = batcher.next()
    assert batch["inputs"].shape == (2, 2, 2, 4) and batch["targets"].shape == (2, 2, 2, 4)
    assert batch["rows"].tolist() == [[0, 1], [2, 3]]
    assert n_sentences == 24 and n_tokens == sum(len(l.split()) for l in lines)

    class Failing:  # its prepared files failing since the run started
        def __getitem__(self, i):
            raise OSError(errno.EIO, "Input/output error")

    source.source = Failing()
    with pytest.raises(DataError, match=r"^tfds:lm1b/train\[8:16\]: cannot be read \(OSError: Input/output error\)"):
        source.read(1)


def test_a_tfds_dataset_not_prepared_is_one_line_and_never_downloaded(tmp_path, monkeypatch, caplog):
    """tfds's ``data_source`` downloads and prepares a dataset it cannot find, unless told not to:
    lm1b would be gigabytes fetched at run time. Here nothing is fetched, and the line says where
    the dataset was looked for; absl's warnings about the missing files stay out of the output."""
    import tensorflow_datasets as tfds

    from elmo_jax.text.sources import DataError, TfdsSource

    asked = []
    monkeypatch.setattr(tfds.core.DatasetBuilder, "download_and_prepare", lambda *a, **k: asked.append(a))
    caplog.set_level(logging.INFO)
    with pytest.raises(DataError) as e:
        TfdsSource("lm1b", "test", data_dir=str(tmp_path))
    assert asked == []
    assert str(e.value) == (
        f"tfds dataset 'lm1b' is not prepared in {tmp_path}/lm1b/1.1.0; prepare it once with "
        "file_format='array_record' (see docs/pretraining.md, \"lm1b with tfds\")"
    )
    with pytest.raises(DataError, match=r"^tfds has no dataset named 'no_such_set' \(tfds:NAME/SPLIT"):
        TfdsSource("no_such_set", "test", data_dir=str(tmp_path))
    assert [r.getMessage() for r in caplog.records if r.name == "absl"] == []


def test_eval_reads_a_tfds_split_like_the_same_text_in_a_file(tmp_path, capsys, fixtures_dir):
    import json

    import tensorflow_datasets as tfds

    from elmo_jax import cli
    from elmo_jax.text.sources import TfdsSource

    run = str(fixtures_dir / "format1_run")
    common = ["--run-dir", run, "--batch-size", "2", "--unroll-steps", "5"]
    results = []
    with tfds.testing.mock_data(num_examples=12):
        source = TfdsSource("lm1b", "test")
        (tmp_path / "test.txt").write_text("".join(line + "\n" for i in range(len(source)) for line in source.read(i)))
        for files in ("tfds:lm1b/test", str(tmp_path / "test.txt")):
            assert cli.main(["eval", "--files", files, *common]) == 0
            results.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert results[0]["tokens"] > 0
    assert results[0] == results[1]


@pytest.mark.slow
@pytest.mark.parametrize("sent", ["SIGTERM", "SIGHUP", "SIGHUP under nohup"])
def test_sigterm_or_a_hangup_saves_a_checkpoint_and_stops(tmp_path, sent):
    """SIGTERM (a scheduler, a preemption notice) and SIGHUP (the terminal closed: an ssh session
    dropped) save the step reached and stop, exit 128 + the signal's number, as the signal's own
    exit: a scheduler or a retry loop must not take the stop for the run's end. (Before, SIGHUP
    ended the process at once, losing the steps since the last checkpoint; later, a stop exited 0.)
    Under nohup, which ignores SIGHUP, a hangup is ignored as asked, and the run goes on until
    SIGTERM."""
    import signal
    import time

    nohup = sent == "SIGHUP under nohup"
    options = _write_tiny_options(tmp_path / "options.json")
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [
            # nohup ignores SIGHUP; otherwise SIGHUP is as a terminal leaves it, whatever the runner's.
            *(["nohup", sys.executable, "-m", "elmo_jax"] if nohup else [sys.executable, "-c", AS_FROM_A_TERMINAL]),
            "train",
            "--config",
            str(options),
            "--train-files",
            str(TRAIN / "data.txt"),
            "--vocab",
            str(TRAIN / "vocab.txt"),
            "--run-dir",
            str(run_dir),
            "--steps",
            "100000",
            "--save-every",
            "100000",
            "--log-every",
            "1",
            "--no-progress",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 300
        metrics = run_dir / "metrics.jsonl"
        while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.5)
        if nohup:
            proc.send_signal(signal.SIGHUP)
            time.sleep(2)
            assert proc.poll() is None, proc.communicate()
            logged = len(metrics.read_text().splitlines())
            time.sleep(1)
            assert len(metrics.read_text().splitlines()) > logged  # still training
        proc.send_signal(signal.SIGTERM if nohup else getattr(signal, sent))
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + (signal.SIGTERM if nohup else getattr(signal, sent)), err
    stopped = [l for l in out.splitlines() if l.startswith("stopped at step")]
    assert len(stopped) == 1, out
    step = int(stopped[0].split()[3].rstrip(";"))
    assert stopped[0] == f"stopped at step {step}; checkpoint saved in {run_dir}; the same command resumes from it"
    assert load_run(str(run_dir))[3] == step >= 2


@pytest.mark.parametrize("new_data", [False, True])
def test_a_signal_stop_says_how_the_run_goes_on(capsys, new_data):
    """Rerun with --new-data, a run would deal its new text from the start again: the line says to
    resume without it. (The stop itself, under real signals: the test above.)"""
    from types import SimpleNamespace

    run = SimpleNamespace(settings=SimpleNamespace(run_dir="RUN", new_data=new_data))
    loop._finish(run, 7, None, "signal", None, lambda step, state: True)
    without = "without --new-data " if new_data else ""
    assert (
        capsys.readouterr().out
        == f"stopped at step 7; checkpoint saved in RUN; the same command {without}resumes from it\n"
    )


def test_a_signal_stop_raises_stopped_in_python_and_the_same_call_resumes(tmp_path, capsys):
    """Ctrl-C (a notebook's interrupt) saves the step reached, then raises ``Stopped``, a
    KeyboardInterrupt holding the step and its metrics: a return means the run reached its end.
    (Before: the stop returned its metrics, as the run's end does.)"""
    import signal

    from elmo_jax.training.hooks import Stopped

    vocab = Vocabulary.load(TRAIN / "vocab.txt")
    options = options_for_vocab(bilm_tf_options(batch_size=2, unroll_steps=5), vocab, None)
    settings = RunSettings(
        run_dir=str(tmp_path / "run"), steps=6, log_every=1, save_every=100, progress=False, devices=1, async_save=False
    )

    def interrupt_at_3(record: dict) -> None:
        if record["step"] == 3:
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(Stopped) as e:
        pretrain(options, vocab, TextFiles(str(TRAIN / "data.txt")), settings, on_metrics=interrupt_at_3)
    assert isinstance(e.value, KeyboardInterrupt) and not isinstance(e.value, Exception)
    assert (e.value.step, e.value.signum, e.value.here) == (3, signal.SIGINT, True)
    assert e.value.metrics["step"] == 3 and math.isfinite(e.value.metrics["loss"])
    assert (
        str(e.value) == f"stopped at step 3; checkpoint saved in {settings.run_dir}; the same command resumes from it"
    )
    assert str(e.value) in capsys.readouterr().out
    assert load_run(settings.run_dir)[3] == 3
    assert pretrain(options, vocab, TextFiles(str(TRAIN / "data.txt")), settings)["step"] == 6


@pytest.mark.slow  # 6 s here: three sessions
def test_a_run_stopped_between_logged_steps_logs_the_same_records_as_the_unbroken_run(tmp_path):
    """A signal stops the run at step 3 of a 2-step log: the checkpoint keeps the window of step 3,
    so the resumed run's record of step 4 averages steps 3 and 4, as the unbroken run's does
    (before: step 4 alone, a record unlike the unbroken run's and not marked as such)."""
    import signal

    from elmo_jax.training.hooks import Stopped

    vocab = Vocabulary.load(TRAIN / "vocab.txt")
    options = options_for_vocab(bilm_tf_options(batch_size=2, unroll_steps=5), vocab, None)

    def settings(name: str) -> RunSettings:
        return RunSettings(
            run_dir=str(tmp_path / name), steps=6, log_every=2, save_every=100, progress=False, devices=1,
            async_save=False,
        )  # fmt: skip

    def stop_after_3(doing: str) -> None:
        if doing == "running step 4":
            os.kill(os.getpid(), signal.SIGINT)

    def records(name: str) -> list[dict]:
        return [json.loads(l) for l in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    pretrain(options, vocab, TextFiles(str(TRAIN / "data.txt")), settings("straight"))
    with pytest.raises(Stopped) as e:
        pretrain(options, vocab, TextFiles(str(TRAIN / "data.txt")), settings("stopped"), on_progress=stop_after_3)
    assert e.value.step == 3 and saved_steps(str(tmp_path / "stopped")) == [3]
    pretrain(options, vocab, TextFiles(str(TRAIN / "data.txt")), settings("stopped"))
    straight, resumed = records("straight"), records("stopped")
    assert [r["step"] for r in straight] == [r["step"] for r in resumed] == [2, 4, 6]
    for a, b in zip(straight, resumed):
        for k in ("loss_fwd", "loss_bwd", "grad_norm"):
            assert a[k] == b[k], (k, a, b)


@pytest.mark.slow
def test_cli_says_whether_it_resumes_and_what_to_do_next(tmp_path, capsys):
    options = _write_tiny_options(tmp_path / "options.json")
    run = tmp_path / "run"
    common = [
        "train",
        "--config",
        str(options),
        "--train-files",
        str(TRAIN / "data.txt"),
        "--vocab",
        str(TRAIN / "vocab.txt"),
        "--run-dir",
        str(run),
        "--devices",
        "1",
        "--log-every",
        "1",
        "--no-progress",
    ]
    outputs = []
    for steps in ("2", "3", "3"):
        assert cli.main([*common, "--steps", steps]) == 0
        outputs.append(capsys.readouterr())
        if steps == "2":  # files that eval, embed and export read, broken between sessions
            (run / "options.json").write_text('{"lstm": ')
            (run / "vocab.txt").write_text("<S>\n</S>\n<UNK>\nother\n")
    # The resumed session wrote both again, each with one warning; the run reads back.
    warned = [l for l in outputs[1].err.splitlines() if l.startswith("warning:")]
    assert warned == [
        f"warning: {run / 'options.json'}: not valid JSON (line 1, column 10: Expecting value); wrote it again "
        "from the newest checkpoint's options",
        f"warning: {run / 'vocab.txt'}: holds another vocabulary than the run's; wrote it again from "
        f"{TRAIN / 'vocab.txt'}",
    ]
    assert load_run(str(run))[3] == 3 and (run / "vocab.txt").read_text() == (TRAIN / "vocab.txt").read_text()
    said = [[l for l in out.out.splitlines() if l.startswith(("starting", "resuming", str(run)))] for out in outputs]
    assert said == [
        [
            f"starting {run} from scratch to step 2 (float32 matmuls [CPU: bfloat16 matmuls are slower here], reset_state_prob 0.1)"
        ],
        [
            f"resuming {run} from step 2 (epoch 0, shard 1 of 1) to step 3 (float32 matmuls [CPU: bfloat16 matmuls are slower here], reset_state_prob 0.1)"
        ],
        [f"{run}: already trained to step 3 (asked for 3); nothing to do"],
    ]
    # Each session's first metrics line times its start-up (compile) apart from the steps.
    metrics = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    # A session with nothing to do prints the last metrics of the step it is at, as the others do.
    printed = [json.loads(l) for out in outputs for l in out.out.splitlines() if l.startswith("{")]
    assert printed[1]["loss"] == printed[2]["loss"] == round(metrics[-1]["loss"], 4) and printed[2]["step"] == 3
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert [("startup_s" in m) for m in metrics] == [True, False, True]
    assert all(m["startup_s"] > 0 and m["tokens_per_s"] > 0 for m in metrics if "startup_s" in m)
    # Then the commands that use the run, on stderr, each one the parser accepts as it stands.
    parser = cli.build_parser()
    for out in outputs:
        commands = [l.split("#")[0].split() for l in out.err.splitlines() if l.strip().startswith("elmo-jax ")]
        assert [c[1] for c in commands] == ["embed", "eval", "export"], out.err
        for c in commands:
            args = parser.parse_args(c[1:])
            assert args.run_dir == str(run)
        assert commands[1][commands[1].index("--files") + 1] == "heldout.txt"  # no --heldout-files: a placeholder


@pytest.mark.slow
def test_draws_per_tower_are_written_said_and_resume_exactly(tmp_path, capsys):
    """``--rows-per-draw``: the start line says how many draws, options.json keeps the key, and a
    run stopped and resumed ends where the unbroken run ends (the draws follow the step)."""
    common = _tiny_train(tmp_path, "--devices", "1", "--save-every", "1")
    towers = [*common, "--rows-per-draw", "1"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert cli.main([*towers, "--run-dir", str(whole), "--steps", "3"]) == 0
    assert "reset_state_prob 0.1, a candidate draw per 1 row (2 a device))" in capsys.readouterr().out
    assert json.loads((whole / "options.json").read_text())["rows_per_draw"] == 1
    for steps in ("1", "3"):
        assert cli.main([*towers, "--run-dir", str(parts), "--steps", steps]) == 0
    _, _, a, _ = read_run(str(whole))
    _, _, b, _ = read_run(str(parts))
    jax.tree_util.tree_map(np.testing.assert_array_equal, a, b)
    # Negative control: one draw for both rows (the key left out) trains other weights.
    other = tmp_path / "other"
    assert cli.main([*common, "--run-dir", str(other), "--steps", "3"]) == 0
    assert "rows_per_draw" not in json.loads((other / "options.json").read_text())
    _, _, c, _ = read_run(str(other))
    leaves = zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(c))
    assert max(np.abs(x - y).max() for x, y in leaves) > 1e-4


@pytest.mark.slow
def test_train_parses_the_next_shard_ahead_in_a_process(tmp_path, monkeypatch, capsys):
    """``elmo-jax train`` runs with ``parse_ahead``: here for shards of any size (the fixture is
    134 words), each direction's next pass over the file is parsed in the loader process, and the
    run ends where the same run parsing in-line ends."""
    from elmo_jax.training import batches

    monkeypatch.setattr(loop, "AHEAD_WORDS", 0)
    parsed = []
    take = batches.ShardLoader.take
    monkeypatch.setattr(
        batches.ShardLoader, "take", lambda self, future: parsed.append(take(self, future)) or parsed[-1]
    )
    args = _tiny_train(tmp_path, "--devices", "1", "--steps", "30")
    assert cli.main([*args, "--run-dir", str(tmp_path / "ahead")]) == 0
    assert len(parsed) >= 4 and all(p is not None for p in parsed)  # not the in-line fallback
    # The same run, every shard parsed in-line (the library's default): the same weights.
    vocab = Vocabulary.load(TRAIN / "vocab.txt")
    opts = options_for_vocab(Options.load(tmp_path / "options.json"), vocab, None)
    settings = RunSettings(run_dir=str(tmp_path / "inline"), steps=30, progress=False, devices=1, async_save=False)
    count = len(parsed)
    pretrain(opts, vocab, TextFiles(str(TRAIN / "data.txt")), settings)
    assert len(parsed) == count
    a, b = load_run(str(tmp_path / "ahead"))[2], load_run(str(tmp_path / "inline"))[2]
    jax.tree_util.tree_map(np.testing.assert_array_equal, a, b)


def _as_written_before_the_reset_default(run_dir: pathlib.Path) -> None:
    """A run dir as the release before 0.1 became the default wrote it at bilm-tf's recipe: neither
    its options.json nor its checkpoints' metadata had the reset_state_prob key."""
    files = [run_dir / "options.json", *run_dir.glob("checkpoints/*/meta/metadata")]
    assert len(files) >= 2
    for f in files:
        d = json.loads(f.read_text())
        options = d.get("options", d)
        assert options.pop("reset_state_prob") == 0.0
        f.write_text(json.dumps(d))


@pytest.mark.slow
def test_a_fresh_run_resets_by_default_and_a_resumed_run_keeps_its_recipe(tmp_path, capsys):
    options = _write_tiny_options(tmp_path / "options.json")  # bilm-tf's keys: no reset_state_prob
    new, old = tmp_path / "new", tmp_path / "old"
    common = [
        "train",
        "--config",
        str(options),
        "--train-files",
        str(TRAIN / "data.txt"),
        "--vocab",
        str(TRAIN / "vocab.txt"),
        "--devices",
        "1",
        "--log-every",
        "1",
        "--save-every",
        "1",
        "--no-progress",
    ]

    def saved_prob(run_dir, step):
        return json.loads((run_dir / "checkpoints" / str(step) / "meta" / "metadata").read_text())["options"].get(
            "reset_state_prob"
        )

    assert cli.main([*common, "--run-dir", str(new), "--steps", "1"]) == 0
    assert (
        f"starting {new} from scratch to step 1 (float32 matmuls [CPU: bfloat16 matmuls are slower here], reset_state_prob 0.1)"
        in capsys.readouterr().out
    )
    assert json.loads((new / "options.json").read_text())["reset_state_prob"] == 0.1
    assert read_run(str(new))[0].train.reset_state_prob == 0.1
    # bilm-tf's recipe exactly, on request; the written options say so too.
    assert cli.main([*common, "--run-dir", str(old), "--steps", "1", "--reset-state-prob", "0"]) == 0
    assert (
        "(float32 matmuls [CPU: bfloat16 matmuls are slower here], reset_state_prob 0, bilm-tf's recipe)"
        in capsys.readouterr().out
    )
    assert json.loads((old / "options.json").read_text())["reset_state_prob"] == 0.0

    # A run dir from before the default resumes on its own recipe, says so, and keeps it.
    _as_written_before_the_reset_default(old)
    assert read_run(str(old))[0].train.reset_state_prob == 0.0  # what export would write
    assert cli.main([*common, "--run-dir", str(old), "--steps", "2"]) == 0
    assert (
        f"resuming {old} from step 1 (epoch 0, shard 1 of 1) to step 2 (float32 matmuls [CPU: bfloat16 matmuls are slower here], reset_state_prob 0, "
        f"bilm-tf's recipe: this run dir predates the 0.1 default, and a run keeps its recipe)"
        in capsys.readouterr().out
    )
    assert saved_prob(old, 2) == 0.0
    # A run started at the default resumes at it without the flag.
    assert cli.main([*common, "--run-dir", str(new), "--steps", "2"]) == 0
    assert (
        "to step 2 (float32 matmuls [CPU: bfloat16 matmuls are slower here], reset_state_prob 0.1)"
        in capsys.readouterr().out
    )
    assert saved_prob(new, 2) == 0.1
    # Changing the recipe midway is refused in one line, either way.
    for run_dir, prob, saved in ((old, "0.1", "0.0"), (new, "0", "0.1")):
        assert cli.main([*common, "--run-dir", str(run_dir), "--steps", "3", "--reset-state-prob", prob]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and f"reset_state_prob: saved {saved}, now {float(prob)}" in err, err
        assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == [1, 2]


def test_throughput_leaves_out_the_start_up(tmp_path, monkeypatch):
    """A first step slowed as a compile would be is timed as startup_s, not as step time."""
    slow = 1.5  # seconds: hundreds of times the tiny step
    real = make_train_step

    def slow_first_call(*args, **kwargs):
        step_fn, calls = real(*args, **kwargs), []

        def step(state, batch):
            if not calls:
                time.sleep(slow)
            calls.append(1)
            return step_fn(state, batch)

        return step

    monkeypatch.setattr(loop, "make_train_step", slow_first_call)  # the name the loop calls
    vocab = Vocabulary.load(TRAIN / "vocab.txt")
    options = options_for_vocab(bilm_tf_options(batch_size=2, unroll_steps=5), vocab, None)
    run = tmp_path / "run"
    pretrain(
        options,
        vocab,
        TextFiles(str(TRAIN / "data.txt")),
        RunSettings(
            run_dir=str(run), steps=4, log_every=2, save_every=10**6, progress=False, devices=1, async_save=False
        ),
    )
    first, second = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    # Counting the start-up, the first window's 2 steps would take over `slow` seconds, so each
    # step over slow / 2; measured over step time only (step 2), much less.
    tokens_per_step = 2 * 5
    assert tokens_per_step / first["tokens_per_s"] < slow / 2, first
    assert first["startup_s"] >= slow and "startup_s" not in second


@pytest.mark.slow
def test_fewer_shards_than_processes_stop_every_process_with_the_same_line(tmp_path):
    options = _write_tiny_options(tmp_path / "options.json")
    port = free_port()
    env = dict(os.environ, XLA_FLAGS=xla_flags(1), JAX_PLATFORMS="cpu")
    env.pop("JAX_COORDINATOR_ADDRESS", None)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "elmo_jax",
                "train",
                "--config",
                str(options),
                "--train-files",
                str(TRAIN / "data.txt"),
                "--vocab",
                str(TRAIN / "vocab.txt"),
                "--run-dir",
                str(tmp_path / "run"),
                "--steps",
                "1",
                "--no-progress",
                "--coordinator",
                f"127.0.0.1:{port}",
                "--num-processes",
                "2",
                "--process-id",
                str(i),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    try:
        errs = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, err in zip(procs, errs):
        assert p.returncode == 2, err
        assert "Traceback" not in err and "Check failure" not in err, err
    lines = [[l for l in err.splitlines() if "error" in l.lower()] for err in errs]
    assert (
        lines[0]
        == lines[1]
        == [
            "elmo-jax train: error: 1 shard(s) for 2 processes: each process needs at least "
            "one; use at least as many shards as processes"
        ]
    ), errs


def test_start_up_checks_fail_before_step_1_with_one_line(tmp_path, capsys):
    options = _write_tiny_options(tmp_path / "options.json")
    tiny_heldout = tmp_path / "heldout.txt"
    tiny_heldout.write_text("the cat\n")
    bare_vocab = tmp_path / "vocab.txt"  # no vocab.txt.json sidecar beside it
    bare_vocab.write_text((TRAIN / "vocab.txt").read_text())
    common = ["train", "--train-files", str(TRAIN / "data.txt"), "--no-progress", "--devices", "1"]
    cases = [
        (
            [
                "--config",
                str(options),
                "--steps",
                "2",
                "--heldout-files",
                str(tiny_heldout),
                "--eval-every",
                "1",
                "--log-every",
                "1",
            ],
            "heldout.txt: 1 sentence, 2 tokens) is smaller than one evaluation window (2 rows x 5 tokens)",
        ),
        (
            [
                "--config",
                str(options),
                "--steps",
                "2",
                "--heldout-files",
                str(TRAIN / "data.txt"),
                "--eval-every",
                "3",
                "--log-every",
                "2",
            ],
            "--eval-every 3 is not a multiple of --log-every 2",
        ),
        (["--config", "tiny", "--vocab", str(bare_vocab), "--epochs", "1"], "has no token-count sidecar"),
        (
            ["--config", str(options), "--steps", "2", "--devices", str(jax.local_device_count() + 1)],
            f"--devices {jax.local_device_count() + 1}: this process has {jax.local_device_count()} device(s)",
        ),
    ]
    for i, (args, message) in enumerate(cases):
        run_dir = tmp_path / f"run{i}"
        assert cli.main([*common, "--run-dir", str(run_dir), *args]) == 2, args
        err = capsys.readouterr().err
        lines = [l for l in err.splitlines() if "error:" in l]
        assert len(lines) == 1 and message in lines[0], (args, err)
        # Refused before anything was written: the vocabulary pass (no --vocab in the first two)
        # too, which can take minutes (before, it wrote vocab.txt first).
        assert not run_dir.exists()
    # A count given by hand is enough (0 epochs: it gets past the check and stops there, untrained).
    assert (
        cli.main(
            [
                *common,
                "--run-dir",
                str(tmp_path / "ok"),
                "--config",
                "tiny",
                "--vocab",
                str(bare_vocab),
                "--epochs",
                "0",
                "--n-train-tokens",
                "1000",
            ]
        )
        == 0
    )
    # A new run asked for no step (before: "already trained to step 0 (asked for 0)").
    assert f"{tmp_path / 'ok'}: set up and untrained: 0 steps planned; nothing to do\n" in capsys.readouterr().out


def test_options_written_for_another_vocabulary_say_both_remedies():
    """A config file's n_tokens_vocab that the vocabulary does not have: the line says what to set,
    or which vocabulary to give (before: only that they must agree)."""
    from elmo_jax._util.arguments import arguments_of

    vocab = Vocabulary.load(TRAIN / "vocab.txt")
    options = bilm_tf_options(batch_size=2, unroll_steps=5)
    wrong = dataclasses.replace(options, train=dataclasses.replace(options.train, n_tokens_vocab=len(vocab) + 7))
    with pytest.raises(CheckpointError) as e:
        options_for_vocab(wrong, vocab, None)
    assert str(e.value).endswith(
        f"they must agree: set n_tokens_vocab to {len(vocab)} in the options, or give the vocab of "
        f"{len(vocab) + 7} tokens they were written for"
    )
    assert arguments_of(e.value) == ("vocab",)
    assert options_for_vocab(wrong, vocab, None, strict=False).training.n_tokens_vocab == len(vocab)


def test_options_without_training_keys_and_no_count_plan_no_epochs_of_1b_word(tmp_path):
    """options_for_vocab(Options(model), vocab, None): no count (null), so a run asks for steps
    (before: bilm-tf's 1B Word count, 768,648,884 tokens, and a run of the bundled 5 sentences
    planned to step 3,002,535). A count given, or the options' own, is kept."""
    vocab = Vocabulary.load(TRAIN / "vocab.txt")
    bare = Options(model=preset("tiny"))
    assert options_for_vocab(bare, vocab, None).training.n_train_tokens is None
    assert options_for_vocab(bare, vocab, 139).training.n_train_tokens == 139
    own = bilm_tf_options(batch_size=2, unroll_steps=5)
    assert options_for_vocab(own, vocab, None).training.n_train_tokens == own.training.n_train_tokens
    settings = RunSettings(run_dir=str(tmp_path / "run"), progress=False, devices=1)
    with pytest.raises(ConfigError, match=r"^the options give no token count \(n_train_tokens is null\), so epochs"):
        pretrain(options_for_vocab(bare, vocab, None), vocab, TextFiles(str(TRAIN / "data.txt")), settings)
    assert not (tmp_path / "run").exists()
    # And a list given for the vocabulary is said so (before: n_negative_samples_batch must be >= 1).
    with pytest.raises(TypeError, match=r"^vocab is a list; expected a Vocabulary"):
        options_for_vocab(bare, ["a", "b"], None)  # type: ignore[arg-type]


def test_a_file_given_for_a_directory_to_make_is_said_by_the_python_api_too(trained_run, tmp_path):
    """pretrain's run_dir and export_run's out_dir, a file or under one: the OS's NotADirectoryError
    naming that file, before anything is read or written (before: FileExistsError from the mkdir,
    seven frames deep, after the checkpoint was read). The CLI says it after the flag."""
    run_dir, options, vocab = trained_run
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x\n")
    for target in (a_file, a_file / "sub"):
        with pytest.raises(NotADirectoryError) as e:
            export_run(str(run_dir), str(target))
        assert e.value.filename == str(a_file)
        settings = RunSettings(run_dir=str(target), steps=1, progress=False, devices=1)
        with pytest.raises(NotADirectoryError) as e:
            pretrain(options, vocab, TextFiles(str(TRAIN / "data.txt")), settings)
        assert e.value.filename == str(a_file)
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"]


@pytest.mark.slow
def test_an_exception_in_the_loop_still_saves_the_last_step_and_closes(trained_run, tmp_path):
    _, options, vocab = trained_run

    def fail_at_3(metrics):
        if metrics["step"] == 3:
            raise MemoryError("held-out evaluation ran out of memory (simulated)")

    run_dir = tmp_path / "run"
    with pytest.raises(MemoryError, match="simulated"):
        pretrain(
            options,
            vocab,
            TextFiles(str(TRAIN / "data.txt")),
            RunSettings(run_dir=str(run_dir), steps=10, save_every=100, log_every=1, progress=False, devices=1),
            on_metrics=fail_at_3,
        )
    assert load_run(str(run_dir))[3] == 3  # the step that completed before the failure, readable
    # Resumes from there.
    assert (
        pretrain(
            options,
            vocab,
            TextFiles(str(TRAIN / "data.txt")),
            RunSettings(run_dir=str(run_dir), steps=4, progress=False, devices=1),
        )["step"]
        == 4
    )


def test_reading_a_run_dir_leaves_a_save_in_flight_alone(tmp_path, fixtures_dir):
    """eval/export/embed on a run dir that is training must not delete the temporary directory of
    the save it has in flight (a writer's checkpoint manager does, when it opens)."""
    import shutil

    from elmo_jax.training.run_dir import export_run, load_run

    run = tmp_path / "run"
    shutil.copytree(fixtures_dir / "format1_run", run)
    in_flight = run / "checkpoints" / "9.orbax-checkpoint-tmp"
    (in_flight / "lstm.orbax-checkpoint-tmp").mkdir(parents=True)
    (in_flight / "lstm.orbax-checkpoint-tmp" / "part").write_bytes(b"being written")
    assert load_run(str(run))[3] == 2
    export_run(str(run), str(tmp_path / "export"))
    assert (in_flight / "lstm.orbax-checkpoint-tmp" / "part").read_bytes() == b"being written"


def test_on_progress_says_what_the_run_does_next_from_the_start_to_the_last_save(tmp_path, capsys):
    """What a watcher for a stuck run is told (``elmo-jax train --stall-timeout`` names it in its
    line): the restore, the first step (batch and compile), every step, each held-out window and
    the last save, on a fresh run and on its resumption. The resumption leaves ``eval_every``
    unset: with held-out text, that is every ``save_every`` steps (held-out text is never ignored)."""
    vocab = Vocabulary.load(TRAIN / "vocab.txt")
    options = options_for_vocab(bilm_tf_options(batch_size=2, unroll_steps=5), vocab, None)
    run = tmp_path / "run"
    quiet = {"progress": False, "devices": 1, "async_save": False}

    def doings(steps: int, eval_every: int | None = 2) -> list[str]:
        said: list[str] = []
        pretrain(
            options,
            vocab,
            TextFiles(str(TRAIN / "data.txt")),
            RunSettings(run_dir=str(run), steps=steps, log_every=2, eval_every=eval_every, save_every=2, **quiet),
            heldout=TextFiles(str(TRAIN / "data.txt")),
            on_progress=said.append,
        )
        return said

    def evaluation(step: int, windows: int) -> list[str]:
        at = f"evaluating the held-out data at step {step}"
        return [f"{at} (its first window)"] + [f"{at} (after window {k})" for k in range(1, windows + 1)]

    fresh = doings(4)
    assert "; held-out perplexity every 2 steps" in capsys.readouterr().out  # the start line says so
    windows = sum(d.startswith("evaluating the held-out data at step 2 (after") for d in fresh)
    assert windows >= 1
    assert fresh == [
        "initialising the model",
        "running step 1, this run's first (its batch, then its compile)",
        "running step 2",
        *evaluation(2, windows),
        "saving step 2",
        "running step 3",
        "running step 4",
        *evaluation(4, windows),
        "saving step 4",
        "ending the run at step 4",
        "saving step 4, the last",
    ], fresh
    assert doings(6, eval_every=None) == [
        f"restoring the newest checkpoint in {run}",
        "running step 5, this run's first (its batch, then its compile)",
        "running step 6",
        *evaluation(6, windows),
        "saving step 6",
        "ending the run at step 6",
        "saving step 6, the last",
    ]
    capsys.readouterr()
    assert not any(d.startswith("evaluating") for d in doings(8, eval_every=0))  # 0: never
    assert "held-out perplexity" not in capsys.readouterr().out
    # A session that ends before the next evaluation says so at its start.
    assert not any(d.startswith("evaluating") for d in doings(9, eval_every=4))
    assert "; held-out perplexity every 4 steps (none in this session: the first would be at step 12)" in (
        capsys.readouterr().out
    )


@pytest.mark.slow
def test_on_progress_is_told_of_each_shard_counted_for_a_vocabulary_the_run_builds(tmp_path):
    from elmo_jax.training.setup import TrainSpec, train

    for i in (1, 2):
        (tmp_path / f"part-{i}.txt").write_text((TRAIN / "data.txt").read_text())
    said: list[str] = []
    run = tmp_path / "run"
    train(
        TrainSpec(),  # the tiny preset, whose vocabulary size follows the data's
        TextFiles(str(tmp_path / "part-*.txt")),
        RunSettings(run_dir=str(run), steps=1, progress=False, devices=1, async_save=False),
        say=lambda *a: None,
        on_progress=said.append,
    )
    assert said == [
        f"counting the words of {tmp_path / 'part-1.txt'} for the vocabulary (shard 1 of 2)",
        f"counting the words of {tmp_path / 'part-2.txt'} for the vocabulary (shard 2 of 2)",
        "initialising the model",
        "running step 1, this run's first (its batch, then its compile)",
        "ending the run at step 1",
        "saving step 1, the last",
    ]
    assert (run / "vocab.txt").exists()


def test_too_little_held_out_text_names_the_setting_that_can_help(tmp_path):
    """With one row a batch already, a smaller batch cannot help; shorter windows can."""
    from elmo_jax._util.arguments import arguments_of
    from elmo_jax.training.evaluate import too_little_text

    (tmp_path / "h.txt").write_text("a b\n")
    source = TextFiles(str(tmp_path / "h.txt"))
    for rows, knob in ((2, "batch_size"), (1, "unroll_steps")):
        e = too_little_text(source, rows, 20)
        assert str(e).endswith(f"give more text or a smaller {knob}") and arguments_of(e) == (knob,)
    e = too_little_text(source, 2, 20, per_sentence=True)  # evaluate() can offer its other protocol
    assert str(e).endswith("a smaller batch_size, or reset_state_per_sentence (it packs any text)")
    assert arguments_of(e) == ("batch_size", "reset_state_per_sentence")
    assert f"({tmp_path / 'h.txt'}: 1 sentence, 2 tokens) is smaller than one evaluation window (2 rows x 20" in str(e)

    # Tokens enough for 16 rows x 20, but one sentence: the carried protocol deals whole sentences
    # to the rows in turn, so 15 rows get none (before: "smaller than one evaluation batch").
    (tmp_path / "h.txt").write_text(" ".join(["w"] * 2000) + "\n")
    e = too_little_text(source, 16, 20)
    said = "1 sentence, 2000 tokens) fills no evaluation window (16 rows x 20 tokens): each row reads whole sentences"
    assert f"({tmp_path / 'h.txt'}: {said}" in str(e), e
    # No sentence at all: neither a smaller batch nor the other protocol can help.
    (tmp_path / "h.txt").write_text("\n \n")
    e = too_little_text(source, 2, 20, per_sentence=True)
    assert str(e) == f"the held-out text ({tmp_path / 'h.txt'}) has no sentence to score; give a file with text in it"
    assert arguments_of(e) == ()


def test_training_text_that_fills_no_step_under_epochs_is_an_error_naming_it(tmp_path, capsys):
    """Text too short for one step's rows under epochs (steps read it again) stops in one line that
    names the file and what can help, exit 2. (Before: "its data ended at step 0 (planned 1);
    nothing to do", exit 0, as if a finished run had been run again.)"""
    from elmo_jax._util.arguments import arguments_of
    from elmo_jax.text.sources import DataError

    (tmp_path / "t.txt").write_text((TRAIN / "data.txt").read_text().splitlines()[0] + "\n")
    vocab = Vocabulary.load(TRAIN / "vocab.txt")
    options = options_for_vocab(bilm_tf_options(batch_size=2, unroll_steps=5), vocab, None)
    settings = RunSettings(run_dir=str(tmp_path / "run"), epochs=1, progress=False, devices=1, async_save=False)
    with pytest.raises(DataError) as e:
        pretrain(options, vocab, TextFiles(str(tmp_path / "t.txt")), settings)
    assert str(e.value).startswith(f"the training text ({tmp_path / 't.txt'}: 1 sentence, ")
    assert "training step (2 rows x 5 tokens)" in str(e.value) and "a smaller batch_size, or steps" in str(e.value)
    assert arguments_of(e.value) == ("batch_size", "steps")
    assert "nothing to do" not in capsys.readouterr().out and saved_steps(settings.run_dir) == []
    # The same text under steps: read again as often as they need.
    assert (
        pretrain(
            options, vocab, TextFiles(str(tmp_path / "t.txt")), dataclasses.replace(settings, epochs=None, steps=2)
        )["step"]
        == 2
    )


def test_a_session_that_stops_between_logged_steps_ends_with_the_metrics_of_its_last_steps(tmp_path, capsys):
    """At the end of the data (or a signal) between logged steps (before: the record of the last
    logged step, under the number of the step it stopped at). The data's end ends the run as a
    total's last step does: that step is logged too, and a rerun says there is nothing to do (before:
    it resumed, said "end of data" again, and gave a record of the step alone)."""
    vocab = Vocabulary.load(TRAIN / "vocab.txt")
    options = options_for_vocab(bilm_tf_options(batch_size=2, unroll_steps=5), vocab, None)
    quiet = {"progress": False, "devices": 1, "async_save": False, "epochs": 1}  # the data ends long before

    def run(name: str, log_every: int) -> tuple[dict, list[dict]]:
        settings = RunSettings(run_dir=str(tmp_path / name), log_every=log_every, **quiet)
        last = pretrain(options, vocab, TextFiles(str(TRAIN / "data.txt")), settings)
        return last, [json.loads(l) for l in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    _, every = run("every", 1)
    last, logged = run("fours", 4)
    assert f"end of data at step {last['step']}" in capsys.readouterr().out
    assert last["step"] == every[-1]["step"] == logged[-1]["step"] == logged[-2]["step"] + 1
    assert last["step"] % 4  # between logged steps
    # The one step since the last logged one: its loss, not the logged window's.
    assert last["loss"] == pytest.approx(every[-1]["loss"], rel=1e-6) and last["loss"] != logged[-2]["loss"]
    assert logged[-1] == {**last, "time": logged[-1]["time"]} and last["epoch"] == 1

    again, relogged = run("fours", 4)
    out = capsys.readouterr().out
    planned = re.search(rf"its data ended at step {last['step']} \(planned (\d+)\); nothing to do", out)
    assert planned and int(planned[1]) > last["step"], out  # rows take whole sentences: the last window did not fill
    assert "end of data" not in out and relogged == logged
    assert again == logged[-1]


@pytest.mark.slow  # 11 s here: two sessions and two exports
def test_a_session_that_changes_the_recipe_is_what_eval_and_export_read(tmp_path):
    """A resume with another learning rate: the run's options.json follows it, and each checkpoint
    is read with its own options (before: options.json and so every export kept the first
    session's, while the checkpoints trained with the new one)."""
    vocab = Vocabulary.load(TRAIN / "vocab.txt")
    first = options_for_vocab(bilm_tf_options(batch_size=2, unroll_steps=5), vocab, None)
    assert first.training.learning_rate == 0.2
    later = dataclasses.replace(first, train=dataclasses.replace(first.training, learning_rate=0.1))
    run = tmp_path / "run"
    quiet = {"progress": False, "devices": 1, "async_save": False, "save_every": 2}
    for options, steps in ((first, 2), (later, 4)):
        pretrain(
            options, vocab, TextFiles(str(TRAIN / "data.txt")), RunSettings(run_dir=str(run), steps=steps, **quiet)
        )
    assert Options.load(run / "options.json", saved=True) == later
    assert load_run(run)[0] == later and load_run(run, step=2)[0] == first  # each step's own
    for step, options in ((None, later), (2, first)):
        out = tmp_path / f"export{step}"
        export_run(run, out, step=step)
        assert json.loads((out / "options.json").read_text())["learning_rate"] == options.training.learning_rate


@pytest.mark.slow  # 8.5 s here: seven sessions
def test_a_resume_without_the_held_out_files_or_with_others_is_warned_and_the_hints_keep_them(tmp_path, capsys):
    """A run scored on held-out text, resumed without it, scores none from then on: said once per
    session, where it stopped silently; and train's closing hints name the run's file. Resumed
    with other held-out text (other files, or the same changed), it says so."""
    heldout = tmp_path / "heldout.txt"
    heldout.write_text((TRAIN / "data.txt").read_text())
    run = ["--run-dir", str(tmp_path / "run"), "--log-every", "1", "--devices", "1"]
    assert cli.main(_tiny_train(tmp_path, *run, "--steps", "1", "--heldout-files", str(heldout))) == 0
    assert "warning" not in capsys.readouterr().err
    for steps in ("2", "3"):  # recorded again by the session without it: warned at each resume
        assert cli.main(_tiny_train(tmp_path, *run, "--steps", steps)) == 0
        err = capsys.readouterr().err
        assert f"warning: {tmp_path / 'run'} scored held-out text ({heldout}) in an earlier session; this one" in err
        assert f"eval --run-dir {tmp_path / 'run'} --files {heldout}" in err, err
    # Negative control: given again, it is scored, and nothing is said.
    assert (
        cli.main(_tiny_train(tmp_path, *run, "--steps", "4", "--heldout-files", str(heldout), "--eval-every", "1")) == 0
    )
    out, err = capsys.readouterr()
    assert "warning" not in err and "heldout_perplexity" in out
    # Other held-out text, by name or by content: the perplexity's curve changes what it measures
    # (before: taken silently, the log mixing two texts' numbers).
    other = tmp_path / "other.txt"
    other.write_text("".join((TRAIN / "data.txt").read_text().splitlines(keepends=True)[::2]))
    for steps, given, said in (
        ("5", other, "heldout.txt is gone; other.txt is new"),
        ("6", heldout, "other.txt is gone; heldout.txt is new"),
    ):
        flags = ("--steps", steps, "--heldout-files", str(given))
        assert cli.main(_tiny_train(tmp_path, *run, *flags)) == 0
        assert (
            f"warning: {tmp_path / 'run'} scored other held-out text before ({said}): heldout_perplexity in "
            f"its metrics.jsonl measures this text from step {int(steps) - 1} on" in capsys.readouterr().err
        )
    heldout.write_text(heldout.read_text() + "one more line\n")
    assert cli.main(_tiny_train(tmp_path, *run, "--steps", "7", "--heldout-files", str(heldout))) == 0
    assert "(heldout.txt changed size (" in capsys.readouterr().err


@pytest.mark.slow  # two sessions
def test_training_text_emptied_since_the_last_checkpoint_is_said_so_at_the_resume(tmp_path, capsys):
    """The run's own file emptied between sessions: the one line says the run was trained on text
    (before: only that the file has no sentence, as if it were a new run's mistake). A new run
    given the same blank file (the control) gets the line alone."""
    text = tmp_path / "text.txt"
    text.write_text((TRAIN / "data.txt").read_text())
    run = ["--run-dir", str(tmp_path / "run"), "--devices", "1", "--train-files", str(text)]
    assert cli.main(_tiny_train(tmp_path, *run, "--steps", "1")) == 0
    text.write_text("")
    capsys.readouterr()
    assert cli.main(_tiny_train(tmp_path, *run, "--steps", "2")) == 2
    said = f"elmo-jax train: error: the training text ({text}) has no sentence to train on; give a file with text in it"
    assert (
        capsys.readouterr().err
        == f"{said}; {tmp_path / 'run'} was trained on text: if these are its files, they were emptied since\n"
    )
    assert cli.main(_tiny_train(tmp_path, *run[:1], str(tmp_path / "new"), *run[2:], "--steps", "2")) == 2
    assert capsys.readouterr().err == said + "\n" and not (tmp_path / "new").exists()


def _fake_checkpoint(run_dir: pathlib.Path, meta: dict) -> None:
    """A committed-looking step whose metadata alone is real: what ``setup.newest_meta`` reads."""
    (run_dir / "checkpoints" / "5" / "meta").mkdir(parents=True)
    (run_dir / "checkpoints" / "5" / "meta" / "metadata").write_text(json.dumps(meta))


def test_a_run_trained_on_other_files_resumed_without_train_files_is_refused_first(tmp_path, capsys):
    """No --train-files trains on the bundled sample: resuming a run of other text that way is
    refused in one line that names its files, before the vocabulary or the data are read. (Before:
    a warning about the vocabulary's count, then "the training data differs ... train.txt is new",
    a file the user never gave.)"""
    run_dir = tmp_path / "run"
    _fake_checkpoint(run_dir, {"train_files": [{"name": "a.txt", "size": 10}], "heldout_files": None})
    assert cli.main(["train", "--run-dir", str(run_dir), "--steps", "9", "--no-progress"]) == 2
    out, err = capsys.readouterr()
    assert err == (
        f"elmo-jax train: error: --run-dir {run_dir}: was trained on a.txt, and no --train-files trains on the "
        "bundled sample; give --train-files with its files to resume it\n"
    )
    assert out == "" and sorted(os.listdir(run_dir)) == ["checkpoints"]


def test_a_sample_run_that_scored_other_held_out_text_is_not_given_the_samples():
    """Resumed without flags, a run of the bundled sample scores the sample's held-out file only if
    that is what it scored before (or nothing): two texts' perplexities would mix in its log."""
    from elmo_jax.cli.commands import _sample_heldout

    sample, sample_heldout = bundled_sample()

    def heldout_for(tmp: pathlib.Path, scored: list[str] | None) -> str | None:
        _fake_checkpoint(tmp, {"train_files": [{"name": "train.txt"}], "heldout_files": scored})
        return _sample_heldout(str(tmp), sample, sample_heldout)

    with tempfile.TemporaryDirectory() as tmp:
        assert _sample_heldout(tmp, sample, sample_heldout) == sample_heldout  # a new run
    for scored, given in (([sample_heldout], sample_heldout), (None, sample_heldout), (["/data/dev.txt"], None)):
        with tempfile.TemporaryDirectory() as tmp:
            assert heldout_for(pathlib.Path(tmp), scored) == given, scored


def test_pretrain_refuses_arguments_that_do_not_fit_before_anything_is_written(tmp_path):
    """Each refused in one line naming the argument, before the run dir is made (before: options
    for another vocabulary trained and exported a softmax whose rows no word named; a path given
    as a str, "'str' object has no attribute 'read'" 14 frames deep; precision 'fp16', a
    ValueError once the run dir was written; devices=5 on 1, an empty run dir)."""
    from elmo_jax._util.arguments import arguments_of
    from elmo_jax.text.sources import DataError, Lines

    vocab = Vocabulary.load(TRAIN / "vocab.txt")
    options = options_for_vocab(bilm_tf_options(batch_size=2, unroll_steps=5), vocab, None)
    smaller = Vocabulary(vocab.words[:-1], source="smaller.txt")
    source = TextFiles(str(TRAIN / "data.txt"))
    run = tmp_path / "run"
    cases = [
        (lambda: pretrain(options, smaller, source, RunSettings(run_dir=str(run))), ConfigError,
         f"the options' n_tokens_vocab is {len(vocab)} but the vocab (smaller.txt) has {len(vocab) - 1} words", "vocab"),
        (lambda: pretrain(options, vocab, str(TRAIN / "data.txt"), RunSettings(run_dir=str(run))), TypeError,
         "source is a str; expected sentences: TextFiles(glob) for files", None),
        (lambda: pretrain(options, vocab, source, RunSettings(run_dir=str(run)), heldout=42), TypeError,
         "heldout is a int; expected sentences", None),
        (lambda: pretrain(options.model, vocab, source, RunSettings(run_dir=str(run))), TypeError,
         "options is ModelConfig; expected training Options", None),
        (lambda: RunSettings(run_dir=str(run), precision="fp16"), ConfigError,
         "precision must be one of float32, tf32, bfloat16; got 'fp16'", "precision"),
        (lambda: RunSettings(run_dir=None), ConfigError, "run_dir must be a directory's path; got None", "run_dir"),
        (lambda: RunSettings(run_dir=str(run), epochs="1"), ConfigError, "epochs must be a finite number >= 0", "epochs"),
        # Before: an AttributeError ('str' object has no attribute 'precision'); epochs ignored.
        (lambda: pretrain(options, vocab, source, str(run)), TypeError,
         "settings is a str; expected a RunSettings (RunSettings(run_dir=...))", "settings"),
        (lambda: RunSettings(run_dir=str(run), steps=2, epochs=1), ConfigError,
         "give steps or epochs, not both: each sets where the run stops", None),
        (lambda: pretrain(options, vocab, source, RunSettings(run_dir=str(run), devices=jax.local_device_count() + 1)),
         CheckpointError, f"devices {jax.local_device_count() + 1}: this process has", "devices"),
        # Text in memory with no sentence, as blank files are (before: refused once the run dir was made).
        (lambda: pretrain(options, vocab, Lines([" "]), RunSettings(run_dir=str(run))), DataError,
         "the training text (<lines>) has no sentence to train on; give a file with text in it", None),
        (lambda: pretrain(options, vocab, [], RunSettings(run_dir=str(run))), DataError,
         "the training text (<lines>) has no sentence to train on", None),
    ]  # fmt: skip
    if jax.default_backend() != "gpu":
        cases.append(
            (lambda: pretrain(options, vocab, source, RunSettings(run_dir=str(run), precision="tf32")), ConfigError,
             "precision 'tf32' is a GPU matmul mode", "precision")
        )  # fmt: skip
    for call, kind, said, argument in cases:
        with pytest.raises(kind) as e:
            call()
        assert str(e.value).startswith(said), str(e.value)
        if argument:
            assert arguments_of(e.value) == (argument,)
        assert not run.exists()
    # A path is taken as the str every reader takes; a list of str as sentences in memory.
    settings = RunSettings(run_dir=run, steps=1, progress=False, devices=1, async_save=False)
    assert settings.run_dir == str(run)
    assert pretrain(options, vocab, (TRAIN / "data.txt").read_text().splitlines(), settings)["step"] == 1
    # TextFiles of a pathlib.Path, as of its str (before: "'PosixPath' object is not iterable").
    assert TextFiles(TRAIN / "data.txt").files == TextFiles(str(TRAIN / "data.txt")).files == [str(TRAIN / "data.txt")]
    assert TextFiles([TRAIN / "data.txt"]).files == [str(TRAIN / "data.txt")]


def test_small_inputs_to_the_library_that_would_lose_or_mislead_are_refused(tmp_path):
    """A vocabulary token no text can hold (a run of it made a vocab.txt its own readers refused);
    a step given as "8" or 8.0 (said to be missing, or damaged); one path for both of save_hdf5's
    files (the options overwrote the weights); an export layout out of its list (out_dir made
    first); options without training keys for a small vocabulary (refused for the 8192 negatives
    the user never set)."""
    from elmo_jax._util.arguments import arguments_of
    from elmo_jax.compat.hdf5 import save_hdf5
    from elmo_jax.config import preset

    for bad in ("new york", "", " a"):
        with pytest.raises(VocabError, match=r"line 4: token .* is empty or holds whitespace"):
            Vocabulary(["<S>", "</S>", "<UNK>", bad, "z"])
    with pytest.raises(TypeError) as e:  # before: os.path.join's TypeError, naming no argument
        load_run(None)  # type: ignore[arg-type]
    assert str(e.value) == "run_dir is a NoneType; expected a run directory's path"
    assert arguments_of(e.value) == ("run_dir",)
    with pytest.raises(TypeError) as e:
        load_run(str(tmp_path), step="8")
    assert str(e.value) == "step is a str ('8'); expected an int or None" and arguments_of(e.value) == ("step",)
    with pytest.raises(TypeError, match=r"^step is a float \(8.0\)"):
        export_run(str(tmp_path), str(tmp_path / "out"), step=8.0)
    with pytest.raises(ValueError, match=r"^layout must be one of"):
        export_run(str(tmp_path), str(tmp_path / "out"), layout="foo")
    assert not (tmp_path / "out").exists()
    config, params = load_hdf5(
        FIXTURES / "allennlp_elmo" / "options.json", FIXTURES / "allennlp_elmo" / "lm_weights.hdf5"
    )
    with pytest.raises(ValueError, match="options_path and weights_path are both"):
        save_hdf5(config, params, tmp_path / "same", tmp_path / "same")
    assert not (tmp_path / "same").exists()
    small = Vocabulary(["<S>", "</S>", "<UNK>", *(f"w{i}" for i in range(100))])
    options = options_for_vocab(Options(model=preset("tiny")), small, 1000)
    assert (options.training.n_tokens_vocab, options.training.n_negative_samples_batch) == (103, 51)


def test_a_run_resumed_with_another_vocabulary_is_told_which_one_it_was_trained_with(trained_run, tmp_path, capsys):
    """(Before: "the options say n_tokens_vocab 17478 but v.txt has 11 tokens; set n_tokens_vocab
    to 11 in the options", advice that a resumed run then refused as other options.)"""
    run_dir, _, vocab = trained_run
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    small = tmp_path / "v.txt"
    small.write_text("\n".join(vocab.words[:11]) + "\n")
    args = ["train", "--run-dir", str(copy), "--train-files", str(TRAIN / "data.txt"), "--steps", "6", "--no-progress"]
    assert cli.main([*args, "--vocab", str(small)]) == 2
    assert capsys.readouterr().err == (
        f"elmo-jax train: error: --vocab {small}: has 11 words, but the run in {copy} was trained with {len(vocab)} "
        "(its vocab.txt): give that vocabulary, or leave --vocab out to use it\n"
    )


@pytest.mark.slow
def test_a_min_count_that_builds_no_vocabulary_is_said_not_used(tmp_path):
    """A run keeps its vocabulary, so min_count counts only when the run builds it. (Before:
    ``--min-count 100000`` on a resumed run, or beside ``--vocab``, trained without a word.) The
    same min_count again, as the same command resumes, says nothing."""
    from elmo_jax.text.vocab import read_vocab_meta
    from elmo_jax.training.setup import TrainSpec, train

    options = str(_write_tiny_options(tmp_path / "options.json"))
    run_dir, source = tmp_path / "run", TextFiles(str(TRAIN / "data.txt"))
    settings = RunSettings(run_dir=str(run_dir), steps=1, progress=False, devices=1, async_save=False)

    def notes(**spec) -> list[tuple]:
        said = []
        train(TrainSpec(config=options, **spec), source, settings, say=lambda *a: said.append(a))
        return [a for a in said if "min_count" in a[1:]]

    assert notes(min_count=2) == []  # the run builds its vocabulary with it
    assert read_vocab_meta(run_dir / "vocab.txt")["min_count"] == 2
    assert notes(min_count=2) == []  # the same command, resumed
    assert notes(min_count=100000) == [
        (
            f"min_count 100000: not used: the run's vocabulary {run_dir}/vocab.txt was built with min_count 2, and a run keeps it",
            "min_count",
        )
    ]
    given = str(TRAIN / "vocab.txt")
    settings = dataclasses.replace(settings, run_dir=str(tmp_path / "other"))
    assert notes(vocab=given, min_count=3) == [
        (f"min_count 3: not used: the vocabulary is given ({given})", "min_count")
    ]
    assert notes(vocab=given) == []  # the default: nothing to say
