"""bilm-tf's TensorFlow training checkpoints (``model.ckpt-N``), read without TensorFlow.

A TF V2 checkpoint ``PREFIX`` is ``PREFIX.index`` plus data shards
``PREFIX.data-00000-of-0000N``. The index is an uncompressed LevelDB-style table: data blocks of
prefix-compressed keys with restart points, an index block pointing at them, an (empty)
metaindex block and a 48-byte footer ending in the table magic number; every block is followed
by a 5-byte trailer (compression type, masked crc32c of the block and that byte). Under the key
``""`` is a ``BundleHeaderProto`` (``num_shards`` 1, ``endianness`` 2, ``version`` 3); under
every other key, a tensor name, a ``BundleEntryProto`` (``dtype`` 1, ``shape`` 2 as a
``TensorShapeProto`` with ``dim`` 2 of ``size`` 1, ``shard_id`` 3, ``offset`` 4, ``size`` 5,
``crc32c`` 6 as fixed32, ``slices`` 7). The tensor's bytes are ``[offset, offset + size)`` of
shard ``shard_id``, little-endian, C order, and their crc32c, masked as TF masks it, is in the
entry. The protobuf wire format is decoded here by hand.

``TFCheckpoint`` maps names to read-only ``np.memmap`` views (a sharded state reads only its
own rows) and checks crc32c on demand; ``read_bilm_tf`` turns a bilm-tf checkpoint into this
project's params, Adagrad accumulators and step.

crc32c uses ``google_crc32c`` when it is installed; otherwise a numpy implementation that runs
the byte-at-a-time table recurrence, four bytes per step through two 65536-entry tables, over
thousands of equal chunks at once, then folds the chunk CRCs together with GF(2) "append n zero
bytes" operators (the crc32c-combine construction).
"""

from __future__ import annotations

import codecs
import dataclasses
import functools
import glob
import math
import os
import re
import struct
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

try:  # optional: 5-10x faster than the numpy fallback
    import google_crc32c as _google_crc32c
except ImportError:  # pragma: no cover - exercised on machines without it
    _google_crc32c = None  # type: ignore[assignment]  # the optional module's stand-in


class TFCheckpointError(Exception):
    """A TF checkpoint is missing, damaged, or not what the caller expects."""


# ---------------------------------------------------------------------------------------------
# crc32c (Castagnoli, reflected polynomial 0x82F63B78), as TF and leveldb use it.

_POLY = 0x82F63B78
_MASK_DELTA = 0xA282EAD8


def mask_crc32c(crc: int) -> int:
    """TF's stored form of a crc32c: rotated right by 15 bits, plus a constant (mod 2**32)."""
    crc &= 0xFFFFFFFF
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + _MASK_DELTA) & 0xFFFFFFFF


def unmask_crc32c(masked: int) -> int:
    rot = (masked - _MASK_DELTA) & 0xFFFFFFFF
    return ((rot >> 17) | (rot << 15)) & 0xFFFFFFFF


def _apply(op: np.ndarray, x) -> np.ndarray:
    """A linear map of 32-bit CRC registers, given as its action on each byte lane (4 x 256)."""
    x = np.asarray(x, np.uint32)
    return op[0][x & 0xFF] ^ op[1][(x >> 8) & 0xFF] ^ op[2][(x >> 16) & 0xFF] ^ op[3][x >> 24]


class _Tables:
    """Lookup tables of the numpy crc32c, built on first use (about 10 ms)."""

    def __init__(self):
        c = np.arange(256, dtype=np.uint32)
        for _ in range(8):
            c = np.where(c & 1, (c >> 1) ^ np.uint32(_POLY), c >> 1).astype(np.uint32)
        byte = np.arange(256, dtype=np.uint32)
        self.basis = np.stack([byte << np.uint32(8 * k) for k in range(4)])
        # One zero byte through the register: x -> T[x & 0xff] ^ (x >> 8).
        zero = np.stack([c] + [byte << np.uint32(8 * (k - 1)) for k in range(1, 4)])
        self.zero_pow2 = [zero]  # [j]: 2**j zero bytes
        for _ in range(63):
            z = self.zero_pow2[-1]
            self.zero_pow2.append(_apply(z, _apply(z, self.basis)))
        four = self.zero_pow2[2]
        half = np.arange(65536, dtype=np.uint32)
        # Four message bytes w after register x: x' = F(x ^ w), F = four zero bytes, split in halves.
        self.lo = _apply(four, half)
        self.hi = _apply(four, half << np.uint32(16))

    def shift(self, x: np.ndarray, n: int) -> np.ndarray:
        """Registers ``x`` after ``n`` zero bytes."""
        j = 0
        while n:
            if n & 1:
                x = _apply(self.zero_pow2[j], x)
            n >>= 1
            j += 1
        return x


@functools.lru_cache(maxsize=1)
def _tables() -> _Tables:
    return _Tables()


_CHUNKS = 16384  # chunks processed side by side
_CHUNK_MAX = 64  # bytes per chunk at most: one segment is at most 1 MiB


def _raw_segment(t: _Tables, data: np.ndarray) -> int:
    """CRC register after ``data`` from register 0 (no pre/post inversion); ``len(data) <= 1 MiB``."""
    n = data.size
    if n == 0:
        return 0
    length = min(_CHUNK_MAX, max(4, 1 << (math.ceil(n / _CHUNKS) - 1).bit_length()))
    k = -(-n // length)
    if k * length != n:
        # Leading zero bytes keep a zero register at zero: pad in front up to k whole chunks.
        buf = np.zeros(k * length, np.uint8)
        buf[k * length - n :] = data
        data = buf
    # Row j holds word j of every chunk (a transposed copy: contiguous rows run fastest).
    rows = np.ascontiguousarray(data.view("<u4").reshape(k, length // 4).T)
    crc = np.zeros(k, np.uint32)
    x = np.empty(k, np.uint32)
    halves = x.view(np.uint16)  # the low and high 16 bits of x, without shifting or masking
    low, high = (halves[0::2], halves[1::2]) if sys.byteorder == "little" else (halves[1::2], halves[0::2])
    tmp = np.empty(k, np.uint32)
    for row in rows:
        np.bitwise_xor(crc, row, out=x)
        np.take(t.lo, low, out=crc)
        np.take(t.hi, high, out=tmp)
        crc ^= tmp
    # Fold pairs: crc(A + B) = shift(crc(A), len(B)) ^ crc(B). Zero chunks in front change nothing.
    width = 1 << (k - 1).bit_length()
    if width != k:
        crc = np.concatenate([np.zeros(width - k, np.uint32), crc])
    level = length.bit_length() - 1
    while crc.size > 1:
        crc = _apply(t.zero_pow2[level], crc[0::2]) ^ crc[1::2]
        level += 1
    return int(crc[0])


def crc32c_numpy(data, crc: int = 0) -> int:
    """crc32c of ``data`` (any buffer) continuing from ``crc`` (that of the bytes before it)."""
    t = _tables()
    if isinstance(data, np.ndarray):
        arr = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    else:
        arr = np.frombuffer(memoryview(data).cast("B"), np.uint8)
    reg = np.asarray(~crc & 0xFFFFFFFF, np.uint32)
    step = _CHUNKS * _CHUNK_MAX
    for start in range(0, arr.size, step):
        seg = arr[start : start + step]
        reg = t.shift(reg, seg.size) ^ np.uint32(_raw_segment(t, seg))
    return int(~reg & 0xFFFFFFFF)


def crc32c(data, crc: int = 0) -> int:
    """crc32c of ``data`` continuing from ``crc``: ``google_crc32c`` if installed, else numpy."""
    if _google_crc32c is None:
        return crc32c_numpy(data, crc)
    if not isinstance(data, bytes):
        data = bytes(memoryview(data).cast("B"))  # it takes bytes only
    return _google_crc32c.extend(crc, data)


def crc32c_implementation() -> str:
    return "google_crc32c" if _google_crc32c is not None else "numpy"


def _file_crc32c(path: str, offset: int, size: int, block: int = 8 << 20) -> int:
    crc = 0
    with open(path, "rb") as f:
        f.seek(offset)
        left = size
        while left:
            chunk = f.read(min(block, left))
            if not chunk:
                raise TFCheckpointError(f"{path}: ends before byte {offset + size} (truncated)")
            crc = crc32c(chunk, crc)
            left -= len(chunk)
    return crc


# ---------------------------------------------------------------------------------------------
# Protobuf wire format and the table file.


def _varint(buf: bytes, pos: int, where: str) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise TFCheckpointError(f"{where}: bad varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def _signed64(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _proto_fields(buf: bytes, where: str) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value) of a serialized message; varints unsigned. The value is
    an int for wire types 0, 1 and 5, bytes for 2 (which a type can't say: hence ``Any``)."""
    pos = 0
    value: int | bytes
    while pos < len(buf):
        key, pos = _varint(buf, pos, where)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos, where)
        elif wire == 1:
            if pos + 8 > len(buf):
                raise TFCheckpointError(f"{where}: truncated fixed64 field")
            value, pos = struct.unpack_from("<Q", buf, pos)[0], pos + 8
        elif wire == 2:
            n, pos = _varint(buf, pos, where)
            if pos + n > len(buf):
                raise TFCheckpointError(f"{where}: truncated length-delimited field")
            value, pos = bytes(buf[pos : pos + n]), pos + n
        elif wire == 5:
            if pos + 4 > len(buf):
                raise TFCheckpointError(f"{where}: truncated fixed32 field")
            value, pos = struct.unpack_from("<I", buf, pos)[0], pos + 4
        else:
            raise TFCheckpointError(f"{where}: unsupported protobuf wire type {wire}")
        yield field, wire, value


_TABLE_MAGIC = 0xDB4775248B80FB57
_FOOTER = 48


def _read_block(data: bytes, handle: bytes, path: str, what: str) -> bytes:
    offset, pos = _varint(handle, 0, f"{path}: {what} handle")
    size, _ = _varint(handle, pos, f"{path}: {what} handle")
    end = offset + size
    if end + 5 > len(data) - _FOOTER:
        raise TFCheckpointError(
            f"{path}: bad index: {what} at bytes [{offset}, {end + 5}) runs past the "
            f"table ({len(data) - _FOOTER} bytes before the footer)"
        )
    stored = struct.unpack_from("<I", data, end + 1)[0]
    if crc32c(data[offset : end + 1]) != unmask_crc32c(stored):
        raise TFCheckpointError(f"{path}: bad index: crc32c mismatch in the {what} at byte {offset}")
    kind = data[end]
    if kind != 0:
        name = "snappy-compressed" if kind == 1 else f"compression type {kind}"
        raise TFCheckpointError(
            f"{path}: {what} is {name}; only uncompressed tables are supported (TF >= 1.2 writes them)"
        )
    return data[offset:end]


def _block_entries(block: bytes, path: str, what: str) -> Iterator[tuple[bytes, bytes]]:
    where = f"{path}: {what}"
    if len(block) < 4:
        raise TFCheckpointError(f"{where}: bad index: block of {len(block)} bytes")
    restarts = struct.unpack_from("<I", block, len(block) - 4)[0]
    limit = len(block) - 4 * (restarts + 1)
    if restarts < 1 or limit < 0:
        raise TFCheckpointError(f"{where}: bad index: {restarts} restart points in a {len(block)}-byte block")
    pos, key = 0, b""
    while pos < limit:
        shared, pos = _varint(block, pos, where)
        unshared, pos = _varint(block, pos, where)
        value_len, pos = _varint(block, pos, where)
        if shared > len(key) or pos + unshared + value_len > limit:
            raise TFCheckpointError(f"{where}: bad index: corrupt entry at byte {pos}")
        key = key[:shared] + block[pos : pos + unshared]
        pos += unshared
        yield key, block[pos : pos + value_len]
        pos += value_len


def _read_table(path: str) -> list[tuple[bytes, bytes]]:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise TFCheckpointError(f"{path}: checkpoint index not found") from None
    if len(data) < _FOOTER:
        raise TFCheckpointError(f"{path}: bad index: {len(data)} bytes, shorter than the {_FOOTER}-byte footer")
    footer = data[-_FOOTER:]
    if struct.unpack_from("<Q", footer, _FOOTER - 8)[0] != _TABLE_MAGIC:
        raise TFCheckpointError(f"{path}: bad index: no table magic number (not a TF V2 checkpoint index)")
    _, pos = _varint(footer, 0, f"{path}: footer")  # metaindex offset
    _, pos = _varint(footer, pos, f"{path}: footer")  # metaindex size
    for _ in _block_entries(_read_block(data, footer, path, "metaindex block"), path, "metaindex block"):
        pass  # TF writes no filter: nothing to use, but its checksum and layout are checked
    index = _read_block(data, footer[pos:], path, "index block")
    entries: list[tuple[bytes, bytes]] = []
    for _, handle in _block_entries(index, path, "index block"):
        block = _read_block(data, handle, path, "data block")
        entries.extend(_block_entries(block, path, "data block"))
    for (a, _), (b, _) in zip(entries, entries[1:]):
        if not a < b:
            raise TFCheckpointError(f"{path}: bad index: keys out of order ({a!r} before {b!r})")
    return entries


# ---------------------------------------------------------------------------------------------
# Entries and the checkpoint.

# TF DataType enum (types.proto) -> little-endian numpy dtype.
_DTYPES = {
    1: "<f4",
    2: "<f8",
    3: "<i4",
    4: "u1",
    5: "<i2",
    6: "i1",
    9: "<i8",
    10: "?",
    17: "<u2",
    19: "<f2",
    22: "<u4",
    23: "<u8",
}
_DTYPE_NAMES = {
    0: "DT_INVALID",
    7: "DT_STRING",
    8: "DT_COMPLEX64",
    11: "DT_QINT8",
    12: "DT_QUINT8",
    13: "DT_QINT32",
    14: "DT_BFLOAT16",
    15: "DT_QINT16",
    16: "DT_QUINT16",
    18: "DT_COMPLEX128",
    20: "DT_RESOURCE",
    21: "DT_VARIANT",
}


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One ``BundleEntryProto``."""

    name: str
    dtype_enum: int
    shape: tuple[int, ...]
    shard_id: int
    offset: int
    size: int
    crc32c: int  # masked, as stored
    sliced: bool

    @property
    def dtype(self) -> np.dtype | None:
        code = _DTYPES.get(self.dtype_enum)
        return None if code is None else np.dtype(code)


def _parse_shape(buf: bytes, where: str) -> tuple[int, ...]:
    dims = []
    for field, wire, value in _proto_fields(buf, where):
        if field == 2 and wire == 2:
            size = 0
            for f2, w2, v2 in _proto_fields(value, where):
                if f2 == 1 and w2 == 0:
                    size = _signed64(v2)
            dims.append(size)
        elif field == 3 and wire == 0 and value:
            raise TFCheckpointError(f"{where}: shape of unknown rank")
    if any(d < 0 for d in dims):
        raise TFCheckpointError(f"{where}: shape {tuple(dims)} has unknown dimensions")
    return tuple(dims)


def _parse_entry(name: str, buf: bytes, where: str) -> TensorEntry:
    values: dict[str, Any] = {
        "dtype": 0,
        "shape": (),
        "shard_id": 0,
        "offset": 0,
        "size": 0,
        "crc32c": 0,
        "sliced": False,
    }
    for field, wire, value in _proto_fields(buf, where):
        if field == 1 and wire == 0:
            values["dtype"] = value
        elif field == 2 and wire == 2:
            values["shape"] = _parse_shape(value, where)
        elif field in (3, 4, 5) and wire == 0:
            values[{3: "shard_id", 4: "offset", 5: "size"}[field]] = _signed64(value)
        elif field == 6 and wire == 5:
            values["crc32c"] = value
        elif field == 7:
            values["sliced"] = True
    return TensorEntry(
        name,
        values["dtype"],
        values["shape"],
        values["shard_id"],
        values["offset"],
        values["size"],
        values["crc32c"],
        values["sliced"],
    )


def data_filename(prefix: str, shard: int, num_shards: int) -> str:
    return f"{prefix}.data-{shard:05d}-of-{num_shards:05d}"


_TEXT_PATH = re.compile(r'^\s*model_checkpoint_path\s*:\s*"((?:[^"\\]|\\.)*)"', re.M)


def resolve_prefix(path: str | os.PathLike) -> str:
    """A checkpoint prefix from a prefix (``DIR/model.ckpt-935588``, with or without ``.index``)
    or a directory: the one its TF ``checkpoint`` file names, else its single ``*.index``."""
    path = os.fspath(path)
    if os.path.isdir(path):
        state = os.path.join(path, "checkpoint")
        if os.path.isfile(state):
            with open(state, "rb") as f:
                match = _TEXT_PATH.search(f.read().decode("utf-8", "replace"))
            if not match:
                raise TFCheckpointError(f"{state}: no model_checkpoint_path line")
            named = codecs.escape_decode(match.group(1).encode("utf-8"))[0].decode("utf-8")
            candidates = [named if os.path.isabs(named) else os.path.join(path, named)]
            # bilm-tf's Saver wrote absolute paths of the training machine: look beside the file too.
            candidates.append(os.path.join(path, os.path.basename(named)))
            for prefix in candidates:
                if os.path.isfile(prefix + ".index"):
                    return prefix
            raise TFCheckpointError(
                f"{state} names checkpoint {named!r}, but neither "
                f"{candidates[0]}.index nor {candidates[1]}.index exists"
            )
        indexes = sorted(glob.glob(os.path.join(glob.escape(path), "*.index")))
        if len(indexes) == 1:
            return indexes[0][: -len(".index")]
        if not indexes:
            raise TFCheckpointError(f"{path}: no TF checkpoint here (no 'checkpoint' file, no *.index)")
        names = ", ".join(os.path.basename(i)[: -len(".index")] for i in indexes)
        raise TFCheckpointError(
            f"{path}: {len(indexes)} checkpoints ({names}) and no 'checkpoint' file "
            "naming one; pass the prefix, e.g. " + indexes[-1][: -len(".index")]
        )
    path = re.sub(r"\.(index|data-\d{5}-of-\d{5})$", "", path)
    if not os.path.isfile(path + ".index"):
        raise TFCheckpointError(
            f"{path}.index: checkpoint index not found (expected a checkpoint prefix "
            "such as DIR/model.ckpt-935588, or its directory)"
        )
    return path


class TFCheckpoint:
    """A TF V2 checkpoint, read without TensorFlow.

    ``get(name)`` returns a read-only ``np.memmap`` view of the tensor (nothing is read until
    used) after checking its crc32c (``verify=False`` skips that, e.g. to read a few rows of a
    large table). Opening checks the index (block checksums, header, entries) and that every
    data shard exists and is long enough for its entries; ``verify=True`` also checks every
    tensor's crc32c at once.
    """

    def __init__(self, path: str | os.PathLike, verify: bool = False):
        self.prefix = resolve_prefix(path)
        self.index_path = self.prefix + ".index"
        table = _read_table(self.index_path)
        if not table or table[0][0] != b"":
            raise TFCheckpointError(f"{self.index_path}: bad index: no header entry (key '')")
        self._parse_header(table[0][1])
        self._entries: dict[str, TensorEntry] = {}
        for key, value in table[1:]:
            name = key.decode("utf-8", "surrogateescape")
            self._entries[name] = _parse_entry(name, value, f"{self.index_path}: entry {name!r}")
        self._maps: dict[int, np.memmap | None] = {}
        self._verified: set[str] = set()
        self._check_shards()
        if verify:
            self.verify()

    def _parse_header(self, buf: bytes) -> None:
        where = f"{self.index_path}: header"
        self.num_shards, endianness, min_consumer = 1, 0, 0
        for field, wire, value in _proto_fields(buf, where):
            if field == 1 and wire == 0:
                self.num_shards = _signed64(value)
            elif field == 2 and wire == 0:
                endianness = value
            elif field == 3 and wire == 2:
                for f2, w2, v2 in _proto_fields(value, where):
                    if f2 == 2 and w2 == 0:
                        min_consumer = v2
        if endianness != 0:
            raise TFCheckpointError(
                f"{self.index_path}: big-endian checkpoint (header endianness "
                f"{endianness}); only little-endian checkpoints are supported"
            )
        if min_consumer > 1:
            raise TFCheckpointError(
                f"{self.index_path}: needs a tensor-bundle reader of version "
                f">= {min_consumer} (this one reads version 1)"
            )
        if self.num_shards < 1:
            raise TFCheckpointError(f"{self.index_path}: bad index: header says {self.num_shards} shards")

    def _check_shards(self) -> None:
        sizes: dict[int, int] = {}
        for shard in range(self.num_shards):
            path = self.data_path(shard)
            try:
                sizes[shard] = os.path.getsize(path)
            except FileNotFoundError:
                raise TFCheckpointError(
                    f"{path}: missing data shard {shard + 1} of {self.num_shards} of checkpoint {self.prefix}"
                ) from None
        for entry in self._entries.values():
            if entry.sliced:
                continue
            if not 0 <= entry.shard_id < self.num_shards:
                raise TFCheckpointError(
                    f"{self.index_path}: entry {entry.name!r} is in shard {entry.shard_id}, "
                    f"but the header says {self.num_shards} shards"
                )
            path = self.data_path(entry.shard_id)
            end = entry.offset + entry.size
            if entry.offset < 0 or entry.size < 0 or end > sizes[entry.shard_id]:
                raise TFCheckpointError(
                    f"{path}: truncated: entry {entry.name!r} needs bytes [{entry.offset}, "
                    f"{end}) but the file has {sizes[entry.shard_id]} bytes"
                )
            dtype = entry.dtype
            if dtype is not None and entry.size != math.prod(entry.shape) * dtype.itemsize:
                raise TFCheckpointError(
                    f"{self.index_path}: bad index: entry {entry.name!r} has {entry.size} "
                    f"bytes, expected {math.prod(entry.shape)} x {dtype.itemsize} "
                    f"for shape {entry.shape} {dtype}"
                )

    def data_path(self, shard: int) -> str:
        return data_filename(self.prefix, shard, self.num_shards)

    # Mapping-like access ------------------------------------------------------------------
    def keys(self) -> list[str]:
        return list(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def entry(self, name: str) -> TensorEntry:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"{self.prefix}: no tensor {name!r}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entry(name).shape

    def dtype(self, name: str) -> np.dtype:
        dtype = self._supported(self.entry(name)).dtype
        assert dtype is not None  # _supported refuses the others
        return dtype

    def _supported(self, entry: TensorEntry) -> TensorEntry:
        if entry.sliced:
            raise TFCheckpointError(
                f"{self.index_path}: tensor {entry.name!r} is saved in slices (a partitioned variable); not supported"
            )
        if entry.dtype is None:
            kind = _DTYPE_NAMES.get(entry.dtype_enum, f"DataType {entry.dtype_enum}")
            raise TFCheckpointError(
                f"{self.index_path}: tensor {entry.name!r} has unsupported dtype {kind}; "
                f"expected one of {sorted({str(np.dtype(d)) for d in _DTYPES.values()})}"
            )
        return entry

    def verify(self, names=None) -> None:
        """Checks the crc32c of the named tensors (default: all that ``get`` can read); raises on
        the first mismatch."""
        if names is None:
            names = [k for k, e in self._entries.items() if not e.sliced and e.dtype is not None]
        for name in [names] if isinstance(names, str) else names:
            entry = self._supported(self.entry(name))
            if name in self._verified:
                continue
            path = self.data_path(entry.shard_id)
            actual = _file_crc32c(path, entry.offset, entry.size)
            if actual != unmask_crc32c(entry.crc32c):
                raise TFCheckpointError(
                    f"corrupted entry {name!r} in {path} (crc32c {actual:#010x}, "
                    f"the index says {unmask_crc32c(entry.crc32c):#010x})"
                )
            self._verified.add(name)

    def _map(self, shard: int) -> np.memmap | None:
        if shard not in self._maps:
            path = self.data_path(shard)
            self._maps[shard] = np.memmap(path, np.uint8, mode="r") if os.path.getsize(path) else None
        return self._maps[shard]

    def get(self, name: str, verify: bool = True) -> np.ndarray:
        """The tensor as a read-only memmap view (a plain array for an empty tensor)."""
        entry = self._supported(self.entry(name))
        if verify:
            self.verify(name)
        if entry.size == 0:
            out = np.zeros(entry.shape, entry.dtype)
            out.flags.writeable = False
            return out
        data, dtype = self._map(entry.shard_id), entry.dtype
        assert data is not None and dtype is not None  # a non-empty tensor, of a supported dtype
        raw = data[entry.offset : entry.offset + entry.size]
        return raw.view(dtype).reshape(entry.shape)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.get(name)

    def close(self) -> None:
        """Drops this object's maps (views handed out stay valid)."""
        self._maps.clear()

    def __enter__(self) -> TFCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TFCheckpoint({self.prefix!r}, {len(self)} tensors, {self.num_shards} shards)"


# ---------------------------------------------------------------------------------------------
# bilm-tf.

ADAGRAD_SLOT = "/Adagrad"


def bilm_tf_hdf5_name(tf_name: str) -> str | None:
    """A bilm-tf TF variable name -> its hdf5 dataset name, as bilm-tf's ``dump_weights``
    (``_get_outname``) maps them; ``None`` outside the ``lm/`` scope (``global_step``, ...).

    ``lm/RNN_0/rnn/multi_rnn_cell/cell_1/lstm_cell/kernel`` -> ``RNN_0/RNN/MultiRNNCell/Cell1/LSTMCell/W_0``
    (``bias`` -> ``B``, ``projection/kernel`` -> ``W_P_0``); TF < 1.2 already used the hdf5 names.
    ``lm/char_embed``, ``lm/CNN/...``, ``lm/CNN_high_k/...``, ``lm/CNN_proj/...``, ``lm/softmax/...``
    lose the ``lm/``. With one layer bilm-tf has no ``MultiRNNCell``:
    ``lm/RNN_0/rnn/lstm_cell/kernel`` -> ``RNN_0/RNN/LSTMCell/W_0``.
    """
    if not tf_name.startswith("lm/"):
        return None
    name = tf_name[3:]
    for tf_part, h5_part in (("/rnn/", "/RNN/"), ("/multi_rnn_cell/", "/MultiRNNCell/"), ("/lstm_cell/", "/LSTMCell/")):
        name = name.replace(tf_part, h5_part)
    name = re.sub(r"/cell_(\d+)/", r"/Cell\1/", name)
    if "/RNN/" in name:
        name = re.sub(r"/projection/kernel$", "/W_P_0", name)
        name = re.sub(r"/kernel$", "/W_0", name)
        name = re.sub(r"/bias$", "/B", name)
    return name


def _tf_name(h5_name: str) -> str:
    """The TF >= 1.2 variable name of an hdf5 dataset name (for messages)."""
    m = re.fullmatch(r"RNN_(\d+)/RNN/MultiRNNCell/Cell(\d+)/LSTMCell/(W_0|B|W_P_0)", h5_name)
    if m:
        leaf = {"W_0": "kernel", "B": "bias", "W_P_0": "projection/kernel"}[m.group(3)]
        return f"lm/RNN_{m.group(1)}/rnn/multi_rnn_cell/cell_{m.group(2)}/lstm_cell/{leaf}"
    return "lm/" + h5_name


def _one_layer_alias(h5_name: str) -> str:
    # bilm-tf with n_layers 1 builds no MultiRNNCell: its single cell is layer 0.
    return re.sub(r"^(RNN_\d+/RNN)/LSTMCell/", r"\1/MultiRNNCell/Cell0/LSTMCell/", h5_name)


def _load_options(options, prefix: str):
    """-> (ModelConfig | None, n_tokens_vocab | None, where the options came from)."""
    from elmo_jax.config import ModelConfig, Options

    if options is None:
        beside = os.path.join(os.path.dirname(prefix) or ".", "options.json")
        if not os.path.isfile(beside):
            return None, None, None
        options = beside
    if isinstance(options, ModelConfig):
        return options, None, "the given ModelConfig"
    if isinstance(options, Options):
        return options.model, options.train.n_tokens_vocab if options.train else None, "the given Options"
    loaded = Options.load(options)
    return loaded.model, loaded.train.n_tokens_vocab if loaded.train else None, os.fspath(options)


def _infer_config(prefix: str, names: dict[str, str], ckpt: TFCheckpoint):
    """A ModelConfig with the checkpoint's shapes (activation, clips and skips are not stored)."""
    from elmo_jax.config import CharCNNConfig, ConfigError, LSTMConfig, ModelConfig

    def shape(h5):
        return ckpt.shape(names[h5]) if h5 in names else None

    try:
        emb = shape("char_embed")
        filters: list[tuple[int, int]] = []
        while shape(f"CNN/W_cnn_{len(filters)}") is not None:
            s = shape(f"CNN/W_cnn_{len(filters)}")
            filters.append((s[1], s[3]))
        n_highway = 0
        while shape(f"CNN_high_{n_highway}/W_carry") is not None:
            n_highway += 1
        n_layers = 0
        while shape(f"RNN_0/RNN/MultiRNNCell/Cell{n_layers}/LSTMCell/W_P_0") is not None:
            n_layers += 1
        w_p = shape("RNN_0/RNN/MultiRNNCell/Cell0/LSTMCell/W_P_0")
        char_cnn = CharCNNConfig(
            embedding_dim=emb[1],
            filters=tuple(filters),
            n_highway=n_highway,
            max_characters_per_token=max(50, max(w for w, _ in filters)),
        )
        return ModelConfig(char_cnn=char_cnn, lstm=LSTMConfig(dim=w_p[0], projection_dim=w_p[1], n_layers=n_layers))
    except (TypeError, IndexError, ValueError, ConfigError) as e:
        raise TFCheckpointError(
            f"{prefix}: not a bilm-tf character model checkpoint (cannot read its "
            f"shapes: {e}); pass options= to say what it should hold"
        ) from None


def read_bilm_tf(path: str | os.PathLike, options=None, *, verify: bool = True) -> dict:
    """A bilm-tf training checkpoint -> this project's trees, with numpy leaves::

        {"config": ModelConfig | None, "prefix": str, "global_step": int | None,
         "params": {"bilm": <load_hdf5's tree>, "softmax": {"w": [V, P], "b": [V]}},
         "accumulators": {"bilm": ..., "softmax": ...} | None}   # Adagrad slots, same trees

    ``path``: a prefix or a directory (``resolve_prefix``). ``options``: a ``ModelConfig``,
    ``Options`` or options.json path; by default bilm-tf's ``options.json`` beside the checkpoint
    if there is one (``config`` is then its model, with ``n_characters`` 262), else the shapes are
    taken from the checkpoint and ``config`` is None. Every tensor's shape is checked against the
    options; a mismatch, a missing tensor or an unexpected ``lm/`` tensor raises one line.
    ``char_embed`` (261 rows in training) gets the padding row 0 in front: 0 in the weights,
    1.0 (Adagrad's initial value) in the accumulators. The softmax leaves stay memmap views;
    ``verify`` checks the crc32c of every tensor read.
    """
    from elmo_jax.compat.hdf5 import params_from_datasets

    ckpt = TFCheckpoint(path)
    prefix = ckpt.prefix
    weights, slots = _tensor_names(ckpt)
    config, n_vocab, source = _load_options(options, prefix)
    inferred = config is None
    if inferred:
        config = _infer_config(prefix, weights, ckpt)
        source = "the checkpoint's own shapes"
    _check_tensors(ckpt, weights, slots, config, n_vocab, f" (per {source})")

    def getter(table):
        return lambda h5: ckpt.get(table[h5], verify=verify) if h5 in table else None

    def softmax(table):
        if "softmax/W" not in table:
            return None
        return {"w": ckpt.get(table["softmax/W"], verify=verify), "b": ckpt.get(table["softmax/b"], verify=verify)}

    params = {"bilm": params_from_datasets(config, getter(weights), 0.0), "softmax": softmax(weights)}
    accumulators = None
    if slots:
        accumulators = {"bilm": params_from_datasets(config, getter(slots), 1.0), "softmax": softmax(slots)}
    if not inferred:  # as load_hdf5: inference uses the shifted ids
        config = config.with_shifted_chars()
    return {
        "config": None if inferred else config,
        "prefix": prefix,
        "global_step": _global_step(ckpt, verify),
        "params": params,
        "accumulators": accumulators,
    }


def _tensor_names(ckpt: TFCheckpoint) -> tuple[dict[str, str], dict[str, str]]:
    """The checkpoint's biLM tensors and their Adagrad slots: ``{hdf5 name: checkpoint name}`` each."""
    weights: dict[str, str] = {}
    slots: dict[str, str] = {}
    for name in ckpt.keys():
        base = name[: -len(ADAGRAD_SLOT)] if name.endswith(ADAGRAD_SLOT) else name
        h5 = bilm_tf_hdf5_name(base)
        if h5 is None:
            continue
        h5 = _one_layer_alias(h5)
        (slots if base != name else weights)[h5] = name
    return weights, slots


def _check_tensors(
    ckpt: TFCheckpoint, weights: dict[str, str], slots: dict[str, str], config, n_vocab: int | None, per: str
) -> None:
    """Raises one line on an unexpected tensor, a missing one, or a shape or dtype other than
    ``config``'s (the softmax: ``n_vocab`` rows, or the checkpoint's when None)."""
    from elmo_jax.compat.hdf5 import expected_datasets

    prefix, c, l = ckpt.prefix, config.char_cnn, config.lstm
    expected = expected_datasets(config)
    optional = set()
    if c.n_filters == l.projection_dim and "CNN_proj/W_proj" not in weights:
        optional = {"CNN_proj/W_proj", "CNN_proj/b_proj"}  # bilm-tf builds no projection then
    if "softmax/W" in weights:
        v = n_vocab if n_vocab is not None else ckpt.shape(weights["softmax/W"])[0]
        expected["softmax/W"] = (v, l.projection_dim)
        expected["softmax/b"] = (v,)
    if "char_embed" in weights and ckpt.shape(weights["char_embed"]) == (262, c.embedding_dim):
        expected["char_embed"] = (262, c.embedding_dim)

    for name in sorted(set(weights) | set(slots)):
        if name not in expected:
            unexpected = weights.get(name) or slots[name]
            raise TFCheckpointError(
                f"{prefix}: unexpected tensor {unexpected!r} with shape {ckpt.shape(unexpected)}{per}"
            )
    for h5, shape in expected.items():
        for table, kind in ((weights, "tensor"), (slots, "Adagrad slot")):
            if table is slots and not slots:
                continue
            tf = table.get(h5)
            if tf is None:
                if h5 in optional:
                    continue
                want = _tf_name(h5) + (ADAGRAD_SLOT if table is slots else "")
                raise TFCheckpointError(f"{prefix}: missing {kind} {want!r} (expected shape {shape} float32){per}")
            if ckpt.shape(tf) != shape:
                raise TFCheckpointError(f"{prefix}: tensor {tf!r} has shape {ckpt.shape(tf)}, expected {shape}{per}")
            if ckpt.dtype(tf) != np.float32:
                raise TFCheckpointError(f"{prefix}: tensor {tf!r} has dtype {ckpt.dtype(tf)}, expected float32")


def _global_step(ckpt: TFCheckpoint, verify: bool) -> int | None:
    """The checkpoint's ``global_step`` (bilm-tf's is a float32 variable), or None without one."""
    if "global_step" not in ckpt:
        return None
    value = np.asarray(ckpt.get("global_step", verify=verify))
    if value.shape != () or value.dtype.kind not in "fiu":
        raise TFCheckpointError(f"{ckpt.prefix}: 'global_step' is {value.dtype} {value.shape}, expected a number")
    return int(value)
