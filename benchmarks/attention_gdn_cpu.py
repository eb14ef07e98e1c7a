"""CPU kernels vs their jnp references: paged attention, GDN recurrence, causal conv1d (ms per call).

    python benchmarks/attention_gdn_cpu.py [--repeat 7] [--only attention,decode,prefill,gdn,conv]

Bench-preset shapes (docs/bench_preset.md): attention Hq 8 / Hkv 2 / hd 128, page size 16; GDN Hv 8, dk = dv = 128;
conv C = 2·4·128 + 8·128 = 2048, K = 4; all f32. Each entry is the minimum over --repeat rounds of the mean of a
few calls of the jitted function (other processes share the cores: the minimum is the least disturbed round).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import qcompile.kernels.gdn as gdn
from qcompile.kernels.causal_conv1d import causal_conv1d_cpu, causal_conv1d_reference
from qcompile.kernels.paged_attention import paged_attention_cpu, paged_attention_reference

HQ, HKV, HD, PS = 8, 2, 128, 16
HV, DK, DV = 8, 128, 128
CONV_C, CONV_K = 2 * 4 * 128 + 8 * 128, 4


def timeit(fn, args, repeat: int) -> float:
    jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    once = time.perf_counter() - t
    number = max(1, min(20, int(0.05 / max(once, 1e-6))))
    rounds = repeat if once < 0.2 else max(2, repeat // 3)
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(number):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t) / number)
    return best * 1e3


def starts(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def attention_case(rng, lengths, history, num_tokens, max_context):
    """Ragged step: sequence b has history[b] cached tokens and lengths[b] new ones (already written)."""
    num_seqs = len(lengths)
    pages_per_seq = max_context // PS
    live_pages = [-(-(h + n) // PS) for h, n in zip(history, lengths)]
    num_pages = sum(live_pages) + 1
    perm = rng.permutation(num_pages)
    table = np.zeros((num_seqs, pages_per_seq), np.int32)
    used = 0
    for b, n in enumerate(live_pages):
        table[b, :n] = perm[used:used + n]
        used += n
    k_pages = rng.standard_normal((num_pages, PS, HKV, HD)).astype(np.float32)
    v_pages = rng.standard_normal((num_pages, PS, HKV, HD)).astype(np.float32)
    qs = starts(lengths)
    positions = np.zeros(num_tokens, np.int32)
    for b, (n, h) in enumerate(zip(lengths, history)):
        positions[qs[b]:qs[b + 1]] = np.arange(h, h + n)
    q = rng.standard_normal((num_tokens, HQ, HD)).astype(np.float32)
    return [jnp.asarray(a) for a in (q, k_pages, v_pages, positions, qs, table)]


def bench_attention(rng, repeat):
    scale = HD**-0.5
    ref = jax.jit(lambda *a: paged_attention_reference(*a, scale))
    new = jax.jit(lambda *a: paged_attention_cpu(*a, scale))
    cases = []
    for batch in (1, 8, 32):
        for max_context in (512, 8192):
            hist = list(rng.integers(150, 170, batch))
            cases.append((f"decode B={batch}, live ~160", max_context, [1] * batch, hist, batch))
    for max_context in (512, 2048):
        cases.append(("prefill 1x128", max_context, [128], [0], 128))
        cases.append(("prefill 1x256", max_context, [256], [0], 256))
    cases.append(("prefill 8x128", 512, [128] * 8, [0] * 8, 1024))
    for max_context in (512, 8192):
        cases.append(("mixed B=8: 121 new + 7 decode @~160", max_context, [121] + [1] * 7,
                      [0] + list(rng.integers(150, 170, 7)), 128))
        cases.append(("mixed B=8: 100 new @400 + 7 decode", max_context, [100] + [1] * 7,
                      [400] + list(rng.integers(150, 170, 7)), 128))
    print("\n## paged attention (Hq 8, Hkv 2, hd 128, page 16, f32)\n")
    print("| case | T | max_context | reference ms | paged_attention_cpu ms | speed-up | max rel err |")
    print("|---|---|---|---|---|---|---|")
    for name, max_context, lengths, hist, num_tokens in cases:
        args = attention_case(rng, lengths, hist, num_tokens, max_context)
        want, got = ref(*args), new(*args)
        err = float(jnp.max(jnp.abs(want - got)) / jnp.max(jnp.abs(want)))
        t_ref, t_new = timeit(ref, args, repeat), timeit(new, args, repeat)
        print(f"| {name} | {num_tokens} | {max_context} | {t_ref:.3f} | {t_new:.3f} | {t_ref / t_new:.1f}x | {err:.1e} |",
              flush=True)


def bench_decode_attention(rng, repeat):
    """Decode rows: the jnp rule's 32-key blocks (forced with decode_block_pages=2) against the native kernel."""
    import ml_dtypes

    scale = HD**-0.5
    jnp_blocks = jax.jit(lambda *a: paged_attention_cpu(*a, scale, decode_block_pages=2))
    native = jax.jit(lambda *a: paged_attention_cpu(*a, scale))
    print("\n## decode attention: jnp blocks vs the native kernel (Hq 8, Hkv 2, hd 128, page 16)\n")
    print("| pages | B | live | jnp blocks ms | native ms | speed-up | max rel err |")
    print("|---|---|---|---|---|---|---|")
    for dtype in ("f32", "bf16"):
        for batch in (1, 8, 32):
            for live in (160, 1000, 4000):
                hist = list(rng.integers(live - 10, live + 10, batch))
                args = attention_case(rng, [1] * batch, hist, batch, 8192 if live > 2000 else 2048)
                if dtype == "bf16":
                    args[1], args[2] = (a.astype(ml_dtypes.bfloat16) for a in args[1:3])
                want, got = jnp_blocks(*args), native(*args)
                err = float(jnp.max(jnp.abs(want - got)) / jnp.max(jnp.abs(want)))
                t_jnp, t_native = timeit(jnp_blocks, args, repeat), timeit(native, args, repeat)
                print(f"| {dtype} | {batch} | ~{live} | {t_jnp:.3f} | {t_native:.3f} | {t_jnp / t_native:.1f}x | "
                      f"{err:.1e} |", flush=True)


def bench_prefill_attention(rng, repeat):
    """Prefill rows (query tiles of sequences with ≥ 2 new tokens): the jnp rule's while loop over tiles and 64-key
    blocks (forced with prefill_block_pages=4) against the native kernel's register-tiled path (every tile in one
    call)."""
    import ml_dtypes

    scale = HD**-0.5
    jnp_tiles = jax.jit(lambda *a: paged_attention_cpu(*a, scale, prefill_block_pages=4))
    native = jax.jit(lambda *a: paged_attention_cpu(*a, scale))
    print("\n## prefill attention: jnp tiles vs the native kernel (Hq 8, Hkv 2, hd 128, page 16)\n")
    print("| pages | new tokens | history | T | jnp tiles ms | native ms | speed-up | max rel err |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype in ("f32", "bf16"):
        for lengths, hist, num_tokens in (([128] * 4, [0] * 4, 512), ([512], [0], 512), ([512], [1536], 512),
                                          ([512], [7680], 512)):
            args = attention_case(rng, lengths, hist, num_tokens, 8192)
            if dtype == "bf16":
                args[1], args[2] = (a.astype(ml_dtypes.bfloat16) for a in args[1:3])
            want, got = jnp_tiles(*args), native(*args)
            err = float(jnp.max(jnp.abs(want - got)) / jnp.max(jnp.abs(want)))
            t_jnp, t_native = timeit(jnp_tiles, args, repeat), timeit(native, args, repeat)
            label = f"{len(lengths)}x{lengths[0]}" if len(lengths) > 1 else f"{lengths[0]}"
            print(f"| {dtype} | {label} | {hist[0]} | {num_tokens} | {t_jnp:.2f} | {t_native:.2f} | "
                  f"{t_jnp / t_native:.1f}x | {err:.1e} |", flush=True)


def l2(x):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def gdn_case(rng, lengths, num_tokens, num_slots):
    q = l2(rng.standard_normal((num_tokens, HV, DK))) * DK**-0.5
    k = l2(rng.standard_normal((num_tokens, HV, DK)))
    v = rng.standard_normal((num_tokens, HV, DV))
    g = -np.abs(rng.standard_normal((num_tokens, HV))) * 0.3
    beta = rng.uniform(0, 1, (num_tokens, HV))
    state = rng.standard_normal((num_slots, HV, DK, DV)) * 0.1
    slots = rng.permutation(num_slots)[: len(lengths)].astype(np.int32)
    return [jnp.asarray(a.astype(np.float32)) for a in (q, k, v, g, beta, state)] + [
        jnp.asarray(starts(lengths)), jnp.asarray(slots)]


def bench_gdn(rng, repeat, forms=True):
    recurrent = jax.jit(gdn.gdn_recurrent_reference)
    chunked = jax.jit(gdn.gdn_chunked_reference, static_argnames="chunk")
    new = jax.jit(gdn.gdn_recurrence_cpu)
    print("\n## GDN recurrence (Hv 8, dk = dv = 128, f32; reference = the op's auto mode: recurrent if T <= B else "
          "chunked 64)\n")
    print("| case | B | T | auto reference ms | recurrent scan ms | gdn_recurrence_cpu ms | speed-up vs auto | "
          "max rel err vs auto (out, state) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, lengths, num_tokens in [("decode", [1], 1), ("decode", [1] * 8, 8), ("decode", [1] * 32, 32),
                                      ("decode, padded bucket", [1] * 8, 16), ("prefill", [128], 128),
                                      ("prefill", [256], 256), ("mixed", [25] + [1] * 7, 32)]:
        args = gdn_case(rng, lengths, num_tokens, len(lengths))
        ref = recurrent if num_tokens <= len(lengths) else chunked
        (ro, rs), (no, ns) = ref(*args), new(*args)
        e_o = float(jnp.max(jnp.abs(ro - no)) / jnp.max(jnp.abs(ro)))
        e_s = float(jnp.max(jnp.abs(rs - ns)) / jnp.max(jnp.abs(rs)))
        t_ref, t_new = timeit(ref, args, repeat), timeit(new, args, repeat)
        t_rec = t_ref if ref is recurrent else timeit(recurrent, args, repeat)
        print(f"| {name} | {len(lengths)} | {num_tokens} | {t_ref:.3f} | {t_rec:.3f} | {t_new:.3f} | "
              f"{t_ref / t_new:.1f}x | {e_o:.1e}, {e_s:.1e} |", flush=True)
    if not forms:
        return

    print("\n### recurrent scan vs chunked form (which form for T > B?)\n")
    print("| lengths | B | T | recurrent ms | chunked 64 ms | chunked 32 ms |")
    print("|---|---|---|---|---|---|")
    for lengths, num_tokens in [([32], 32), ([128], 128), ([256], 256), ([9] + [1] * 7, 16), ([25] + [1] * 7, 32),
                                ([16] * 8, 128)]:
        args = gdn_case(rng, lengths, num_tokens, len(lengths))
        times = [timeit(recurrent, args, repeat)] + [
            timeit(jax.jit(lambda *a, c=c: gdn.gdn_chunked_reference(*a, chunk=c)), args, repeat) for c in (64, 32)]
        label = f"{lengths[0]}" + (f" + {len(lengths) - 1}x{lengths[1]}" if len(lengths) > 1 else "")
        print(f"| {label} | {len(lengths)} | {num_tokens} | " + " | ".join(f"{t:.2f}" for t in times) + " |", flush=True)

    print("\n### Precision.HIGHEST in _mm on CPU\n")
    results = {}
    for name, precision in (("HIGHEST", jax.lax.Precision.HIGHEST), ("DEFAULT", jax.lax.Precision.DEFAULT)):
        gdn.HIGHEST = precision  # _mm reads the module global at trace time
        try:
            rec, chk = jax.jit(gdn.gdn_recurrent_reference), jax.jit(gdn.gdn_chunked_reference)
            dec, pre = gdn_case(np.random.default_rng(1), [1] * 32, 32, 32), gdn_case(np.random.default_rng(2), [128], 128, 1)
            results[name] = (rec(*dec), chk(*pre), timeit(rec, dec, repeat), timeit(chk, pre, repeat))
        finally:
            gdn.HIGHEST = jax.lax.Precision.HIGHEST
    same = all(bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves(results["HIGHEST"][:2]),
                                                            jax.tree.leaves(results["DEFAULT"][:2])))
    print("| precision | recurrent decode B=32 ms | chunked prefill 128 ms |")
    print("|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r[2]:.3f} | {r[3]:.3f} |")
    print(f"\nresults bit-identical between HIGHEST and DEFAULT: {same}")


def bench_conv(rng, repeat):
    ref = jax.jit(causal_conv1d_reference)
    new = jax.jit(causal_conv1d_cpu)
    print(f"\n## causal conv1d (C {CONV_C}, K {CONV_K}, f32, silu)\n")
    print("| case | B | T | reference ms | causal_conv1d_cpu ms | speed-up | max abs err |")
    print("|---|---|---|---|---|---|---|")
    for name, lengths, num_tokens in [("decode", [1] * 32, 32), ("prefill", [256], 256), ("prefill", [32] * 8, 256),
                                      ("mixed", [121] + [1] * 7, 128)]:
        num_seqs = len(lengths)
        x = jnp.asarray(rng.standard_normal((num_tokens, CONV_C)).astype(np.float32))
        state = jnp.asarray(rng.standard_normal((num_seqs, CONV_C, CONV_K - 1)).astype(np.float32))
        weight = jnp.asarray(rng.standard_normal((CONV_C, CONV_K)).astype(np.float32) * 0.5)
        args = (x, state, weight, jnp.asarray(starts(lengths)), jnp.arange(num_seqs, dtype=jnp.int32))
        (ry, rs), (ny, ns) = ref(*args), new(*args)
        err = max(float(jnp.max(jnp.abs(ry - ny))), float(jnp.max(jnp.abs(rs - ns))))
        t_ref, t_new = timeit(ref, args, repeat), timeit(new, args, repeat)
        print(f"| {name} | {num_seqs} | {num_tokens} | {t_ref:.3f} | {t_new:.3f} | {t_ref / t_new:.1f}x | {err:.1e} |",
              flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--only", default="attention,gdn,conv",
                        help="comma-separated parts: attention, decode (jnp blocks vs the native decode kernel), "
                             "prefill (jnp tiles vs the native kernel), gdn (with the forms tables), gdn-main "
                             "(without), conv")
    opts = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, repeat {opts.repeat} (minimum taken)")
    parts = opts.only.split(",")
    if "attention" in parts:
        bench_attention(rng, opts.repeat)
    if "decode" in parts:
        bench_decode_attention(rng, opts.repeat)
    if "prefill" in parts:
        bench_prefill_attention(rng, opts.repeat)
    if "gdn" in parts or "gdn-main" in parts:
        bench_gdn(rng, opts.repeat, forms="gdn" in parts)
    if "conv" in parts:
        bench_conv(rng, opts.repeat)


if __name__ == "__main__":
    main()
