"""jax.distributed's coordination service in a process of its own, kept by process 0 of a run.

jax.distributed runs the service inside process 0, so when process 0 is killed (SIGKILL, the
kernel's out-of-memory killer) the service dies with it, and jax ends every other process at
once from C++ (SIGABRT), before any Python code can speak. Kept in a child process of process 0,
the service outlives it: the other processes' peer watch (``multihost.PeerWatch``) then finds
process 0 silent and stops each with one line, as for any other process. Process 0 joins the
service as a client, as the others do. jax still starts a service inside process 0; that one is
bound to a spare loopback port and never used.

The keeper lives as long as its parent: it reads its stdin until the parent ends. Then it serves
on while clients are still connected (on Linux it counts its established TCP connections), at
most ``linger`` seconds after a parent that died (long enough for the others to find the death
and leave) or ``DONE_GRACE`` after one that said ``done``. Its exit ends the service, and ends
from C++ any process still connected.

It ignores SIGINT, SIGTERM and SIGHUP, which a terminal or a scheduler sends to the whole
process group: process 0 stops on them together with the others, and then lets it go. SIGSTOP
and SIGTSTP still suspend it with its group, so a suspended job's service does not count the
pause against anyone's heartbeats.

``Coordinator.start`` runs ``main`` in the child, with the service's bind address, the number of
processes, jax's heartbeat and shutdown timeouts, whether the service is recoverable, and the
linger.
"""

from __future__ import annotations

import atexit
import os
import select
import signal
import socket
import subprocess
import sys
import time

# jax's own service for process 0, which no client uses: "localhost" binds whichever loopback
# address the host has, and port 0 any free port.
SPARE_BIND = "localhost:0"
# After a parent that ended well, the others are past jax's shutdown barrier and leaving.
DONE_GRACE = 5.0
START_TIMEOUT = 120.0  # for the keeper to import jaxlib and start listening, on a loaded host


class CoordinatorError(RuntimeError):
    """The service could not be started at the ``--coordinator`` address; says what to do."""


def listens(address: str) -> bool:
    """Whether something accepts a TCP connection at ``host:port``."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
            return True
    except (OSError, ValueError):
        return False


# An HTTP/2 client's connection preface with an empty SETTINGS frame (RFC 9113, 3.4).
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes(3) + b"\x04" + bytes(5)


def answer_at(address: str, timeout: float = 2.0) -> str:
    """What answers a client's HTTP/2 preface at ``host:port``: ``"http2"``, a SETTINGS frame, as a
    gRPC service (jax's coordination service) sends; ``"other"``, anything else or a close (a web
    server, a database: it need not be waited for); ``"silent"``, nothing within ``timeout`` (a
    service of a suspended job, a busy one: waited for, as a service may be)."""
    host, _, port = address.rpartition(":")
    head = b""
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as s:
            s.sendall(_HTTP2_PREFACE)
            while len(head) < 9 and (chunk := s.recv(9 - len(head))):
                head += chunk
    except TimeoutError:
        return "other" if head else "silent"
    except (OSError, ValueError):
        return "other"
    return "http2" if len(head) == 9 and head[3] == 0x04 else "other"  # frame type byte 4: SETTINGS


class Coordinator:
    """Process 0's handle on the keeper (``start``); ``done`` when process 0 leaves knowing the
    others have left or are leaving (also run at exit)."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.said = False
        atexit.register(self.done)

    @classmethod
    def start(
        cls, address: str, num_processes: int, *, heartbeat: int, shutdown: int, linger: float, wait: float
    ) -> Coordinator | None:
        """Starts the keeper serving the run at ``address``'s port, and returns once it listens.

        ``heartbeat``, ``shutdown``: jax.distributed's timeouts for the service (seconds). A
        service still listening there, such as a previous run's keeper that has not yet let go,
        is waited for up to ``wait`` seconds; another program (an answer that is not HTTP/2's) is
        refused at once (``answer_at``). Returns None where this jax has no service to
        start apart (process 0 then runs it itself, as jax does); raises ``CoordinatorError``
        where the port is taken or the service cannot bind it."""
        if listens(address):
            if answer_at(address) == "other":
                raise CoordinatorError(
                    f"--coordinator {address}: another program answers there; stop it, or give every process "
                    "another port"
                )
            print(
                f"--coordinator {address}: something answers there already (a previous run's coordination service "
                f"lets go once its processes have left); waiting up to {wait:g} s for it to end",
                file=sys.stderr,
                flush=True,
            )
            deadline = time.monotonic() + wait
            while listens(address) and time.monotonic() < deadline:
                time.sleep(0.5)
            if listens(address):
                raise CoordinatorError(
                    f"--coordinator {address}: something still holds the port after {wait:g} s (another run's "
                    "coordination service, or a stopped process); stop it, or give every process another port"
                )
        from jax._src import distributed

        # What jax.distributed.initialize would give its own service.
        bind = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS") or "[::]:" + address.rsplit(":", 1)[1]
        recoverable = int(bool(getattr(getattr(distributed, "_ENABLE_RECOVERABILITY", None), "value", False)))
        argv = [bind, num_processes, heartbeat, shutdown, recoverable, linger]
        # The child imports this very package, wherever the parent found it.
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        proc = subprocess.Popen(
            # Not "-m": the package's import of this module would then run it twice.
            [sys.executable, "-c", _MAIN, *map(str, argv)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # gRPC's log lines, for as long as it serves: nobody reads them
            # It starts no backend; if anything did, it must not be a second claim on a GPU.
            env={**os.environ, "PYTHONPATH": path, "JAX_PLATFORMS": "cpu"},
        )
        word = _first_line(proc, START_TIMEOUT)
        if word == "serving":
            return cls(proc)
        silent = not word and proc.poll() is None  # alive, and said nothing: slow, not refused
        proc.kill()
        proc.wait()
        if word.startswith("unavailable"):
            return None
        if silent:
            raise CoordinatorError(
                f"--coordinator {address}: jax's coordination service did not start within {START_TIMEOUT:.0f} s "
                "(its process had not yet imported jaxlib: a host too loaded?); rerun the same command"
            )
        raise CoordinatorError(
            f"--coordinator {address}: jax's coordination service could not listen at {bind} "
            f"({word or f'its process ended with {proc.returncode}'}); check that the port is free on this host, "
            "or give every process another one"
        )

    def done(self) -> None:
        """Tells the keeper to let go soon after this process ends (once said, nothing more).

        The pipe stays open: the keeper counts its grace from this process's end, which closes
        it. At exit that end comes after jax's shutdown barrier, which needs the service."""
        if self.said or self.proc.stdin is None:
            return
        self.said = True
        try:
            self.proc.stdin.write(b"done\n")
            self.proc.stdin.flush()
        except (OSError, ValueError):  # the keeper gone, or the pipe closed
            pass


_MAIN = """
import sys
try:
    from elmo_jax.cli.coordinator import main
except ImportError as e:
    print(f"unavailable: {e}", flush=True)
    sys.exit(1)
sys.exit(main(sys.argv[1:]))
"""


def _first_line(proc: subprocess.Popen, timeout: float) -> str:
    """The keeper's first line on stdout ("" if it ends or says nothing within ``timeout``)."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline().decode(errors="replace").strip() if ready else ""


def live_connections() -> int | None:
    """This process's established TCP connections (None where /proc cannot say: not Linux)."""
    try:
        inodes = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                link = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue  # closed while listed
            if link.startswith("socket:["):
                inodes.add(link[len("socket:[") : -1])
        count = 0
        for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
            if os.path.exists(table):
                with open(table) as f:
                    # Columns: sl, local, remote, state (01: established), ..., inode (the 10th).
                    count += sum(1 for row in list(f)[1:] if (c := row.split())[3] == "01" and c[9] in inodes)
        return count
    except (OSError, IndexError):
        return None


def main(argv: list[str]) -> int:
    """The keeper (in the child): serves, says so on stdout, and lets go as the module doc says."""
    bind, n, heartbeat, shutdown, recoverable, linger = argv
    for name in ("SIGINT", "SIGTERM", "SIGHUP"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    try:
        try:
            # jaxlib's extension alone: importing jax (which the parent has checked against this
            # jaxlib) took 2.3 s of process 0's start-up here, 0.2 s this way.
            from jaxlib import _jax
        except ImportError:
            from jax._src.lib import _jax

        start = _jax.get_distributed_runtime_service
    except (ImportError, AttributeError) as e:  # a jax that moved it: process 0 serves, as jax does
        print(f"unavailable: {e}", flush=True)
        return 1
    try:
        _service = start(  # held: the service serves as long as this reference lives
            bind,
            int(n),
            heartbeat_timeout=int(heartbeat),
            shutdown_timeout=int(shutdown),
            recoverable=recoverable == "1",
        )
    except TypeError as e:  # other arguments in another jax
        print(f"unavailable: {e}", flush=True)
        return 1
    except Exception as e:  # noqa: BLE001 - said to the parent, which says it in one line
        print(f"{type(e).__name__}: {e}", flush=True)
        return 1
    print("serving", flush=True)
    said = sys.stdin.buffer.read()  # until the parent ends, whichever way
    deadline = time.monotonic() + (DONE_GRACE if b"done" in said else float(linger))
    while time.monotonic() < deadline and live_connections() != 0:
        time.sleep(0.2)
    sys.stdout.flush()
    os._exit(0)  # the service's threads go with the process; nothing waits on them
