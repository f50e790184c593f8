"""The ``elmo-jax`` command line (also ``python -m elmo_jax``); the subcommands are in ``commands``.

Importing this package imports neither jax nor the commands: ``main`` sets the command's signal
handling first and imports them after (jax and Orbax, most of a second on a CPU), so that an
interrupt in that second is the command's one line and exit code, not a traceback out of an import
(or a crash in one: ``signals.held_signals``).
"""

from __future__ import annotations

import sys
import typing

if typing.TYPE_CHECKING:
    from elmo_jax.cli.commands import build_parser

__all__ = ["build_parser", "main"]


def main(argv: list[str] | None = None) -> int:
    """Runs ``elmo-jax`` with ``argv`` (None: the program, ``sys.argv[1:]``); returns its exit code."""
    from elmo_jax.cli.signals import as_interrupt, held_signals, interrupting_signals, say_interrupted

    command = _command(sys.argv[1:] if argv is None else argv)
    with interrupting_signals():
        with held_signals(command) as came:  # the imports: a signal is said once they are done
            from elmo_jax.cli import commands
        if came:
            return say_interrupted(command, as_interrupt(came[0]))
        try:
            return commands.main(argv)
        except KeyboardInterrupt as e:
            # The parsing and the checks before the command runs: the command says its own
            # interruption (commands._run), with what it cleaned up.
            return say_interrupted(command, e)


def _command(argv: list[str]) -> str | None:
    """The subcommand named in ``argv``, as far as it can be told without the parser."""
    words = iter(argv)
    for word in words:
        if word == "--compile-cache":  # the one option before the subcommand that takes a value
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None


def __getattr__(name: str):
    if name == "build_parser":
        from elmo_jax.cli.commands import build_parser

        return build_parser
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
