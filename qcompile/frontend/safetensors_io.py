"""Reading and writing safetensors checkpoints, with strict validation and no eager data reads.

What: a small, self-contained implementation of the safetensors format
(https://github.com/huggingface/safetensors): an 8-byte little-endian header length, a JSON header
mapping tensor names to ``{"dtype", "shape", "data_offsets"}`` (plus an optional ``__metadata__``
object of strings), then one data section that the tensors tile exactly.

Why our own instead of the ``safetensors`` package:

* Laziness. Checkpoints are tens to hundreds of gigabytes. :class:`SafetensorsFile` reads only the
  8 + header bytes on construction, and :meth:`SafetensorsFile.read` returns a zero-copy, read-only
  view into one memory map per file, so the compiler touches only the tensors it needs.
* Diagnostics. Every malformed file raises :class:`~qcompile.errors.CheckpointError` (exit code 65)
  with one line naming the file, the tensor where relevant, the problem and, where obvious, the
  fix -- for example a Git LFS pointer checked out instead of the data.
* Dtypes. ``bfloat16`` and the float8 formats map to :mod:`ml_dtypes` numpy dtypes, so tensors read
  and write as ordinary numpy arrays.

:class:`TensorStore` joins a whole checkpoint -- a single file, or a
``model.safetensors.index.json`` plus its shards -- behind one name -> tensor interface and checks
that the index and the shards agree. :func:`write_safetensors` writes a file atomically (temp file
plus ``os.replace``); :func:`stream_safetensors` writes tensors produced piece by piece, hashing as it goes, so a
400 GB file is never whole in memory.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import secrets
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import ml_dtypes
import numpy as np

from qcompile.errors import CheckpointError, one_line

__all__ = [
    "DTYPES",
    "MAX_HEADER_BYTES",
    "INDEX_FILE_NAME",
    "SINGLE_FILE_NAME",
    "TensorInfo",
    "SafetensorsFile",
    "TensorStore",
    "load_index",
    "stream_safetensors",
    "aligned_order",
    "write_safetensors",
]

#: safetensors dtype code -> numpy dtype (explicitly little-endian where byte order matters).
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype(np.bool_),
}

#: Largest header we accept (the limit the reference implementation uses).
MAX_HEADER_BYTES = 100_000_000

#: File names looked for when :meth:`TensorStore.open` is given a directory.
INDEX_FILE_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"

_METADATA_KEY = "__metadata__"
_LFS_PREFIX = b"version https://git-lfs"
#: The data section starts on this boundary (the header is padded with spaces to reach it): XLA's CPU client maps a
#: 64-byte-aligned read-only buffer into an array without copying it, so tensors laid out on that boundary can be used
#: straight from the mapped file (see :func:`aligned_order`).
DATA_ALIGN = 64


# --------------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------------


def _fail(where: str, problem: str, tensor: str | None = None) -> CheckpointError:
    """Build a one-line CheckpointError ``<where>: [tensor '<name>': ]<problem>``."""
    prefix = f"{where}: tensor {tensor!r}: " if tensor is not None else f"{where}: "
    return CheckpointError(one_line(prefix + problem))


class _PairsDict(dict):
    """A dict that remembers which keys a JSON object repeated (see :func:`_json_object_pairs`)."""

    duplicates: list[str]


def _json_object_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` that notices repeated keys.

    Returns a plain dict in the common case (fast); only an object with a repeated key becomes a
    :class:`_PairsDict` listing the repeats.
    """
    out = dict(pairs)
    if len(out) == len(pairs):
        return out
    marked = _PairsDict(out)
    marked.duplicates = []
    seen: set[str] = set()
    for key, _value in pairs:
        if key in seen:
            marked.duplicates.append(key)
        seen.add(key)
    return marked


def _duplicates(obj: Any) -> list[str]:
    """Repeated keys of a JSON object parsed with :func:`_json_object_pairs` (``[]`` otherwise)."""
    return list(getattr(obj, "duplicates", []))


def _is_int(value: Any) -> bool:
    """A JSON integer (``bool`` is a subclass of ``int`` in Python and is rejected)."""
    return type(value) is int


def _brief(value: Any, limit: int = 60) -> str:
    """A JSON rendering of ``value`` for an error message, cut to about ``limit`` characters."""
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _shape_text(shape: Iterable[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


# --------------------------------------------------------------------------------------------------
# Tensor descriptions and single files
# --------------------------------------------------------------------------------------------------


@attrs.frozen
class TensorInfo:
    """Where one tensor lives: its file and its absolute byte range ``[begin, end)`` there."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    path: Path
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def np_dtype(self) -> np.dtype:
        """The numpy dtype of this tensor's elements."""
        return DTYPES[self.dtype]


class SafetensorsFile:
    """One safetensors file.

    The header is parsed and fully validated on construction, reading only the first 8 + header
    bytes; tensor data is never read until :meth:`read`, which maps the file into memory once
    (lazily) and returns read-only views into that map.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._where = str(path)
        self._mmap: mmap.mmap | None = None
        size, header_len, header = self._read_header()
        self._file_size = size
        data_start = 8 + header_len
        self.metadata: dict[str, str] = self._parse_metadata(header)
        self.tensors: dict[str, TensorInfo] = self._parse_entries(header, data_start)
        self._check_layout(data_len=size - data_start)

    def __repr__(self) -> str:
        return f"SafetensorsFile({self._where!r}, {len(self.tensors)} tensors)"

    # -- header --------------------------------------------------------------------------------

    def _read_header(self) -> tuple[int, int, Any]:
        """Read and JSON-decode the header; return ``(file size, header length, header object)``."""
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                head = f.read(len(_LFS_PREFIX))
                header_len = self._check_prefix(head, size)
                f.seek(8)
                raw = f.read(header_len)
        except OSError as exc:
            raise _fail(self._where, f"cannot read file: {exc.strerror or exc}") from exc
        if len(raw) != header_len:
            raise _fail(self._where, "file changed while its header was being read; try again")
        return size, header_len, self._decode_header(raw)

    def _check_prefix(self, head: bytes, size: int) -> int:
        """Validate the first bytes of the file and return the declared header length."""
        if head.startswith(_LFS_PREFIX):
            raise _fail(
                self._where,
                "is a Git LFS pointer, not the tensor data; run `git lfs pull` in the checkpoint's "
                "repository (or download the file directly)",
            )
        if size < 8:
            raise _fail(
                self._where,
                f"file is only {size} bytes; a safetensors file starts with an 8-byte header "
                "length (the file is truncated or not a safetensors file)",
            )
        header_len = int.from_bytes(head[:8], "little")
        if header_len > size - 8:
            raise _fail(
                self._where,
                f"header length {header_len} is larger than the rest of the file "
                f"({size - 8} bytes); the file is truncated or not a safetensors file",
            )
        if header_len > MAX_HEADER_BYTES:
            raise _fail(
                self._where,
                f"header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte limit; "
                "not a safetensors file?",
            )
        return header_len

    def _decode_header(self, raw: bytes) -> Any:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _fail(
                self._where,
                f"header is not valid UTF-8 (byte {exc.start}); not a safetensors file?",
            ) from exc
        try:
            header = json.loads(text, object_pairs_hook=_json_object_pairs)
        except json.JSONDecodeError as exc:
            raise _fail(
                self._where,
                f"header is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})",
            ) from exc
        except (ValueError, RecursionError) as exc:  # nesting too deep, integers past Python's digit limit
            raise _fail(self._where, f"header is not valid JSON ({type(exc).__name__}: {exc})") from exc
        if not isinstance(header, dict):
            raise _fail(
                self._where, f"header is not a JSON object (got {type(header).__name__})"
            )
        dups = _duplicates(header)
        if dups:
            raise _fail(
                self._where, "appears more than once in the header (duplicate name)", dups[0]
            )
        return header

    def _parse_metadata(self, header: dict[str, Any]) -> dict[str, str]:
        if _METADATA_KEY not in header:
            return {}
        meta = header[_METADATA_KEY]
        if not isinstance(meta, dict):
            raise _fail(self._where, f"{_METADATA_KEY} must be a JSON object of strings")
        for key, value in meta.items():
            if not isinstance(value, str):
                raise _fail(
                    self._where,
                    f"{_METADATA_KEY} entry {key!r} must be a string, "
                    f"got {type(value).__name__}",
                )
        if _duplicates(meta):
            raise _fail(self._where, f"{_METADATA_KEY} repeats key {_duplicates(meta)[0]!r}")
        return dict(meta)

    # -- tensor entries ------------------------------------------------------------------------

    def _parse_entries(self, header: dict[str, Any], data_start: int) -> dict[str, TensorInfo]:
        tensors: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            if name == _METADATA_KEY:
                continue
            dtype, shape, (begin, end) = self._parse_entry(name, entry)
            tensors[name] = TensorInfo(
                name=name,
                dtype=dtype,
                shape=shape,
                path=self.path,
                begin=data_start + begin,
                end=data_start + end,
            )
        return tensors

    def _parse_entry(self, name: str, entry: Any) -> tuple[str, tuple[int, ...], tuple[int, int]]:
        """Validate one header entry; return ``(dtype code, shape, data offsets)``."""
        if not isinstance(entry, dict):
            raise _fail(
                self._where,
                f"header entry must be an object with dtype, shape and data_offsets, "
                f"got {type(entry).__name__}",
                name,
            )
        if _duplicates(entry):
            raise _fail(self._where, f"header entry repeats key {_duplicates(entry)[0]!r}", name)
        missing = [k for k in ("dtype", "shape", "data_offsets") if k not in entry]
        if missing:
            raise _fail(self._where, f"header entry is missing {', '.join(missing)}", name)
        dtype = self._parse_dtype(name, entry["dtype"])
        shape = self._parse_shape(name, entry["shape"])
        offsets = self._parse_offsets(name, entry["data_offsets"])
        expected = math.prod(shape) * DTYPES[dtype].itemsize
        if offsets[1] - offsets[0] != expected:
            raise _fail(
                self._where,
                f"byte length {offsets[1] - offsets[0]} does not match shape "
                f"{_shape_text(shape)} x {dtype} ({expected} bytes)",
                name,
            )
        return dtype, shape, offsets

    def _parse_dtype(self, name: str, dtype: Any) -> str:
        if not isinstance(dtype, str):
            raise _fail(self._where, f"dtype must be a string, got {_brief(dtype)}", name)
        if dtype not in DTYPES:
            raise _fail(
                self._where,
                f"unknown dtype {dtype!r} (supported: {', '.join(DTYPES)})",
                name,
            )
        return dtype

    def _parse_shape(self, name: str, shape: Any) -> tuple[int, ...]:
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise _fail(
                self._where,
                f"shape must be a list of non-negative integers, got {_brief(shape)}",
                name,
            )
        return tuple(shape)

    def _parse_offsets(self, name: str, offsets: Any) -> tuple[int, int]:
        valid = (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(_is_int(o) and o >= 0 for o in offsets)
        )
        if not valid:
            raise _fail(
                self._where,
                f"data_offsets must be two non-negative integers [begin, end], "
                f"got {_brief(offsets)}",
                name,
            )
        begin, end = offsets
        if begin > end:
            raise _fail(self._where, f"data_offsets [{begin}, {end}] have begin after end", name)
        return begin, end

    # -- data layout ---------------------------------------------------------------------------

    def _check_layout(self, data_len: int) -> None:
        """The tensors must tile the data section ``[0, data_len)`` exactly.

        No gaps, no overlaps, no bytes past the last tensor, and no tensor past the end of the file.
        """
        data_start = self._file_size - data_len
        cursor, previous = data_start, None
        for info in sorted(self.tensors.values(), key=lambda t: (t.begin, t.end)):
            if info.begin > cursor:
                after = f"after tensor {previous.name!r}" if previous else "at the data's start"
                raise _fail(
                    self._where,
                    f"gap of {info.begin - cursor} unused bytes {after} "
                    "(data_offsets must be contiguous)",
                    info.name,
                )
            if previous is not None and info.begin < cursor:
                raise _fail(
                    self._where,
                    f"data_offsets [{info.begin - data_start}, {info.end - data_start}] overlap "
                    f"those of tensor {previous.name!r}",
                    info.name,
                )
            cursor, previous = info.end, info
        if cursor - data_start > data_len:
            raise _fail(
                self._where,
                f"truncated data: the header describes {cursor - data_start} data bytes but the "
                f"file holds only {data_len} (offsets out of bounds); re-download the file",
                previous.name if previous else None,
            )
        if cursor < self._file_size:
            raise _fail(
                self._where,
                f"{self._file_size - cursor} unexpected bytes after the last tensor "
                "(the file is corrupt or was appended to)",
            )

    # -- data ----------------------------------------------------------------------------------

    def _map(self) -> mmap.mmap:
        """The file's memory map, created on first use and then reused."""
        if self._mmap is None:
            try:
                with open(self.path, "rb") as f:
                    mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as exc:
                raise _fail(self._where, f"cannot map file into memory: {exc}") from exc
            if len(mapped) != self._file_size:
                mapped.close()
                raise _fail(
                    self._where,
                    f"file changed size since it was opened ({self._file_size} -> {len(mapped)} "
                    "bytes); reopen the checkpoint",
                )
            self._mmap = mapped
        return self._mmap

    def release(self, name: str, start: int = 0, stop: int | None = None) -> None:
        """Drop this process's mapped pages of tensor ``name`` — or of its bytes [start, stop) — (the data stays in
        the page cache and a later :meth:`read` maps it again). Streaming a checkpoint larger than memory through one
        long-lived map would otherwise count every page ever touched in the resident set."""
        info = self.tensors[name]
        end = info.end if stop is None else min(info.end, info.begin + stop)
        if self._mmap is None or end <= info.begin + start:
            return
        page = mmap.PAGESIZE
        begin = (info.begin + start) // page * page
        try:
            self._mmap.madvise(mmap.MADV_DONTNEED, begin, end - begin)
        except (AttributeError, OSError, ValueError):  # no madvise here: pages are only reclaimed under pressure
            pass

    def read(self, name: str) -> np.ndarray:
        """A zero-copy, read-only view of tensor ``name`` (``KeyError`` if absent)."""
        info = self.tensors[name]
        dtype = DTYPES[info.dtype]
        if info.nbytes == 0:
            empty = np.empty(info.shape, dtype=dtype)
            empty.flags.writeable = False
            return empty
        flat = np.frombuffer(
            self._map(), dtype=dtype, count=info.nbytes // dtype.itemsize, offset=info.begin
        )
        return flat.reshape(info.shape)


# --------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------


def _dtype_code(name: str, dtype: np.dtype) -> str:
    """The safetensors code of a numpy dtype (either byte order); ``TypeError`` if unsupported."""
    if dtype.byteorder == ">":
        dtype = dtype.newbyteorder("<")
    for code, candidate in DTYPES.items():
        if dtype == candidate:
            return code
    raise TypeError(
        f"tensor {name!r}: dtype {dtype} cannot be stored in safetensors "
        f"(supported: {', '.join(DTYPES)})"
    )


def _header(specs: Mapping[str, tuple[np.dtype, tuple[int, ...]]], metadata: Mapping[str, str] | None) -> bytes:
    """The padded JSON header for tensors of the given dtypes and shapes, laid out in mapping order."""
    header: dict[str, Any] = {}
    if metadata is not None:
        bad = [k for k, v in metadata.items() if not (isinstance(k, str) and isinstance(v, str))]
        if bad:
            raise TypeError(f"metadata must map str to str; bad entry {bad[0]!r}")
        header[_METADATA_KEY] = dict(metadata)
    offset = 0
    for name, (dtype, shape) in specs.items():
        if not isinstance(name, str) or not name or name == _METADATA_KEY:
            raise ValueError(f"invalid tensor name {name!r}")
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        header[name] = {"dtype": _dtype_code(name, np.dtype(dtype)), "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return raw + b" " * (-(8 + len(raw)) % DATA_ALIGN)


def aligned_order(specs: Mapping[str, tuple[np.dtype, tuple[int, ...]]]) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """``specs`` reordered so that every tensor starts on a :data:`DATA_ALIGN` boundary of the file but those after
    the first whose size is not a multiple of it: the sized ones first (in their order), then the rest (in practice a
    few norm vectors and biases). Loading such a file maps its large tensors without a copy."""
    def fits(item) -> bool:
        dtype, shape = item[1]
        return math.prod(shape) * np.dtype(dtype).itemsize % DATA_ALIGN == 0

    items = list(specs.items())
    return dict([item for item in items if fits(item)] + [item for item in items if not fits(item)])


@attrs.frozen
class Written:
    """What :func:`stream_safetensors` wrote: the file's size and SHA-256, computed while writing."""

    bytes: int
    sha256: str


def stream_safetensors(
    path: str | os.PathLike[str],
    specs: Mapping[str, tuple[np.dtype, tuple[int, ...]]],
    chunks: Callable[[str], Iterable[np.ndarray]],
    metadata: Mapping[str, str] | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> Written:
    """Write a safetensors file whose tensors (name -> (dtype, shape), in file order) are produced one at a time.

    ``chunks(name)`` yields the tensor's data as consecutive C-order pieces (e.g. slabs along axis 0) that together
    hold exactly its elements, so no tensor need ever be whole in memory. The file is hashed as it is written
    (no second read) and written to a temporary file that atomically replaces ``path``; on any failure — including a
    piece of the wrong dtype or a wrong total size — the temporary file is removed and ``path`` is left as it was.
    ``on_bytes`` is called with each piece's size (progress).
    """
    import hashlib

    target = Path(path)
    header = _header(specs, metadata)
    digest = hashlib.sha256()
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            for piece in (len(header).to_bytes(8, "little"), header):
                f.write(piece)
                digest.update(piece)
            total = 8 + len(header)
            for name, (dtype, shape) in specs.items():
                want = math.prod(shape) * np.dtype(dtype).itemsize
                got = 0
                for chunk in chunks(name):
                    chunk = np.asarray(chunk)
                    if chunk.dtype != np.dtype(dtype):
                        raise TypeError(f"tensor {name!r}: a piece of dtype {chunk.dtype}, expected {np.dtype(dtype)}")
                    data = np.ascontiguousarray(chunk).reshape(-1).view(np.uint8).data
                    f.write(data)
                    digest.update(data)
                    got += chunk.nbytes
                    if on_bytes is not None:
                        on_bytes(chunk.nbytes)
                if got != want:
                    raise ValueError(f"tensor {name!r}: its pieces hold {got} bytes, expected {want}")
                total += got
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return Written(total, digest.hexdigest())


def write_safetensors(
    path: str | os.PathLike[str],
    tensors: Mapping[str, np.ndarray],
    metadata: Mapping[str, str] | None = None,
) -> Written:
    """Write ``tensors`` (in their mapping order) to a safetensors file at ``path``, atomically.

    The header is JSON padded with spaces so that the data starts on a 64-byte boundary; the data follows contiguously
    in header order, little-endian (see :func:`stream_safetensors`). Unsupported dtypes raise ``TypeError``.
    """
    arrays = {name: np.asarray(value) for name, value in tensors.items()}
    for name, array in arrays.items():
        code = _dtype_code(name, array.dtype) if isinstance(name, str) else None
        if code is not None and array.dtype != DTYPES[code]:  # big-endian input: stored little-endian
            arrays[name] = array.astype(DTYPES[code])
    specs = {name: (array.dtype, tuple(array.shape)) for name, array in arrays.items()}
    return stream_safetensors(path, specs, lambda name: (arrays[name],), metadata)


# --------------------------------------------------------------------------------------------------
# Sharded checkpoints
# --------------------------------------------------------------------------------------------------


def load_index(index_path: str | os.PathLike[str]) -> dict[str, str]:
    """Parse a ``model.safetensors.index.json``; return its weight_map (tensor name -> shard file).

    Shard names must be relative paths that stay inside the index's directory.
    """
    where = str(index_path)
    try:
        text = Path(index_path).read_text(encoding="utf-8")
    except OSError as exc:
        raise _fail(where, f"cannot read index: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise _fail(where, "index is not valid UTF-8") from exc
    if text.startswith(_LFS_PREFIX.decode()):
        raise _fail(where, "is a Git LFS pointer, not the index; run `git lfs pull`")
    try:
        index = json.loads(text, object_pairs_hook=_json_object_pairs)
    except json.JSONDecodeError as exc:
        raise _fail(
            where, f"index is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
        ) from exc
    except (ValueError, RecursionError) as exc:  # nesting too deep, integers past Python's digit limit
        raise _fail(where, f"index is not valid JSON ({type(exc).__name__}: {exc})") from exc
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        raise _fail(where, 'index has no "weight_map" object mapping tensor names to shard files')
    weight_map = index["weight_map"]
    if _duplicates(weight_map):
        raise _fail(where, "is listed more than once in weight_map", _duplicates(weight_map)[0])
    for name, shard in weight_map.items():
        _check_shard_name(where, name, shard)
    return dict(weight_map)


def _check_shard_name(where: str, name: str, shard: Any) -> None:
    if not isinstance(shard, str) or not shard:
        raise _fail(where, f"weight_map value must be a shard file name, got {_brief(shard)}", name)
    parts = Path(shard).parts
    if Path(shard).is_absolute() or ".." in parts:
        raise _fail(
            where,
            f"shard {shard!r} must be a file name relative to the index's directory",
            name,
        )


class TensorStore:
    """All tensors of a checkpoint -- one file, or an index plus shards -- by name. Lazy.

    Construction checks that no tensor name appears in two files.
    """

    def __init__(self, files: list[SafetensorsFile], source: Path) -> None:
        self.source = Path(source)
        self.files = list(files)
        self._owner: dict[str, SafetensorsFile] = {}
        for file in self.files:
            for name in file.tensors:
                other = self._owner.get(name)
                if other is not None:
                    raise _fail(
                        str(source),
                        f"appears in both {other.path} and {file.path} (duplicate tensor); "
                        "remove one copy",
                        name,
                    )
                self._owner[name] = file

    def __repr__(self) -> str:
        counts = f"{len(self._owner)} tensors, {len(self.files)} files"
        return f"TensorStore({str(self.source)!r}, {counts})"

    # -- opening -------------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> TensorStore:
        """Open a checkpoint directory, a ``.safetensors`` file or a ``.index.json`` file.

        A directory uses ``model.safetensors.index.json`` if present, else ``model.safetensors``,
        else every ``*.safetensors`` file in it; ``reference_*.safetensors`` files (test fixtures
        kept next to checkpoints) are ignored.
        """
        source = Path(path)
        if source.is_dir():
            return cls._open_dir(source)
        if not source.exists():
            raise _fail(str(path), "no such file or directory")
        if source.name.endswith(".index.json"):
            return cls._open_index(source)
        return cls([SafetensorsFile(source)], source)

    @classmethod
    def _open_dir(cls, directory: Path) -> TensorStore:
        if (directory / INDEX_FILE_NAME).is_file():
            return cls._open_index(directory / INDEX_FILE_NAME)
        if (directory / SINGLE_FILE_NAME).is_file():
            return cls([SafetensorsFile(directory / SINGLE_FILE_NAME)], directory)
        found = sorted(
            p
            for p in directory.glob("*.safetensors")
            if p.is_file() and not p.name.startswith("reference_")
        )
        if not found:
            raise _fail(
                str(directory),
                f"no {INDEX_FILE_NAME}, {SINGLE_FILE_NAME} or other *.safetensors file in this "
                "directory",
            )
        return cls([SafetensorsFile(p) for p in found], directory)

    @classmethod
    def _open_index(cls, index_path: Path) -> TensorStore:
        weight_map = load_index(index_path)
        where = str(index_path)
        shard_names = list(dict.fromkeys(weight_map.values()))
        files: dict[str, SafetensorsFile] = {}
        for shard in shard_names:
            shard_path = index_path.parent / shard
            if not shard_path.is_file():
                first = next(n for n, s in weight_map.items() if s == shard)
                raise _fail(
                    where,
                    f"shard {shard!r} (holding tensor {first!r}) is missing from "
                    f"{index_path.parent}; download it",
                )
            files[shard] = SafetensorsFile(shard_path)
        for name, shard in weight_map.items():
            if name not in files[shard].tensors:
                raise _fail(
                    where,
                    f"index maps it to shard {shard!r}, but that shard has no such tensor "
                    "(index and shards are out of sync)",
                    name,
                )
        return cls(list(files.values()), index_path)

    # -- access --------------------------------------------------------------------------------

    def names(self) -> list[str]:
        return list(self._owner)

    def info(self, name: str) -> TensorInfo:
        return self._owner[name].tensors[name]

    def read(self, name: str) -> np.ndarray:
        return self._owner[name].read(name)

    def release(self, name: str, start: int = 0, stop: int | None = None) -> None:
        """Drop the mapped pages of ``name``, or of its bytes [start, stop) (see :meth:`SafetensorsFile.release`)."""
        self._owner[name].release(name, start, stop)

    def __contains__(self, name: object) -> bool:
        return name in self._owner

    def __len__(self) -> int:
        return len(self._owner)

    def __iter__(self) -> Iterator[str]:
        return iter(self._owner)
