"""``elmo-jax train``'s watch for a stuck run: no progress for ``--stall-timeout`` s.

A run can stop making progress without failing: a read from a network file system that never
returns, a deadlock, a device that no longer answers; across hosts, any of these on one process
leaves the others waiting in a collective. Nothing raises, and jax.distributed's heartbeats go on
(a C++ thread sends them), so the run would wait for ever. This watch writes every thread's
Python stack to a file, says so in one line, and exits 1, so that a person or a scheduler can
restart the run from its newest checkpoint."""

from __future__ import annotations

import atexit
import faulthandler
import os
import tempfile
import threading

from elmo_jax._util.atomic import is_local
from elmo_jax._util.clock import WatchClock
from elmo_jax.cli import multihost


class StallWatch:
    """Stops the process when ``beat`` (``pretrain``'s ``on_progress``) has not been called for
    ``timeout`` seconds. Armed by ``start``, before the vocabulary, the checkpoint and the first
    step: a read that hangs there is as stuck as one later. So the timeout must exceed the longest
    wait between beats that is not a stall: the first step's compile, a held-out evaluation's first
    window (its compile), a vocabulary shard's count.

    ``peers``: the multi-host watch, through which the other processes are told and every process
    leaves together; None for one process."""

    def __init__(self, timeout: float, run_dir: str, peers: multihost.PeerWatch | None = None):
        self.timeout, self.run_dir, self.peers = float(timeout), run_dir, peers
        self.period = max(0.1, min(5.0, self.timeout / 20))
        self.clock = WatchClock(self.period)  # a suspended run (Ctrl-Z, SLURM) is not a stuck one
        self.last = 0.0  # set by start
        self.doing = "starting the run"
        self.quit = threading.Event()
        self.thread = threading.Thread(target=self._run, name="elmo-jax stall watch", daemon=True)

    def beat(self, doing: str) -> None:
        """``doing``: what the run does from now on, for the line said if it stops there."""
        self.last, self.doing = self.clock.now(), doing

    def start(self) -> None:
        self.last = self.clock.now()
        self.thread.start()
        atexit.register(self.close)

    def close(self) -> None:
        self.quit.set()

    def _run(self) -> None:
        while not self.clock.wait(self.quit):
            if self.clock.now() - self.last > self.timeout:
                self._stalled()
                return

    def _stalled(self) -> None:
        """Writes the stacks, says where, and exits 1 (through ``peers`` with several processes)."""
        doing = self.doing
        name = "stalled.txt" if self.peers is None else f"stalled.p{self.peers.me}.txt"
        path = os.path.join(self.run_dir if is_local(self.run_dir) else tempfile.gettempdir(), name)
        try:
            with open(path, "w") as f:
                f.write(f"no progress for {self.timeout:g} s while {doing}; every thread's Python stack:\n\n")
                f.flush()
                faulthandler.dump_traceback(f, all_threads=True)
            where = f"every thread's stack is in {path}"
        except OSError as e:
            where = f"its threads' stacks could not be written to {path} ({e.strerror or e})"
        here = "" if self.peers is None else f"process {self.peers.me} of {self.peers.n}: "
        n = 1 if self.peers is None else self.peers.n
        line = (
            f"{self.run_dir}: {here}no progress for {self.timeout:g} s (--stall-timeout) while {doing}: the run "
            f"is stuck (a read that never returns, a deadlock, a device that no longer answers); {where}; "
            f"{multihost.resume_from(self.run_dir, n)}"
        )
        if self.peers is None:
            multihost.leave(f"elmo-jax train: error: {line}")
        else:
            self.peers.stop(line)
