"""Host memory of a long `elmo-jax train` run: whether its resident set levels off or keeps growing.

    python benchmarks/host_memory.py [--epochs 25] [--every 10] [--out FILE] [-- TRAIN FLAGS...]

A run that grows a little every step is ended by the kernel's out-of-memory killer days into a
pretraining run, long after any test has finished. This runs `elmo-jax train` on the bundled sample
(the `tiny` preset, a checkpoint every 200 steps, held-out perplexity every 100: every host path of
a real run) as its own process, reads its resident set (VmRSS) every ``--every`` seconds, and
prints it by step, with the growth over each quarter of the run. Flags after ``--`` go to
`elmo-jax train` (they override the defaults above).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def last_step(metrics: str) -> int | None:
    try:
        with open(metrics, "rb") as f:
            lines = f.read().splitlines()
        return json.loads(lines[-1])["step"] if lines else None
    except (OSError, ValueError, KeyError):
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=float, default=25)
    parser.add_argument("--every", type=float, default=10.0, help="seconds between readings")
    parser.add_argument("--out", help="also write the report here")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    run_dir = tempfile.mkdtemp(prefix="host_memory_")
    cmd = [
        sys.executable, "-m", "elmo_jax", "train", "--run-dir", os.path.join(run_dir, "run"),
        "--epochs", str(args.epochs), "--no-progress", "--save-every", "200", "--eval-every", "100",
        "--log-every", "50", *extra,
    ]  # fmt: skip
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    readings: list[tuple[float, int, float]] = []  # seconds, step, MiB
    while proc.poll() is None:
        mib, step = rss_mib(proc.pid), last_step(os.path.join(run_dir, "run", "metrics.jsonl"))
        if mib is not None and step is not None:
            readings.append((time.monotonic() - start, step, mib))
        time.sleep(args.every)
    if proc.returncode != 0 or len(readings) < 8:
        sys.exit(
            f"elmo-jax train ended with {proc.returncode} after {len(readings)} readings: {proc.stderr.read()[-2000:]}"
        )
    report = [f"# {' '.join(cmd[2:])}", "# seconds  step  VmRSS MiB"]
    report += [f"{t:8.0f} {s:6d} {m:9.1f}" for t, s, m in readings]
    quarter = len(readings) // 4
    for q in range(4):
        part = readings[q * quarter : (q + 1) * quarter + 1]
        (_, s0, m0), (_, s1, m1) = part[0], part[-1]
        per_k = (m1 - m0) / max(s1 - s0, 1) * 1000
        report.append(f"# quarter {q + 1}: steps {s0}-{s1}, {m0:.0f} -> {m1:.0f} MiB ({per_k:+.1f} MiB per 1000 steps)")
    peak = max(m for _, _, m in readings)
    report.append(f"# peak {peak:.0f} MiB at step {max(readings, key=lambda r: r[2])[1]}; {readings[-1][1]} steps")
    text = "\n".join(report)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
