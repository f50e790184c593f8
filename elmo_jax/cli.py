"""The ``elmo-jax`` command line (also ``python -m elmo_jax``)."""

from __future__ import annotations

import argparse
import sys
from importlib import resources

import numpy as np

from elmo_jax.chars import VocabError
from elmo_jax.config import ConfigError
from elmo_jax.weights import WeightsError

# Errors that are the user's input, not our bug: one line, no traceback.
USER_ERRORS = (ConfigError, WeightsError, VocabError, FileNotFoundError, IsADirectoryError, PermissionError)

DEMO_SENTENCES = [
    "I ate an apple and a pear for lunch .",
    "Apple released a new phone yesterday .",
    "The apple pie was still warm .",
]


def bundled_model() -> tuple[str, str]:
    """Paths of the bundled AllenNLP test biLM (options, weights)."""
    data = resources.files("elmo_jax") / "data"
    return str(data / "fixture_options.json"), str(data / "fixture_weights.hdf5")


def cmd_demo(args: argparse.Namespace) -> None:
    from elmo_jax.bilm import bilm_apply
    from elmo_jax.chars import batch_to_ids
    from elmo_jax.weights import load_hdf5

    options, weights = (args.options, args.weights) if args.options else bundled_model()
    config, params = load_hdf5(options, weights)
    sentences = [s.split() for s in (args.sentence or DEMO_SENTENCES)]
    layers, mask, _ = bilm_apply(params, config, batch_to_ids(sentences))
    layers, mask = np.asarray(layers), np.asarray(mask)
    print(f"model: {weights}")
    print(f"  {config.lstm.n_layers} LSTM layers, dim {config.lstm.dim}, projection {config.lstm.projection_dim}; "
          f"ELMo layers: {config.n_output_layers} x {config.output_dim}")
    print(f"batch: {len(sentences)} sentences -> layers {list(layers.shape)}, mask {list(mask.shape)}")
    for i, s in enumerate(sentences):
        n = int(mask[i].sum())
        norms = np.linalg.norm(layers[:, i, :n], axis=-1).mean(axis=1)
        print(f"  [{i}] {n:2d} tokens  mean |layer| = {', '.join(f'{x:.3f}' for x in norms)}  {' '.join(s)}")
    word = args.word
    found = [(i, s.index(t)) for i, s in enumerate(sentences) for t in s if t.lower() == word][:8]
    if len(found) >= 2:
        print(f"cosine similarity of '{word}' across sentences (layer 0 is context-free: the same spelling always gives 1.000):")
        for layer in range(layers.shape[0]):
            v = np.stack([layers[layer, i, t] for i, t in found])
            v = v / np.linalg.norm(v, axis=-1, keepdims=True)
            sims = v @ v.T
            pairs = [f"{a}-{b}: {sims[a, b]:.3f}" for a in range(len(found)) for b in range(a + 1, len(found))]
            print(f"  layer {layer}: {', '.join(pairs)}")
    if not args.options:
        print("(the bundled model is AllenNLP's tiny test biLM: the numbers show the plumbing, not meaning)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="elmo-jax", description="ELMo biLMs in JAX.")
    sub = p.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="embed a few sentences with the bundled test model and print the result")
    demo.add_argument("--options", help="bilm-tf options.json (default: the bundled test model)")
    demo.add_argument("--weights", help="bilm-tf weights hdf5 (with --options)")
    demo.add_argument("--sentence", action="append", help="a whitespace-tokenized sentence (repeatable)")
    demo.add_argument("--word", default="apple", help="word whose vectors to compare across sentences")
    demo.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "options", None) and not getattr(args, "weights", None):
        parser.error("--options needs --weights")
    try:
        args.func(args)
    except USER_ERRORS as e:
        print(f"elmo-jax {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"elmo-jax {args.command}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
