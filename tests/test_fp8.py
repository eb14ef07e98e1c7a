"""FP8 checkpoints (frontend/quantization.py): both formats, both families, sharded, against transformers run on the
dequantized weights; every malformed scale is a one-line exit 65.

The oracle's weights are dequantized here, by this file's own float64 loops over blocks (not qcompile's code), from
the FP8 values and scales the checkpoint holds; transformers runs on them in f32. qcompile reads the FP8 files and
multiplies them out itself. Measured error: 2–9e-6 × max |logit| over the four cases below (the two dequantizations
agree to f32 rounding; the rest is the usual f32 noise of the model), so the fp32 fidelity bound (1e-4 × max |logit|)
applies unchanged; FP8 itself moves these random models' logits by 0.3–0.6 × max |logit|, and a scale applied to the
wrong blocks misses the bound by orders of magnitude (tested).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

import hf_oracle
from qcompile.errors import CheckpointError
from qcompile.frontend.checkpoint import Checkpoint
from qcompile.frontend.quantization import FP8, Quantization, parse_quantization, quantize
from qcompile.frontend.safetensors_io import INDEX_FILE_NAME, TensorStore, write_safetensors
from qcompile.frontend.tiny import fp8_stored, with_fp8
from qcompile.ir.abi import CacheConfig
from qcompile.runtime.model import load_model

PROMPT = [int(x) for x in np.random.default_rng(11).integers(3, 500, size=23)]
FORMATS = {"block": dict(method="fp8", block=(16, 32)), "channel": dict(method="compressed-tensors",
                                                                         strategy="channel"),
           "tensor": dict(method="compressed-tensors", strategy="tensor")}


def _dequantized_independently(values: np.ndarray, scale: np.ndarray, quant: Quantization) -> np.ndarray:
    """float64 reference: every element times the scale of its block (row, tensor), by explicit indexing."""
    out = values.astype(np.float64)
    *lead, n, k = values.shape
    if quant.strategy == "tensor":
        return out * float(np.asarray(scale).reshape(-1)[0])
    if quant.strategy == "channel":
        return out * np.asarray(scale, np.float64).reshape(*lead, n, 1)
    bn, bk = quant.block
    rows = np.arange(n) // bn
    cols = np.arange(k) // bk
    return out * np.asarray(scale, np.float64)[..., rows[:, None], cols[None, :]]


def fp8_copy(src: Path, fp8_dir: Path, float_dir: Path, fmt: str, shards: int = 2) -> None:
    """`src` (a float checkpoint) written as an FP8 checkpoint in `shards` files with an index, and the same model with
    the FP8 values dequantized (independently, f32) into a plain float checkpoint for transformers."""
    config = with_fp8(json.loads((src / "config.json").read_text()), **FORMATS[fmt])
    quant = parse_quantization(config, "test")
    store = TensorStore.open(src)
    quantized, plain = {}, {}
    for name in sorted(store.names()):
        values = np.asarray(store.read(name), np.float32)
        if fp8_stored(name):
            q, scale = quantize(values, quant)
            quantized[name], quantized[quant.scale_name(name)] = q, scale
            plain[name] = _dequantized_independently(q, scale, quant).astype(np.float32)
        else:
            quantized[name] = plain[name] = values
    for out in (fp8_dir, float_dir):
        out.mkdir(parents=True)
        for extra in ("generation_config.json",):
            if (src / extra).exists():
                (out / extra).write_text((src / extra).read_text())
    names = sorted(quantized)
    per = math.ceil(len(names) / shards)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i * per:(i + 1) * per]
        write_safetensors(fp8_dir / file, {n: quantized[n] for n in part}, metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    (fp8_dir / INDEX_FILE_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (fp8_dir / "config.json").write_text(json.dumps(config))
    write_safetensors(float_dir / "model.safetensors", plain, metadata={"format": "pt"})
    (float_dir / "config.json").write_text((src / "config.json").read_text())


def _logits(path: Path, fp8: str = "keep") -> np.ndarray:
    engine = load_model(path, "f32", progress=False, fp8=fp8).engine(CacheConfig(max_seqs=2, max_context=64))
    return engine.step([(engine.add_sequence(), PROMPT)], all_logits=True)[0]


@pytest.mark.parametrize("family, fmt", [("qwen3_5_moe", "block"), ("qwen3_next", "block"),
                                         ("qwen3_5_moe", "channel"), ("qwen3_next", "tensor")])
def test_fp8_checkpoints_match_transformers_on_the_dequantized_weights(family, fmt, hf_checkpoint, tmp_path):
    src = hf_checkpoint(family)
    fp8_copy(src, tmp_path / "fp8", tmp_path / "float", fmt)
    checkpoint = Checkpoint.open(tmp_path / "fp8")
    assert checkpoint.config.quantization.strategy == ("block" if fmt == "block" else fmt)
    assert not checkpoint.unknown  # the scales are read with their tensors, not reported as unused
    quantized = [n for n in checkpoint.params if "fp8" in checkpoint.source_dtypes(n)]
    assert any(".experts." in n for n in quantized) and any("q_proj" in n for n in quantized)
    ref = hf_oracle.hf_logits(tmp_path / "float", PROMPT)
    ours = _logits(tmp_path / "fp8")
    bound = 1e-4 * max(1.0, float(np.abs(ref).max()))
    error = float(np.abs(ours - ref).max())
    assert error <= bound, f"{family} {fmt}: {error:.3g} > {bound:.3g}"
    # FP8 moved the model: the dequantized weights are not the original ones
    assert float(np.abs(hf_oracle.hf_logits(src, PROMPT) - ref).max()) > 10 * bound


@pytest.mark.parametrize("fp8", ["keep", "dequantize"])
def test_a_scale_applied_to_the_wrong_blocks_misses_the_bound(hf_checkpoint, tmp_path, monkeypatch, fp8):
    """Both paths: weights kept FP8 (the block scale the graph holds, Quantization.block_scale) and multiplied out
    when read (Quantization.expand)."""
    src = hf_checkpoint("qwen3_5_moe")
    fp8_copy(src, tmp_path / "fp8", tmp_path / "float", "block")
    ref = hf_oracle.hf_logits(tmp_path / "float", PROMPT)
    right_expand, right_scale = Quantization.expand, Quantization.block_scale

    def flipped(self, scale):  # block (i, j) scaled by block (i, last - j)'s scale
        scale = np.asarray(scale)
        return np.flip(scale, axis=-1) if self.strategy == "block" and scale.shape[-1] > 1 else scale

    monkeypatch.setattr(Quantization, "expand", lambda self, scale, shape, row_offset=0: right_expand(
        self, flipped(self, scale), shape, row_offset))
    monkeypatch.setattr(Quantization, "block_scale", lambda self, scale, shape: right_scale(
        self, flipped(self, scale), shape))
    error = float(np.abs(_logits(tmp_path / "fp8", fp8) - ref).max())
    assert error > 1e-2 * max(1.0, float(np.abs(ref).max()))


def test_rows_read_in_pieces_equal_the_whole_tensor(tmp_path):
    """Large weights are read a range of rows at a time (ir/weights.py); the scales follow the rows."""
    quant = Quantization("fp8", "block", (16, 32))
    rng = np.random.default_rng(0)
    values, scale = quantize(rng.normal(size=(70, 50)).astype(np.float32), quant)
    assert values.dtype == FP8 and scale.shape == (5, 2)
    whole = quant.dequantize(values, scale)
    for start, stop in ((0, 16), (5, 40), (33, 70), (69, 70)):
        blocks = scale[start // 16:-(-stop // 16)]
        np.testing.assert_array_equal(quant.dequantize(values[start:stop], blocks, start % 16), whole[start:stop])
    np.testing.assert_allclose(whole, _dequantized_independently(values, scale, quant), rtol=1e-6)


@pytest.fixture
def fp8_checkpoint(tmp_path):
    from qcompile.frontend.tiny import write_tiny

    return write_tiny(tmp_path / "fp8", dtype="fp8")


def _rewrite(path: Path, change) -> None:
    store = TensorStore.open(path / "model.safetensors")
    tensors = {n: np.asarray(store.read(n)) for n in store.names()}
    del store
    change(tensors)
    (path / "model.safetensors").unlink()
    write_safetensors(path / "model.safetensors", tensors)


@pytest.mark.parametrize("breakage, message", [
    ("drop", "has no scale 'model.language_model.layers.0.linear_attn.in_proj_qkv.weight_scale_inv'"),
    ("shape", "has shape [3, 1] but [192, 96] in blocks of [128, 128] needs [2, 1]"),
    ("dtype", "scales must be F32, BF16 or F16"),
    ("config", "an FP8 tensor needs a config.json whose quantization_config declares FP8"),
    ("method", "quantization method 'awq' is not supported"),
    ("block", "weight_block_size must be [rows, columns]")])
def test_malformed_fp8_checkpoints_exit_65(fp8_checkpoint, breakage, message, capsys):
    from qcompile.cli import main

    scale = "model.language_model.layers.0.linear_attn.in_proj_qkv.weight_scale_inv"
    config = json.loads((fp8_checkpoint / "config.json").read_text())
    if breakage == "drop":
        _rewrite(fp8_checkpoint, lambda t: t.pop(scale))
    elif breakage == "shape":
        _rewrite(fp8_checkpoint, lambda t: t.__setitem__(scale, np.ones((3, 1), np.float32)))
    elif breakage == "dtype":
        _rewrite(fp8_checkpoint, lambda t: t.__setitem__(scale, np.ones((2, 1), np.int32)))
    elif breakage == "config":
        config.pop("quantization_config")
    elif breakage == "method":
        config["quantization_config"]["quant_method"] = "awq"
    else:
        config["quantization_config"]["weight_block_size"] = [128]
    (fp8_checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit) as done:
        main(["run", str(fp8_checkpoint), "--prompt-ids", "1,2,3", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert done.value.code == 65 and message in err and len(err.strip().splitlines()) == 1, err
    with pytest.raises(CheckpointError):
        Checkpoint.open(fp8_checkpoint)


def test_init_tiny_fp8_runs(fp8_checkpoint, capsys):
    """`init-tiny --dtype fp8` writes Qwen's format (128 x 128 blocks; bf16 where Qwen keeps bf16) that runs."""
    from qcompile.cli import main

    store = TensorStore.open(fp8_checkpoint / "model.safetensors")
    assert store.info("model.language_model.layers.0.mlp.experts.gate_up_proj").dtype == "F8_E4M3"
    assert store.info("model.language_model.layers.0.mlp.experts.gate_up_proj_scale_inv").shape == (8, 1, 1)
    assert store.info("model.language_model.layers.0.mlp.gate.weight").dtype == "BF16"
    assert store.info("lm_head.weight").dtype == "BF16"
    with pytest.raises(SystemExit) as done:
        main(["run", str(fp8_checkpoint), "--prompt-ids", "5,6,7,8", "--max-new-tokens", "4"])
    assert done.value.code == 0 and len(capsys.readouterr().out.split(",")) == 4
