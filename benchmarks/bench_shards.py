"""Throughput of `elmo-jax embed` in one process vs N concurrent shard processes (`--num-shards N`).

    python benchmarks/bench_shards.py                      # the sample's heldout.txt, bundled model, N = 2
    python benchmarks/bench_shards.py --file train --lines 5000 --shards 4

Each process is timed from start to exit, so its imports, model load and compiles are included
(the persistent compile cache is off, so each process compiles alike). Per process it prints
sentences/s and tokens/s over the lines that process embedded; for the sharded run also the
whole run's rate (all lines over the slowest process). Shard processes share the machine's cores:
on a machine with other jobs running the numbers move from run to run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

from elmo_jax.cli.commands import bundled_model, bundled_sample


def run(commands: list[list[str]], log_dir: str) -> list[float]:
    """Starts every command at once; the wall seconds of each, start to exit."""
    logs = [open(os.path.join(log_dir, f"log{i}.txt"), "w+") for i in range(len(commands))]
    start = time.perf_counter()
    procs = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=log) for c, log in zip(commands, logs)]
    seconds: list[float | None] = [None] * len(procs)
    while None in seconds:
        for i, p in enumerate(procs):
            if seconds[i] is None and p.poll() is not None:
                seconds[i] = time.perf_counter() - start
        time.sleep(0.05)
    for p, log in zip(procs, logs):
        log.seek(0)
        if p.returncode:
            sys.exit(f"failed: {' '.join(p.args)}\n{log.read()}")
        log.close()
    return seconds  # type: ignore[return-value]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--file", choices=["heldout", "train"], default="heldout", help="which file of the bundled sample")
    ap.add_argument("--lines", type=int, help="only the first N lines (default: all)")
    ap.add_argument("--shards", type=int, default=2)
    args = ap.parse_args()
    train, heldout = bundled_sample()
    with open(heldout if args.file == "heldout" else train, encoding="utf-8") as f:
        lines = f.read().splitlines()[: args.lines]
    options, weights = bundled_model()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "in.txt")
        with open(path, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")

        def command(output: str, *extra: str) -> list[str]:
            return [
                sys.executable,
                "-m",
                "elmo_jax",
                "--compile-cache",
                "none",
                "embed",
                "--options",
                options,
                "--weights",
                weights,
                "--input",
                path,
                "--output",
                os.path.join(d, output),
                "--no-progress",
                "--layers",
                "top",
                *extra,
            ]

        n = args.shards
        print(
            f"{len(lines)} lines, {sum(len(l.split()) for l in lines)} tokens of the sample's {args.file}.txt, "
            f"bundled model; {os.cpu_count()} CPUs"
        )
        for label, commands in (
            ("1 process", [command("one.hdf5")]),
            (
                f"{n} shard processes",
                [command("s.hdf5", "--num-shards", str(n), "--shard-index", str(i)) for i in range(n)],
            ),
        ):
            seconds = run(commands, d)
            k = len(commands)
            for i, s in enumerate(seconds):
                mine = lines[i::k]
                print(
                    f"  {label}, process {i}: {len(mine)} lines in {s:.1f} s: {len(mine) / s:,.0f} sentences/s, "
                    f"{sum(len(l.split()) for l in mine) / s:,.0f} tokens/s"
                )
            if k > 1:
                print(
                    f"  {label}, whole run: {len(lines) / max(seconds):,.0f} sentences/s, "
                    f"{sum(len(l.split()) for l in lines) / max(seconds):,.0f} tokens/s"
                )


if __name__ == "__main__":
    main()
