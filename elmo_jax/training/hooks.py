"""The pretraining loop's hooks: each does one job at logged or saved steps, and is tested alone.

- ``MetricsWindow``: sums the step metrics between two logged steps and times them;
- ``MetricsFile``: ``metrics.jsonl``, one line per logged step, kept exact across resumes;
- ``Progress``: the tqdm bar, and a beat at each step for whoever watches for a stuck run;
- ``SignalStop``: SIGTERM/SIGINT/SIGHUP become a request to save and stop at the next step boundary
  (``Stopped`` then says the run ended short of its end);
- ``DivergenceGuard``: a blown-up training loss stops the run (``Diverged``) or is warned about.

The held-out evaluator (``evaluate.HeldoutEvaluator``) and the checkpointer are the others.
"""

from __future__ import annotations

import errno
import json
import math
import signal
import sys
import time
from collections.abc import Callable

import jax
import numpy as np

from elmo_jax._util.atomic import is_local, open_binary, write_bytes_atomic
from elmo_jax._util.disk_full import (
    OutOfSpaceError,
    WriteFailed,
    innermost_message,
    os_errno,
    out_of_space_errno,
    reason,
    remedy,
)
from elmo_jax._util.signals import HANGUP, as_interrupt, handling
from elmo_jax._util.terminal import bar_size, is_terminal


class MetricsWindow:
    """The metrics of the steps since the last logged one, read one step late.

    A step's metrics are device arrays; reading them waits for the step. ``add`` is called right
    after the next step is dispatched and reads the step before, so the host never waits for the
    device except at a logged step (``close``), which reads the last one at once.
    ``tokens_per_s`` is step time only: the first step of a session (first batch, compile, first
    run) is reported apart as the first record's ``startup_s``, and the hooks' own work at a
    logged step is off the clock (``restart_clock``).
    """

    KEYS = ("loss_sum_fwd", "loss_sum_bwd", "count", "grad_norm")

    def __init__(self, tokens_per_step: int):
        self.tokens_per_step = tokens_per_step
        self.sums, self.n = dict.fromkeys(self.KEYS, 0.0), 0
        self.pending: dict | None = None
        self.startup: float | None = None
        self.first_run: float | None = None
        self.timed = 0
        self.t0 = time.perf_counter()
        self.last: dict = {}
        """The last record ``close`` made."""

    def add(self, m: dict) -> None:
        """The metrics of the step just dispatched (the first one is waited for, to time startup)."""
        if self.first_run is None:
            # jit compiles inside the call but runs asynchronously: wait for this one run.
            t_run = time.perf_counter()
            jax.block_until_ready(m)
            now = time.perf_counter()
            self.startup, self.first_run, self.t0 = now - self.t0, now - t_run, now
        else:
            self.timed += 1
        if self.pending is not None:
            self._read(self.pending)
        self.pending = m

    def flush(self) -> None:
        if self.pending is not None:
            self._read(self.pending)
            self.pending = None

    def close(self, step: int, epoch: int) -> dict:
        """The record of the window ending at ``step``; the next window starts empty."""
        self.flush()
        # A window of the first step alone has only that step's run to time.
        n, seconds = (self.timed, time.perf_counter() - self.t0) if self.timed else (1, self.first_run or 0.0)
        record = summarise(self.sums, self.n, step, epoch, self.tokens_per_step * n, seconds)
        if self.startup is not None:
            record["startup_s"], self.startup = self.startup, None
        self.sums, self.n = dict.fromkeys(self.KEYS, 0.0), 0
        self.last = record
        return record

    def restart_clock(self) -> None:
        """After the logged step's hooks ran: they are not step time."""
        self.t0, self.timed = time.perf_counter(), 0

    def saved(self) -> dict:
        """The window so far, for a checkpoint's host file: the sums of its steps, and how many. A
        run resumed from a step between logged ones (a signal's stop) then logs its first record
        over the same steps as the unbroken run, not over the steps since the restore alone."""
        self.flush()  # a save waits for the step anyway
        return {"sums": np.array([self.sums[k] for k in self.KEYS], np.float64), "n": np.int64(self.n)}

    def resume(self, saved: dict) -> None:
        """Starts from a checkpoint's ``saved()`` window."""
        self.sums, self.n = dict(zip(self.KEYS, map(float, saved["sums"]))), int(saved["n"])

    def _read(self, m: dict) -> None:
        # Replicated: any local copy. One device_get starts every copy before it waits on one.
        for k, v in zip(self.KEYS, jax.device_get([m[k].addressable_data(0) for k in self.KEYS])):
            self.sums[k] += float(v)
        self.n += 1


def summarise(sums: dict, n: int, step: int, epoch: int, tokens: int, seconds: float) -> dict:
    """A ``metrics.jsonl`` record from a window's sums over ``n`` steps."""
    fwd, bwd = sums["loss_sum_fwd"] / sums["count"], sums["loss_sum_bwd"] / sums["count"]
    loss = 0.5 * (fwd + bwd)
    return {
        "step": step,
        "epoch": epoch,
        "loss": loss,
        "loss_fwd": fwd,
        "loss_bwd": bwd,
        "perplexity": math.exp(min(loss, 50.0)),
        "grad_norm": sums["grad_norm"] / max(n, 1),
        "tokens_per_s": tokens / max(seconds, 1e-9),
        "time": time.time(),
    }


class MetricsFile:
    """``metrics.jsonl``: one JSON line per logged step, written by process 0.

    A run resumed from step ``start`` drops the lines of later steps (logged before a crash, after
    the checkpoint it resumes from): those steps run and log again, and each step is logged once.
    Lines that are not JSON objects with a step are kept as they are.

    A local file is appended to. An object store (``gs://``) has no append: the whole file is
    rewritten, as one object write, at each log from the lines held here. That is O(lines) per log,
    but small: a 100k-step run logged every 100 steps has 1,000 lines, ~0.3 MB.
    """

    def __init__(self, path: str, start: int):
        self.path, self.local = path, is_local(path)
        try:
            with open_binary(path) as f:
                raw = f.read()
        except FileNotFoundError:
            raw = b""
        lines = raw.splitlines()  # bytes: whatever is there is kept byte for byte
        self.lines = [line for line in lines if not _logged_after(line, start)]
        torn = raw and not raw.endswith(b"\n")  # a crash mid-append: the next line must not join it
        if len(self.lines) < len(lines) or torn:
            self._rewrite()
        if self.local:
            self.lines = []  # appended to: nothing to hold

    def add(self, record: dict) -> None:
        line = json.dumps(record).encode("utf-8")
        try:
            if self.local:
                with open(self.path, "ab") as f:
                    f.write(line + b"\n")
            else:
                self.lines.append(line)
                self._rewrite()
        except OSError as e:  # a full disk, a quota, a failing mount: the loop saves, then stops
            raise _not_logged(self.path, e) from None

    def _rewrite(self) -> None:
        write_bytes_atomic(self.path, b"".join(line + b"\n" for line in self.lines))


def _not_logged(path: str, e: OSError) -> WriteFailed:
    """The one-line error for a metrics line the file system refused (``e``)."""
    space = out_of_space_errno(e)
    code = space if space is not None else (os_errno(e) or errno.EIO)
    why = reason(space) if space is not None else innermost_message(e)
    fix = remedy(space) if space is not None else "once the cause is fixed,"
    said = f"{path}: not written: {why}; {fix} rerun the same command: the run resumes from its newest checkpoint"
    return OutOfSpaceError(said, path, code) if space is not None else WriteFailed(said, path, code)


def _record(line: bytes) -> dict | None:
    """A metrics line's record, or None for a line that is not a JSON object."""
    try:
        record = json.loads(line)
    except ValueError:  # not JSON (UnicodeDecodeError is a ValueError)
        return None
    return record if isinstance(record, dict) else None


def _logged_after(line: bytes, start: int) -> bool:
    step = (_record(line) or {}).get("step")
    return isinstance(step, int) and step > start


def logged(path: str, step: int) -> dict:
    """The last record ``metrics.jsonl`` at ``path`` holds for ``step`` ({} if none, or no file)."""
    try:
        with open_binary(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    return next((r for r in map(_record, reversed(lines)) if r is not None and r.get("step") == step), {})


class SignalStop:
    """SIGTERM, SIGINT and SIGHUP ask the loop to save and stop at the next step boundary.

    SIGHUP is the terminal going away (an ssh session that dropped): by default it ends the
    process at once, losing the steps since the last checkpoint. An ignored SIGTERM or SIGHUP
    (``nohup``) stays ignored (``elmo_jax._util.signals.handling``, whose rule the command line
    shares outside the loop)."""

    def __init__(self):
        self.signum = 0  # the first signal's number; 0 while none came
        self._handling = handling(self._handle, (signal.SIGTERM, signal.SIGINT, HANGUP))

    @property
    def requested(self) -> bool:
        return self.signum != 0

    def __enter__(self):
        self._handling.__enter__()
        return self

    def _handle(self, signum, frame):
        if self.requested:  # a second one: stop now, as the command line's handlers stop it
            raise as_interrupt(signum)
        self.signum = signum

    def __exit__(self, *exc):
        self._handling.__exit__(*exc)


class Progress:
    """The run's progress: the tqdm bar of process 0 (nothing elsewhere, or when ``enabled`` is
    False), and ``on_progress(doing)`` (every process), called with what the run does next at
    each step boundary and each held-out window, so that a watcher can tell a slow run from a
    stuck one, and say where it stuck."""

    def __init__(self, enabled: bool, total: int | None, start: int, on_progress: Callable[[str], None] | None = None):
        self.bar, self.quiet = None, True
        self.step, self.total = start, total
        self.on_progress = on_progress
        if enabled:
            from tqdm.auto import tqdm

            # Into a log file or a pipe each redraw is written for good (a \r, not a terminal's
            # overwrite): 65 KB for the README's one-minute run. There, a redraw a minute.
            self.quiet = tqdm.__module__ != "tqdm.notebook" and not is_terminal(sys.stderr)
            self.bar = tqdm(
                total=total,
                initial=start,
                unit="step",
                **bar_size(sys.stderr),
                **({"mininterval": 60.0} if self.quiet else {}),
            )
        # The first step reads the first batch and compiles: the longest wait of most runs.
        self.beat(f"running step {start + 1}, this run's first (its batch, then its compile)")

    def update(self) -> None:
        """A step completed."""
        self.step += 1
        if self.bar is not None:
            if self.bar.n == self.bar.initial:
                # The first step's batch and compile are left out of the bar's clock (and so of its
                # elapsed time): counted, the README's run showed 20:16 left at step 9, where 2:15
                # were.
                self.bar.unpause()
            self.bar.update(1)
        last = self.total is not None and self.step >= self.total
        self.beat(f"ending the run at step {self.step}" if last else f"running step {self.step + 1}")

    def beat(self, doing: str) -> None:
        if self.on_progress is not None:
            self.on_progress(doing)

    def show(self, record: dict) -> None:
        if self.bar is not None:
            self.bar.set_postfix(
                loss=f"{record['loss']:.3f}",
                ppl=f"{record['perplexity']:.1f}",
                tok_s=f"{record['tokens_per_s']:.0f}",
                refresh=not self.quiet,  # into a file, shown at the next of its redraws a minute
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Stopped(KeyboardInterrupt):
    """A signal stopped the run short of its end, once the step it reached was saved: ``pretrain``
    raises it where a finished run returns, so that a caller (a notebook's interrupt, a script
    under a scheduler's SIGTERM) cannot take the stop for the end. The same run dir resumes.

    ``step``: the step saved; ``signum``: the signal (another process's, when ``here`` is False);
    ``metrics``: the record ``pretrain`` returns at the end, for the steps since the last logged one.
    A ``KeyboardInterrupt``, as the signal's own would have been: ``except Exception`` lets it by,
    and the command line exits 128 + ``signum`` (143 for SIGTERM), as a process killed by it."""

    def __init__(self, message: str, step: int, signum: int, here: bool, metrics: dict):
        super().__init__(message)
        self.step, self.signum, self.here, self.metrics = step, signum, here, metrics


class Diverged(RuntimeError):
    """The training loss diverged and the run stopped (``DivergenceGuard``, mode ``"stop"``).

    ``step``: the logged step that decided it; ``last_good``: the newest step whose parameters are
    known to give a healthy loss (see ``DivergenceGuard``)."""

    def __init__(self, message: str, step: int, last_good: int):
        super().__init__(message)
        self.step, self.last_good = step, last_good


class DivergenceGuard:
    """Stops (or warns about) a run whose training loss has blown up, from the logged records alone.

    A record is bad when its loss is not finite, or above ``ln V + margin``: a model that guesses
    uniformly over the vocabulary scores ln V, so a trained one above it has lost what it learnt.
    (The sampled softmax's loss can pass ln V in a run's first steps, by up to about 0.6 nats on
    the bundled sample, hence the margin.) A non-finite record decides at once; a finite one
    after ``patience`` bad records in a row, so that one noisy window does not stop a run.

    ``last_good`` is the newest step whose parameters gave a healthy loss: a record at step ``L``
    averages the losses of steps up to ``L``, computed with the parameters saved after step
    ``L - 1`` and before, so a healthy record proves ``L - 1``. The steps saved after it, in a
    run that diverged, hold a state that is diverged or about to be (see ``loop.pretrain``).
    It reads what the metrics window has already brought to the host: no extra device sync.
    """

    MODES = ("stop", "warn")

    def __init__(self, n_vocab: int, start: int, margin: float = 1.0, patience: int = 3, mode: str = "stop"):
        if mode not in self.MODES:
            raise ValueError(f"on_divergence must be one of {', '.join(self.MODES)}; got {mode!r}")
        if patience < 1:
            raise ValueError(f"divergence patience must be 1 or more; got {patience}")
        self.threshold, self.margin, self.patience, self.mode = math.log(n_vocab) + margin, margin, patience, mode
        self.streak, self.warned = 0, False
        self.last_good = start  # the state a session starts from was judged by the session before

    @property
    def suspect(self) -> bool:
        """Whether the newest record was bad: a state saved now might be a diverged one."""
        return self.streak > 0

    def check(self, record: dict) -> str | None:
        """Reads one logged record; returns why the run diverged (when it just did), else None.
        In mode ``"stop"`` a divergence raises ``Diverged`` instead."""
        loss, step = record["loss"], record["step"]
        finite = all(math.isfinite(record[k]) for k in ("loss", "loss_fwd", "loss_bwd", "grad_norm"))
        if finite and loss <= self.threshold:
            self.streak, self.warned, self.last_good = 0, False, max(self.last_good, step - 1)
            return None
        self.streak += 1
        if (finite and self.streak < self.patience) or self.warned:  # warn once per bad stretch
            return None
        self.warned = True
        why = (
            f"loss {loss:.6g}, not finite"
            if not finite
            else f"loss {loss:.6g} above {self.threshold:.2f} (ln V + {self.margin:g}) for {self.streak} logged steps"
        )
        if self.mode == "stop":
            raise Diverged(f"the training loss diverged at step {step}: {why}", step, self.last_good)
        return why
