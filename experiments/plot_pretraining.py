"""The pretraining run's curves from its ``metrics.jsonl``: held-out perplexity (forward, backward,
combined; state carried across sentences, as logged during training) and training perplexity
(sampled softmax), against epochs, beside another run's (``--compare``); a PNG and a markdown table.

    python experiments/plot_pretraining.py --run-dir runs/real --label "P = 0.1" \\
        --compare experiments/results/pretrain_h200 --compare-label "P = 0" [--out experiments/results]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from elmo_jax._util.atomic import write_text_atomic  # noqa: E402

YMAX = 1000


def read_metrics(run_dir: pathlib.Path) -> tuple[dict, list[dict], list[dict]]:
    """(options, logged rows, held-out rows) of a run dir, or of a results folder holding its
    ``metrics.jsonl`` and ``options.json``."""
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.exists():
        sys.exit(f"plot_pretraining: {metrics_path} not found; train first (experiments/README.md)")
    options = json.loads((run_dir / "options.json").read_text())
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    evals = [r for r in rows if "heldout_perplexity" in r]
    if not evals:
        sys.exit(f"plot_pretraining: {metrics_path} has no held-out evaluation (train with --eval-every)")
    return options, rows, evals


def ppl(x: float) -> str:
    """A perplexity for the table: the blow-up's 1e10 in short form, the rest to one decimal."""
    return f"{x:.1e}" if x >= 1e5 else f"{x:,.1f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", type=pathlib.Path, default=pathlib.Path("runs/real"))
    p.add_argument("--label", default=None, help="the run's name in the plot and table (default: its folder)")
    p.add_argument("--compare", type=pathlib.Path, help="another run (or results folder) to draw beside it")
    p.add_argument("--compare-label", default=None)
    p.add_argument("--out", type=pathlib.Path, default=ROOT / "experiments" / "results")
    args = p.parse_args(argv)
    runs = [(args.label or args.run_dir.name, *read_metrics(args.run_dir))]
    if args.compare:
        runs.append((args.compare_label or args.compare.name, *read_metrics(args.compare)))
    # Same data, same rows: the epoch axis is shared (the table's steps are the first run's).
    options = runs[0][1]
    tokens_per_step = options["batch_size"] * options["unroll_steps"]
    epoch = lambda step: step * tokens_per_step / options["n_train_tokens"]  # noqa: E731

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    colors = ("C0", "C3")
    for (label, _, rows, evals), color in zip(runs, colors):
        ax.plot(
            [epoch(r["step"]) for r in rows],
            [r["perplexity"] for r in rows],
            color=color,
            lw=0.8,
            alpha=0.4,
            label=f"{label}: train (sampled softmax)",
        )
        ax.plot(
            [epoch(r["step"]) for r in evals],
            [r["heldout_perplexity"] for r in evals],
            color=color,
            marker="o",
            ms=3,
            label=f"{label}: held-out (fwd + bwd)",
        )
    ax.set_yscale("log")
    # Early full-softmax evaluations can be huge (the zero-state blow-up, see the table); the
    # axis stops at YMAX so that the rest of the curves stays readable.
    off = [
        f"{label} step {r['step']}"
        for label, _, _, evals in runs
        for r in evals
        if max(r[k] for k in r if k.startswith("heldout_perplexity")) > YMAX
    ]
    ax.set_ylim(top=YMAX)
    if off:
        ax.text(0.02, 0.02, f"above {YMAX}, not shown: {', '.join(off)}", transform=ax.transAxes, fontsize=6)
    ax.set_xlabel("epoch")
    ax.set_ylabel("perplexity")
    ax.set_title(f"{options['n_train_tokens']:,} tokens an epoch")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    args.out.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out / "pretraining.png", dpi=120)

    head = "| step | epoch |" + "".join(
        f" {label}: train ppl (sampled) | {label}: held-out fwd / bwd | {label}: held-out combined |"
        for label, *_ in runs
    )
    lines = [head, "|---:|---:|" + "---:|---:|---:|" * len(runs)]
    by_step = [{r["step"]: r for r in evals} for _, _, _, evals in runs]
    for r in runs[0][3]:
        cells = ""
        for evals in by_step:
            e = evals.get(r["step"])
            cells += (
                f" {e['perplexity']:.1f} | {ppl(e['heldout_perplexity_fwd'])} / {ppl(e['heldout_perplexity_bwd'])}"
                f" | {ppl(e['heldout_perplexity'])} |"
                if e
                else " | | |"
            )
        lines.append(f"| {r['step']:,} | {epoch(r['step']):.2f} |{cells}")
    write_text_atomic(args.out / "pretraining.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {args.out / 'pretraining.png'} and {args.out / 'pretraining.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
