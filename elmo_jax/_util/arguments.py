"""Errors that speak of a function's arguments, marked so that a front end can name its own.

A library error names an argument by its Python name (``batch_tokens must be 1 or more; got 0``)
and says which names those are: ``raise about(ConfigError(...), "batch_tokens")``. The command
line reads them back with ``arguments_of`` and writes its flags in their place
(``--batch-tokens must be 1 or more; got 0``); from Python the message reads as it is.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable
from typing import TypeVar

_ATTRIBUTE = "arguments"
_E = TypeVar("_E", bound=BaseException)


def about(exc: _E, *arguments: str) -> _E:
    """``exc``, marked as speaking of ``arguments`` (each written in its message as it is named)."""
    setattr(exc, _ATTRIBUTE, tuple(arguments))
    return exc


def arguments_of(exc: BaseException) -> tuple[str, ...]:
    """The argument names ``exc`` was marked with by ``about`` (none: ``()``)."""
    return tuple(getattr(exc, _ATTRIBUTE, ()))


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """``"; did you mean X?"`` for the choice nearest a mistyped ``word`` (difflib's ratio, 0.6 at
    least), or ``""``: the end of a message that refuses ``word``."""
    close = difflib.get_close_matches(str(word), list(choices), n=1)
    return f"; did you mean {close[0]}?" if close else ""


def check_path(value: object, name: str, hint: str = "a path") -> None:
    """A one-line ``TypeError`` naming the argument ``name`` when ``value`` is neither a str nor a
    ``os.PathLike`` (arguments given in another order, a None): ``hint`` says what was expected."""
    if not isinstance(value, (str, os.PathLike)):
        raise about(TypeError(f"{name} is a {type(value).__name__}; expected {hint}"), name)
