"""Every line of a text file through an ``Embedder`` into hdf5: bilm-tf's dump format, pooled
rows, or one shard of a run split over processes (with its manifest).

``embed_file(embedder, input_path, output_path, options)`` is what ``elmo-jax embed`` does; from
Python it is the same call, with the choices in one ``EmbedFileOptions``::

    from elmo_jax.extract import EmbedFileOptions, embed_file

    embed_file(embedder, "sentences.txt", "elmo.hdf5", EmbedFileOptions(layers="top", pool="mean"))

The file is written under a temporary name next to ``output_path`` and renamed into place when
complete (``elmo_jax._util.atomic``): an error or Ctrl-C leaves no file under the final name, and a
full disk (or quota, or a read-only file system) is one ``OutOfSpaceError`` naming the file and the
space left (``elmo_jax._util.disk_full``).
Errors about the options name their fields (``window must be an integer >= 1; got 0``).

``ShardedEmbeddings`` reads what ``embed_file`` wrote back in line order: the files of the N
processes of a sharded run (each found by its manifest), or one file.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import glob
import json
import os
import re
import shutil
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from elmo_jax._util import background, disk_full, utf8
from elmo_jax._util.arguments import about, check_path
from elmo_jax._util.atomic import atomic_path, is_local, write_text_atomic
from elmo_jax._util.device_memory import CHECK_THE_DEVICE, device_error
from elmo_jax._util.disk_full import out_of_space_errno
from elmo_jax._util.paths import fault, replaced_input, said, same_path
from elmo_jax._util.terminal import bar_size
from elmo_jax.config import ConfigError, check_counts
from elmo_jax.text.sources import DataError

if TYPE_CHECKING:  # imported where used: the embedder imports jax, which this module does not
    from elmo_jax.extract.embedder import Embedder


@dataclasses.dataclass(frozen=True)
class EmbedFileOptions:
    """What ``embed_file`` writes, and how.

    layers: ``"all"`` (``[n_layers + 1, n_tokens, 2P]`` per line), ``"top"``, ``"average"``, or one
      weight per ELMo layer (a weighted sum, not normalised): ``[n_tokens, 2P]``.
    pool: None, ``"mean"`` or ``"max"``: one dataset ``embeddings`` with a row per line (an empty
      line gives zeros) instead of a dataset per line.
    window: sentences read, sorted and written at a time.
    ahead: windows the embedding may run ahead of the writes, which a background thread does
      (0: written in the loop; each costs a window's memory).
    num_shards, shard_index: this process embeds the lines ``i`` with ``i % num_shards ==
      shard_index`` into its own file and manifest (``shard_file``); None: every line.
    sentence_to_index: also write AllenNLP's ``sentence_to_index`` JSON dataset (each sentence's
        dataset name; with ``pool``, its row of ``embeddings``, as a string too).
    progress: a tqdm bar over the lines.
    """

    layers: str | tuple[float, ...] = "all"
    pool: str | None = None
    window: int = 2048
    ahead: int = 1
    num_shards: int | None = None
    shard_index: int | None = None
    sentence_to_index: bool = False
    progress: bool = True

    def __post_init__(self):
        weights = None
        if not isinstance(self.layers, str):
            try:
                weights = tuple(float(w) for w in self.layers)
            except (TypeError, ValueError):
                pass
            else:
                object.__setattr__(self, "layers", weights)
        if weights is None and self.layers not in ("all", "top", "average"):
            raise about(
                ConfigError(f"layers {self.layers!r}: expected all, top, average or one weight per ELMo layer"),
                "layers",
            )
        if self.pool not in (None, "mean", "max"):
            raise about(ConfigError(f"pool {self.pool!r}: expected None, mean or max"), "pool")
        n, i = self.num_shards, self.shard_index
        check_counts(1, optional=True, num_shards=n)  # 0 was answered with a range 0..-1 for shard_index
        if n is not None and not (n >= 1 and i is not None and 0 <= i < n):
            raise about(ConfigError(f"num_shards {n} needs shard_index in 0..{n - 1}"), "num_shards", "shard_index")
        if i is not None and n is None:
            raise about(ConfigError("shard_index needs num_shards"), "shard_index", "num_shards")
        check_counts(1, window=self.window)
        check_counts(0, ahead=self.ahead)

    @property
    def sharded(self) -> bool:
        return self.num_shards is not None


@dataclasses.dataclass(frozen=True)
class EmbedFileResult:
    """What ``embed_file`` wrote: ``output`` (the shard's own name when sharded) and its
    ``manifest`` (None unsharded), ``lines`` of the input, ``written`` by this process, and how
    many ``empty_pooled`` lines were pooled to zero vectors."""

    output: str
    manifest: str | None
    lines: int
    written: int
    empty_pooled: int


def _the_embedder(embedder: Any) -> Embedder:
    """``embed_file``'s ``embedder``: an ``Embedder``, or made by the function given."""
    from elmo_jax.extract.embedder import Embedder

    if callable(embedder) and not isinstance(embedder, Embedder):
        embedder = embedder()
    if not isinstance(embedder, Embedder):  # a model's path, say (unchecked: no attribute 'config')
        raise about(
            TypeError(
                f"embedder is a {type(embedder).__name__}; expected an Embedder (Embedder.from_hdf5, "
                "from_checkpoint or from_pretrained), or a function of no arguments returning one"
            ),
            "embedder",
        )
    return embedder


def embed_file(
    embedder,
    input_path: str | os.PathLike,
    output_path: str | os.PathLike,
    options: EmbedFileOptions = EmbedFileOptions(),
) -> EmbedFileResult:
    """ELMo layers of every line of ``input_path`` (UTF-8, one whitespace-tokenized sentence a line)
    into the hdf5 ``output_path``: dataset ``str(i)`` for line ``i`` (0-based), or with
    ``options.pool`` one dataset ``embeddings``, row ``i`` for line ``i``. Sharded, the file is
    ``shard_file(output_path, ...)`` and its manifest that name plus ``.json``, written once
    the file is complete (``ShardedEmbeddings`` reads the shards back as one).

    ``embedder``: an ``Embedder``, or a function of no arguments returning one, called after the
    paths are checked. Raises ``DataError`` (input missing or not UTF-8, output directory missing),
    ``ConfigError`` (``layers`` that do not fit the model), ``disk_full.OutOfSpaceError`` or
    ``OutOfDeviceMemory`` (``batch_tokens`` too many for the device); nothing is left under
    ``output_path`` then.
    """
    input_path, output_path = _paths(input_path, output_path)
    _check_arguments(input_path, output_path, options)
    from elmo_jax.extract.embedder import check_layers

    embedder = _the_embedder(embedder)

    try:
        layers = check_layers(options.layers, embedder.config.n_output_layers)
    except ValueError as e:
        raise about(ConfigError(str(e)), "layers") from None
    # This process embeds lines start, start + step, ... (0-based); unsharded: all of them.
    start, step = (options.shard_index or 0, options.num_shards or 1)  # unsharded: (0, 1)
    output = shard_file(output_path, start, step) if options.sharded else output_path
    with open(input_path, "rb") as f:
        total = sum(1 for _ in f)
    manifest = output + ".json" if options.sharded else None
    if manifest:
        try:  # a manifest says its shard is complete: a stale one must not outlive its file
            os.unlink(manifest)
        except FileNotFoundError:
            pass
    lines = (line.split() for n, line in utf8.lines(input_path, DataError) if (n - 1) % step == start)
    mine = len(range(start, total, step))
    error = None
    try:
        with disk_full.reported(output):
            empty = _write_hdf5(embedder, lines, output, layers, options, start, step, mine)
    except RuntimeError as e:
        error = device_error(
            e,
            out_of_memory_said=lambda xla: (
                f"{output}: not written: the device ran out of memory ({xla}); batch_tokens "
                f"{embedder.batch_tokens} per device is more than it holds: lower batch_tokens and rerun"
            ),
            knob="batch_tokens",
            failed_said=lambda xla: f"{output}: not written: the device failed ({xla}); {CHECK_THE_DEVICE} rerun",
        )
        if error is None:
            raise
    if error is not None:  # raised here, outside the clause: XLA's traceback is not the message
        raise error
    if manifest:
        extra = dict(
            layers=layers if isinstance(layers, str) else layers.tolist(),
            pool=options.pool,
            input=os.path.abspath(input_path),
        )
        write_text_atomic(
            manifest,
            json.dumps(shard_manifest(output_path, start, step, total, bool(options.pool), **extra), indent=1) + "\n",
        )
    return EmbedFileResult(
        output=output, manifest=manifest, lines=total, written=mine, empty_pooled=empty if options.pool else 0
    )


def _paths(input_path, output_path) -> tuple[str, str]:
    """The two paths as str; a one-line ``TypeError`` for one that is no path (the arguments in
    another order: before, ``os.fspath``'s "expected str, bytes or os.PathLike object, not Embedder")."""
    for name, value in (("input_path", input_path), ("output_path", output_path)):
        check_path(value, name, "a path: embed_file(embedder, input_path, output_path)")
    return os.fspath(input_path), os.fspath(output_path)


def _check_arguments(input_path: str, output_path: str, options: EmbedFileOptions) -> None:
    """``embed_file``'s arguments, before the model is built: no work is lost to a mistyped path."""
    if not isinstance(options, EmbedFileOptions):
        raise TypeError(
            f"options must be an EmbedFileOptions, got {type(options).__name__} (EmbedFileOptions(pool='mean'), say)"
        )
    if not is_local(input_path):
        raise DataError(f"{input_path}: the input is read as a local file: copy it to this machine first")
    # Each named by its argument: the same path may be given twice (an input that is the run dir).
    if bad := fault(input_path, "file"):
        raise about(DataError(f"input_path {said(*bad, input_path)}"), "input_path")
    if bad := fault(output_path, "output"):
        raise about(DataError(f"output_path {said(*bad, output_path)}"), "output_path")
    output = (
        shard_file(output_path, options.shard_index or 0, options.num_shards or 1) if options.sharded else output_path
    )
    if replaced_input(output, [input_path]):
        raise about(DataError(f"{output}: is the input file: its text would be lost; give another output"), "output")
    if os.path.isfile(output) and os.path.getsize(output):  # empty: what a crashed writer may leave
        import h5py

        if not h5py.is_hdf5(output):
            raise about(
                DataError(f"{output}: exists and is not an hdf5 file, which this would replace; give another output"),
                "output",
            )


def _write_hdf5(
    embedder,
    lines: Iterable[list[str]],
    output: str,
    layers,
    options: EmbedFileOptions,
    start: int,
    step: int,
    mine: int,
) -> int:
    """Writes the file (atomically); returns how many of its ``mine`` lines were empty."""
    import h5py
    from tqdm import tqdm

    sentence_to_index: dict[str, str] = {}
    counts: collections.Counter[str] = collections.Counter()
    with atomic_path(output) as tmp, h5py.File(tmp, "w") as out:
        # Each sentence's dataset, as AllenNLP's index has it; pooled, its row of ``embeddings``.
        at = (0, 1) if options.pool else (start, step)
        lines = _remember(lines, sentence_to_index if options.sentence_to_index else None, *at)
        write = _pooled_rows(out, mine, embedder.config, layers, options.window) if options.pool else None

        room = _Room(out, tmp)

        def store(item: tuple[int, np.ndarray]) -> None:
            k, x = item
            room.check(x.size * 4)
            if write:
                write(x)  # rows come in line order
            else:
                out.create_dataset(str(start + k * step), data=x.astype(np.float32, copy=False))

        # A background thread writes (an hdf5 dataset per line is host time: see
        # benchmarks/bench_embed_cli.py) while this one goes on with the next window's device work.
        with (
            tqdm(total=mine, unit="sent", disable=not options.progress, **bar_size(sys.stderr)) as bar,
            warnings.catch_warnings(),
            background.calls(store, options.ahead * options.window) as submit,
        ):
            # Pooled by embed (on the device); its empty-sentence warning per window gives way to
            # one count at the end.
            warnings.filterwarnings("ignore", message=r"\d+ empty sentence\(s\) pooled")
            for k, x in embedder.embed_stream(
                _count_empty(lines, counts), window=options.window, layers=layers, pool=options.pool
            ):
                submit((k, x))
                bar.update(1)
        if write:
            write(None)
        if options.sentence_to_index:
            out.create_dataset("sentence_to_index", data=json.dumps(sentence_to_index))
    return counts["empty"]


class _Room:
    """Stops the writes while the disk still has room for the file's close.

    HDF5 holds metadata in its cache and meets a full disk when it flushes it: in a dataset's
    deallocation (where Python only prints the error), then in the file's close, which then fails
    and leaves the file open; the interpreter's exit closed it again and crashed (SIGSEGV, after
    ~20,000 lines of h5py's tracebacks on a 3 MB file system). So before each write the free space
    is checked (one statvfs) against twice the write plus ``SLACK``, and the file is flushed every
    ``FLUSH_EVERY`` writes, so that what the close still has to write stays well under ``SLACK``:
    short of room, an ``ENOSPC`` is raised here, before HDF5 meets one. A flush that meets a full
    disk all the same (another writer took the space) is an ``ENOSPC`` too."""

    SLACK = 1 << 20
    FLUSH_EVERY = 256

    def __init__(self, out, tmp: str):
        self.out, self.dir, self.n = out, os.path.dirname(os.path.abspath(tmp)), 0

    def check(self, nbytes: int) -> None:
        """Before a write of ``nbytes``."""
        if shutil.disk_usage(self.dir).free < 2 * nbytes + self.SLACK:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.dir)
        self.n += 1
        if self.n % self.FLUSH_EVERY:
            return
        try:
            self.out.flush()
        except RuntimeError as e:  # h5py's, for HDF5's failed write ("errno = 28")
            if out_of_space_errno(e) is None:
                raise
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.dir) from None


def _count_empty(lines: Iterable[list[str]], counts: collections.Counter) -> Iterator[list[str]]:
    for tokens in lines:
        counts["empty"] += not tokens
        yield tokens


def _remember(lines: Iterable[list[str]], table: dict | None, start: int, step: int) -> Iterator[list[str]]:
    """The lines, unchanged; each new one's line number goes into ``table`` (None: nothing kept)."""
    for i, tokens in enumerate(lines):
        if table is not None:
            table.setdefault(" ".join(tokens), str(start + i * step))
        yield tokens


def _pooled_rows(out, n_rows: int, config, layers, window: int) -> Callable[[np.ndarray | None], None]:
    """``write(row)`` appends to dataset ``embeddings`` ``[n_rows, ...]`` float32 of ``out``, buffered
    ``window`` rows at a time (an h5py write per row is slow); ``write(None)`` flushes."""
    shape = (
        (config.n_output_layers, config.output_dim)
        if isinstance(layers, str) and layers == "all"
        else (config.output_dim,)
    )
    ds = out.create_dataset("embeddings", shape=(n_rows, *shape), dtype=np.float32)
    buf: list[np.ndarray] = []
    done = 0

    def write(row: np.ndarray | None) -> None:
        nonlocal done
        if row is not None:
            buf.append(row)
        if buf and (row is None or len(buf) >= window):
            ds[done : done + len(buf)] = np.stack(buf)
            done += len(buf)
            buf.clear()

    return write


# -- sharded output: `elmo-jax embed --num-shards N --shard-index I` ---------------------------
MANIFEST_FORMAT = "elmo-jax-embed-shard/1"


def shard_file(output: str | os.PathLike, index: int, num_shards: int) -> str:
    """Shard ``index``'s hdf5 for ``--output``: ``elmo.hdf5`` -> ``elmo-00001-of-00004.hdf5``.

    Its manifest is that name plus ``.json``. Each shard writes only its own two files, so N
    processes never write the same file.
    """
    root, ext = os.path.splitext(os.fspath(output))
    return f"{root}-{index:05d}-of-{num_shards:05d}{ext}"


def shard_manifest(
    output: str | os.PathLike, index: int, num_shards: int, num_lines: int, pooled: bool, **extra
) -> dict:
    """The manifest of shard ``index``: it holds lines ``index, index + num_shards, ...`` of the
    input's ``num_lines``, each as dataset ``str(line)``, or, when ``pooled``, as row
    ``(line - index) // num_shards`` of dataset ``embeddings``. ``file`` is relative to the manifest."""
    return {
        "format": MANIFEST_FORMAT,
        "file": os.path.basename(shard_file(output, index, num_shards)),
        "shard_index": index,
        "num_shards": num_shards,
        "num_lines": num_lines,
        "lines": {"start": index, "stop": num_lines, "step": num_shards},
        "dataset": "embeddings" if pooled else "{line}",
        **extra,
    }


# shard_file's names: OUTPUT-00001-of-00004.hdf5 (groups: the output's root, index, count, extension).
_SHARD = re.compile(r"(.+)-(\d{5,})-of-(\d{5,})(\.[^.]*)?")


def _output_of(shard: str) -> str | None:
    """The ``--output`` whose ``shard_file`` is ``shard`` (None: not a shard's name)."""
    m = _SHARD.fullmatch(os.path.basename(shard))
    return None if m is None else os.path.join(os.path.dirname(shard), m[1] + (m[4] or ""))


class ShardedEmbeddings:
    """One read-only view, in line order, over what ``elmo-jax embed`` wrote: the files of the N
    processes of a ``--num-shards N`` run, or the one file of an unsharded run.

    ``source``: the ``--output`` the shards were given (their manifests are found next to it),
    a list of the shards' manifests (``*.hdf5.json``), or the hdf5 of an unsharded run.
    ``len(view)`` is the input's line count; ``view[i]`` is line i's array as stored (float32
    ``[n_layers + 1, n_tokens, 2P]`` by default, ``[2P]`` with ``--pool``, ...); iteration yields
    them in line order. Files open on first use; ``close()`` (or ``with``) closes them.
    """

    def __init__(self, source: str | os.PathLike | Sequence[str | os.PathLike]):
        self._files: dict[str, Any] = {}  # path -> open h5py.File (h5py has no type information)
        if not isinstance(source, (str, os.PathLike)):
            self._shards = self._check([self._read_manifest(os.fspath(p)) for p in source])
            return
        source = os.fspath(source)
        if source.endswith(".json"):
            self._shards = self._check([self._read_manifest(source)])
            return
        root, ext = os.path.splitext(source)
        # The glob's * would also take another output's shards: e-top-00000-of-00002.hdf5.json for e.hdf5.
        paths = sorted(
            p
            for p in glob.glob(f"{glob.escape(root)}-*-of-*{glob.escape(ext)}.json")
            if (output := _output_of(p.removesuffix(".json"))) is not None and same_path(output, source)
        )
        self._shards = self._check([self._read_manifest(p) for p in paths]) if paths else [self._unsharded(source)]

    @staticmethod
    def _read_manifest(path: str) -> dict:
        if not path.endswith(".json"):
            raise ValueError(
                f"{path}: a list names shard manifests (*.hdf5.json); give an hdf5 file, or the --output "
                "of a sharded run, alone"
            )
        with open(path, "rb") as f:
            try:
                m = json.loads(f.read().decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"{path}: not an elmo-jax embed shard manifest ({e})") from None
        if not isinstance(m, dict) or m.get("format") != MANIFEST_FORMAT:
            m = m if isinstance(m, dict) else {}
            raise ValueError(f"{path}: not an elmo-jax embed shard manifest (format {m.get('format')!r})")
        return {**m, "path": os.path.join(os.path.dirname(path), m["file"]), "manifest": path}

    @staticmethod
    def _check(shards: list[dict]) -> list[dict]:
        if not shards:
            raise FileNotFoundError("no shard manifests given")
        # What one run's shards share: a shard run again with other --layers or --pool (or on
        # another input of as many lines) would mix arrays of other shapes or meanings.
        keys = ("num_shards", "num_lines", "layers", "pool", "input")
        runs = {json.dumps([m.get(k) for k in keys]) for m in shards}
        if len(runs) > 1:
            raise ValueError(
                f"the manifests come from different runs (their {', '.join(keys)} differ: "
                f"{'; '.join(sorted(runs))}): {', '.join(m['manifest'] for m in shards)}"
            )
        n = shards[0]["num_shards"]
        by_index: dict[int, dict] = {}
        for m in shards:
            if m["shard_index"] in by_index:
                raise ValueError(
                    f"two manifests of shard {m['shard_index']}: {by_index[m['shard_index']]['manifest']} and "
                    f"{m['manifest']}; give the manifests of one run"
                )
            by_index[m["shard_index"]] = m
        missing = [i for i in range(n) if i not in by_index]
        if missing:
            # The output the shards were given, from one manifest's name (shard_file's pattern).
            known = shards[0]
            output = _output_of(known["manifest"].removesuffix(".json")) or known["manifest"]
            names = ", ".join(shard_file(output, i, n) + ".json" for i in missing[:3]) + (
                ", ..." if len(missing) > 3 else ""
            )
            raise FileNotFoundError(f"shard(s) {missing} of {n} have no manifest: {names} (still running, or failed?)")
        return [by_index[i] for i in range(n)]

    @staticmethod
    def _unsharded(path: str) -> dict:
        import h5py

        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: no such embed output, and no shard manifests next to it")
        shard = _SHARD.fullmatch(os.path.basename(path))
        if shard is not None and os.path.isfile(path + ".json"):  # its manifest says what it is
            output = _output_of(path)
            raise ValueError(
                f"{path}: is shard {int(shard[2])} of {int(shard[3])} of {output}, one line in "
                f"{int(shard[3])}: give {output} to read every shard's lines in line order"
            )
        if not h5py.is_hdf5(path):
            raise ValueError(f"{path}: not an hdf5 file: give what elmo-jax embed wrote (its --output)")
        with h5py.File(path, "r") as f:
            names = list(f)  # one pass over the file's index: a dataset per line can be millions
            pooled = "embeddings" in names
            rows = len(f["embeddings"]) if pooled else 0
        lines = sorted(int(k) for k in names if k.isdigit())
        others = sorted(k for k in names if not k.isdigit() and k not in ("embeddings", "sentence_to_index"))
        # A weights file, say; or one dataset per line, but not lines 0 to n-1.
        if others or lines != list(range(len(lines))):
            held = f"{others[:4]}" if others else f"the lines {lines[:3]}... of {len(lines)}"
            raise ValueError(f"{path}: not what elmo-jax embed writes (it holds {held}): give its --output")
        n = rows if pooled else len(lines)
        return {
            "path": path,
            "num_lines": n,
            "lines": {"start": 0, "stop": n, "step": 1},
            "dataset": "embeddings" if pooled else "{line}",
        }

    def __len__(self) -> int:
        return self._shards[0]["num_lines"]

    def __getitem__(self, i: int) -> np.ndarray:
        n = len(self)
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise TypeError(
                f"a line's index must be an int, got {type(i).__name__} (a slice: [view[k] for k in range(a, b)])"
            )
        if not -n <= i < n:
            raise IndexError(f"line {i} out of range for {n} lines")
        i = int(i) % n
        shard = self._shards[i % len(self._shards)]  # shard k holds the lines i with i % N == k
        f = self._files.get(shard["path"])
        if f is None:
            import h5py

            f = self._files[shard["path"]] = h5py.File(shard["path"], "r")
        if shard["dataset"] == "embeddings":
            return f["embeddings"][(i - shard["lines"]["start"]) // shard["lines"]["step"]]
        return f[str(i)][()]

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self[i] for i in range(len(self)))

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> ShardedEmbeddings:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["EmbedFileOptions", "EmbedFileResult", "ShardedEmbeddings", "embed_file", "shard_file", "shard_manifest"]
