"""What the progress bars need to know of the terminal they draw on."""

from __future__ import annotations

import os
from typing import Any

# tqdm's own sizes for a stream it cannot measure.
FALLBACK_COLUMNS, FALLBACK_LINES = 80, 20


def is_terminal(stream: Any) -> bool:
    """Whether ``stream`` is a terminal (False for a file, a pipe, or a closed or stream-less one)."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


def bar_size(stream: Any) -> dict[str, Any]:
    """tqdm's size arguments for a bar drawn on ``stream``: the terminal's size, read again at each
    redraw (``dynamic_ncols``), or fixed where the terminal says it has 0 columns or lines, each
    such one taken as tqdm takes a stream it cannot measure (80 x 20).

    A pseudo-terminal opened with no window size says 0 x 0 (``docker exec -t`` before its first
    resize, some CI runners' ttys). tqdm takes one less of each: a width of -1 draws an empty bar,
    and a height of -1 hides it as a nested bar below the screen, so a run showed no progress."""
    if is_terminal(stream):
        try:
            columns, lines = os.get_terminal_size(stream.fileno())
        except (OSError, ValueError):
            return {"dynamic_ncols": True}
        if not (columns and lines):
            return {"ncols": columns or FALLBACK_COLUMNS, "nrows": lines or FALLBACK_LINES}
    return {"dynamic_ncols": True}
