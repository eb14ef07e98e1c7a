"""The routed experts of one decode step of the bench preset, f32, in the two layouts the native kernel reads:
[E, K, Nout] (the checkpoint's, transposed) and column panels [E, Nout/64, K, 64] (the cpu target's layout,
ir/target_layout.py). Eight layers of grouped_matmul_swiglu (K 1024 -> 2 x 256) and grouped_matmul (256 -> 1024)
over 64 experts, top-8 routing of TOKENS tokens (random, fixed seed); each layer's weights distinct (1.6 GB at 32
tokens: nothing stays in the caches between layers, as in a step).

Run: python benchmarks/expert_panels_cpu.py [--tokens 1,8,32,128] [--rounds 15] [--dtype f32|bf16]
(bf16: a bf16 checkpoint's experts, rows bf16, as the bf16 rules take them without AMX: the product rounded to bf16,
then SwiGLU's halves).
The layouts are timed alternately in one process (the machine's speed drifts between runs); prints min and median
ms per step and GB/s of the routed experts' weights at the median. Results in docs/cpu_rules.md, "Experts in column
panels"."""
from __future__ import annotations

import argparse
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
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    args = ap.parse_args()
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
    for tokens in map(int, args.tokens.split(",")):
        sizes = [jnp.asarray(np.bincount(np.stack([rng.choice(E, TOPK, replace=False) for _ in range(tokens)]).ravel(),
                                         minlength=E).astype(np.int32)) for _ in range(LAYERS)]
        x = jnp.asarray(rng.standard_normal((tokens * TOPK, K), np.float32), dtype)
        outs = {name: np.asarray(fn(x, *weights[name], sizes), np.float64) for name, fn in steps.items()}
        a, b = outs.values()
        assert np.abs(a - b).max() <= (1e-5 if args.dtype == "f32" else 1e-2) * np.abs(a).max()
        times: dict[str, list[float]] = {name: [] for name in steps}
        for _ in range(args.rounds):
            for name, fn in steps.items():
                for _ in range(2):
                    t = time.perf_counter()
                    fn(x, *weights[name], sizes).block_until_ready()
                    times[name].append(time.perf_counter() - t)
        hit = sum(int((s > 0).sum()) for s in sizes)
        gb = hit * (K * 2 * I + I * K) * itemsize / 1e9
        for name, t in times.items():
            ms = np.array(t) * 1e3
            print(f"tokens {tokens:4d}  {name:11s} min {ms.min():7.2f}  median {np.median(ms):7.2f} ms  "
                  f"{gb / np.median(ms) * 1e3:5.1f} GB/s ({gb:.2f} GB of routed experts)")


if __name__ == "__main__":
    main()
