"""Tests for qcompile.frontend.safetensors_io: round trips, laziness, atomic writes, validation."""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy as st_np

from qcompile.errors import CheckpointError
from qcompile.frontend import safetensors_io as sio
from qcompile.frontend.safetensors_io import (
    DTYPES,
    SafetensorsFile,
    TensorInfo,
    TensorStore,
    load_index,
    write_safetensors,
)

# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


def raw_file(path: Path, header: object, data: bytes = b"", *, header_bytes: bytes | None = None,
             header_len: int | None = None) -> Path:
    """Write a safetensors-like file from a header object (or raw header bytes) plus data bytes."""
    if header_bytes is None:
        header_bytes = json.dumps(header).encode("utf-8")
    n = len(header_bytes) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n) + header_bytes + data)
    return path


def entry(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def sample_tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "model.embed.weight": rng.standard_normal((5, 3)).astype(np.float32),
        "model.layers.0.w": rng.standard_normal((4, 6)).astype(ml_dtypes.bfloat16),
        "model.layers.0.h": rng.standard_normal((7,)).astype(np.float16),
        "ids": np.arange(-3, 9, dtype=np.int64).reshape(3, 4),
        "scalar": np.array(2.5, dtype=np.float32),
        "empty": np.zeros((0, 4), dtype=np.float32),
        "mask": np.array([True, False, True]),
        "bytes": np.arange(11, dtype=np.uint8),
    }


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Exact equality including dtype, shape and bit pattern (NaN-safe, bf16-safe)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


def one_line_error(exc_info) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg and msg == msg.strip() and msg
    return msg


# --------------------------------------------------------------------------------------------------
# round trips
# --------------------------------------------------------------------------------------------------


def test_round_trip_own_writer_own_reader(tmp_path):
    tensors = sample_tensors()
    path = tmp_path / "model.safetensors"
    write_safetensors(path, tensors, metadata={"format": "np", "note": "hi"})
    f = SafetensorsFile(path)
    assert list(f.tensors) == list(tensors)  # header (insertion) order preserved
    assert f.metadata == {"format": "np", "note": "hi"}
    for name, value in tensors.items():
        got = f.read(name)
        assert same(got, value), name
        info = f.tensors[name]
        assert info.nbytes == value.nbytes
        assert info.shape == value.shape
        assert info.path == path


def test_header_is_padded_and_data_contiguous(tmp_path):
    path = tmp_path / "x.safetensors"
    write_safetensors(path, {"a": np.ones(3, np.float32), "b": np.ones(2, np.int16)})
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0
    header = json.loads(raw[8:8 + n])
    assert list(header) == ["a", "b"]
    assert header["a"]["data_offsets"] == [0, 12]
    assert header["b"]["data_offsets"] == [12, 16]
    assert len(raw) == 8 + n + 16
    f = SafetensorsFile(path)
    assert f.tensors["a"] == TensorInfo("a", "F32", (3,), path, 8 + n, 8 + n + 12)


def test_our_files_read_by_reference_parser(tmp_path):
    tensors = sample_tensors()
    path = tmp_path / "ours.safetensors"
    write_safetensors(path, tensors)
    ref = st_np.load_file(str(path))
    assert set(ref) == set(tensors)
    for name, value in tensors.items():
        if value.dtype == ml_dtypes.bfloat16:
            assert ref[name].view(np.uint16).tobytes() == value.view(np.uint16).tobytes()
            assert ref[name].shape == value.shape
        else:
            assert same(ref[name], value), name


def test_reference_files_read_by_us(tmp_path):
    tensors = {k: v for k, v in sample_tensors().items() if v.dtype != ml_dtypes.bfloat16}
    bf16_bits = np.array([[0x3F80, 0xC000], [0x7FC0, 0x0001]], dtype=np.uint16)
    path = tmp_path / "ref.safetensors"
    st_np.save_file(tensors, str(path), metadata={"k": "v"})
    f = SafetensorsFile(path)
    assert f.metadata == {"k": "v"}
    for name, value in tensors.items():
        assert same(f.read(name), value), name
    # bf16 written by the reference package (it needs a bf16 numpy dtype too).
    path2 = tmp_path / "ref_bf16.safetensors"
    st_np.save_file({"w": bf16_bits.view(ml_dtypes.bfloat16)}, str(path2))
    got = SafetensorsFile(path2).read("w")
    assert got.dtype == np.dtype(ml_dtypes.bfloat16)
    assert np.array_equal(got.view(np.uint16), bf16_bits)


def test_float8_and_big_endian_inputs(tmp_path):
    tensors = {
        "e4m3": np.array([0.5, -2.0, 448.0], dtype=ml_dtypes.float8_e4m3fn),
        "e5m2": np.array([1.0, -0.25], dtype=ml_dtypes.float8_e5m2),
        "be": np.arange(4, dtype=">i4"),
        "noncontig": np.arange(12, dtype=np.float64).reshape(3, 4).T,
    }
    path = tmp_path / "f8.safetensors"
    write_safetensors(path, tensors)
    f = SafetensorsFile(path)
    assert f.tensors["e4m3"].dtype == "F8_E4M3" and f.tensors["e5m2"].dtype == "F8_E5M2"
    assert f.tensors["be"].dtype == "I32"
    assert np.array_equal(f.read("be"), np.arange(4))
    assert np.array_equal(f.read("noncontig"), tensors["noncontig"])
    assert same(f.read("e4m3"), tensors["e4m3"])


def test_dtypes_table():
    assert DTYPES["BF16"] == np.dtype(ml_dtypes.bfloat16)
    assert DTYPES["F8_E4M3"] == np.dtype(ml_dtypes.float8_e4m3fn)
    assert DTYPES["F8_E5M2"] == np.dtype(ml_dtypes.float8_e5m2)
    assert DTYPES["BOOL"] == np.dtype(bool)
    for code in ["F64", "F32", "F16", "I64", "I32", "I16", "I8", "U8"]:
        assert code in DTYPES


# --------------------------------------------------------------------------------------------------
# laziness and memory mapping
# --------------------------------------------------------------------------------------------------


def test_construction_reads_only_header_of_huge_sparse_file(tmp_path):
    big = 2 * 1024**3  # 2 GiB of F32 that is never written (sparse)
    small = np.arange(4, dtype=np.float32)
    header = {"big": entry("F32", [big // 4], 0, big), "small": entry("F32", [4], big, big + 16)}
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    path = tmp_path / "huge.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)) + hb)
        f.seek(8 + len(hb) + big)
        f.write(small.tobytes())
    t0 = time.perf_counter()
    sf = SafetensorsFile(path)
    assert time.perf_counter() - t0 < 1.0
    assert sf._mmap is None  # nothing mapped yet
    assert sf.tensors["big"].nbytes == big
    assert np.array_equal(sf.read("small"), small)
    assert sf.read("big").shape == (big // 4,)  # a view, not a 2 GiB read


def test_construction_does_not_map_and_map_is_reused(tmp_path, monkeypatch):
    path = tmp_path / "m.safetensors"
    write_safetensors(path, {"a": np.ones(3, np.float32), "b": np.zeros(2, np.int8)})
    calls = []
    real = sio.mmap.mmap

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(sio.mmap, "mmap", spy)
    f = SafetensorsFile(path)
    assert calls == []
    f.read("a")
    f.read("b")
    f.read("a")
    assert len(calls) == 1


def test_read_returns_read_only_memory_mapped_view(tmp_path):
    path = tmp_path / "m.safetensors"
    write_safetensors(path, {"a": np.arange(6, dtype=np.float32).reshape(2, 3)})
    f = SafetensorsFile(path)
    arr = f.read("a")
    assert not arr.flags.writeable
    assert arr.shape == (2, 3) and arr.dtype == np.float32
    base = np.frombuffer(f._mmap, dtype=np.uint8)
    assert np.shares_memory(arr, base)
    with pytest.raises(ValueError):
        arr[0, 0] = 1.0
    with pytest.raises(KeyError):
        f.read("missing")


# --------------------------------------------------------------------------------------------------
# atomic writes
# --------------------------------------------------------------------------------------------------


def test_write_unsupported_dtype_leaves_nothing(tmp_path):
    path = tmp_path / "out.safetensors"
    tensors = {"ok": np.ones(3, np.float32), "bad": np.array([object(), 1], dtype=object)}
    with pytest.raises(TypeError, match="bad"):
        write_safetensors(path, tensors)
    assert list(tmp_path.iterdir()) == []


def test_write_failing_midway_leaves_old_file_and_no_temp(tmp_path):
    path = tmp_path / "out.safetensors"
    write_safetensors(path, {"old": np.ones(2, np.float32)})
    before = path.read_bytes()
    calls = []

    def pieces(name):
        calls.append(name)
        if name == "b":
            raise OSError("disk full")
        yield np.ones(3, np.float32)

    specs = {"a": (np.dtype(np.float32), (3,)), "b": (np.dtype(np.float32), (3,))}
    with pytest.raises(OSError, match="disk full"):
        sio.stream_safetensors(path, specs, pieces)
    assert calls == ["a", "b"]
    assert [p.name for p in tmp_path.iterdir()] == ["out.safetensors"]
    assert path.read_bytes() == before


def test_streamed_write_hashes_what_it_wrote_and_checks_each_tensors_pieces(tmp_path):
    """Pieces of a tensor (slabs along axis 0) write the same bytes as the whole array; the returned SHA-256 and
    size are the file's; pieces of the wrong dtype or total size are refused before the file appears."""
    import hashlib

    big = np.arange(24, dtype=np.float32).reshape(6, 4)
    specs = {"w": (big.dtype, big.shape), "b": (np.dtype(np.int32), (2,))}
    parts = {"w": lambda: (big[0:4], big[4:6]), "b": lambda: (np.array([7, 8], np.int32),)}
    written = sio.stream_safetensors(tmp_path / "s.safetensors", specs, lambda n: parts[n]())
    whole = write_safetensors(tmp_path / "w.safetensors", {"w": big, "b": np.array([7, 8], np.int32)})
    data = (tmp_path / "s.safetensors").read_bytes()
    assert data == (tmp_path / "w.safetensors").read_bytes()
    assert written == whole and written.sha256 == hashlib.sha256(data).hexdigest() and written.bytes == len(data)
    np.testing.assert_array_equal(SafetensorsFile(tmp_path / "s.safetensors").read("w"), big)
    with pytest.raises(ValueError, match="expected 96"):
        sio.stream_safetensors(tmp_path / "short.safetensors", specs, lambda n: (big[:1],) if n == "w" else ())
    with pytest.raises(TypeError, match="dtype"):
        sio.stream_safetensors(tmp_path / "f64.safetensors", specs, lambda n: (big.astype(np.float64),))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.safetensors", "w.safetensors"]


def test_released_pages_leave_the_resident_set_and_reads_still_work(tmp_path):
    """`release` drops a tensor's mapped pages from this process (so streaming a checkpoint through one map does not
    grow the resident set with every tensor read) and the tensor reads back unchanged afterwards."""
    data = np.random.default_rng(0).standard_normal((64, 1 << 14)).astype(np.float32)  # 4 MiB
    write_safetensors(tmp_path / "m.safetensors", {"x": data})
    f = SafetensorsFile(tmp_path / "m.safetensors")

    def mapped_kib() -> int:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("Rss:"):
                return int(line.split()[1])
        raise AssertionError("no Rss line")

    if not Path("/proc/self/smaps_rollup").exists():
        pytest.skip("needs Linux /proc/self/smaps_rollup to see the resident set")
    float(f.read("x").sum())  # touch every page
    touched = mapped_kib()
    f.release("x")
    assert touched - mapped_kib() >= 3 * 1024  # ~4 MiB of mapped pages gone
    np.testing.assert_array_equal(f.read("x"), data)


def test_write_rejects_bad_metadata_and_names(tmp_path):
    with pytest.raises(TypeError):
        write_safetensors(tmp_path / "a.safetensors", {"a": np.ones(1)}, metadata={"k": 1})
    with pytest.raises(ValueError):
        write_safetensors(tmp_path / "a.safetensors", {"__metadata__": np.ones(1)})
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------------------------------
# malformed files
# --------------------------------------------------------------------------------------------------

F32x4 = entry("F32", [4], 0, 16)
DATA16 = bytes(16)

# id -> (builder(path), tensor name or None, distinctive words)
MALFORMED = {
    "too-short": (lambda p: p.write_bytes(b"\x01\x02\x03"), None, ["only 3 bytes"]),
    "empty": (lambda p: p.write_bytes(b""), None, ["only 0 bytes"]),
    "header-longer-than-file": (
        lambda p: raw_file(p, {"w": F32x4}, DATA16, header_len=10_000), None, ["larger than"]),
    "header-over-limit": (
        lambda p: _sparse_header_over_limit(p), None, ["100000000", "limit"]),
    "lfs-pointer": (
        lambda p: p.write_bytes(
            b"version https://git-lfs.github.com/spec/v1\noid sha256:abcd\nsize 123\n"),
        None, ["Git LFS pointer", "git lfs pull"]),
    "not-utf8": (
        lambda p: raw_file(p, None, b"", header_bytes=b'{"\xff\xfe": 1}'), None, ["UTF-8"]),
    "not-json": (lambda p: raw_file(p, None, b"", header_bytes=b'{"w": [1, 2'), None, ["JSON"]),
    "not-object": (lambda p: raw_file(p, [1, 2, 3]), None, ["not a JSON object"]),
    "duplicate-name": (
        lambda p: raw_file(
            p, None, DATA16,
            header_bytes=b'{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},'
                         b'"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}'),
        "w", ["more than once"]),
    "entry-not-object": (lambda p: raw_file(p, {"w": [1, 2]}), "w", ["must be an object"]),
    "missing-dtype": (
        lambda p: raw_file(p, {"w": {"shape": [4], "data_offsets": [0, 16]}}, DATA16),
        "w", ["missing dtype"]),
    "missing-shape-offsets": (
        lambda p: raw_file(p, {"w": {"dtype": "F32"}}, DATA16), "w", ["shape", "data_offsets"]),
    "dtype-not-string": (
        lambda p: raw_file(p, {"w": entry(7, [4], 0, 16)}, DATA16), "w", ["dtype must be"]),
    "shape-not-list": (
        lambda p: raw_file(p, {"w": entry("F32", 4, 0, 16)}, DATA16), "w", ["shape must be"]),
    "shape-negative": (
        lambda p: raw_file(p, {"w": entry("F32", [-4], 0, 16)}, DATA16), "w", ["non-negative"]),
    "shape-float": (
        lambda p: raw_file(p, {"w": entry("F32", [4.0], 0, 16)}, DATA16), "w", ["shape must be"]),
    "shape-bool": (
        lambda p: raw_file(p, {"w": entry("F32", [True], 0, 4)}, bytes(4)), "w", ["shape must be"]),
    "offsets-three": (
        lambda p: raw_file(p, {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8, 16]}},
                           DATA16), "w", ["data_offsets must be"]),
    "offsets-strings": (
        lambda p: raw_file(p, {"w": {"dtype": "F32", "shape": [4], "data_offsets": ["0", "16"]}},
                           DATA16), "w", ["data_offsets must be"]),
    "offsets-reversed": (
        lambda p: raw_file(p, {"w": entry("F32", [0], 16, 0)}, DATA16), "w", ["begin after end"]),
    "unknown-dtype": (
        lambda p: raw_file(p, {"w": entry("F4", [4], 0, 16)}, DATA16),
        "w", ["unknown dtype", "F4"]),
    "byte-length": (
        lambda p: raw_file(p, {"model.norm.weight": entry("F32", [96], 0, 380)}, bytes(380)),
        "model.norm.weight", ["byte length 380", "[96] x F32 (384 bytes)"]),
    "truncated": (
        lambda p: raw_file(p, {"a": entry("F32", [4], 0, 16), "b": entry("F32", [4], 16, 32)},
                           bytes(20)), "b", ["truncated data"]),
    "out-of-bounds-single": (
        lambda p: raw_file(p, {"w": entry("F32", [4], 0, 16)}, bytes(8)), "w", ["truncated data"]),
    "overlap": (
        lambda p: raw_file(p, {"a": entry("F32", [4], 0, 16), "b": entry("F32", [4], 8, 24)},
                           bytes(24)), "b", ["overlap"]),
    "gap": (
        lambda p: raw_file(p, {"a": entry("F32", [4], 0, 16), "b": entry("F32", [4], 20, 36)},
                           bytes(36)), "b", ["gap of 4"]),
    "gap-at-start": (
        lambda p: raw_file(p, {"a": entry("F32", [4], 8, 24)}, bytes(24)),
        "a", ["gap of 8", "start"]),
    "trailing-bytes": (
        lambda p: raw_file(p, {"w": F32x4}, bytes(21)),
        None, ["5 unexpected bytes after the last"]),
    "metadata-not-object": (
        lambda p: raw_file(p, {"__metadata__": ["x"], "w": F32x4}, DATA16), None, ["__metadata__"]),
    "metadata-not-str": (
        lambda p: raw_file(p, {"__metadata__": {"k": 1}, "w": F32x4}, DATA16), None,
        ["__metadata__", "'k'"]),
}


def _sparse_header_over_limit(path: Path) -> None:
    n = 100_000_001
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", n))
        f.truncate(8 + n + 16)


@pytest.mark.parametrize("case", list(MALFORMED), ids=list(MALFORMED))
def test_malformed_file(tmp_path, case):
    build, tensor, words = MALFORMED[case]
    path = tmp_path / f"bad-{case}.safetensors"
    build(path)
    with pytest.raises(CheckpointError) as exc_info:
        SafetensorsFile(path)
    msg = one_line_error(exc_info)
    assert exc_info.value.exit_code == 65
    assert str(path) in msg
    if tensor is not None:
        assert repr(tensor) in msg
    for word in words:
        assert word in msg, (word, msg)


def test_error_message_format(tmp_path):
    path = raw_file(tmp_path / "model.safetensors",
                    {"model.norm.weight": entry("F32", [96], 0, 380)}, bytes(380))
    with pytest.raises(CheckpointError) as exc_info:
        SafetensorsFile(path)
    assert str(exc_info.value) == (
        f"{path}: tensor 'model.norm.weight': byte length 380 does not match shape [96] x F32 "
        "(384 bytes)")


def test_valid_edge_cases(tmp_path):
    # No tensors at all; zero-length tensors at the same offset; metadata only.
    f = SafetensorsFile(raw_file(tmp_path / "a.safetensors", {}))
    assert f.tensors == {} and f.metadata == {}
    f = SafetensorsFile(raw_file(
        tmp_path / "b.safetensors",
        {"__metadata__": {"format": "pt"}, "e1": entry("F32", [0], 0, 0),
         "w": entry("I8", [2], 0, 2), "e2": entry("BF16", [3, 0], 2, 2)},
        b"\x01\xff"))
    assert f.metadata == {"format": "pt"}
    assert list(f.tensors) == ["e1", "w", "e2"]
    assert f.read("e2").shape == (3, 0) and not f.read("e2").flags.writeable
    assert f.read("w").tolist() == [1, -1]


def test_unreadable_path_is_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError) as exc_info:
        SafetensorsFile(tmp_path / "nope.safetensors")
    assert "nope.safetensors" in one_line_error(exc_info)


# --------------------------------------------------------------------------------------------------
# index and TensorStore
# --------------------------------------------------------------------------------------------------


def make_sharded(directory: Path, n_shards: int = 3) -> dict[str, np.ndarray]:
    """Write ``n_shards`` shards of two tensors each plus a matching index; return all tensors."""
    directory.mkdir(parents=True, exist_ok=True)
    everything: dict[str, np.ndarray] = {}
    weight_map: dict[str, str] = {}
    for i in range(n_shards):
        shard = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        tensors = {
            f"layers.{i}.w": np.full((2, 3), i, dtype=np.float32),
            f"layers.{i}.b": np.arange(i + 1, dtype=np.int32),
        }
        write_safetensors(directory / shard, tensors)
        everything.update(tensors)
        weight_map.update({name: shard for name in tensors})
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return everything


def write_index(directory: Path, weight_map: dict) -> Path:
    path = directory / "model.safetensors.index.json"
    path.write_text(json.dumps({"weight_map": weight_map}))
    return path


def test_store_single_file_dir(tmp_path):
    tensors = sample_tensors()
    write_safetensors(tmp_path / "model.safetensors", tensors)
    store = TensorStore.open(tmp_path)
    assert store.source == tmp_path
    assert store.names() == list(tensors)
    for name, value in tensors.items():
        assert name in store
        assert same(store.read(name), value)
        assert store.info(name).path == tmp_path / "model.safetensors"
    assert "nope" not in store
    with pytest.raises(KeyError):
        store.info("nope")
    with pytest.raises(KeyError):
        store.read("nope")


def test_store_index_and_three_shards(tmp_path):
    tensors = make_sharded(tmp_path / "ckpt")
    for source in (tmp_path / "ckpt", tmp_path / "ckpt" / "model.safetensors.index.json"):
        store = TensorStore.open(source)
        assert sorted(store.names()) == sorted(tensors)
        for name, value in tensors.items():
            assert same(store.read(name), value)
        assert store.info("layers.2.w").path.name == "model-00003-of-00003.safetensors"
    assert store.source == tmp_path / "ckpt" / "model.safetensors.index.json"


def test_store_opens_only_shards_the_index_names(tmp_path):
    tensors = make_sharded(tmp_path)
    write_safetensors(tmp_path / "stray.safetensors", {"layers.0.w": np.ones(1, np.float32)})
    store = TensorStore.open(tmp_path)  # the stray file would otherwise be a duplicate
    assert sorted(store.names()) == sorted(tensors)


def test_store_safetensors_file_path(tmp_path):
    write_safetensors(tmp_path / "weights.safetensors", {"a": np.ones(2, np.float16)})
    store = TensorStore.open(tmp_path / "weights.safetensors")
    assert store.names() == ["a"]
    assert store.read("a").dtype == np.float16


def test_store_ignores_reference_files(tmp_path):
    write_safetensors(tmp_path / "model.safetensors", {"a": np.ones(2, np.float32)})
    write_safetensors(tmp_path / "reference_fp32.safetensors", {"a": np.zeros(2, np.float32),
                                                               "logits": np.ones(3, np.float32)})
    assert TensorStore.open(tmp_path).names() == ["a"]


def test_store_dir_without_index_opens_all_files(tmp_path):
    write_safetensors(tmp_path / "part1.safetensors", {"a": np.ones(2, np.float32)})
    write_safetensors(tmp_path / "part2.safetensors", {"b": np.ones(2, np.float32)})
    write_safetensors(tmp_path / "reference_fp32.safetensors", {"a": np.ones(2, np.float32)})
    store = TensorStore.open(tmp_path)
    assert sorted(store.names()) == ["a", "b"]
    assert len(store.files) == 2


def test_store_duplicate_tensor_in_two_files(tmp_path):
    write_safetensors(tmp_path / "part1.safetensors", {"a": np.ones(2, np.float32)})
    write_safetensors(tmp_path / "part2.safetensors", {"a": np.ones(2, np.float32)})
    with pytest.raises(CheckpointError) as exc_info:
        TensorStore.open(tmp_path)
    msg = one_line_error(exc_info)
    assert "'a'" in msg and "part1.safetensors" in msg and "part2.safetensors" in msg
    assert "duplicate" in msg


def test_store_duplicate_tensor_across_indexed_shards(tmp_path):
    make_sharded(tmp_path)
    # Shard 1 also carries layers.1.w, which the index maps to shard 2.
    write_safetensors(tmp_path / "model-00001-of-00003.safetensors", {
        "layers.0.w": np.zeros((2, 3), np.float32), "layers.0.b": np.zeros(1, np.int32),
        "layers.1.w": np.zeros((2, 3), np.float32)})
    with pytest.raises(CheckpointError) as exc_info:
        TensorStore.open(tmp_path)
    msg = one_line_error(exc_info)
    assert "'layers.1.w'" in msg and "duplicate" in msg


def test_store_index_names_missing_shard(tmp_path):
    make_sharded(tmp_path)
    os.remove(tmp_path / "model-00002-of-00003.safetensors")
    with pytest.raises(CheckpointError) as exc_info:
        TensorStore.open(tmp_path)
    msg = one_line_error(exc_info)
    assert "model.safetensors.index.json" in msg
    assert "'model-00002-of-00003.safetensors'" in msg and "missing" in msg


def test_store_index_names_tensor_not_in_shard(tmp_path):
    make_sharded(tmp_path)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["layers.9.w"] = "model-00001-of-00003.safetensors"
    write_index(tmp_path, index["weight_map"])
    with pytest.raises(CheckpointError) as exc_info:
        TensorStore.open(tmp_path)
    msg = one_line_error(exc_info)
    assert "'layers.9.w'" in msg and "model-00001-of-00003.safetensors" in msg
    assert "no such tensor" in msg


def test_store_bad_shard_is_reported_by_file(tmp_path):
    make_sharded(tmp_path)
    (tmp_path / "model-00003-of-00003.safetensors").write_bytes(
        b"version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 10\n")
    with pytest.raises(CheckpointError) as exc_info:
        TensorStore.open(tmp_path)
    msg = one_line_error(exc_info)
    assert "model-00003-of-00003.safetensors" in msg and "git lfs pull" in msg


def test_store_errors_for_missing_or_empty_paths(tmp_path):
    with pytest.raises(CheckpointError, match="no such file"):
        TensorStore.open(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no model.safetensors.index.json"):
        TensorStore.open(tmp_path / "empty")
    (tmp_path / "onlyref").mkdir()
    write_safetensors(tmp_path / "onlyref" / "reference_x.safetensors", {"a": np.ones(1)})
    with pytest.raises(CheckpointError):
        TensorStore.open(tmp_path / "onlyref")


@pytest.mark.parametrize(
    "text, words",
    [
        ("{not json", ["not valid JSON"]),
        ("[1, 2]", ["weight_map"]),
        ('{"metadata": {}}', ["weight_map"]),
        ('{"weight_map": [1]}', ["weight_map"]),
        ('{"weight_map": {"a": 3}}', ["'a'", "shard file name"]),
        ('{"weight_map": {"a": "../x.safetensors"}}', ["'a'", "relative"]),
        ('{"weight_map": {"a": "s.safetensors", "a": "t.safetensors"}}', ["'a'", "more than once"]),
    ],
)
def test_load_index_errors(tmp_path, text, words):
    path = tmp_path / "model.safetensors.index.json"
    path.write_text(text)
    with pytest.raises(CheckpointError) as exc_info:
        load_index(path)
    msg = one_line_error(exc_info)
    assert str(path) in msg
    for word in words:
        assert word in msg, (word, msg)


def test_load_index_ok(tmp_path):
    path = write_index(tmp_path, {"a": "s1.safetensors", "b": "s2.safetensors"})
    assert load_index(path) == {"a": "s1.safetensors", "b": "s2.safetensors"}
