"""``elmo-jax train`` across processes (jax.distributed): the start, and a watch on the other processes.

jax.distributed ends a process from C++ (SIGABRT, with a stack trace that blames "another task")
when the processes do not all join in time, or when one of them stops sending heartbeats. Both
deadlines are kept here from Python a little before jax's own, so that every process stops with
one line that names the process at fault and the checkpoint to resume from. A process that fails
alone, where the training loop's agreement cannot carry its error, tells the others through the
same key-value store instead of leaving them in a collective that will not complete.

jax.distributed runs its coordination service inside process 0, whose death would then end the
others at once from C++ (a Python ``missed_heartbeat_callback`` cannot stand in: it is not
handed the error, ``std::bad_cast``). So process 0 keeps the service in a child process
(``elmo_jax.cli.coordinator``), and its death is found by this watch like any other's."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import re
import sys
import threading
import time
from typing import Any

from elmo_jax._util.arguments import about
from elmo_jax._util.clock import WatchClock
from elmo_jax._util.processes import kv_client
from elmo_jax.cli.coordinator import SPARE_BIND, Coordinator, listens
from elmo_jax.config import ConfigError

# jax.distributed's own heartbeat timeout, as a multiple of --heartbeat-timeout (plus 10 s): a
# backstop, late enough that this watch has stopped every process first.
JAX_HEARTBEAT_FACTOR = 2
JAX_SHUTDOWN_TIMEOUT = 300  # jax.distributed.initialize's default, for the service process 0 keeps
# The kept service's own heartbeat timeout (seconds). Past it, the service takes every silent
# process for dead and jax ends the rest from C++; and after a suspend of the whole job (SLURM's,
# a laptop's sleep) it finds every process silent at once (30 s of suspend at a 20 s timeout
# ended both processes of tests/probe_suspend.py). Deaths are this watch's to find, within
# --heartbeat-timeout, so the service waits a day.
SERVICE_HEARTBEAT = 24 * 3600
KEY = "elmo_jax/alive"
CLUSTERS = {"slurm": "SLURM", "ompi": "Open MPI"}  # jax's names of the launchers read here (``from_cluster``)


def coordinator(args: argparse.Namespace) -> str | None:
    """The coordinator's ``host:port``: ``--coordinator``, else JAX_COORDINATOR_ADDRESS; None for
    a run of one process."""
    return args.coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")


def from_cluster(args: argparse.Namespace) -> str | None:
    """Fills what the flags leave unset of ``--coordinator``, ``--num-processes`` and
    ``--process-id`` from a cluster's environment (a SLURM job step, or Open MPI's ``mpirun``), as
    ``jax.distributed.initialize()`` would: so ``srun -n 2 elmo-jax train ...`` is one run of 2
    processes, not 2 runs writing one run dir. Known before jax starts, the ids let every process
    check the shards, and process 0 keep the coordination service apart, as with the flags.
    ``--num-processes 1`` keeps one process whatever the environment says.

    Returns the line that says so (process 0's to print), or None where nothing was filled."""
    address = coordinator(args)
    if args.num_processes == 1 or (address and args.num_processes and args.process_id is not None):
        return None
    try:
        from jax._src import clusters

        # Only the launchers whose variables say it all: a Cloud TPU's or Kubernetes' environment
        # is found by asking a server, which every single-process run would then wait for.
        env = next((e for e in clusters.ClusterEnv._cluster_types if e.name in CLUSTERS and e.is_env_present()), None)
        if env is None:
            return None
        n = int(args.num_processes or env.get_process_count())
        i = int(env.get_process_id() if args.process_id is None else args.process_id)
        if not address and n > 1:
            port = os.environ.get("JAX_COORDINATOR_PORT")
            address = args.coordinator = env.get_coordinator_address(args.init_timeout, port)
    except Exception:  # noqa: BLE001 - jax's private cluster API changed: jax finds them itself, as before
        return None
    if not address:  # one process in the job: a run of one, as without the cluster
        return None
    args.num_processes, args.process_id = n, i
    kind = CLUSTERS[env.name]
    return f"process {i} of {n}, from {kind}'s environment (coordinator {address})"


def check_processes(args: argparse.Namespace, source) -> None:
    """The multi-host flags against each other and the shards, before jax.distributed starts: so
    every process refuses them at once and alike, and jax never meets a process id out of range
    (it aborts that process itself, "Unexpected task")."""
    from elmo_jax.text.sources import shard_for_process

    n, i, address = args.num_processes, args.process_id, coordinator(args)
    if n is not None and n < 1:
        raise about(ConfigError(f"num_processes must be 1 or more; got {n}"), "num_processes")
    if i is not None and i < 0:
        raise about(ConfigError(f"process_id must be 0 or more; got {i}"), "process_id")
    if n and i is not None and not 0 <= i < n:
        raise about(
            ConfigError(f"process_id must be 0 to {n - 1} (num_processes - 1); got {i}"), "process_id", "num_processes"
        )
    if ((n or 1) > 1 or (i or 0) > 0) and not address:  # else each host would train a run of its own into one run dir
        raise about(
            ConfigError(
                "several processes need a coordinator: the host:port of process 0 (or JAX_COORDINATOR_ADDRESS), "
                "given to every process"
            ),
            "coordinator",
        )
    port = re.fullmatch(r"\S+:(\d+)", address or "")
    if address and not (port and 1 <= int(port[1]) <= 65535):  # jax would fail on it, or wait for ever
        raise about(
            ConfigError(f"coordinator {address!r}: expected host:port, a port from 1 to 65535, e.g. host0:8476"),
            "coordinator",
        )
    if n:
        shard_for_process(source, 0, n)


def check_count(args: argparse.Namespace) -> None:
    """This process's ``--num-processes`` against the run's count, once jax.distributed has
    started: process 0's count is the service's, and a process told another one joins all the
    same, its shards dealt for a run of another size."""
    import jax

    n, count = args.num_processes, jax.process_count()
    if n and n != count:
        raise about(
            ConfigError(
                f"num_processes {n}, but the run has {count} processes (process 0's num_processes): give "
                "every process the same"
            ),
            "num_processes",
        )


def start(args: argparse.Namespace) -> PeerWatch | None:
    """jax.distributed for ``--coordinator`` (or JAX_COORDINATOR_ADDRESS), and the watch on the other
    processes; None for a single-process run."""
    import jax

    address = coordinator(args)
    if not address:
        return None
    # jax.distributed waits for every process to join, and past its initialization timeout it
    # aborts the process from C++. This watchdog says what is missing in one line a little before
    # that, and exits: nothing is written yet.
    joined = threading.Event()
    error: ConfigError | None = None
    # Process 0 runs the coordinator, and waits a little longer: the processes that did join must
    # say so first, as a process that finds the coordinator gone says nothing answered there.
    wait = args.init_timeout + (min(15.0, max(2.0, args.init_timeout / 10)) if args.process_id in (0, None) else 0.0)
    heartbeat = JAX_HEARTBEAT_FACTOR * args.heartbeat_timeout + 10
    keeper = _keep_service(args, address, heartbeat)
    watchdog = threading.Timer(wait, _not_joined, (args, address, joined, keeper))
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(
            coordinator_address=args.coordinator,
            num_processes=args.num_processes,
            process_id=args.process_id,
            initialization_timeout=args.init_timeout + 30,
            heartbeat_timeout_seconds=heartbeat,
            shutdown_timeout_seconds=JAX_SHUTDOWN_TIMEOUT,
            # With the service kept apart, the one jax starts in process 0 serves nobody.
            coordinator_bind_address=None if keeper is None else SPARE_BIND,
        )
    except ValueError as e:  # what jax could not find out itself: the ids, on a host that does not say them
        error = about(
            ConfigError(f"coordinator {address}: jax.distributed: {e} Give num_processes and process_id"),
            "coordinator",
            "num_processes",
            "process_id",
        )
    finally:
        joined.set()
        watchdog.cancel()
    if error is not None:  # raised here, outside the clause: jax's traceback is not the message
        raise error
    client = kv_client()
    if jax.process_count() == 1 or client is None:
        return None
    watch = PeerWatch(
        client,
        jax.process_index(),
        jax.process_count(),
        args.heartbeat_timeout,
        args.run_dir,
        keeper=keeper,
    )
    watch.start()
    return watch


def _keep_service(args: argparse.Namespace, address: str, heartbeat: int) -> Coordinator | None:
    """On process 0 of a run whose processes are numbered before jax starts (the flags, or a
    cluster's environment: ``from_cluster``), jax's coordination service started in a child
    process (``elmo_jax.cli.coordinator``); None elsewhere."""
    if args.process_id != 0 or (args.num_processes or 0) < 2 or sys.platform == "win32":  # win32: no select on pipes
        return None
    # The others find process 0 dead within --heartbeat-timeout and a few of their ticks.
    linger = args.heartbeat_timeout + 4 * PeerWatch.period_for(args.heartbeat_timeout) + 5
    return Coordinator.start(
        address,
        args.num_processes,
        heartbeat=max(heartbeat, SERVICE_HEARTBEAT),
        shutdown=JAX_SHUTDOWN_TIMEOUT,
        linger=linger,
        wait=linger,
    )


def _not_joined(args: argparse.Namespace, address: str, joined: threading.Event, keeper: Coordinator | None) -> None:
    """The start watchdog's end (``start``): one line on stderr, then exit 1 at once."""
    if joined.is_set():
        return
    n = f" {args.num_processes}" if args.num_processes else ""
    if args.process_id not in (None, 0) and not listens(address):
        why = (
            f"no coordinator answered there within {args.init_timeout} s (process 0 starts it); start process 0 "
            "with the same --coordinator, check the host and port, or raise --init-timeout"
        )
    else:
        why = (
            f"not all of the{n} processes joined the run within {args.init_timeout} s; start each one with the "
            f"same --coordinator and --num-processes and its own --process-id, or raise --init-timeout"
        )
    leave(f"elmo-jax {args.command}: error: --coordinator {address}: {why}", keeper=keeper)


def leave(line: str, code: int = 1, keeper: Coordinator | None = None) -> None:
    """``line`` on stderr, then exit at once: past jax's deadlines, the interpreter's teardown
    would wait on jax.distributed's shutdown barrier for a process that is not coming.
    ``keeper``: process 0's service, told that the others have left or are leaving."""
    if line:
        print(line, file=sys.stderr)
    if keeper is not None:
        keeper.done()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _on_every_process(line: str) -> str:
    """How another process's error line ends when this one says it: its own advice (ours end
    with "rerun ..." or "restart ...") goes for every process; a line without any gets some."""
    if "rerun" in line or "restart" in line:
        return " (every process alike)"
    return "; once its cause is fixed, restart every process with the same command"


class PeerWatch:
    """Whether the other processes of the run are still there, through jax.distributed's key-value
    store. Every ``period`` seconds each process writes ``KEY/<its id>`` = ``"<count> <state>"``
    (``running``, ``ended``, or ``failed own|follow <its error line>``) and reads everyone's.

    While this process works, a background thread stops it with one line (exit 1) when another
    process has not counted on for ``timeout`` seconds (killed, out of memory, its host lost), or
    has failed and this one is still working ``grace`` seconds later (an error of its own that no
    collective carried here). A process that has ended or failed is never taken for dead: it has
    said what happened to it.

    ``client``: jax.distributed's client (``key_value_set``, ``key_value_dir_get``); ``keeper``:
    on process 0, the coordination service's process (``start``)."""

    def __init__(self, client: Any, me: int, n: int, timeout: float, run_dir: str, keeper: Coordinator | None = None):
        self.client, self.me, self.n, self.timeout, self.run_dir = client, me, n, float(timeout), run_dir
        self.keeper = keeper
        self.period = self.period_for(self.timeout)
        # Silences are measured on it: after a suspend of the whole run, no process is dead.
        self.clock = WatchClock(self.period)
        self.grace = max(5.0, self.timeout / 4)
        self.state = "running"
        self.count = 0
        self.started = self.clock.now()
        self.seen: dict[int, tuple[str, float]] = {}  # the other's word, and when it last changed
        self.failed_at: dict[int, float] = {}  # when the other was first seen failed
        self.lock = threading.Lock()
        self.quit = threading.Event()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="elmo-jax peer watch", daemon=True)

    @staticmethod
    def period_for(timeout: float) -> float:
        """Seconds between a process's ticks, for a ``timeout`` of silence that means dead."""
        return max(0.25, min(5.0, timeout / 20))

    def start(self) -> None:
        self._tick()
        self.thread.start()
        # Before the interpreter's teardown destroys jax.distributed's client under the thread.
        atexit.register(self.close)

    def close(self) -> None:
        self.quit.set()
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(timeout=2 * self.period + 5)

    def ended(self) -> None:
        """This process's work ended well: it is never taken for dead from now on."""
        self._unless_stopping()
        self._say("ended")

    def failed(self, line: str, follow: bool = False, wait: bool = False) -> None:
        """This process's work ended with an error, ``line`` (``follow``: because another failed).

        ``wait``: an error this code did not foresee, which a peer's death can cause (a collective
        that lost its peer). Waits until every other process has said how it ended, or until the
        watch has taken one for dead and stopped this process with that line instead."""
        self._unless_stopping()
        self._say(f"failed {'follow' if follow else 'own'} {line}")
        deadline = time.monotonic() + self.timeout + 3 * self.period
        while wait and time.monotonic() < deadline and not all(self._ended(k) for k in self._others()):
            time.sleep(self.period)
            self._unless_stopping()

    def _unless_stopping(self) -> None:
        """Waits for the exit when the watch is stopping the process: its shutdown cancels what the
        main thread waits on, whose error is then no news."""
        if self.stopping.is_set():
            threading.Event().wait()

    def _say(self, state: str) -> None:
        with self.lock:
            self.state = " ".join(state.split())  # one line in the store, whatever the error said
        self._tick()

    def _run(self) -> None:
        while not self.clock.wait(self.quit):
            self._tick()
            with self.lock:
                working = self.state == "running"
            verdict = self._first_verdict(working)
            if verdict is not None:
                dead, line = verdict
                self.stop(line, kind="dead" if dead else "follow", dead=dead)

    def _first_verdict(self, working: bool) -> tuple[bool, str] | None:
        """The verdict (``_verdict``) that stops this process, a death before a failure: with a
        process dead, the others must not wait for it at jax's shutdown barrier."""
        verdicts = [v for k in self._others() if (v := self._verdict(k, working)) is not None]
        return max(verdicts, key=lambda v: v[0]) if verdicts else None

    def _tick(self) -> None:
        """Counts on in the store, and reads everyone's word."""
        with self.lock:
            self.count += 1
            word = f"{self.count} {self.state}"
        try:
            self.client.key_value_set(f"{KEY}/{self.me}", word, allow_overwrite=True)
            words = self.client.key_value_dir_get(KEY)
        except Exception:  # noqa: BLE001 - the store unreachable is no word, as a silent process is
            return
        now = self.clock.now()
        with self.lock:
            for key, value in words:
                k = int(key.rsplit("/", 1)[1])
                if k != self.me and (k not in self.seen or self.seen[k][0] != value):
                    self.seen[k] = (value, now)
                    if _parse(value)[0] == "failed":
                        self.failed_at.setdefault(k, now)

    def _others(self) -> list[int]:
        return [k for k in range(self.n) if k != self.me]

    def _ended(self, k: int) -> bool:
        with self.lock:
            return k in self.seen and _parse(self.seen[k][0])[0] in ("ended", "failed")

    def _word(self, k: int) -> tuple[str, str, str, float, float]:
        """Process ``k``'s (state, kind, line), when its word last changed, and when it was first
        seen failed (now if never)."""
        with self.lock:
            word, since = self.seen.get(k, ("0 running", self.started))
            failed_at = self.failed_at.get(k, self.clock.now())
        return (*_parse(word), since, failed_at)

    def _dead(self, k: int) -> bool:
        """Whether process ``k`` is silent past the timeout, or said that another one died."""
        state, kind, _, since, _ = self._word(k)
        return kind == "dead" or (state == "running" and self.clock.now() - since > self.timeout)

    def _verdict(self, k: int, working: bool) -> tuple[bool, str] | None:
        """Whether process ``k`` stops this one: (a death, the line to say), or None.

        ``working``: this process's own work goes on, so a failure of ``k`` that no collective
        brought here after ``grace`` seconds stops it; once its own work has ended (well or not),
        only a death does: ``k``'s, or one that ``k`` found and said."""
        state, kind, line, _, failed_at = self._word(k)
        if kind == "dead":
            return True, line
        if self._dead(k):
            return True, (
                f"process {k} of {self.n} stopped answering: no word from it for {self.timeout:g} s "
                "(--heartbeat-timeout); it was killed, ran out of memory, or lost its host; "
                f"{resume_from(self.run_dir, self.n)}"
            )
        if state == "failed" and working and self.clock.now() - failed_at >= self.grace:
            return False, f"process {k} of {self.n} stopped with an error: {line}{_on_every_process(line)}"
        return None

    def stop(self, line: str, kind: str = "own", dead: bool = False) -> None:
        """Says ``line`` as this process's error, tells the others, and exits 1 (does not return).

        Every process must leave so that jax.distributed ends none of them from C++. With one
        dead, the others cannot pass its shutdown barrier: they leave at once, process 0 last, as
        its service ends with it where jax keeps it (and its keeper lets go when it says so).
        With all of them alive (one failed), they leave together through the barrier, where the
        failed one waits.

        ``kind``: ``own`` (this process's error), ``follow`` (another's), ``dead`` (another died)."""
        with self.lock:  # the peer watch and the stall watch may both come here: the first says it
            first = not self.stopping.is_set()
            self.stopping.set()
        if not first:
            threading.Event().wait()
        print(f"elmo-jax train: error: {line}", file=sys.stderr, flush=True)
        self._say(f"failed {kind} {line}")
        dead = dead or any(self._dead(k) for k in self._others())
        if not dead:
            import jax

            with contextlib.suppress(Exception):
                jax.distributed.shutdown()
        elif self.me == 0:
            deadline = time.monotonic() + self.grace + 3 * self.period
            while time.monotonic() < deadline and not all(self._dead(k) or self._ended(k) for k in self._others()):
                time.sleep(self.period)
                self._tick()
            time.sleep(self.period)  # those that have said so are leaving
        leave("", keeper=self.keeper)


def _parse(word: str) -> tuple[str, str, str]:
    """(state, kind, line) of a process's word in the store, ``"<count> <state> [<kind> <line>]"``."""
    _, state, *said = word.split(" ", 3)
    kind, line = (*said, "", "")[:2]
    return state, kind, line


def resume_from(run_dir: str, processes: int) -> str:
    """What a restart resumes from, in words: of every process, or of the one (``processes``)."""
    from elmo_jax.training.setup import saved_steps

    again = "restart every process with the same command" if processes > 1 else "rerun the same command"
    try:
        steps = saved_steps(run_dir)
    except Exception:  # noqa: BLE001 - a listing that fails (a remote store gone) leaves the steps unsaid
        return f"{again} to resume from its newest checkpoint"
    if not steps:
        return f"no checkpoint was saved before it: {again}"
    return f"step(s) {', '.join(map(str, steps))} are intact: {again} to resume from step {steps[-1]}"
