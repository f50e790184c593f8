"""A probe of a multi-host run suspended as a whole, for longer than jax's own heartbeat timeout:
run by hand, not by the suite (the file name does not match ``test_*.py``).

    python tests/probe_suspend.py 30      # seconds of suspend

Two CLI processes (as ``test_distributed.py`` starts them) with ``--heartbeat-timeout 5``, so
jax.distributed's own timeout is 20 s (``multihost.JAX_HEARTBEAT_FACTOR``). Once step 4 is saved,
both get SIGSTOP (and process 0's keeper of the coordination service: a scheduler's suspend stops
every process of the job), then SIGCONT after the given seconds; 12 s later each still running gets SIGTERM.
It prints whether they ran on and how they ended, and asserts nothing: the suite's
``test_a_suspend_of_the_whole_run_longer_than_the_timeouts_is_survived`` suspends for 20 s, past
jax's clients' timeout (16 s there), to keep the suite short. The service process 0 keeps waits a
day for a silent process (``multihost.SERVICE_HEARTBEAT``); at 20 s, 30 s of suspend ended both.
"""

import os
import pathlib
import signal
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from test_distributed import SHARDS, _keeper_of, _scenario, _start_workers, _wait_for_a_checkpoint, _wait_workers

from elmo_jax.training.setup import saved_steps


def main(pause: float) -> None:
    tmp = pathlib.Path(tempfile.mkdtemp())
    run_dir, args = _scenario(tmp, SHARDS)
    args = args[:-2] + ["--save-every", "4", "--heartbeat-timeout", "5"]
    procs, logs = _start_workers(tmp, 0, args, str(tmp / "cache"))
    _wait_for_a_checkpoint(run_dir, procs)
    print(f"saved {saved_steps(str(run_dir))}; suspending both for {pause:g} s", flush=True)
    every = [pid for pid in (_keeper_of(procs[0]), *(p.pid for p in procs)) if pid is not None]
    for pid in every:
        os.kill(pid, signal.SIGSTOP)
    time.sleep(pause)
    for pid in every:
        os.kill(pid, signal.SIGCONT)
    time.sleep(12)
    print(f"12 s after the resume, exit codes (None: running): {[p.poll() for p in procs]}", flush=True)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    texts = _wait_workers(procs, logs, timeout=60, expect_ok=False)
    print(f"exit codes: {[p.returncode for p in procs]}")
    for i, text in enumerate(texts):
        said = [line for line in text.splitlines() if line.startswith(("stopped at step", "elmo-jax train: error"))]
        print(f"process {i}: {said}")


if __name__ == "__main__":
    main(float(sys.argv[1]))
