"""What a new ``Embedder`` costs once another of the same model has run: a notebook that builds
one again, a server that builds one per request.

    python benchmarks/bench_new_embedder.py [--shape small] [--times 3] [--devices 1]

Builds an ``Embedder`` of random ``--shape`` weights and embeds two short sentences, ``--times``
times in one process with jax's persistent compilation cache off, and prints each round's wall
time and the programs it compiled. The first round compiles; the later ones run the programs the
first one made (``elmo_jax.extract.embedder``'s programs are shared per config and precision).
"""

from __future__ import annotations

import argparse
import time

import jax


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="small")
    ap.add_argument("--times", type=int, default=3)
    ap.add_argument("--devices", type=int, default=1)
    args = ap.parse_args()

    import elmo_jax as ej

    jax.config.update("jax_enable_compilation_cache", False)
    config = ej.preset(args.shape)
    params = ej.init_bilm(jax.random.PRNGKey(0), config)
    compiled: list[str] = []

    def listen(event, seconds, fun_name="", **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(fun_name)

    jax.monitoring.register_event_duration_secs_listener(listen)
    print(f"{args.shape}, {args.devices} device(s), jax {jax.__version__} on {jax.devices()[0].device_kind}")
    for k in range(args.times):
        compiled.clear()
        t = time.perf_counter()
        ej.Embedder(config, params, devices=args.devices).embed([["a", "short", "one"], ["hello", "world"]])
        print(f"  Embedder {k + 1}: {time.perf_counter() - t:.2f} s, {len(compiled)} program(s) compiled")


if __name__ == "__main__":
    main()
