"""A probe of signals landing at random moments: run by hand, not by the suite (the file name does
not match ``test_*.py``).

    python tests/probe_signals.py train 60            # 60 runs, each signalled once
    python tests/probe_signals.py train 40 --rerun    # and each run again to its end
    python tests/probe_signals.py embed 40 --from 1 --to 6 --seed 3
    python tests/probe_signals.py train 40 --twice 1.5 --rerun   # a second signal up to 1.5 s later
    python tests/probe_signals.py train 40 --kill --rerun        # kill -9, then the same command again
    python tests/probe_signals.py embed 20 --kill --rerun --from 2 --to 8

Each run starts ``elmo-jax train`` (the README's command, to step 60 on the bundled sample, in a
new run dir) or ``elmo-jax embed`` (AllenNLP's test biLM over 20,000 lines) as a terminal starts
it, sends SIGINT, SIGTERM or SIGHUP after a random delay, and sorts how it ended:

- ``stopped``: training's loop saved and stopped ("stopped at step N", exit 128 + N as a process
  the signal ended);
- ``interrupted``: the command's one line, ``elmo-jax train: interrupted (SIGTERM)``, exit 128 + N
  (``LEFT FILES`` if embed left anything of its output);
- ``before its handlers``: the signal came while the interpreter started, before ``elmo_jax.cli``
  set its handlers (the signal's own exit, or Python's KeyboardInterrupt traceback: Python's rule,
  not the CLI's). Until 610ffdc that window held the import of jax, about 0.6 s; the handlers now
  come first, within milliseconds of the interpreter's start;
- ``done first``: the command ended well before the signal;
- ``killed`` (with ``--kill``): SIGKILL's own end, which no program can handle; with ``--rerun``
  the same command must still take the run to its last step;
- ``ended in its exit``: the command had done its work and said what comes next (training
  completed, or saved and stopped on a first signal) or said it was interrupted, and the (second)
  signal came as the interpreter shut down, its handlers gone: the signal's own exit, which the
  shell reports as 128 + N too;
- ``LOST``: it ran to its end as if never signalled;
- ``WEDGED``: still running 60 s after the signal (killed; its stacks are printed when py-spy is
  installed);
- ``TRACEBACK`` / ``OTHER``: a traceback, or any other ending;
- ``NOT RESUMED`` (with ``--rerun``): the same ``train`` command, run again, did not take the run
  to its last step: the signal left the run dir in a state it could not go on from;
- ``NOT REDONE`` (``embed`` with ``--rerun``): the same command, run again, failed, or left a file
  besides its output (a partial file of the killed run, say).

It prints a line per run and the counts. The suite tests each cause found by sending signals so
on its own: ``test_background.py`` (a hand-off wedged), ``test_cli.py::test_a_signal_whose_*``
(a signal lost), ``test_cli.py::test_an_interrupted_program_*`` (an exit held up),
``test_cli.py::test_a_signal_while_the_program_imports_*`` (a traceback, an abort or a lost signal
in the imports), ``test_hooks.py::test_a_signal_becomes_a_request_*`` (a second SIGHUP said as
Ctrl-C) and ``test_atomic.py::test_a_partial_file_*`` (what a kill left beside embed's output).
"""

import argparse
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from helpers import AS_FROM_A_TERMINAL, xla_flags

from elmo_jax.training.setup import saved_steps

ROOT = pathlib.Path(__file__).parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "allennlp_elmo"
BAD = ("LOST", "WEDGED", "TRACEBACK", "LEFT FILES", "NOT RESUMED", "NOT REDONE", "OTHER")


def _command(kind: str, tmp: pathlib.Path) -> list[str]:
    if kind == "train":
        return ["train", "--run-dir", str(tmp / "run"), "--steps", "60", "--save-every", "20", "--no-progress"]
    lines = (ROOT / "elmo_jax" / "data" / "sample" / "heldout.txt").read_text().splitlines()
    (tmp / "in.txt").write_text("\n".join(lines[i % len(lines)] for i in range(20000)) + "\n")
    return ["embed", "--options", str(FIXTURE / "options.json"), "--weights", str(FIXTURE / "lm_weights.hdf5"),
            "--input", str(tmp / "in.txt"), "--output", str(tmp / "o.hdf5"), "--no-progress"]  # fmt: skip


def _outcome(kind: str, sent: signal.Signals, rc: int | None, out: str, err: str, signalled: bool) -> str:
    if rc is None:
        return "WEDGED"
    if not signalled:
        return "done first" if rc == 0 else "OTHER"
    if sent == signal.SIGKILL:
        return "killed" if rc == -sent else "OTHER"
    said = f"elmo-jax {kind}: interrupted" + ("" if sent == signal.SIGINT else f" ({sent.name})")
    lines = err.strip().splitlines()
    if rc == -sent and ("next:" in out + err or (lines and lines[-1] == said)):
        return "ended in its exit"
    if rc == -sent or (rc == -signal.SIGINT and "KeyboardInterrupt" in err and "elmo_jax/cli/commands" not in err):
        return "before its handlers"
    if rc == 1 and 'File "<frozen site>"' in err and err.rstrip().endswith("KeyboardInterrupt"):
        return "before its handlers"  # Ctrl-C in Python's own start-up, its site module
    if rc == 128 + sent and kind == "train" and "stopped at step" in out:
        return "stopped"
    if rc == 0:
        return "LOST"
    if "Traceback" in err:
        return "TRACEBACK"
    return "interrupted" if rc == 128 + sent and lines and lines[-1] == said else "OTHER"


def _stacks(pid: int) -> str:
    spy = shutil.which("py-spy")
    if spy is None:
        return "(install py-spy to see where it waits)"
    return subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True).stdout


def _not_done_again(kind: str, tmp: pathlib.Path, env: dict) -> str | None:
    """Why the same command, run again, did not finish cleanly (None if it did): ``train`` must
    take the run to its last step, leaving no temporary file of a killed write (a hidden file,
    Orbax's temporary step directory) in the run dir; ``embed`` must write its output and nothing
    else beside it (a partial file of the run before must not stay)."""
    r = subprocess.run([sys.executable, "-m", "elmo_jax", *_command(kind, tmp)], cwd=tmp, env=env,
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    if kind == "train":
        steps = saved_steps(str(tmp / "run"))
        left = [str(f.relative_to(tmp)) for f in (tmp / "run").rglob("*") if ".tmp" in f.name or "-tmp-" in f.name]
        if r.returncode == 0 and steps and steps[-1] == 60 and not left:
            return None
        return f"exit {r.returncode}, steps saved {steps}, left {left}: {r.stderr.strip()[-2000:]}"
    files = sorted(os.listdir(tmp))
    if r.returncode == 0 and files == ["in.txt", "o.hdf5"]:
        return None
    return f"exit {r.returncode}, files {files}: {r.stderr.strip()[-2000:]}"


def probe(
    kind: str, runs: int, start: float, end: float, seed: int, rerun: bool, twice: float, kill: bool
) -> dict[str, int]:
    rng = random.Random(seed)
    counts: dict[str, int] = {}
    env = {**os.environ, "XLA_FLAGS": xla_flags(1)}
    for i in range(runs):
        tmp = pathlib.Path(tempfile.mkdtemp(prefix="probe_signals_"))
        sent = signal.SIGKILL if kill else rng.choice([signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
        delay = rng.uniform(start, end)
        p = subprocess.Popen([sys.executable, "-c", AS_FROM_A_TERMINAL, *_command(kind, tmp)], cwd=tmp, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        time.sleep(delay)
        signalled = p.poll() is None
        if signalled:
            p.send_signal(sent)
        t = time.monotonic()
        if twice and signalled:  # a second one, as a user presses Ctrl-C again while the run saves
            time.sleep(rng.uniform(0, twice))
            if p.poll() is None:
                p.send_signal(sent)
        try:
            out, err = p.communicate(timeout=60)
            rc: int | None = p.returncode
        except subprocess.TimeoutExpired:
            err = _stacks(p.pid)
            p.kill()
            out, rc = p.communicate()[0], None
        took = time.monotonic() - t
        outcome = _outcome(kind, sent, rc, out, err, signalled)
        left = sorted(f for f in os.listdir(tmp) if f not in ("in.txt", "run"))
        if kind == "embed" and outcome == "interrupted" and left:
            outcome, err = "LEFT FILES", f"{err}\nleft: {left}"
        if rerun and outcome not in BAD and (why := _not_done_again(kind, tmp, env)):
            outcome, err = "NOT RESUMED" if kind == "train" else "NOT REDONE", f"{err}\nthe rerun: {why}"
        counts[outcome] = counts.get(outcome, 0) + 1
        print(f"{i:3d} {sent.name:7s} at {delay:5.2f} s: {outcome} (exit {rc}, {took:.2f} s after)",
              flush=True)  # fmt: skip
        if outcome in BAD:
            print("    " + "\n    ".join((out + err).strip().splitlines()[-25:]), flush=True)
        shutil.rmtree(tmp, ignore_errors=True)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["train", "embed"])
    parser.add_argument("runs", type=int)
    parser.add_argument("--from", dest="start", type=float, default=0.3, help="earliest delay, s")
    parser.add_argument("--to", dest="end", type=float, default=4.0, help="latest delay, s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--rerun", action="store_true", help="rerun each to its end; it must get there (embed: leaving only its output)"
    )
    parser.add_argument(
        "--kill", action="store_true", help="SIGKILL instead (with --rerun: a kill -9 must lose no run)"
    )
    parser.add_argument(
        "--twice", type=float, default=0.0, help="send a second signal up to this many s after the first"
    )
    args = parser.parse_args()
    counts = probe(args.command, args.runs, args.start, args.end, args.seed, args.rerun, args.twice, args.kill)
    print(", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
    sys.exit(1 if any(k in BAD for k in counts) else 0)


if __name__ == "__main__":
    main()
