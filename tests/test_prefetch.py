"""Host work done ahead of the step (``elmo_jax.training.prefetch``, ``GlobalBatches(prefetch=, workers=)``):
the same candidates, batches and data state as built in the loop, failures reported at their
step, and nothing left running."""

import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import jax
import numpy as np
import pytest
from helpers import heavy_modules_loaded, spelled_inputs
from jax.sharding import Mesh

from elmo_jax.config import TrainConfig
from elmo_jax.model.vocabulary import Vocabulary
from elmo_jax.text.sources import DataError, TextFiles
from elmo_jax.training.batches import LMBatcher, ShardLoader
from elmo_jax.training.global_batches import GlobalBatches, StopTogether
from elmo_jax.training.prefetch import CandidatePool
from elmo_jax.training.step import AXIS, BATCH_KEYS, add_candidates

ROWS, STEPS = 3, 7  # rows per device, unroll steps


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two shards of Zipfian sentences; words w50..w59 are out of the vocabulary (their spelling is
    part of the data state)."""
    d = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(60)]
    for k in range(2):
        lines = [" ".join(words[i] for i in np.minimum(rng.zipf(1.3, rng.integers(3, 12)), 60) - 1) for _ in range(40)]
        (d / f"part{k}.txt").write_text("\n".join(lines) + "\n")
    vocab = Vocabulary(["<S>", "</S>", "<UNK>", *words[:50]], source="test")
    return vocab, str(d / "*.txt")


def _feed(corpus, prefetch: int, workers: int = 0, epochs: int = 1) -> GlobalBatches:
    vocab, files = corpus
    batcher = LMBatcher(
        TextFiles(files),
        vocab,
        rows_per_device=ROWS,
        unroll_steps=STEPS,
        max_chars=20,
        n_devices=2,
        seed=5,
        max_epochs=epochs,
    )
    cfg = TrainConfig(n_tokens_vocab=len(vocab), batch_size=ROWS, unroll_steps=STEPS, n_negative_samples_batch=16)
    mesh = Mesh(np.array(jax.devices()[:2]), (AXIS,))
    return GlobalBatches(batcher, cfg, mesh, seed=3, first_device=0, fixed=False, prefetch=prefetch, workers=workers)


def _assert_states_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for d in a:
        assert a[d].keys() == b[d].keys()
        for k in a[d]:
            np.testing.assert_array_equal(a[d][k], b[d][k], err_msg=f"{d}/{k}")


def _host(batch: dict) -> dict:
    return {k: np.asarray(v) for k, v in jax.device_get(batch).items()}


def _wait_ready(pool: CandidatePool) -> None:
    deadline = time.monotonic() + 60
    while not pool.ready:
        assert time.monotonic() < deadline, "the candidate workers did not start"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("draws", [1, 3])
def test_candidates_drawn_by_workers_equal_those_drawn_in_process(draws):
    args = dict(seed=7, num_sampled=2048, vocab_size=793_471, draws=draws, first_device=2, fixed=False)
    batch = {"inputs": np.zeros((2, 2, ROWS, STEPS), np.int32), "targets": np.ones((2, 2, ROWS, STEPS), np.int32)}
    with CandidatePool(n_devices=2, workers=2, **args) as pool:
        for step in (0, 1, 2, 5, 6, 7):  # a jump: the draws queued for steps 3 and 4 are dropped
            if step == 1:  # step 0 was drawn in-process, while the workers started
                _wait_ready(pool)
            got, want = pool.add(batch, step), add_candidates(batch, step=step, **args)
            assert got.keys() == want.keys()
            for k in want:
                assert got[k].dtype == want[k].dtype
                np.testing.assert_array_equal(got[k], want[k], err_msg=f"step {step}: {k}")
            assert got["candidates"].shape == (2, 2, draws, 2048)


def test_a_global_draw_is_the_same_on_one_device_or_on_several():
    """Draw g of device k is global draw k * G + g: 3 draws on device 1 are devices 3-5's one
    draw each, so 384 rows in 3 draws on one device sample as 3 devices of 128 rows do."""
    args = dict(step=4, seed=7, num_sampled=256, vocab_size=10_000)
    one = add_candidates({"inputs": np.zeros((1, 0))}, draws=3, first_device=1, **args)
    three = add_candidates({"inputs": np.zeros((3, 0))}, draws=1, first_device=3, **args)
    np.testing.assert_array_equal(one["candidates"][0].swapaxes(0, 1), three["candidates"][:, :, 0])
    np.testing.assert_array_equal(one["num_tries"][0].T, three["num_tries"][:, :, 0])
    # and the draws differ (the comparison could not pass with one draw repeated)
    assert len({c.tobytes() for c in three["candidates"].reshape(6, -1)}) == 6


@pytest.mark.parametrize("workers", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_prefetched_batches_and_data_state_equal_those_built_in_the_loop(corpus, workers):
    plain, ahead = _feed(corpus, prefetch=0, epochs=2), _feed(corpus, prefetch=2, workers=workers, epochs=2)
    states, batches, epochs = [], [], []
    try:
        _assert_states_equal(ahead.data_state(), plain.data_state())
        step = 0
        while True:
            try:
                want = plain.next(step)
            except StopTogether as e:
                assert e.reason == "end of data"
                with pytest.raises(StopTogether, match="end of data"):  # at the same step
                    ahead.next(step)
                break
            got = ahead.next(step)
            if step == 0 and workers:  # drawn in-process while the workers start; then by them
                _wait_ready(ahead.host.pool)
            assert got.keys() == want.keys() == set(BATCH_KEYS)
            for k, x in _host(want).items():
                np.testing.assert_array_equal(_host(got)[k], x, err_msg=f"step {step}: {k}")
            # The batcher is ahead of the loop; the state to save is that after this step's batch.
            _assert_states_equal(ahead.data_state(), plain.data_state())
            assert ahead.epoch() == plain.epoch() == plain.batcher.epoch  # the epoch logged: this step's
            epochs.append(ahead.epoch())
            states.append(ahead.data_state())
            batches.append(_host(want))
            step += 1
        assert step >= 6 and epochs[0] == 0 and epochs[-1] == 1, epochs
        _assert_states_equal(ahead.data_state(), plain.data_state())
    finally:
        plain.close()
        ahead.close()
    # Resumed from the state saved after step 2, the data continues as it did.
    resumed = _feed(corpus, prefetch=2, workers=0, epochs=2)
    resumed.batcher.restore(states[2])
    try:
        for step in range(3, len(batches)):
            got = _host(resumed.next(step))
            for k in ("chars", "inputs", "targets", "rows", "starts"):
                np.testing.assert_array_equal(got[k], batches[step][k], err_msg=f"resumed, step {step}: {k}")
    finally:
        resumed.close()


def test_a_failure_while_building_ahead_is_reported_at_its_step(corpus):
    feed = _feed(corpus, prefetch=2)
    real_next, calls = feed.batcher.next, []

    def failing_next():
        calls.append(1)
        if len(calls) == 4:
            raise OSError("shard unreadable (simulated)")
        return real_next()

    feed.batcher.next = failing_next
    try:
        for step in range(3):
            feed.next(step)
        assert feed.error is None
        with pytest.raises(StopTogether, match="error"):
            feed.next(3)
        assert isinstance(feed.error, OSError)
    finally:
        feed.close()


def _failing_candidates_at(feed: GlobalBatches, step: int) -> None:
    """Makes the candidate draw of ``step`` fail: after ``batcher.next()`` has moved the batcher on."""
    real_add = feed.host.pool.add

    def add(batch, s):
        if s == step:
            raise RuntimeError("a candidate sampling worker process died (simulated)")
        return real_add(batch, s)

    feed.host.pool.add = add


def _peer_stops_at(feed, step: int) -> None:
    """Another process's stop at ``step``, as the agreement reports it, after this one built its batch."""
    real, calls = feed.agree, []

    def agree(values):
        calls.append(1)
        return (*values[:2], StopTogether.REASONS.index("signal"), 15) if len(calls) == step + 1 else real(values)

    feed.agree = agree


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("stop", ["failed build", "peer stops"])
def test_a_batch_built_for_a_step_that_does_not_run_is_not_in_the_saved_data_state(corpus, prefetch, stop, monkeypatch):
    """A checkpoint of the steps taken holds the batcher's position after the last batch taken,
    so the resumed run trains on the batch of the step that did not run: not one batch further."""
    reference, states, batches = _feed(corpus, prefetch=0), [], []
    try:
        for step in range(5):
            batches.append(_host(reference.next(step)))
            states.append(reference.data_state())
    finally:
        reference.close()
    feed = _feed(corpus, prefetch=prefetch)
    if stop == "failed build":
        _failing_candidates_at(feed, 3)
    else:
        _peer_stops_at(feed, 3)
    try:
        for step in range(3):
            feed.next(step)
        with pytest.raises(StopTogether, match="error" if stop == "failed build" else "signal"):
            feed.next(3)
        saved, live = feed.data_state(), feed.batcher.state()
        # the batcher itself went past step 3's batch (so the check below is not vacuous)
        assert any(not np.array_equal(live[d][k], states[2][d][k]) for d in live for k in live[d])
    finally:
        feed.close()
    _assert_states_equal(saved, states[2])
    monkeypatch.undo()
    resumed = _feed(corpus, prefetch=prefetch)
    resumed.batcher.restore(saved)
    try:
        for step in (3, 4):
            got = _host(resumed.next(step))
            for k in ("chars", "inputs", "targets", "rows", "starts"):
                np.testing.assert_array_equal(got[k], batches[step][k], err_msg=f"resumed, step {step}: {k}")
    finally:
        resumed.close()


def _prefetch_threads() -> list:
    return [t for t in threading.enumerate() if t.name == "elmo-jax-prefetch"]


@pytest.mark.slow
def test_close_or_dropping_stops_the_thread_and_the_workers(corpus):
    before = set(multiprocessing.active_children())
    for close in (True, False):
        feed = _feed(corpus, prefetch=2, workers=1)
        feed.next(0)
        feed.next(1)
        assert _prefetch_threads() and set(multiprocessing.active_children()) - before
        if close:
            feed.close()
            feed.close()  # again: nothing more to do
        del feed
        gc.collect()  # dropped without close(): its finaliser stops both
        assert not _prefetch_threads()
        assert not set(multiprocessing.active_children()) - before


@pytest.mark.slow
def test_a_dead_worker_fails_the_step_with_one_line():
    batch = {"inputs": np.zeros((1, 2, ROWS, STEPS), np.int32)}
    with CandidatePool(seed=0, num_sampled=64, vocab_size=1000, n_devices=1, workers=1) as pool:
        _wait_ready(pool)
        pool.add(batch, 0)
        for pid in list(pool._executor._processes):
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="candidate sampling worker process died") as e:
            for step in range(1, 100):  # the draws already done may still come back
                pool.add(batch, step)
        assert "\n" not in str(e.value)


@pytest.mark.slow
def test_the_interpreter_exits_with_a_pool_and_a_prefetcher_left_open():
    script = textwrap.dedent("""
        import time

        import numpy as np
        from elmo_jax.training.prefetch import CandidatePool, HostBatch, Prefetcher

        pool = CandidatePool(seed=0, num_sampled=64, vocab_size=1000, n_devices=1, workers=1)
        while not pool.ready:
            time.sleep(0.05)
        batch = {"inputs": np.zeros((1, 2, 3, 7), np.int32)}
        ahead = Prefetcher(lambda step: HostBatch(step, pool.add(batch, step)), 0, 2)
        print(ahead.take().step, ahead.take().step)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["0", "1"]


# -- the next shard, parsed ahead in a process -----------------------------------------------------


class _Shards:
    """Three in-memory shards with out-of-vocabulary words; ``fail`` names a shard whose read
    fails, as a file gone since the glob does; ``reads`` counts this process's reads (a loader
    process reads its own copy)."""

    def __init__(self, fail: int | None = None):
        rng = np.random.default_rng(5)
        words = [f"w{i}" for i in range(40)] + [f"oov{i}" for i in range(15)]
        self.shards = [[" ".join(rng.choice(words, rng.integers(2, 9))) for _ in range(n)] for n in (11, 4, 8)]
        self.vocab = Vocabulary(["<S>", "</S>", "<UNK>"] + words[:40])
        self.fail, self.reads = fail, 0

    def __len__(self) -> int:
        return len(self.shards)

    def name(self, shard: int) -> str:
        return f"shard{shard}.txt"

    def read(self, shard: int) -> list[str]:
        self.reads += 1
        if shard == self.fail:
            raise DataError(f"{self.name(shard)}: cannot be read")
        return list(self.shards[shard])


@pytest.mark.slow
def test_shards_parsed_ahead_give_the_batches_and_positions_of_shards_parsed_when_needed():
    """Over two epochs of three shards, both directions: the same batches, by spelling, and the
    same saved positions (a checkpoint's data state, its buffered words by spelling), whether
    the loader process parses the next shards (every shard: ``load_ahead_words=0``) or not."""
    sources = {ahead: _Shards() for ahead in (None, 0)}
    batchers = {
        ahead: LMBatcher(
            source, source.vocab, rows_per_device=3, unroll_steps=4, max_chars=10, seed=1, load_ahead_words=ahead
        )
        for ahead, source in sources.items()
    }
    try:
        for step in range(60):
            got = []
            for b in batchers.values():
                try:
                    batch = b.next()
                    spelled = [spelled_inputs(batch), batch["targets"], batch["starts"], batch["rows"]]
                    got.append((spelled, b.state()))
                except StopIteration:
                    got.append(None)
            assert got[1] is not None and got[0] is not None  # the stream does not end: no max_epochs
            (plain, plain_state), (ahead, ahead_state) = got
            for x, y in zip(plain, ahead):
                np.testing.assert_array_equal(x, y, err_msg=f"step {step}")
            for d in ("dir0", "dir1"):
                a, b = plain_state[d], ahead_state[d]
                for key in ("position", "buffer_lengths", "buffer_targets"):
                    np.testing.assert_array_equal(a[key], b[key])
                spelled = [
                    np.asarray(batchers[k].table.words, dtype=object)[s["buffer_inputs"]]
                    for k, s in ((None, a), (0, b))
                ]
                np.testing.assert_array_equal(*spelled)
        assert min(s.epoch for s in batchers[None].streams) >= 2  # over two epochs of the three shards
        # The loader parsed them (this is not one path compared with itself): this process read
        # only each direction's first shard ...
        assert sum(s.loaded_ahead for s in batchers[0].streams) >= 10
        assert sources[0].reads == 2
        # ... and without it every shard was parsed here.
        assert sum(s.loaded_ahead for s in batchers[None].streams) == 0
        assert sources[None].reads >= 12
    finally:
        for b in batchers.values():
            b.close()


def test_the_shard_loader_process_parses_a_shard_without_importing_jax(tmp_path):
    """The loader parses text with numpy alone: jax in it cost each run's loader about half a
    second of its start and 120 MB that it held for the run."""
    (tmp_path / "a.txt").write_text("the cat sat\non the mat\n")
    vocab = Vocabulary(["<S>", "</S>", "<UNK>", "the", "cat", "sat", "on", "mat"])
    loader = ShardLoader(vocab, min_words=0)
    try:
        future = loader.submit(TextFiles(str(tmp_path / "*.txt")), 0, None, False, (0, 1), 2)
        pair_in, _, offsets, oov = loader.take(future)
        assert not loader.failed and len(offsets) == 3 and oov == []  # parsed there, both lines
        assert pair_in.tolist() == [0, 3, 4, 5, 0, 6, 3, 7]
        assert loader._pool is not None
        # The control: this process has imported them, so the check would see them if they were there.
        assert {"jax", "jaxlib"} <= set(heavy_modules_loaded())
        assert loader._pool.submit(heavy_modules_loaded).result() == []
    finally:
        loader.close()


@pytest.mark.slow
def test_a_shard_that_cannot_be_read_fails_when_the_stream_reaches_it():
    """Its read fails in the loader process, ahead; the error reaches the caller at the batch
    that needs the shard, with the line it has in-line, after the same batches."""
    ends = {}
    for ahead in (None, 0):
        source = _Shards(fail=1)
        batcher = LMBatcher(
            source, source.vocab, rows_per_device=3, unroll_steps=4, max_chars=10, shuffle=False, load_ahead_words=ahead
        )
        served = 0
        try:
            with pytest.raises(DataError, match="^shard1.txt: cannot be read$"):
                while True:
                    batcher.next()
                    served += 1
            ends[ahead] = served
            if ahead == 0:
                assert source.reads == 2  # shard 0 of each direction; shard 1 was read by the loader
        finally:
            batcher.close()
    assert ends[0] == ends[None] > 0
