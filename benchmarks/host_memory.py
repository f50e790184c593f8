"""Host memory of a long `elmo-jax train` run: whether its resident set levels off or keeps growing.

    python benchmarks/host_memory.py [--epochs 25] [--every 10] [--out FILE] [-- TRAIN FLAGS...]
    python benchmarks/host_memory.py --summarise FILE    # the summary of a report written before

A run that grows a little every step is ended by the kernel's out-of-memory killer days into a
pretraining run, long after any test has finished. This runs `elmo-jax train` on the bundled sample
(the `tiny` preset, a checkpoint every 200 steps, held-out perplexity every 100: every host path of
a real run) as its own process, reads its resident set (VmRSS) every ``--every`` seconds, and
prints it by step, then each quarter of the run's median and largest reading. Flags after ``--`` go to
`elmo-jax train` (they override the defaults above; ``--steps`` there stops the run instead of ``--epochs``).
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
        with open(metrics, "rb") as f:  # its last line only: the file grows with the run
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            lines = f.read().splitlines()
        return json.loads(lines[-1])["step"] if lines else None
    except (OSError, ValueError, KeyError):
        return None


def summary(readings: list[tuple[float, int, float]]) -> list[str]:
    """Per quarter of the run, the median and the largest reading: single readings swing by tens
    of MiB with the allocator's state, so a growth shows in the medians, not in two readings."""
    quarter = len(readings) // 4
    lines = []
    for q in range(4):
        part = readings[q * quarter : (q + 1) * quarter]
        rss = sorted(m for _, _, m in part)
        lines.append(
            f"# quarter {q + 1}: steps {part[0][1]}-{part[-1][1]}: median {rss[len(rss) // 2]:.0f} MiB, "
            f"largest {rss[-1]:.0f} MiB"
        )
    return lines


def read_report(path: str) -> list[tuple[float, int, float]]:
    with open(path) as f:
        rows = [line.split() for line in f if line.strip() and not line.startswith("#")]
    return [(float(t), int(s), float(m)) for t, s, m in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=float, default=25)
    parser.add_argument("--every", type=float, default=10.0, help="seconds between readings")
    parser.add_argument("--out", help="also write the report here")
    parser.add_argument("--summarise", metavar="REPORT", help="only print the summary of a report written before")
    args, extra = parser.parse_known_args()
    if args.summarise:
        print("\n".join(summary(read_report(args.summarise))))
        return
    extra = [a for a in extra if a != "--"]
    # --steps after -- stops the run in place of --epochs (train takes one of the two).
    stop = [] if any(a == "--steps" or a.startswith("--steps=") for a in extra) else ["--epochs", str(args.epochs)]
    run_dir = tempfile.mkdtemp(prefix="host_memory_")
    cmd = [
        sys.executable, "-m", "elmo_jax", "train", "--run-dir", os.path.join(run_dir, "run"),
        *stop, "--no-progress", "--save-every", "200", "--eval-every", "100", "--log-every", "50", *extra,
    ]  # fmt: skip
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    readings: list[tuple[float, int, float]] = []  # seconds, step, MiB
    while proc.poll() is None:
        mib, step = rss_mib(proc.pid), last_step(os.path.join(run_dir, "run", "metrics.jsonl"))
        if mib is not None and step is not None:
            readings.append((time.monotonic() - start, step, mib))
        time.sleep(args.every)
    if proc.returncode != 0:
        sys.exit(f"elmo-jax train ended with {proc.returncode}: {proc.stderr.read()[-2000:]}")
    if len(readings) < 8:  # a quarter's median needs two readings at least
        sys.exit(
            f"the run ended after {len(readings)} readings, too few to show a trend: give more --epochs or less --every"
        )
    report = [f"# {' '.join(cmd[2:])}", "# seconds  step  VmRSS MiB"]
    report += [f"{t:8.0f} {s:6d} {m:9.1f}" for t, s, m in readings]
    report += summary(readings)
    text = "\n".join(report)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
