"""qcompile's native CPU kernels (qcompile/kernels/native.py): the f32 grouped-matmul custom call against a float64
NumPy oracle, the switch that turns it off, the fallback when it cannot be built, and artifacts that call it.

Oracle: a float64 per-group product. The kernel accumulates K ≤ 300 f32 products, so its relative error (max|Δ| /
max|oracle|) is a few 1e-7 (9e-7 measured); 1e-5 catches a wrong expert, a wrong row, a dropped k block or a
column tail left unwritten (all O(1)). Shapes are drawn to hit every code path of the C++: 64- and 16-column panels
and the scalar tail (Nout 1..200), row tiles of 1-6 rows and row chunks over 48 (groups up to 70 rows), k blocks
(K up to 300 with Nout up to 1024, so kc = 65536/Nout = 64 splits K), empty and negative groups (clipped to 0), groups
summing past N (clipped), padding rows (must come back 0) and N = 0.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
from pathlib import Path
import platform
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qcompile.kernels import gdn
from qcompile.kernels import grouped_matmul as gm
from qcompile.kernels import linear as lin
from qcompile.kernels import native
from qcompile.kernels import moe_routes as routes

REL = 1e-5
pytestmark = pytest.mark.skipif(not all(native.ensure(name) for name in native.KERNELS),
                                reason=f"native kernels unavailable: {native.status(gm.NATIVE_F32)}")


def oracle(rows, w, gs):
    r, wn = np.asarray(rows, np.float64), np.asarray(w, np.float64)
    want, start = np.zeros((r.shape[0], wn.shape[2])), 0
    for e, g in enumerate(np.asarray(gs)):
        g = min(max(int(g), 0), r.shape[0] - start)
        want[start:start + g] = r[start:start + g] @ wn[e]
        start += g
    return want, start


def draw_case(rng):
    n = int(rng.integers(0, 120))
    e = int(rng.integers(1, 10))
    k = int(rng.choice([1, 3, 16, 17, 100, 300]))
    nout = int(rng.choice([1, 5, 15, 16, 17, 63, 64, 65, 130, 200, 1024]))
    gs = rng.integers(-2, 75, e).astype(np.int32)
    gs[rng.random(e) < 0.3] = 0
    return (jnp.asarray(rng.standard_normal((n, k)), jnp.float32),
            jnp.asarray(rng.standard_normal((e, k, nout)), jnp.float32), jnp.asarray(gs))


@pytest.mark.parametrize("weights", ["f32", "bf16"])
def test_matches_float64_oracle_on_random_shapes(weights):
    """f32 weights, and a bf16 checkpoint's weights as they are (widened in registers for items of few rows, into an
    f32 slab for more: groups here reach 75 rows), against float64 products of the same (bf16-exact) values."""
    rng = np.random.default_rng(20261203)
    call = jax.jit(gm.grouped_matmul_native if weights == "f32"
                   else gm.grouped_matmul_bf16_native)
    for case in range(40):
        rows, w, gs = draw_case(rng)
        if weights == "bf16":
            w = w.astype(jnp.bfloat16)
        want, total = oracle(rows, w, gs)
        got = np.asarray(call(rows, w, gs))
        assert got.shape == want.shape and got.dtype == np.float32
        assert np.isfinite(got).all(), f"case {case}: unwritten output"
        if total:
            err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)
            assert err <= REL, f"case {case}: rows {rows.shape}, w {w.shape}, groups {np.asarray(gs)}: {err:.2e}"
        assert not got[total:].any(), f"case {case}: padding rows must be 0"


@pytest.mark.parametrize("weights", ["f32", "bf16", "bf16 pairs"])
@pytest.mark.parametrize("swiglu", [False, True])
def test_panels_match_float64_oracle_on_random_shapes(swiglu, weights):
    """Experts in column panels ([E, Nout/64, K, 64], the cpu layout), f32 or bf16 (widened in registers for one row
    tile, into an f32 panel for more): groups of 0-75 rows (row tiles of 1-6, several tiles and items per expert),
    negative groups and groups past N, padding rows; with SwiGLU (f32: the kernel's epilogue); bf16 rows with bf16
    panels on VDPBF16PS pairs where the CPU has them (K made even; the rule's bf16 result, SwiGLU in the kernel, bit
    for bit the reference's bf16 ops on the f32 products); into output buffers the call must write whole (XLA gives
    them uninitialised)."""
    if weights == "bf16 pairs" and not native.avx512_bf16():
        pytest.skip("this CPU has no AVX512_BF16 (VDPBF16PS)")
    rng = np.random.default_rng(20261206)
    pairs = jax.jit(lambda r, w, g: jax.ffi.ffi_call(gm.NATIVE_PANELS_BF16_PAIRS, jax.ShapeDtypeStruct(
        (r.shape[0], w.shape[1] * w.shape[3]), jnp.float32))(r, w, g))  # f32 out: the kernel before any rounding
    for case in range(16):
        rows, w, gs = draw_case(rng)
        if weights == "bf16 pairs":  # bf16 rows, K even
            rows = jnp.concatenate([rows, rows[:, :1]], axis=1) if rows.shape[1] % 2 else rows
            rows = rows.astype(jnp.bfloat16)
        p = int(rng.integers(1, 5)) * (2 if swiglu else 1)
        w = jnp.asarray(rng.standard_normal((w.shape[0], rows.shape[1], 64 * p)), jnp.float32)
        if weights != "f32":
            w = w.astype(jnp.bfloat16)
        panels = w.reshape(w.shape[0], w.shape[1], p, 64).transpose(0, 2, 1, 3)
        want, total = oracle(rows, w, gs)
        if swiglu:
            gate, up = want[:, :32 * p], want[:, 32 * p:]
            want = gate / (1 + np.exp(-gate)) * up
        if weights == "bf16 pairs":
            product = pairs(rows, panels, gs)
            got = np.asarray(product, np.float64)
            # the rule's bf16 result: rounded in the kernel, SwiGLU as the reference's bf16 ops round it
            assert_bf16_result(jax.jit(gm.grouped_matmul_panels_native, static_argnums=3)(rows, panels, gs, swiglu),
                               product, swiglu)
            if swiglu:
                got = got[:, :32 * p] / (1 + np.exp(-got[:, :32 * p])) * got[:, 32 * p:]
        else:
            got = np.asarray(jax.jit(gm.grouped_matmul_panels_native, static_argnums=3)(rows, panels, gs, swiglu))
        assert got.shape == want.shape and got.dtype == (np.float64 if weights == "bf16 pairs" else np.float32)
        assert np.isfinite(got).all(), f"case {case}: unwritten output"
        if total:
            err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)
            assert err <= REL, f"case {case}: rows {rows.shape}, panels {panels.shape}, groups {np.asarray(gs)}: {err:.2e}"
        assert not got[total:].any(), f"case {case}: padding rows must be 0"


@pytest.mark.skipif(not native.avx512_bf16(), reason="this CPU has no AVX512_BF16 (VDPBF16PS)")
def test_bf16_swiglu_epilogue_rounds_as_the_reference_at_every_gate_value():
    """The bf16 SwiGLU epilogue (native/bf16.h swiglu_bf16) against XLA's bf16 ops at every one of the 65536 bf16
    gate values — subnormals, ±0, ±inf, NaN, e^-g overflowing from g = -88.75 and the lanes past exp16's clamp at
    -88.5 — times up values of both signs, 0 and inf: K = 2 makes gate = rows[:, 0] and up = rows[:, 1] · w exactly.
    One rounding in place of the six (silu · up rounded once) differs in 3.4% of these values."""
    assert native.ensure(gm.NATIVE_SWIGLU_PANELS_BF16_PAIRS)
    gate = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(jnp.bfloat16)
    rows = jnp.asarray(np.stack([gate, np.ones_like(gate)], axis=1))
    up = np.linspace(-4, 4, 64).astype(np.float32)
    up[:4] = [0.0, -0.0, np.inf, 3e-39]
    w = np.zeros((1, 2, 2, 64), np.float32)
    w[0, 0, 0, :] = 1.0  # gate panel: row 0 → every column is the gate value
    w[0, 1, 1, :] = up  # up panel: row 1 (x = 1) → column c is up[c]
    w = jnp.asarray(w, jnp.bfloat16)
    gs = jnp.asarray([65536], jnp.int32)
    product = jax.ffi.ffi_call(gm.NATIVE_PANELS_BF16_PAIRS, jax.ShapeDtypeStruct((65536, 128), jnp.float32))(
        rows, w, gs)
    got = jax.ffi.ffi_call(gm.NATIVE_SWIGLU_PANELS_BF16_PAIRS, jax.ShapeDtypeStruct((65536, 64), jnp.bfloat16))(
        rows, w, gs)
    assert_bf16_result(got, product, swiglu=True)


def assert_bf16_result(got, product, swiglu: bool):
    """A kernel's bf16 result against the reference on its f32 `product`: rounded to bf16, then (swiglu) SwiGLU's
    halves as XLA computes them on bf16 — the same bits, NaN where the reference has NaN (its bits aside)."""
    want = product.astype(jnp.bfloat16)
    want = np.asarray(jax.jit(gm.swiglu_halves)(want) if swiglu else want)
    got = np.asarray(got)
    assert got.dtype == want.dtype == jnp.bfloat16 and got.shape == want.shape
    nan = np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
    np.testing.assert_array_equal(got.view(np.uint16)[~nan], want.view(np.uint16)[~nan])


@pytest.mark.parametrize("swiglu", [False, True])
def test_fp8_panels_equal_the_f32_panel_kernel_on_the_dequantized_weights(swiglu):
    """FP8 experts in panels ([E, P, K, 64] e4m3 values, block scales [E, ceil(P/bp), ceil(K/bk)]): each panel row
    dequantized in registers (through fp16) for one row tile, into an f32 panel for more. The result must equal the f32
    panel kernel's on the dequantized weights bit for bit (the same value, FP8 · scale rounded once, multiplied in the
    same order) — over every FP8 code (subnormals and zeros included), blocks of 1-3 panels and 1-128 rows cut
    unevenly, groups of 0-75 rows, padding rows; a NaN code poisons exactly its column of its expert's rows; a scale
    whose · 2^8 overflows takes the portable route and still equals; and against the float64 oracle. For a bf16 graph
    (each weight rounded to bf16 in the kernel) the f32 products equal the bf16 panel kernel's on the bf16
    dequantize, bit for bit, and with bf16 rows (bf16 pairs on VDPBF16PS: made in registers for one row tile, through
    a bf16 panel for more) the bf16 pair kernel's; its bf16 result (SwiGLU in the kernel) the reference's bf16 ops
    on those products, bit for bit."""
    import ml_dtypes

    from qcompile.kernels.fp8 import QuantizedWeight

    rng = np.random.default_rng(20261207)
    f32 = jax.jit(gm.grouped_matmul_panels_native, static_argnums=3)

    def fp8(rows, w, gs):  # QuantizedWeight is not a pytree: its arrays go in, its block stays static
        return jax.jit(lambda r, v, sc, g: gm.grouped_matmul_panels_fp8_native(
            r, QuantizedWeight(v, sc, w.block, jnp.float32), g, swiglu))(rows, w.values, w.scale, gs)

    for case in range(14):
        rows, w, gs = draw_case(rng)
        e, k = w.shape[0], rows.shape[1]
        p = int(rng.integers(1, 4)) * (2 if swiglu else 1)
        bp, bk = int(rng.integers(1, 4)), int(rng.choice([1, 7, 16, 128]))
        codes = rng.integers(0, 256, (e, p, k, 64)).astype(np.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0  # NaN codes only where a case asks for them
        scale = rng.uniform(0.5, 2.0, (e, -(-p // bp), -(-k // bk), 1)).astype(np.float32) / 64
        if case == 1:  # a NaN weight: expert 0, panel 0, row 0, column 5; expert 0 gets rows 0-2
            codes[0, 0, 0, 5] = 0xFF
            rows = jnp.asarray(rng.standard_normal((5, k)), jnp.float32)
            gs = jnp.asarray(np.array([3] + [0] * (e - 1), np.int32))
        if case == 2:  # scale · 2^8 overflows f32 (the portable route); small weights and rows keep results finite
            scale[0, 0, 0, 0] = np.float32(2.0 ** 120 * 1.5)
            codes[0, :bp, :bk] &= 0x87  # |value| < 2
            rows = rows * 1e-36
        values = jnp.asarray(codes.view(ml_dtypes.float8_e4m3fn))
        weight = QuantizedWeight(values, jnp.asarray(scale), (1, bp, bk, 64), jnp.float32)
        got = np.asarray(fp8(rows, weight, gs))
        want = np.asarray(f32(rows, weight.dequantize(), gs, swiglu))
        np.testing.assert_array_equal(got, want, err_msg=f"case {case}: bp {bp}, bk {bk}, groups {np.asarray(gs)}")
        # a bf16 graph's: each weight rounded to bf16 in the kernel = the bf16 panel kernel's products; its bf16
        # result (SwiGLU in the kernel) = the reference's bf16 SwiGLU on those products rounded
        shape = jax.ShapeDtypeStruct((rows.shape[0], 64 * p), jnp.float32)
        shape16 = jax.ShapeDtypeStruct((rows.shape[0], (32 if swiglu else 64) * p), jnp.bfloat16)
        entry = gm.NATIVE_SWIGLU_PANELS_FP8 if swiglu else gm.NATIVE_PANELS_FP8
        raw = jax.ffi.ffi_call(gm.NATIVE_PANELS_FP8, shape)(
            rows, values, jnp.asarray(scale[..., 0]), gs, block_p=bp, block_k=bk, bf16_weights=1)
        w16 = QuantizedWeight(values, jnp.asarray(scale), (1, bp, bk, 64), jnp.bfloat16).dequantize()
        ref16 = jax.ffi.ffi_call(gm.NATIVE_PANELS_BF16, shape)(rows, w16, gs)
        np.testing.assert_array_equal(np.asarray(raw), np.asarray(ref16), err_msg=f"bf16 case {case}")
        assert_bf16_result(jax.ffi.ffi_call(entry, shape16)(
            rows, values, jnp.asarray(scale[..., 0]), gs, block_p=bp, block_k=bk, bf16_weights=1), ref16, swiglu)
        if native.avx512_bf16() and k % 2 == 0:  # bf16 rows: bf16 pairs (made in registers for a group of one
            # row tile, through a bf16 panel for more) = the bf16 pair kernel on the bf16 dequantize
            rows16 = rows.astype(jnp.bfloat16)
            got16 = jax.ffi.ffi_call(gm.NATIVE_PANELS_FP8, shape)(
                rows16, values, jnp.asarray(scale[..., 0]), gs, block_p=bp, block_k=bk, bf16_weights=1)
            pairs16 = jax.ffi.ffi_call(gm.NATIVE_PANELS_BF16_PAIRS, shape)(rows16, w16, gs)
            np.testing.assert_array_equal(np.asarray(got16), np.asarray(pairs16), err_msg=f"pairs case {case}")
            assert_bf16_result(jax.ffi.ffi_call(entry, shape16)(
                rows16, values, jnp.asarray(scale[..., 0]), gs, block_p=bp, block_k=bk, bf16_weights=1), pairs16,
                swiglu)
        _, total = oracle(rows, np.zeros((e, k, 1)), gs)
        assert not got[total:].any(), f"case {case}: padding rows must be 0"
        if case == 1:
            rows_hit, cols_hit = np.nonzero(np.isnan(got))
            assert set(rows_hit.tolist()) == {0, 1, 2} and set(cols_hit.tolist()) == {5}
            continue
        dense = np.asarray(weight.dequantize(), np.float64).transpose(0, 2, 1, 3).reshape(e, k, 64 * p)
        oracle_out, _ = oracle(rows, dense, gs)
        if swiglu:
            gate, up = oracle_out[:, :32 * p], oracle_out[:, 32 * p:]
            oracle_out = gate / (1 + np.exp(-gate)) * up
        if total:
            err = np.abs(got - oracle_out).max() / max(np.abs(oracle_out).max(), 1e-30)
            assert err <= REL, f"case {case}: {err:.2e}"


def test_linear_fp8_panels_equal_the_f32_panel_kernel_on_the_dequantized_weights():
    """Dense FP8 weights in panels ([P, K, 64] e4m3, scales [ceil(P/bp), ceil(K/bk)]), each k block of a panel
    dequantized into an f32 block: equal bit for bit to the f32 panel kernel on the dequantized panels at 1-130 rows
    (row tiles, row chunks past 48), K across the kernel's 64-row k blocks with tails, scale blocks of 1-3 panels and
    1-128 rows cut unevenly, every FP8 code but NaN; a NaN code poisons its column only; and the float64 oracle.
    bf16 (each weight rounded to bf16 in the kernel): equal to the bf16 panel kernel on the bf16 dequantize, and with
    bf16 activations (the block as bf16 pairs on VDPBF16PS; from 24 rows the whole panel, in items of up to 384 rows
    — 400 rows: one of 384 and one of 16) to the bf16 pair kernel."""
    import ml_dtypes

    from qcompile.kernels.fp8 import QuantizedWeight

    rng = np.random.default_rng(20261208)
    f32 = jax.jit(lin.linear_panels_cpu)
    for case, (t, k, p) in enumerate([(1, 64, 1), (5, 65, 3), (7, 1, 2), (40, 300, 4), (49, 130, 5), (130, 63, 2),
                                      (6, 200, 3), (400, 130, 3)]):
        bp, bk = int(rng.integers(1, 4)), int(rng.choice([1, 7, 64, 128]))
        codes = rng.integers(0, 256, (p, k, 64)).astype(np.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0
        if case == 1:
            codes[1, 3, 9] = 0x7F
        scale = rng.uniform(0.5, 2.0, (-(-p // bp), -(-k // bk), 1)).astype(np.float32) / 64
        weight = QuantizedWeight(jnp.asarray(codes.view(ml_dtypes.float8_e4m3fn)), jnp.asarray(scale), (bp, bk, 64),
                                 jnp.float32)
        x = jnp.asarray(rng.standard_normal((t, k)), jnp.float32)
        got = np.asarray(jax.jit(lambda x, v, sc: lin.linear_panels_cpu(
            x, QuantizedWeight(v, sc, weight.block, jnp.float32)))(x, weight.values, weight.scale))
        want = np.asarray(f32(x, weight.dequantize()))
        np.testing.assert_array_equal(got, want, err_msg=f"x {x.shape}, {p} panels, blocks {bp} x {bk}")
        # a bf16 graph's: each weight rounded to bf16 in the kernel = the bf16 panel kernel on the bf16 dequantize
        fp8 = functools.partial(jax.ffi.ffi_call(lin.NATIVE_PANELS_FP8, jax.ShapeDtypeStruct((t, 64 * p), jnp.float32)),
                                block_p=bp, block_k=bk, bf16_weights=1, swiglu=0)
        raw = fp8(x, weight.values, jnp.asarray(scale[..., 0]))
        w16 = QuantizedWeight(weight.values, weight.scale, weight.block, jnp.bfloat16).dequantize()
        ref16 = jax.ffi.ffi_call(lin.NATIVE_PANELS_BF16, jax.ShapeDtypeStruct((t, 64 * p), jnp.float32))(
            x, w16, swiglu=0)
        np.testing.assert_array_equal(np.asarray(raw), np.asarray(ref16), err_msg=f"bf16 x {x.shape}")
        # the bf16 result: rounded once, or (p even: [gate ; up]) SwiGLU's halves as the reference's bf16 ops
        for swiglu in (False, True)[:1 + (p % 2 == 0)]:
            shape16 = jax.ShapeDtypeStruct((t, (32 if swiglu else 64) * p), jnp.bfloat16)
            assert_bf16_result(jax.ffi.ffi_call(lin.NATIVE_PANELS_FP8, shape16)(
                x, weight.values, jnp.asarray(scale[..., 0]), block_p=bp, block_k=bk, bf16_weights=1,
                swiglu=int(swiglu)), ref16, swiglu)
        if native.avx512_bf16() and k % 2 == 0:  # bf16 x: the block as bf16 pairs = the bf16 pair kernel's
            x16 = x.astype(jnp.bfloat16)
            raw = fp8(x16, weight.values, jnp.asarray(scale[..., 0]))
            ref16 = jax.ffi.ffi_call(lin.NATIVE_PANELS_BF16_PAIRS, jax.ShapeDtypeStruct((t, 64 * p), jnp.float32))(
                x16, w16, swiglu=0)
            np.testing.assert_array_equal(np.asarray(raw), np.asarray(ref16), err_msg=f"pairs x {x.shape}")
            for swiglu in (False, True)[:1 + (p % 2 == 0)]:
                shape16 = jax.ShapeDtypeStruct((t, (32 if swiglu else 64) * p), jnp.bfloat16)
                assert_bf16_result(jax.ffi.ffi_call(lin.NATIVE_PANELS_FP8, shape16)(
                    x16, weight.values, jnp.asarray(scale[..., 0]), block_p=bp, block_k=bk, bf16_weights=1,
                    swiglu=int(swiglu)), ref16, swiglu)
        if case == 1:
            assert set(np.nonzero(np.isnan(got))[1].tolist()) == {64 + 9}
            continue
        dense = np.asarray(weight.dequantize(), np.float64).transpose(1, 0, 2).reshape(k, 64 * p)
        oracle_out = np.asarray(x, np.float64) @ dense
        assert np.abs(got - oracle_out).max() <= REL * np.abs(oracle_out).max(), f"case {case}"


def test_bench_preset_shapes_and_the_cpu_rule_agree_with_the_jnp_rule():
    """The shapes the bench preset runs (E=64, top-8, K/Nout 1024/256 and 256/1024) at decode and prefill sizes,
    through `grouped_matmul_cpu` (which picks the native kernel for f32) against the jnp rule it replaces."""
    rng = np.random.default_rng(7)
    for tokens, (k, nout) in ((1, (1024, 256)), (32, (256, 1024)), (128, (1024, 256))):
        ids = np.stack([rng.choice(64, 8, replace=False) for _ in range(tokens)])
        gs = jnp.asarray(np.bincount(ids.reshape(-1), minlength=64).astype(np.int32))
        rows = jnp.asarray(rng.standard_normal((tokens * 8, k)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((64, k, nout)) / np.sqrt(k), jnp.float32)
        got, want = jax.jit(gm.grouped_matmul_cpu)(rows, w, gs), jax.jit(gm.grouped_matmul_jnp)(rows, w, gs)
        assert np.abs(np.asarray(got) - np.asarray(want)).max() <= REL * np.abs(np.asarray(want)).max()


def test_cpu_rule_lowers_to_the_f32_or_the_bf16_custom_call():
    rows, w, gs = jnp.ones((8, 16), jnp.float32), jnp.ones((4, 16, 8), jnp.float32), jnp.asarray([2, 2, 2, 2])
    assert gm.NATIVE_F32 in jax.jit(gm.grouped_matmul_cpu).lower(rows, w, gs).as_text()
    bf16 = jax.jit(gm.grouped_matmul_cpu).lower(rows.astype(jnp.bfloat16), w.astype(jnp.bfloat16), gs).as_text()
    assert gm.NATIVE_F32 not in bf16 and gm.NATIVE_BF16 in bf16  # a bf16 checkpoint's weights read as they are


def test_linear_matches_float64_oracle_on_random_shapes():
    """The few-row linear kernel (x[T,K]·w[N,K]ᵀ): row tiles of 1-6 rows split evenly and row chunks past 48, weight
    tiles of 1-4 rows and blocks of 16, k tails (K not a multiple of 16, K < 16), leading batch dims, T = N = 0 and
    K = 0. K ≤ 1100 f32 products: measured ≤ 3e-7 relative; 1e-5 catches a wrong row, a dropped k tail or a tile
    written to the wrong place."""
    rng = np.random.default_rng(20261204)
    call = jax.jit(lin.linear_native)
    shapes = [((1,), 1, 1), ((2, 3), 5, 7), ((48,), 1024, 33), ((32,), 17, 64), ((49,), 100, 18), ((100,), 31, 3),
              ((0,), 16, 8), ((4,), 16, 0), ((3,), 0, 5)]
    shapes += [((int(rng.integers(1, 60)),), int(rng.choice([1, 15, 16, 33, 256, 1100])), int(rng.integers(1, 70)))
               for _ in range(25)]
    for lead, k, n in shapes:
        x = jnp.asarray(rng.standard_normal((*lead, k)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((n, k)), jnp.float32)
        want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
        got = np.asarray(call(x, w))
        assert got.shape == want.shape and got.dtype == np.float32
        if want.size:
            err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)
            assert err <= REL, f"x {x.shape}, w {w.shape}: {err:.2e}"


@pytest.mark.parametrize("weights", ["f32", "bf16"])
def test_linear_panels_matches_float64_oracle_on_random_shapes(weights):
    """The panel kernel (x[T,K] · w[P,K,64] panels): row tiles of 1-6 rows split evenly, row chunks past 48, k blocks
    of 64 with tails (K = 1, 63, 65, 1100), one to many panels (runs of panels per work item), leading batch dims,
    T = 0 and K = 0. Sequential f32 sums over K ≤ 1100: measured ≤ 2e-6 relative to the largest output; 1e-5 catches
    a wrong panel, a dropped k block or a row tile written to the wrong place. bf16 panels (a bf16 checkpoint's): the
    same against the bf16-exact weights, read in place by one row tile, widened per k block for more. f32 [gate ; up]
    panels with SwiGLU in the epilogue (items over the gate panels, each paired with its up panel): the same bound on
    silu(gate) · up — a gate paired with the wrong up panel is far beyond it."""
    rng = np.random.default_rng(20261205)
    call = jax.jit(lin.linear_panels_cpu)
    swiglu_call = jax.jit(functools.partial(lin.linear_panels_cpu, swiglu=True))
    shapes = [((1,), 1, 1), ((2, 3), 65, 2), ((48,), 1024, 3), ((32,), 63, 16), ((49,), 100, 1), ((100,), 1100, 5),
              ((0,), 16, 2), ((4,), 0, 3)]
    shapes += [((int(rng.integers(1, 120)),), int(rng.choice([1, 15, 64, 65, 130, 700])), int(rng.integers(1, 40)))
               for _ in range(12)]
    for lead, k, panels in shapes:
        x = jnp.asarray(rng.standard_normal((*lead, k)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((panels * lin.PANEL, k)), jnp.float32 if weights == "f32" else jnp.bfloat16)
        want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
        got = np.asarray(call(x, lin.pack_panels(w)))
        assert got.shape == want.shape and got.dtype == np.float32
        if want.size:
            err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)
            assert err <= REL, f"x {x.shape}, {panels} panels: {err:.2e}"
        if weights == "f32" and panels % 2 == 0:  # [gate ; up]: SwiGLU in the kernel's epilogue, items over gates
            fused = np.asarray(swiglu_call(x, lin.pack_panels(w)))
            half = want.shape[-1] // 2
            ref = want[..., :half] / (1 + np.exp(-want[..., :half])) * want[..., half:]
            assert fused.shape == ref.shape and fused.dtype == np.float32
            if ref.size:
                err = np.abs(fused - ref).max() / max(np.abs(ref).max(), 1e-30)
                assert err <= REL, f"swiglu x {x.shape}, {panels} panels: {err:.2e}"


@pytest.mark.skipif(not native.avx512_bf16(), reason="this CPU has no AVX512_BF16 (VDPBF16PS)")
def test_linear_panels_bf16_pairs_match_float64_oracle():
    """VDPBF16PS tiles (bf16 activations and panels, K even): pairs of k summed into f32 accumulators, rows k and
    k + 1 interleaved in registers and put back in column order at the store — a column swapped between the two
    halves of a 128-bit lane, a dropped pair or a k block added twice is far beyond 1e-5; row tiles of 1-6, row
    chunks past 48, k blocks of 64 with tails below 24 rows an item and the whole K from 24, T = 0 and K = 0. Against float64 products of the same bf16 values
    (measured ≤ 7e-7)."""
    rng = np.random.default_rng(20261206)
    assert native.ensure(lin.NATIVE_PANELS_BF16_PAIRS)
    shapes = [(1, 64, 1), (7, 130, 3), (32, 1024, 4), (100, 1100, 2), (3, 2, 1), (49, 66, 10), (0, 4, 1), (5, 0, 1)]
    shapes += [(int(rng.integers(1, 120)), 2 * int(rng.integers(1, 400)), int(rng.integers(1, 12))) for _ in range(10)]
    for t, k, panels in shapes:
        x = jnp.asarray(rng.standard_normal((t, k)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((panels * lin.PANEL, k)), jnp.bfloat16)
        want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
        call = jax.ffi.ffi_call(lin.NATIVE_PANELS_BF16_PAIRS, jax.ShapeDtypeStruct((t, panels * lin.PANEL), jnp.float32))
        product = jax.jit(functools.partial(call, swiglu=0))(x, lin.pack_panels(w))
        got = np.asarray(product, np.float64)
        # the rule's bf16 result (rounded in the kernel), and [gate ; up] panels' SwiGLU as the reference rounds it;
        # from AMX_MIN_ROWS rows on a CPU with AMX tiles the rule multiplies there (its own sum order: its product)
        rule_product = product
        if t >= lin.AMX_MIN_ROWS and k % 32 == 0 and k and native.amx_bf16():
            rule_product = jax.ffi.ffi_call(lin.NATIVE_PANELS_AMX, jax.ShapeDtypeStruct(
                (t, panels * lin.PANEL), jnp.float32))(x, lin.pack_panels(w))
        for swiglu in (False, True)[:1 + (panels % 2 == 0)]:
            assert_bf16_result(jax.jit(functools.partial(lin.linear_panels_cpu, swiglu=swiglu))(
                x, lin.pack_panels(w)), rule_product, swiglu)
        assert np.isfinite(got).all(), f"x {x.shape}: unwritten output"
        if want.size and np.abs(want).max() > 0:
            err = np.abs(got - want).max() / np.abs(want).max()
            assert err <= REL, f"x {x.shape}, {panels} panels: {err:.2e}"
        else:
            assert not got.any()
    text = jax.jit(lin.linear_panels_cpu).lower(jnp.ones((4, 32), jnp.bfloat16),
                                                lin.pack_panels(jnp.ones((64, 32), jnp.bfloat16))).as_text()
    assert lin.NATIVE_PANELS_BF16_PAIRS in text  # 4 rows: below AMX's threshold, so pairs wherever AVX512_BF16 is


def test_linear_panels_rule_uses_the_kernel_at_every_row_count():
    w = lin.pack_panels(jnp.ones((128, 32), jnp.float32))
    text = lambda x, w: jax.jit(lin.linear_panels_cpu).lower(x, w).as_text()  # noqa: E731
    assert lin.NATIVE_PANELS in text(jnp.ones((2, 24, 32), jnp.float32), w)     # decode-sized
    assert lin.NATIVE_PANELS in text(jnp.ones((512, 32), jnp.float32), w)       # prefill-sized
    bf16 = text(jnp.ones((lin.AMX_MIN_ROWS - 1, 32), jnp.bfloat16), w.astype(jnp.bfloat16))  # below AMX's rows
    pairs = lin.NATIVE_PANELS_BF16_PAIRS if native.avx512_bf16() else lin.NATIVE_PANELS_BF16
    assert lin.NATIVE_PANELS not in bf16 and pairs in bf16
    widened = text(jnp.ones((lin.AMX_MIN_ROWS - 1, 32), jnp.float32), w.astype(jnp.bfloat16))  # f32 rows: widened
    assert lin.NATIVE_PANELS_BF16 in widened and lin.NATIVE_PANELS_BF16_PAIRS not in widened


def test_linear_rule_uses_the_kernel_for_few_f32_rows_only():
    w = jnp.ones((40, 32), jnp.float32)
    text = lambda x, w: jax.jit(lin.linear_cpu).lower(x, w).as_text()  # noqa: E731
    assert lin.NATIVE_F32 in text(jnp.ones((2, 24, 32), jnp.float32), w)      # 48 rows: decode-sized
    assert lin.NATIVE_F32 not in text(jnp.ones((49, 32), jnp.float32), w)     # prefill-sized: XLA's dot
    assert lin.NATIVE_F32 not in text(jnp.ones((8, 32), jnp.bfloat16), w.astype(jnp.bfloat16))


def gdn_oracle(q, k, v, g, beta, state, query_start, slots):
    """The delta rule token by token in float64, written from spec/model.md §3.5 (decay, write, then read)."""
    q, k, v, g, beta, st = (np.asarray(a, np.float64) for a in (q, k, v, g, beta, state))
    st = st.copy()
    out = np.zeros(v.shape)
    qs = np.asarray(query_start)
    for b, slot in enumerate(np.asarray(slots)):
        s = st[slot] if 0 <= slot < st.shape[0] else np.zeros(st.shape[1:])
        for t in range(qs[b], qs[b + 1]):
            s = s * np.exp(g[t])[:, None, None]
            delta = beta[t][:, None] * (v[t] - np.einsum("hkv,hk->hv", s, k[t]))
            s = s + k[t][:, :, None] * delta[:, None, :]
            out[t] = np.einsum("hkv,hk->hv", s, q[t])
        if 0 <= slot < st.shape[0]:
            st[slot] = s
    pad = slice(qs[-1], None)
    out[pad] = (np.sum(k[pad] * q[pad], -1) * beta[pad])[..., None] * v[pad]
    return out, st


def test_gdn_recurrence_matches_float64_oracle():
    """Decode (one token per sequence), prefill (chained tokens), mixed batches with empty sequences, padding token
    slots, an out-of-range slot (reads a zero state, writes nothing), untouched slots (kept bit-identical), dv not a
    multiple of 16. Measured ≤ 1e-6 relative; 1e-5 catches a missing decay, the read before the write, a wrong head or
    a state written to the wrong slot (all O(1))."""
    rng = np.random.default_rng(11)
    call = jax.jit(gdn.gdn_recurrent_native)
    cases = [  # (new tokens per sequence, T, slots, S)
        ([1, 1, 1], 4, [2, 0, 3], 5),
        ([5, 1, 0, 9], 16, [1, 4, 0, 2], 5),
        ([40], 40, [0], 1),
        ([2, 3], 8, [7, 1], 3),      # slot 7 is out of range
    ]
    for h, dk, dv in ((2, 8, 12), (8, 128, 128)):
        for new, num_tokens, slots, num_slots in cases:
            qs = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
            unit = lambda *shape: rng.standard_normal(shape) / np.sqrt(shape[-1])  # noqa: E731
            q, k = unit(num_tokens, h, dk), unit(num_tokens, h, dk)
            v = rng.standard_normal((num_tokens, h, dv))
            g, beta = -rng.uniform(0.01, 1.0, (num_tokens, h)), rng.uniform(0.1, 0.9, (num_tokens, h))
            state = rng.standard_normal((num_slots, h, dk, dv))
            args = [jnp.asarray(a, jnp.float32) for a in (q, k, v, g, beta, state)]
            args += [jnp.asarray(qs), jnp.asarray(np.array(slots, np.int32))]
            want_out, want_state = gdn_oracle(*args)
            got_out, got_state = (np.asarray(a) for a in call(*args))
            for got, want in ((got_out, want_out), (got_state, want_state)):
                err = np.abs(got - want).max() / np.abs(want).max()
                assert err <= REL, f"h={h} dk={dk} dv={dv} new={new}: {err:.2e}"
            untouched = sorted(set(range(num_slots)) - set(slots))
            assert np.array_equal(got_state[untouched], np.asarray(args[5])[untouched])


@pytest.mark.skipif(not native.ensure(gdn.NATIVE_BF16_STATE), reason="native kernels unavailable")
def test_gdn_recurrence_with_a_bf16_state_matches_the_oracle():
    """The bf16-state entry point: the oracle run from the stored (bf16) state in float64, the result rounded once
    per step (one token: rows rounded in place; several: the whole state once) — within bf16's half ulp. dv = 40:
    rows widened and rounded 16 values at a time in registers, and the last 8 one at a time; dv = 128: the
    fixed-width form (delta_rule.h's delta_rule_token_fixed, Sᵀk, Sᵀq and δ held in registers)."""
    import ml_dtypes

    rng = np.random.default_rng(12)
    call = jax.jit(gdn.gdn_recurrent_native)
    for (new, num_tokens, slots, num_slots), (dk, dv) in itertools.product(
            (([1, 1, 1], 4, [2, 0, 3], 5), ([5, 1, 0, 9], 16, [1, 4, 0, 2], 5), ([2, 3], 8, [7, 1], 3)),
            ((16, 40), (128, 128))):
        h = 2
        qs = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
        q, k = (rng.standard_normal((num_tokens, h, dk)) / 4 for _ in range(2))
        v = rng.standard_normal((num_tokens, h, dv))
        g, beta = -rng.uniform(0.01, 1.0, (num_tokens, h)), rng.uniform(0.1, 0.9, (num_tokens, h))
        state = jnp.asarray(rng.standard_normal((num_slots, h, dk, dv)), jnp.bfloat16)
        args = [jnp.asarray(a, jnp.float32) for a in (q, k, v, g, beta)]
        tail = [jnp.asarray(qs), jnp.asarray(np.array(slots, np.int32))]
        want_out, want_state = gdn_oracle(*args, state.astype(jnp.float32), *tail)
        got_out, got_state = call(*args, state, *tail)
        assert got_state.dtype == jnp.bfloat16
        assert np.abs(np.asarray(got_out) - want_out).max() / np.abs(want_out).max() <= 1e-5  # o from the f32 state
        got64 = np.asarray(got_state.astype(jnp.float32), np.float64)
        assert np.abs(got64 - want_state).max() / np.abs(want_state).max() <= 4e-3
        rounded = np.asarray(want_state, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
        assert np.mean(got64 == rounded) > 0.99  # rounded to nearest even, as XLA rounds


def test_bf16_state_rounding_equals_xlas_conversion_at_every_finite_value():
    """A decode token's bf16 state rows are rounded in registers (native/bf16.h narrow16: VCVTNEPS2BF16 where the CPU
    has it, the bit formula where not or for a vector with an f32 denormal lane). With k = 0 the new state is exactly
    round(e·S): every finite bf16 value of S times e = 0.75 — a third of the products are ties between two bf16
    values, some land below f32's normal range — against XLA's own multiply-and-convert on the same values, bit for
    bit (±0 alike: the kernel's e·S + 0·δ turns -0 into +0). Truncating, or rounding ties away from zero, fails."""
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    bits[(bits & 0x7F80) == 0x7F80] = 0  # inf and NaN would poison Sᵀk for their whole slot
    state = jnp.asarray(bits.view(jnp.bfloat16).reshape(4, 1, 128, 128))
    t = 4
    zeros = jnp.zeros((t, 1, 128), jnp.float32)
    g = jnp.full((t, 1), np.log(0.75), jnp.float32)
    decay = float(np.exp(np.float32(np.log(0.75))))
    assert decay == 0.75
    _, got = jax.jit(gdn.gdn_recurrent_native)(zeros, zeros, zeros, g, jnp.full((t, 1), 0.5, jnp.float32), state,
                                               jnp.arange(t + 1, dtype=jnp.int32), jnp.arange(t, dtype=jnp.int32))
    want = jax.jit(lambda s: (s.astype(jnp.float32) * decay).astype(jnp.bfloat16))(state)
    got, want = np.asarray(got).view(np.uint16).ravel(), np.asarray(want).view(np.uint16).ravel()
    zero = (want & 0x7FFF) == 0
    assert np.array_equal(got[~zero], want[~zero])
    assert not (got[zero] & 0x7FFF).any()
    assert zero.sum() < 1000  # the comparison is over the values, not over zeros


def test_gdn_rule_uses_the_kernel_and_updates_the_state_in_place():
    """The CPU rule lowers to the custom call with the new state aliasing the old (no state copy in the module)."""
    q = jnp.ones((4, 2, 8), jnp.float32)
    args = (q, q, jnp.ones((4, 2, 8)), jnp.zeros((4, 2)), jnp.ones((4, 2)), jnp.zeros((3, 2, 8, 8)),
            jnp.asarray([0, 1, 2, 3], jnp.int32), jnp.asarray([0, 1, 2], jnp.int32))
    text = jax.jit(gdn.gdn_recurrence_cpu, donate_argnums=5).lower(*args).as_text()
    assert gdn.NATIVE_F32 in text and "output_operand_aliases" in text


PROBE = """
import json, sys, jax, jax.numpy as jnp, numpy as np
from qcompile.kernels import grouped_matmul as gm, linear as lin, native
rows, w, gs = jnp.ones((8, 16), jnp.float32), jnp.ones((4, 16, 8), jnp.float32), jnp.asarray([2, 2, 2, 2])
text = jax.jit(gm.grouped_matmul_cpu).lower(rows, w, gs).as_text()
out = np.asarray(jax.jit(gm.grouped_matmul_cpu)(rows, w, gs))
dense = np.asarray(jax.jit(lin.linear_cpu)(rows, jnp.ones((5, 16), jnp.float32)))
native.ensure(gm.NATIVE_SWIGLU_F32)  # a second entry point of grouped_matmul_f32.cc: no second build
print(json.dumps({"custom_call": gm.NATIVE_F32 in text, "status": native.status(gm.NATIVE_F32),
                  "result_ok": bool(np.all(out == 16.0) and np.all(dense == 16.0))}))
"""


def _probe(env_changes, tmp_path):
    env = {**os.environ, **env_changes}
    run = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1]), run.stderr


def test_qcompile_native_off_uses_the_jnp_rule(tmp_path):
    got, _ = _probe({"QCOMPILE_NATIVE": "off"}, tmp_path)
    assert got == {"custom_call": False, "status": "disabled by QCOMPILE_NATIVE=off", "result_ok": True}


def test_without_a_compiler_it_says_so_once_and_falls_back(tmp_path):
    got, stderr = _probe({"PATH": str(tmp_path), "CXX": "", "QCOMPILE_NATIVE_DIR": str(tmp_path / "empty")}, tmp_path)
    assert got["custom_call"] is False and got["result_ok"] is True
    assert "no C++ compiler found" in got["status"]
    assert stderr.count("using the slower jnp rules") == 1  # one line for both kernels


def test_a_fresh_cache_builds_once_then_loads(tmp_path):
    cache = tmp_path / "native"
    first, stderr1 = _probe({"QCOMPILE_NATIVE_DIR": str(cache)}, tmp_path)
    second, stderr2 = _probe({"QCOMPILE_NATIVE_DIR": str(cache)}, tmp_path)
    assert first == second == {"custom_call": True, "status": "available", "result_ok": True}
    assert stderr1.count("building the native CPU kernels of") == 2 and "building" not in stderr2  # per source
    libs = list(cache.glob("*.so"))  # one library per source file, named by it
    sources = {Path(native.KERNELS[name][0]).stem for name in (gm.NATIVE_F32, lin.NATIVE_F32)}
    assert sorted(lib.name.split("-")[0] for lib in libs) == sorted(sources)
    assert not list(cache.glob(".*")), "no temporary file left behind"


def test_artifact_names_the_kernel_and_refuses_an_unknown_one(tmp_path):
    from qcompile.compiler.export import write_artifact
    from qcompile.errors import CheckpointError
    from qcompile.frontend.tiny import write_tiny
    from qcompile.ir.abi import CacheConfig
    from qcompile.runtime.artifact import MANIFEST, load_artifact
    from qcompile.runtime.model import load_model

    model = load_model(write_tiny(tmp_path / "ckpt", family="qwen3_next", seed=3), progress=False)
    cache = CacheConfig(max_seqs=1, max_context=32, max_step_tokens=4)
    out = tmp_path / "art"
    manifest = write_artifact(out, model.graph, model.params, config_json=model.checkpoint.config.to_json(),
                              cache=cache, target="cpu", progress=False)
    from qcompile.kernels.paged_attention import NATIVE_DECODE

    assert manifest["native_kernels"] == sorted([gm.NATIVE_F32, lin.NATIVE_F32, lin.NATIVE_PANELS, gdn.NATIVE_F32,
                                                 routes.NATIVE_DISPATCH, routes.NATIVE_COMBINE_F32, NATIVE_DECODE])
    want = model.engine(cache).generate([[5, 6, 7]], 3)["tokens"]
    assert load_artifact(out).engine().generate([[5, 6, 7]], 3)["tokens"] == want

    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    m = json.loads((bad / MANIFEST).read_text())
    m["native_kernels"] = ["qcompile_warp_drive"]
    from qcompile.runtime.artifact import DIGEST_KEY, manifest_digest

    (bad / MANIFEST).write_text(json.dumps({**m, DIGEST_KEY: manifest_digest(m)}))  # a forged, sealed manifest
    with pytest.raises(CheckpointError, match="names a kernel this qcompile does not have") as info:
        load_artifact(bad)
    assert info.value.exit_code == 65


def test_moe_dispatch_and_combine_across_work_items():
    """800 routes (7 copy items of 128 rows) and 100 tokens (7 combine items of 16) on XLA's threads, H = 72 (a tail
    past the 16-lane vectors): dispatch equals the stable argsort exactly, combine its reference within f32 rounding;
    a route to expert E (not on this device) is placed last and read back by combine like any other row."""
    import qcompile.ir.importer  # noqa: F401
    from qcompile.ir.ops.moe import MoeCombine, MoeDispatch
    from qcompile.ir.registry import lowering_rule

    rng = np.random.default_rng(11)
    tokens, top_k, experts, hidden = 100, 8, 16, 72
    ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
    ids[3, 2] = experts
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    op = MoeDispatch(experts)
    want = jax.jit(lambda x, i: lowering_rule(MoeDispatch, "reference")(op, x, i))(x, ids)
    got = jax.jit(lambda x, i: routes.dispatch_native(x, i, experts))(x, ids)
    for w, g in zip(want, got):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert int(np.asarray(got[2])[-1]) == 3 * top_k + 2 and int(np.sum(got[1])) == tokens * top_k - 1
    weights = rng.uniform(0.05, 1.0, (tokens, top_k)).astype(np.float32)
    ref = jax.jit(lambda r, o, w: lowering_rule(MoeCombine, "reference")(MoeCombine(), r, o, w))(got[0], got[2], weights)
    out = jax.jit(routes.combine_native)(got[0], got[2], weights)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=0, atol=REL * np.abs(np.asarray(ref)).max())
    np.testing.assert_allclose(np.asarray(out)[3], (weights[3, :, None] * x[3]).sum(0), rtol=1e-5, atol=1e-5)


def test_moe_combine_in_bf16_sums_f32_products_as_the_reference_runs():
    """bf16 rows and weights: f32 products summed over the k routes in f32 in route order and rounded once — equal, to
    the last bf16 bit, to moe_combine's reference rule as XLA CPU runs it (its excess-precision simplification
    removes the bf16 rounding of each product that the rule's jnp text spells; a kernel that kept that rounding
    differed in 2821 of 7200 outputs here and, in a deep bf16 model, flipped routes: tests/test_check_noise.py)."""
    import ml_dtypes

    import qcompile.ir.importer  # noqa: F401
    from qcompile.ir.ops.moe import MoeCombine
    from qcompile.ir.registry import lowering_rule

    rng = np.random.default_rng(5)
    tokens, top_k, hidden = 100, 8, 72
    rows = rng.standard_normal((tokens * top_k, hidden)).astype(ml_dtypes.bfloat16)
    order = rng.permutation(tokens * top_k).astype(np.int32)
    weights = rng.uniform(0.05, 1.0, (tokens, top_k)).astype(ml_dtypes.bfloat16)
    got = np.asarray(jax.jit(routes.combine_native)(rows, order, weights))
    assert got.dtype == ml_dtypes.bfloat16
    ref = jax.jit(lambda r, o, w: lowering_rule(MoeCombine, "reference")(MoeCombine(), r, o, w))(rows, order, weights)
    routed = rows.astype(np.float32)[np.argsort(order)].reshape(tokens, top_k, hidden)
    want = np.zeros((tokens, hidden), np.float32)
    for j in range(top_k):
        want = want + routed[:, j] * weights.astype(np.float32)[:, j, None]
    np.testing.assert_array_equal(got.astype(np.float32), want.astype(ml_dtypes.bfloat16).astype(np.float32))
    assert np.mean(got.astype(np.float32) != np.asarray(ref, np.float32)) < 0.01  # sum order only, if anything


amx = pytest.mark.skipif(not native.amx_bf16(), reason="this CPU has no AMX bf16 tiles (or the OS refuses them)")


@amx
@pytest.mark.parametrize("pair_order", [False, True])
def test_amx_linear_matches_float64_oracle_with_row_tails(pair_order):
    """bf16 activations and panels on AMX tiles, every row structure of the kernel — fewer than 16 rows (one
    zero-padded block that repacks as it goes), 16 (one streaming block of 16), 17-31 (16 + a padded tail), 32 and
    more (a streaming block of 32, then 32s, a 16, a padded tail) —, K = 32..1024 (multiples of 32), one to many
    panels, against float64 products of the same bf16 values. f32 accumulation over
    K ≤ 1024: ≤ 1e-5 relative before the result is rounded to bf16; a wrong VNNI pairing, a dropped k step or a tail
    row written from the padding would be off by far more. `pair_order`: the panels stored in pair order
    (to_pair_order), which the tiles read in place — read as if in k order they would be off by O(1)."""
    from qcompile.kernels import linear as lin

    rng = np.random.default_rng(31)
    name = lin.NATIVE_PAIR_PANELS_AMX if pair_order else lin.NATIVE_PANELS_AMX
    call = jax.jit(lambda x, w: jax.ffi.ffi_call(name, jax.ShapeDtypeStruct(
        (x.shape[0], w.shape[0] * w.shape[2]), jnp.float32))(x, gm.to_pair_order(w) if pair_order else w))
    assert native.ensure(name)
    for rows, k, panels in ((1, 64, 2), (7, 1024, 3), (15, 32, 1), (16, 96, 2), (23, 64, 1), (32, 32, 1), (37, 64, 2),
                            (48, 128, 2), (61, 96, 1), (100, 96, 3), (64, 1024, 16), (256, 256, 5), (300, 128, 1)):
        x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((panels * lin.PANEL, k)), jnp.bfloat16)
        want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
        got = np.asarray(call(x, lin.pack_panels(w)))
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err <= REL, f"{rows} rows, K {k}, {panels} panels: {err:.2e}"
    text = jax.jit(lin.linear_panels_cpu).lower(jnp.ones((32, 64), jnp.bfloat16),
                                                lin.pack_panels(jnp.ones((64, 64), jnp.bfloat16))).as_text()
    assert lin.NATIVE_PANELS_AMX in text  # the rule takes it from AMX_MIN_ROWS bf16 rows; fewer widen in registers
    text = jax.jit(lin.linear_panels_cpu).lower(jnp.ones((lin.AMX_MIN_ROWS - 1, 64), jnp.bfloat16),
                                                lin.pack_panels(jnp.ones((64, 64), jnp.bfloat16))).as_text()
    assert lin.NATIVE_PANELS_AMX not in text and lin.NATIVE_PANELS_BF16 in text


@amx
@pytest.mark.parametrize("layout", ["[E,K,Nout]", "panels", "pair panels"])
def test_amx_grouped_matmul_matches_float64_oracle(layout):
    """bf16 rows and experts on AMX tiles, the experts as [E, K, Nout], in panels [E, Nout/64, K, 64] (the cpu
    layout; each 64-column strip one contiguous panel) or in panels in pair order (read in place, no repacking):
    groups of 0-79 rows (every row structure of the linear's test; long ones in items of 256), negative and overlong
    group sizes clipped, rows past the groups 0. Bound as the linear's, on the f32 result; a panel read with another
    layout's stride or order would be off by O(1)."""
    panels = layout != "[E,K,Nout]"
    rng = np.random.default_rng(41)
    for case in range(8):
        experts, k, nout = int(rng.integers(1, 6)), int(rng.choice([32, 64, 96])), int(rng.choice([64, 128, 192]))
        n = 32 * experts + int(rng.integers(0, 50))
        gs = rng.integers(-2, 80, experts).astype(np.int32)
        rows = jnp.asarray(rng.standard_normal((n, k)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((experts, k, nout)), jnp.bfloat16)
        if layout == "pair panels":
            laid = gm.to_pair_order(w.reshape(experts, k, nout // gm.PANEL, gm.PANEL).transpose(0, 2, 1, 3))
            assert gm._amx_pair_panels(rows, laid)
            call = jax.ffi.ffi_call(gm.NATIVE_PAIR_PANELS_AMX, jax.ShapeDtypeStruct((n, nout), jnp.float32))
        elif panels:
            laid = w.reshape(experts, k, nout // gm.PANEL, gm.PANEL).transpose(0, 2, 1, 3)
            assert gm._amx_panels(rows, laid)
            call = jax.ffi.ffi_call(gm.NATIVE_PANELS_AMX, jax.ShapeDtypeStruct((n, nout), jnp.float32))
        else:
            laid = w
            assert gm._amx(rows, w)
            call = jax.ffi.ffi_call(gm.NATIVE_AMX, jax.ShapeDtypeStruct((n, nout), jnp.float32))
        got = np.asarray(jax.jit(call)(rows, laid, jnp.asarray(gs)), np.float64)
        want, total = oracle(rows, w, gs)
        if total:
            err = np.abs(got[:total] - want[:total]).max() / np.abs(want[:total]).max()
            assert err <= REL, f"case {case}: groups {gs}, K {k}, Nout {nout}: {err:.2e}"
        assert not got[total:].any(), f"case {case}: rows past the groups must be 0"


@amx
@pytest.mark.parametrize("swiglu", [False, True])
def test_bf16_grouped_matmul_rules_pick_amx_at_prefill(swiglu):
    """From AMX_MIN_ROWS_PER_EXPERT rows per expert on average (prefill) the bf16 rules run on AMX, below (decode) the
    bf16 FMA kernel on [E, K, Nout], the pair kernel on panels (VDPBF16PS: every AMX CPU has AVX512_BF16);
    SwiGLU rounds the product to bf16 and takes the halves as the reference does (an epilogue on the f32 products
    flipped routes in a deep bf16 model: tests/test_check_noise.py)."""
    w = jnp.ones((4, 64, 128), jnp.bfloat16)
    rule = gm.grouped_matmul_swiglu_cpu if swiglu else gm.grouped_matmul_cpu
    prefill = jax.jit(rule).lower(jnp.ones((128, 64), jnp.bfloat16), w, jnp.full((4,), 32, jnp.int32)).as_text()
    decode = jax.jit(rule).lower(jnp.ones((16, 64), jnp.bfloat16), w, jnp.full((4,), 4, jnp.int32)).as_text()
    assert gm.NATIVE_AMX in prefill and gm.NATIVE_BF16 not in prefill
    assert gm.NATIVE_AMX not in decode and gm.NATIVE_BF16 in decode
    panels = w.reshape(4, 64, 2, gm.PANEL).transpose(0, 2, 1, 3)
    rule = jax.jit(functools.partial(gm.grouped_matmul_panels_cpu, swiglu=swiglu))
    prefill = rule.lower(jnp.ones((128, 64), jnp.bfloat16), panels, jnp.full((4,), 32, jnp.int32)).as_text()
    decode = rule.lower(jnp.ones((16, 64), jnp.bfloat16), panels, jnp.full((4,), 4, jnp.int32)).as_text()
    pairs = gm.NATIVE_SWIGLU_PANELS_BF16_PAIRS if swiglu else gm.NATIVE_PANELS_BF16_PAIRS
    assert gm.NATIVE_PANELS_AMX in prefill and pairs not in prefill
    assert gm.NATIVE_PANELS_AMX not in decode and pairs in decode


def test_pair_order_round_trips_and_pairs_k():
    """to_pair_order puts the weights of k = 2i and 2i + 1 of a column side by side (flat 128·i + 2·c + k mod 2 within
    a panel); from_pair_order undoes it."""
    w = jnp.arange(3 * 2 * 8 * gm.PANEL, dtype=jnp.float32).reshape(3, 2, 8, gm.PANEL)
    paired = np.asarray(gm.to_pair_order(w)).reshape(3, 2, -1)
    flat = np.asarray(w)
    for k, c in ((0, 0), (1, 0), (2, 5), (7, 63)):
        assert paired[1, 1, 128 * (k // 2) + 2 * c + k % 2] == flat[1, 1, k, c]
    np.testing.assert_array_equal(np.asarray(gm.from_pair_order(gm.to_pair_order(w))), flat)


@pytest.mark.skipif(not native.avx512_bf16(), reason="this CPU has no AVX512_BF16")
@pytest.mark.parametrize("swiglu", [False, True])
def test_pair_order_vdpbf16ps_kernels_equal_the_k_order_ones(swiglu):
    """The VDPBF16PS kernels on panels in pair order (each 64-byte load already the instruction's operand) against the
    same kernels on the same panels in k order (interleaved in registers): the same products summed in the same
    order, so the same bits — dense (1-7 rows a tile, k blocks; many rows over all of K) and experts (groups of 0-9
    rows), bf16 results, SwiGLU's halves in the kernel. A pair read in the wrong order would differ at once."""
    from qcompile.kernels import linear as lin

    rng = np.random.default_rng(53)
    for rows, k, panels in ((1, 64, 2), (3, 1024, 4), (7, 130, 2), (30, 96, 2), (100, 256, 2)):
        x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
        w = lin.pack_panels(jnp.asarray(rng.standard_normal((panels * lin.PANEL, k)) / 8, jnp.bfloat16))
        width = panels * lin.PANEL // (2 if swiglu else 1)
        want = jax.ffi.ffi_call(lin.NATIVE_PANELS_BF16_PAIRS, jax.ShapeDtypeStruct((rows, width), jnp.bfloat16))(
            x, w, swiglu=int(swiglu))
        assert native.ensure(lin.NATIVE_PAIR_PANELS_BF16)
        got = jax.ffi.ffi_call(lin.NATIVE_PAIR_PANELS_BF16, jax.ShapeDtypeStruct((rows, width), jnp.bfloat16))(
            x, gm.to_pair_order(w), swiglu=int(swiglu))
        np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))
    experts, k = 5, 96
    gs = jnp.asarray([3, 0, 9, 1, 6], jnp.int32)
    rows = jnp.asarray(rng.standard_normal((24, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((experts, k, 256)) / 8, jnp.bfloat16).reshape(experts, k, 4, gm.PANEL)
    w = w.transpose(0, 2, 1, 3)
    k_order = gm.NATIVE_SWIGLU_PANELS_BF16_PAIRS if swiglu else gm.NATIVE_PANELS_BF16_PAIRS
    paired = gm.NATIVE_SWIGLU_PAIR_PANELS_BF16 if swiglu else gm.NATIVE_PAIR_PANELS_BF16
    assert native.ensure(k_order) and native.ensure(paired)
    shape = jax.ShapeDtypeStruct((24, 128 if swiglu else 256), jnp.bfloat16)
    want = np.asarray(jax.ffi.ffi_call(k_order, shape)(rows, w, gs))[:19]
    got = np.asarray(jax.ffi.ffi_call(paired, shape)(rows, gm.to_pair_order(w), gs))[:19]
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


@amx
@pytest.mark.parametrize("swiglu", [False, True])
def test_pair_order_rules_read_in_place_on_amx(swiglu):
    """Panels in pair order are read where they lie: VDPBF16PS for a few rows, AMX tiles from AMX_PAIR_MIN_ROWS rows
    (dense) or AMX_PAIR_MIN_ROWS_PER_EXPERT rows per expert — nothing is repacked —, and the rule's bf16 result
    equals the k-order reference on the same weights to the bf16 rounding (SwiGLU's halves after it, as the
    reference takes them)."""
    from qcompile.kernels import linear as lin

    rng = np.random.default_rng(47)
    w = jnp.asarray(rng.standard_normal((256, 96)) / 8, jnp.bfloat16)
    paired = gm.to_pair_order(lin.pack_panels(w))
    rule = jax.jit(functools.partial(lin.linear_panels_cpu, swiglu=swiglu, pair_order=True))
    for rows in (1, lin.AMX_PAIR_MIN_ROWS - 1, lin.AMX_PAIR_MIN_ROWS, 37):
        x = jnp.asarray(rng.standard_normal((rows, 96)), jnp.bfloat16)
        text = rule.lower(x, paired).as_text()
        amx_ = rows >= lin.AMX_PAIR_MIN_ROWS
        assert (lin.NATIVE_PAIR_PANELS_AMX in text) == amx_ and (lin.NATIVE_PAIR_PANELS_BF16 in text) != amx_
        got = np.asarray(rule(x, paired), np.float64)
        product = (np.asarray(x, np.float64) @ np.asarray(w, np.float64).T).astype(np.float32)
        ref = np.asarray(jnp.asarray(product).astype(jnp.bfloat16))
        ref = np.asarray(gm.swiglu_halves(jnp.asarray(ref)), np.float64) if swiglu else ref.astype(np.float64)
        assert np.abs(got - ref).max() <= 2 ** -7 * np.abs(ref).max(), rows
    experts = jnp.asarray(rng.standard_normal((4, 96, 128)) / 8, jnp.bfloat16)
    panels = experts.reshape(4, 96, 2, gm.PANEL).transpose(0, 2, 1, 3)
    gs = jnp.asarray([3, 0, 2, 1], jnp.int32)
    grouped = jax.jit(functools.partial(gm.grouped_matmul_panels_cpu, swiglu=swiglu, pair_order=True))
    for n in (8, 4 * gm.AMX_PAIR_MIN_ROWS_PER_EXPERT, 128):
        rows = jnp.asarray(rng.standard_normal((n, 96)), jnp.bfloat16)
        text = grouped.lower(rows, gm.to_pair_order(panels), gs).as_text()
        amx_ = n >= 4 * gm.AMX_PAIR_MIN_ROWS_PER_EXPERT
        pairs = gm.NATIVE_SWIGLU_PAIR_PANELS_BF16 if swiglu else gm.NATIVE_PAIR_PANELS_BF16
        assert (gm.NATIVE_PAIR_PANELS_AMX in text) == amx_ and (pairs in text) != amx_
        got = np.asarray(grouped(rows, gm.to_pair_order(panels), gs), np.float64)[:6]
        want = np.asarray(gm.grouped_matmul_panels_reference(rows, panels, gs, swiglu), np.float64)[:6]
        assert np.abs(got - want).max() <= 2 ** -7 * np.abs(want).max(), n


@amx
@pytest.mark.parametrize("swiglu", [False, True])
def test_bf16_expert_panels_rule_on_amx_matches_the_reference(swiglu):
    """The panel rule at prefill-sized rows on AMX (the f32 product rounded once to bf16, then SwiGLU's halves)
    against the reference rule on the same panels: the same bf16 rounding points, so equal to ~1 bf16 ulp."""
    rng = np.random.default_rng(43)
    experts, k, nout = 4, 96, 256
    gs = jnp.asarray([40, 0, 57, 31], jnp.int32)
    rows = jnp.asarray(rng.standard_normal((136, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((experts, k, nout)) / 8, jnp.bfloat16)
    panels = w.reshape(experts, k, nout // gm.PANEL, gm.PANEL).transpose(0, 2, 1, 3)
    text = jax.jit(functools.partial(gm.grouped_matmul_panels_cpu, swiglu=swiglu)).lower(rows, panels, gs).as_text()
    assert gm.NATIVE_PANELS_AMX in text
    got = np.asarray(gm.grouped_matmul_panels_cpu(rows, panels, gs, swiglu), np.float64)[:128]
    want = np.asarray(gm.grouped_matmul_panels_reference(rows, panels, gs, swiglu), np.float64)[:128]
    assert np.abs(want).max() > 0.5
    assert np.abs(got - want).max() <= 2 ** -7 * np.abs(want).max()
    assert np.mean(got != want) < 0.05  # sum order only, if anything


def test_kv_cache_write_and_gather_match_jnp_on_edge_indices():
    """The bf16 cache-row kernels (cache_rows.cc) under the KV write and attention's page reads, against jnp's own
    scatter and gather, bit for bit, where the index rules bite: empty sequences, padding tokens past
    query_start[B], positions past the page table (clipped to its last column), negative pages (counted from the
    end), pages past P (a write drops them, a gather clamps them)."""
    from qcompile.kernels import cache_rows as rows_
    from qcompile.kernels import paged_attention as pa

    rng = np.random.default_rng(3)
    num_pages, ps, hkv, hd = 11, 4, 2, 8
    pages = jnp.asarray(rng.standard_normal((num_pages, ps, hkv, hd)), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((12, hkv, hd)), jnp.bfloat16)
    query_start = jnp.asarray([0, 3, 3, 7, 10], jnp.int32)  # sequence 1 is empty; tokens 10, 11 are padding
    positions = jnp.asarray([0, 5, 13, 2, 3, 4, 30, 1, 6, 9, 0, 1], jnp.int32)
    page_table = jnp.asarray([[2, 5, 9], [0, 1, 3], [-1, 4, 11], [7, 40, -2]], jnp.int32)
    want = np.asarray(jax.jit(pa.kv_cache_write_reference)(pages, kv, positions, query_start, page_table))
    got = np.asarray(jax.jit(pa.kv_cache_write_cpu, donate_argnums=0)(jnp.array(pages), kv, positions, query_start,
                                                                        page_table))
    assert not np.array_equal(want, np.asarray(pages))
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    hlo = jax.jit(pa.kv_cache_write_cpu, donate_argnums=0).lower(pages, kv, positions, query_start,
                                                                 page_table).as_text()
    assert rows_.NATIVE_SCATTER in hlo and "output_operand_aliases" in hlo

    ids = jnp.asarray([[0, 10], [-1, 3], [11, -12], [25, 4]], jnp.int32)
    got = np.asarray(jax.jit(rows_.page_reader(pages))(ids))
    want = np.asarray(pages[ids].reshape(4, 2 * ps, hkv, hd).astype(jnp.float32))
    np.testing.assert_array_equal(got, want)
    assert rows_.NATIVE_GATHER in jax.jit(rows_.page_reader(pages)).lower(ids).as_text()


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("hd, group", [(20, 3), (128, 3), (64, 7), (128, 16)])
def test_paged_decode_attention_matches_the_jnp_blocks(dtype, hd, group):
    """The native decode attention (paged_attention_f32.cc) against the jnp rule's online-softmax blocks: rows at
    different positions (one past the page table's keys, one that sees none, blocks that end after 1, 7 and 16 of
    their keys), keys in several 32-key blocks, a negative page id and one past P; a head size that is not a multiple
    of 16 (the row-at-a-time path) and multiples of 64 (the row-group path: groups of 4 rows, then 3; 16 rows, as
    Qwen3.5's 32 query heads over 2 KV heads)."""
    import ml_dtypes

    from qcompile.kernels import cache_rows as rows_
    from qcompile.kernels import paged_attention as pa

    rng = np.random.default_rng(7)
    items, kv_heads, ps, per_seq, num_pages = 5, 2, 4, 20, 30
    np_dtype = np.float32 if dtype == "f32" else ml_dtypes.bfloat16
    k_pages = jnp.asarray(rng.standard_normal((num_pages, ps, kv_heads, hd)).astype(np_dtype))
    v_pages = jnp.asarray(rng.standard_normal((num_pages, ps, kv_heads, hd)).astype(np_dtype))
    qi = jnp.asarray(rng.standard_normal((items, kv_heads, group, hd)), jnp.float32)
    item_pages = jnp.asarray(rng.integers(0, num_pages, (items, per_seq)), jnp.int32)
    item_pages = item_pages.at[1, 0].set(-3).at[2, 5].set(num_pages + 4)
    row_pos = np.array([[0, 5, 2], [33, 70, 79], [100, 50, -1], [-1, -1, -1], [79, 200, 15]])
    row_pos = jnp.asarray(np.stack([np.resize(r, group) for r in row_pos]), jnp.int32)
    blocks = -(-per_seq // 8)
    want = pa._flash_blocks(qi, row_pos, item_pages, rows_.page_reader(k_pages), rows_.page_reader(v_pages),
                            jnp.int32(blocks), 8, ps)
    got = jax.jit(pa._decode_native)(qi, row_pos, item_pages, k_pages, v_pages)
    assert pa.NATIVE_DECODE in jax.jit(pa._decode_native).lower(qi, row_pos, item_pages, k_pages, v_pages).as_text()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(got)[3]) and np.any(np.asarray(got)[0])


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_paged_attention_kernel_on_prefill_tiles_matches_the_jnp_blocks(dtype):
    """Items of many rows (a prefill tile's tokens times the GQA group: the kernel's register-tiled path): rows at
    consecutive positions as a causal tile has them, rows past the sequence (-1: no key), a tile whose rows see only
    part of the last block, head sizes past 64 that are not multiples of 16 (80: one 64-column pass and a scalar tail;
    20: the tail only), keys over several 32-key blocks through shuffled pages."""
    import ml_dtypes

    from qcompile.kernels import cache_rows as rows_
    from qcompile.kernels import paged_attention as pa

    rng = np.random.default_rng(8)
    np_dtype = np.float32 if dtype == "f32" else ml_dtypes.bfloat16
    for hd, rows in ((80, 48), (20, 33), (128, 64)):  # (items of 32 rows or more take the tiled path)
        items, kv_heads, ps, per_seq, num_pages = 4, 2, 8, 16, 70
        k_pages = jnp.asarray(rng.standard_normal((num_pages, ps, kv_heads, hd)).astype(np_dtype))
        v_pages = jnp.asarray(rng.standard_normal((num_pages, ps, kv_heads, hd)).astype(np_dtype))
        qi = jnp.asarray(rng.standard_normal((items, kv_heads, rows, hd)) * hd**-0.5, jnp.float32)
        item_pages = jnp.asarray(rng.permutation(num_pages)[:items * per_seq].reshape(items, per_seq), jnp.int32)
        start = np.array([0, 37, 100, 5])
        row_pos = start[:, None] + np.arange(rows)[None, :] // 3  # three rows a token: a group of 3
        row_pos[3, rows // 2:] = -1  # the tile runs past its sequence's last token
        row_pos = jnp.asarray(row_pos, jnp.int32)
        want = pa._flash_blocks(qi, row_pos, item_pages, rows_.page_reader(k_pages), rows_.page_reader(v_pages),
                                jnp.int32(per_seq // 4), 4, ps)
        got = np.asarray(jax.jit(pa._decode_native)(qi, row_pos, item_pages, k_pages, v_pages))
        np.testing.assert_allclose(got, np.asarray(want), rtol=2e-5, atol=2e-5, err_msg=f"hd {hd}, rows {rows}")
        assert not got[3, :, rows // 2:].any() and got[3, :, :rows // 2].any()


@pytest.mark.skipif(platform.machine() != "x86_64", reason="AVX512_BF16 is an x86-64 extension")
def test_bf16_pairs_need_the_cpu_flag_and_a_compiler_that_enables_it(monkeypatch, tmp_path):
    """The pair kernels run only where /proc/cpuinfo lists avx512_bf16 and the C++ compiler's -march=native defines
    __AVX512BF16__ (else the kernels are built without the instruction and would refuse every call)."""
    fake = tmp_path / "c++"
    monkeypatch.setattr(native, "_compiler", lambda: str(fake))
    for flags, macros, want in (({"avx512_bf16"}, "#define __AVX512F__ 1", False),
                                ({"avx512_bf16"}, "#define __AVX512BF16__ 1", True),
                                (set(), "#define __AVX512BF16__ 1", False)):
        fake.write_text(f"#!/bin/sh\necho '{macros}'\n")
        fake.chmod(0o755)
        monkeypatch.setattr(native, "_pairs", [])
        monkeypatch.setattr(native, "_cpu_flags", lambda flags=flags: flags)
        assert native.avx512_bf16() is want, (flags, macros)
