"""Time the gdn-conv-fusion pass's CPU rule against the unfused CPU rules it replaces, at the bench preset's shapes,
with f32 and bf16 (bf16-state) states.

Usage: python benchmarks/gdn_fusion_cpu.py [--repeats 30]

Bench preset GDN layer: Hk 4, Hv 8, dk = dv = 128 (C = 2048 conv channels), K = 4. Unfused = causal_conv1d's CPU rule,
the [q | k | v] slices, gdn_gates and gdn_recurrence's CPU rule (the native recurrence) — the ops the unfused graph
runs; fused = gated_delta_net's CPU rule (the native fused kernel). Both caches are donated and fed back each call,
as the engine does (so the in-place kernels do not copy their states first); the minimum of --repeats calls after a
warm-up (shared machine). Batches: decode (B sequences × 1 token), prefill (1 × 128 tokens, 8 × 128), mixed (1
decode + one 64-token prefill chunk per 8 sequences).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from qcompile.ir.registry import lowering_rule
from qcompile.ir.ops.gdn import CausalConv1d, GatedDeltaNet, GdnGates, GdnRecurrence
from qcompile.kernels.gdn_fused import split_heads

HK, HV, DK, DV, K = 4, 8, 128, 128, 4
C = 2 * HK * DK + HV * DV


def unfused(x, a, b, conv_state, conv_w, a_log, dt_bias, state, qs, slots):
    y, conv_state = lowering_rule(CausalConv1d, "cpu")(CausalConv1d(), x, conv_state, conv_w, qs, slots)
    q, k, v = split_heads(y, HV, DK, DV)
    g, beta = lowering_rule(GdnGates, "cpu")(GdnGates(), a, b, a_log, dt_bias)
    o, state = lowering_rule(GdnRecurrence, "cpu")(GdnRecurrence(), q, k, v, g, beta, state, qs, slots)
    return o, conv_state, state


def fused(*args):
    return lowering_rule(GatedDeltaNet, "cpu")(GatedDeltaNet(), *args)


def time_donated(fn, args, repeats):
    """Min ms of fn over repeats, the two caches (args 3 and 7) donated and replaced by the outputs each call."""
    step = jax.jit(fn, donate_argnums=(3, 7))
    args = list(args)
    out = step(*args)
    jax.block_until_ready(out)
    best = float("inf")
    for _ in range(repeats):
        args[3], args[7] = out[1], out[2]
        started = time.perf_counter()
        out = step(*args)
        jax.block_until_ready(out)
        best = min(best, time.perf_counter() - started)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    batches = {"decode B=1": [1], "decode B=8": [1] * 8, "decode B=32": [1] * 32, "prefill 1×128": [128],
               "prefill 8×128": [128] * 8, "mixed 7×1 + 64": [1] * 7 + [64]}
    print("| batch | state | unfused ms | fused ms | speed-up |")
    print("|---|---|---|---|---|")
    for name, lengths in batches.items():
        num_seqs, tokens = len(lengths), sum(lengths)
        slots = np.arange(num_seqs, dtype=np.int32)
        qs = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        for dtype in (jnp.float32, jnp.bfloat16):
            base = (jnp.asarray(rng.standard_normal((tokens, C)), jnp.float32),
                    jnp.asarray(rng.standard_normal((tokens, HV)), jnp.float32),
                    jnp.asarray(rng.standard_normal((tokens, HV)), jnp.float32),
                    None, jnp.asarray(rng.standard_normal((C, K)) * 0.5, jnp.float32),
                    jnp.asarray(rng.standard_normal(HV) * 0.5, jnp.float32),
                    jnp.asarray(rng.standard_normal(HV), jnp.float32), None, jnp.asarray(qs), jnp.asarray(slots))
            times = []
            for fn in (unfused, fused):
                call = list(base)
                call[3] = jnp.asarray(rng.standard_normal((num_seqs + 1, C, K - 1)), dtype)
                call[7] = jnp.asarray(rng.standard_normal((num_seqs + 1, HV, DK, DV)) * 0.1, dtype)
                times.append(time_donated(fn, call, args.repeats))
            label = "f32" if dtype == jnp.float32 else "bf16"
            print(f"| {name} | {label} | {times[0]:.3f} | {times[1]:.3f} | {times[0] / times[1]:.2f}× |")


if __name__ == "__main__":
    main()
