"""Time the CPU grouped_matmul strategies (qcompile/kernels/grouped_matmul.py) at bench-preset MoE shapes.

Usage: python benchmarks/grouped_matmul_cpu.py [--tokens 1,4,8,32,64,128,256] [--dtypes f32,bf16]
                                               [--ref-max-tokens 8] [--repeats 7] [--precision] [--out FILE]

Shapes: E=64 experts, top-8 routing (random 8 of 64 per token, fixed seed), N = tokens*8 rows;
  gate/up: K=1024 -> Nout=256 (w [64, 1024, 256]);  down: K=256 -> Nout=1024 (w [64, 256, 1024]) — the op's
  [E, K, Nout] layout (the importer prepares it from the checkpoints' [E, Nout, K]).
"native" is the C++ custom call (kernels/native.py), f32 only, which grouped_matmul_cpu runs for f32 where it can be
built. Each strategy is jitted, warmed up once, then timed as the minimum of --repeats runs (other processes share the cores;
the minimum is the least noisy statistic). Columns: ms; GB/s = bytes of the weights of the experts actually routed
÷ time (the decode roofline quantity); GFLOP/s = 2·N_real·K·Nout ÷ time (useful FLOPs only). The reference
(jax.lax.ragged_dot, which JAX expands to all E experts on CPU) runs only up to --ref-max-tokens (it takes seconds).
--precision also times an f32 [512,1024]x[1024,1024] dot at Precision.DEFAULT vs HIGHEST and compares the results.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from qcompile.kernels import grouped_matmul as gm
from qcompile.kernels import native

E, TOPK = 64, 8
SHAPES = {"gate/up": (1024, 256), "down": (256, 1024)}
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


def strategies(n: int, dtype_name: str):
    out = {}
    for b, ok in ((1, n <= 64), (2, 16 <= n <= 128), (4, 32 <= n <= 512), (8, 32 <= n <= 1024), (16, n >= 64),
                  (32, n >= 256)):
        if ok:
            out[f"loop b{b}"] = functools.partial(gm.grouped_matmul_blocks_loop, block=b)
    for b, ok in ((1, n <= 64), (16, n >= 256), (32, n >= 1024)):
        if ok:
            out[f"experts b{b}"] = functools.partial(gm.grouped_matmul_experts_unrolled, block=b)
    if n <= 8:
        out["batched b8"] = functools.partial(gm.grouped_matmul_blocks_batched, block=8)
        out["rowwise"] = gm.grouped_matmul_rowwise
    if dtype_name == "f32" and native.ensure(gm.NATIVE_F32):
        out["native"] = gm.grouped_matmul_native
    return out


def chosen(n: int, k: int, nout: int, dtype) -> str:
    """The strategy grouped_matmul_cpu runs for this shape."""
    if dtype == jnp.float32 and native.ensure(gm.NATIVE_F32):
        return "native"
    return gm.choose_strategy(n, E, k, nout, dtype)


def time_fn(fn, args, repeats: int) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    time_fn.first = time.perf_counter() - t0
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def routing(tokens: int, rng):
    ids = np.stack([rng.choice(E, TOPK, replace=False) for _ in range(tokens)])
    return np.bincount(ids.reshape(-1), minlength=E).astype(np.int32)


def precision_check(lines):
    rng = np.random.default_rng(1)
    a = jnp.asarray(rng.standard_normal((512, 1024)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((1024, 1024)), jnp.float32)
    exact = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    lines.append("| precision | ms | GFLOP/s | max rel err vs f64 |")
    lines.append("|---|---|---|---|")
    res = {}
    for name, p in (("DEFAULT", jax.lax.Precision.DEFAULT), ("HIGHEST", jax.lax.Precision.HIGHEST)):
        fn = jax.jit(functools.partial(jnp.dot, precision=p))
        t = time_fn(fn, (a, b), 10)
        res[name] = np.asarray(fn(a, b))
        err = np.abs(res[name] - exact).max() / np.abs(exact).max()
        lines.append(f"| {name} | {t * 1e3:.2f} | {2 * 512 * 1024 * 1024 / t / 1e9:.0f} | {err:.1e} |")
    lines.append(f"\nDEFAULT and HIGHEST results bitwise equal: {bool(np.array_equal(res['DEFAULT'], res['HIGHEST']))}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,4,8,32,64,128,256")
    ap.add_argument("--dtypes", default="f32,bf16")
    ap.add_argument("--shapes", default="gate/up,down")
    ap.add_argument("--ref-max-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--only", default="", help="comma list of strategy-name prefixes to run")
    ap.add_argument("--precision", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    lines = [f"jax {jax.__version__}, {jax.devices()[0].platform}, E={E}, top-{TOPK}, min of {args.repeats}", ""]
    lines.append("| dtype | matrix | tokens | N | experts hit | strategy | ms | GB/s | GFLOP/s | first call s |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(lines), flush=True)
    rng = np.random.default_rng(0)
    only = [s for s in args.only.split(",") if s]
    for dname in args.dtypes.split(","):
        dtype = DTYPES[dname]
        for shape in args.shapes.split(","):
            k, nout = SHAPES[shape]
            w = jnp.asarray(rng.standard_normal((E, k, nout)) * 0.03, dtype)
            for tokens in map(int, args.tokens.split(",")):
                n = tokens * TOPK
                gs = jnp.asarray(routing(tokens, rng))
                rows = jnp.asarray(rng.standard_normal((n, k)), dtype)
                hit = int((np.asarray(gs) > 0).sum())
                wbytes = hit * nout * k * jnp.dtype(dtype).itemsize
                flops = 2 * n * k * nout
                cands = strategies(n, dname)
                if tokens <= (args.ref_max_tokens if dname == "f32" else min(1, args.ref_max_tokens)):
                    cands = {"reference ragged_dot": gm.grouped_matmul_reference, **cands}
                for name, fn in cands.items():
                    if only and not any(name.startswith(o) for o in only) and name != "reference ragged_dot":
                        continue
                    reps = 2 if name.startswith("reference") else args.repeats
                    t = time_fn(jax.jit(fn), (rows, w, gs), reps)
                    if name == chosen(n, k, nout, dtype):
                        name = f"**{name}** (chosen)"
                    line = (f"| {dname} | {shape} | {tokens} | {n} | {hit} | {name} | {t * 1e3:.3f} | "
                            f"{wbytes / t / 1e9:.1f} | {flops / t / 1e9:.1f} | {time_fn.first:.2f} |")
                    lines.append(line)
                    print(line, flush=True)
    if args.precision:
        lines.append("")
        precision_check(lines)
        print("\n".join(lines[-5:]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
