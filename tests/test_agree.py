"""The per-step agreement of a multi-process run (``elmo_jax._util.processes.StepAgreement``),
through ``benchmarks/bench_agree.py``: two processes on 127.0.0.1, every result checked against
the max each process computes itself, and a second agreement object after the first."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _bench(calls: int, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_agree.py"), "--calls", str(calls)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "benchmarks")]), **(env or {})},
    )


@pytest.mark.slow
def test_the_store_agrees_as_the_collective_does_without_waiting_for_the_device():
    r = _bench(12)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "every result checked" in r.stdout
    # The collective queues behind the step in flight, always; the store is host to host. (How
    # often it beats the step depends on the load of the machine's cores, which run the "device".)
    [collective] = re.findall(
        r"collective, behind a step in flight: .*returned before the step ended: (\d+) of 12", r.stdout
    )
    assert collective == "0", r.stdout
    assert re.search(r"key-value store, behind a step in flight: .*returned before the step ended: \d+ of 12", r.stdout)
