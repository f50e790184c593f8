"""A pytest plugin that adds up where a test run's time goes in jax's compile pipeline.

    PYTHONPATH=benchmarks python -m pytest -p pytest_compile_time tests/test_bilm.py -m "not slow"

At the end of the run it prints, for each of jax's duration events (tracing, lowering to MLIR,
XLA's backend compile, persistent-cache reads), the seconds and the count in this process
(subprocesses, e.g. the CLI tests', are not counted). ``JAX_LOG_COMPILES=1`` with ``-p no:logging
-s`` names each compiled program instead.
"""

from __future__ import annotations

import collections

import jax

SECONDS: collections.Counter = collections.Counter()
COUNTS: collections.Counter = collections.Counter()


def _record(event: str, seconds: float, **_) -> None:
    SECONDS[event] += seconds
    COUNTS[event] += 1


jax.monitoring.register_event_duration_secs_listener(_record)


def pytest_terminal_summary(terminalreporter) -> None:
    for event, seconds in SECONDS.most_common(8):
        terminalreporter.write_line(f"{seconds:8.1f} s {COUNTS[event]:6d}x {event}")
