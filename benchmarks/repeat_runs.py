"""What a notebook's second, third ... ``pretrain`` call in one process costs, and what it compiles.

    python benchmarks/repeat_runs.py [--runs 4] [--steps 2]

Each run is a fresh run dir (seed = the run's number, so that a program with the key as a
constant would differ every time), then one resume of the first. Printed per call: its wall time,
its ``startup_s`` (first step: batch, compile, first run) and the programs XLA compiled in it
(``jax.monitoring``'s backend-compile events; the persistent compile cache is off, so a program
made again shows). The first call compiles the run's programs; a later one should compile none.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

import jax

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRAIN = ROOT / "tests" / "fixtures" / "bilm_tf_train"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()

    from elmo_jax.config import Options
    from elmo_jax.model.vocabulary import Vocabulary
    from elmo_jax.text.sources import TextFiles
    from elmo_jax.training.loop import RunSettings, options_for_vocab, pretrain

    sys.path.insert(0, str(ROOT / "tests"))
    from test_config import BILM_TF_TRAIN_OPTIONS  # the reference recipe the tests train

    jax.config.update("jax_enable_compilation_cache", False)
    compiled: list[str] = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, fun_name="", **_: (
            compiled.append(fun_name) if event == "/jax/core/compile/backend_compile_duration" else None
        )
    )
    vocab = Vocabulary.load(TRAIN / "vocab.txt")
    options = options_for_vocab(
        Options.from_dict({**BILM_TF_TRAIN_OPTIONS, "batch_size": 2, "unroll_steps": 5}), vocab, None
    )
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; {args.steps} steps a run")
    with tempfile.TemporaryDirectory() as tmp:
        calls = [(f"run {i} (seed {i})", i, args.steps) for i in range(args.runs)]
        calls.append(("run 0 resumed", 0, 2 * args.steps))
        for name, seed, steps in calls:
            compiled.clear()
            settings = RunSettings(
                run_dir=f"{tmp}/{seed}", steps=steps, seed=seed, progress=False, devices=1, async_save=False
            )
            start = time.perf_counter()
            last = pretrain(options, vocab, TextFiles(str(TRAIN / "data.txt")), settings)
            wall = time.perf_counter() - start
            print(
                f"{name:>16}: {wall:6.2f} s, startup {last.get('startup_s', 0):5.2f} s, "
                f"compiled {len(compiled)}: {', '.join(compiled) or '-'}",
                flush=True,
            )


if __name__ == "__main__":
    main()
