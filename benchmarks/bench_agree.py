"""The cost of the per-step agreement of a multi-process run: the training loop's
``StepAgreement`` (jax.distributed's key-value store) beside ``agree_max`` (one collective on the
devices), both in ``elmo_jax._util.processes``.

    python benchmarks/bench_agree.py [--processes 2] [--calls 200]

Starts ``--processes`` local processes (one CPU device each, jax.distributed on 127.0.0.1, gloo
collectives) that each agree ``--calls`` times, as the training loop does once per step, and
prints the median and 90th percentile time of one agreement of each kind. Every result is
checked against the max that each process can compute itself, and so are those of a second
``StepAgreement`` made after the first (a notebook's second run talks to the same store). On a
real cluster the figures depend on the interconnect and on how far the processes drift apart;
this measures the floor on one machine.

Each is timed twice: alone, and right after a dispatched device computation of about 30 ms, as
in the training loop, where the agreement comes after the step before it was dispatched. The
collective queues behind it on the device and returns when it ends; the store does not wait.
"""

from __future__ import annotations

import argparse
import sys
import time

from harness import local_processes


def worker(port: int, n: int, rank: int, calls: int) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n, process_id=rank)
    from elmo_jax._util.processes import StepAgreement, agree_max

    def proposal(i: int, p: int) -> list[int]:
        return [i, p, (p * 7 + i) % 5]

    x = jax.device_put(np.ones((256, 256), np.float32) / 256)
    step = jax.jit(lambda x: jax.lax.fori_loop(0, 60, lambda _, y: jnp.tanh(y @ y), x))  # ~30 ms on one CPU core
    step(x).block_until_ready()

    early = {}  # kind -> agreements that returned while the step was still running

    def timed(agree, offset: int, behind_a_step: bool = False) -> np.ndarray:
        times, before_its_end = [], 0
        for i in range(offset, offset + calls):
            running = step(x) if behind_a_step else None
            t = time.perf_counter()
            got = agree(proposal(i, rank))
            times.append(time.perf_counter() - t)
            if running is not None:
                before_its_end += not running.is_ready()
                running.block_until_ready()
            want = [max(x) for x in zip(*(proposal(i, p) for p in range(n)))]
            if got != want:
                raise SystemExit(f"process {rank}: call {i} agreed on {got}, not {want}")
        if behind_a_step:
            early[agree] = before_its_end
        return np.array(times) * 1e3

    agree_max([1, 2, 0])  # the first call compiles
    store = StepAgreement()
    kinds = {
        "collective (agree_max)": timed(agree_max, 0),
        "key-value store (StepAgreement)": timed(store, 0),
        "collective, behind a step in flight": timed(agree_max, calls, behind_a_step=True),
        "key-value store, behind a step in flight": timed(store, calls, behind_a_step=True),
    }
    # A second one: its own keys, up to and past the rounds whose keys the first left in the store.
    second = StepAgreement()
    timed(second, 0)
    timed(second, calls)
    if rank == 0:
        print(f"{n} processes, {calls} calls of each kind, every result checked:")
        for kind, ms in kinds.items():
            line = (
                f"  {kind}: median {np.median(ms):.2f} ms, 90th percentile {np.percentile(ms, 90):.2f} ms per agreement"
            )
            if "behind" in kind:
                line += f"; returned before the step ended: {early[agree_max if 'collective' in kind else store]} of {calls}"
            print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
