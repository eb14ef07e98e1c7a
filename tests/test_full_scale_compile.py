"""Full-scale compile: weights streamed into the artifact one slab at a time in bounded memory, `--weights
copy|link|none`, the free-space check, tampering refused in every mode, and the numerics check of a slice restricted
to some experts when even one layer of each type does not fit in memory.

Checkpoints here are either tiny (numerics) or header-only sparse files at full width (`write_sparse_checkpoint`:
real safetensors headers, data as holes that read as zeros): a multi-GB model in a few KB of disk.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from qcompile.compiler import driver, export
from qcompile.errors import CheckpointError
from qcompile.frontend.checkpoint import Checkpoint
from qcompile.frontend.safetensors_io import SafetensorsFile, write_safetensors
from qcompile.frontend.tiny import full_config, write_sparse_checkpoint
from qcompile.ir.importer import build_graph
from qcompile.ir.weights import PIECE_BYTES, param_types
from qcompile.runtime.artifact import load_artifact
from test_cli import cli

PROMPT = "5,17,300,42,7"
SMALL_ARTIFACT = ("--max-seqs", "1", "--max-context", "32", "--max-step-tokens", "8")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from conftest import write_small

    return write_small(tmp_path_factory.mktemp("full") / "m", family="qwen3_5_moe", seed=4)


def _tokens(capsys, source) -> tuple[list[int], str]:
    code, out, err = cli(capsys, "run", source, "--prompt-ids", PROMPT, "--max-new-tokens", 4, "--ignore-eos")
    assert code == 0, err
    return [int(t) for t in out.strip().split(",")], err


@pytest.mark.parametrize("mode", ["link", "none"])
def test_link_and_none_artifacts_run_like_the_checkpoint(mode, tiny, capsys, tmp_path):
    """Neither mode copies a weight; `run ARTIFACT` makes the weights from the checkpoint's own files (hard links
    inside the artifact for link, the checkpoint's path for none — said in one line) and generates what `run
    CHECKPOINT` generates."""
    out = tmp_path / mode
    code, _, err = cli(capsys, tiny, "--passes", "all", "--verify", "none", "-o", out, "--weights", mode,
                       *SMALL_ARTIFACT)
    assert code == 0, err
    assert not (out / "weights.safetensors").exists()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["weights"]["mode"] == mode
    want, _ = _tokens(capsys, tiny)
    got, note = _tokens(capsys, out)
    assert got == want
    if mode == "link":
        linked = out / "checkpoint" / "model.safetensors"
        assert linked.stat().st_ino == (tiny / "model.safetensors").stat().st_ino  # a hard link, not a copy
        assert manifest["weights"]["source"] == "linked" and "checkpoint/model.safetensors" in manifest["files"]
        assert "hard-linked" in note
    else:
        assert manifest["weights"]["source"] == "checkpoint"
        assert note.count("\n") == 1 and f"needs the checkpoint at {tiny}" in note


def _flip_a_data_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("mode", ["link", "none"])
def test_a_changed_or_missing_checkpoint_is_refused(mode, tiny, capsys, tmp_path):
    mine = tmp_path / "ckpt"
    shutil.copytree(tiny, mine)
    out = tmp_path / "art"
    assert cli(capsys, mine, "--passes", "none", "--verify", "none", "-o", out, "--weights", mode,
               *SMALL_ARTIFACT)[0] == 0
    load_artifact(out)  # as compiled: fine
    # Tampering in place: the hard link sees it too (same inode), the reference by path sees it by hash.
    _flip_a_data_byte(mine / "model.safetensors")
    with pytest.raises(CheckpointError, match="sha256"):
        load_artifact(out)
    code, _, err = cli(capsys, "run", out, "--prompt-ids", PROMPT)
    assert code == 65 and err.count("\n") == 1
    if mode == "none":
        shutil.rmtree(mine)
        with pytest.raises(CheckpointError, match=f"reads them from {mine}"):
            load_artifact(out)


def test_link_falls_back_to_references_where_hard_links_are_refused(tiny, capsys, tmp_path, monkeypatch):
    """Another device (EXDEV) or a file system without hard links: the artifact references the checkpoint by path,
    size and hash instead, leaves no partial links behind, and `run` says where it reads the weights from."""
    def refuse(*_args, **_kwargs):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(export.os, "link", refuse)
    out = tmp_path / "art"
    code, _, err = cli(capsys, tiny, "--passes", "none", "--verify", "none", "-o", out, "--weights", "link",
                       *SMALL_ARTIFACT)
    assert code == 0, err
    monkeypatch.undo()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["weights"]["mode"] == "link" and manifest["weights"]["source"] == "checkpoint"
    recorded = manifest["weights"]["checkpoint"]["files"]
    assert recorded["model.safetensors"]["bytes"] == (tiny / "model.safetensors").stat().st_size
    assert not (out / "checkpoint").exists()
    got, note = _tokens(capsys, out)
    assert got == _tokens(capsys, tiny)[0] and f"needs the checkpoint at {tiny}" in note


def test_too_little_free_space_is_refused_before_anything_is_written(tiny, capsys, tmp_path, monkeypatch):
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(export, "SPACE_MARGIN", 0)
    monkeypatch.setattr(export.shutil, "disk_usage", lambda _p: usage._replace(free=1000))
    out = tmp_path / "nested" / "art"
    code, _, err = cli(capsys, tiny, "--passes", "none", "--verify", "none", "-o", out, *SMALL_ARTIFACT)
    assert code == 2 and err.count("\n") == 1 and "GB free" in err and "--weights link" in err
    assert not (tmp_path / "nested").exists()
    # link writes no weight bytes, so the same free space is enough for it.
    code, _, err = cli(capsys, tiny, "--passes", "none", "--verify", "none", "-o", out, "--weights", "link",
                       *SMALL_ARTIFACT)
    assert code == 0, err


def _wide_config(layers: int, experts: int, vocab: int) -> dict:
    """Qwen3.5-397B's widths (H 4096, I 1024, 32/2 heads of 256, GDN 16/64 heads of 128) with fewer layers and
    experts, so a test writes a few GB instead of 800."""
    config = copy.deepcopy(full_config("qwen3.5-397b", "qwen3_5_moe", "bf16"))
    text = config["text_config"]
    text.update(num_hidden_layers=layers, num_experts=experts, vocab_size=vocab,
                layer_types=["full_attention" if (i + 1) % 4 == 0 or i == layers - 1 else "linear_attention"
                             for i in range(layers)])
    return config


def _peak_rss_of(argv: list[str]) -> tuple[int, str]:
    """(peak resident bytes of a fresh process running argv, its stderr), measured by a wrapper process so earlier
    children of the test process do not count."""
    probe = ("import resource, subprocess, sys; p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
             "sys.stderr.write(p.stderr); "
             "print(p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    done = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=900)
    code, kib = done.stdout.split()
    assert int(code) == 0, done.stderr[-2000:]
    return int(kib) * 1024, done.stderr


def _scratch_dir(tmp_path: Path, needed: int) -> Path:
    """Where a test writes a multi-GB artifact: /dev/shm when it has room (memory-backed, not counted in the
    compile's resident set, and far faster than this machine's disk), else the test's tmp directory."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 2 * needed:
        return Path(__import__("tempfile").mkdtemp(dir=shm))
    return tmp_path


def _bytes_not_linked(root: Path, checkpoint: Path) -> int:
    """Bytes the artifact adds on disk: its files, minus those that are hard links to the checkpoint's."""
    inodes = {p.stat().st_ino for p in checkpoint.iterdir()}
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and p.stat().st_ino not in inodes)


@pytest.mark.slow
def test_a_sparse_full_width_checkpoint_compiles_in_memory_bounded_by_a_slab(tmp_path):
    """A 3 GB full-width checkpoint (two layers, 32 experts) compiles with --passes all into a copied artifact
    while the compile's peak resident memory stays within what the same compile takes without weights
    (`--weights none`: Python, JAX, the export) plus 16 slabs of PIECE_BYTES — the bound docs/compile_time.md states —
    and under a third of the weights; link and none artifacts add under 1% of the checkpoint's size."""
    ckpt = write_sparse_checkpoint(tmp_path / "wide", _wide_config(2, 32, 65536), shard_bytes=10**9)
    weight_bytes = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    assert weight_bytes > 2.5e9 and len(list(ckpt.glob("*.safetensors"))) >= 3
    base = [sys.executable, "-m", "qcompile.cli", str(ckpt), "--passes", "all", "--verify", "none",
            "--max-seqs", "1", "--max-step-tokens", "1"]
    sizes = {}
    for mode in ("none", "link"):
        out = tmp_path / mode
        sizes[mode], _ = _peak_rss_of([*base, "-o", str(out), "--weights", mode])
        assert _bytes_not_linked(out, ckpt) < 0.01 * weight_bytes
    scratch = _scratch_dir(tmp_path, weight_bytes)
    try:
        out = scratch / "copy"
        peak, _ = _peak_rss_of([*base, "-o", str(out), "--weights", "copy"])
        graph_bytes = sum(int(np.prod(t.shape)) * 2 for t in param_types(build_graph(Checkpoint.open(ckpt))).values())
        weights = SafetensorsFile(out / "weights.safetensors")
        assert sum(info.nbytes for info in weights.tensors.values()) == graph_bytes
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["files"]["weights.safetensors"]["bytes"] == (out / "weights.safetensors").stat().st_size
    finally:
        if scratch != tmp_path:
            shutil.rmtree(scratch, ignore_errors=True)
    print(f"peak resident: none {sizes['none'] / 2**20:.0f} MiB, link {sizes['link'] / 2**20:.0f} MiB, copy {peak / 2**20:.0f} MiB of {weight_bytes / 2**30:.1f} GiB weights")
    assert peak < sizes["none"] + 16 * PIECE_BYTES, (peak, sizes)
    assert peak < weight_bytes / 3, (peak, weight_bytes)


@pytest.mark.slow
def test_the_full_size_flagship_compiles_link_and_none_in_bounded_memory(tmp_path):
    """Qwen3.5-397B-A17B at full size (60 layers, 512 experts, 793 GB sparse bf16 in 16 shards of 50 GB): link and
    none compile with --passes all in bounded memory and add under 1% of its size; copy is refused with exit 2 when
    the disk cannot hold it (this machine), before anything is written."""
    ckpt = write_sparse_checkpoint(tmp_path / "flagship", full_config("qwen3.5-397b", "qwen3_5_moe", "bf16"))
    weight_bytes = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    assert weight_bytes > 790e9
    base = [sys.executable, "-m", "qcompile.cli", str(ckpt), "--passes", "all", "--verify", "none",
            "--max-seqs", "1", "--max-step-tokens", "1"]
    for mode in ("none", "link"):
        out = tmp_path / mode
        peak, _ = _peak_rss_of([*base, "-o", str(out), "--weights", mode])
        assert peak < 2 << 30
        assert _bytes_not_linked(out, ckpt) < 0.01 * weight_bytes
    if shutil.disk_usage(tmp_path).free < weight_bytes:
        done = subprocess.run([*base, "-o", str(tmp_path / "copy")], capture_output=True, text=True, timeout=600)
        assert done.returncode == 2 and "GB free" in done.stderr
        assert not (tmp_path / "copy").exists()


def test_with_experts_is_the_checkpoint_of_those_experts(tmp_path):
    """Checkpoint.with_experts(k) reads exactly what a checkpoint holding only the first k experts (and the router's
    first k rows) would hold, for the stacked (Qwen3.5) and per-expert (Qwen3-Next) layouts."""
    from conftest import write_small

    for family in ("qwen3_5_moe", "qwen3_next"):
        full = Checkpoint.open(write_small(tmp_path / family, family=family, seed=2))
        k = 3
        restricted = full.with_experts(k)
        assert restricted.config.num_experts == k and restricted.config.top_k == min(full.config.top_k, k)
        # The oracle: a checkpoint written with only those experts.
        store = full.store
        tensors = {}
        for name in store.names():
            array = np.asarray(store.read(name))
            if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj") \
                    or name.endswith("mlp.gate.weight"):
                array = array[:k]
            elif ".mlp.experts." in name and int(name.split(".mlp.experts.")[1].split(".")[0]) >= k:
                continue
            tensors[name] = array
        config = json.loads((full.path / "config.json").read_text())
        (config.get("text_config") or config)["num_experts"] = k
        oracle_dir = tmp_path / f"{family}-oracle"
        oracle_dir.mkdir()
        write_safetensors(oracle_dir / "model.safetensors", tensors)
        (oracle_dir / "config.json").write_text(json.dumps(config))
        oracle = Checkpoint.open(oracle_dir)
        assert set(oracle.params) == set(restricted.params)
        for name in oracle.params:
            np.testing.assert_array_equal(restricted.load(name), oracle.load(name), err_msg=name)
            rows = oracle.params[name].shape[0] if oracle.params[name].shape else 0
            if rows > 1:
                np.testing.assert_array_equal(restricted.load_rows(name, 1, rows), oracle.load(name)[1:])


def test_a_slice_too_large_for_memory_is_checked_on_fewer_experts(tiny, capsys, monkeypatch):
    """When even one layer of each type does not fit in the check's memory budget, the check runs on that slice
    restricted to the first N routed experts (router restricted too) and says so;
    when not even top-k experts fit, it is a one-line exit 2 naming the memory needed."""
    ckpt = Checkpoint.open(tiny)
    graph = build_graph(ckpt)
    per_type = build_graph(ckpt, layers=(0, 1))
    slice_bytes = sum(int(np.prod(t.shape)) * 4 for t in param_types(per_type).values())
    # Budget (a third of "memory") just under the one-layer-per-type slice: a few experts must go.
    monkeypatch.setattr(driver, "memory_bytes", lambda: 3 * (slice_bytes - 1))
    code, out, err = cli(capsys, tiny, "--passes", "swiglu-fusion", "--verify", "final")
    assert code == 0, err
    assert "routed experts 0.." in err and "router restricted" in err
    experts = int(err.split("routed experts 0..")[1].split()[0]) + 1
    assert ckpt.config.top_k <= experts < ckpt.config.num_experts
    assert f"with experts 0..{experts - 1}" in out
    del graph
    monkeypatch.setattr(driver, "memory_bytes", lambda: 3000)
    code, _, err = cli(capsys, tiny, "--passes", "swiglu-fusion", "--verify", "final")
    assert code == 2 and err.count("\n") == 1 and "GiB of memory" in err and "--verify none" in err


def test_weights_are_written_with_a_progress_bar_in_bytes_and_a_rate(tiny, capfd, tmp_path):
    ckpt = Checkpoint.open(tiny)
    graph = build_graph(ckpt)
    from qcompile.ir.abi import CacheConfig

    export.write_artifact(tmp_path / "art", graph, export.CheckpointWeights(ckpt, graph), config_json={},
                          cache=CacheConfig(max_seqs=1, max_context=16, max_step_tokens=1), progress=True)
    err = capfd.readouterr().err
    assert "writing weights" in err and "B/s" in err and "exporting for cpu" in err
