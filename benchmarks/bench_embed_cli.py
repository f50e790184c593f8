"""`elmo-jax embed` end to end: wall time of the command on a whole file, per ``--ahead`` value.

    python benchmarks/bench_embed_cli.py [--shape small] [--input FILE] [--ahead 0 1] [--rounds 3]

A model of ``--shape`` with random weights (speed does not depend on them) is written to a
temporary bilm-tf hdf5, then the command runs in a fresh process per (round, ``--ahead``), the
values alternating, each writing every line's layers to its own hdf5 (bilm-tf's dump format):
startup, weights, compiles (the persistent compile cache is off, so each run compiles what it
needs), the device's work and the writes, all included. ``--ahead 0`` embeds a window, then
writes it; ``--ahead 1`` hands the writes to a background thread and goes on with the next window.
Prints seconds and tokens/s of each run, and the medians; first, the host's writes alone: the
same datasets (the shape's every layer for each line) written by h5py, no model involved.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def write_only(path: str, shape: str, out: str, tokens: int) -> None:
    """Times writing one float32 ``[n_layers + 1, n_tokens, 2P]`` dataset per line of ``path``."""
    import h5py
    import numpy as np

    from elmo_jax import preset

    config = preset(shape)
    layers, width = config.n_output_layers, 2 * config.lstm.projection_dim
    with open(path, encoding="utf-8") as f:
        lengths = [len(line.split()) for line in f]
    arrays = {n: np.ones((layers, n, width), np.float32) for n in set(lengths)}  # made before the clock
    t = time.perf_counter()
    with h5py.File(out, "w") as f:
        for i, n in enumerate(lengths):
            f.create_dataset(str(i), data=arrays[n])
    sec = time.perf_counter() - t
    print(
        f"the writes alone: {len(lengths):,} datasets, {sum(a.nbytes for a in map(arrays.get, lengths)) / 1e9:.2f} GB "
        f"in {sec:.2f} s ({1e3 * sec / len(lengths):.2f} ms a line, {tokens / sec:,.0f} tokens/s)",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="small")
    ap.add_argument("--input", default=os.path.join(ROOT, "experiments/data/lm/heldout.txt"))
    ap.add_argument("--ahead", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--writes-only", action="store_true", help="only the host's writes, no model")
    ap.add_argument("--extra", default="", help="more `elmo-jax embed` options, e.g. '--pool mean'")
    args = ap.parse_args()
    if not os.path.isfile(args.input):
        sys.exit(f"{args.input}: not found (bash experiments/fetch_data.sh && python experiments/prep_corpus.py)")
    with open(args.input, encoding="utf-8") as f:
        tokens = sum(len(line.split()) for line in f)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with tempfile.TemporaryDirectory() as tmp:
        write_only(args.input, args.shape, f"{tmp}/writes.hdf5", tokens)
        if args.writes_only:
            return
        subprocess.run(
            [
                sys.executable,
                "-c",
                (
                    "import jax, sys; from elmo_jax import init_bilm, preset; from elmo_jax.compat.hdf5 import save_hdf5; "
                    "c = preset(sys.argv[1]); save_hdf5(c, init_bilm(jax.random.PRNGKey(0), c), sys.argv[2], sys.argv[3])"
                ),
                args.shape,
                f"{tmp}/options.json",
                f"{tmp}/weights.hdf5",
            ],
            check=True,
            env=env,
        )
        times: dict[int, list[float]] = {a: [] for a in args.ahead}
        for r in range(args.rounds):
            for ahead in args.ahead:
                cmd = [
                    sys.executable,
                    "-m",
                    "elmo_jax",
                    "--compile-cache",
                    "none",
                    "embed",
                    "--options",
                    f"{tmp}/options.json",
                    "--weights",
                    f"{tmp}/weights.hdf5",
                    "--input",
                    args.input,
                    "--output",
                    f"{tmp}/out.hdf5",
                    "--no-progress",
                    "--ahead",
                    str(ahead),
                    *args.extra.split(),
                ]
                t = time.perf_counter()
                subprocess.run(cmd, check=True, env=env, stderr=subprocess.DEVNULL)
                sec = time.perf_counter() - t
                times[ahead].append(sec)
                print(f"round {r + 1}, --ahead {ahead}: {sec:.2f} s, {tokens / sec:,.0f} tokens/s", flush=True)
    for ahead, secs in times.items():
        med = statistics.median(secs)
        print(
            f"{args.shape} {os.path.basename(args.input)} ({tokens:,} tokens) {args.extra} --ahead {ahead}: "
            f"median {med:.2f} s, {tokens / med:,.0f} tokens/s",
            flush=True,
        )


if __name__ == "__main__":
    main()
