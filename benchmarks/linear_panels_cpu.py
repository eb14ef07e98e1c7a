"""Time the CPU rules of a dense linear with weights from memory, as a decode step reads them: the row kernel on the
checkpoint's [N, K] layout (`linear_native`, ≤ 48 rows; XLA's dot above), the panel kernel on the same weights in
column panels (`linear_panels_cpu`), and XLA's dot on [N, K] (`linear_xla`).

Usage: python benchmarks/linear_panels_cpu.py [--rows 1,8,32,128,512] [--repeats 6] [--dtype f32|bf16]

--dtype bf16 times a bf16 checkpoint's products instead (bf16 activations and panels, 0.64 GB): the panel rule as the
step calls it (AMX tiles from AMX_MIN_ROWS rows where the CPU has them) beside the FMA, VDPBF16PS and AMX panel
kernels at every row count; on a CPU with AVX512_BF16 also the panels in pair order (the layout where the CPU has
AMX): the rule, and its kernels (VDPBF16PS, and AMX where the CPU has it), each at every row count.

One jitted chain multiplies the rows by the bench preset's dense weights of one decode step, eight times over
(60 × [1024, 1024], 30 × [2048, 1024], 60 × [512, 1024], 60 × [1024, 512], 4 × [32000, 1024]; 1.28 GB, more than
the last-level cache holds), each product feeding the next input, so every weight comes from memory and nothing runs
concurrently. The minimum over --repeats runs is reported with GB/s (weight bytes ÷ time) and GFLOP/s.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from timing import best_ms

from qcompile.kernels import linear as lin
from qcompile.kernels.grouped_matmul import to_pair_order
from qcompile.kernels import native

SHAPES = [(1024, 1024)] * 60 + [(2048, 1024)] * 30 + [(512, 1024)] * 60 + [(1024, 512)] * 60 + [(32000, 1024)] * 4


def chain(product):
    @jax.jit
    def run(x, weights):
        total = 0.0
        for w in weights:
            k = x.shape[1]
            need = w.shape[1]  # K of [N, K] and of [P, K, 64]
            xi = x[:, :need] if need <= k else jnp.tile(x, (1, need // k))
            y = product(xi, w)
            total = total + y[:, :8].sum()
            x = x + 1e-3 * y[:, :1]
        return total
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,32,128,512")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--dtype", choices=("f32", "bf16"), default="f32")
    args = ap.parse_args()
    if args.dtype == "bf16":
        return main_bf16(args)
    for name in (lin.NATIVE_F32, lin.NATIVE_PANELS):
        if not native.ensure(name):
            raise SystemExit(f"native kernel unavailable: {native.status(name)}")
    rng = np.random.default_rng(0)
    weights = [jnp.asarray(rng.standard_normal((n, k)) / np.sqrt(k), jnp.float32) for n, k in SHAPES]
    panels = [jax.block_until_ready(lin.pack_panels(w)) for w in weights]
    nbytes = sum(n * k * 4 for n, k in SHAPES)
    print("| rows | rule | ms | GB/s | GFLOP/s |\n|---|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        x = jnp.asarray(rng.standard_normal((rows, 1024)), jnp.float32)
        flops = sum(2 * rows * n * k for n, k in SHAPES)
        rules = [("rows [N,K]" if rows <= lin.NATIVE_MAX_ROWS else "xla [N,K]", lin.linear_cpu, weights),
                 ("panels", lin.linear_panels_cpu, panels)]
        if rows <= lin.NATIVE_MAX_ROWS:
            rules.append(("xla [N,K]", lin.linear_xla, weights))
        for label, product, ws in rules:
            ms = best_ms(chain(product), x, ws, repeats=args.repeats)
            print(f"| {rows} | {label} | {ms:.1f} | {nbytes / ms / 1e6:.1f} | {flops / ms / 1e6:.0f} |")


def fma_panels_bf16(x, wp):
    """The FMA panel kernel on bf16 panels whatever the row count (the rule's choice below AMX_MIN_ROWS)."""
    p, k, c = wp.shape
    call = jax.ffi.ffi_call(lin.NATIVE_PANELS_BF16, jax.ShapeDtypeStruct((x.shape[0], p * c), jnp.float32))
    return call(x.astype(jnp.float32), wp, swiglu=0).astype(x.dtype)


def pairs_panels_bf16(x, wp):
    """The VDPBF16PS pair kernel on bf16 panels whatever the row count (the rule's choice below AMX_MIN_ROWS on an
    AVX512_BF16 CPU)."""
    p, k, c = wp.shape
    call = jax.ffi.ffi_call(lin.NATIVE_PANELS_BF16_PAIRS, jax.ShapeDtypeStruct((x.shape[0], p * c), jnp.bfloat16))
    return call(x, wp, swiglu=0)


def amx_panels_bf16(x, wp):
    """The AMX kernel on bf16 panels whatever the row count (the rule's choice from AMX_MIN_ROWS on)."""
    p, k, c = wp.shape
    call = jax.ffi.ffi_call(lin.NATIVE_PANELS_AMX, jax.ShapeDtypeStruct((x.shape[0], p * c), jnp.float32))
    return call(x, wp).astype(x.dtype)


def pair_order_amx(x, wp):
    """The AMX kernel on panels in pair order (read in place; the rule's choice from AMX_PAIR_MIN_ROWS on)."""
    p, k, c = wp.shape
    call = jax.ffi.ffi_call(lin.NATIVE_PAIR_PANELS_AMX, jax.ShapeDtypeStruct((x.shape[0], p * c), jnp.float32))
    return call(x, wp).astype(x.dtype)


def pair_order_pairs(x, wp):
    """The VDPBF16PS kernel on panels in pair order (no interleaving; the rule's choice below AMX_PAIR_MIN_ROWS)."""
    p, k, c = wp.shape
    call = jax.ffi.ffi_call(lin.NATIVE_PAIR_PANELS_BF16, jax.ShapeDtypeStruct((x.shape[0], p * c), jnp.bfloat16))
    return call(x, wp, swiglu=0)


def main_bf16(args) -> None:
    if not native.ensure(lin.NATIVE_PANELS_BF16):
        raise SystemExit(f"native kernel unavailable: {native.status(lin.NATIVE_PANELS_BF16)}")
    rng = np.random.default_rng(0)
    panels = [jax.block_until_ready(lin.pack_panels(jnp.asarray(rng.standard_normal((n, k)) / np.sqrt(k),
                                                                jnp.bfloat16))) for n, k in SHAPES]
    nbytes = sum(n * k * 2 for n, k in SHAPES)
    amx = native.amx_bf16() and native.ensure(lin.NATIVE_PANELS_AMX)
    pairs = native.avx512_bf16() and native.ensure(lin.NATIVE_PANELS_BF16_PAIRS)
    print(f"AMX: {'yes' if amx else 'no'}; the rule uses it from {lin.AMX_MIN_ROWS} rows; "
          f"VDPBF16PS pairs: {'yes' if pairs else 'no'}")
    # panels in pair order (the cpu layout of bf16 weights where the CPU has AMX, ir/target_layout.py)
    paired = None
    if pairs and native.ensure(lin.NATIVE_PAIR_PANELS_BF16):
        paired = [jax.block_until_ready(to_pair_order(w)) for w in panels]
    amx_paired = paired is not None and amx and native.ensure(lin.NATIVE_PAIR_PANELS_AMX)
    print("| rows | rule | ms | GB/s | GFLOP/s |\n|---|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        x = jnp.asarray(rng.standard_normal((rows, 1024)), jnp.bfloat16)
        flops = sum(2 * rows * n * k for n, k in SHAPES)
        rules = [("rule (k order)", lin.linear_panels_cpu, panels), ("fma", fma_panels_bf16, panels)]
        if pairs:
            rules.append(("pairs", pairs_panels_bf16, panels))
        if amx:
            rules.append(("amx (repacks)", amx_panels_bf16, panels))
        if paired is not None:
            rules += [("rule (pair order)", functools.partial(lin.linear_panels_cpu, pair_order=True), paired),
                      ("pair order: pairs", pair_order_pairs, paired)]
        if amx_paired:
            rules.append(("pair order: amx", pair_order_amx, paired))
        for label, product, weights in rules:
            ms = best_ms(chain(product), x, weights, repeats=args.repeats)
            print(f"| {rows} | {label} | {ms:.1f} | {nbytes / ms / 1e6:.1f} | {flops / ms / 1e6:.0f} |")


if __name__ == "__main__":
    main()
