"""Held-out evaluation of a run's checkpoint under both protocols: windows, padding, programs
compiled and wall time.

    python benchmarks/bench_eval.py [--run-dir runs/tiny-sample] [--files elmo_jax/data/sample/heldout.txt]
                                    [--batch-size 16] [--unroll-steps 20] [--calls 2]

For the carried protocol and the per-sentence one (``evaluate(reset_state_per_sentence=True)``),
builds a ``HeldoutEvaluator`` (the host's dealing, timed apart) and calls it ``--calls`` times with
jax's persistent compilation cache off: the first call compiles, the later ones only run. Prints
the windows, the positions they hold against the tokens scored (the rest is padding), the
programs each call compiled and its wall time, and the perplexity.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-dir", default="runs/tiny-sample")
    ap.add_argument("--files", default="elmo_jax/data/sample/heldout.txt")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--unroll-steps", type=int, default=20)
    ap.add_argument("--calls", type=int, default=2)
    args = ap.parse_args()

    from elmo_jax.text.sources import open_source
    from elmo_jax.training.evaluate import HeldoutEvaluator
    from elmo_jax.training.run_dir import load_run

    jax.config.update("jax_enable_compilation_cache", False)
    compiled: list[str] = []

    def listen(event, seconds, fun_name="", **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(fun_name)

    jax.monitoring.register_event_duration_secs_listener(listen)
    options, vocab, params, step = load_run(args.run_dir, None)
    params = jax.device_put(params)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    print(
        f"{args.run_dir} step {step}, {args.files}, {args.batch_size} rows x {args.unroll_steps} steps, "
        f"jax {jax.__version__} on {len(jax.devices())} {jax.devices()[0].device_kind}"
    )
    for name, per_sentence in (("carried", False), ("per sentence", True)):
        t = time.perf_counter()
        evaluator = HeldoutEvaluator(
            options.model,
            vocab,
            open_source(args.files, None),
            mesh,
            batch_size=args.batch_size,
            unroll_steps=args.unroll_steps,
            reset_state_per_sentence=per_sentence,
        )
        dealt = time.perf_counter() - t
        positions = sum(local["inputs"][:, 0].size for local, _ in evaluator.windows)
        shapes = {local["inputs"].shape[1:] for local, _ in evaluator.windows}
        print(
            f"  {name}: {len(evaluator.windows)} windows of {len(shapes)} shape(s), {positions:,} positions "
            f"for {int(evaluator.count.mean()):,} tokens scored ({1 - evaluator.count.mean() / positions:.1%} "
            f"padding), dealt in {dealt:.2f} s"
        )
        for k in range(args.calls):
            compiled.clear()
            t = time.perf_counter()
            result = evaluator(params)
            print(
                f"    call {k + 1}: {time.perf_counter() - t:.2f} s, {len(compiled)} program(s) compiled, "
                f"perplexity {result['perplexity']:.4f}"
            )


if __name__ == "__main__":
    main()
