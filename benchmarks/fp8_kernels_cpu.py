"""Time the CPU rules on FP8 weights (the native kernels that dequantize a slab at a time in cache) against the same
rules on f32 weights, at the bench preset's shapes.

Usage: python benchmarks/fp8_kernels_cpu.py [--tokens 1,8,32,128] [--repeats 30] [--block 128]

Routed experts (E=64, top-8, H=1024, I=256): grouped_matmul_swiglu_cpu over the fused [64, 1024, 512] weight, f32
(the native f32 kernel) vs FP8 in blocks of 1 × block × block (the native FP8 kernel); the down projection
[64, 256, 1024] likewise with grouped_matmul_cpu. Shared expert / attention-sized linear: linear_cpu over [1024, 1024]
f32 vs FP8 (the native kernels up to 48 rows; from 64 rows the FP8 weight is dequantized and XLA's dot runs). Each is
jitted, warmed up, timed as the minimum of --repeats runs (shared machine). GB/s = weight bytes the call reads (only
the routed experts' for a grouped matmul) ÷ time. The relative error of FP8 against f32 on the same dequantized
weights is printed too (the kernels must agree to f32 rounding).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from timing import best_ms

from qcompile.kernels import grouped_matmul as gm
from qcompile.kernels import linear as lin
from qcompile.kernels.fp8 import QuantizedWeight, dequantize

E, TOPK, H, I_ROUTED = 64, 8, 1024, 256


def quantized(w: np.ndarray, block: tuple[int, ...]):
    """(FP8 values, f32 block scale) with each block's largest magnitude at 448."""
    shape = w.shape
    split = [x for d, b in zip(shape, block) for x in (d // b, b)]
    peak = np.abs(w).reshape(split).max(axis=tuple(range(1, 2 * w.ndim, 2)))
    scale = (peak / 448.0).astype(np.float32)
    expanded = scale
    for axis, b in enumerate(block):
        expanded = np.repeat(expanded, b, axis=axis)
    return jnp.asarray((w / expanded).astype(ml_dtypes.float8_e4m3fn)), jnp.asarray(scale)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,8,32,128")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--block", type=int, default=128)
    args = ap.parse_args()
    b = args.block
    rng = np.random.default_rng(0)
    fused = (rng.standard_normal((E, H, 2 * I_ROUTED)) * 0.03).astype(np.float32)
    down = (rng.standard_normal((E, I_ROUTED, H)) * 0.03).astype(np.float32)
    dense = (rng.standard_normal((H, H)) * 0.03).astype(np.float32)
    weights = {}
    for name, w, block in (("fused", fused, (1, b, b)), ("down", down, (1, b, b)), ("dense", dense, (b, b))):
        values, scale = quantized(w, block)
        # the f32 kernels run on the same (dequantized) weights, so the outputs must agree to rounding
        weights[name] = (dequantize(values, scale, block, jnp.float32), values, scale, block)

    def fp8(name):
        _, values, scale, block = weights[name]
        return values, scale, block

    swiglu_f32 = jax.jit(gm.grouped_matmul_swiglu_cpu)
    swiglu_fp8 = jax.jit(lambda x, v, s, g: gm.grouped_matmul_swiglu_cpu(
        x, QuantizedWeight(v, s, fp8("fused")[2], jnp.float32), g))
    down_f32 = jax.jit(gm.grouped_matmul_cpu)
    down_fp8 = jax.jit(lambda x, v, s, g: gm.grouped_matmul_cpu(x, QuantizedWeight(v, s, fp8("down")[2], jnp.float32),
                                                                 g))
    dense_f32 = jax.jit(lin.linear_cpu)
    dense_fp8 = jax.jit(lambda x, v, s: lin.linear_cpu(x, QuantizedWeight(v, s, fp8("dense")[2], jnp.float32)))
    print(f"blocks of {b}; ms (weight GB/s); error = max |fp8 − f32| ÷ max |f32|")
    print("| tokens | routed gate+up f32 | FP8 | down f32 | FP8 | linear 1024² f32 | FP8 | max error |")
    print("|---|---|---|---|---|---|---|---|")
    for tokens in (int(t) for t in args.tokens.split(",")):
        ids = np.stack([rng.choice(E, TOPK, replace=False) for _ in range(tokens)])
        counts = np.bincount(ids.reshape(-1), minlength=E)
        groups = jnp.asarray(counts.astype(np.int32))
        hit = int((counts > 0).sum())
        rows = jnp.asarray(rng.standard_normal((tokens * TOPK, H)), jnp.float32)
        act = jnp.asarray(rng.standard_normal((tokens * TOPK, I_ROUTED)), jnp.float32)
        x = jnp.asarray(rng.standard_normal((tokens, H)), jnp.float32)
        cells, errors = [], []
        for f32_fn, fp8_fn, name, inputs, extra, bytes_f32 in (
                (swiglu_f32, swiglu_fp8, "fused", rows, (groups,), hit * H * 2 * I_ROUTED * 4),
                (down_f32, down_fp8, "down", act, (groups,), hit * I_ROUTED * H * 4),
                (dense_f32, dense_fp8, "dense", x, (), H * H * 4)):
            w32, values, scale, _ = weights[name]
            a = best_ms(f32_fn, inputs, w32, *extra, repeats=args.repeats)
            c = best_ms(fp8_fn, inputs, values, scale, *extra, repeats=args.repeats)
            ref = np.asarray(f32_fn(inputs, w32, *extra))
            got = np.asarray(fp8_fn(inputs, values, scale, *extra))
            errors.append(float(np.abs(got - ref).max() / np.abs(ref).max()))
            bytes_fp8 = bytes_f32 / 4 + scale.size * 4 * (hit / E if extra else 1)
            cells += [f"{a:.3f} ({bytes_f32 / a / 1e6:.1f})", f"{c:.3f} ({bytes_fp8 / c / 1e6:.1f})"]
        print(f"| {tokens} | " + " | ".join(cells) + f" | {max(errors):.1e} |")


if __name__ == "__main__":
    main()
