"""The cost of the per-step agreement of a multi-process run (``elmo_jax._util.processes.agree_max``).

    python benchmarks/bench_agree.py [--processes 2] [--calls 200]

Starts ``--processes`` local processes (one CPU device each, jax.distributed on 127.0.0.1, gloo
collectives) that each call the agreement ``--calls`` times, as the training loop does once per
step, and prints the median and 90th percentile time of one call. On a real cluster the figure
depends on the interconnect and on how far the processes drift apart; this measures the floor on
one machine.
"""

from __future__ import annotations

import argparse
import sys
import time

from harness import local_processes


def worker(port: int, n: int, rank: int, calls: int) -> None:
    import jax
    import numpy as np

    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n, process_id=rank)
    from elmo_jax._util.processes import agree_max

    agree_max([1, 2, 0])  # the first call compiles
    times = []
    for i in range(calls):
        t = time.perf_counter()
        agree_max([i, rank, 0])
        times.append(time.perf_counter() - t)
    if rank == 0:
        ms = np.array(times) * 1e3
        print(
            f"{n} processes, {calls} calls: median {np.median(ms):.2f} ms, 90th percentile "
            f"{np.percentile(ms, 90):.2f} ms per agreement"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--worker", type=int, nargs=2, metavar=("PORT", "RANK"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker[0], args.processes, args.worker[1], args.calls)
    procs = local_processes(__file__, args.processes, ["--processes", str(args.processes), "--calls", str(args.calls)])
    sys.exit(max(p.wait() for p in procs))


if __name__ == "__main__":
    main()
