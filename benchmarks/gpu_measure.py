"""The whole GPU measurement of issue 30 in one call, under one time budget, as small text files.

    PYTHONPATH=. python benchmarks/gpu_measure.py --out "$OUT" [--budget 465] [--baseline DIR]
    PYTHONPATH=. python benchmarks/gpu_measure.py --out /tmp/rehearsal --rehearse   # tiny shapes, a CPU

Parts, each a fresh process (so each peak memory is its own) under a timeout, each writing
``OUT/<part>.txt`` as it goes (a part cut short keeps the lines it printed). In this order:
roofline, step128, axis2_128, cnnvjp128, wave128, baseline128, saved128, saved_again128, saved384, cli,
step384, wave384, towers384, baseline384, extract, axis2_384, autodiff128, profile (a short budget skips
the last first).

- ``roofline``: ``harness.roofline_report``: the card's name and clocks (nvidia-smi), the bfloat16
  and tf32 matmul rates at 8192^3 by the slope method, beside the datasheet's dense peaks; also
  ``roofline.json``, which the step parts read for their MFU.
- ``step128``, ``step384``: the ``original`` train step, V = 793,471, 8,192 negatives, bfloat16 (the
  ``"bfloat16"`` policy) under the backend's layout, at 128 and at 384 rows (bilm-tf's global batch
  on one device): median ms over 10 steps, tokens/s, TFLOP/s executed and MFU against both the
  datasheet peak and the measured matmul, peak device memory (``memory_stats``) and XLA's plan
  (``memory_analysis``), and the compiled program's scatters (unique or not), sorts and while
  loops (``elmo_jax._util.hlo.scatter_census``). Under XLA's deterministic-ops flag, as
  ``elmo-jax train`` runs it by default (``--gpu-kernels fixed``).
- ``axis2_128``, ``axis2_384``: ``step128`` and ``step384`` with the LSTM's per-step arrays
  ``[2, B, T, ...]`` (``Layout.lstm_time_axis`` 2, the loop written out in Python): whether
  sparing XLA the gate arrays' transposes is faster, in the same call.
- ``cnnvjp128``: ``step128`` with each char-CNN filter's max differentiated by its hand-written
  backward pass (``Layout.cnn_vjp``, a bool mask of where the maxima lie instead of autodiff's
  float one; measured faster on the CPU, where it is the default): whether it is on the GPU too.
- ``wave128``, ``wave384``: ``step128`` and ``step384`` with the LSTM's layers in one wavefront scan
  (``Layout.lstm_wavefront``: 21 sequential steps of both layers instead of 40 of one).
- ``towers384``: ``step384`` with a draw of candidates per 128 rows (``TrainConfig.rows_per_draw``,
  bilm-tf's 3 towers exactly): what the two extra draws' gathers and scatters cost.
- ``baseline128``, ``baseline384``: with ``--baseline DIR`` (the previous commit's tree, from
  ``git archive``), right after ``step128`` and ``step384``: the same step, under the same flag,
  with that tree's ``elmo_jax`` and this tree's benchmark code.
- ``saved128``, ``saved384``: the same steps as ``elmo-jax train --gpu-kernels saved`` runs them:
  autotuned, the choices written to a fresh per-fusion autotuning directory. ``saved_again128`` runs ``saved128`` once more in a fresh process that reads that
  directory. Each prints a digest of the state its steps ended with; ``summary.txt`` says whether
  ``saved128`` and ``saved_again128`` agreed bit for bit.
- ``cli``: ``elmo-jax train --config original --batch-size 384 --precision bfloat16 --gpu-kernels
  saved`` end to end, 300 steps on a synthetic Zipfian corpus in two shards of about 1.2 M words
  (each direction meets its second mid-run, parsed ahead in the loader process) with a
  793,471-word vocabulary (host pipeline, prefetch 2 by default), saving at steps 150 and 300:
  its start-up, tokens/s per log line from ``metrics.jsonl``, the ratio to ``saved384``, and the
  number of files in ``RUN/xla_autotune``. Then the resume check: two copies of the run
  directory without step 300, each resumed to 300 in a fresh process, one with the run's saved
  kernels and one with ``--gpu-kernels tuned`` (autotuned afresh: the control);
  each one's step-300 parameters against the uninterrupted run's, by sha256.
- ``extract``: ``bench_embed.py --job-only``, ``original``, bfloat16: a whole job of at least
  100,000 natural tokens (the experiments' held-out text where carried, else the first lines of
  the bundled sample's ``train.txt``), cold and twice warm, each pass split by phase (the token
  table, the host's share of the biLSTM calls, the waits for the device). Then the same job with
  ``layers="top"``, a third of the bytes to copy off the device and into the outputs: if it runs
  much faster, the job is bound by those bytes, not by the biLSTM's work (experiments/README.md,
  "The GPU calls, prepared", says why this is open). Each of the two, as the layout has it and
  with the outputs in shared 64 MiB blocks (``Layout.extract_block_mib``: one allocation, backed by
  2 MiB pages, instead of one a sentence, faulted in 4 KiB pages); each pass's line counts the
  process's minor page faults.
- ``autodiff128``: ``step128`` with the LSTM differentiated by autodiff of the scan (the
  layout's ``lstm_vjp=False``): what the hand-written backward pass gains, in one call.
- ``profile``: ``step128`` again with XLA's command buffers off (each kernel its own trace event),
  its steps then run once more under ``jax.profiler``: ``profile_parts.py``'s table of time per
  part of the step (char CNN, LSTM, dropout RNG, softmax, optimizer; forward and backward apart;
  idle) and the top ops.

A part starts only with at least its minimum time left of ``--budget`` seconds, and runs for at
most its own share or what is left; what is skipped or cut short is said in ``summary.txt``,
which ends with each variant step part against the default step of its rows (``comparisons``).
``--rehearse`` runs the same parts with tiny shapes (the ``tiny`` preset, 4 and 12 rows, V = 2,000,
a 256^3 roofline, a 3,000-token job; the step parts under the GPU layout) to check the script on a
CPU in about 5 minutes.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# name -> (seconds at most, seconds at least to start it)
BUDGETS = {
    "roofline": (50, 20),
    "step128": (75, 40),
    "step384": (85, 45),
    "saved128": (75, 40),
    "saved_again128": (60, 35),
    "saved384": (85, 45),
    "cli": (230, 100),
    "extract": (140, 50),
    "autodiff128": (75, 40),
    "profile": (70, 40),
    "axis2_128": (70, 35),
    "axis2_384": (75, 40),
    "cnnvjp128": (70, 35),
    "wave128": (70, 35),
    "wave384": (75, 40),
    "towers384": (75, 40),
    "baseline128": (70, 35),
    "baseline384": (75, 40),
}
FULL = {
    "shape": "original",
    "rows": (128, 384),
    "vocab": 793_471,
    "negatives": 8192,
    "steps": 10,
    "roofline_size": None,
    "cli_steps": 300,
    "cli_log": 50,
    "job_tokens": 100_000,
}
REHEARSAL = {
    "shape": "tiny",
    "rows": (4, 12),
    "vocab": 2000,
    "negatives": 64,
    "steps": 3,
    "roofline_size": 256,
    "cli_steps": 10,
    "cli_log": 5,
    "job_tokens": 3000,
}


def _settings(rehearse: bool) -> dict:
    return REHEARSAL if rehearse else FULL


# -- the parts, each run in its own process ------------------------------------------------------


def part_roofline(args, s: dict) -> None:
    from harness import roofline_report

    # A rehearsal on a CPU measures bfloat16 too, so that the step parts' MFU has both denominators.
    lines, rates = roofline_report(
        s["roofline_size"], repeats=3 if args.rehearse else 5, dtypes=("float32", "bfloat16") if args.rehearse else None
    )
    print("\n".join(lines), flush=True)
    with open(os.path.join(args.out, "roofline.json"), "w", encoding="utf-8") as f:
        json.dump({d: {"n": r.n, "tflops": r.tflops, "seconds": r.seconds} for d, r in rates.items()}, f)


def measured_rates(out: str) -> dict:
    """The roofline part's rates, as ``harness.MatmulRate``s (empty if it did not run)."""
    from harness import MatmulRate

    try:
        with open(os.path.join(out, "roofline.json"), encoding="utf-8") as f:
            raw = json.load(f)
    except OSError:
        return {}
    return {d: MatmulRate(d, r["n"], (8, 40), tuple(r["seconds"]), r["tflops"]) for d, r in raw.items()}


def kernel_flags(mode: str, autotune_dir: str | None) -> None:
    """XLA_FLAGS as ``elmo-jax train --gpu-kernels MODE`` sets them (before jax starts its backend),
    with ``autotune_dir`` as the run directory."""
    try:
        from elmo_jax._util.runtime import set_gpu_kernels
    except ImportError:  # a baseline tree from before --gpu-kernels: the XLA flag was its only mode
        from elmo_jax.cli.commands import deterministic_gpu_flags

        return deterministic_gpu_flags()
    print(set_gpu_kernels(mode, autotune_dir), flush=True)


def count_files(directory: str) -> int:
    return sum(len(files) for _, _, files in os.walk(directory))


def part_step(args, s: dict) -> None:
    kernel_flags(args.kernels, args.autotune_dir)
    import jax
    import numpy as np
    from bench_train import device_batches, distinct_words, model_and_config, time_step, train_flops, zipf_corpus
    from harness import mfu
    from jax.sharding import Mesh

    from elmo_jax import policy
    from elmo_jax._util.hlo import scatter_census
    from elmo_jax.config import TrainConfig
    from elmo_jax.model.compute import Compute
    from elmo_jax.model.layout import for_backend
    from elmo_jax.training.step import AXIS

    rows = args.rows
    ns = argparse.Namespace(
        shape=s["shape"],
        batch=rows,
        negatives=s["negatives"],
        steps=s["steps"],
        reset_state_prob=TrainConfig.reset_state_prob,
        rows_per_draw=args.rows_per_draw,
    )
    model, tc = model_and_config(ns, s["vocab"])
    mesh = Mesh(np.array(jax.local_devices()[:1]), (AXIS,))
    layout = for_backend("gpu" if args.rehearse else None)  # a rehearsal runs the GPU's program on the CPU
    if args.autodiff:  # the LSTM differentiated by autodiff of the scan, as before lstm._rows_scan_vjp
        layout = dataclasses.replace(layout, lstm_vjp=False)
    if args.row_sums:  # elmo_jax.model.gather: "scatter" is the GPU layout before the sorted row sums
        layout = dataclasses.replace(layout, row_sums=args.row_sums)
    if args.time_axis is not None:  # Layout.lstm_time_axis: where the LSTM's per-step arrays keep time
        layout = dataclasses.replace(layout, lstm_time_axis=args.time_axis)
    if args.cnn_vjp:  # Layout.cnn_vjp: the char CNN's max by its hand-written backward pass
        layout = dataclasses.replace(layout, cnn_vjp=True)
    if args.wavefront:  # Layout.lstm_wavefront: the LSTM's layers in one scan
        layout = dataclasses.replace(layout, lstm_wavefront=True)
    compute = Compute.from_policy("bfloat16", layout=layout)
    device = jax.devices()[0]
    tree = os.path.dirname(os.path.dirname(os.path.abspath(policy.__file__)))
    with tempfile.TemporaryDirectory() as tmp:
        vocab, path = zipf_corpus(tmp, 100_000, max(200_000, rows * 20 * (s["steps"] + 4)))
        batches, width, _ = device_batches(ns, model, tc, vocab, path, mesh)
        trace = os.path.join(tmp, "trace") if args.profile else None
        timing = time_step(model, tc, mesh, batches, compute=compute, trace_dir=trace, digest=args.digest)
        sec, compiled = timing.seconds, timing.compiled
        if trace:
            from profile_parts import profile_lines

            table = profile_lines(trace, timing, len(batches) - 1)
    flops = train_flops(model, tc, width)
    tflops = flops / sec / 1e12
    plan = compiled.memory_analysis()
    planned = (
        (plan.argument_size_in_bytes + plan.output_size_in_bytes - plan.alias_size_in_bytes + plan.temp_size_in_bytes)
        if plan is not None
        else float("nan")
    )
    stats = device.memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    tokens = rows * 20 / sec
    print(f"elmo_jax from {tree}; {device.device_kind}, jax {jax.__version__}", flush=True)
    print(
        f"step {s['shape']} bfloat16 {rows} rows x 20, V={s['vocab']:,}, {s['negatives']:,} negatives, "
        f"{distinct_words(batches)} distinct words a window, {width} rows encoded, {flops / 1e9:,.0f} GFLOP a step",
        flush=True,
    )
    print(
        f"step {rows} rows: {sec * 1e3:.2f} ms/step (median of {s['steps']}), {tokens:,.0f} tokens/s, "
        f"{tflops:,.2f} TFLOP/s ({mfu(tflops, 'bfloat16', device.device_kind, measured_rates(args.out))})",
        flush=True,
    )
    print(
        f"step {rows} rows memory: peak in use {peak / 2**20:,.0f} MiB (memory_stats), "
        if peak is not None
        else f"step {rows} rows memory: no memory_stats on {device.platform}, ",
        end="",
    )
    print(
        f"planned {planned / 2**20:,.0f} MiB (memory_analysis: arguments + outputs - aliased + temporaries)", flush=True
    )
    print(f"layout {layout}", flush=True)
    if getattr(tc, "rows_per_draw", 0):
        print(f"candidates: a draw per {tc.rows_per_draw} rows, {tc.draws_per_device} a step", flush=True)
    if args.digest:
        print(f"state after {s['steps'] + 1} steps: sha256 {timing.digest}", flush=True)
    if args.kernels == "saved":
        n = count_files(args.autotune_dir)
        print(f"{n} files in {args.autotune_dir} (XLA's per-fusion autotuning results)", flush=True)
    # Under the flag XLA rewrites each scatter it cannot show deterministic into sorts and scans,
    # or a loop over its updates: these counts say which it did (elmo_jax._util.hlo.scatter_census).
    hlo = compiled.as_text()
    census = scatter_census(hlo)
    if args.hlo:  # the optimized module, to read on a CPU which kernels the profile's unnamed fusions are
        import gzip

        with gzip.open(os.path.join(args.out, f"step{rows}_hlo.txt.gz"), "wt", encoding="utf-8") as f:
            f.write(hlo)
    print(
        f"step {rows} rows compiled ops (XLA_FLAGS {os.environ.get('XLA_FLAGS', '')!r}): "
        + ", ".join(f"{k} {v}" for k, v in census.items()),
        flush=True,
    )
    if args.profile:  # another program (XLA's command buffers off): its figures are not the step's
        print(f"the same steps run again under the profiler: {timing.traced_seconds * 1e3:.2f} ms a step", flush=True)
        print("\n".join(table), flush=True)
        return
    with open(os.path.join(args.out, f"step{rows}.json"), "w", encoding="utf-8") as f:
        json.dump({"rows": rows, "ms": sec * 1e3, "tokens_per_s": tokens, "tflops": tflops}, f)


def _train(cmd: list[str], tmp: str, env: dict) -> tuple[int, float, str]:
    """Runs one ``elmo-jax train`` command; its exit code, wall seconds and start line."""
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t
    log = r.stdout + r.stderr
    start = [line for line in log.splitlines() if line.startswith(("starting", "resuming", "GPU kernels"))]
    return r.returncode, wall, "; ".join(start).replace(tmp, "TMP") if start else log[-1500:]


def params_digest(run_dir: str, step: int) -> str:
    """sha256 of a checkpoint's parameters, restored (file bytes may differ where values do not)."""
    import hashlib

    import jax
    import numpy as np

    from elmo_jax.training.run_dir import load_run

    params = load_run(run_dir, step)[2]
    h = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(params):
        h.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    return h.hexdigest()[:16]


def part_cli(args, s: dict) -> None:
    from bench_train import zipf_corpus

    # This process reads checkpoints on the CPU: on the GPU its jax would hold the memory the
    # resumed runs need.
    env = dict(os.environ)
    os.environ["JAX_PLATFORMS"] = "cpu"
    rows, steps = s["rows"][1], s["cli_steps"]
    with tempfile.TemporaryDirectory() as tmp:
        vocab, text = zipf_corpus(tmp, 100_000, rows * 20 * (steps + 20))
        # Two shards, as a real corpus has many: each direction meets a new one mid-run, which
        # `elmo-jax train` parses ahead in its loader process (over a million words a shard).
        with open(text, encoding="utf-8") as f:
            lines = f.readlines()
        for k in range(2):
            with open(os.path.join(tmp, f"shard{k}.txt"), "w", encoding="utf-8") as f:
                f.writelines(lines[k::2])
        corpus = os.path.join(tmp, "shard*.txt")
        print(f"corpus: 2 shards of {sum(len(line.split()) for line in lines[::2]):,} words or so", flush=True)
        words = vocab.words[: s["vocab"]]
        words += [f"filler{i}" for i in range(s["vocab"] - len(words))]  # the released models' V
        vocab_path = os.path.join(tmp, "vocab.txt")
        with open(vocab_path, "w", encoding="utf-8") as f:
            f.write("\n".join(words) + "\n")

        def train(run_dir: str, *extra: str) -> list[str]:
            return [
                sys.executable, "-m", "elmo_jax", "--compile-cache", os.path.join(tmp, "xla"), "train",
                "--config", s["shape"], "--batch-size", str(rows), "--precision", "bfloat16",
                "--train-files", corpus, "--vocab", vocab_path, "--run-dir", run_dir, "--steps", str(steps),
                "--log-every", str(s["cli_log"]), "--save-every", str(steps // 2), "--keep", "2", "--no-progress",
                *extra,
            ]  # fmt: skip

        run_dir = os.path.join(tmp, "run")
        cmd = train(run_dir, "--gpu-kernels", "saved", *args.cli_flags)
        print("$ elmo-jax " + " ".join(cmd[3:]).replace(tmp, "TMP"), flush=True)
        code, wall, start = _train(cmd, tmp, env)
        print(f"exit {code} after {wall:.0f} s; {start}", flush=True)
        try:
            with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
                lines = [json.loads(line) for line in f]
        except OSError:
            print("no metrics.jsonl", flush=True)
            return
        for m in lines:
            print(
                f"  step {m['step']}: {m['tokens_per_s']:,.0f} tokens/s"
                + (f", startup {m['startup_s']:.1f} s" if "startup_s" in m else ""),
                flush=True,
            )
        later = [m["tokens_per_s"] for m in lines[1:]] or [m["tokens_per_s"] for m in lines]
        rate = statistics.median(later)
        line = f"cli {rows} rows: median {rate:,.0f} tokens/s over the log lines after the first"
        for part, path in ((f"saved{rows}", f"saved/step{rows}.json"), (f"step{rows}", f"step{rows}.json")):
            try:
                with open(os.path.join(args.out, path), encoding="utf-8") as f:
                    step = json.load(f)
                line += f", {100 * rate / step['tokens_per_s']:.0f}% of the {part} part's {step['tokens_per_s']:,.0f}"
            except OSError:
                pass
        print(line, flush=True)
        print(f"{count_files(os.path.join(run_dir, 'xla_autotune'))} files in RUN/xla_autotune", flush=True)
        # The resume check: copies of the run without its last checkpoint, each resumed to the end.
        digests = {"uninterrupted": params_digest(run_dir, steps)}
        for name, extra in (
            ("resumed, the run's saved kernels", ("--gpu-kernels", "saved")),
            ("resumed, --gpu-kernels tuned", ("--gpu-kernels", "tuned")),
        ):
            copy = os.path.join(tmp, f"copy{len(digests)}")
            shutil.copytree(run_dir, copy)
            shutil.rmtree(os.path.join(copy, "checkpoints", str(steps)))
            for host in glob.glob(os.path.join(copy, "host_state", f"{steps}.p*")):
                os.remove(host)
            code, wall, start = _train(train(copy, *args.cli_flags, *extra), tmp, env)
            print(f"{name}: exit {code} after {wall:.0f} s; {start}", flush=True)
            digests[name] = params_digest(copy, steps) if code == 0 else "failed"
        first = digests["uninterrupted"]
        for name, digest in digests.items():
            verdict = "" if name == "uninterrupted" else (": the same" if digest == first else ": DIFFERENT")
            print(f"step {steps} parameters, {name}: sha256 {digest}{verdict}", flush=True)


# -- the driver --------------------------------------------------------------------------------


def budget_key(part: str) -> str:
    """The ``BUDGETS`` entry of a part: a rehearsal's rows rename the step parts (``step4``)."""
    m = re.fullmatch(r"(step|saved_again|saved|baseline|axis2_|cnnvjp|wave|towers|autodiff)(\d+)", part)
    if m is None:
        return part
    return m.group(1) + ("128" if int(m.group(2)) in (FULL["rows"][0], REHEARSAL["rows"][0]) else "384")


def job_file(directory: str, tokens: int) -> tuple[str, int]:
    """A natural-text job of at least ``tokens`` tokens: the experiments' held-out text where it
    is carried and long enough, else the first lines of the bundled sample's train.txt."""
    heldout = os.path.join(ROOT, "experiments", "data", "lm", "heldout.txt")
    sources = [heldout, os.path.join(ROOT, "elmo_jax", "data", "sample", "train.txt")]
    path = os.path.join(directory, "job.txt")
    for source in sources:
        if not os.path.exists(source):
            continue
        n, keep = 0, []
        with open(source, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    keep.append(line)
                    n += len(line.split())
                if n >= tokens and source != heldout:
                    break
        if n >= tokens:
            with open(path, "w", encoding="utf-8") as f:
                f.writelines(keep)
            return path, n
    raise SystemExit(f"no natural text of {tokens:,} tokens found")


def run_part(name: str, cmd: list[str], out: str, seconds: float, env: dict | None = None) -> str:
    """Runs ``cmd`` into ``OUT/<name>.txt`` for at most ``seconds``; its outcome, in words."""
    path = os.path.join(out, f"{name}.txt")
    t = time.perf_counter()
    with open(path, "w", encoding="utf-8") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=seconds)
            outcome = f"exit {code}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the part and anything it started
            proc.wait()
            outcome = f"cut short at its {seconds:.0f} s limit (the lines above were measured)"
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"[{name}: {outcome}, {time.perf_counter() - t:.0f} s]\n")
    with open(path, encoding="utf-8") as f:
        print(f.read(), end="", flush=True)
    return f"{outcome}, {time.perf_counter() - t:.0f} s"


def _last_match(out: str, part: str, pattern: str) -> str | None:
    """The first group of ``pattern``'s last match in ``OUT/<part>.txt`` (None: no file or match)."""
    path = os.path.join(out, f"{part}.txt")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        found = re.findall(pattern, f.read())
    return found[-1] if found else None


# The step parts that change one thing against step<rows> (same flag, same call), and what.
VARIANTS = {
    "axis2_": "Layout.lstm_time_axis 2",
    "cnnvjp": "Layout.cnn_vjp",
    "wave": "Layout.lstm_wavefront",
    "towers": "a candidate draw per third of the rows, bilm-tf's towers",
    "autodiff": "the LSTM by autodiff",
    "baseline": "the previous commit",
}


def comparisons(out: str, rows: tuple[int, ...]) -> list[str]:
    """Each variant step part against ``step<rows>`` of the same call: ms a step and the change,
    the line a session reads to decide whether a switch becomes the GPU's default."""
    lines = []
    for r in rows:
        base = _last_match(out, f"step{r}", rf"step {r} rows: ([\d.]+) ms/step")
        for prefix, what in VARIANTS.items():
            ms = _last_match(out, f"{prefix}{r}", rf"step {r} rows: ([\d.]+) ms/step")
            if ms is None:
                continue
            if base is None:
                lines.append(f"{prefix}{r} ({what}): {float(ms):.2f} ms a step; step{r} did not run")
                continue
            change = 100 * (float(base) - float(ms)) / float(base)
            lines.append(
                f"{prefix}{r} ({what}): {float(ms):.2f} ms a step against step{r}'s {float(base):.2f}: "
                f"{abs(change):.1f} % {'faster' if change > 0 else 'slower'}"
            )
    return lines


def determinism(out: str, rows: int) -> list[str]:
    """Whether ``saved{rows}`` and ``saved_again{rows}``, each in a fresh process, the second
    reading the first's autotuning directory, ended with the same state (``part_step``'s
    ``sha256`` line)."""

    def digest(part: str) -> str | None:
        return _last_match(out, part, r"sha256 (\w+)")

    first, second = f"saved{rows}", f"saved_again{rows}"
    a, b = digest(first), digest(second)
    verdict = "not both run" if a is None or b is None else ("the same" if a == b else "DIFFERENT")
    return [
        f"determinism with saved kernels (the second start read the first's): {first} {a} and {second} {b}: {verdict}"
    ]


def drive(args) -> None:
    # Asked of the driver without starting jax's backend, which on a GPU would take the card's
    # memory away from the parts' processes.
    if not args.rehearse and shutil.which("nvidia-smi") is None and not os.path.exists("/dev/nvidia0"):
        sys.exit("gpu_measure.py: no NVIDIA GPU here (no nvidia-smi, no /dev/nvidia0); --rehearse runs the same "
                 "parts with tiny shapes on a CPU")  # fmt: skip
    s = _settings(args.rehearse)
    os.makedirs(args.out, exist_ok=True)
    me = [sys.executable, os.path.abspath(__file__), "--out", args.out] + (["--rehearse"] if args.rehearse else [])
    work = tempfile.mkdtemp(prefix="gpu_measure_")
    job, job_tokens = job_file(work, s["job_tokens"])
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    r0, r1 = s["rows"]
    tuned = {r: os.path.join(work, f"tuned{r}") for r in s["rows"]}  # each a run directory's stand-in

    def step(rows: int, *extra: str) -> list[str]:
        return me + ["--part", "step", "--rows", str(rows), *extra]

    def saved(rows: int, tag: str) -> list[str]:
        digest = ["--digest"] if rows == r0 else []
        return step(rows, "--kernels", "saved", "--autotune-dir", tuned[rows], "--tag", tag, *digest)

    # The previous commit's elmo_jax under this tree's benchmark code (the script's folder comes
    # first on sys.path, PYTHONPATH next), right after this tree's same step, under the same flag.
    base_env = dict(env, PYTHONPATH=os.path.abspath(args.baseline)) if args.baseline else None

    def baseline(rows: int) -> list:
        return [(f"baseline{rows}", step(rows, "--tag", "baseline"), base_env)] if args.baseline else []

    # --digest only where `determinism` compares it: it copies the whole state to the host.
    parts: list[tuple[str, list[str], dict]] = [
        ("roofline", me + ["--part", "roofline"], env),
        # Under XLA's deterministic-ops flag (--gpu-kernels fixed, the default before saved), then
        # as `elmo-jax train` runs it now: autotuned, the choices saved, and read by a second start.
        (f"step{r0}", step(r0), env),
        # The same step with the LSTM's per-step arrays [2, B, T, ...] (Layout.lstm_time_axis 2).
        (f"axis2_{r0}", step(r0, "--time-axis", "2", "--tag", "axis2"), env),
        (f"cnnvjp{r0}", step(r0, "--cnn-vjp", "--tag", "cnnvjp"), env),
        (f"wave{r0}", step(r0, "--wavefront", "--tag", "wave"), env),
        *baseline(r0),
        (f"saved{r0}", saved(r0, "saved"), env),
        (f"saved_again{r0}", saved(r0, "saved_again"), env),
        (f"saved{r1}", saved(r1, "saved"), env),
        ("cli", me + ["--part", "cli", *(f"--cli-flag={x}" for x in args.cli_flags)], env),
        # The flag's cost at 384 rows, and the other LSTM time axis there: after the default's
        # figures, where a short budget skips them first.
        (f"step{r1}", step(r1), env),
        (f"wave{r1}", step(r1, "--wavefront", "--tag", "wave"), env),
        (f"towers{r1}", step(r1, "--rows-per-draw", str(r1 // 3), "--tag", "towers"), env),
        *baseline(r1),
        (
            "extract",
            [sys.executable, os.path.join(HERE, "bench_embed.py"), "--shapes", s["shape"], "--job-only"]
            + ["--job-file", job, "--job-precisions", "bfloat16", "--job-repeats", "2", "--job-layers", "all", "top"]
            + ["--job-blocks", "0", "64"],
            env,
        ),
        (f"axis2_{r1}", step(r1, "--time-axis", "2", "--tag", "axis2"), env),
        (f"autodiff{r0}", step(r0, "--autodiff", "--tag", "autodiff"), env),
    ]
    # The profile: with XLA's command buffers off, so that each kernel is its own trace event.
    no_graphs = dict(env, XLA_FLAGS=f"{env.get('XLA_FLAGS', '')} --xla_gpu_enable_command_buffer=".strip())
    parts.append(("profile", step(r0, "--profile"), no_graphs))
    start = time.perf_counter()
    summary = [
        f"gpu_measure.py{' --rehearse' if args.rehearse else ''}: budget {args.budget:.0f} s; "
        f"job {os.path.basename(job)}: {job_tokens:,} tokens"
    ]
    for name, cmd, part_env in parts:
        most, least = BUDGETS[budget_key(name)]
        if args.rehearse:
            most, least = most * 2, 1  # a CPU compiles and runs slower; never skip in a rehearsal
        left = args.budget - (time.perf_counter() - start)
        if left < least:
            summary.append(f"{name}: skipped, {max(left, 0):.0f} s left of the budget and it needs about {least} s")
            print(summary[-1], flush=True)
            continue
        summary.append(f"{name}: " + run_part(name, cmd, args.out, min(most, left), part_env))
    summary.extend(determinism(args.out, r0))
    summary.extend(comparisons(args.out, s["rows"]))
    summary.append(f"total {time.perf_counter() - start:.0f} s")
    with open(os.path.join(args.out, "summary.txt"), "w", encoding="utf-8") as f:
        f.write("\n".join(summary) + "\n")
    print("\n".join(summary), flush=True)


def main() -> None:
    try:  # jax imported, its backend not started: XLA_FLAGS still apply
        from elmo_jax.model.gather import SUMS
    except ImportError:  # a baseline tree from before the sorted row sums
        SUMS = None

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu_measure"), help="where the text files go")
    ap.add_argument("--rehearse", action="store_true", help="tiny shapes, for a CPU")
    ap.add_argument("--budget", type=float, default=465.0, help="seconds for all parts together")
    ap.add_argument("--baseline", help="the previous commit's tree: its train step is measured too")
    ap.add_argument(
        "--cli-flag",
        dest="cli_flags",
        action="append",
        default=[],
        help="an extra `elmo-jax train` flag for the cli part (repeatable, e.g. --cli-flag=--prefetch=0)",
    )
    ap.add_argument("--part", choices=["roofline", "step", "cli"], help=argparse.SUPPRESS)
    ap.add_argument("--rows", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--tag", default="", help=argparse.SUPPRESS)
    ap.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--autodiff", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--kernels", choices=("saved", "fixed", "tuned"), default="fixed", help=argparse.SUPPRESS)
    ap.add_argument("--autotune-dir", help=argparse.SUPPRESS)
    ap.add_argument("--hlo", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--row-sums", choices=SUMS, help=argparse.SUPPRESS)
    ap.add_argument("--digest", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--time-axis", type=int, choices=(0, 2), help=argparse.SUPPRESS)
    ap.add_argument("--cnn-vjp", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--wavefront", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rows-per-draw", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.part is None:
        return drive(args)
    s = _settings(args.rehearse)
    os.makedirs(args.out, exist_ok=True)
    if args.tag:  # the baseline's step files beside, not over, this tree's
        args.out = os.path.join(args.out, args.tag)
        os.makedirs(args.out, exist_ok=True)
        for name in ("roofline.json",):
            src = os.path.join(os.path.dirname(args.out), name)
            if os.path.exists(src) and not os.path.exists(os.path.join(args.out, name)):
                with open(src, encoding="utf-8") as f, open(os.path.join(args.out, name), "w", encoding="utf-8") as g:
                    g.write(f.read())
    {"roofline": part_roofline, "step": part_step, "cli": part_cli}[args.part](args, s)


if __name__ == "__main__":
    main()
