"""The stall of a save step: how long the training loop waits while a checkpoint is taken.

    python benchmarks/bench_save.py [--shape small] [--vocab 793471] [--batch 128] [--repeats 3]

Two ways to save the same state with Orbax's async checkpointing, timed in the same run:

- **global arrays** (the current code): ``Checkpointer.save`` of the state as it lies on the
  devices; each process copies out only the shards it holds, and the writing goes on in the
  background.
- **host copy first** (the replicated design before the device mesh): the whole state copied to
  host numpy (``jax.device_get``) before the same save is called.

"stall" is the time until ``save`` returns, when the next step could start; "written" is the
time until the checkpoint is complete on disk.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import jax
import numpy as np
from jax.sharding import Mesh

from elmo_jax.config import PRESETS, Options, TrainConfig, preset
from elmo_jax.training.checkpoint import Checkpointer
from elmo_jax.training.step import AXIS, init_state, state_shardings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="small", help="a preset or a bilm-tf options.json")
    ap.add_argument("--vocab", type=int, default=793_471)
    ap.add_argument("--batch", type=int, default=128, help="rows per device")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model = preset(args.shape) if args.shape in PRESETS else Options.load(args.shape).model
    tc = TrainConfig(n_tokens_vocab=args.vocab, batch_size=args.batch)
    mesh = Mesh(np.array(jax.devices()), (AXIS,))
    rows = args.batch * mesh.size
    shardings = state_shardings(jax.eval_shape(lambda: init_state(jax.random.PRNGKey(0), model, tc, rows)), mesh)
    state = jax.jit(lambda: init_state(jax.random.PRNGKey(0), model, tc, rows), out_shardings=shardings)()
    jax.block_until_ready(state)
    nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(state))
    print(
        f"{args.shape}, V={args.vocab:,}, {rows} rows, {mesh.size} {jax.devices()[0].platform} device(s): "
        f"state {nbytes / 1e9:.2f} GB"
    )
    host = {"data": {"position": np.zeros(3, np.int64)}}
    results: dict[str, list[tuple[float, float]]] = {"global arrays": [], "host copy first": []}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Checkpointer(os.path.join(tmp, "run"), keep=1, async_save=True)
        step = 0
        for _ in range(args.repeats):
            for name in results:
                step += 1
                t0 = time.perf_counter()
                if name == "global arrays":
                    ckpt.save(step, state.shared(), state.lstm, host, {})
                else:
                    ckpt.save(step, jax.device_get(state.shared()), jax.device_get(state.lstm), host, {})
                stall = time.perf_counter() - t0
                ckpt.wait()
                results[name].append((stall, time.perf_counter() - t0))
        ckpt.close()
    for name, times in results.items():
        stall, written = np.median(np.array(times), axis=0)
        print(f"{name:>16}: stall {stall * 1e3:8.1f} ms, written {written:6.2f} s (median of {len(times)})")


if __name__ == "__main__":
    main()
