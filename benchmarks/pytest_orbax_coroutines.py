"""A pytest plugin that shows which test leaves Orbax coroutines alive, and what a collection costs.

    PYTHONPATH=benchmarks python -m pytest -p pytest_orbax_coroutines -m slow tests

After each test it collects garbage and writes the count of live Orbax coroutines, with the test's
id, to ``$ORBAX_COROUTINES_LOG`` (default ``orbax_coroutines.log``). At the end it prints the
number of objects the garbage collector tracks, and how long one scan of them and one full
collection take: what ``elmo_jax.training.orbax_log`` pays at the end of each block that looks for
them; and how many blocks looked in the session, and the seconds those looks took in all.

A coroutine that stays alive (a write that never ends) made every later ``orbax_log`` block wait
its 5 s timeout until 5395c03; this is how that was found (``results/cpu/test_opt_levels.txt``).
"""

from __future__ import annotations

import gc
import os
import time

from elmo_jax.training import orbax_log
from elmo_jax.training.orbax_log import _orbax_coroutines

_looks = {"blocks": 0, "seconds": 0.0}


def pytest_configure(config) -> None:
    settle = orbax_log._settle

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return settle(*args, **kwargs)
        finally:
            _looks["blocks"] += 1
            _looks["seconds"] += time.perf_counter() - t0

    orbax_log._settle = timed


def pytest_runtest_logfinish(nodeid: str, location) -> None:
    gc.collect()
    with open(os.environ.get("ORBAX_COROUTINES_LOG", "orbax_coroutines.log"), "a") as f:
        f.write(f"{time.strftime('%H:%M:%S')} {len(_orbax_coroutines())} {nodeid}\n")


def pytest_terminal_summary(terminalreporter) -> None:
    t0 = time.perf_counter()
    n = len(gc.get_objects())
    scan = time.perf_counter() - t0
    t0 = time.perf_counter()
    gc.collect()
    collect = time.perf_counter() - t0
    terminalreporter.write_line(f"{n} objects tracked; one scan {scan:.3f} s, one full collection {collect:.3f} s")
    terminalreporter.write_line(f"orbax_log looked in {_looks['blocks']} block(s), {_looks['seconds']:.1f} s in all")
