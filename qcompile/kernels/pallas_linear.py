"""Pallas TPU linear on FP8 weights: x [..., K] · wᵀ with w [N, K] read as FP8 tiles (tpu rule of linear,
linear_swiglu and linear_f32 given a deferred FP8 weight, kernels/fp8.py).

Why: the attention and GDN projections and the shared expert are the FP8 weights a decode step reads besides the
experts; handing XLA a dequantized weight leaves it to decide whether the f8 → bf16 convert is fused into the dot
or materialized in HBM per step. This kernel reads one byte a weight: each [tn, tk] tile of w comes from HBM as FP8,
its block scale from SMEM (the whole [N/tn, K/tk] table: 12 KiB for Qwen3.5-397B's largest projection), and is
dequantized in VMEM (FP8 → f32 × scale → the rows' dtype: the reference dequantize's single rounding) before its dot.

Grid (N/tn, M/tm, K/tk), k innermost, an f32 accumulator [tm, tn] in VMEM written out in the rows' dtype at the last
k block — the contract of the reference rule (einsum with f32 accumulation, rounded once). It takes Qwen's layout:
blocks of 128 × 128 = the tiles, N and K multiples of 128 (`fits`); the rule dequantizes any other layout first.
Rows are padded to the row tile (min(128, M rounded up to 8)) and sliced off.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from qcompile.kernels.fp8 import QuantizedWeight
from qcompile.kernels.pallas_gmm import BLOCK, DequantizedTile, pad_to


def fits(w: QuantizedWeight) -> bool:
    """Whether a deferred FP8 weight [N, K] is in the layout linear_fp8_pallas takes."""
    n, k = w.shape
    return tuple(w.block) == (BLOCK, BLOCK) and n % BLOCK == 0 and k % BLOCK == 0


def _kernel(x_ref, w_ref, s_ref, out_ref, acc, *, dtype):
    j, kk = pl.program_id(0), pl.program_id(2)

    @pl.when(kk == 0)
    def _zero():
        acc[...] = jnp.zeros_like(acc)

    tile = DequantizedTile(w_ref, s_ref[j, kk], dtype)[...]  # [tn, tk]
    acc[...] += jax.lax.dot_general(x_ref[...], tile, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    @pl.when(kk == pl.num_programs(2) - 1)
    def _write():
        out_ref[...] = acc[...].astype(out_ref.dtype)


def linear_fp8_pallas(x, values, scale, *, interpret=False, out_dtype=None, tm: int = BLOCK, tn: int = BLOCK,
                      tk: int = BLOCK):
    """x [..., K] · dequantize(values [N, K], scale [N/tn, K/tk])ᵀ in x's dtype, or `out_dtype` (f32: linear_f32's
    unrounded partial sums) — see the module docstring."""
    out_dtype = out_dtype or x.dtype
    lead, k = x.shape[:-1], x.shape[-1]
    n = values.shape[0]
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    if m == 0:
        return jnp.zeros((*lead, n), out_dtype)
    tm = min(tm, -(-m // 8) * 8)
    padded = pad_to(rows, 0, tm)
    call = pl.pallas_call(
        functools.partial(_kernel, dtype=x.dtype),
        out_shape=jax.ShapeDtypeStruct((padded.shape[0], n), out_dtype),
        grid=(n // tn, padded.shape[0] // tm, k // tk),
        in_specs=[pl.BlockSpec((tm, tk), lambda j, i, kk: (i, kk)),
                  pl.BlockSpec((tn, tk), lambda j, i, kk: (j, kk)),
                  pl.BlockSpec(scale.shape, lambda j, i, kk: (0, 0), memory_space=pltpu.SMEM)],
        out_specs=pl.BlockSpec((tm, tn), lambda j, i, kk: (i, j)),
        scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
    )
    return call(padded, values, scale.astype(jnp.float32))[:m].reshape(*lead, n)


def linear_fp8_tpu(x, w: QuantizedWeight, out_dtype=None):
    """linear_fp8_pallas as a lowering rule (a weight that `fits`): compiled on TPU, interpreted elsewhere."""
    return jax.lax.platform_dependent(
        x, w.values, w.scale,
        tpu=functools.partial(linear_fp8_pallas, interpret=False, out_dtype=out_dtype),
        default=functools.partial(linear_fp8_pallas, interpret=True, out_dtype=out_dtype))
