"""The pretraining run's curves from its ``metrics.jsonl``: held-out perplexity (forward, backward,
combined; state carried across sentences, as logged during training) and training perplexity
(sampled softmax), against epochs; a PNG and a markdown table.

    python experiments/plot_pretraining.py --run-dir runs/real [--out experiments/results]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from elmo_jax._util.atomic import write_text_atomic  # noqa: E402

YMAX = 1000


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", type=pathlib.Path, default=pathlib.Path("runs/real"))
    p.add_argument("--out", type=pathlib.Path, default=ROOT / "experiments" / "results")
    args = p.parse_args(argv)
    metrics_path = args.run_dir / "metrics.jsonl"
    if not metrics_path.exists():
        sys.exit(f"plot_pretraining: {metrics_path} not found; train first (experiments/README.md)")
    options = json.loads((args.run_dir / "options.json").read_text())
    tokens_per_step = options["batch_size"] * options["unroll_steps"]
    epoch = lambda step: step * tokens_per_step / options["n_train_tokens"]  # noqa: E731
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    evals = [r for r in rows if "heldout_perplexity" in r]
    if not evals:
        sys.exit(f"plot_pretraining: {metrics_path} has no held-out evaluation (train with --eval-every)")

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([epoch(r["step"]) for r in rows], [r["perplexity"] for r in rows], color="0.7", lw=1,
            label="train (sampled softmax)")
    for key, label in (("heldout_perplexity_fwd", "held-out forward"), ("heldout_perplexity_bwd", "held-out backward"),
                       ("heldout_perplexity", "held-out combined")):
        ax.plot([epoch(r["step"]) for r in evals], [r[key] for r in evals], marker="o", ms=3, label=label)
    ax.set_yscale("log")
    # Early full-softmax evaluations of a sampled-softmax model can be huge (see the table); the
    # axis stops at YMAX so that the rest of the curve stays readable.
    off = [r["step"] for r in evals if max(r[k] for k in r if k.startswith("heldout_perplexity")) > YMAX]
    ax.set_ylim(top=YMAX)
    if off:
        ax.text(0.02, 0.02, f"held-out points above {YMAX} not shown (steps {', '.join(map(str, off))})",
                transform=ax.transAxes, fontsize=7)
    ax.set_xlabel("epoch")
    ax.set_ylabel("perplexity")
    ax.set_title(f"{args.run_dir.name}: {options['n_train_tokens']:,} tokens an epoch")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    args.out.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out / "pretraining.png", dpi=120)

    lines = ["| step | epoch | train ppl (sampled) | held-out fwd | held-out bwd | held-out combined |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in evals:
        lines.append(f"| {r['step']:,} | {epoch(r['step']):.2f} | {r['perplexity']:.1f} | "
                     f"{r['heldout_perplexity_fwd']:.1f} | {r['heldout_perplexity_bwd']:.1f} | "
                     f"{r['heldout_perplexity']:.1f} |")
    write_text_atomic(args.out / "pretraining.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {args.out / 'pretraining.png'} and {args.out / 'pretraining.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
