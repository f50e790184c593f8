"""AllenNLP's released ELMo models: a registry of their files, and safe downloads into a cache.

    from elmo_jax.pretrained import load_pretrained
    config, params = load_pretrained("original")      # fetches options + weights once, then reads the cache

The cache is ``$ELMO_JAX_HOME`` (default ``$XDG_CACHE_HOME/elmo_jax/models``, i.e.
``~/.cache/elmo_jax/models``), one directory per model. Environment:

``ELMO_JAX_HOME``     the cache directory.
``ELMO_JAX_MIRROR``   replaces AllenNLP's storage base: an ``http(s)://`` base URL, or a local
                      directory (a path or ``file://`` URL) to copy from. Either must hold the
                      files under their released relative paths (``RemoteFile.path``).
``ELMO_JAX_OFFLINE``  ``1``: never touch the network; a missing file is an error that says where
                      to put it.
``ELMO_JAX_SHA256``   pinned hashes, ``MODEL:KEY=HEX`` separated by commas (KEY: a role such as
                      ``weights``, or a file's name in the cache); the ``sha256=`` argument wins.

AllenNLP publishes no checksums, so a file is trusted in layers: its size is checked against
the size pinned here (or, where no source states one, the size recorded at download) every
time it is used; its sha256 is computed once after the download and kept in the model
directory's ``manifest.json``; ``verify`` recomputes it; and a user may pin a sha256, which a
download must match to be kept. A download goes to ``NAME.part`` next to its final name (resumed
with an HTTP Range request when a transfer breaks) and is renamed into place only when it has
passed those checks, under a per-model lock so that two processes fetching the same model
download it once.

This module imports no jax (``load_pretrained`` does, to read the weights).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
import posixpath
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from elmo_jax._util.arguments import about, did_you_mean
from elmo_jax._util.atomic import write_text_atomic
from elmo_jax._util.disk_full import reported
from elmo_jax._util.lock import FileLock
from elmo_jax._util.paths import IS_A_FILE, describe, fault, said
from elmo_jax._util.terminal import bar_size, is_terminal

__all__ = [
    "BASE_URL",
    "MODELS",
    "ROLES",
    "FileStatus",
    "PretrainedError",
    "PretrainedModel",
    "RemoteFile",
    "cache_root",
    "cache_status",
    "fetch",
    "get_model",
    "list_models",
    "load_pretrained",
    "offline",
    "source_of",
    "verify",
]

BASE_URL = "https://s3-us-west-2.amazonaws.com/allennlp/models/elmo/"
ROLES = ("options", "weights", "softmax", "vocab", "checkpoint")
DEFAULT_FILES = ("options", "weights")
MANIFEST = "manifest.json"
CHECKPOINT_DIR = "tf_checkpoint"  # the TF checkpoint's files, in the model's cache directory

CHUNK = 1 << 20
TIMEOUT_S = 60
ATTEMPTS = 3  # per file: a broken transfer is resumed this many times in one fetch
RETRY_WAIT_S = 1.0


class PretrainedError(Exception):
    """A released model cannot be fetched or used as asked (one line: the file and what was expected)."""


class DownloadFailed(PretrainedError):
    """The network failed a transfer that was asked rightly (no connection, a body cut short, a
    server error after every retry): the bytes received stay in the ``.part`` file, and running
    again resumes. Every other ``PretrainedError`` is about the input (a name, a mirror, a pin)."""


class _Interrupted(PretrainedError):
    """A transfer broke off (network, not content): the ``.part`` file is kept for a resume."""


@dataclass(frozen=True)
class RemoteFile:
    """One released file. ``path`` is relative to the storage base, so a mirror can replace it."""

    path: str
    size: int | None = None  # bytes, only where a source states it (see the registry's comments)
    local: str = ""  # where it goes in the model's cache directory (default: the file's name)

    def __post_init__(self):
        if not self.local:
            object.__setattr__(self, "local", posixpath.basename(self.path))


@dataclass(frozen=True)
class PretrainedModel:
    """A released model: its files by role, and the published figures for choosing one.

    Roles: ``options`` (bilm-tf options.json), ``weights`` (hdf5), ``softmax`` (hdf5, the output
    layer, rows in ``vocab`` order), ``vocab`` (the LM vocabulary), ``checkpoint`` (bilm-tf's
    TensorFlow training checkpoint: several files, one directory). Each role maps to a tuple of
    files; only ``checkpoint`` has more than one.
    """

    name: str
    description: str
    files: Mapping[str, tuple[RemoteFile, ...]]
    parameters_m: float | None = None  # millions
    lstm_dim: int | None = None
    projection_dim: int | None = None  # the LSTM output size (an ELMo vector is twice this)
    n_highway: int | None = None
    srl_f1: float | None = None  # AllenNLP's SRL model with these ELMo vectors (no GloVe)
    parsing_f1: float | None = None  # AllenNLP's constituency parser, likewise

    def summary(self) -> str:
        """One line of the published figures, for ``elmo-jax models``."""
        parts = []
        if self.parameters_m is not None:
            parts.append(f"{self.parameters_m:.1f}M parameters")
        if self.lstm_dim is not None:
            layers = "layer" if self.n_highway == 1 else "layers"
            parts.append(f"LSTM {self.lstm_dim}/{self.projection_dim}, {self.n_highway} highway {layers}")
        if self.srl_f1 is not None:
            parts.append(f"SRL F1 {self.srl_f1:.2f}, constituency parsing F1 {self.parsing_f1:.2f}")
        return "; ".join(parts + [self.description])


def _one(path: str, size: int | None = None) -> tuple[RemoteFile, ...]:
    return (RemoteFile(path, size),)


def _tf_checkpoint(directory: str, step: int, index_file: bool = True) -> tuple[RemoteFile, ...]:
    # ``checkpoint`` is TF's small text index (tf.train.latest_checkpoint reads it); options.json
    # is the training options (vocabulary size, token count), not the hdf5's inference options.
    names = (
        (["checkpoint"] if index_file else [])
        + ["options.json"]
        + [f"model.ckpt-{step}.{ext}" for ext in ("index", "data-00000-of-00001", "meta")]
    )
    return tuple(RemoteFile(f"{directory}/{n}", local=f"{CHECKPOINT_DIR}/{n}") for n in names)


# Sources. URLs and the figures: AllenNLP's ELMo page (allennlp.org/elmo; allenai/allennlp-website
# elmo.html: the models table, the contributed-models table, the training data). Softmax files and
# the 1B Word vocabulary: allennlp's ``elmo`` perplexity command defaults (allennlp/commands), the
# bilm-tf README's checkpoint FAQ (vocab-2016-09-10.txt at the storage root), and for the 5.5B
# model's softmax and vocab, facebookresearch/LAMA's download script. TF checkpoints: original, the
# bilm-tf README FAQ; small, bilm-tf issue #105; medium, bilm-tf issue #198 (which lists no
# ``checkpoint`` index file; #172 got 403 for it). No checkpoint of the 5.5B model or PubMed model
# was released (bilm-tf #207 asks for the 5.5B one, still open). Sizes: the original model's
# options (336 bytes) and weights (374,434,792 bytes) from AllenNLP's download progress bars in
# published notebooks' output (336/336, 374434792/374434792), matching the Hugging Face mirror
# lysandre/elmo-2x4096_512_2048cnn_2xhighway (options.json 336 bytes, weights.hdf5 374 MB). No
# source found states the other files' sizes: those are recorded at download and checked after.
_VOCAB_1B = "vocab-2016-09-10.txt"
_O = "2x4096_512_2048cnn_2xhighway"
_B = "2x4096_512_2048cnn_2xhighway_5.5B"

MODELS: dict[str, PretrainedModel] = {
    "small": PretrainedModel(
        "small",
        "1B Word Benchmark (~800M tokens of WMT 2011 news)",
        {
            "options": _one("2x1024_128_2048cnn_1xhighway/elmo_2x1024_128_2048cnn_1xhighway_options.json"),
            "weights": _one("2x1024_128_2048cnn_1xhighway/elmo_2x1024_128_2048cnn_1xhighway_weights.hdf5"),
            "vocab": _one(_VOCAB_1B),
            "checkpoint": _tf_checkpoint("2x1024_128_2048cnn_1xhighway/tf_checkpoint", 1501260),
        },
        parameters_m=13.6,
        lstm_dim=1024,
        projection_dim=128,
        n_highway=1,
        srl_f1=83.62,
        parsing_f1=93.12,
    ),
    "medium": PretrainedModel(
        "medium",
        "1B Word Benchmark (~800M tokens of WMT 2011 news)",
        {
            "options": _one("2x2048_256_2048cnn_1xhighway/elmo_2x2048_256_2048cnn_1xhighway_options.json"),
            "weights": _one("2x2048_256_2048cnn_1xhighway/elmo_2x2048_256_2048cnn_1xhighway_weights.hdf5"),
            "vocab": _one(_VOCAB_1B),
            "checkpoint": _tf_checkpoint("2x2048_256_2048cnn_1xhighway/tf_checkpoint", 1501260, index_file=False),
        },
        parameters_m=28.0,
        lstm_dim=2048,
        projection_dim=256,
        n_highway=1,
        srl_f1=84.04,
        parsing_f1=93.60,
    ),
    "original": PretrainedModel(
        "original",
        "1B Word Benchmark (~800M tokens of WMT 2011 news)",
        {
            "options": _one(f"{_O}/elmo_{_O}_options.json", 336),
            "weights": _one(f"{_O}/elmo_{_O}_weights.hdf5", 374_434_792),
            "softmax": _one(f"{_O}/elmo_{_O}_softmax_weights.hdf5"),
            "vocab": _one(_VOCAB_1B),
            "checkpoint": _tf_checkpoint(f"{_O}_tf_checkpoint", 935588),
        },
        parameters_m=93.6,
        lstm_dim=4096,
        projection_dim=512,
        n_highway=2,
        srl_f1=84.63,
        parsing_f1=93.85,
    ),
    "original_5.5b": PretrainedModel(
        "original_5.5b",
        "5.5B tokens: Wikipedia (1.9B) + WMT 2008-2012 news (3.6B); AllenNLP's recommended default",
        {
            "options": _one(f"{_B}/elmo_{_B}_options.json"),
            "weights": _one(f"{_B}/elmo_{_B}_weights.hdf5"),
            "softmax": _one(f"{_B}/elmo_{_B}_softmax_weights.hdf5"),
            "vocab": _one(f"{_B}/tf_checkpoint/vocab-enwiki-news-500000.txt"),
        },
        parameters_m=93.6,
        lstm_dim=4096,
        projection_dim=512,
        n_highway=2,
        srl_f1=84.93,
        parsing_f1=94.01,
    ),
    # Contributed (Matthew Peters); no figures published. The architecture is the one its file
    # names spell (2x4096_512, 2 highway layers); AllenNLP's constituency-parser experiment scripts
    # describe it as trained from scratch on 800M PubMed tokens. Its options file has the same name
    # as ``original``'s: one cache directory per model keeps them apart.
    "pubmed": PretrainedModel(
        "pubmed",
        "PubMed text (~800M tokens), contributed",
        {
            "options": _one(f"contributed/pubmed/elmo_{_O}_options.json"),
            "weights": _one(f"contributed/pubmed/elmo_{_O}_weights_PubMed_only.hdf5"),
        },
        lstm_dim=4096,
        projection_dim=512,
        n_highway=2,
    ),
}


# --- where things are ------------------------------------------------------------------------


def cache_root(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """``cache_dir``, else ``$ELMO_JAX_HOME``, else ``$XDG_CACHE_HOME/elmo_jax/models`` (``~/.cache/...``)."""
    if cache_dir is not None:
        return pathlib.Path(cache_dir).expanduser()
    if os.environ.get("ELMO_JAX_HOME"):
        return pathlib.Path(os.environ["ELMO_JAX_HOME"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return pathlib.Path(base, "elmo_jax", "models")


def _usable_root(cache_dir: str | os.PathLike | None) -> pathlib.Path:
    """``cache_root(cache_dir)``, refused where a file stands at it or above it: such a path is
    neither an empty cache to list nor one to name in a message saying where to put a file."""
    root = cache_root(cache_dir)
    if (bad := fault(root, "dir")) and bad[1] == IS_A_FILE:
        raise _cache_error(cache_dir, root, *bad)
    return root


def _cache_error(cache_dir: str | os.PathLike | None, root: pathlib.Path, culprit: str, phrase: str) -> PretrainedError:
    """The model cache at ``root`` cannot serve: ``culprit`` ``phrase`` (``paths.describe``'s
    words), said of ``cache_dir`` where the caller gave one, else of the variable that chose it."""
    if cache_dir is not None:
        return about(PretrainedError(f"cache_dir {said(culprit, phrase, str(root))}"), "cache_dir")
    source = "ELMO_JAX_HOME=" if os.environ.get("ELMO_JAX_HOME") else "the default model cache "
    kind = "a directory" if phrase == IS_A_FILE else "a directory this user can write"
    return PretrainedError(f"{source}{said(culprit, phrase, str(root))}; set ELMO_JAX_HOME to {kind}")


def offline() -> bool:
    return os.environ.get("ELMO_JAX_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _mirror() -> tuple[str, str]:
    """("http", base URL ending in /) or ("dir", local directory), from ``$ELMO_JAX_MIRROR``."""
    value = os.environ.get("ELMO_JAX_MIRROR", "").strip()
    if not value:
        return "http", BASE_URL
    if value.startswith(("http://", "https://")):
        return "http", value.rstrip("/") + "/"
    if value.startswith("file://"):
        from urllib.parse import urlparse
        from urllib.request import url2pathname

        return "dir", url2pathname(urlparse(value).path)
    if "://" in value:
        raise PretrainedError(f"ELMO_JAX_MIRROR={value}: expected an http(s):// URL, a file:// URL or a directory")
    return "dir", os.path.expanduser(value)


def source_of(f: RemoteFile) -> str:
    """Where ``f`` is fetched from: its URL, or its path under a local-directory mirror."""
    kind, base = _mirror()
    return base + f.path if kind == "http" else os.path.join(base, *f.path.split("/"))


def get_model(name: str | PretrainedModel) -> PretrainedModel:
    """The registry entry of ``name`` (case-insensitive); a ``PretrainedModel`` is returned as is."""
    if isinstance(name, PretrainedModel):
        return name
    model = MODELS.get(str(name).lower())
    if model is None:
        raise PretrainedError(f"unknown model {name!r}; known models: {', '.join(MODELS)}{did_you_mean(name, MODELS)}")
    return model


def list_models() -> list[PretrainedModel]:
    """The registry's models, in its order (the released ones smallest first, then contributed ones)."""
    return list(MODELS.values())


def _files(model: PretrainedModel, roles: Sequence[str]) -> list[RemoteFile]:
    if isinstance(roles, str):
        roles = (roles,)
    out: list[RemoteFile] = []
    for role in roles:
        if role not in model.files:
            raise PretrainedError(f"{model.name}: no {role!r} file was released; it has {', '.join(model.files)}")
        out.extend(model.files[role])
    return out


# --- the manifest and the lock ---------------------------------------------------------------


def _read_manifest(model_dir: pathlib.Path) -> dict:
    try:
        with open(model_dir / MANIFEST, encoding="utf-8") as f:
            return json.load(f).get("files", {})
    except (OSError, ValueError):
        return {}  # none yet (or unreadable): sizes pinned here still apply, hashes get recomputed


def _record(model_dir: pathlib.Path, local: str, entry: dict) -> None:
    """Adds one file's entry to the manifest; call with the model's lock held."""
    files = _read_manifest(model_dir)
    files[local] = entry
    write_text_atomic(model_dir / MANIFEST, json.dumps({"format": 1, "files": files}, indent=1, sort_keys=True) + "\n")


def _locked(model_dir: pathlib.Path) -> FileLock:
    """The model's lock, for one download or cache check at a time (none on Windows)."""
    return FileLock(model_dir / ".lock")


# --- checks ------------------------------------------------------------------------------------


def _sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def _looks_like_html(f: RemoteFile, head: bytes) -> bool:
    """An error or login page served in a file's place (mirrors and proxies answer 200 with one)."""
    start = head.lstrip()[:16].lower()
    if start.startswith((b"<!doctype", b"<html")):
        return True
    # hdf5 starts with its signature and JSON with "{": a "<" is markup. (A vocabulary starts
    # with "</S>", and a checkpoint's data file may start with any byte, so only these two.)
    return f.local.endswith((".hdf5", ".json")) and start[:1] == b"<"


def _pins(model: PretrainedModel, sha256: Mapping[str, str] | None) -> dict[str, str]:
    """Local file name -> pinned sha256, from ``$ELMO_JAX_SHA256`` and then the argument."""
    keyed: dict[str, tuple[str, str]] = {}  # key -> (digest, where it was pinned: said if it is bad)
    for item in filter(None, (s.strip() for s in os.environ.get("ELMO_JAX_SHA256", "").split(","))):
        target, _, digest = item.partition("=")
        model_name, _, key = target.partition(":")
        if not key or not digest:
            raise PretrainedError(f"ELMO_JAX_SHA256: {item!r} is not MODEL:KEY=HEX")
        if model_name.strip().lower() == model.name:
            keyed[key.strip()] = (digest.strip(), "ELMO_JAX_SHA256")
    keyed.update({key: (digest, "sha256") for key, digest in (sha256 or {}).items()})
    pins = {}
    for key, (digest, where) in keyed.items():
        digest = digest.lower()
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise PretrainedError(f"{where}: the sha256 pinned for {model.name}'s {key!r} is not 64 hex digits")
        if key in model.files:
            if len(model.files[key]) != 1:
                raise PretrainedError(
                    f"{model.name}: pin the {key} files by name ({', '.join(f.local for f in model.files[key])})"
                )
            pins[model.files[key][0].local] = digest
        elif any(key == f.local for files in model.files.values() for f in files):
            pins[key] = digest
        else:
            raise PretrainedError(
                f"{model.name}: cannot pin {key!r}: not a role ({', '.join(model.files)}) nor a file of the model"
            )
    return pins


def _expected_size(f: RemoteFile, manifest: dict) -> int | None:
    return f.size if f.size is not None else manifest.get(f.local, {}).get("size")


def _check_cached(
    model: PretrainedModel, f: RemoteFile, path: pathlib.Path, manifest: dict, pin: str | None, rehash: bool = False
) -> str | None:
    """Refuses a cached file whose size (or hash) is not the expected one; returns its sha256 when known."""
    size, expected = path.stat().st_size, _expected_size(f, manifest)
    if expected is not None and size != expected:
        raise PretrainedError(
            f"{path}: {size} bytes, but {model.name}'s {f.local} has {expected}; delete it to download it again"
        )
    recorded = manifest.get(f.local, {}).get("sha256")
    if not (pin or rehash):
        return recorded
    digest = _sha256(path) if rehash or not recorded else recorded
    if recorded and digest != recorded:
        raise PretrainedError(
            f"{path}: sha256 {digest} differs from the {recorded} recorded when it was "
            f"downloaded; delete it to download it again"
        )
    if pin and digest != pin:
        raise PretrainedError(f"{path}: sha256 {digest}, but {pin} is pinned; delete it to download it again")
    return digest


def _finish(model: PretrainedModel, f: RemoteFile, part: pathlib.Path, source: str, pin: str | None) -> str:
    """Checks a complete ``.part`` file: its size, that it is no HTML page, its pinned hash. Returns its sha256."""
    size = part.stat().st_size
    if f.size is not None and size != f.size:
        raise PretrainedError(f"{source}: got {size} bytes, but {model.name}'s {f.local} has {f.size}")
    with open(part, "rb") as fh:
        if _looks_like_html(f, fh.read(512)):
            raise PretrainedError(f"{source}: got an HTML page, not {f.local}; is the mirror right?")
    digest = _sha256(part)
    if pin and digest != pin:
        raise PretrainedError(f"{source}: sha256 {digest}, but {pin} is pinned for {f.local}")
    return digest


# --- transfers ---------------------------------------------------------------------------------


def _bar(f: RemoteFile, total: int | None, initial: int, progress: bool):
    from tqdm import tqdm

    return tqdm(
        total=total,
        initial=initial,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=f.local,
        disable=not progress,
        file=sys.stderr,
        **bar_size(sys.stderr),
    )


def _chunks(read, source: str) -> Iterator[bytes]:
    import http.client

    while True:
        try:
            chunk = read(CHUNK)
        except (http.client.HTTPException, OSError) as e:  # reset, timeout, incomplete read
            raise _Interrupted(f"{source}: transfer broke off ({e.__class__.__name__}: {e})") from None
        if not chunk:
            return
        yield chunk


def _content_range(value: str | None) -> tuple[int, int | None]:
    """``bytes START-END/TOTAL`` -> (START, TOTAL or None)."""
    try:
        span, _, total = (value or "").split(" ", 1)[1].partition("/")
        return int(span.split("-")[0]), (None if total in ("", "*") else int(total))
    except (AttributeError, IndexError, ValueError):
        return -1, None


def _http_attempt(model: PretrainedModel, f: RemoteFile, part: pathlib.Path, url: str, progress: bool) -> None:
    """One request: resumes ``part`` from its size, or restarts it from zero when the server will not."""
    from urllib.error import HTTPError, URLError
    from urllib.request import Request, urlopen

    offset = part.stat().st_size if part.exists() else 0
    if f.size is not None and offset >= f.size:
        if offset == f.size:
            return  # a previous attempt got every byte but stopped before the rename
        part.unlink()
        offset = 0
    headers = {"User-Agent": "elmo-jax"}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    try:
        resp = urlopen(Request(url, headers=headers), timeout=TIMEOUT_S)
    except HTTPError as e:
        if e.code == 416 and offset:  # the part is not a prefix the server recognises: start over
            part.unlink()
            raise _Interrupted(f"{url}: HTTP 416 for a resume; restarting") from None
        if e.code >= 500 or e.code == 429:  # the server's trouble or its load, not the request: retried
            raise _Interrupted(f"{url}: HTTP {e.code} {e.reason}") from None
        raise PretrainedError(f"{url}: HTTP {e.code} {e.reason} (for {model.name}'s {f.local})") from None
    except (URLError, OSError) as e:
        raise _Interrupted(f"{url}: cannot connect ({getattr(e, 'reason', e)})") from None
    with resp:
        if resp.headers.get_content_type() == "text/html":
            raise PretrainedError(
                f"{url}: the server sent an HTML page (Content-Type text/html), not "
                f"{model.name}'s {f.local}; is the mirror right?"
            )
        if resp.status == 206:
            start, total = _content_range(resp.headers.get("Content-Range"))
            if start != offset:
                part.unlink()
                raise _Interrupted(f"{url}: the server resumed at byte {start}, not {offset}; restarting")
        else:
            # 200: the whole file. A server that ignores Range answers this too: the body starts at
            # byte 0, so it replaces the partial file, never extends it.
            offset, length = 0, resp.headers.get("Content-Length")
            total = int(length) if length and length.isdigit() else None
        chunks = _chunks(resp.read, url)
        first = next(chunks, b"")
        # Before the size check: an error page is better reported as what it is.
        if offset == 0 and _looks_like_html(f, first):
            raise PretrainedError(
                f"{url}: the server sent an HTML page, not {model.name}'s {f.local}; is the mirror right?"
            )
        if f.size is not None and total is not None and total != f.size:
            raise PretrainedError(f"{url}: the server has {total} bytes, but {model.name}'s {f.local} has {f.size}")
        done = offset
        with open(part, "ab" if offset else "wb") as out, _bar(f, total, offset, progress) as bar:
            for chunk in _prepend(first, chunks):
                out.write(chunk)
                done += len(chunk)
                bar.update(len(chunk))
                if f.size is not None and done > f.size:
                    raise PretrainedError(f"{url}: more than the {f.size} bytes of {model.name}'s {f.local}")
    # http.client ends a body cut short with a quiet EOF, not an error: the count is the check.
    if total is not None and done < total:
        raise _Interrupted(f"{url}: transfer broke off at byte {done} of {total}")


def _prepend(first: bytes, rest: Iterator[bytes]) -> Iterator[bytes]:
    if first:
        yield first
    yield from rest


def _http_get(model: PretrainedModel, f: RemoteFile, part: pathlib.Path, url: str, progress: bool) -> None:
    for attempt in range(1, ATTEMPTS + 1):
        try:
            return _http_attempt(model, f, part, url, progress)
        except _Interrupted as e:
            if attempt == ATTEMPTS:
                kept = part.stat().st_size if part.exists() else 0
                resume = f"; {kept} bytes kept in {part}, run again to resume" if kept else ""
                raise _Interrupted(f"{e} (after {ATTEMPTS} tries{resume})") from None
            time.sleep(RETRY_WAIT_S * attempt)


def _copy(model: PretrainedModel, f: RemoteFile, part: pathlib.Path, src: str, progress: bool) -> None:
    try:
        size = os.path.getsize(src)
    except OSError:
        raise PretrainedError(f"mirror: {src} not found (for {model.name}'s {f.local})") from None
    if f.size is not None and size != f.size:
        raise PretrainedError(f"{src}: {size} bytes, but {model.name}'s {f.local} has {f.size}")
    with open(src, "rb") as inp, open(part, "wb") as out, _bar(f, size, 0, progress) as bar:
        for chunk in _chunks(inp.read, src):
            out.write(chunk)
            bar.update(len(chunk))


def _download(model: PretrainedModel, f: RemoteFile, model_dir: pathlib.Path, progress: bool, pin: str | None) -> None:
    """Fetches ``f`` into ``model_dir`` (call with the model's lock held): ``.part``, checks, rename, manifest."""
    path = model_dir / f.local
    part = path.with_name(path.name + ".part")
    kind, _ = _mirror()
    source = source_of(f)
    # A full (or read-only) cache is said naming the file, and the partial file kept to resume;
    # the network's OSErrors pass as they are.
    try:
        with reported(path, space_only=True):
            if kind == "http":
                _http_get(model, f, part, source, progress)
            else:
                _copy(model, f, part, source, progress)
            digest = _finish(model, f, part, source, pin)
    except _Interrupted as e:  # a broken transfer: the partial file stays for the next run to resume
        raise DownloadFailed(str(e)) from None  # the public type (_Interrupted is the retries' signal)
    except PretrainedError:
        part.unlink(missing_ok=True)  # refused content (404, an HTML page, a wrong size or hash): none of it stays
        raise
    os.replace(part, path)
    _record(
        model_dir,
        f.local,
        {
            "size": path.stat().st_size,
            "sha256": digest,
            "source": source,
            "fetched": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
    )


# --- the API -------------------------------------------------------------------------------------


def fetch(
    name: str | PretrainedModel,
    files: Sequence[str] = DEFAULT_FILES,
    *,
    cache_dir: str | os.PathLike | None = None,
    progress: bool | None = None,
    sha256: Mapping[str, str] | None = None,
) -> dict[str, pathlib.Path]:
    """Makes the ``files`` (roles) of model ``name`` present in the cache; returns role -> local path.

    A role's path is its file; for ``checkpoint`` it is the directory holding the TF checkpoint
    (``options.json``, ``model.ckpt-STEP.*`` and, except for ``medium``, TF's ``checkpoint``
    index): bilm-tf's restart takes that directory, and the checkpoint prefix is
    ``DIR/model.ckpt-STEP``.

    ``progress``: a tqdm bar per download (default: when stderr is a terminal). ``sha256``: pins,
    role or file name -> hex digest; a download that does not match is deleted and refused, and
    so is a cached file whose recorded hash does not. Files already cached are only checked
    (size, and recorded hash against pins), never downloaded again.
    """
    model = get_model(name)
    wanted = _files(model, files)
    pins = _pins(model, sha256)
    progress = is_terminal(sys.stderr) if progress is None else progress
    model_dir = _usable_root(cache_dir) / model.name
    manifest = _read_manifest(model_dir)
    missing = []
    for f in wanted:
        path = model_dir / f.local
        if path.is_file():
            _check_cached_and_record(model, f, path, model_dir, manifest, pins.get(f.local))
        else:
            missing.append(f)
    if missing and offline():
        f = missing[0]
        raise PretrainedError(
            f"ELMO_JAX_OFFLINE is set and {model.name}'s {f.local} is not cached: "
            f"get {source_of(f)} and put it at {model_dir / f.local}"
        )
    if missing:
        try:  # the model's directory and those of its files (a TF checkpoint's are nested)
            for d in dict.fromkeys([model_dir, *((model_dir / f.local).parent for f in missing)]):
                d.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # not this user's, a read-only file system, a file in the way
            raise _cache_error(cache_dir, model_dir.parent, *describe(e)) from None
        with _locked(model_dir):
            manifest = _read_manifest(model_dir)
            for f in missing:
                path = model_dir / f.local
                if path.is_file():  # another process fetched it while we waited for the lock
                    _check_cached(model, f, path, manifest, pins.get(f.local))
                else:
                    _download(model, f, model_dir, progress, pins.get(f.local))
    roles = [files] if isinstance(files, str) else list(files)
    return {
        role: model_dir / (CHECKPOINT_DIR if role == "checkpoint" else model.files[role][0].local) for role in roles
    }


def _check_cached_and_record(model, f, path, model_dir, manifest, pin) -> None:
    digest = _check_cached(model, f, path, manifest, pin)
    if digest and f.local not in manifest:
        # Put there by hand (offline) and hashed for a pin: remember it, if the cache is writable.
        with contextlib.suppress(OSError):
            with _locked(model_dir):
                _record(model_dir, f.local, {"size": path.stat().st_size, "sha256": digest, "source": "local"})


def load_pretrained(name: str | PretrainedModel, **fetch_kwargs):
    """``(ModelConfig, params)`` of a released model: ``fetch`` its options and weights, then read them.

    ``fetch_kwargs``: ``cache_dir``, ``progress``, ``sha256`` as for ``fetch``.
    """
    from elmo_jax.compat.hdf5 import load_hdf5  # jax: only when a model is loaded

    paths = fetch(name, DEFAULT_FILES, **fetch_kwargs)
    return load_hdf5(paths["options"], paths["weights"])


def verify(
    name: str | PretrainedModel, *, cache_dir: str | os.PathLike | None = None, sha256: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Rehashes every cached file of ``name``: local name -> sha256.

    Refuses (``PretrainedError``, naming the first bad file) a size other than the pinned or
    recorded one, a hash other than the recorded one, or one other than a pin. A file cached
    without a recorded hash (put there by hand) gets one recorded. Files not cached are skipped.
    """
    model = get_model(name)
    pins = _pins(model, sha256)
    model_dir = _usable_root(cache_dir) / model.name
    manifest = _read_manifest(model_dir)
    out = {}
    for files in model.files.values():
        for f in files:
            path = model_dir / f.local
            if path.is_file():
                digest = _check_cached(model, f, path, manifest, pins.get(f.local), rehash=True)
                assert digest is not None  # rehash: always known
                out[f.local] = digest
                if f.local not in manifest:
                    with contextlib.suppress(OSError), _locked(model_dir):
                        _record(
                            model_dir, f.local, {"size": path.stat().st_size, "sha256": out[f.local], "source": "local"}
                        )
    return out


@dataclass(frozen=True)
class FileStatus:
    """One row of ``elmo-jax models``: a released file and its state in the cache."""

    model: str
    role: str
    file: str  # its name in the model's cache directory
    size: int | None  # the released size where known, else the size recorded at download
    path: pathlib.Path
    state: str  # "cached", "partial", "wrong size" or "missing"
    on_disk: int | None  # bytes of the file (or of its .part)


def cache_status(
    cache_dir: str | os.PathLike | None = None, models: Sequence[str | PretrainedModel] | None = None
) -> list[FileStatus]:
    """Every released file of ``models`` (default: all) and whether it is cached; checks sizes only.
    A cache directory that does not exist yet has nothing in it (``_usable_root``)."""
    root = _usable_root(cache_dir)
    rows = []
    for model in (get_model(m) for m in (models if models is not None else MODELS)):
        model_dir = root / model.name
        manifest = _read_manifest(model_dir)
        for role, files in model.files.items():
            for f in files:
                path, expected = model_dir / f.local, _expected_size(f, manifest)
                part = path.with_name(path.name + ".part")
                if path.is_file():
                    on_disk = path.stat().st_size
                    state = "cached" if expected is None or on_disk == expected else "wrong size"
                elif part.is_file():
                    on_disk, state = part.stat().st_size, "partial"
                else:
                    on_disk, state = None, "missing"
                rows.append(FileStatus(model.name, role, f.local, expected, path, state, on_disk))
    return rows
