"""What the shard loader process costs a run: its start and its memory (``batches.ShardLoader``,
started with "spawn" on a run's first shard of a million words or more).

    python benchmarks/bench_loader.py [--repeats 3]
    PYTHONPATH=.baseline python benchmarks/bench_loader.py      # another tree (git archive), alike

Starts a process as ``ShardLoader`` does (``_loader_started`` as its initializer, a small
vocabulary) and asks it, as its first task, for its peak resident set and whether jax is loaded.
Prints the seconds to that first result and the answers, once per repeat, each a fresh process.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import time

from elmo_jax.training import batches


def _inside() -> tuple[int, bool]:
    import resource
    import sys

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10, "jax" in sys.modules


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    for _ in range(args.repeats):
        t = time.perf_counter()
        with concurrent.futures.ProcessPoolExecutor(
            1,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=batches._loader_started,
            initargs=(["<S>", "</S>", "<UNK>", "the"],),
        ) as pool:
            mib, has_jax = pool.submit(_inside).result()
            seconds = time.perf_counter() - t
        print(f"loader process: first result after {seconds:.2f} s; max RSS {mib} MiB; jax loaded: {has_jax}")


if __name__ == "__main__":
    main()
