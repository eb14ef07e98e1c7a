"""FP8 panels in a bf16 graph: bf16 activations as they are (VDPBF16PS pair tiles over the FP8 weights dequantized to
bf16) against the same activations widened to f32 first (the registers path), in one process, alternating.

Run: python benchmarks/fp8_panels_pairs_cpu.py [--rounds 10]
Experts: eight layers of the bench preset's routed experts (E=64, top-8, [gate | up] 1024 -> 512, down 256 -> 1024;
FP8 panels in 128 x 128 blocks) at 1, 8, 32 and 128 tokens, the product rounded to bf16 and SwiGLU's halves between.
Projections: a chain of 64 FP8 [1024, 1024] panels at 1, 8, 32 and 128 rows. Prints median ms. Results in
docs/cpu_rules.md, "FP8 weights in panels". Needs a CPU with AVX512_BF16 (else both columns run the same path)."""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from qcompile.kernels import grouped_matmul as gm
from qcompile.kernels import linear as lin
from qcompile.kernels import native

LAYERS, E, K, I, TOPK, CHAIN = 8, 64, 1024, 256, 8, 64


def fp8_panels(rng, lead: tuple, k: int, n: int):
    """Random FP8 panel values [*lead, n/64, k, 64] (no NaN codes) and scales [*lead, n/128, k/128]."""
    codes = rng.integers(0, 256, (*lead, n // 64, k, 64)).astype(np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0
    scale = rng.uniform(1e-3, 1e-2, (*lead, n // 128, k // 128)).astype(np.float32)
    return jnp.asarray(codes.view(ml_dtypes.float8_e4m3fn)), jnp.asarray(scale)


def timed(fns: dict, args: tuple, rounds: int) -> dict:
    for f in fns.values():
        f(*args).block_until_ready()
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, f in fns.items():
            t = time.perf_counter()
            f(*args).block_until_ready()
            times[name].append(time.perf_counter() - t)
    return {name: round(float(np.median(t)) * 1e3, 2) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    assert native.ensure(gm.NATIVE_PANELS_FP8) and native.ensure(lin.NATIVE_PANELS_FP8)
    rng = np.random.default_rng(0)

    def experts(x, v, s, sizes, n):
        return jax.ffi.ffi_call(gm.NATIVE_PANELS_FP8, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))(
            x, v, s, sizes, block_p=2, block_k=128, bf16_weights=1).astype(jnp.bfloat16)

    def projection(x, v, s):
        return jax.ffi.ffi_call(lin.NATIVE_PANELS_FP8, jax.ShapeDtypeStruct((x.shape[0], K), jnp.float32))(
            x, v, s, block_p=2, block_k=128, bf16_weights=1, swiglu=0).astype(jnp.bfloat16)

    def moe_step(pairs: bool):
        cast = (lambda a: a) if pairs else (lambda a: a.astype(jnp.float32))

        @jax.jit
        def step(x, gate_up, down, sizes):
            for layer in range(LAYERS):
                h = gm.swiglu_halves(experts(cast(x), *gate_up[layer], sizes[layer], 2 * I))
                x = x + experts(cast(h), *down[layer], sizes[layer], K) * 0.01
            return x
        return step

    def chain(pairs: bool):
        cast = (lambda a: a) if pairs else (lambda a: a.astype(jnp.float32))

        @jax.jit
        def run(x, weights):
            for v, s in weights:
                x = projection(cast(x), v, s) * 0.03
            return x
        return run

    gate_up = [fp8_panels(rng, (E,), K, 2 * I) for _ in range(LAYERS)]
    down = [fp8_panels(rng, (E,), I, K) for _ in range(LAYERS)]
    for tokens in (1, 8, 32, 128):
        sizes = [jnp.asarray(np.bincount(np.stack([rng.choice(E, TOPK, replace=False) for _ in range(tokens)]).ravel(),
                                         minlength=E).astype(np.int32)) for _ in range(LAYERS)]
        x = jnp.asarray(rng.standard_normal((tokens * TOPK, K)), jnp.bfloat16)
        print(f"experts, {tokens:4d} tokens (ms):",
              timed({"pairs": moe_step(True), "widened": moe_step(False)}, (x, gate_up, down, sizes), args.rounds))
    weights = [fp8_panels(rng, (), K, K) for _ in range(CHAIN)]
    for rows in (1, 8, 32, 128):
        x = jnp.asarray(rng.standard_normal((rows, K)), jnp.bfloat16)
        print(f"projections, {rows:4d} rows (ms):",
              timed({"pairs": chain(True), "widened": chain(False)}, (x, weights), args.rounds))


if __name__ == "__main__":
    main()
