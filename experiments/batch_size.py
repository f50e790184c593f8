"""Held-out quality of a larger global batch at the same number of training tokens (issue 30).

bilm-tf trained on 3 GPUs x 128 rows with the gradients averaged, a global batch of 384 rows; one
device running 384 rows is that recipe. This runs ``elmo-jax train`` once per arm, each arm a
global batch and a step count with the same rows x steps, scores the held-out text (full softmax,
both directions) at the same token counts, and writes a table:

    python experiments/batch_size.py --arms 64x1200 192x400 --evals 4 \
        --out experiments/results/batch_size                 # the CPU run of experiments/README.md
    python experiments/batch_size.py --arms 128x3000 384x1000 --evals 4 --precision bfloat16 \
        --out "$OUT"                                         # issue 30's GPU run

An arm is ``ROWSxSTEPS`` (one device) or ``ROWSxSTEPS@D`` (``D`` devices of ``ROWS / D`` rows:
bilm-tf's towers, each drawing its own sampled candidates). Everything else is the config's
recipe (``--config``, default the experiments' ``experiments/data/lm/options.json``): the same
seed, learning rate and data order. Needs ``experiments/data/lm`` (``prep_corpus.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LM = os.path.join(ROOT, "experiments", "data", "lm")


def parse_arm(text: str) -> tuple[int, int, int]:
    """``"192x400"`` -> (192 rows, 400 steps, 1 device); ``"192x400@2"`` -> 2 devices of 96 rows."""
    try:
        shape, _, devices = text.partition("@")
        rows, steps = (int(x) for x in shape.split("x"))
        d = int(devices or 1)
    except ValueError:
        raise SystemExit(f"--arms: {text!r} is not ROWSxSTEPS or ROWSxSTEPS@DEVICES (e.g. 192x400)") from None
    if rows % d:
        raise SystemExit(f"--arms: {text!r}: {rows} rows do not split over {d} devices")
    return rows, steps, d


def arm_name(rows: int, steps: int, devices: int) -> str:
    return f"{rows}x{steps}" + (f"@{devices}" if devices > 1 else "")


def run_arm(args, rows: int, steps: int, devices: int, evals: int) -> str:
    """Trains one arm into ``OUT/<arm>/`` (resumed if it was cut short) and returns that dir."""
    name = arm_name(rows, steps, devices)
    run = os.path.join(args.runs or args.out, name)
    every = steps // evals
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    if devices > 1:  # a CPU lends itself as several devices only if asked before jax starts
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    cmd = [
        sys.executable, "-m", "elmo_jax", "train",
        "--config", args.config,
        "--train-files", os.path.join(LM, "train", "*.txt"),
        "--heldout-files", os.path.join(LM, "heldout.txt"),
        "--vocab", os.path.join(LM, "vocab.txt"),
        "--run-dir", run,
        "--batch-size", str(rows // devices),
        "--devices", str(devices),
        "--steps", str(steps),
        "--eval-every", str(every),
        "--log-every", str(every),
        "--save-every", str(steps),
        "--keep", "1",
        "--no-progress",
    ]  # fmt: skip
    if args.precision:
        cmd += ["--precision", args.precision]
    if args.learning_rate:
        cmd += ["--learning-rate", str(args.learning_rate)]
    print(f"$ {' '.join(cmd[1:])}", flush=True)
    t = time.perf_counter()
    with open(os.path.join(args.out, f"{name}.log"), "a", encoding="utf-8") as log:
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode
    print(f"{name}: exit {code} after {time.perf_counter() - t:.0f} s", flush=True)
    return run


def table(runs: dict[str, str], tokens_per_step: dict[str, int]) -> list[str]:
    """The held-out perplexities of every arm at each token count, as markdown lines."""
    rows: dict[int, dict[str, dict]] = {}
    for name, run in runs.items():
        try:
            with open(os.path.join(run, "metrics.jsonl"), encoding="utf-8") as f:
                records = [json.loads(line) for line in f]
        except OSError:
            continue
        for m in records:
            if "heldout_perplexity" in m:
                rows.setdefault(m["step"] * tokens_per_step[name], {})[name] = m
    names = list(runs)
    lines = [
        "| training tokens | "
        + " | ".join(f"{n}: held-out fwd / bwd / **combined**, train loss" for n in names)
        + " |",
        "|---:|" + "---:|" * len(names),
    ]
    for tokens in sorted(rows):
        cells = []
        for n in names:
            m = rows[tokens].get(n)
            cells.append(
                f"{m['heldout_perplexity_fwd']:.1f} / {m['heldout_perplexity_bwd']:.1f} / "
                f"**{m['heldout_perplexity']:.1f}**, {m['loss']:.3f} (step {m['step']:,})"
                if m
                else ""
            )
        lines.append(f"| {tokens:,} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arms", nargs="+", default=["64x1200", "192x400"], help="ROWSxSTEPS[@DEVICES] each")
    ap.add_argument("--evals", type=int, default=4, help="held-out evaluations per arm, at the same token counts")
    ap.add_argument("--config", default=os.path.join(LM, "options.json"))
    ap.add_argument("--precision", help="--precision for elmo-jax train (default: the backend's)")
    ap.add_argument("--learning-rate", type=float, help="for every arm (default: the config's)")
    ap.add_argument("--out", default=os.path.join(ROOT, "experiments", "results", "batch_size"))
    ap.add_argument(
        "--runs", help="where the run dirs go (default: --out); each arm's metrics.jsonl is copied to --out"
    )
    ap.add_argument("--table-only", action="store_true", help="only write the table of runs already in --out")
    args = ap.parse_args()
    arms = [parse_arm(a) for a in args.arms]
    tokens = {rows * steps for rows, steps, _ in arms}
    if len(tokens) > 1:
        raise SystemExit(f"--arms: every arm must train on the same tokens (rows x steps); got {sorted(tokens)}")
    if not os.path.exists(os.path.join(LM, "vocab.txt")):
        raise SystemExit(f"{LM}: no prepared corpus; run experiments/fetch_data.sh and experiments/prep_corpus.py")
    os.makedirs(args.out, exist_ok=True)
    unroll = 20  # a preset's, and bilm-tf's default
    if os.path.exists(args.config):
        with open(args.config, encoding="utf-8") as f:
            unroll = json.load(f).get("unroll_steps", unroll)
    runs, per_step = {}, {}
    for rows, steps, devices in arms:
        if steps % args.evals:
            raise SystemExit(f"--arms: {steps} steps do not split into {args.evals} evaluations")
        name = arm_name(rows, steps, devices)
        runs[name] = (
            os.path.join(args.runs or args.out, name)
            if args.table_only
            else run_arm(args, rows, steps, devices, args.evals)
        )
        kept = os.path.join(runs[name], "metrics.jsonl")
        if args.runs and os.path.exists(kept):
            shutil.copy(kept, os.path.join(args.out, f"{name}.metrics.jsonl"))
        per_step[name] = rows * unroll
    lines = table(runs, per_step)
    with open(os.path.join(args.out, "table.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
