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

`linear_panels_cpu(x[..., K], wp[P, K, PANEL]) -> [..., P·PANEL]` is the same product with the weight prepared at
compile time in column panels (ir/target_layout.py makes this layout for every f32 linear whose weight is known and
whose N is a multiple of PANEL): panel p holds w[PANEL·p + c, k] at [p, k, c], so each panel is one contiguous run
of memory that an outer-product kernel (kernels/native/linear_panels_f32.cc) streams once per chunk of 48 rows.
With weights from memory, as in a decode step, it ran 1.3× faster than the row kernel above at 32 rows and 1.1× at
1 and 8, and as fast as XLA's dot or faster from 128 to 512 rows, so it serves every row count
(benchmarks/linear_panels_cpu.py; docs/cpu_rules.md). Panels are made only where the kernel can be built; an artifact
with panels run where it cannot falls back to XLA's dot over the panels (correct, slower).

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
from qcompile.kernels.grouped_matmul import from_pair_order, swiglu_halves

NATIVE_F32 = "qcompile_linear_f32"
NATIVE_FP8 = "qcompile_linear_fp8"
NATIVE_MAX_ROWS = 48  # the kernel's row chunk; from 64 rows on XLA's packed GEMM is as fast or faster
NATIVE_PANELS = "qcompile_linear_panels_f32"
NATIVE_PANELS_BF16 = "qcompile_linear_panels_bf16"  # bf16 panels, widened a k block at a time inside the kernel
NATIVE_PANELS_BF16_PAIRS = "qcompile_linear_panels_bf16_pairs"  # bf16 activations and panels on VDPBF16PS (no AMX)
NATIVE_PANELS_AMX = "qcompile_linear_panels_amx"  # bf16 activations and panels on AMX tiles (prefill-sized)
NATIVE_PAIR_PANELS_AMX = "qcompile_linear_pair_panels_amx"  # ... panels in pair order, read in place
NATIVE_PAIR_PANELS_BF16 = "qcompile_linear_pair_panels_bf16"  # panels in pair order on VDPBF16PS (a few rows)
#: panels in pair order go to AMX from this many rows, below to VDPBF16PS (0.64 GB of the bench preset's dense products
#: from memory: 1 row 26.1 vs 27.8 ms, 3 rows 28.0 vs 28.8, 4 rows 30.0 vs 28.4; docs/cpu_rules.md "bf16 panels in
#: pair order on a CPU with AMX")
AMX_PAIR_MIN_ROWS = 4
NATIVE_PANELS_FP8 = "qcompile_linear_panels_fp8"  # FP8 panels dequantized a k block at a time inside the kernel
AMX_MIN_ROWS = 6  # from here on a bf16 product goes to AMX where the CPU has it (docs/cpu_rules.md, "AMX thresholds")
PANEL = 64  # output columns per panel of linear_panels' weight (the panel kernel's register tile width)


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


def pack_panels(w):
    """w[N, K] -> [N/PANEL, K, PANEL], the layout of linear_panels' weight (N a multiple of PANEL)."""
    n, k = w.shape
    return jnp.transpose(w.reshape(n // PANEL, PANEL, k), (0, 2, 1))


def linear_panels_xla(x, wp):
    """x · the panel-laid-out weight with XLA's dot (the reference rule's product at the CPU's default precision)."""
    p, k, c = wp.shape
    y = jnp.einsum("...k,pkc->...pc", x, wp, preferred_element_type=jnp.float32)
    return y.reshape(*x.shape[:-1], p * c).astype(x.dtype)


def fp8_panels_fit(x, wp) -> bool:
    """Whether `wp` is a deferred FP8 weight in panels [P, K, 64] the FP8 panel kernel takes with rows `x` in the
    weight's compute dtype (f32 or bf16): one scale across each panel's 64 columns (blocks [bp, bk, 64])."""
    return (isinstance(wp, QuantizedWeight) and x.dtype == wp.dtype and wp.dtype in (jnp.float32, jnp.bfloat16)
            and wp.values.ndim == 3 and wp.shape[2] == PANEL and wp.block[2] == PANEL)


def linear_panels_fp8_native(x, wp: QuantizedWeight, swiglu: bool = False):
    """The native panel kernel on FP8 panels (values [P, K, 64], scale [ceil(P/bp), ceil(K/bk), 1]): each k block of
    a panel dequantized into an L1-resident f32 block (for a bf16 weight each value rounded to bf16 as the reference's
    dequantize rounds it, the block as bf16 pairs on VDPBF16PS where the CPU has AVX512_BF16 and K is even — from 24
    rows an item the whole panel once, for tiles over all of K —, else the activations widened exactly; the f32
    result rounded once in the kernel); `swiglu`: the panels are [gate ; up] and the result SwiGLU's halves, computed
    in the kernel (for a bf16 weight as the reference's bf16 ops round them) when the halves are whole panels, after
    it otherwise; call only after `native.ensure(NATIVE_PANELS_FP8)`."""
    p, k, c = wp.shape
    rows = math.prod(x.shape[:-1])
    fused = swiglu and p % 2 == 0
    width = p * c // 2 if fused else p * c
    if rows == 0:
        return jnp.zeros((*x.shape[:-1], p * c // 2 if swiglu else p * c), x.dtype)
    bf16 = wp.dtype == jnp.bfloat16
    call = jax.ffi.ffi_call(NATIVE_PANELS_FP8, jax.ShapeDtypeStruct((rows, width), jnp.bfloat16 if bf16 else jnp.float32))
    pairs = bf16 and k % 2 == 0 and native.avx512_bf16()  # bf16 x on VDPBF16PS, as it is
    out = call(x.reshape(rows, k) if pairs else x.reshape(rows, k).astype(jnp.float32), wp.values,
               wp.scale.astype(jnp.float32).reshape(wp.scale.shape[:2]), block_p=wp.block[0], block_k=wp.block[1],
               bf16_weights=int(bf16), swiglu=int(fused))
    out = out.reshape(*x.shape[:-1], width).astype(x.dtype)
    return swiglu_halves(out) if swiglu and not fused else out


def linear_panels_cpu(x, wp, swiglu: bool = False, pair_order: bool = False):
    """The CPU rule of linear_panels: the native panel kernel at any row count — f32 panels, or a bf16 checkpoint's
    bf16 panels widened inside it (bf16 activations widened before, the f32 result rounded once after, as the
    reference's f32 accumulation is; from AMX_MIN_ROWS bf16 rows on, AMX tiles where the CPU has them; bf16
    activations and panels on VDPBF16PS pairs where the CPU has AVX512_BF16, an even K; FP8 panels dequantized a k
    block at a time, for f32 or bf16 activations) —, XLA's dot otherwise. `swiglu` (linear_panels' attr): the panels
    are [gate ; up] and the result SwiGLU's halves — in the kernel where it computes them as the reference does (f32
    panels; bf16 pairs and FP8, whose bf16 result rounds every op as the reference's bf16 ops) and the halves are
    whole panels (an even P), else after it. `pair_order`: bf16 panels in pair order (grouped_matmul.to_pair_order),
    read in place — by AMX tiles from AMX_PAIR_MIN_ROWS rows, by VDPBF16PS below (no interleaving: the order is its
    operand's) —, else put back in k order first (correct, slower)."""
    if pair_order:  # bf16 panels in pair order: read in place by AMX tiles, or by VDPBF16PS for a few rows
        p, k, c = wp.shape
        rows = math.prod(x.shape[:-1])
        bf16 = x.dtype == wp.dtype == jnp.bfloat16 and c == PANEL
        if rows == 0 and bf16:
            return jnp.zeros((*x.shape[:-1], p * c // (2 if swiglu else 1)), x.dtype)
        if (bf16 and rows >= AMX_PAIR_MIN_ROWS and k % 32 == 0 and native.amx_bf16()
                and native.ensure(NATIVE_PAIR_PANELS_AMX)):
            call = jax.ffi.ffi_call(NATIVE_PAIR_PANELS_AMX, jax.ShapeDtypeStruct((rows, p * c), jnp.float32))
            y = call(x.reshape(rows, k), wp).reshape(*x.shape[:-1], p * c).astype(x.dtype)
            return swiglu_halves(y) if swiglu else y
        if bf16 and k % 2 == 0 and native.avx512_bf16() and native.ensure(NATIVE_PAIR_PANELS_BF16):
            fuse = swiglu and p % 2 == 0  # a bf16 result (SwiGLU's halves too) from the kernel
            call = jax.ffi.ffi_call(NATIVE_PAIR_PANELS_BF16, jax.ShapeDtypeStruct(
                (rows, p * c // 2 if fuse else p * c), jnp.bfloat16))
            y = call(x.reshape(rows, k), wp, swiglu=int(fuse)).reshape(*x.shape[:-1], -1)
            return swiglu_halves(y) if swiglu and not fuse else y
        wp = from_pair_order(wp)
    if isinstance(wp, QuantizedWeight):
        if fp8_panels_fit(x, wp) and native.ensure(NATIVE_PANELS_FP8):
            return linear_panels_fp8_native(x, wp, swiglu)
        wp = wp.dequantize()
    p, k, c = wp.shape
    rows = math.prod(x.shape[:-1])
    fuse = swiglu and p % 2 == 0  # the halves are whole panels: gate panel j pairs with up panel P/2 + j
    width = p * c // 2 if fuse else p * c
    halves = swiglu_halves if swiglu else (lambda y: y)
    if (x.dtype == wp.dtype == jnp.bfloat16 and rows >= AMX_MIN_ROWS and k % 32 == 0 and c == PANEL
            and native.amx_bf16() and native.ensure(NATIVE_PANELS_AMX)):
        call = jax.ffi.ffi_call(NATIVE_PANELS_AMX, jax.ShapeDtypeStruct((rows, p * c), jnp.float32))
        return halves(call(x.reshape(rows, k), wp).reshape(*x.shape[:-1], p * c).astype(x.dtype))
    if (x.dtype == wp.dtype == jnp.bfloat16 and rows > 0 and k % 2 == 0 and c == PANEL and native.avx512_bf16()
            and native.ensure(NATIVE_PANELS_BF16_PAIRS)):  # a bf16 result (SwiGLU's halves too) from the kernel
        call = jax.ffi.ffi_call(NATIVE_PANELS_BF16_PAIRS, jax.ShapeDtypeStruct((rows, width), jnp.bfloat16))
        y = call(x.reshape(rows, k), wp, swiglu=int(fuse)).reshape(*x.shape[:-1], width)
        return y if fuse else halves(y)
    kernel = NATIVE_PANELS if wp.dtype == jnp.float32 else NATIVE_PANELS_BF16 if wp.dtype == jnp.bfloat16 else None
    if not (kernel is not None and x.dtype in (jnp.float32, jnp.bfloat16) and c == PANEL and rows > 0
            and native.ensure(kernel)):
        return halves(linear_panels_xla(x, wp))
    fused = fuse and kernel == NATIVE_PANELS and x.dtype == jnp.float32  # the f32 epilogue: an f32 graph's SwiGLU
    n = width if fused else p * c
    y = jax.ffi.ffi_call(kernel, jax.ShapeDtypeStruct((rows, n), jnp.float32))(
        x.reshape(rows, k).astype(jnp.float32), wp, swiglu=int(fused))
    y = y.reshape(*x.shape[:-1], n).astype(x.dtype)
    return y if fused else halves(y)


def greedy_cpu(logits):
    """argmax over the last axis (lowest index on ties; the first NaN where a row has one) as two reductions."""
    top = jnp.max(logits, axis=-1, keepdims=True)
    hit = (logits == top) | jnp.isnan(logits)
    index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return jnp.min(jnp.where(hit, index, logits.shape[-1]), axis=-1).astype(jnp.int32)
