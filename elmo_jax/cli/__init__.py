"""The ``elmo-jax`` command line (also ``python -m elmo_jax``): ``parser`` reads the flags,
``commands`` runs them.

Importing this package imports neither jax nor the commands. ``main`` parses first (``parser``
imports no jax, so ``--help`` and a mistyped flag are answered at once), then sets the command's
signal handling and imports the commands (jax and Orbax, most of a second on a CPU), so that an
interrupt in that second is the command's one line and exit code, not a traceback out of an import
(or a crash in one: ``signals.held_signals``).
"""

from __future__ import annotations

import sys

from elmo_jax.cli import parser
from elmo_jax.cli.parser import build_parser

__all__ = ["build_parser", "main"]


def main(argv: list[str] | None = None) -> int:
    """Runs ``elmo-jax`` with ``argv`` (None: the program, ``sys.argv[1:]``); returns its exit code."""
    from elmo_jax.cli.signals import as_interrupt, held_signals, interrupting_signals, say_interrupted

    command = parser.named_command(sys.argv[1:] if argv is None else argv)
    with interrupting_signals():
        try:
            args = parser.parse(argv)
            with held_signals(args.command) as came:  # the imports: a signal is said once they are done
                from elmo_jax.cli import commands
            if came:
                return say_interrupted(args.command, as_interrupt(came[0]))
            return commands.run(args, argv)
        except KeyboardInterrupt as e:
            # The parsing and the checks before the command runs: the command says its own
            # interruption (commands._run), with what it cleaned up.
            return say_interrupted(command, e)
