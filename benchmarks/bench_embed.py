"""Extraction throughput of ``Embedder.embed`` with its defaults, on one device, after warm-up.

    python benchmarks/bench_embed.py [--shapes small original] [--repeats 10]

Two inputs: 32 sentences of 20 random lowercase words, and the 30 natural sentences of the
bilm-tf fixture (lm_embeddings_sentences.json). Real tokens are counted once. Weights are random
(speed does not depend on them). For each shape: float32 and bfloat16, with and without a token
cache holding the words of the input, and the process's peak memory so far.

A third input is a whole job: the 2,074 sentences of the bundled sample's ``heldout.txt`` (or
``--job-file``, e.g. the experiments' held-out text, 119k tokens) through a fresh ``Embedder`` per
precision (``--job-precisions``, default float32), first cold (every compile included, as a
user's first call) and then again warm (``--job-repeats`` times), each pass with its wall time
split by phase (``Phases``: the token table, the biLSTM calls' dispatch, output arrays, copies and
waits for the device). ``--job-tokens``,
``--job-steps``, ``--job-blocks`` and ``--job-layers`` compare ``batch_tokens``, ``Layout.extract_steps``
and ``Layout.extract_block_mib`` values (rows x steps per biLSTM call, steps per call, the outputs'
shared blocks) and ``embed(layers=)``, ``--job-pool`` ``embed(pool=)``. ``--host-only gpu``
times only the host's share of the job under that backend's layout (``--blocks`` compares
``extract_block_mib`` values there). ``--job-only`` runs only that; it also runs the previous commit's
tree (``git archive``), whose ``Embedder`` took ``dtype=``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib.util
import json
import os
import resource
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import jax
from harness import encoder_flops, lstm_flops, matmul_gflops, random_sentences

from elmo_jax import Embedder, init_bilm, preset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPILES: list[float] = []  # seconds of each XLA compile in this process (a persistent-cache hit is not one)
jax.monitoring.register_event_duration_secs_listener(
    lambda event, sec, **_: COMPILES.append(sec) if event == "/jax/core/compile/backend_compile_duration" else None
)


def natural_sentences() -> list[list[str]]:
    path = os.path.join(ROOT, "tests/fixtures/bilm_tf_model/lm_embeddings_sentences.json")
    with open(path) as f:
        return [s.split() for group in json.load(f) for s in group]


def sample_sentences(path: str | None = None) -> list[list[str]]:
    with open(path or os.path.join(ROOT, "elmo_jax/data/sample/heldout.txt"), encoding="utf-8") as f:
        return [line.split() for line in f if line.strip()]


def make_embedder(config, params, precision: str, **kw) -> Embedder:
    # A tree from before elmo_jax.policy named the policy dtype= ("float32"/"bfloat16").
    if importlib.util.find_spec("elmo_jax.policy") is None:
        return Embedder(config, params, dtype=precision, **kw)
    return Embedder(config, params, precision=precision, **kw)


def job_plan(embedder, lengths: list[int]) -> str:
    """The biLSTM's work for these sentence lengths: calls, sequential steps, padded token-steps."""
    real = f"{sum(n + 2 for n in lengths if n):,} real"
    if hasattr(embedder, "_packing"):
        pack = embedder._packing(lengths)
        return (
            f"the job's plan: {pack.calls} calls of {pack.rows} rows x {pack.steps} steps, "
            f"{pack.calls * pack.steps:,} sequential LSTM steps, "
            f"{pack.rows * pack.calls * pack.steps:,} padded token-steps ({real})"
        )
    if hasattr(embedder, "_plan"):  # the batches of 807c246 and before
        plan = embedder._plan(lengths)
        return (
            f"the job's plan: {len(plan)} batches, {sum(t + 2 for _, _, t in plan):,} sequential LSTM steps, "
            f"{sum(r * (t + 2) for _, r, t in plan):,} padded token-steps ({real})"
        )
    return "the job's plan: (not known to this tree)"


class Phases:
    """Wall time of one ``embed`` call split by phase, by wrapping the ``Embedder``'s steps for the
    duration of a ``with`` block (a tree without one of them leaves that phase out):

    - token table: the call's distinct words, the char CNN on them (its device time included);
    - biLSTM calls, split into the host's dispatch of each call, the output arrays (``new_outputs``,
      layer 0 filled in), the copies of each call's outputs into them (``Packing.scatter``), and the
      rest: the host waiting for the device (its results, or a free slot for the next call);
    - other: the rest of ``embed`` (checks, packing, the index streams, mixing, pooling).

    Also the process's minor page faults during the block (``getrusage``): each is the kernel
    mapping a page of memory on its first touch, 4 KiB (or 2 MiB, a transparent huge page)."""

    def __init__(self, embedder):
        from elmo_jax.extract import embedder as module

        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.patches = [
            (type(embedder), "_token_table", "token table"),
            (type(embedder), "_run_packed", "biLSTM calls"),
            (module, "new_outputs", "output arrays"),
            (getattr(module, "Packing", None), "scatter", "copies into them"),
            (embedder, "_packed", "dispatch"),
            (embedder, "_gather", "dispatch"),
        ]
        self.saved: list[tuple[object, str, object]] = []
        self.faults = 0

    def _timed(self, fn, key: str):
        def wrapper(*args, **kw):
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.seconds[key] += time.perf_counter() - t

        return wrapper

    def __enter__(self) -> Phases:
        for owner, attr, key in self.patches:
            fn = getattr(owner, attr, None)
            if fn is not None:
                # Class attributes are read through the class dict (a plain function, rebound on each call).
                raw = owner.__dict__[attr] if isinstance(owner, type) else fn
                self.saved.append((owner, attr, raw))
                setattr(owner, attr, self._timed(raw, key))
        self.faults = -resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        return self

    def __exit__(self, *exc) -> None:
        self.faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for owner, attr, raw in reversed(self.saved):
            setattr(owner, attr, raw)

    def line(self, total: float) -> str:
        s = self.seconds
        wait = s["biLSTM calls"] - s["dispatch"] - s["output arrays"] - s["copies into them"]
        other = total - s["token table"] - s["biLSTM calls"]
        ms = lambda v: f"{1e3 * v:.0f} ms"  # noqa: E731
        return (
            f"token table {ms(s['token table'])}; biLSTM calls {ms(s['biLSTM calls'])} = dispatch "
            f"{ms(s['dispatch'])} + output arrays {ms(s['output arrays'])} + copies into them "
            f"{ms(s['copies into them'])} + waiting for the device {ms(wait)}; other {ms(other)}; "
            f"{self.faults:,} minor page faults"
        )


def bench_job(
    name: str,
    params,
    config,
    path: str | None,
    precisions: list[str],
    peak: float,
    settings: list[dict],
    repeats: int = 1,
    layer_choices: tuple[str, ...] = ("all",),
    pools: tuple[str | None, ...] = (None,),
) -> None:
    sents = sample_sentences(path)
    n = sum(len(s) for s in sents)
    distinct = len({w for s in sents for w in s})
    flops = distinct * encoder_flops(config) + sum(len(s) + 2 for s in sents) * lstm_flops(config)
    what = f"{len(sents):,} sentences of {os.path.basename(path) if path else 'the sample'} ({n:,} tokens)"
    for precision in precisions:
        for kw, layers, pool in ((kw, layers, pool) for kw in settings for layers in layer_choices for pool in pools):
            embedder = make_embedder(config, params, precision, devices=1, **kw)
            label = " ".join(layout_label(v) if k == "layout" else f"{k}={v}" for k, v in kw.items())
            label += (f" layers={layers}" if layers != "all" else "") + (f" pool={pool}" if pool else "")
            if precision == precisions[0] and layers == layer_choices[0] and pool == pools[0]:
                print(f"{name:8s} {label} {job_plan(embedder, [len(s) for s in sents])}", flush=True)
            for run in ("cold",) + ("warm",) * repeats:
                compiles = len(COMPILES)
                with Phases(embedder) as phases:
                    t = time.perf_counter()
                    embedder.embed(sents, layers=layers, pool=pool)
                    sec = time.perf_counter() - t
                new = COMPILES[compiles:]
                print(
                    f"{name:8s} {precision:8s} {label} {what}, {run}: {n / sec:8.0f} tokens/s ({sec:.2f} s, of which "
                    f"{sum(new):.1f} s compiling {len(new)} programs; {100 * flops / sec / 1e9 / peak:.0f}% of the "
                    f"float32 matmul, useful FLOPs only)",
                    flush=True,
                )
                print(f"{name:8s}   where the {sec:.2f} s went: {phases.line(sec)}", flush=True)


def bench_host(name: str, config, path: str | None, backend: str, block_mib: int | None = None) -> tuple[object, dict]:
    """The host's share of the job under ``backend``'s layout, no device involved (the device's
    outputs are zeros here), ms each and the tokens/s they allow: the packing and index streams,
    then per output form the host's work on each call's outputs: every layer (the per-sentence
    arrays with layer 0 filled in, then the copies of the biLSTM layers), one layer
    (``layers="top"`` or any mix, mixed on the device), or pooled (``pool=``, pooled on the
    device: the piece table, then adding each call's piece sums). Each form twice: first, and
    again once the first pass's arrays are freed, as every window of a long job after the first
    reuses the memory of the one before (new memory costs a page fault per 4 KiB page).
    ``block_mib``: ``Layout.extract_block_mib`` for the outputs (default: the layout's).

    Returns the job's ``Packing`` and ``{(form, run): seconds}``, the packing and index streams
    included (``gpu_projection.py`` builds on them)."""
    import numpy as np

    # A tree from before elmo_jax.extract.packing kept these in the embedder module.
    packing = importlib.import_module(
        "elmo_jax.extract.packing"
        if importlib.util.find_spec("elmo_jax.extract.packing")
        else "elmo_jax.extract.embedder"
    )
    copy_thread_count, copy_threads = packing.copy_thread_count, packing.copy_threads
    new_outputs, pack_sentences = packing.new_outputs, packing.pack_sentences
    from elmo_jax.model.layout import BY_BACKEND

    sents = sample_sentences(path)
    lengths = [len(s) for s in sents]
    layout, p, n_out = BY_BACKEND[backend], config.lstm.projection_dim, config.n_output_layers
    slot: dict[str, int] = {}
    token_rows = [np.array([slot.setdefault(w, len(slot)) for w in s], np.int64) for s in sents]
    table = np.ones((len(slot), p), np.float32)
    t = time.perf_counter()
    pack = pack_sentences(lengths, 1, layout.extract_tokens, layout.extract_steps)
    t1 = time.perf_counter()
    pack.streams(token_rows, len(slot), len(slot) + 1)
    common = {"packing": t1 - t, "index streams": time.perf_counter() - t1}
    threads = copy_thread_count(layout)  # as Embedder.embed picks them
    block = getattr(layout, "extract_block_mib", 0) if block_mib is None else block_mib
    print(
        f"{name:8s} host side under the {backend} layout, {len(sents):,} sentences ({sum(lengths):,} tokens) in "
        f"{pack.calls} calls of {pack.rows} x {pack.steps}, {threads} copy thread(s), "
        f"{f'outputs in blocks of {block} MiB' if block else 'an array a sentence'}: "
        + ", ".join(f"{k} {1e3 * v:.0f} ms" for k, v in common.items()),
        flush=True,
    )
    seconds = {}
    for form in ("all", "top", "pooled"):
        for run in ("first", "again"):
            times = dict(common)
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            if form == "pooled":
                t = time.perf_counter()
                segment, owner = pack.pieces(1)
                acc = np.zeros((len(sents), n_out, 2, p), np.float32)
                times["piece table"] = time.perf_counter() - t
                sums = np.zeros((owner.shape[1], n_out, 2, p), np.float32)
                t = time.perf_counter()
                for c in range(pack.calls):  # as Embedder does with each call's sums
                    ids = owner[c]
                    acc[ids[ids >= 0]] += sums[ids >= 0]
                acc = [x.reshape(n_out, 2 * p).copy() for x in acc]
                times["piece sums"] = time.perf_counter() - t
                gb = pack.calls * sums.nbytes / 1e9
            else:
                with copy_threads(threads) as copier:
                    t = time.perf_counter()
                    # A tree from before Layout.extract_block_mib takes no block size.
                    blocked = [block << 20] if block else []
                    out = new_outputs(table, token_rows, n_out if form == "all" else 1, copier, *blocked)
                    times["new arrays" + (" and layer 0" if form == "all" else "")] = time.perf_counter() - t
                    ys = np.zeros((n_out - 1 if form == "all" else 1, 2, pack.rows, pack.steps, p), np.float32)
                    t = time.perf_counter()
                    for c in range(pack.calls):
                        pack.scatter(out, c, ys, copier)
                    times["biLSTM layers" if form == "all" else "the mixed layer"] = time.perf_counter() - t
                gb = sum(x.nbytes for x in out) / 1e9
                del out
            print(
                f"{name:8s}   {form} ({gb:.2f} GB from the device), {run}: "
                + ", ".join(f"{k} {1e3 * v:.0f} ms" for k, v in times.items() if k not in common)
                + f"; {sum(lengths) / sum(times.values()):,.0f} tokens/s with the above, if nothing else ran; "
                + f"{resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults:,} minor page faults",
                flush=True,
            )
            seconds[form, run] = sum(times.values())
    return pack, seconds


def layout_label(layout) -> str:
    block = getattr(layout, "extract_block_mib", 0)  # a baseline tree's Layout may lack it
    return f"extract_steps={layout.extract_steps}" + (f" extract_block_mib={block}" if block else "")


def job_settings(tokens: list[int] | None, steps: list[int] | None, blocks: list[int] | None = None) -> list[dict]:
    """Embedder keywords for each (batch_tokens, extract_steps, extract_block_mib) asked for; [{}]:
    the defaults (the only choice a tree from before ``Layout.extract_steps`` has)."""
    out = []
    for t in tokens or [None]:
        for k in steps or [None]:
            for b in blocks or [None]:
                kw = {} if t is None else {"batch_tokens": t}
                if k is not None or b is not None:
                    from elmo_jax.model.layout import for_backend  # only here: a baseline tree may lack it

                    change = {"extract_steps": k, "extract_block_mib": b}
                    kw["layout"] = dataclasses.replace(
                        for_backend(), **{f: v for f, v in change.items() if v is not None}
                    )
                out.append(kw)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["small", "original"])
    ap.add_argument("--repeats", type=int, default=10, help="best of this many timed calls per input")
    ap.add_argument("--job-only", action="store_true", help="only the whole-job measurement")
    ap.add_argument("--job-file", help="text, one tokenized sentence per line (default: the bundled sample's)")
    ap.add_argument("--job-precisions", nargs="+", default=["float32"])
    ap.add_argument("--job-tokens", nargs="+", type=int, help="batch_tokens values to compare (default: the library's)")
    ap.add_argument("--job-steps", nargs="+", type=int, help="extract_steps values to compare (default: the layout's)")
    ap.add_argument(
        "--job-blocks", nargs="+", type=int, help="extract_block_mib values to compare (default: the layout's)"
    )
    ap.add_argument("--job-repeats", type=int, default=1, help="warm runs of the job after the cold one")
    ap.add_argument(
        "--job-layers",
        nargs="+",
        default=["all"],
        choices=["all", "top", "average"],
        help="embed(layers=...) values to compare",
    )
    ap.add_argument(
        "--job-pool",
        nargs="+",
        default=["none"],
        choices=["none", "mean", "max"],
        help="embed(pool=...) values to compare (none: every token's vectors)",
    )
    ap.add_argument(
        "--host-only",
        metavar="BACKEND",
        help="only the host's share of the job under this backend's layout (e.g. gpu), no device",
    )
    ap.add_argument(
        "--blocks", nargs="+", type=int, help="with --host-only: extract_block_mib values to compare, in turn"
    )
    args = ap.parse_args()
    if args.host_only:
        for name in args.shapes:
            for block in args.blocks or [None]:
                bench_host(name, preset(name), args.job_file, args.host_only, block)
        return
    peak, limit = matmul_gflops()
    print(f"device: {jax.devices()[0].device_kind} x1; {limit}: {peak:.1f} GFLOP/s")
    inputs = {"32x20 random words": random_sentences(32, 20), "30 natural sentences": natural_sentences()}
    for name in args.shapes:
        config = preset(name)
        params = init_bilm(jax.random.PRNGKey(0), config)
        bench_job(
            name,
            params,
            config,
            args.job_file,
            args.job_precisions,
            peak,
            job_settings(args.job_tokens, args.job_steps, args.job_blocks),
            args.job_repeats,
            tuple(args.job_layers),
            tuple(None if v == "none" else v for v in args.job_pool),
        )
        if args.job_only:
            continue
        for dtype in ("float32", "bfloat16"):
            for cached in (False, True):
                for label, sents in inputs.items():
                    words = sorted({w for s in sents for w in s}) if cached else None
                    embedder = make_embedder(config, params, dtype, token_cache=words, devices=1)
                    embedder.embed(sents)  # warm-up: compiles
                    best = float("inf")
                    for _ in range(args.repeats):
                        t = time.perf_counter()
                        embedder.embed(sents)
                        best = min(best, time.perf_counter() - t)
                    n = sum(len(s) for s in sents)
                    distinct = len({w for s in sents for w in s})
                    flops = (0 if cached else distinct * encoder_flops(config)) + sum(
                        len(s) + 2 for s in sents
                    ) * lstm_flops(config)
                    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
                    print(
                        f"{name:8s} {dtype:8s} cache={'on ' if cached else 'off'} {label:22s}: {n / best:8.0f} tokens/s "
                        f"{flops / best / 1e9:6.1f} GFLOP/s ({100 * flops / best / 1e9 / peak:.0f}% of matmul, "
                        f"useful FLOPs only)  peak RSS {rss:.0f} MiB"
                    )


if __name__ == "__main__":
    main()
