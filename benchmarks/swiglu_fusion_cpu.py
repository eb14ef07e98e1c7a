"""Time the swiglu-fusion pass's CPU rules against the unfused ops they replace, at the bench preset's shapes.

Usage: python benchmarks/swiglu_fusion_cpu.py [--tokens 1,8,32,128,512] [--repeats 30]

Routed experts (E=64, top-8, H=1024, I=256): unfused = two grouped_matmul_cpu calls (gate, up: each [N,1024] ×
[64,1024,256]) then silu(gate)·up, as the unfused graph runs them; fused = grouped_matmul_swiglu_cpu over the
prepared [64,1024,512] weight (the native kernel with its epilogue). Shared expert (I=512): two linear_cpu calls and
silu·mul vs linear_swiglu's rule (one linear_cpu over [1024, 1024] rows of [gate ; up], then the halves). Each is
jitted, warmed up, timed as the minimum of --repeats runs (shared machine); weights are distinct per call site as in
a model (the routed weights, 128 MiB per matrix pair, do not stay in the L3).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from timing import best_ms

from qcompile.kernels import grouped_matmul as gm
from qcompile.kernels import linear as lin

E, TOPK, H, I_ROUTED, I_SHARED = 64, 8, 1024, 256, 512


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,8,32,128,512")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    w_gate = jnp.asarray(rng.standard_normal((E, H, I_ROUTED)) * 0.03, jnp.float32)
    w_up = jnp.asarray(rng.standard_normal((E, H, I_ROUTED)) * 0.03, jnp.float32)
    w_fused = jnp.concatenate([w_gate, w_up], axis=2)
    s_gate = jnp.asarray(rng.standard_normal((I_SHARED, H)) * 0.03, jnp.float32)
    s_up = jnp.asarray(rng.standard_normal((I_SHARED, H)) * 0.03, jnp.float32)
    s_fused = jnp.concatenate([s_gate, s_up], axis=0)
    unfused_moe = jax.jit(lambda x, wg, wu, g: jax.nn.silu(gm.grouped_matmul_cpu(x, wg, g))
                          * gm.grouped_matmul_cpu(x, wu, g))
    fused_moe = jax.jit(gm.grouped_matmul_swiglu_cpu)
    unfused_dense = jax.jit(lambda x, wg, wu: jax.nn.silu(lin.linear_cpu(x, wg)) * lin.linear_cpu(x, wu))
    fused_dense = jax.jit(lambda x, w: gm.swiglu_halves(lin.linear_cpu(x, w)))
    print("| tokens | routed unfused ms | routed fused ms | speed-up | shared unfused ms | shared fused ms | speed-up |")
    print("|---|---|---|---|---|---|---|")
    for tokens in (int(t) for t in args.tokens.split(",")):
        ids = np.stack([rng.choice(E, TOPK, replace=False) for _ in range(tokens)])
        groups = jnp.asarray(np.bincount(ids.reshape(-1), minlength=E).astype(np.int32))
        rows = jnp.asarray(rng.standard_normal((tokens * TOPK, H)), jnp.float32)
        x = jnp.asarray(rng.standard_normal((tokens, H)), jnp.float32)
        a = best_ms(unfused_moe, rows, w_gate, w_up, groups, repeats=args.repeats)
        b = best_ms(fused_moe, rows, w_fused, groups, repeats=args.repeats)
        c = best_ms(unfused_dense, x, s_gate, s_up, repeats=args.repeats)
        d = best_ms(fused_dense, x, s_fused, repeats=args.repeats)
        print(f"| {tokens} | {a:.3f} | {b:.3f} | {a / b:.2f}× | {c:.3f} | {d:.3f} | {c / d:.2f}× |")


if __name__ == "__main__":
    main()
