"""Which processes of a multi-process run load their programs from a shared compile cache.

    python benchmarks/multihost_compile_cache.py [--processes 2]

Runs the same job twice, each time as ``--processes`` local processes (one CPU device each,
jax.distributed on 127.0.0.1) that share one persistent compile cache directory. The job compiles
a program over the global mesh (a ``shard_map`` matmul with a ``psum``, as the training step is)
and one on the process's own device. For the second run, each process prints how many of its
compiles were cache hits and misses (jax's own monitoring events). jax writes the cache from
process 0 only, so whether the others hit depends on their programs' keys matching process 0's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile

from harness import local_processes


def worker(port: int, n: int, rank: int) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n, process_id=rank)
    counts = {"requests": 0, "hits": 0}

    def on_event(event: str, **_: object) -> None:
        if event == "/jax/compilation_cache/compile_requests_use_cache":
            counts["requests"] += 1
        elif event == "/jax/compilation_cache/cache_hits":
            counts["hits"] += 1

    jax.monitoring.register_event_listener(on_event)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    spec = NamedSharding(mesh, P("data"))

    @jax.jit
    def global_step(x, w):
        def per_device(x, w):
            return jax.lax.psum(jnp.tanh(x @ w), "data")

        return jax.shard_map(per_device, mesh=mesh, in_specs=(P("data"), P()), out_specs=P())(x, w)

    local = np.ones((n * 8, 64), np.float32)
    x = jax.make_array_from_process_local_data(spec, local[rank * 8 : (rank + 1) * 8])
    w = jnp.ones((64, 64), jnp.float32)
    jax.block_until_ready(global_step(x, w))
    jax.block_until_ready(jax.jit(lambda a: a * 2 + 1)(jnp.ones(16)))  # this process's own device
    misses = counts["requests"] - counts["hits"]
    print(f"process {rank}: {counts['hits']} of {counts['requests']} program(s) loaded, {misses} compiled", flush=True)


def run(n: int, cache: str) -> list[str]:
    cache_env = {
        "JAX_COMPILATION_CACHE_DIR": cache,
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }
    procs = local_processes(__file__, n, ["--processes", str(n)], cache_env, stdout=subprocess.PIPE, text=True)
    outs = [p.communicate(timeout=300)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"a worker failed: exit codes {[p.returncode for p in procs]}")
    return [line for out in outs for line in out.splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--worker", type=int, nargs=2, metavar=("PORT", "RANK"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker[0], args.processes, args.worker[1])
    with tempfile.TemporaryDirectory() as cache:
        run(args.processes, cache)  # fills the cache
        entries = len(os.listdir(cache))
        print(f"first run: {entries} cache entries written; second run, same programs, same directory:")
        for line in run(args.processes, cache):
            print(" ", line)


if __name__ == "__main__":
    main()
