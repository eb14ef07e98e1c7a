"""FP8 checkpoints: the block-scaled format of Qwen's own FP8 releases and compressed-tensors FP8, validated and read.

Two formats, named by config.json's `quantization_config` (top level, or in `text_config`):

- `quant_method: fp8` (Qwen's and DeepSeek's FP8 releases): `fmt: e4m3`, `weight_block_size: [bn, bk]`. Each
  quantized weight W [..., N, K] is stored as F8_E4M3 beside a F32 scale named by appending `_scale_inv` —
  `X.weight` → `X.weight_scale_inv`, a stacked expert tensor `experts.gate_up_proj` → `experts.gate_up_proj_scale_inv`
  — of shape [..., ceil(N/bn), ceil(K/bk)]; the value is the FP8 number times its block's scale (transformers'
  `dequantize_fp8_blockwise`; the name says "inverse" because it undoes the quantizer's division).
  `modules_to_not_convert` lists what stays in bf16.
- `quant_method: compressed-tensors` with 8-bit float weights (`config_groups.*.weights: {num_bits: 8, type:
  float, strategy: channel | tensor}`): `X.weight` F8_E4M3 and `X.weight_scale` F32 [N, 1] (per output channel) or
  [1] (per tensor); value = FP8 × scale. `ignore` lists what stays unquantized.

Which tensors are quantized is read off the files: an F8_E4M3 tensor needs a config that declares FP8 and a scale
of exactly the expected shape (a malformed one is exit 65, like every malformed input).

What happens to the values: a canonical weight made of FP8 tensors stays FP8 (frontend/checkpoint.py
`fp8_block` / `load_fp8_scale`): the graph holds it as f8e4m3 values, an f32 scale with one entry per block, and a
`dequantize` where it is used (ir/ops/quant.py). Every format is one block layout there — `source_block` gives each
axis's block extent (Qwen's [1,] 128 × 128; per channel 1 × K; per tensor the whole shape) and `block_scale` the scale
in that layout. A canonical weight that is a reshape of its tensor (none of the projections) is multiplied out to
f32 when read (this module's `dequantize`), one tensor — or one range of rows — at a time.
"""

from __future__ import annotations

import math

import attrs
import ml_dtypes
import numpy as np

from qcompile.errors import CheckpointError

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
#: Suffix of a kept FP8 weight's scale parameter in the graph: "layers.0.self_attn.q_proj" → "….q_proj.fp8_scale".
SCALE_SUFFIX = ".fp8_scale"
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448


@attrs.frozen
class Quantization:
    method: str  # "fp8" | "compressed-tensors"
    strategy: str  # "block" | "channel" | "tensor"
    block: tuple[int, int] | None = None  # (bn, bk) for "block"
    keep: tuple[str, ...] = ()  # modules_to_not_convert / ignore, as written

    def stores_fp8(self, tensor: str, shape: tuple[int, ...]) -> bool:
        """Whether a checkpoint in this format holds Hub tensor `tensor` in FP8, judged from its name alone (planning
        from a config.json, where no file header says): the projections' weights — matrices and stacked experts —
        except the embedding, the head, the routers and what `keep` lists. A checkpoint's own headers decide
        otherwise (Checkpoint.fp8_block)."""
        stem = tensor[:-len(".weight")] if tensor.endswith(".weight") else tensor
        last = stem.rsplit(".", 1)[-1]
        if len(shape) < 2 or last in ("embed_tokens", "lm_head", "gate", "shared_expert_gate", "conv1d") or \
                "norm" in last:
            return False
        return not any(f".{keep}." in f".{stem}." or stem.endswith(keep) for keep in self.keep)

    def scale_name(self, tensor: str) -> str:
        return tensor + ("_scale_inv" if self.method == "fp8" else "_scale")

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The scale's shape for a quantized tensor of `shape` ([..., N, K])."""
        *lead, n, k = shape
        if self.strategy == "block":
            bn, bk = self.block
            return (*lead, math.ceil(n / bn), math.ceil(k / bk))
        if self.strategy == "channel":
            return (*lead, n, 1)
        return (1,)

    def expand(self, scale: np.ndarray, shape: tuple[int, ...], row_offset: int = 0) -> np.ndarray:
        """The scale broadcast to the values it multiplies: [..., N, K] (rows from `row_offset` on, for a slice of a
        2-D tensor's rows)."""
        scale = np.asarray(scale, np.float32)
        *lead, n, k = shape
        if self.strategy == "block":
            bn, bk = self.block
            rows = np.repeat(scale, bn, axis=-2)[..., row_offset:row_offset + n, :]
            return np.repeat(rows, bk, axis=-1)[..., :k]
        if self.strategy == "channel":
            return scale.reshape(*lead, -1, 1)[..., row_offset:row_offset + n, :]
        return scale.reshape(())

    def source_block(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Each axis's block extent for a quantized tensor of `shape` (see `block_scale`)."""
        *lead, n, k = shape
        if self.strategy == "block":
            return (*(1,) * len(lead), *self.block)
        if self.strategy == "channel":
            return (*(1,) * len(lead), 1, k)
        return tuple(shape)

    def block_scale(self, scale: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """The scale of a quantized tensor of `shape` with one entry per block of `source_block(shape)` (the same
        rank as the tensor), f32."""
        block = self.source_block(shape)
        return np.asarray(scale, np.float32).reshape([math.ceil(d / b) for d, b in zip(shape, block)])

    def dequantize(self, values: np.ndarray, scale: np.ndarray, row_offset: int = 0) -> np.ndarray:
        """f32 values of FP8 `values` [..., N, K] (rows from `row_offset` of a 2-D tensor when a slice)."""
        return values.astype(np.float32) * self.expand(scale, values.shape, row_offset)


def parse_quantization(raw: dict, where: str) -> Quantization | None:
    """The quantization a config.json declares (None: none), or a CheckpointError naming what is unsupported."""
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    spec = raw.get("quantization_config") or text.get("quantization_config")
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise CheckpointError(f"{where}: 'quantization_config' must be an object, got {spec!r}")
    method = spec.get("quant_method")
    if method == "fp8":
        fmt = spec.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise CheckpointError(f"{where}: FP8 format {fmt!r} is not supported (qcompile reads e4m3)")
        block = spec.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
            raise CheckpointError(f"{where}: quantization_config.weight_block_size must be [rows, columns], got "
                                  f"{block!r}")
        return Quantization("fp8", "block", tuple(block), tuple(spec.get("modules_to_not_convert") or ()))
    if method == "compressed-tensors":
        groups = spec.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise CheckpointError(f"{where}: compressed-tensors quantization_config has no config_groups")
        strategies = set()
        for name, group in groups.items():
            weights = (group or {}).get("weights") or {}
            if weights.get("num_bits") != 8 or weights.get("type") != "float":
                raise CheckpointError(f"{where}: compressed-tensors group {name!r} is not 8-bit float weights "
                                      f"({weights.get('num_bits')}-bit {weights.get('type')}); qcompile reads FP8")
            strategies.add(weights.get("strategy"))
        if len(strategies) != 1 or not strategies <= {"channel", "tensor"}:
            raise CheckpointError(f"{where}: compressed-tensors weight strategy {sorted(map(str, strategies))} is not "
                                  "supported (one of channel, tensor)")
        return Quantization("compressed-tensors", strategies.pop(), None, tuple(spec.get("ignore") or ()))
    raise CheckpointError(f"{where}: quantization method {method!r} is not supported (qcompile reads fp8 and "
                          "compressed-tensors FP8)")


def quantize(values: np.ndarray, quant: Quantization) -> tuple[np.ndarray, np.ndarray]:
    """(FP8 values, f32 scale) of float `values` [..., N, K] in `quant`'s layout: each block's (row's, tensor's)
    largest magnitude maps to FP8's largest (448). For writing test checkpoints (`init-tiny --dtype fp8`)."""
    values = np.asarray(values, np.float32)
    *lead, n, k = values.shape
    if quant.strategy == "block":
        bn, bk = quant.block
        nb, kb = math.ceil(n / bn), math.ceil(k / bk)
        padded = np.zeros((*lead, nb * bn, kb * bk), np.float32)
        padded[..., :n, :k] = np.abs(values)
        peak = padded.reshape(*lead, nb, bn, kb, bk).max(axis=(-3, -1))
    elif quant.strategy == "channel":
        peak = np.abs(values).max(axis=-1, keepdims=True)
    else:
        peak = np.abs(values).max().reshape(1)
    scale = np.where(peak > 0, peak / FP8_MAX, 1.0).astype(np.float32)
    return (values / quant.expand(scale, values.shape)).astype(FP8), scale
