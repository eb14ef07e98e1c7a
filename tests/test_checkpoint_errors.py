"""End-to-end checks of design.md §8: a bad checkpoint is rejected through the CLI with exit code 65 and exactly
one line on stderr (``qcompile: error: <message>``) naming the file, the tensor where relevant and the problem,
never a traceback — and the user's files are left untouched.

tests/test_safetensors_io.py covers the low-level parser at the API level; this file drives the same rules through
``qcompile.cli.main`` (in-process, for speed; a few cases also as a real subprocess), plus the config / checkpoint
rules (missing tensor, wrong shape, non-float dtype, model_type, config.json problems), the unknown-tensor warning
and the laziness of ``Checkpoint.open`` (headers only).

Each test copies a pristine tiny checkpoint (written once per session per family) into its tmp_path, corrupts the
copy, snapshots the checkpoint's files, runs the CLI and compares the snapshot afterwards.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from qcompile.cli import main
from qcompile.frontend.checkpoint import Checkpoint
from qcompile.frontend.safetensors_io import SafetensorsFile, write_safetensors
from qcompile.frontend.tiny import write_tiny

FAMILIES = ("qwen3_5_moe", "qwen3_next")
PREFIX = {"qwen3_5_moe": "model.language_model.", "qwen3_next": "model."}
ERROR = "qcompile: error: "
BAD_INPUT = 65
LFS_POINTER = (
    "version https://git-lfs.github.com/spec/v1\n"
    "oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\n"
    "size 3080632\n"
)


# --------------------------------------------------------------------------------------------------
# fixtures and helpers
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def pristine(tmp_path_factory) -> dict[str, Path]:
    """One untouched tiny checkpoint per family, written once per session (never modified)."""
    return {family: write_tiny(tmp_path_factory.mktemp(f"pristine-{family}"), family) for family in FAMILIES}


@pytest.fixture
def fresh(pristine, tmp_path):
    """fresh(family="qwen3_5_moe") -> a private copy of the pristine checkpoint directory, free to corrupt."""

    def copy(family: str = "qwen3_5_moe") -> Path:
        return Path(shutil.copytree(pristine[family], tmp_path / f"ckpt-{family}"))

    return copy


def weights(ckpt: Path) -> Path:
    return ckpt / "model.safetensors"


def read_raw(path: Path) -> tuple[dict, bytes]:
    """(header object in file order, data section bytes) of a safetensors file."""
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def write_raw(path: Path, header: dict | bytes, data: bytes, header_len: int | None = None) -> None:
    """Write a safetensors-like file from a header (object or raw bytes) and data, with no validation."""
    raw = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode("utf-8")
    if not isinstance(header, bytes):
        raw += b" " * (-len(raw) % 8)
    n = len(raw) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n) + raw + data)


def by_offset(header: dict) -> list[str]:
    """Tensor names in data order."""
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])


def read_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file, copied out of the memory map (header order)."""
    f = SafetensorsFile(path)
    return {name: np.array(f.read(name)) for name in f.tensors}


def edit_config(ckpt: Path, **changes) -> None:
    """Set (or, with value None, delete) keys of the text config in config.json (wrapper or flat)."""
    path = ckpt / "config.json"
    cfg = json.loads(path.read_text())
    text = cfg["text_config"] if "text_config" in cfg else cfg
    for key, value in changes.items():
        if value is None:
            del text[key]
        else:
            text[key] = value
    path.write_text(json.dumps(cfg, indent=2))


def snapshot(root: Path) -> dict[str, tuple]:
    """Every file under root (or root itself) -> (size, mtime_ns, content digest). Large files hash head + tail."""
    root = Path(root)
    if not root.exists():
        return {}
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    out = {}
    for p in files:
        st = p.stat()
        digest = hashlib.sha256()
        with open(p, "rb") as f:
            if st.st_size <= 64 << 20:
                digest.update(f.read())
            else:  # e.g. a sparse file claiming hundreds of MB: hash its ends only
                digest.update(f.read(1 << 20))
                f.seek(-(1 << 20), os.SEEK_END)
                digest.update(f.read())
        out[str(p.relative_to(root) if root.is_dir() else p.name)] = (st.st_size, st.st_mtime_ns, digest.hexdigest())
    return out


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """Run `qcompile ARGV` in-process; return (exit code, stdout, stderr)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in argv])
    out, err = capsys.readouterr()
    code = exit_info.value.code
    return (0 if code is None else code), out, err


def assert_rejected(capsys, tmp_path: Path, target: Path, *needles: str, protect: Path | None = None) -> str:
    """`qcompile --passes none TARGET -o OUT` must exit 65 with exactly one `qcompile: error:` line that contains
    every needle, write no output, and leave the checkpoint's files (protect, default: TARGET's checkpoint dir)
    byte-for-byte and mtime-for-mtime unchanged. Returns the message."""
    protect = protect or (target if target.is_dir() else target.parent)
    before = snapshot(protect)
    out_dir = tmp_path / "out"
    code, out, err = run_cli(capsys, "--passes", "none", target, "-o", out_dir)
    lines = err.splitlines()
    assert code == BAD_INPUT, f"exit code {code}, stderr: {err!r}"
    assert len(lines) == 1, f"expected exactly one stderr line, got {lines!r}"
    line = lines[0]
    assert line.startswith(ERROR), line
    assert "Traceback" not in err
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    assert out == ""
    assert not out_dir.exists(), "a rejected checkpoint must not produce output"
    assert snapshot(protect) == before, "the user's checkpoint files were modified"
    return line[len(ERROR) :]


# --------------------------------------------------------------------------------------------------
# baseline
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_pristine_copy_compiles(fresh, capsys, tmp_path, family):
    ckpt = fresh(family)
    before = snapshot(ckpt)
    code, out, err = run_cli(capsys, "--passes", "none", ckpt, "--report", tmp_path / "report.json")
    assert code == 0, err
    assert err == ""
    assert out.startswith(f"{family}: 4 layers")
    assert (tmp_path / "report.json").is_file()
    assert snapshot(ckpt) == before


# --------------------------------------------------------------------------------------------------
# safetensors file format (design.md §8; the same rules as test_safetensors_io.py, end to end)
# --------------------------------------------------------------------------------------------------


def test_header_length_larger_than_file(fresh, capsys, tmp_path):
    ckpt = fresh()
    path = weights(ckpt)
    blob = path.read_bytes()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob[8:])
    msg = assert_rejected(capsys, tmp_path, ckpt, str(path), f"header length {len(blob)}", "larger than")
    assert "truncated or not a safetensors file" in msg


def test_header_length_over_100mb(fresh, capsys, tmp_path):
    """A file big enough to hold the claimed header, so it is the 100 MB limit (not the file size) that trips."""
    ckpt = fresh()
    path = weights(ckpt)
    claim = 150_000_000
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", claim) + b'{"__metadata__":{}}')
        f.truncate(8 + claim + 4096)  # sparse: no real disk use
    assert_rejected(capsys, tmp_path, ckpt, str(path), f"header length {claim}", "100000000-byte limit")


def test_git_lfs_pointer(fresh, capsys, tmp_path):
    ckpt = fresh()
    path = weights(ckpt)
    path.write_text(LFS_POINTER)
    assert_rejected(capsys, tmp_path, ckpt, str(path), "Git LFS pointer", "git lfs pull")


@pytest.mark.parametrize("cut", [1, 1000, 3_000_000])
def test_truncated_data(fresh, capsys, tmp_path, cut):
    ckpt = fresh()
    path = weights(ckpt)
    header, _ = read_raw(path)
    last = by_offset(header)[-1]
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - cut)
    assert_rejected(capsys, tmp_path, ckpt, str(path), "truncated", f"'{last}'")


def test_file_shorter_than_length_prefix(fresh, capsys, tmp_path):
    ckpt = fresh()
    path = weights(ckpt)
    path.write_bytes(b"\x10\x00\x00")
    assert_rejected(capsys, tmp_path, ckpt, str(path), "only 3 bytes")


def test_header_not_utf8(fresh, capsys, tmp_path):
    ckpt = fresh()
    path = weights(ckpt)
    blob = bytearray(path.read_bytes())
    header, _ = read_raw(path)
    name = by_offset(header)[0]
    at = blob.index(name.encode()) + 2  # inside the first tensor name
    blob[at] = 0xFF
    path.write_bytes(bytes(blob))
    assert_rejected(capsys, tmp_path, ckpt, str(path), "not valid UTF-8")


def test_header_not_json(fresh, capsys, tmp_path):
    ckpt = fresh()
    path = weights(ckpt)
    blob = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", blob[:8])
    raw = bytes(blob[8 : 8 + n]).rstrip()
    assert raw.endswith(b"}")
    blob[8 + len(raw) - 1] = ord(" ")  # drop the closing brace, keep the length
    path.write_bytes(bytes(blob))
    assert_rejected(capsys, tmp_path, ckpt, str(path), "not valid JSON")


def test_header_not_an_object(fresh, capsys, tmp_path):
    ckpt = fresh()
    path = weights(ckpt)
    write_raw(path, b"[1, 2, 3]", b"")
    assert_rejected(capsys, tmp_path, ckpt, str(path), "not a JSON object")


def test_duplicate_tensor_name(fresh, capsys, tmp_path):
    ckpt = fresh()
    path = weights(ckpt)
    header, data = read_raw(path)
    name = by_offset(header)[1]
    text = json.dumps(header, separators=(",", ":"))
    text = text[:-1] + "," + json.dumps(name) + ":" + json.dumps(header[name], separators=(",", ":")) + "}"
    write_raw(path, text.encode(), data)
    assert_rejected(capsys, tmp_path, ckpt, str(path), f"'{name}'", "duplicate")


def test_offsets_out_of_bounds(fresh, capsys, tmp_path):
    """The last tensor claims a consistent shape and byte range that runs past the end of the file."""
    ckpt = fresh()
    path = weights(ckpt)
    header, data = read_raw(path)
    last = by_offset(header)[-1]
    entry = header[last]
    assert entry["dtype"] == "F32" and len(entry["shape"]) == 1
    begin = entry["data_offsets"][0]
    entry["shape"] = [1_000_000]
    entry["data_offsets"] = [begin, begin + 4_000_000]
    write_raw(path, header, data)
    assert_rejected(capsys, tmp_path, ckpt, str(path), f"'{last}'", "out of bounds")


def test_overlapping_ranges(fresh, capsys, tmp_path):
    ckpt = fresh()
    path = weights(ckpt)
    header, data = read_raw(path)
    order = by_offset(header)
    a, b = order[0], order[1]  # lm_head and embed_tokens: same shape, adjacent
    assert header[a]["shape"] == header[b]["shape"]
    header[b]["data_offsets"] = list(header[a]["data_offsets"])
    write_raw(path, header, data)
    assert_rejected(capsys, tmp_path, ckpt, str(path), "overlap", f"'{a}'", f"'{b}'")


def test_gap_between_ranges(fresh, capsys, tmp_path):
    ckpt = fresh()
    path = weights(ckpt)
    header, data = read_raw(path)
    order = by_offset(header)
    k = len(order) // 2
    split = header[order[k]]["data_offsets"][1]
    for name in order[k + 1 :]:
        header[name]["data_offsets"] = [o + 16 for o in header[name]["data_offsets"]]
    write_raw(path, header, data[:split] + b"\0" * 16 + data[split:])
    assert_rejected(capsys, tmp_path, ckpt, str(path), "gap of 16", f"'{order[k]}'", f"'{order[k + 1]}'")


def test_trailing_bytes_after_last_tensor(fresh, capsys, tmp_path):
    ckpt = fresh()
    path = weights(ckpt)
    with open(path, "ab") as f:
        f.write(b"\0" * 24)
    assert_rejected(capsys, tmp_path, ckpt, str(path), "24 unexpected bytes")


def test_byte_length_does_not_match_shape(fresh, capsys, tmp_path):
    ckpt = fresh()
    path = weights(ckpt)
    header, data = read_raw(path)
    name = f"{PREFIX['qwen3_5_moe']}norm.weight"
    assert header[name]["shape"] == [96]
    header[name]["shape"] = [95]
    write_raw(path, header, data)
    assert_rejected(capsys, tmp_path, ckpt, str(path), f"'{name}'", "byte length 384", "[95]", "380 bytes")


def test_unknown_dtype(fresh, capsys, tmp_path):
    ckpt = fresh()
    path = weights(ckpt)
    header, data = read_raw(path)
    name = f"{PREFIX['qwen3_5_moe']}layers.2.linear_attn.dt_bias"
    header[name]["dtype"] = "Q4"
    write_raw(path, header, data)
    assert_rejected(capsys, tmp_path, ckpt, str(path), f"'{name}'", "unknown dtype 'Q4'")


def test_directory_without_weights(fresh, capsys, tmp_path):
    ckpt = fresh()
    weights(ckpt).unlink()
    assert_rejected(capsys, tmp_path, ckpt, str(ckpt), "model.safetensors")


# --------------------------------------------------------------------------------------------------
# sharded checkpoints
# --------------------------------------------------------------------------------------------------

SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def shard(ckpt: Path) -> dict[str, str]:
    """Split model.safetensors into two shards plus model.safetensors.index.json; return the weight_map."""
    tensors = read_tensors(weights(ckpt))
    names = sorted(tensors)
    half = len(names) // 2
    parts = (names[:half], names[half:])
    weight_map = {}
    for file_name, part in zip(SHARDS, parts):
        write_safetensors(ckpt / file_name, {n: tensors[n] for n in part}, metadata={"format": "pt"})
        weight_map.update({n: file_name for n in part})
    weights(ckpt).unlink()
    total = sum(t.nbytes for t in tensors.values())
    write_index(ckpt, weight_map, total)
    return weight_map


def write_index(ckpt: Path, weight_map: dict[str, str], total: int = 0) -> Path:
    path = ckpt / "model.safetensors.index.json"
    path.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return path


@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_checkpoint_loads(fresh, capsys, tmp_path, family):
    """A sharded checkpoint compiles from its directory or its index file (the first with its numerics check), and
    every prepared weight read through the index equals the one read from the single file it was cut from."""
    from qcompile.ir.importer import build_graph
    from qcompile.ir.weights import load_params

    ckpt = fresh(family)
    graph = build_graph(Checkpoint.open(ckpt), None, 16)
    whole = load_params(Checkpoint.open(ckpt), graph, progress=False)
    shard(ckpt)
    for target, verify in ((ckpt, "final"), (ckpt / "model.safetensors.index.json", "none")):
        code, out, err = run_cli(capsys, "--passes", "none", "--verify", verify, target)
        assert code == 0, err
        assert err == "" and out.startswith(family)
    sharded = load_params(Checkpoint.open(ckpt / "model.safetensors.index.json"), graph, progress=False)
    assert sharded.keys() == whole.keys()
    for name in whole:
        np.testing.assert_array_equal(np.asarray(sharded[name]), np.asarray(whole[name]), err_msg=name)


@pytest.mark.parametrize("via_index_file", [False, True])
def test_index_names_missing_shard(fresh, capsys, tmp_path, via_index_file):
    ckpt = fresh()
    weight_map = shard(ckpt)
    (ckpt / SHARDS[1]).unlink()
    first = next(n for n, s in weight_map.items() if s == SHARDS[1])
    index = ckpt / "model.safetensors.index.json"
    target = index if via_index_file else ckpt
    assert_rejected(capsys, tmp_path, target, str(index), f"'{SHARDS[1]}'", "missing", f"'{first}'")


def test_index_names_tensor_not_in_its_shard(fresh, capsys, tmp_path):
    ckpt = fresh()
    weight_map = shard(ckpt)
    moved = next(n for n, s in weight_map.items() if s == SHARDS[1])
    weight_map[moved] = SHARDS[0]  # the tensor really lives in shard 2
    index = write_index(ckpt, weight_map)
    assert_rejected(capsys, tmp_path, ckpt, str(index), f"'{moved}'", f"'{SHARDS[0]}'", "no such tensor")


def test_index_names_nonexistent_tensor(fresh, capsys, tmp_path):
    ckpt = fresh()
    weight_map = shard(ckpt)
    ghost = f"{PREFIX['qwen3_5_moe']}layers.0.ghost.weight"
    weight_map[ghost] = SHARDS[1]
    index = write_index(ckpt, weight_map)
    assert_rejected(capsys, tmp_path, ckpt, str(index), f"'{ghost}'", f"'{SHARDS[1]}'", "no such tensor")


def test_index_not_json(fresh, capsys, tmp_path):
    ckpt = fresh()
    shard(ckpt)
    index = ckpt / "model.safetensors.index.json"
    index.write_text('{"weight_map": {')
    assert_rejected(capsys, tmp_path, ckpt, str(index), "not valid JSON")


def test_corrupt_shard_is_named(fresh, capsys, tmp_path):
    ckpt = fresh()
    shard(ckpt)
    bad = ckpt / SHARDS[1]
    bad.write_text(LFS_POINTER)
    assert_rejected(capsys, tmp_path, ckpt, str(bad), "Git LFS pointer")


# --------------------------------------------------------------------------------------------------
# checkpoint against config
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_missing_for_config(fresh, capsys, tmp_path, family):
    ckpt = fresh(family)
    path = weights(ckpt)
    name = f"{PREFIX[family]}layers.1.linear_attn.A_log"
    tensors = read_tensors(path)
    del tensors[name]
    write_safetensors(path, tensors)
    msg = assert_rejected(capsys, tmp_path, ckpt, f"'{name}'", "missing")
    assert str(path) in msg or str(ckpt) in msg, msg  # names the checkpoint's weights (file or directory)


@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_missing_names_the_weights_file(fresh, capsys, tmp_path, family):
    """design.md §8: the line names *the file*. With a single weights file that is model.safetensors itself."""
    ckpt = fresh(family)
    path = weights(ckpt)
    name = f"{PREFIX[family]}layers.0.mlp.shared_expert_gate.weight"
    tensors = read_tensors(path)
    del tensors[name]
    write_safetensors(path, tensors)
    assert_rejected(capsys, tmp_path, ckpt, str(path), f"'{name}'", "missing")


def test_tensor_missing_in_sharded_checkpoint_names_the_index(fresh, capsys, tmp_path):
    ckpt = fresh()
    weight_map = shard(ckpt)
    name = f"{PREFIX['qwen3_5_moe']}layers.3.self_attn.k_norm.weight"
    file_name = weight_map.pop(name)
    tensors = read_tensors(ckpt / file_name)
    del tensors[name]
    write_safetensors(ckpt / file_name, tensors)
    index = write_index(ckpt, weight_map)
    assert_rejected(capsys, tmp_path, ckpt, str(index), f"'{name}'", "missing")


@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_with_wrong_shape(fresh, capsys, tmp_path, family):
    ckpt = fresh(family)
    path = weights(ckpt)
    name = f"{PREFIX[family]}layers.0.linear_attn.out_proj.weight"
    tensors = read_tensors(path)
    assert tensors[name].shape == (96, 128)
    tensors[name] = np.ascontiguousarray(tensors[name].T)  # a transposed layout
    write_safetensors(path, tensors)
    assert_rejected(capsys, tmp_path, ckpt, str(path), f"'{name}'", "[128, 96]", "implies [96, 128]")


@pytest.mark.parametrize("family", FAMILIES)
def test_config_hidden_size_does_not_match_tensors(fresh, capsys, tmp_path, family):
    ckpt = fresh(family)
    edit_config(ckpt, hidden_size=128)
    msg = assert_rejected(capsys, tmp_path, ckpt, str(weights(ckpt)), "[512, 96]", "[512, 128]", "config.json")
    assert f"'{PREFIX[family]}embed_tokens.weight'" in msg or "'lm_head.weight'" in msg, msg


@pytest.mark.parametrize("family", FAMILIES)
def test_weight_with_integer_dtype(fresh, capsys, tmp_path, family):
    ckpt = fresh(family)
    path = weights(ckpt)
    header, data = read_raw(path)
    name = f"{PREFIX[family]}layers.2.post_attention_layernorm.weight"
    header[name]["dtype"] = "I32"  # same itemsize: the file stays well-formed
    write_raw(path, header, data)
    assert_rejected(capsys, tmp_path, ckpt, str(path), f"'{name}'", "dtype I32", "F32")


# --------------------------------------------------------------------------------------------------
# config.json
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_unsupported_model_type(fresh, capsys, tmp_path, family):
    ckpt = fresh(family)
    cfg_path = ckpt / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["model_type"] = "llama"
    cfg_path.write_text(json.dumps(cfg))
    assert_rejected(capsys, tmp_path, ckpt, str(cfg_path), "unsupported model_type 'llama'",
                    "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")


def test_model_type_missing(fresh, capsys, tmp_path):
    ckpt = fresh("qwen3_next")
    cfg_path = ckpt / "config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["model_type"]
    cfg_path.write_text(json.dumps(cfg))
    assert_rejected(capsys, tmp_path, ckpt, str(cfg_path), "unsupported model_type None", "qwen3_next")


@pytest.mark.parametrize("target", ["dir", "file"])
def test_config_json_missing(fresh, capsys, tmp_path, target):
    ckpt = fresh()
    (ckpt / "config.json").unlink()
    path = ckpt if target == "dir" else weights(ckpt)
    assert_rejected(capsys, tmp_path, path, str(ckpt / "config.json"), "not found", protect=ckpt)


def test_config_json_not_json(fresh, capsys, tmp_path):
    ckpt = fresh()
    cfg_path = ckpt / "config.json"
    cfg_path.write_text('{"model_type": "qwen3_5_moe", ')
    assert_rejected(capsys, tmp_path, ckpt, str(cfg_path), "not valid JSON")


def test_config_json_not_utf8(fresh, capsys, tmp_path):
    ckpt = fresh()
    cfg_path = ckpt / "config.json"
    cfg_path.write_bytes(b'{"model_type": "\xff"}')
    assert_rejected(capsys, tmp_path, ckpt, str(cfg_path), "not valid JSON")


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_config_json_not_a_regular_file(fresh, capsys, tmp_path, kind):
    """A FIFO would block the read forever and /dev/zero would fill the memory: refused before reading (65)."""
    ckpt = fresh()
    cfg_path = ckpt / "config.json"
    cfg_path.unlink()
    if kind == "fifo":
        os.mkfifo(cfg_path)
    else:
        cfg_path.symlink_to("/dev/zero")
    assert_rejected(capsys, tmp_path, ckpt, str(cfg_path), "not a regular file")


def test_config_json_not_an_object(fresh, capsys, tmp_path):
    ckpt = fresh()
    cfg_path = ckpt / "config.json"
    cfg_path.write_text("[1, 2]")
    assert_rejected(capsys, tmp_path, ckpt, str(cfg_path), "expected a JSON object")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("key", ["num_hidden_layers", "hidden_size", "linear_num_key_heads", "num_experts_per_tok"])
def test_config_missing_required_key(fresh, capsys, tmp_path, family, key):
    ckpt = fresh(family)
    edit_config(ckpt, **{key: None})
    assert_rejected(capsys, tmp_path, ckpt, str(ckpt / "config.json"), f"missing required key '{key}'")


def test_config_wrong_value_type(fresh, capsys, tmp_path):
    ckpt = fresh()
    edit_config(ckpt, num_hidden_layers="four")
    assert_rejected(capsys, tmp_path, ckpt, str(ckpt / "config.json"), "'num_hidden_layers'",
                    "non-negative integer", "'four'")


def test_wrapper_without_text_config(fresh, capsys, tmp_path):
    ckpt = fresh("qwen3_5_moe")
    cfg_path = ckpt / "config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["text_config"]
    cfg_path.write_text(json.dumps(cfg))
    assert_rejected(capsys, tmp_path, ckpt, str(cfg_path), "text_config")


@pytest.mark.parametrize("family", FAMILIES)
def test_config_heads_not_a_multiple(fresh, capsys, tmp_path, family):
    ckpt = fresh(family)
    edit_config(ckpt, num_attention_heads=3, num_key_value_heads=2)
    assert_rejected(capsys, tmp_path, ckpt, str(ckpt / "config.json"),
                    "num_attention_heads 3 is not a multiple of num_key_value_heads 2")


def test_config_zero_kv_heads(fresh, capsys, tmp_path):
    ckpt = fresh()
    edit_config(ckpt, num_key_value_heads=0)
    assert_rejected(capsys, tmp_path, ckpt, str(ckpt / "config.json"), "num_key_value_heads 0")


def test_config_top_k_above_experts(fresh, capsys, tmp_path):
    ckpt = fresh()
    edit_config(ckpt, num_experts_per_tok=9)
    assert_rejected(capsys, tmp_path, ckpt, str(ckpt / "config.json"), "num_experts_per_tok 9")


def test_config_layer_types_wrong_length(fresh, capsys, tmp_path):
    ckpt = fresh()
    edit_config(ckpt, layer_types=["linear_attention"] * 3)
    assert_rejected(capsys, tmp_path, ckpt, str(ckpt / "config.json"), "layer_types")


@pytest.mark.parametrize(
    ("family", "changes", "needles"),
    [
        ("qwen3_5_moe", {"layer_types": 5}, ["layer_types", "got 5"]),
        ("qwen3_5_moe", {"layer_types": "linear"}, ["layer_types", "'linear'"]),
        ("qwen3_5_moe", {"rope_parameters": "x"}, ["'rope_parameters' must be a JSON object"]),
        ("qwen3_5_moe", {"rope_parameters": [1, 2]}, ["'rope_parameters' must be a JSON object"]),
        ("qwen3_next", {"rope_parameters": {"rope_theta": "big"}}, ["'rope_theta' must be a number", "'big'"]),
        ("qwen3_next", {"rope_parameters": {"partial_rotary_factor": "x"}}, ["'partial_rotary_factor'"]),
        ("qwen3_next", {"rope_parameters": {"rope_type": "yarn"}}, ["rope_type 'yarn' is not supported"]),
        ("qwen3_next", {"rope_parameters": None, "rope_scaling": [1]}, ["'rope_scaling' must be a JSON object"]),
        ("qwen3_5_moe", {"rms_norm_eps": "abc"}, ["'rms_norm_eps' must be a number", "'abc'"]),
        ("qwen3_next", {"mlp_only_layers": 5}, ["'mlp_only_layers'", "got 5"]),
        ("qwen3_next", {"mlp_only_layers": [[0]]}, ["'mlp_only_layers'"]),
        # values of the right type that no model can have: refused at load, not NaN logits or an internal error
        ("qwen3_5_moe", {"rms_norm_eps": -1}, ["rms_norm_eps must be a positive number, got -1"]),
        ("qwen3_next", {"rms_norm_eps": 0}, ["rms_norm_eps must be a positive number"]),
        ("qwen3_5_moe", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                                             "partial_rotary_factor": 5}}, ["partial_rotary_factor must be in (0, 1]"]),
        ("qwen3_next", {"hidden_act": "gelu"}, ["hidden_act 'gelu' is not supported"]),
        ("qwen3_5_moe", {"eos_token_id": 99999}, ["eos_token_id 99999 is outside the vocabulary"]),
    ],
)
def test_config_value_of_the_wrong_type(fresh, capsys, tmp_path, family, changes, needles):
    """Malformed values are bad input (65) naming the key, not an internal error (exit 1)."""
    ckpt = fresh(family)
    edit_config(ckpt, **changes)
    assert_rejected(capsys, tmp_path, ckpt, str(ckpt / "config.json"), *needles)


@pytest.mark.parametrize("value", [["qwen3_next"], {"a": 1}, 7])
def test_model_type_not_a_string(fresh, capsys, tmp_path, value):
    ckpt = fresh("qwen3_next")
    cfg_path = ckpt / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["model_type"] = value
    cfg_path.write_text(json.dumps(cfg))
    assert_rejected(capsys, tmp_path, ckpt, str(cfg_path), "unsupported model_type", "qwen3_next")


def test_config_json_is_a_directory(fresh, capsys, tmp_path):
    ckpt = fresh()
    (ckpt / "config.json").unlink()
    (ckpt / "config.json").mkdir()
    assert_rejected(capsys, tmp_path, ckpt, str(ckpt / "config.json"), "cannot read")


@pytest.mark.parametrize("payload", [b"[" * 100_000 + b"]" * 100_000, b'{"vocab_size": ' + b"9" * 5000 + b"}"],
                         ids=["deeply-nested", "5000-digit-integer"])
def test_config_json_pathological(fresh, capsys, tmp_path, payload):
    ckpt = fresh()
    (ckpt / "config.json").write_bytes(payload)
    assert_rejected(capsys, tmp_path, ckpt, str(ckpt / "config.json"), "not valid JSON")


@pytest.mark.parametrize(
    "header",
    [b"[" * 200_000 + b"]" * 200_000, b'{"__metadata__":' + b'{"a":' * 100_000 + b"1" + b"}" * 100_001,
     b'{"a":{"dtype":"F32","shape":[' + b"9" * 5000 + b'],"data_offsets":[0,0]}}'],
    ids=["deep-array", "deep-object", "5000-digit-integer"],
)
def test_pathological_safetensors_header(fresh, capsys, tmp_path, header):
    ckpt = fresh()
    path = weights(ckpt)
    write_raw(path, header, b"")
    assert_rejected(capsys, tmp_path, ckpt, str(path), "header")


def test_pathological_index(fresh, capsys, tmp_path):
    ckpt = fresh()
    shard(ckpt)
    index = ckpt / "model.safetensors.index.json"
    index.write_text('{"weight_map": ' + "[" * 200_000 + "]" * 200_000 + "}")
    assert_rejected(capsys, tmp_path, ckpt, str(index), "index")


# --------------------------------------------------------------------------------------------------
# paths
# --------------------------------------------------------------------------------------------------


def test_path_does_not_exist(capsys, tmp_path):
    missing = tmp_path / "no" / "such" / "checkpoint"
    assert_rejected(capsys, tmp_path, missing, str(missing), "no such file or directory", protect=tmp_path / "no")


def test_path_is_not_a_checkpoint(capsys, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("these are not weights\n")
    assert_rejected(capsys, tmp_path, notes, str(notes), "not a checkpoint", protect=notes)


def test_junk_named_safetensors(fresh, capsys, tmp_path):
    ckpt = fresh()
    path = weights(ckpt)
    write_raw(path, b"\x00\x01junk\xff\xfe", b"")
    assert_rejected(capsys, tmp_path, path, str(path), "header is not valid UTF-8", protect=ckpt)


# --------------------------------------------------------------------------------------------------
# the real console: no traceback, one line (a few cases as subprocesses)
# --------------------------------------------------------------------------------------------------


def _console(*argv) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("QCOMPILE_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "qcompile.cli", *map(str, argv)], capture_output=True, text=True,
                          env=env, timeout=120)


@pytest.mark.parametrize("case", ["lfs", "missing_tensor", "bad_model_type"])
def test_console_one_line_no_traceback(fresh, tmp_path, case):
    ckpt = fresh("qwen3_next")
    path = weights(ckpt)
    if case == "lfs":
        path.write_text(LFS_POINTER)
        needles = [str(path), "Git LFS pointer"]
    elif case == "missing_tensor":
        name = "model.layers.1.linear_attn.A_log"
        tensors = read_tensors(path)
        del tensors[name]
        write_safetensors(path, tensors)
        needles = [f"'{name}'", "missing"]
    else:
        edit_config(ckpt, model_type="llama")
        needles = [str(ckpt / "config.json"), "llama"]
    before = snapshot(ckpt)
    proc = _console("--passes", "none", ckpt, "-o", tmp_path / "out")
    assert proc.returncode == BAD_INPUT, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(ERROR), proc.stderr
    assert all(n in lines[0] for n in needles), lines[0]
    assert proc.stdout == ""
    assert not (tmp_path / "out").exists()
    assert snapshot(ckpt) == before


# --------------------------------------------------------------------------------------------------
# tensors the model does not use
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_unknown_extra_tensor_warns_once(fresh, capsys, tmp_path, family):
    ckpt = fresh(family)
    path = weights(ckpt)
    extra = f"{PREFIX[family]}layers.0.foo.weight"
    tensors = read_tensors(path)
    tensors[extra] = np.zeros((3, 4), np.float32)
    write_safetensors(path, tensors)
    before = snapshot(ckpt)
    code, out, err = run_cli(capsys, "--passes", "none", ckpt)
    assert code == 0, err
    lines = err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("qcompile: warning: ") and extra in lines[0], lines[0]
    assert out.startswith(family)
    assert snapshot(ckpt) == before


@pytest.mark.parametrize("family", FAMILIES)
def test_ignorable_extra_tensors_are_silent(fresh, capsys, tmp_path, family):
    ckpt = fresh(family)
    path = weights(ckpt)
    tensors = read_tensors(path)
    tensors["mtp.fc.weight"] = np.zeros((96, 192), np.float32)
    tensors["model.visual.x"] = np.zeros((2,), np.float32)
    write_safetensors(path, tensors)
    code, out, err = run_cli(capsys, "--passes", "none", "--verify", "none", ckpt)  # opening is what warns
    assert code == 0, err
    assert err == ""
    ckpt_obj = Checkpoint.open(ckpt)
    assert set(ckpt_obj.ignored) == {"mtp.fc.weight", "model.visual.x"} and ckpt_obj.unknown == []


# --------------------------------------------------------------------------------------------------
# laziness: opening a checkpoint reads headers only
# --------------------------------------------------------------------------------------------------


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise KeyError("rchar")


def test_open_reads_headers_only(pristine, tmp_path):
    if not os.access("/proc/self/io", os.R_OK):
        pytest.skip("/proc/self/io is not readable here")
    vocab = 2_000_000
    src = pristine["qwen3_5_moe"]
    ckpt = tmp_path / "big"
    ckpt.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    cfg["text_config"]["vocab_size"] = vocab
    (ckpt / "config.json").write_text(json.dumps(cfg))

    old, _ = read_raw(weights(src))
    big = {"lm_head.weight", f"{PREFIX['qwen3_5_moe']}embed_tokens.weight"}
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name in by_offset(old):
        shape = [vocab, 96] if name in big else old[name]["shape"]
        size = int(np.prod(shape)) * 4
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path = weights(ckpt)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)  # zero-filled and sparse: no real disk use
    data_bytes = offset
    assert data_bytes > 1_500_000_000
    if path.stat().st_blocks * 512 > 64 << 20:
        pytest.skip("this filesystem does not make sparse files")

    Checkpoint.open(src)  # warm up imports and caches outside the measurement
    before_io, started = _rchar(), time.perf_counter()
    opened = Checkpoint.open(ckpt)
    elapsed, read = time.perf_counter() - started, _rchar() - before_io

    assert opened.config.vocab_size == vocab
    assert opened.store.info("lm_head.weight").nbytes == vocab * 96 * 4
    assert elapsed < 2.0, f"Checkpoint.open took {elapsed:.2f} s"
    assert read < 10_000_000, f"Checkpoint.open read {read} bytes of a {data_bytes}-byte checkpoint"
    assert path.stat().st_blocks * 512 < 64 << 20  # and wrote nothing into it


def test_all_nan_weights_are_bad_input_not_a_crash(fresh, capsys, tmp_path):
    """A checkpoint whose floats are all NaN: the unoptimized model's own outputs are NaN, so there is nothing to
    check a pass against — exit 65 saying so (it was an internal error, a max over no finite values)."""
    ckpt = fresh()
    path = weights(ckpt)
    tensors = {name: np.full_like(t, np.nan) if np.issubdtype(t.dtype, np.floating) else t
               for name, t in read_tensors(path).items()}
    write_safetensors(path, tensors)
    before = snapshot(ckpt)
    code, _, err = run_cli(capsys, "--passes", "swiglu-fusion", ckpt, "-o", tmp_path / "out")
    assert code == BAD_INPUT and len(err.splitlines()) == 1 and "all NaN/inf" in err, err
    assert snapshot(ckpt) == before and not (tmp_path / "out").exists()


def test_a_missing_embedding_is_named_as_the_checkpoint_names_it(fresh, capsys, tmp_path):
    """A Qwen3.5 wrapper checkpoint without its embedding: the error names model.language_model.embed_tokens.weight
    (the flat name before: the naming was read off the embedding itself)."""
    ckpt = fresh("qwen3_5_moe")
    path = weights(ckpt)
    tensors = read_tensors(path)
    del tensors["model.language_model.embed_tokens.weight"]
    write_safetensors(path, tensors)
    assert_rejected(capsys, tmp_path, ckpt, "'model.language_model.embed_tokens.weight'", "missing")
