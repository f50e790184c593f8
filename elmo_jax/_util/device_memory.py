"""A device out of memory, told apart from XLA's other runtime errors, for one line that names the
knob to turn (the training's ``batch_size``, the extraction's ``batch_tokens``)."""

from __future__ import annotations


class OutOfDeviceMemory(RuntimeError):
    """A computation needed more device memory than there is."""


def out_of_memory(e: BaseException) -> str | None:
    """XLA's first line when ``e`` is its out-of-memory error (``RESOURCE_EXHAUSTED``), else None."""
    text = str(e).strip()
    if type(e).__name__ not in ("JaxRuntimeError", "XlaRuntimeError") or "RESOURCE_EXHAUSTED" not in text:
        return None
    return text.splitlines()[0][:200]
