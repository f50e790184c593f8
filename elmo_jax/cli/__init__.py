"""The ``elmo-jax`` command line (also ``python -m elmo_jax``); the subcommands are in ``commands``."""

from elmo_jax.cli.commands import build_parser, main

__all__ = ["build_parser", "main"]
