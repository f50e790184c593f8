"""The per-step agreement of a multi-process run (``elmo_jax._util.processes.StepAgreement``),
through ``benchmarks/bench_agree.py``: two processes on 127.0.0.1, every result checked against
the max each process computes itself, and a second agreement object after the first."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import jax
import pytest

from elmo_jax._util.processes import StepAgreement, StoreFailed

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


class FakeStore:
    """jax.distributed's client as the agreement uses it, over a dict: the other processes' keys
    are put in beforehand (``late``: keys that appear only once waited on, as a peer arriving)."""

    def __init__(self, late: dict[str, str] | None = None, fail: str | None = None):
        self.kv: dict[str, str] = {}
        self.late = dict(late or {})
        self.fail, self.calls = fail, []

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if self.fail == name:
            raise jax.errors.JaxRuntimeError("UNAVAILABLE: failed to connect to all addresses\nmore")

    def key_value_set(self, key, value):
        self._call("set")
        self.kv[key] = value

    def key_value_dir_get(self, prefix):
        self._call("dir_get")
        return [(k, v) for k, v in self.kv.items() if k.startswith(prefix + "/")]

    def blocking_key_value_get(self, key, timeout_ms):
        self._call("get")
        if key in self.late:
            self.kv[key] = self.late.pop(key)
        if key not in self.kv:
            raise jax.errors.JaxRuntimeError(f"DEADLINE_EXCEEDED: GetKeyValue() timed out with key: {key}")
        return self.kv[key]

    def key_value_delete(self, key):
        self._call("delete")
        self.kv.pop(key, None)


def _agreement(store: FakeStore, n: int = 3, me: int = 0) -> StepAgreement:
    agree = StepAgreement.__new__(StepAgreement)
    agree.n, agree.me, agree.round, agree.client, agree.prefix = n, me, 0, store, "p"
    return agree


def test_a_round_reads_the_directory_once_when_every_process_is_there_and_deletes_two_rounds_back():
    store = FakeStore()
    agree = _agreement(store)
    for r in range(4):
        store.kv.update({f"p/{r}/1": f"{r} 5 0", f"p/{r}/2": f"1 {r} 7"})
        store.calls.clear()
        assert agree([2, 0, r]) == [max(2, r), 5, 7]
        assert store.calls == ["set", "dir_get"] + (["delete"] if r >= 2 else [])  # not a get per process
    assert sorted(k for k in store.kv if k.endswith("/0")) == ["p/2/0", "p/3/0"]  # rounds 0 and 1 deleted


def test_a_process_that_comes_late_is_waited_for_and_then_read():
    store = FakeStore(late={"p/0/2": "9 9 9"})
    store.kv["p/0/1"] = "0 0 0"
    assert _agreement(store)([1, 2, 3]) == [9, 9, 9]
    assert store.calls == ["set", "dir_get", "get", "dir_get"]


@pytest.mark.parametrize("where", ["set", "dir_get", "get"])
def test_a_store_that_fails_is_one_line_naming_the_key_not_a_device_error(where):
    """(A JaxRuntimeError left as it is would be read by the loop as the device's failure.)"""
    store = FakeStore(fail=where)
    store.kv["p/0/1"] = "0 0 0"  # process 2 missing: the agreement waits on its key
    with pytest.raises(StoreFailed, match=r"^the step agreement could not use jax.distributed's key-value store \(p/0"
                       r".*UNAVAILABLE: failed to connect to all addresses\); the coordination service") as e:  # fmt: skip
        _agreement(store)([1, 2, 3])
    assert "\n" not in str(e.value) and not isinstance(e.value, jax.errors.JaxRuntimeError)
