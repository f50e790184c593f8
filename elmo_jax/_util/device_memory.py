"""XLA's runtime errors told apart, for one line each: a device out of memory, which names the knob
to turn (the training's ``batch_size``, the extraction's ``batch_tokens``), and a device that
failed while it ran a program (a GPU's illegal address or ECC error, a TPU core that halted, a
link between devices that broke). Any other runtime error is the program's: a bug, shown with its
traceback."""

from __future__ import annotations

from collections.abc import Callable

from elmo_jax._util.arguments import about


class OutOfDeviceMemory(RuntimeError):
    """A computation needed more device memory than there is."""


class DeviceFailed(RuntimeError):
    """The device, its driver or a link between devices failed while a computation ran."""


# What a ``DeviceFailed`` line tells the user to do, before "rerun ...".
CHECK_THE_DEVICE = "check the device (nvidia-smi, on a GPU); once it works,"


# XLA's status codes for a program that compiled and then met a device that failed under it. Not
# INVALID_ARGUMENT or FAILED_PRECONDITION: a buffer donated and used again is the program's error.
FAILURE_CODES = ("INTERNAL", "UNAVAILABLE", "ABORTED", "DATA_LOSS", "UNKNOWN", "DEADLINE_EXCEEDED")


def _runtime_error_line(e: BaseException) -> str | None:
    """XLA's first line (at most 200 characters) when ``e`` is its runtime error, else None."""
    if type(e).__name__ not in ("JaxRuntimeError", "XlaRuntimeError"):
        return None
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else ""


def out_of_memory(e: BaseException) -> str | None:
    """XLA's first line when ``e`` is its out-of-memory error (``RESOURCE_EXHAUSTED``, wherever XLA
    puts it in the text), else None."""
    line = _runtime_error_line(e)
    return line if line is not None and "RESOURCE_EXHAUSTED" in str(e) else None


def device_failure(e: BaseException) -> str | None:
    """XLA's first line when ``e`` says the device failed under a running program (its status, the
    text's first word, one of ``FAILURE_CODES``) and is not ``out_of_memory``, else None."""
    line = _runtime_error_line(e)
    if line is None or out_of_memory(e) is not None or line.split(":", 1)[0] not in FAILURE_CODES:
        return None
    return line


def device_error(
    e: BaseException, *, out_of_memory_said: Callable[[str], str], knob: str, failed_said: Callable[[str], str]
) -> RuntimeError | None:
    """The one-line error that stands for XLA's runtime error ``e``, made from XLA's first line:
    ``OutOfDeviceMemory(out_of_memory_said(line))`` naming the argument ``knob`` to lower, or
    ``DeviceFailed(failed_said(line))``; None for any other error (the program's: re-raise it).
    Callers raise it outside their ``except`` clause: XLA's traceback is not the message."""
    if (xla := out_of_memory(e)) is not None:
        return about(OutOfDeviceMemory(out_of_memory_said(xla)), knob)
    if (xla := device_failure(e)) is not None:
        return DeviceFailed(failed_said(xla))
    return None
