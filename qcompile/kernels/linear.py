"""Dense linear layers and greedy sampling for the CPU backend.

`linear_cpu(x[..., K], w[N, K]) -> [..., N]` (x·wᵀ, f32 accumulation, Hugging Face's [out, in] weight layout) picks
per static shape:

- the native kernel (kernels/native/linear_f32.cc, an XLA FFI custom call built on first use, kernels/native.py) for
  f32 when the step has at most NATIVE_MAX_ROWS rows — decode steps, one row per sequence. It reads each weight row
  where it lies and keeps a 6×4 tile of dot products in registers; XLA's dot packs a transposed copy of the [N, K]
  weight per call and is blocked for large row counts. Measured on the bench preset's shapes (2 threads, min of 60,
  benchmarks/linear_cpu.py): 1.2-1.4× faster than XLA at 32 rows, 1.4-2.5× at 8, equal at 64, slower from 96 rows on;
- XLA's dot otherwise (prefill, bf16, or no C++ compiler), with the CPU's default precision: XLA CPU's f32 dot is
  already full precision, so Precision.HIGHEST would only cost time (bit-identical, measured).

`greedy_cpu(logits[R, V]) -> i32[R]` is argmax as two plain reductions (the row maximum, then the lowest index that
holds it) instead of XLA CPU's variadic (value, index) reduction, which ran 5× slower at [32, 32000] (2.3 vs
0.47 ms). Same function as jnp.argmax, NaN included: a row with a NaN answers its first NaN.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from qcompile.kernels import native
from qcompile.kernels.fp8 import QuantizedWeight

NATIVE_F32 = "qcompile_linear_f32"
NATIVE_FP8 = "qcompile_linear_fp8"
NATIVE_MAX_ROWS = 48  # the kernel's row chunk; from 64 rows on XLA's packed GEMM is as fast or faster


def linear_xla(x, w):
    return jnp.einsum("...k,nk->...n", x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def linear_native(x, w):
    """The native f32 kernel; call only after `native.ensure(NATIVE_F32)` returned True."""
    lead, k, n = x.shape[:-1], x.shape[-1], w.shape[0]
    rows = math.prod(lead)
    call = jax.ffi.ffi_call(NATIVE_F32, jax.ShapeDtypeStruct((rows, n), jnp.float32))
    return call(x.reshape(rows, k).astype(jnp.float32), w.astype(jnp.float32)).reshape(*lead, n)


def use_native(x, w) -> bool:
    rows = math.prod(x.shape[:-1])
    return (x.dtype == jnp.float32 and w.dtype == jnp.float32 and 0 < rows <= NATIVE_MAX_ROWS
            and native.ensure(NATIVE_F32))


def linear_fp8_native(x, w: QuantizedWeight):
    """The native kernel on FP8 weights: each work item's weight rows dequantized into an L2-resident buffer
    (kernels/native/linear_f32.cc); call only after `native.ensure(NATIVE_FP8)` returned True."""
    lead, k, n = x.shape[:-1], x.shape[-1], w.shape[0]
    rows = math.prod(lead)
    block_n, block_k = w.block
    call = jax.ffi.ffi_call(NATIVE_FP8, jax.ShapeDtypeStruct((rows, n), jnp.float32))
    out = call(x.reshape(rows, k).astype(jnp.float32), w.values,
               w.scale.astype(jnp.float32), block_n=block_n, block_k=block_k)
    return out.reshape(*lead, n)


def linear_cpu(x, w):
    """The CPU lowering of linear: the native kernel for few f32 rows (on FP8 weights as they are), XLA's dot
    otherwise (FP8 weights dequantized first)."""
    if isinstance(w, QuantizedWeight):
        rows = math.prod(x.shape[:-1])
        if (x.dtype == jnp.float32 and w.dtype == jnp.float32 and 0 < rows <= NATIVE_MAX_ROWS
                and native.ensure(NATIVE_FP8)):
            return linear_fp8_native(x, w)
        w = w.dequantize()
    return linear_native(x, w) if use_native(x, w) else linear_xla(x, w)


def greedy_cpu(logits):
    """argmax over the last axis (lowest index on ties; the first NaN where a row has one) as two reductions."""
    top = jnp.max(logits, axis=-1, keepdims=True)
    hit = (logits == top) | jnp.isnan(logits)
    index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return jnp.min(jnp.where(hit, index, logits.shape[-1]), axis=-1).astype(jnp.int32)
