"""Pretraining throughput and communication: the train step over a device mesh, the row-split
softmax at a large vocabulary, and the input pipeline alone.

    python benchmarks/bench_train.py [--shape small] [--batch 32] [--steps 10] [--devices 1]
    python benchmarks/bench_train.py --shape original --batch 128 --compile-only 8 64 256
    python benchmarks/bench_train.py --pipeline-only

Tokens are real tokens per step, ``rows x unroll_steps`` per device, each counted once although
both directions learn from it (bilm-tf's count). FLOPs are those executed: forward (the char CNN
over the batch's distinct words, the biLSTM, the sampled softmax) times 3 for forward + backward.

Every configuration also prints, per device and per step: the softmax bytes it stores (weights,
bias and their Adagrad accumulators), and the bytes its collectives send, read from the compiled
program's HLO (``elmo_jax._util.hlo``; ring algorithms), beside the same figures for the replicated
design this project had before (every device holds the whole softmax and all-gathers every
device's sparse rows), computed from its formula.

``--compile-only N ...``: for each N, a subprocess with N fake CPU devices compiles the step for a
mesh of N devices and reports memory and bytes without running it (never *run* more than 2 fake
CPU devices here: XLA's CPU collectives time out under load). Timed runs use ``--devices``
(default 1); fake CPU devices measure overhead, not speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

if "--fake-devices" in sys.argv:  # a --compile-only child: set before jax is imported
    _n = sys.argv[sys.argv.index("--fake-devices") + 1]
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={_n}"
    os.environ["JAX_PLATFORMS"] = "cpu"

import jax
import jax.numpy as jnp
import numpy as np
from harness import encoder_flops, lstm_flops, matmul_gflops
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from elmo_jax._util.hlo import wire_bytes_per_device
from elmo_jax.config import PRESETS, Options, TrainConfig, preset
from elmo_jax.model.compute import Compute
from elmo_jax.model.gather import SUMS
from elmo_jax.model.layout import for_backend
from elmo_jax.model.vocabulary import Vocabulary
from elmo_jax.text.sources import TextFiles
from elmo_jax.training.batches import LMBatcher
from elmo_jax.training.global_batches import GlobalBatches
from elmo_jax.training.sharded_softmax import RowLayout, plan_fetch
from elmo_jax.training.softmax import sample_log_uniform_unique
from elmo_jax.training.step import AXIS, add_candidates, init_state, make_train_step, plan_batch, state_shardings

MB = 1e6


def zipf_corpus(directory: str, vocab_size: int, n_tokens: int, seed: int = 0) -> tuple[Vocabulary, str]:
    """A synthetic Zipfian corpus over ``vocab_size`` made-up words (plus some OOV words)."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = sorted({"".join(rng.choice(letters, rng.integers(2, 12))) for _ in range(int(vocab_size * 1.3))})
    rng.shuffle(words)
    words = words[: vocab_size + 1000]
    ranks = np.minimum(rng.zipf(1.1, n_tokens), len(words)) - 1
    lengths = rng.integers(5, 40, n_tokens // 5)
    path = os.path.join(directory, "corpus.txt")
    with open(path, "w") as f:
        pos = 0
        for n in lengths:
            if pos >= n_tokens:
                break
            f.write(" ".join(words[i] for i in ranks[pos : pos + n]) + "\n")
            pos += n
    return Vocabulary(["<S>", "</S>", "<UNK>", *words[: vocab_size - 3]], source="zipf"), path


def bench_pipeline(vocab: Vocabulary, path: str, rows: int, max_chars: int) -> float:
    batcher = LMBatcher(TextFiles(path), vocab, rows_per_device=rows, unroll_steps=20, max_chars=max_chars)
    batcher.next()  # loads and encodes the shard
    n = 0
    t = time.perf_counter()
    while time.perf_counter() - t < 3.0:
        batcher.next()
        n += 1
    return n * rows * 20 / (time.perf_counter() - t)  # real tokens, counted once, with char ids


def host_step_parts(vocab: Vocabulary, path: str, tc: TrainConfig, max_chars: int, steps: int = 30) -> dict:
    """Milliseconds per step of each part of the host work, one after the other on one core."""
    batcher = LMBatcher(TextFiles(path), vocab, rows_per_device=tc.batch_size, unroll_steps=20, max_chars=max_chars)
    batcher.next()  # loads and encodes the shard
    draws = dict(
        seed=0, num_sampled=tc.n_negative_samples_batch, vocab_size=tc.n_tokens_vocab, draws=tc.draws_per_device
    )
    add_candidates(batcher.next(), step=0, **draws)  # the sampler's once-per-run set-up
    layout, parts = (
        RowLayout.for_vocab(tc.n_tokens_vocab),
        dict.fromkeys(("batcher", "data snapshot", "candidates", "plan_fetch"), 0.0),
    )
    for step in range(steps):
        t0 = time.perf_counter()
        batch = batcher.next()
        t1 = time.perf_counter()
        batcher.snapshot()  # what prefetch takes each step (state() only when a checkpoint is saved)
        t2 = time.perf_counter()
        batch = add_candidates(batch, step=step, **draws)
        t3 = time.perf_counter()
        plan_fetch(batch["candidates"], batch["targets"], layout, 1)
        t4 = time.perf_counter()
        for k, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            parts[k] += dt * 1e3 / steps
    return parts


def bench_host_pipeline(
    vocab: Vocabulary,
    path: str,
    tc: TrainConfig,
    max_chars: int,
    prefetch: int,
    workers: int,
    device_s: float = 0.0,
    steps: int = 150,
    load_ahead_words: int | None = None,
) -> float:
    """Seconds per step of a loop over ``GlobalBatches.next`` on one device: the whole host side of
    a step (batcher, candidates, fetch plan, global arrays) with ``prefetch`` batches built ahead in
    a thread and ``workers`` processes drawing candidates. ``device_s``: each step also runs that
    long on an imagined device, asynchronously as a jitted step does: the loop prepares step s+1
    while step s runs, and waits (GIL released) only for a device still busy with the step before.
    0: batches taken as fast as they come. ``path``: a file or a glob of shards;
    ``load_ahead_words``: ``LMBatcher``'s (each direction's next shard parsed ahead in a process).

    Timed over ``steps`` steps after the workers' start and 20 steps of warm-up (the shard's load), all
    within the corpus's first pass: a shard reload (a second or so here, every few hundred steps
    of this small corpus) is not what is measured."""
    mesh = Mesh(np.array(jax.local_devices()[:1]), (AXIS,))
    batcher = LMBatcher(
        TextFiles(path),
        vocab,
        rows_per_device=tc.batch_size,
        unroll_steps=20,
        max_chars=max_chars,
        load_ahead_words=load_ahead_words,
    )
    feed = GlobalBatches(batcher, tc, mesh, seed=0, first_device=0, fixed=False, prefetch=prefetch, workers=workers)
    try:
        while workers and not feed.host.pool.ready:  # the workers' start (imports) is not the pipeline
            time.sleep(0.1)
        for step in range(20):
            jax.block_until_ready(feed.next(step))
        t = busy_until = time.perf_counter()  # busy_until: when the imagined device finishes its step
        for step in range(20, 20 + steps):
            jax.block_until_ready(feed.next(step))
            now = time.perf_counter()
            if now < busy_until:
                time.sleep(busy_until - now)
            busy_until = max(now, busy_until) + device_s
        return (max(time.perf_counter(), busy_until) - t) / steps
    finally:
        feed.close()


def softmax_bytes(v: int, p: int, n: int) -> tuple[float, float]:
    """(row-split, replicated) bytes per device of the softmax weights, bias and accumulators."""
    layout = RowLayout.for_vocab(v)
    return 2 * 4 * (p + 1) * layout.padded / n, 2 * 4 * (p + 1) * v


# Link rates for the step times the bytes imply (bytes a device sends / rate), per direction.
LINKS = (("NVLink 4, 450 GB/s", 450e9), ("InfiniBand 400 Gb/s", 50e9), ("a TPU v5e ICI link, 400 Gb/s", 50e9))


def replicated_wire_bytes(dense_params: int, tc: TrainConfig, p: int, n: int) -> float:
    """Bytes each device sent per step in the replicated design (the previous train step): a ring
    all-reduce of the dense gradients, and an all-gather of every device's candidate and target
    ids with their gradient rows (``2 S + 2 B T`` of them, not deduplicated)."""
    if n == 1:
        return 0.0
    sent = 2 * tc.n_negative_samples_batch + 2 * tc.batch_size * tc.unroll_steps
    return 2 * (n - 1) / n * 4 * dense_params + (n - 1) / n * n * sent * (p + 2) * 4


def model_and_config(args, v: int):
    model = preset(args.shape) if args.shape in PRESETS else Options.load(args.shape).model
    # Only when asked: a baseline tree from before the key runs this code too (gpu_measure.py).
    draws = {"rows_per_draw": args.rows_per_draw} if getattr(args, "rows_per_draw", 0) else {}
    tc = TrainConfig(
        n_tokens_vocab=v,
        batch_size=args.batch,
        unroll_steps=20,
        n_negative_samples_batch=args.negatives,
        reset_state_prob=args.reset_state_prob,
        **draws,
    )
    return model, tc


def report_comm(tag: str, hlo_text: str, n: int, model, tc, links: bool = False) -> None:
    p = model.lstm.projection_dim
    wire = wire_bytes_per_device(hlo_text, n)
    dense = sum(
        x.size
        for x in jax.tree_util.tree_leaves(
            jax.eval_shape(lambda: init_state(jax.random.PRNGKey(0), model, tc)).params["bilm"]
        )
    )
    split, rep = softmax_bytes(tc.n_tokens_vocab, p, n)
    old = replicated_wire_bytes(dense, tc, p, n)
    kinds = ", ".join(f"{k} {b / MB:,.1f}" for k, b in sorted(wire.items())) or "none"
    print(
        f"{tag}   softmax stored per device {split / MB:,.1f} MB (replicated design: {rep / MB:,.1f} MB); "
        f"sent per device per step {sum(wire.values()) / MB:,.1f} MB [{kinds}] "
        f"(replicated design: {old / MB:,.1f} MB)"
    )
    if links and n > 1:
        print(
            f"{tag}   implied communication time per step: "
            + "; ".join(
                f"{name}: {sum(wire.values()) / rate * 1e3:,.1f} ms (replicated design {old / rate * 1e3:,.1f} ms)"
                for name, rate in LINKS
            )
        )


def abstract_step_inputs(model, tc: TrainConfig, mesh: Mesh, words: int) -> tuple[dict, dict, int, int]:
    """``(state, batch, capacity, rows_asked)``: shape-only stand-ins (``jax.ShapeDtypeStruct``,
    sharded over ``mesh``) of the train step's inputs, to compile it without running it. The
    fetch plan is that of one device's candidates and a Zipfian batch of targets, drawn as in
    training; ``words``: distinct words per device batch."""
    n = mesh.size
    layout = RowLayout.for_vocab(tc.n_tokens_vocab)
    abstract = jax.eval_shape(lambda: init_state(jax.random.PRNGKey(0), model, tc, tc.batch_size * n))
    shardings = state_shardings(abstract, mesh)
    state = jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings)
    rng = np.random.default_rng(0)
    g = tc.draws_per_device
    cands = np.stack(
        [sample_log_uniform_unique(rng, tc.n_negative_samples_batch, tc.n_tokens_vocab)[0] for _ in range(2 * g)]
    ).reshape(2, g, -1)
    targets = np.minimum(rng.zipf(1.1, (2, tc.batch_size, tc.unroll_steps)), tc.n_tokens_vocab) - 1
    plan, capacity = plan_fetch(cands[None], targets[None], layout, n)
    rows_asked = len(np.unique(np.concatenate([cands.ravel(), targets.ravel()])))
    b, t, s, c = tc.batch_size, tc.unroll_steps, tc.n_negative_samples_batch, model.char_cnn.max_characters_per_token
    i32, sh = jnp.int32, NamedSharding(mesh, P(AXIS))
    shapes = {
        "chars": ((words, c), i32),
        "inputs": ((2, b, t), i32),
        "targets": ((2, b, t), i32),
        "rows": ((b,), i32),
        "starts": ((2, b, t), bool),
        "candidates": ((2, g, s), i32),
        "num_tries": ((2, g), jnp.float32),
        "fetch": ((n, capacity), i32),
        "cand_index": ((2, g, s), i32),
        "target_index": ((2, b, t), i32),
    }
    batch = {k: jax.ShapeDtypeStruct((n,) + shape, dtype, sharding=sh) for k, (shape, dtype) in shapes.items()}
    return state, batch, capacity, rows_asked


def compile_only(args) -> None:
    """In a child with --fake-devices N: compile the step for N devices, print one JSON line."""
    n = len(jax.devices())
    model, tc = model_and_config(args, args.vocabs[-1])
    mesh = Mesh(np.array(jax.devices()), (AXIS,))
    state, batch, capacity, rows_asked = abstract_step_inputs(model, tc, mesh, args.words)
    t0 = time.perf_counter()
    compiled = make_train_step(model, tc, mesh).lower(state, batch).compile()
    mem = compiled.memory_analysis()
    print(
        json.dumps(
            {
                "n": n,
                "hlo": compiled.as_text(),
                "capacity": capacity,
                "rows_asked": rows_asked,
                "compile_s": time.perf_counter() - t0,
                "args_bytes": getattr(mem, "argument_size_in_bytes", None),
                "temp_bytes": getattr(mem, "temp_size_in_bytes", None),
            }
        )
    )


def device_batches(args, model, tc: TrainConfig, vocab: Vocabulary, path: str, mesh: Mesh) -> tuple[list, int, int]:
    """``args.steps + 2`` global batches from the corpus at ``path``, all with one distinct-word
    width and one fetch capacity (so no timed step recompiles); and that width and capacity."""
    n = mesh.size
    batcher = LMBatcher(
        TextFiles(path),
        vocab,
        rows_per_device=tc.batch_size,
        unroll_steps=20,
        max_chars=model.char_cnn.max_characters_per_token,
        n_devices=n,
    )
    feed = GlobalBatches(batcher, tc, mesh, seed=0, first_device=0, fixed=False, prefetch=0)
    host = [feed.next(i) for i in range(args.steps + 2)]
    feed.close()  # no more batches: stop building them ahead
    width, capacity = max(b["chars"].shape[1] for b in host), feed.capacity
    batches = []
    for b in host:
        local = {k: np.asarray(x) for k, x in jax.device_get(b).items()}
        local["chars"] = np.pad(local["chars"], ((0, 0), (0, width - local["chars"].shape[1]), (0, 0)))
        local, _ = plan_batch(local, tc.n_tokens_vocab, n, capacity)
        batches.append({k: jax.device_put(x, NamedSharding(mesh, P(AXIS))) for k, x in local.items()})
    return batches, width, capacity


def distinct_words(batches: list) -> str:
    """The fewest and most distinct words of one device's window over ``batches`` (the rows the
    char CNN encodes before padding them to a bucket), as ``"min-max"``."""
    counts = [len(np.unique(x)) for b in batches for x in np.asarray(b["inputs"])]
    return f"{min(counts):,}-{max(counts):,}"


@dataclasses.dataclass(frozen=True)
class StepTiming:
    seconds: float  # median wall seconds of one step, untraced
    compiled: object  # the compiled step (jax.stages.Compiled)
    traced_seconds: float | None = None  # median of the traced pass, when there was one
    digest: str = ""  # with time_step(digest=True): sha256 of the state after the timed pass


def time_step(
    model,
    tc: TrainConfig,
    mesh: Mesh,
    batches: list,
    *,
    compute: Compute = Compute(),
    trace_dir: str | None = None,
    digest: bool = False,
) -> StepTiming:
    """Median seconds of one train step over ``batches[1:]`` (``batches[0]`` warms up), and the
    compiled step. With ``trace_dir``, the same steps run once more under ``jax.profiler`` after
    the timed pass, so that the profiler's overhead never reaches the timed figure. With
    ``digest``, also a sha256 of the state after the timed pass (the whole state crosses to the
    host for it: 3.3 GB at the `original` shape's V = 793,471)."""
    n = mesh.size
    step = make_train_step(model, tc, mesh, compute=compute)
    shardings = state_shardings(
        jax.eval_shape(lambda: init_state(jax.random.PRNGKey(0), model, tc, tc.batch_size * n)), mesh
    )
    state = jax.jit(lambda: init_state(jax.random.PRNGKey(0), model, tc, tc.batch_size * n), out_shardings=shardings)()
    compiled = step.lower(state, batches[0]).compile()
    state, m = step(state, batches[0])
    jax.block_until_ready(m)

    def timed_pass():
        nonlocal state
        times = []
        for b in batches[1:]:
            t = time.perf_counter()
            state, m = step(state, b)
            jax.block_until_ready(m)
            times.append(time.perf_counter() - t)
        return float(np.median(times))

    seconds, traced = timed_pass(), None
    # Two processes that ran the same steps on the same data agree here bit for bit, or the step
    # is not deterministic on this device (the GPU's scatters and matmul choices).
    sha = ""
    if digest:
        h = hashlib.sha256()
        for leaf in jax.tree_util.tree_leaves(jax.device_get(state)):
            h.update(np.ascontiguousarray(leaf).tobytes())
        sha = h.hexdigest()[:16]
    if trace_dir:
        jax.profiler.start_trace(trace_dir)
        traced = timed_pass()
        jax.profiler.stop_trace()
    del state
    return StepTiming(seconds, compiled, traced, sha)


def train_flops(model, tc: TrainConfig, width: int, n: int = 1) -> float:
    """FLOPs executed by one step on ``n`` devices: 3 x forward (the char CNN over ``width``
    distinct words, the biLSTM, the sampled softmax)."""
    p = model.lstm.projection_dim
    fwd = n * (
        width * encoder_flops(model)
        + tc.batch_size * 20 * lstm_flops(model)
        + 2 * tc.batch_size * 20 * 2 * p * (tc.n_negative_samples_batch + 1)
    )
    return 3 * fwd


def pipeline_only(args, vocab: Vocabulary, path: str) -> None:
    """The whole host side of a step at the original shape's sizes (the batcher's words come from
    the 100k-word corpus; candidates and fetch plan at V = 793,471), at ``args.batch`` rows,
    ``args.negatives`` and ``args.rows_per_draw``."""
    rows = args.batch
    _, tc = model_and_config(args, 793_471)
    draws = f", {tc.draws_per_device} draw(s) of {tc.n_negative_samples_batch:,} negatives"
    # V = 28k: the experiments' vocabulary (experiments/data/lm), where ids repeat most.
    for v in (28_000, 793_471):
        parts = host_step_parts(vocab, path, dataclasses.replace(tc, n_tokens_vocab=v), 50)
        print(
            f"host work per step, one after the other on one core ({rows} rows x 20, V={v:,}{draws}): "
            + ", ".join(f"{k} {ms:.1f} ms" for k, ms in parts.items())
        )
    print(
        f"host pipeline, a loop over GlobalBatches.next on 1 device ({os.cpu_count()} cores; {rows} rows{draws}): "
        f"batches taken as fast as they come | with a {args.device_ms:g} ms step on an (imagined, asynchronous) device"
    )
    for prefetch, workers in ((0, 0), (2, 0), (2, 1), (2, 2)):
        rates = [
            bench_host_pipeline(vocab, path, tc, 50, prefetch, workers, device_s)
            for device_s in (0.0, args.device_ms / 1e3)
        ]
        print(
            f"  prefetch {prefetch}, {workers} candidate worker(s): "
            + " | ".join(f"{sec * 1e3:5.1f} ms/step {rows * 20 / sec:9,.0f} tokens/s" for sec in rates)
        )
    if args.shards:
        shard_boundaries(args, vocab, tc)


def shard_boundaries(args, vocab: Vocabulary, tc: TrainConfig) -> None:
    """The host pipeline over ``args.shards`` shards of ``args.shard_tokens`` tokens, so that each
    direction meets a new shard every few dozen steps: each direction's next shard parsed ahead in
    a loader process (``LMBatcher``'s ``load_ahead_words``, here for shards of any size), against
    parsed when needed, alternating."""
    rows, steps = tc.batch_size, 150
    with tempfile.TemporaryDirectory() as tmp:
        _, path = zipf_corpus(tmp, 100_000, args.shards * args.shard_tokens)  # the same words as ``vocab``
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
        for k in range(args.shards):
            with open(os.path.join(tmp, f"shard{k}.txt"), "w", encoding="utf-8") as f:
                f.writelines(lines[k :: args.shards])
        glob = os.path.join(tmp, "shard*.txt")
        t = time.perf_counter()
        LMBatcher(TextFiles(glob), vocab, rows_per_device=rows, unroll_steps=20, max_chars=50).next()
        load = time.perf_counter() - t
        per_shard = args.shard_tokens / (rows * 20)
        print(
            f"shard boundaries: {args.shards} shards of {args.shard_tokens:,} tokens (a direction meets a new one every "
            f"{per_shard:.0f} steps; the first window, both directions' first shards parsed in-line, took "
            f"{load * 1e3:.0f} ms: {load / 2 / (args.shard_tokens / 1e6):.2f} s per million words and direction), "
            f"{steps} steps, prefetch 2, no candidate workers, a {args.device_ms:g} ms step on an imagined device"
        )
        for rnd in range(2):
            for ahead in (False, True):
                words = 0 if ahead else None
                sec = bench_host_pipeline(
                    vocab, glob, tc, 50, 2, 0, args.device_ms / 1e3, steps, load_ahead_words=words
                )
                print(
                    f"  round {rnd + 1}, {'next shard parsed ahead' if ahead else 'shards parsed when needed'}: "
                    f"{sec * 1e3:5.1f} ms/step {rows * 20 / sec:9,.0f} tokens/s, "
                    f"{100 * (sec * 1e3 / args.device_ms - 1):.1f} % over the device's step"
                )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="small", help="a preset or a bilm-tf options.json")
    ap.add_argument(
        "--batch", type=int, help="rows per device (bilm-tf batch_size; default 32, and 128 with --pipeline-only)"
    )
    ap.add_argument("--negatives", type=int, default=8192)
    ap.add_argument(
        "--rows-per-draw", type=int, default=0, help="rows per draw of candidates (TrainConfig.rows_per_draw)"
    )
    ap.add_argument("--vocabs", type=int, nargs="+", default=[10_000, 793_471])
    ap.add_argument("--steps", type=int, default=10, help="timed steps (the median is reported)")
    ap.add_argument(
        "--reset-state-prob",
        type=float,
        default=TrainConfig.reset_state_prob,
        help="TrainConfig.reset_state_prob (default: its default)",
    )
    ap.add_argument("--devices", type=int, default=1, help="local devices of the timed mesh")
    ap.add_argument(
        "--row-sums",
        choices=SUMS,
        help="the layout's row sums (default: the backend's; elmo_jax.model.layout)",
    )
    ap.add_argument("--pipeline-only", action="store_true")
    ap.add_argument(
        "--compile-only",
        type=int,
        nargs="+",
        metavar="N",
        help="compile (not run) for N fake CPU devices each, in subprocesses",
    )
    ap.add_argument("--words", type=int, default=2048, help="--compile-only: distinct words per device batch")
    ap.add_argument("--fake-devices", type=int, help=argparse.SUPPRESS)
    ap.add_argument(
        "--shards", type=int, default=0, help="--pipeline-only: also over this many shards, loaded ahead or not"
    )
    ap.add_argument("--shard-tokens", type=int, default=300_000, help="--shards: tokens per shard")
    ap.add_argument(
        "--device-ms",
        type=float,
        default=15.0,
        help="--pipeline-only: the imagined device's step (15 ms: the original shape at 128 rows on an H100)",
    )
    args = ap.parse_args()
    args.batch = args.batch or (128 if args.pipeline_only else 32)
    if args.fake_devices:
        return compile_only(args)
    if args.compile_only:
        model, tc = model_and_config(args, args.vocabs[-1])
        print(
            f"compile only: {args.shape}, V={tc.n_tokens_vocab:,}, {args.batch} rows x 20 per device, "
            f"{args.negatives} negatives, {args.words} distinct words per device batch"
        )
        for n in args.compile_only:
            cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--fake-devices", str(n)]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                print(f"n={n}: failed\n{r.stderr[-2000:]}")
                continue
            out = json.loads(r.stdout.strip().splitlines()[-1])
            print(
                f"n={n:>4}: compiled in {out['compile_s']:.0f} s; per device: arguments "
                f"{(out['args_bytes'] or 0) / MB:,.0f} MB, temporaries {(out['temp_bytes'] or 0) / MB:,.0f} MB; "
                f"rows asked {out['rows_asked']:,}, capacity per owner {out['capacity']}"
            )
            report_comm("        ", out["hlo"], n, model, tc, links=True)
        return
    with tempfile.TemporaryDirectory() as tmp:
        vocab, path = zipf_corpus(tmp, 100_000, 600_000)
        rate = bench_pipeline(vocab, path, 128, 50)
        print(
            f"input pipeline alone, one core (100k vocab, 128 rows x 20, both directions' windows with char ids): "
            f"{rate:,.0f} tokens/s"
        )
        if args.pipeline_only:
            pipeline_only(args, vocab, path)
            return
        peak, limit = matmul_gflops()
        n = args.devices
        mesh = Mesh(np.array(jax.local_devices()[:n]), (AXIS,))
        print(f"device: {jax.devices()[0].device_kind} x {n}; {limit}: {peak:.1f} GFLOP/s")
        for v in args.vocabs:
            model, tc = model_and_config(args, v)
            batches, width, capacity = device_batches(args, model, tc, vocab, path, mesh)
            compute = Compute()
            if args.row_sums:  # the backend's layout with the other row sums (elmo_jax.model.gather)
                compute = Compute(layout=dataclasses.replace(for_backend(), row_sums=args.row_sums))
            timing = time_step(model, tc, mesh, batches, compute=compute)
            sec, compiled = timing.seconds, timing.compiled
            mem = compiled.memory_analysis()
            tokens = args.batch * 20 * n
            gflops = train_flops(model, tc, width, n) / sec / 1e9
            temp = f", compiled temp {mem.temp_size_in_bytes / 2**20:.0f} MiB" if mem is not None else ""
            print(
                f"{args.shape} V={v:>7,}: {sec * 1e3:7.1f} ms/step (median of {args.steps})  {tokens / sec:7.0f} tokens/s  "
                f"{gflops:6.1f} GFLOP/s ({100 * gflops / peak:.0f}% of matmul x {n})  "
                f"[distinct words a window {distinct_words(batches)}, rows encoded {width}, "
                f"fetch capacity {capacity}]{temp}"
            )
            report_comm("   ", compiled.as_text(), n, model, tc)


if __name__ == "__main__":
    main()
