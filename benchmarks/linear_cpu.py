"""Time the CPU rules of `linear` (qcompile/kernels/linear.py) and greedy at the bench preset's dense shapes.

Usage: python benchmarks/linear_cpu.py [--rows 1,8,32,48,64,96,128] [--repeats 60]

Shapes (x[T,K] · w[N,K]ᵀ, Hugging Face's [out, in] layout): the bench preset's dense projections and its lm_head
(K=1024, N=32000). "xla" is XLA's dot as the rule ran it before (`linear_xla`); "native" is the C++ custom call
(`linear_native`). Each is jitted, warmed up, then timed as the minimum of --repeats runs (other processes share the
cores). GB/s = weight bytes ÷ time; GFLOP/s = 2·T·K·N ÷ time. Weights small enough for the L3 stay cached between
repeats, so their GB/s can exceed the memory bandwidth (a decode step, touching every layer, does not get that).
Then greedy: jnp.argmax against the two-reduction rule at [T, 32000].
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from timing import best_ms

from qcompile.kernels import linear as lin
from qcompile.kernels import native

SHAPES = [(1024, 4096), (4096, 1024), (2048, 1024), (1024, 32000)]  # (K, N)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,32,48,64,96,128")
    ap.add_argument("--repeats", type=int, default=60)
    args = ap.parse_args()
    if not native.ensure(lin.NATIVE_F32):
        raise SystemExit(f"native kernel unavailable: {native.status(lin.NATIVE_F32)}")
    rng = np.random.default_rng(0)
    xla, nat = jax.jit(lin.linear_xla), jax.jit(lin.linear_native)
    print("| T | K | N | xla ms | native ms | native GB/s | native GFLOP/s | speed-up |")
    print("|---|---|---|---|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        for k, n in SHAPES:
            x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
            w = jnp.asarray(rng.standard_normal((n, k)) / np.sqrt(k), jnp.float32)
            a, b = best_ms(xla, x, w, repeats=args.repeats), best_ms(nat, x, w, repeats=args.repeats)
            print(f"| {rows} | {k} | {n} | {a:.3f} | {b:.3f} | {n * k * 4 / b / 1e6:.1f} | "
                  f"{2 * rows * k * n / b / 1e6:.0f} | {a / b:.2f}× |")
    print("\n| T | jnp.argmax ms | greedy_cpu ms |\n|---|---|---|")
    argmax = jax.jit(lambda v: jnp.argmax(v, axis=-1).astype(jnp.int32))
    for rows in (1, 8, 32):
        logits = jnp.asarray(rng.standard_normal((rows, 32000)), jnp.float32)
        print(f"| {rows} | {best_ms(argmax, logits, repeats=args.repeats):.3f} | "
              f"{best_ms(jax.jit(lin.greedy_cpu), logits, repeats=args.repeats):.3f} |")


if __name__ == "__main__":
    main()
