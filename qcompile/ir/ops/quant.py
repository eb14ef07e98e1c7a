"""FP8 weights: `dequantize` of FP8 values by their block scales, and `refine_scale`, a block scale made finer.

A checkpoint's FP8 weight enters the graph as two parameters — its f8e4m3 values and its f32 block scale — and one
`dequantize` to the compute dtype; the weight stays FP8 in memory and in the artifact, and the multiply happens where
the weight is used: a target rule that reads FP8 itself (the native CPU matmuls) receives the deferred operands
(kernels/fp8.py `QuantizedWeight`); any other rule sees the dequantized array. Weight preparation applies layout ops
on a dequantized weight to its values and scale instead (ir/fp8_layout.py), so a prepared weight stays FP8 too.

    %w = param "layers.0.mlp.experts.gate_proj" : f8e4m3[64,128,512]
    %s = param "layers.0.mlp.experts.gate_proj.fp8_scale" : f32[64,1,4]
    %g = dequantize(%w, %s) {block=[1,128,128], dtype=f32} : f32[64,128,512]
"""

from __future__ import annotations

import math

import attrs

from qcompile.frontend.quantization import SCALE_SUFFIX  # noqa: F401  (the scale parameter's name, re-exported)
from qcompile.ir.cost import Cost, cost, nbytes
from qcompile.ir.registry import expect, lowering, op, type_rule
from qcompile.ir.types import TensorType, np_dtype
from qcompile.kernels.fp8 import QuantizedWeight, dequantize, expand_scale



def blocks(shape, block) -> tuple:
    """The scale's shape for a weight of `shape` in blocks of `block` (symbolic dims are whole blocks of 1)."""
    return tuple(math.ceil(d / b) if isinstance(d, int) else d for d, b in zip(shape, block))


@op("dequantize")
@attrs.frozen
class Dequantize:
    """dequantize(w: f8e4m3[...], scale: f32[ceil(d_i / block_i)...]) -> dtype[...] = w · scale of each element's
    block (computed in f32, rounded once to `dtype`)."""

    block: tuple = attrs.field(converter=tuple)
    dtype: str


@type_rule(Dequantize)
def _dequantize_type(op_, w, scale):
    expect(w.dtype == "f8e4m3" and scale.dtype == "f32", f"dequantize wants f8e4m3 values and f32 scales; got {w}, "
                                                          f"{scale}")
    expect(len(op_.block) == w.rank == scale.rank and all(isinstance(b, int) and b >= 1 for b in op_.block),
           f"dequantize block {list(op_.block)} does not fit {w}")
    expect(tuple(scale.shape) == blocks(w.shape, op_.block),
           f"dequantize scale {scale} does not cover {w} in blocks of {list(op_.block)}")
    return TensorType(op_.dtype, w.shape, sharding=w.sharding)


@lowering(Dequantize)
def _dequantize(op_, w, scale):
    return dequantize(w, scale, op_.block, np_dtype(op_.dtype))


@lowering(Dequantize, target="cpu")
@lowering(Dequantize, target="tpu")
def _dequantize_deferred(op_, w, scale):
    """Deferred: a consumer rule that reads FP8 itself (the native CPU matmuls, the Pallas TPU grouped matmul) gets
    the operands; ir/lowering.py multiplies them out for any other."""
    return QuantizedWeight(w, scale, tuple(op_.block), np_dtype(op_.dtype))


@cost(Dequantize)
def _dequantize_cost(op_, operands, results, step):
    """The scale, read once. The FP8 values are counted by the consumer, which reads them at one byte a weight
    (ir/cost.py passes a dequantized operand to its consumer's rule with the FP8 type)."""
    (scale_type, scale_shape) = operands[1]
    return Cost(0.0, nbytes(scale_type, scale_shape))


@op("refine_scale")
@attrs.frozen
class RefineScale:
    """refine_scale(scale) -> the same scale in blocks of `to` (a divisor of `block`) along `axis` (each entry
    repeated block/to times, cut to ceil(size/to)): what lets a layout op cut a quantized weight inside a block
    (ir/fp8_layout.py)."""

    axis: int
    block: int
    size: int
    to: int = 1


@type_rule(RefineScale)
def _refine_scale_type(op_, scale):
    expect(scale.shape[op_.axis] == math.ceil(op_.size / op_.block),
           f"refine_scale: {scale} does not hold {op_.size} entries in blocks of {op_.block} along axis {op_.axis}")
    expect(op_.to >= 1 and op_.block % op_.to == 0, f"refine_scale: blocks of {op_.to} do not divide {op_.block}")
    shape = list(scale.shape)
    shape[op_.axis] = math.ceil(op_.size / op_.to)
    keep = scale.sharding is not None and scale.sharding.dims[op_.axis] is None  # the experts split carries through
    return TensorType(scale.dtype, tuple(shape), sharding=scale.sharding if keep else None)


@lowering(RefineScale)
def _refine_scale(op_, scale):
    block = tuple(op_.block // op_.to if i == op_.axis else 1 for i in range(scale.ndim))
    shape = tuple(math.ceil(op_.size / op_.to) if i == op_.axis else d for i, d in enumerate(scale.shape))
    return expand_scale(scale, block, shape)
