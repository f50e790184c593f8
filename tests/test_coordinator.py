"""Process 0's keeper of jax's coordination service (``elmo_jax.cli.coordinator``), without a run:
when it lets go, and what it says when the port is taken. The multi-host runs that rely on it
are in ``test_distributed.py``."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
from helpers import FIXTURES, free_port, run_elmo_jax

from elmo_jax.cli.coordinator import Coordinator, CoordinatorError, answer_at, listens, live_connections

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/net/tcp"), reason="counts connections in /proc")
# Each test but the first starts the keeper, a process (pyproject.toml's rule for the slow tier).
slow = pytest.mark.slow
TRAIN = FIXTURES / "bilm_tf_train"


SETTINGS_FRAME = bytes(3) + b"\x04" + bytes(5)  # an empty HTTP/2 SETTINGS frame, as a gRPC server sends first
HTTP1_ERROR = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n"  # a web server's answer to the preface


@contextlib.contextmanager
def _listener(close_after: float | None = None, answer: bytes | None = None):
    """A TCP listener on a free loopback port, closed after ``close_after`` s. ``answer``: sent to
    each connection (``SETTINGS_FRAME``: a gRPC service, another run's; ``HTTP1_ERROR``: another
    program); None: it never answers (a stopped process's port)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()

    def reply() -> None:
        while True:
            try:
                conn, _ = s.accept()
            except OSError:  # closed
                return
            with conn:
                conn.sendall(answer)

    if answer is not None:
        threading.Thread(target=reply, daemon=True).start()
    timer = threading.Timer(close_after, s.close) if close_after is not None else None
    if timer is not None:
        timer.start()
    try:
        yield f"127.0.0.1:{s.getsockname()[1]}"
    finally:
        if timer is not None:
            timer.cancel()
        s.close()


def _free_address() -> str:
    return f"127.0.0.1:{free_port()}"


def _keeper(address: str, linger: float = 60.0, wait: float = 1.0) -> Coordinator:
    keeper = Coordinator.start(address, 2, heartbeat=30, shutdown=30, linger=linger, wait=wait)
    assert keeper is not None
    return keeper


def _end(keeper: Coordinator) -> bool:
    """Its parent's good end, as at exit: ``done``, then the pipe closed; whether it let go."""
    keeper.done()
    keeper.proc.stdin.close()
    return _gone(keeper, within=10)


def _gone(keeper: Coordinator, within: float) -> bool:
    try:
        keeper.proc.wait(timeout=within)
        return True
    except subprocess.TimeoutExpired:
        return False


def test_live_connections_counts_this_processes_established_ones():
    before = live_connections()
    assert before is not None
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        with socket.create_connection(server.getsockname()) as client:
            accepted, _ = server.accept()
            with accepted:
                assert live_connections() == before + 2  # both ends are this process's
            client.shutdown(socket.SHUT_RDWR)
    assert live_connections() == before  # closed, or closing: no longer established


@slow
def test_the_keeper_serves_until_its_parent_ends_then_until_its_last_client_leaves():
    """Its parent gone without a word (killed), the keeper serves on while a client is connected,
    and lets go once none is: the other processes of a run outlive a dead process 0 only while
    the service does, and leave within --heartbeat-timeout."""
    address = _free_address()
    keeper = _keeper(address)
    assert listens(address)
    host, port = address.split(":")
    client = socket.create_connection((host, int(port)))
    time.sleep(0.5)  # accepted by the service, as a run's clients were long before
    keeper.proc.stdin.close()  # the parent's end, as a SIGKILL closes it: no "done"
    assert not _gone(keeper, within=3), "it let go with a client still connected"
    assert listens(address)
    client.close()
    assert _gone(keeper, within=10), "it kept serving with no client left"
    assert not listens(address)


@slow
def test_the_keeper_serves_without_importing_jax():
    """The keeper needs jaxlib's service alone: importing jax too took 2.3 s of process 0's
    start-up (its own import after the keeper's ``serving``). Negative control, the keeper
    importing ``jax._src.lib``: True."""
    script = (
        "import builtins, io, sys\n"
        "from elmo_jax.cli import coordinator\n"
        "say = builtins.print\n"
        "def print(*a, **k):\n"
        "    say(*a, **k)\n"
        "    if a == ('serving',):\n"
        "        say('jax' in sys.modules, flush=True)\n"
        "builtins.print = print\n"
        "coordinator.DONE_GRACE = 0\n"
        "sys.stdin = io.TextIOWrapper(io.BytesIO(b'done'))\n"
        "coordinator.main([sys.argv[1], '1', '10', '10', '0', '0'])\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", script, _free_address()], capture_output=True, text=True, timeout=60, check=False
    )
    assert r.stdout.split() == ["serving", "False"], (r.stdout, r.stderr[-2000:])


@slow
def test_a_keeper_told_done_lets_go_once_the_others_have_left():
    address = _free_address()
    keeper = _keeper(address)
    keeper.done()
    keeper.done()  # again, as at exit after leave(): nothing more happens
    assert not _gone(keeper, within=2), "it let go before its parent ended (jax's shutdown barrier needs it)"
    keeper.proc.stdin.close()  # the parent's end
    assert _gone(keeper, within=10)
    assert not listens(address)


@slow
def test_a_keeper_whose_parent_died_lets_go_after_linger_even_with_a_client_left():
    """A client that never leaves (a host lost without a word) holds the service at most
    ``linger`` seconds: then it goes, and jax ends that client, as it would have at once before."""
    address = _free_address()
    keeper = _keeper(address, linger=2.0)
    host, port = address.split(":")
    with socket.create_connection((host, int(port))):
        time.sleep(0.5)
        keeper.proc.stdin.close()
        assert _gone(keeper, within=10)


def test_a_port_taken_by_another_program_is_said_in_one_line_without_waiting(capfd):
    """Another program (it does not speak HTTP/2) is refused at once, not waited for as a previous
    run's service letting go (before: up to --heartbeat-timeout plus 25 s, then a line)."""
    with _listener(answer=HTTP1_ERROR) as address:
        t0 = time.monotonic()
        with pytest.raises(CoordinatorError) as e:
            Coordinator.start(address, 2, heartbeat=30, shutdown=30, linger=60, wait=60)
        assert time.monotonic() - t0 < 10
    assert str(e.value) == (
        f"--coordinator {address}: another program answers there; stop it, or give every process another port"
    )
    assert "waiting" not in capfd.readouterr().err


@pytest.mark.parametrize("answer", [SETTINGS_FRAME, None], ids=["a grpc service", "a silent port"])
def test_a_service_or_a_silent_port_that_does_not_let_go_is_said_after_the_wait(capfd, answer):
    """A port that says nothing (a suspended job's service) is waited for as a service may be."""
    with _listener(answer=answer) as address:
        with pytest.raises(CoordinatorError) as e:
            Coordinator.start(address, 2, heartbeat=30, shutdown=30, linger=60, wait=1)
    assert "something answers there already" in capfd.readouterr().err
    assert str(e.value) == (
        f"--coordinator {address}: something still holds the port after 1 s (another run's coordination "
        "service, or a stopped process); stop it, or give every process another port"
    )


@slow
def test_a_previous_keeper_still_letting_go_is_waited_for(capfd):
    """A restart soon after process 0 died: the last run's service may still serve its leaving
    processes. The new process 0 says so, waits for it to end, then starts its own."""
    with _listener(close_after=1.5, answer=SETTINGS_FRAME) as address:
        keeper = _keeper(address, wait=20)
    try:
        assert "something answers there already" in capfd.readouterr().err
        assert listens(address)
    finally:
        _end(keeper)


@slow
def test_the_probe_tells_a_keeper_from_another_program_and_from_a_silent_port():
    """The probe that tells a previous run's service (waited for) from another program (refused)."""
    address = _free_address()
    keeper = _keeper(address)
    try:
        assert answer_at(address) == "http2"
    finally:
        assert _end(keeper)
    with _listener(answer=HTTP1_ERROR) as other:
        assert answer_at(other) == "other"
    with _listener() as silent:
        assert answer_at(silent, timeout=0.5) == "silent"
    assert answer_at(address) == "other"  # nothing there any more: refused


@slow
def test_the_keeper_ignores_the_signals_a_terminal_sends_its_group():
    """Ctrl-C, a closed terminal or a scheduler's SIGTERM reach the whole group: process 0 stops
    on them in agreement with the others, which still need the service to do so."""
    import signal

    address = _free_address()
    keeper = _keeper(address)
    try:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            keeper.proc.send_signal(sig)
        assert not _gone(keeper, within=1.5)
        assert listens(address)
    finally:
        assert _end(keeper)


@slow
def test_the_cli_says_a_taken_coordinator_port_in_one_line(tmp_path):
    """``elmo-jax train --process-id 0`` where another program holds the --coordinator port: one
    line naming the flag, exit 1, before jax.distributed starts (which would have crashed in gRPC)."""
    lines = (TRAIN / "data.txt").read_text().splitlines()
    for i in range(2):  # a shard per process
        (tmp_path / f"shard-{i}.txt").write_text("\n".join(lines[i::2]) + "\n")
    with _listener(answer=HTTP1_ERROR) as address:
        r = run_elmo_jax(
            "train", "--train-files", tmp_path / "shard-*.txt", "--vocab", TRAIN / "vocab.txt", "--run-dir", tmp_path / "run",
            "--no-progress", "--coordinator", address, "--num-processes", "2", "--process-id", "0",
            "--heartbeat-timeout", "1", timeout=120,
        )  # fmt: skip
    assert r.returncode == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    [line] = [l for l in r.stderr.splitlines() if "error" in l]
    assert line == (
        f"elmo-jax train: error: --coordinator {address}: another program answers there; stop it, or give every "
        "process another port"
    )


def test_a_keeper_too_slow_to_start_is_said_as_slow_not_as_a_port_taken(monkeypatch):
    """(Before: "could not listen at [::]:PORT (its process ended with -9); check that the port is
    free", the -9 being our own kill at the timeout.)"""
    import elmo_jax.cli.coordinator as coordinator

    monkeypatch.setattr(coordinator, "START_TIMEOUT", 0.001)  # far less than a Python start
    address = _free_address()
    with pytest.raises(CoordinatorError) as e:
        Coordinator.start(address, 2, heartbeat=30, shutdown=30, linger=60, wait=1)
    assert str(e.value) == (
        f"--coordinator {address}: jax's coordination service did not start within 0 s (its process had not yet "
        "imported jaxlib: a host too loaded?); rerun the same command"
    )
