"""This tree against another (the previous commit) on the CPU: extraction and the train step.

    git archive --prefix=.baseline/ <commit> | tar -x        # the other tree (ignored by git)
    python benchmarks/cpu_compare.py --baseline .baseline [--rounds 2]

Each figure is a median of 10 timed calls, taken in a child process per tree with
``PYTHONPATH`` set to it; the trees alternate for ``--rounds`` rounds (the machine is shared and
drifts), each first in every other round, and the median over rounds is reported. Extraction: ``Embedder.embed`` with its
defaults, float32, `small` shape, on 32 x 20 random words, the 30 natural sentences of the
bilm-tf fixture, and the whole job of the sample's ``heldout.txt`` (warm; 5 calls), each also as
its best call ("best": less moved by other load on a shared machine than the median). Training:
each tree's own ``benchmarks/bench_train.py --shape small --vocabs 10000 --steps 10`` (the
median of 10 steps; ``experiments/bench_train.py`` in a tree from before ``benchmarks/``), tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

CHILD = r"""
import json, statistics, sys, time
sys.path.insert(0, sys.argv[1])
import jax
from harness import random_sentences
from bench_embed import natural_sentences, sample_sentences
from elmo_jax import Embedder, init_bilm, preset  # the public names: the same in a tree before the subpackages

config = preset("small")
params = init_bilm(jax.random.PRNGKey(0), config)
out = {}
for name, sents, calls in (("random 32x20", random_sentences(32, 20), 10), ("natural 30", natural_sentences(), 10),
                           ("job, warm", sample_sentences(), 5)):
    embedder = Embedder(config, params, devices=1)
    embedder.embed(sents)  # compiles
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        embedder.embed(sents)
        times.append(time.perf_counter() - t)
    out[name] = sum(len(s) for s in sents) / statistics.median(times)
    # The best call: what the code can do when the shared machine leaves it alone.
    out[name + " best"] = sum(len(s) for s in sents) / min(times)
import elmo_jax
out["from"] = elmo_jax.__file__
print(json.dumps(out))
"""


def extraction(tree: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
    # In the tree: `python -c` puts its working directory first on sys.path, ahead of PYTHONPATH,
    # so from this repository's root both children would import this tree's elmo_jax.
    r = subprocess.run(
        [sys.executable, "-c", CHILD, HERE], env=env, cwd=tree, capture_output=True, text=True, check=True
    )
    out = json.loads(r.stdout.strip().splitlines()[-1])
    where = out.pop("from")
    if not os.path.abspath(where).startswith(os.path.abspath(tree) + os.sep):
        raise SystemExit(f"the child for {tree} imported elmo_jax from {where}, not from that tree")
    return out


def train(tree: str) -> float:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
    script = os.path.join(os.path.abspath(tree), "benchmarks", "bench_train.py")
    if not os.path.exists(script):  # a tree from before benchmarks/ had its own in experiments/
        script = os.path.join(os.path.abspath(tree), "experiments", "bench_train.py")
    r = subprocess.run(
        [sys.executable, script, "--shape", "small", "--vocabs", "10000", "--steps", "10"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    m = re.search(r"V=\s*10,000:.*?([\d.]+) tokens/s", r.stdout)
    if not m:
        raise SystemExit(f"no tokens/s in the output of {script}:\n{r.stdout[-2000:]}")
    return float(m.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, help="the other tree (e.g. git archive of the previous commit)")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    trees = {"baseline": args.baseline, "this tree": os.path.dirname(HERE)}
    figures = {name: {} for name in trees}
    for r in range(args.rounds):
        # Each tree goes first in every other round: a child that runs after the other tree's
        # training (memory just freed, the kernel still reclaiming it) is not always the same tree's.
        for name, tree in list(trees.items())[:: 1 if r % 2 == 0 else -1]:
            got = {**extraction(tree), "train step": train(tree)}
            print(f"round {r + 1}, {name}: " + ", ".join(f"{k} {v:,.0f}" for k, v in got.items()), flush=True)
            for k, v in got.items():
                figures[name].setdefault(k, []).append(v)
    print("median over rounds, tokens/s (this tree / baseline):")
    for k in figures["baseline"]:
        base, new = (statistics.median(figures[n][k]) for n in trees)
        print(f"  {k:<14} baseline {base:9,.0f}  this tree {new:9,.0f}  ({100 * (new / base - 1):+.1f} %)")


if __name__ == "__main__":
    main()
