"""Checkpoints of a training run: Orbax for the global state, a small per-process file for the data position.

A run directory holds::

    checkpoints/<step>/          Orbax: ``state`` (params, optimizer state, step, RNG; the softmax
                                 and its accumulators in ``RowLayout`` slot order, split by rows
                                 over the devices), ``lstm`` (the carried state of every global
                                 row), and JSON ``meta`` (the options, the vocabulary's hash and
                                 size, the global row count, the softmax layout, the format)
    host_state/<step>.p<i>.npz   per process: its data position (epoch, shard, sentence, the
                                 rows' buffered pairs) and the softmax fetch capacity its batches
                                 were planned with
    options.json, vocab.txt      what the run was started with (written again on a resume that
                                 finds them unreadable)
    metrics.jsonl                one JSON line per logged step

The state is saved as global ``jax.Array``s: each process writes the shards it holds, and a
restore onto another mesh reads what each device needs (Orbax reshards). Orbax commits a step by
renaming a finished temporary directory, so a crash mid-save leaves nothing that looks like a
checkpoint; a step whose files are damaged anyway is skipped with a warning and the previous one
is used. The host file is written (temp + rename; on an object store such as ``gs://``, one
object write) before the Orbax save starts, and is only read for steps Orbax has committed. On
``gs://`` Orbax commits a step with a ``commit_success.txt`` file instead of a rename.

Format 1 (before the device mesh): ``state`` held the softmax in id order, ``[V, P]``, and the
host file held the process's LSTM rows too. ``restore_latest`` reads both formats.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import hashlib
import io
import itertools
import json
import logging
import os
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from elmo_jax._util.atomic import atomic_path, is_local
from elmo_jax._util.device_memory import CHECK_THE_DEVICE, device_error
from elmo_jax._util.disk_full import (
    OutOfSpaceError,
    WriteFailed,
    exception_chain,
    free_space,
    innermost_message,
    os_errno,
    out_of_space_errno,
    reason,
    remedy,
    size,
)
from elmo_jax._util.processes import agree_max, kv_client
from elmo_jax._util.runtime import absl_errors_only
from elmo_jax.model.vocabulary import Vocabulary

FORMAT = 2
# How long (seconds) the processes of a resumed run wait for each other to list the newest step.
# NFS's attribute cache keeps a directory's listing on one host for up to 60 s by default.
VISIBLE_WAIT = 90


class CheckpointError(ValueError):
    """A run directory cannot be resumed as asked."""


class SaveFailed(WriteFailed):
    """A save failed in the file system (an I/O error, a vanished or unwritable directory): ``str()``
    is the one line to show. The failed step's partial files are removed where they can be;
    ``kept`` are the steps intact on disk."""

    def __init__(self, message: str, path: str, code: int | None, step: int, kept: list[int]):
        super().__init__(message, path, code)
        self.step, self.kept = step, kept


class DiskFull(SaveFailed, OutOfSpaceError):
    """A save failed for lack of space (or a quota, or a read-only file system)."""


def vocab_hash(vocab: Vocabulary) -> str:
    return hashlib.sha256("\n".join(vocab.words).encode("utf-8")).hexdigest()


def damaged_values(restored: dict) -> str | None:
    """Why a restored checkpoint (``{"state": ..., "lstm": ...}``) is unusable though it was read:
    bytes a disk flipped inside an array's chunk still decode, as NaNs that a resume trains on
    and that eval and export hand on. None when every value is finite. Each array is reduced
    where it lies, whatever its sharding, and one bool each comes back (no copy to the host): a
    collective over the arrays' devices, which every process calls once all have read the
    checkpoint."""
    named = [
        (jax.tree_util.keystr(path, simple=True, separator="/"), x)
        for path, x in jax.tree_util.tree_leaves_with_path(restored)
        if jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    finite = _all_finite([x for _, x in named]) if named else []
    bad = next((name for (name, _), ok in zip(named, finite) if not ok.addressable_data(0)), None)
    return None if bad is None else f"its {bad} holds NaN or inf values"


@jax.jit
def _all_finite(arrays: list) -> list:
    return [jnp.isfinite(x).all() for x in arrays]


def _flatten(tree: dict, prefix: str = "") -> dict[str, np.ndarray]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}/"))
        elif isinstance(v, np.ndarray) and v.dtype == object:
            # Token strings hold no whitespace: one newline-joined string is lossless.
            out[f"{prefix}{k}#words"] = np.array("\n".join(str(w) for w in v))
        else:
            out[f"{prefix}{k}"] = np.asarray(v)
    return out


def _unflatten(flat: dict[str, np.ndarray]) -> dict:
    out: dict[str, Any] = {}
    for key, v in flat.items():
        *parents, leaf = key.split("/")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        if leaf.endswith("#words"):
            text = str(v)
            node[leaf[:-6]] = np.array(text.split("\n") if text else [], dtype=object)
        else:
            node[leaf] = v
    return out


def checkpoint_bytes(shared: dict, lstm: dict) -> int:
    """About what a checkpoint of these global arrays takes on disk (their bytes, uncompressed)."""
    return sum(x.nbytes for x in jax.tree_util.tree_leaves((shared, lstm)))


def _device_error(run_dir, step: int, e: BaseException | None) -> RuntimeError | None:
    """The one-line error for a restore of ``step`` that the device failed or ran out of memory
    in (not damage: falling back would move good checkpoints aside), else None."""
    return (
        None
        if e is None
        else device_error(
            e,
            out_of_memory_said=lambda xla: (
                f"{run_dir}: restoring checkpoint {step} ran the devices out of memory ({xla}); nothing was moved: "
                "rerun on more devices or devices with more memory"
            ),
            knob="devices",
            failed_said=lambda xla: (
                f"{run_dir}: the device failed while restoring checkpoint {step} ({xla}); nothing was moved: "
                f"{CHECK_THE_DEVICE} rerun the same command"
            ),
        )
    )


def _denied(e: BaseException) -> bool:
    """Whether ``e`` (or an exception it was raised from) is a permission error of the OS."""
    return os_errno(e) in (errno.EACCES, errno.EPERM)


def _stop_waiting_writes() -> list[threading.Thread]:
    """Tells this process's Orbax write threads not to write; returns those still alive.

    A thread still waiting for its step's directory returns without writing once its signal
    comes; one already writing finishes. The signal is a key in the distributed store, set by
    whichever process sends it, so a process whose save failed says this before it tells the
    others: a peer that lets its own waiting writes go sets the same key, which would otherwise
    send this process's writes into a directory it has given up (and is removing). Orbax's
    internals (0.12); under a version without them, nothing is stopped."""
    try:
        from orbax.checkpoint._src.futures import future as orbax_future

        alive = [t for t in threading.enumerate() if isinstance(t, orbax_future._SignalingThread) and t.is_alive()]
        for t in alive:
            t.cancel()
    except (ImportError, AttributeError, TypeError):
        return []
    return alive


def _release_stranded_writes() -> list[threading.Thread]:
    """Ends the Orbax write threads still waiting for a failed save's step directory; returns
    those it let go.

    Each write waits for a signal that its step's directory was made, for up to Orbax's barrier
    timeout (300 s). When making it failed (the checkpoints directory gone, a file, unwritable),
    the signal never comes, and as the threads are not daemons the process cannot exit for five
    minutes. Stopped (``_stop_waiting_writes``), then sent their signal, they return without
    writing. Orbax's internals (0.12): a version without them keeps the wait, nothing worse."""
    stopped = _stop_waiting_writes()
    try:
        from orbax.checkpoint._src.futures import future as orbax_future

        for t in stopped:
            orbax_future.set_signals(t._receive_signals, operation_id=t._operation_id)  # type: ignore[attr-defined]
    except (ImportError, AttributeError, TypeError):
        return []
    return stopped


def _end_stranded_writes(timeout: float = 60.0) -> None:
    """Releases the waiting writes (``_release_stranded_writes``) and waits for every write thread
    to end, for up to ``timeout`` seconds in all.

    Its own function so that no frame keeps a thread past it: a stopped thread still holds its
    write's coroutine, never awaited, and a frame kept by the run's error (a local naming the last
    thread) would have it collected, and warn, after the run's one line."""
    deadline = time.monotonic() + timeout
    for thread in _release_stranded_writes():
        threading.Thread.join(thread, timeout=max(0.0, deadline - time.monotonic()))  # Orbax's join raises


class _FailedRead:
    """What a process's Orbax read returns in place of raising: see ``_reach_the_barrier_on_failure``."""

    def __init__(self, error: Exception):
        self.error = error


def _reach_the_barrier_on_failure(manager: ocp.CheckpointManager) -> None:
    """Makes a read that fails on this process still reach Orbax's restore barrier.

    Orbax's restore reads, then waits at a barrier for every process. A process whose read raised
    skipped the barrier and went on to agree on a fall-back (``restore_latest``) while the others
    still waited there: their collectives mismatched, and the run died with a traceback. Here the
    read's exception is returned instead, as a ``_FailedRead``, through the barrier, and
    ``Checkpointer._read`` raises it after.

    Orbax's own code can also raise before the read, on one process (the step's directory not
    found or unreadable there, its checks): that process then passes the barrier itself, with
    Orbax's key, before the error goes on. Orbax's internals (0.12: the ``CheckpointManager``'s
    ``_checkpointer._restore``, and its barrier's key and processes); under a version without
    them, the mismatch stays."""
    inner: Any = getattr(manager, "_checkpointer", None)
    read = getattr(inner, "_restore", None)
    if read is None:
        return
    reads = [0]  # the reads begun: a restore that raised with none begun skipped the barrier

    def read_or_failure(directory, args):
        reads[0] += 1
        try:
            return read(directory, args=args)
        except Exception as e:  # noqa: BLE001 - raised again by Checkpointer._read, past the barrier
            return _FailedRead(e)

    inner._restore = read_or_failure
    if not hasattr(inner, "_barrier_sync_key_prefix") or not hasattr(inner, "_active_processes"):
        return
    restore = manager.restore
    key = ocp.multihost.unique_barrier_key("Checkpointer:restore", prefix=inner._barrier_sync_key_prefix)

    def restore_reaching_the_barrier(step, *args, **kwargs):
        before = reads[0]
        try:
            return restore(step, *args, **kwargs)
        except Exception:
            if reads[0] == before and jax.process_count() > 1:
                ocp.multihost.sync_global_processes(key, processes=inner._active_processes)
            raise

    manager.restore = restore_reaching_the_barrier


class _PeerSaveFailed(Exception):
    """What a process's save raises when its own writes went through and another process's did not."""


class _FailedWrite:
    """A commit future that raises ``error``: the handler's blocking phase failed (see below)."""

    def __init__(self, error: Exception):
        self.error = error

    def result(self, timeout: float | None = None) -> None:
        raise self.error

    def cancel(self) -> None:
        pass


class _AgreedCommit:
    """The one commit future Orbax's background thread waits for, in place of a save's own ones
    (see ``_commit_only_if_every_process_wrote``): it waits for them, keeping their failure, says
    in the key-value store under ``key`` whether this process wrote, and reads the others' word."""

    def __init__(self, client: Any, key: str, futures: list):
        self.client, self.key, self.futures = client, key, futures
        self.me = jax.process_index()
        self.others = [p for p in range(jax.process_count()) if p != self.me]
        self.failed: list[BaseException] = []  # this process's own failure
        self.peers_failed: list[int] = []

    def result(self, timeout: float | None = None) -> None:
        start = time.monotonic()

        def left() -> float:
            return 300.0 if timeout is None else timeout - (time.monotonic() - start)

        try:
            for f in self.futures:
                while True:
                    try:
                        f.result(timeout=max(0.0, min(1.0, left())))
                        break
                    except TimeoutError:
                        if left() <= 0:
                            raise  # Orbax's own timeout, in its own words
                        # A write waiting for a directory that another process failed to make
                        # would wait out Orbax's timeout: once a peer has said it failed, this
                        # save is lost, and its waiting writes are let go without writing.
                        if not self.peers_failed and (said := self._failed_by_word(blocking_ms=None)):
                            self.peers_failed = said
                            _release_stranded_writes()
        except TimeoutError:
            raise
        except concurrent.futures.CancelledError:
            if not self.peers_failed:
                raise  # cancelled by Orbax: its own clean path
        except Exception as e:  # noqa: BLE001 - raised by this process's next wait, past the barriers
            self.failed.append(e)
            _stop_waiting_writes()  # before the others hear of it: see there
        self.client.key_value_set(f"{self.key}/{self.me}", "failed" if self.failed else "wrote", allow_overwrite=True)
        if not self.peers_failed:
            self.peers_failed = self._failed_by_word(blocking_ms=max(1, int(left() * 1000)))

    def _failed_by_word(self, blocking_ms: int | None) -> list[int]:
        """The other processes that said they failed: of those that have said so far (one read of
        the key's directory, however many processes), or with ``blocking_ms``, once each has."""
        if blocking_ms is None:
            try:
                words = dict(self.client.key_value_dir_get(self.key))
            except Exception:  # noqa: BLE001 - the store unreachable: the barrier after this says so
                return []
            return [p for p in self.others if words.get(f"{self.key}/{p}", "wrote") != "wrote"]
        said = []
        for p in self.others:
            try:
                word = self.client.blocking_key_value_get(f"{self.key}/{p}", blocking_ms)
            except Exception:  # noqa: BLE001 - a timeout is Orbax's barrier's to report, after this
                continue
            if word != "wrote":
                said.append(p)
        return said

    def cancel(self) -> None:
        for f in self.futures:
            f.cancel()

    def every_process_wrote(self) -> bool:
        return not self.failed and not self.peers_failed

    def error(self) -> BaseException | None:
        if self.failed:
            return self.failed[0]
        return _PeerSaveFailed(f"process(es) {self.peers_failed}") if self.peers_failed else None

    def forget(self) -> None:
        """Deletes this process's word. Every process read it before Orbax's write barrier, which
        comes before its commit barrier: past both, it can go."""
        with contextlib.suppress(Exception):
            self.client.key_value_delete(f"{self.key}/{self.me}")


def _commit_only_if_every_process_wrote(manager: ocp.CheckpointManager) -> None:
    """Makes an Orbax save that fails on one process of several end alike on all of them.

    Orbax's async save has each process write its shards in a background thread, which then waits
    at a barrier for every process before the primary commits the step. A process whose writes
    failed skipped that barrier: the others waited there for Orbax's 300 s timeout, and the run
    hung past it. A failure in the handler's blocking phase skipped the main thread's later
    barriers (collectives) instead, and both processes aborted in the mismatch. Here:

    - a failure of the handler's blocking phase becomes a failed commit future, so the main thread
      goes through the rest of Orbax's save as the other processes do;
    - each background thread waits for its futures, keeping their failure rather than raising it,
      says in the distributed key-value store whether its writes went through, and reads the other
      processes' word before Orbax's barrier (``_AgreedCommit``). Writes still waiting for a step
      directory that the primary failed to make are let go once it has said so, rather than
      waiting out Orbax's timeout;
    - the primary commits the step only if every process wrote, and every process's save then
      fails alike: with its own error, or ``_PeerSaveFailed``.

    Orbax's internals (0.12: the ``AsyncCheckpointer``'s ``_handler.async_save`` and
    ``_async_manager._thread_func``); under a version without them, the hang stays. One process
    has nothing to agree with, and is left as it is."""
    inner = getattr(manager, "_checkpointer", None)
    handler = getattr(inner, "_handler", None)
    background: Any = getattr(inner, "_async_manager", None)
    blocking_save = getattr(handler, "async_save", None)
    run_in_background = getattr(background, "_thread_func", None)
    client = kv_client()
    if jax.process_count() == 1 or client is None or blocking_save is None or run_in_background is None:
        return

    async def save_or_fail_in_background(directory, *args, **kwargs):
        try:
            return await blocking_save(directory, *args, **kwargs)
        except Exception as e:  # noqa: BLE001 - raised by the background thread, past the barriers
            return [_FailedWrite(e)]

    saves = itertools.count()  # the same on every process: saves are collective

    def commit_if_every_process_wrote(directory, commit_futures, on_commit_callback):
        # The step's name, not its path: each host may mount the run dir elsewhere.
        agreed = _AgreedCommit(client, f"elmo_jax/save/{epath.Path(directory).name}/{next(saves)}", commit_futures)

        def commit() -> None:
            if agreed.every_process_wrote():
                on_commit_callback()

        try:
            run_in_background(directory, [agreed], commit)
        finally:
            agreed.forget()
        if background._exception is None and (error := agreed.error()) is not None:
            background._exception = error

    handler.async_save = save_or_fail_in_background  # type: ignore[union-attr]
    background._thread_func = commit_if_every_process_wrote


# Orbax's lines about a step's ``_CHECKPOINT_METADATA`` missing or not valid JSON (the latter
# with the whole file's content, garbage or not, and once a manager opens: three times a resume).
_BENIGN = ("Metadata file does not exist: %s", "Failed to json parse Metadata file: %s, file content: %s, error: %s")


def _without_benign_orbax_warnings(record: logging.LogRecord) -> bool:
    """False for Orbax's lines that a step's ``_CHECKPOINT_METADATA`` is missing or damaged: that is
    its own bookkeeping of save times, which it reads around (the checkpoint restores all the same,
    and the files this package reads are checked for damage: ``_json_files``), so they would be
    noise on the console of a run that is fine."""
    return record.msg not in _BENIGN


def _json_files(step_dir: epath.Path) -> list[str]:
    """The JSON files of a checkpoint that Orbax reads, relative to ``step_dir``: the metadata
    item's, each array item's tree and its per-process array metadata."""
    names = ["meta/metadata"]
    for item in ("state", "lstm"):
        if (step_dir / item).is_dir():
            names.append(f"{item}/_METADATA")
            if (step_dir / item / "array_metadatas").is_dir():
                names += sorted(
                    f"{item}/array_metadatas/{p.name}" for p in (step_dir / item / "array_metadatas").iterdir()
                )
    return [name for name in names if (step_dir / name).exists()]


def _parses(path: epath.Path) -> bool:
    try:
        json.loads(path.read_bytes())
    except ValueError:  # JSONDecodeError, and UnicodeDecodeError for bytes that are not text
        return False
    return True


class Checkpointer:
    """Saves every ``save_every`` steps (and on demand), keeps the last ``keep``, async by default."""

    def __init__(self, run_dir: str | os.PathLike, keep: int = 3, async_save: bool = True, read_only: bool = False):
        """``read_only``: for readers (eval, export, embed) of a run dir that may be training right
        now. A writer's manager deletes unfinished saves' temporary directories when it opens;
        a reader's must not, or it destroys the save the training has in flight."""
        # Through etils.epath, so that a gs:// run dir works (an absolute path only for a local one:
        # abspath would turn gs://b/r into <cwd>/gs:/b/r).
        self.run_dir = epath.Path(os.path.abspath(run_dir) if is_local(run_dir) else run_dir)
        self.shown = os.fspath(run_dir)  # for messages: the run dir as the user wrote it, as the CLI's lines name it
        self.host_dir = self.run_dir / "host_state"
        self.read_only = read_only
        if not read_only:
            self.host_dir.mkdir(parents=True, exist_ok=True)
        options = (
            ocp.CheckpointManagerOptions(read_only=True, max_to_keep=None, save_interval_steps=0, create=False)
            if read_only
            else ocp.CheckpointManagerOptions(
                max_to_keep=keep, enable_async_checkpointing=async_save, cleanup_tmp_directories=True, create=True
            )
        )
        self._closed = False
        self._in_flight: int | None = None  # the step an async save is writing
        self._failed: SaveFailed | None = None
        # Whether Orbax's own code raised inside its save on this process, one of several (its
        # argument checks, its clean-up before a save): the others may be waiting at one of its
        # barriers, which are collectives, and meet whatever collective this process enters next
        # (gloo then ends them from C++, a mismatch). Such a process enters none: it says its error
        # through the peer watch, which stops the others with it (``loop._steps``).
        self.alone = False
        # Whether one of Orbax's reads or writes failed here: tensorstore may then still hold their
        # coroutines, which ``orbax_log`` collects while their lines go to the run's orbax.log.
        self.orbax_failed = False
        self.nbytes: int | None = None  # of the last checkpoint saved: what the next one needs
        absl = logging.getLogger("absl")
        if _without_benign_orbax_warnings not in absl.filters:
            absl.addFilter(_without_benign_orbax_warnings)
        # Read only, Orbax warns that the directory is read only: that is the point here.
        with absl_errors_only() if read_only else contextlib.nullcontext():
            self.manager = ocp.CheckpointManager(self.run_dir / "checkpoints", options=options)
        _reach_the_barrier_on_failure(self.manager)
        if not read_only:
            _commit_only_if_every_process_wrote(self.manager)

    def _host_path(self, step: int, process: int) -> epath.Path:
        return self.host_dir / f"{step}.p{process}.npz"

    def save(self, step: int, shared: dict, lstm: dict, host: dict, meta: dict) -> None:
        """``shared`` and ``lstm``: global arrays, saved shard by shard where they are; ``host``:
        this process's numpy arrays.

        Raises ``DiskFull`` when this save, or the async one before it, runs out of space, and
        ``SaveFailed`` when the file system fails it otherwise."""
        self.nbytes = checkpoint_bytes(shared, lstm)
        failed, host_error = None, None
        try:
            self.wait()  # the previous save's failure is reported as that step's
            with atomic_path(self._host_path(step, jax.process_index())) as tmp:
                np.savez(tmp, **_flatten(host))  # type: ignore[arg-type]  # numpy's stub: **kwds could be allow_pickle
        except Exception as e:  # noqa: BLE001 - raised below, once every process knows
            host_error = e
        # Orbax's save is collective (its barriers): a process whose previous save or host file
        # failed must not skip it alone, or it goes on while the others wait there, and the next
        # collective mismatches. So all skip it together, and the others say another one failed.
        if agree_max([int(host_error is not None)])[0] and host_error is None:
            failed = self._fail_once(step, errno.EIO, "another process could not save it")
        else:
            try:
                if host_error is not None:
                    raise host_error
                self.alone = jax.process_count() > 1  # until Orbax's save returns
                self.manager.save(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardSave(shared),
                        lstm=ocp.args.StandardSave(lstm),
                        meta=ocp.args.JsonSave({**meta, "format": FORMAT}),
                    ),
                    force=True,
                )
                self.alone = False
            except Exception as e:
                if (failed := self._failure(step, e)) is None:
                    raise
        if failed is not None:
            raise failed
        self._in_flight = step
        self._prune_host_files()

    def _failure(self, step: int, e: BaseException) -> SaveFailed | None:
        """The ``SaveFailed`` (a ``DiskFull`` for want of space) for a failure of the file system
        ``e``, made once (a second failure is the same one); None for any other error, a bug to
        show as it is.

        Callers raise it outside their ``except`` clause, so that it has no ``__context__``: Orbax's
        exception holds the failed save's asyncio futures (through its traceback's frames), and
        those must be collectable inside the run (``loop._orbax_log``) for what they log when
        collected to go to ``orbax.log`` rather than after the run's one-line error."""
        if isinstance(e, _PeerSaveFailed):
            return self._fail_once(step, errno.EIO, "another process could not save it")
        space = out_of_space_errno(e)
        code = space if space is not None else os_errno(e)
        if code is None:
            return None
        return self._fail_once(step, code, None if space is not None else innermost_message(e))

    def _fail_once(self, step: int, code: int, error: str | None) -> SaveFailed:
        """``_save_failed``'s error, made at the first failure only: a second is the same one.
        Every failed save comes through here (one that does not is raised as it is, out of the
        run's ``orbax_log`` block, which then looks for its coroutines anyway)."""
        self.orbax_failed = True
        if self._failed is None:
            self._failed = self._save_failed(step, code, error)
        return self._failed

    def _save_failed(self, step: int, code: int, error: str | None) -> SaveFailed:
        """Removes what the failed save wrote (to give the space back) and says what is kept.
        ``error``: the file system's words, for a failure other than space (None)."""
        self._remove_partial(step)
        # On a file system remounted read-only the removal fails, yet the steps before are intact
        # and must be listed: a run told that none is left would be started again.
        with contextlib.suppress(OSError):
            self._host_path(step, jax.process_index()).unlink(missing_ok=True)
        try:
            self.manager.reload()
            kept = [s for s in self.steps() if s != step]
        except OSError:  # the directory itself is what failed (gone, unreadable): nothing to list
            kept = []
        fix = (
            remedy(code, "free space (or keep fewer checkpoints) and") if error is None else "once the cause is fixed,"
        )
        if kept:
            then = (
                f"step(s) {', '.join(map(str, kept))} are intact; {fix} rerun the same command to "
                f"resume from step {kept[-1]}"
            )
        else:
            then = f"no step is intact on disk; {fix} rerun the same command to start again"
        if error is None:
            why = reason(code)
            if code != errno.EROFS:  # a read-only file system has room: its free space is beside the point
                free = free_space(str(self.run_dir / "checkpoints"))
                why += f" (a checkpoint needs about {size(self.nbytes)}" + (
                    f", {size(free)} free)" if free is not None else ")"
                )
            return DiskFull(
                f"{self.shown}: step {step} not saved: {why}; {then}",
                str(self.run_dir),
                code,
                step,
                kept,
            )
        return SaveFailed(f"{self.shown}: step {step} not saved: {error}; {then}", str(self.run_dir), code, step, kept)

    def _remove_partial(self, step: int) -> None:
        if is_local(str(self.run_dir)):
            for tmp in (self.run_dir / "checkpoints").glob(f"{step}.orbax-checkpoint-tmp*"):
                shutil.rmtree(tmp, ignore_errors=True)

    def check_space(self, keep: int, nbytes: int) -> str | None:
        """A warning when the free space cannot hold ``keep`` checkpoints of ``nbytes``
        (``checkpoint_bytes``) and one being saved; None when it can, or cannot be known."""
        free = free_space(str(self.run_dir / "checkpoints"))
        if free is None:
            return None
        need = (keep + 1 - min(len(self.steps()), keep)) * nbytes  # what is on disk already counts
        if free >= need:
            return None
        return (
            f"{self.shown}: {size(free)} free, but keeping {keep} checkpoints of about {size(nbytes)} "
            f"each (and one in flight) needs about {size(need)} more; a save may run out of space"
        )

    def _prune_host_files(self) -> None:
        """Deletes the host files of steps no longer kept, once their checkpoint's directory is
        gone. Orbax drops the oldest step from its list as the save that replaces it starts, but
        deletes its directory only once that save has committed: until then the old step is the
        one a failed save or a killed process leaves to resume from, and it needs its host file
        (deleted as the save started, with ``keep`` 1 a full disk or a kill -9 would leave no
        readable checkpoint). Housekeeping: where the directory cannot be read it leaves them,
        and the next save's own write says what is wrong."""
        keep = set(self.manager.all_steps())
        with contextlib.suppress(OSError):
            for path in self.host_dir.iterdir():
                step = path.name.split(".", 1)[0]
                if (
                    step.isdigit()
                    and int(step) not in keep
                    and int(step) < max(keep, default=0)
                    and not (self.run_dir / "checkpoints" / step).exists()
                ):
                    path.unlink(missing_ok=True)

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def _read(self, step: int, **items) -> Any:
        """Orbax's restore of ``items`` (``ocp.args``) at ``step``, raising what its read raised."""
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        except BaseException:
            self.orbax_failed = True
            raise
        if isinstance(restored, _FailedRead):
            self.orbax_failed = True
            raise restored.error
        return restored

    def meta(self, step: int) -> dict:
        return self._read(step, meta=ocp.args.JsonRestore())["meta"]

    def latest_meta(self) -> dict | None:
        """The metadata of the newest step that every process lists and can read, or None. A
        damaged one is named in a warning, and the processes try an older one together."""
        for step in self._agreed_steps():
            meta, error = None, None
            try:
                meta = self.meta(step)
            except Exception as e:  # noqa: BLE001 - any damage means "try the previous one"
                error = e
            if not self._failed_anywhere(step, error):
                return meta
            warnings.warn(
                f"{self.shown}: checkpoint {step} metadata unreadable "
                f"({type(error).__name__ if error is not None else 'on another process'}); trying older",
                stacklevel=2,
            )
        return None

    def _failed_anywhere(self, step: int, error: BaseException | None) -> bool:
        """Whether the read of ``step`` failed on any process (``error``: this one's failure, or
        None), agreed by all: every process then falls back alike. (Otherwise they would train
        from two states, or mismatch their collectives.) A read that failed for a reason that is
        not damage (denied, or the device's) stops them all alike, and moves nothing."""
        device = _device_error(self.shown, step, error)
        mine = 0 if error is None else 2 if _denied(error) else 3 if device else 1
        worst = agree_max([mine])[0] if jax.process_count() > 1 else mine
        if worst == 2:
            self._refuse_if_denied(step, error or PermissionError(errno.EACCES, "on another process"))
        if worst == 3:
            raise device or CheckpointError(
                f"{self.shown}: checkpoint {step}: another process's device failed or ran out of memory while restoring it; "
                "nothing was moved: see that process's line"
            )
        return bool(worst)

    def restore(
        self, step: int, abstract: Callable[[dict], tuple[dict, dict | None]], with_host: bool = True
    ) -> tuple[dict, dict | None, dict | None, dict]:
        """(shared state, LSTM rows or None, host state or None, meta) of one step.

        ``abstract(meta)`` gives the targets (``jax.ShapeDtypeStruct`` trees, with the sharding to
        restore onto) of the ``state`` item and of the ``lstm`` item, or None to skip the rows.
        ``with_host=False`` skips this process's host file (a run resumed by another number of
        processes has none that fits).
        """
        meta = self.meta(step)
        target_state, target_lstm = abstract(meta)
        items = {"state": ocp.args.StandardRestore(target_state)}
        if target_lstm is not None and meta.get("format", 1) >= 2:
            items["lstm"] = ocp.args.StandardRestore(target_lstm)
        restored = self._read(step, **items)
        host = None
        if with_host:
            # Read whole (a few KB to MB): np.load wants a seekable file, which a remote one may not be.
            data = io.BytesIO(self._host_path(step, jax.process_index()).read_bytes())
            with np.load(data, allow_pickle=False) as f:
                host = _unflatten({k: f[k] for k in f.files})
        return restored["state"], restored.get("lstm") if "lstm" in items else None, host, meta

    def why_unreadable(self, step: int, e: BaseException) -> str:
        """Why ``step`` could not be read: a file of Orbax's gone from it, which Orbax reports as a
        tree it did not expect (with a repr of the whole restore target), or one of its JSON files
        damaged, which Orbax reports as json's words with no file named; else the innermost error."""
        where = self.run_dir / "checkpoints" / str(step)
        # A directory that cannot be listed (gs://'s client raises its own types): the error says it,
        # and nothing may escape here, inside restore_latest's handler, before the processes agree.
        with contextlib.suppress(Exception):
            if where.is_dir():
                # The state is in every checkpoint, the LSTM rows only from format 2 on.
                items = ["state"] + [item for item in ("lstm",) if (where / item).is_dir()]
                gone = [f"{item}/_METADATA" for item in items if not (where / item / "_METADATA").exists()]
                if gone:
                    return f"its {', '.join(gone)} missing"
                if any(isinstance(x, json.JSONDecodeError) for x in exception_chain(e)):
                    bad = [name for name in _json_files(where) if not _parses(where / name)]
                    if bad:
                        return f"its {', '.join(bad)} {'is' if len(bad) == 1 else 'are'} not valid JSON (damaged)"
        return innermost_message(e)

    def restore_latest(
        self,
        abstract: Callable[[dict], tuple[dict, dict | None]],
        with_host: bool = True,
        set_aside: str | None = None,
    ) -> tuple[int, dict, dict | None, dict | None, dict] | None:
        """(step, shared, lstm, host, meta) of the newest readable checkpoint, or None.

        Each unreadable newer one is named in a warning. ``set_aside``: the folder of the run dir
        to move those to (``Checkpointer.set_aside``), for the trainer, which saves their steps
        again (Orbax refuses a step that exists); readers leave them where they are."""
        unreadable: list[tuple[int, str]] = []
        found = None
        for step in self._agreed_steps():
            why, error = None, None
            try:
                found = (step, *self.restore(step, abstract, with_host))
            except Exception as e:  # noqa: BLE001 - a damaged step falls back to the previous one
                found, why, error = None, self.why_unreadable(step, e), e
            # One process whose own files (its host file, its Orbax shards) are damaged makes all
            # fall back together.
            if self._failed_anywhere(step, error):
                found, why = None, why or "another process could not read it"
            elif found is not None and (bad := damaged_values({"state": found[1], "lstm": found[2]})):
                found, why = None, bad  # after the agreement: every process reduces its shards together
            if found is not None:
                break
            unreadable.append((step, why or ""))
        moved = self.set_aside(found[0] if found else -1, set_aside) if unreadable and set_aside else []
        for step, why in unreadable:
            where = (
                f"moved to {os.path.join(self.shown, set_aside, str(step))}; " if step in moved and set_aside else ""
            )
            then = (
                "no older one is readable"
                if found is None and step == unreadable[-1][0]
                else "falling back to an older one"
            )
            warnings.warn(f"{self.shown}: checkpoint {step} is unreadable ({why}); {where}{then}", stacklevel=2)
        return found

    def _agreed_steps(self) -> Iterator[int]:
        """The steps to try, newest first, the same on every process (``_newest_listed_by_all``):
        each is agreed when it is asked for, so a caller that stops early agrees no further."""
        step = self._newest_listed_by_all(below=None)
        while step >= 0:
            yield step
            step = self._newest_listed_by_all(below=step)

    def _newest_listed_by_all(self, below: int | None) -> int:
        """The newest step (before ``below``) that any process lists, once every process lists it;
        -1 if none does.

        A shared file system whose hosts see a directory change at different times (NFS's
        attribute cache) can list a step that was committed just before a restart on one host and
        not yet on another. Each process resuming from its own newest step would train from two
        states, or mismatch their collectives. So they agree on the step, and those that do not
        list it yet look again, once a second, for up to ``VISIBLE_WAIT`` seconds; every process
        counts the same tries, so all give up together, with one line."""
        listed = [s for s in self.steps() if below is None or s < below]
        if jax.process_count() == 1:
            return max(listed, default=-1)
        newest = agree_max([max(listed, default=-1)])[0]
        for _ in range(VISIBLE_WAIT):
            if newest < 0 or not agree_max([int(newest not in listed)])[0]:
                return newest
            time.sleep(1)
            self.manager.reload()
            listed = self.steps()
        raise CheckpointError(
            f"{self.shown}: checkpoint {newest} is listed on some hosts but not on all of them after "
            f"{VISIBLE_WAIT} s: every process must see the run dir alike (a shared file system, mounted on "
            "every host without a long attribute cache); check the mounts, then restart every process"
        )

    def _refuse_if_denied(self, step: int, e: BaseException) -> None:
        """Raises ``CheckpointError`` if ``e`` is a denied read: a checkpoint this user may not read
        is not damaged, and falling back past it (moving it aside) would lose its steps."""
        if _denied(e):
            raise CheckpointError(
                f"{self.shown}: checkpoint {step} cannot be read, access denied ({innermost_message(e)}); "
                "nothing was moved: give this user access to the run dir (or run as its owner) and rerun"
            )

    def set_aside(self, after: int, folder: str) -> list[int]:
        """Moves the checkpoints of the steps after ``after``, and their host files, to
        ``run_dir/folder/<step>/`` where no reader looks: the newest checkpoint is then at or
        before ``after``. Kept, not deleted: they may be worth a look. Returns the steps moved."""
        self.wait()
        steps = [s for s in self.steps() if s > after]
        if steps and jax.process_index() == 0:
            for s in steps:
                dest = self.run_dir / folder / str(s)
                n = 1
                while dest.exists():  # set aside before, in an earlier session
                    dest, n = self.run_dir / folder / f"{s}.{n}", n + 1
                dest.mkdir(parents=True)
                (self.run_dir / "checkpoints" / str(s)).rename(dest / "checkpoint")
                for host in self.host_dir.glob(f"{s}.p*.npz"):
                    host.rename(dest / host.name)
        if steps and jax.process_count() > 1:  # every process stops alike: all call this
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("elmo_jax set_aside")
        if steps:
            self.manager.reload()
        return steps

    def wait(self) -> None:
        """Waits for the save in flight; raises ``SaveFailed`` (``DiskFull``) if it failed."""
        step, self._in_flight = self._in_flight, None
        failed = None
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            if (failed := self._failure(step if step is not None else -1, e)) is None:
                raise
        if failed is not None:
            raise failed

    def close(self) -> None:
        """Waits for the save in flight and closes (idempotent). A ``SaveFailed`` already raised is
        not raised again."""
        if self._closed:
            return
        self._closed = True
        reported = self._failed is not None
        try:
            try:
                self.wait()
                if not self.read_only:
                    self._prune_host_files()  # the last save's predecessor, deleted once that save committed
            finally:
                self._close_manager()
        except SaveFailed:
            if not reported:
                raise

    def _close_manager(self) -> None:
        failed = None
        try:
            self.manager.close()  # waits once more, and raises a failed save's error once more
        except Exception as e:
            if (failed := self._failure(-1, e)) is None:
                raise
        finally:
            # The closed manager's threads still hold a failed save's exception, and through its
            # traceback the save's asyncio futures (see ``_failure``): let go of it.
            del self.manager
            if self._failed is not None:  # writes of the failed save that were still in flight
                _end_stranded_writes()  # their files must land before the removal
                self._remove_partial(self._failed.step)
        if failed is not None:
            raise failed
