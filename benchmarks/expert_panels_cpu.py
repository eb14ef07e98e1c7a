"""The routed experts of one decode step of the bench preset, f32, in the two layouts the native kernel reads:
[E, K, Nout] (the checkpoint's, transposed) and column panels [E, Nout/64, K, 64] (the cpu target's layout,
ir/target_layout.py). Eight layers of grouped_matmul_swiglu (K 1024 -> 2 x 256) and grouped_matmul (256 -> 1024)
over 64 experts, top-8 routing of TOKENS tokens (random, fixed seed); each layer's weights distinct (1.6 GB at 32
tokens: nothing stays in the caches between layers, as in a step).

Run: python benchmarks/expert_panels_cpu.py [--tokens 1,8,32,128] [--rounds 15] [--dtype f32|bf16|fp8]
(bf16: a bf16 checkpoint's experts, rows bf16, as the bf16 rules take them without AMX: the product rounded to bf16,
then SwiGLU's halves; where the CPU has AVX512_BF16, also the panels in pair order through their rule (the layout on
a CPU with AMX; measured without AMX too: docs/cpu_rules.md "Pair order without AMX").
fp8: the experts FP8 in Qwen's 128 x 128 blocks, rows f32: the FP8 kernel on [E, K, Nout]
(a slab dequantized into a buffer), the FP8 panel kernel (each panel row dequantized in registers), and beside them
the f32 panel kernel on the same weights dequantized, whose result the FP8 panels must equal bit for bit).
The layouts are timed alternately in one process (the machine's speed drifts between runs); prints min and median
ms per step and GB/s of the routed experts' weights at the median. Results in docs/cpu_rules.md, "Experts in column
panels"."""
from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from qcompile.kernels import grouped_matmul as gm
from qcompile.kernels import native

LAYERS, E, K, I, TOPK = 8, 64, 1024, 256, 8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,8,32,128")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16", "fp8"])
    args = ap.parse_args()
    if args.dtype == "fp8":
        return fp8_main(args)
    dtype = jnp.float32 if args.dtype == "f32" else jnp.bfloat16
    for name in (gm.NATIVE_F32, gm.NATIVE_SWIGLU_F32, gm.NATIVE_PANELS_F32, gm.NATIVE_SWIGLU_PANELS_F32,
                 gm.NATIVE_BF16, gm.NATIVE_PANELS_BF16):
        assert native.ensure(name), native.status(name)
    rng = np.random.default_rng(0)
    gate_up = [jnp.asarray(rng.standard_normal((E, K, 2 * I), np.float32) * 0.03, dtype) for _ in range(LAYERS)]
    down = [jnp.asarray(rng.standard_normal((E, I, K), np.float32) * 0.03, dtype) for _ in range(LAYERS)]
    itemsize = 4 if args.dtype == "f32" else 2

    def swiglu_plain(x, w, sizes):
        if args.dtype == "f32":
            return gm.grouped_matmul_swiglu_native(x, w, sizes)
        return gm.swiglu_halves(gm.grouped_matmul_bf16_native(x, w, sizes))

    def down_plain(x, w, sizes):
        if args.dtype == "f32":
            return gm.grouped_matmul_native(x, w, sizes)
        return gm.grouped_matmul_bf16_native(x, w, sizes)

    def panels(w):
        return w.reshape(w.shape[0], w.shape[1], -1, gm.PANEL).transpose(0, 2, 1, 3)

    weights = {"[E,K,Nout]": (gate_up, down), "panels": ([panels(w) for w in gate_up], [panels(w) for w in down])}

    @jax.jit
    def plain(x, wgu, wd, sizes):
        for layer in range(LAYERS):
            h = swiglu_plain(x, wgu[layer], sizes[layer])
            x = x + down_plain(h, wd[layer], sizes[layer]) * 0.01
        return x

    @jax.jit
    def paneled(x, wgu, wd, sizes):
        for layer in range(LAYERS):
            h = gm.grouped_matmul_panels_native(x, wgu[layer], sizes[layer], True)
            x = x + gm.grouped_matmul_panels_native(h, wd[layer], sizes[layer], False) * 0.01
        return x

    steps = {"[E,K,Nout]": plain, "panels": paneled}
    if args.dtype == "bf16" and native.avx512_bf16():  # the layout bf16 experts get there (ir/target_layout.py)
        @jax.jit
        def pair_order(x, wgu, wd, sizes):
            for layer in range(LAYERS):
                h = gm.grouped_matmul_panels_cpu(x, wgu[layer], sizes[layer], True, pair_order=True)
                x = x + gm.grouped_matmul_panels_cpu(h, wd[layer], sizes[layer], False, pair_order=True) * 0.01
            return x

        weights["pair order"] = tuple([gm.to_pair_order(w) for w in ws] for ws in weights["panels"])
        steps["pair order"] = pair_order
    tol = 1e-5 if args.dtype == "f32" else 1e-2
    run(args, rng, {name: (fn, weights[name], itemsize) for name, fn in steps.items()}, dtype, lambda a, b: np.abs(a - b).max() <= tol * np.abs(a).max())


def run(args, rng, steps: dict, dtype, agree) -> None:
    """Per token count: route, check the steps agree (`agree` on the first two outputs), time them alternately."""
    for tokens in map(int, args.tokens.split(",")):
        sizes = [jnp.asarray(np.bincount(np.stack([rng.choice(E, TOPK, replace=False) for _ in range(tokens)]).ravel(),
                                         minlength=E).astype(np.int32)) for _ in range(LAYERS)]
        x = jnp.asarray(rng.standard_normal((tokens * TOPK, K), np.float32), dtype)
        outs = [np.asarray(fn(x, *w, sizes), np.float64) for fn, w, _ in steps.values()]
        assert agree(*outs[:2]), "the layouts disagree"
        times: dict[str, list[float]] = {name: [] for name in steps}
        for _ in range(args.rounds):
            for name, (fn, w, _) in steps.items():
                for _ in range(2):
                    t = time.perf_counter()
                    fn(x, *w, sizes).block_until_ready()
                    times[name].append(time.perf_counter() - t)
        hit = sum(int((s > 0).sum()) for s in sizes)
        for name, t in times.items():
            gb = hit * (K * 2 * I + I * K) * steps[name][2] / 1e9
            ms = np.array(t) * 1e3
            print(f"tokens {tokens:4d}  {name:15s} min {ms.min():7.2f}  median {np.median(ms):7.2f} ms  "
                  f"{gb / np.median(ms) * 1e3:5.1f} GB/s ({gb:.2f} GB of routed experts)")


def fp8_main(args) -> None:
    """--dtype fp8 (module docstring)."""
    import ml_dtypes

    from qcompile.kernels.fp8 import QuantizedWeight

    for name in (gm.NATIVE_FP8, gm.NATIVE_SWIGLU_FP8, gm.NATIVE_PANELS_FP8, gm.NATIVE_SWIGLU_PANELS_FP8,
                 gm.NATIVE_PANELS_F32, gm.NATIVE_SWIGLU_PANELS_F32):
        assert native.ensure(name), native.status(name)
    rng = np.random.default_rng(0)

    def quantized(shape):  # Qwen's format: 128 x 128 blocks of each expert, each block's peak at 448
        w = rng.standard_normal(shape, np.float32) * 0.03
        blocks = w.reshape(shape[0], shape[1] // 128, 128, shape[2] // 128, 128)
        scale = (np.abs(blocks).max(axis=(2, 4)) / 448.0).astype(np.float32)
        values = (blocks / scale[:, :, None, :, None]).reshape(shape).astype(ml_dtypes.float8_e4m3fn)
        return QuantizedWeight(jnp.asarray(values), jnp.asarray(scale), (1, 128, 128), jnp.float32)

    def panels(q):  # what ir/fp8_layout.py makes of the panel layout: values [E,P,K,64], scales [E,P/2,K/128,1]
        e, k, n = q.shape
        values = q.values.reshape(e, k, n // gm.PANEL, gm.PANEL).transpose(0, 2, 1, 3)
        scale = q.scale.transpose(0, 2, 1)[..., None]
        return QuantizedWeight(values, scale, (1, 128 // gm.PANEL, 128, gm.PANEL), jnp.float32)

    gate_up = [quantized((E, K, 2 * I)) for _ in range(LAYERS)]
    down = [quantized((E, I, K)) for _ in range(LAYERS)]
    gate_up_p, down_p = [panels(q) for q in gate_up], [panels(q) for q in down]
    f32 = ([q.dequantize() for q in gate_up_p], [q.dequantize() for q in down_p])

    def step(swiglu_fn, down_fn):
        @jax.jit
        def fn(x, wgu, wd, sizes):
            for layer in range(LAYERS):
                h = swiglu_fn(x, wgu[layer], sizes[layer])
                x = x + down_fn(h, wd[layer], sizes[layer]) * 0.01
            return x
        return fn

    def as_pytree(qs):  # QuantizedWeight is not a pytree: hand jit its arrays
        return [(q.values, q.scale) for q in qs]

    def rebuild(swiglu, panel, block):
        def fn(x, w, sizes):
            q = QuantizedWeight(w[0], w[1], block, jnp.float32)
            if panel:
                return gm.grouped_matmul_panels_fp8_native(x, q, sizes, swiglu)
            return gm.grouped_matmul_fp8_native(x, q, sizes, swiglu)
        return fn

    pblock = (1, 128 // gm.PANEL, 128, gm.PANEL)
    steps = {
        "fp8 panels": (step(rebuild(True, True, pblock), rebuild(False, True, pblock)),
                       (as_pytree(gate_up_p), as_pytree(down_p)), 1),
        "f32 panels": (step(lambda x, w, s: gm.grouped_matmul_panels_native(x, w, s, True),
                            lambda x, w, s: gm.grouped_matmul_panels_native(x, w, s, False)), f32, 4),
        "fp8 [E,K,Nout]": (step(rebuild(True, False, (1, 128, 128)), rebuild(False, False, (1, 128, 128))),
                           (as_pytree(gate_up), as_pytree(down)), 1),
    }
    run(args, rng, steps, jnp.float32, lambda a, b: np.array_equal(a, b) or os.environ.get("QC_NOCHECK") == "1")


if __name__ == "__main__":
    main()
