"""FP8 weights with block scales: the jnp dequantization, and the deferred form a matmul rule dequantizes itself.

A quantized weight is FP8 (e4m3fn) values W8 of any rank and an f32 scale S with one entry per block: `block` gives
the block's extent along every axis, so S has ceil(d / b) entries along an axis of size d and block b, and
W[i] = W8[i] · S[i // block] (elementwise, per axis). Every format qcompile reads is one such block layout (the
frontend converts them, frontend/quantization.py): Qwen's FP8 releases (1 × 128 × 128 for a stacked expert tensor,
128 × 128 for a linear), per-output-channel scales (1 × K), a per-tensor scale (the whole shape).

`QuantizedWeight` is how a lowering hands a dequantize op's result to its consumer without computing it: a matmul
rule that reads FP8 itself (the native CPU grouped matmul and linear, kernels/native/*_fp8.cc: each slab of weight
rows is dequantized into an L2-resident buffer just before it is multiplied, so memory moves one byte per weight)
takes it as is; any other rule gets `dequantize()`'s array (ir/lowering.py does this).
"""

from __future__ import annotations

import math

import attrs
import jax
import jax.numpy as jnp


def expand_scale(scale, block: tuple[int, ...], shape: tuple[int, ...]):
    """The per-block scale repeated to one entry per element of a weight of `shape`."""
    out = scale
    for axis, (b, d) in enumerate(zip(block, shape)):
        if b != 1:
            out = jnp.repeat(out, b, axis=axis, total_repeat_length=math.ceil(d / b) * b)
            out = jax.lax.slice_in_dim(out, 0, d, axis=axis)
    return out


def dequantize(values, scale, block: tuple[int, ...], dtype):
    """W8 · S per block, computed in f32 and rounded once to `dtype`."""
    return (values.astype(jnp.float32) * expand_scale(scale.astype(jnp.float32), block, values.shape)).astype(dtype)


@attrs.frozen(eq=False)
class QuantizedWeight:
    """A dequantize op's operands, not yet multiplied out (see the module docstring)."""

    values: object  # f8e4m3 array
    scale: object  # f32 array, one entry per block
    block: tuple[int, ...]
    dtype: object  # the dtype the weight is used in

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    def dequantize(self):
        return dequantize(self.values, self.scale, self.block, self.dtype)


def materialized(value):
    """`value` as an array: a QuantizedWeight dequantized, anything else as it is."""
    return value.dequantize() if isinstance(value, QuantizedWeight) else value


def unit_leading(weight: QuantizedWeight, axes: int) -> QuantizedWeight:
    """`weight` with blocks of 1 along its first `axes` axes (a per-tensor scale over stacked experts becomes one
    per expert): the layout the native kernels take, whose scales are indexed per expert."""
    scale, block = weight.scale, list(weight.block)
    for axis in range(axes):
        if block[axis] != 1:
            scale = expand_scale(scale, tuple(block[axis] if i == axis else 1 for i in range(len(block))),
                                 tuple(weight.shape[axis] if i == axis else scale.shape[i]
                                       for i in range(len(block))))
            block[axis] = 1
    return attrs.evolve(weight, scale=scale, block=tuple(block))
