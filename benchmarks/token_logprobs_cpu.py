"""Time the rules of `token_logprobs` (qcompile/kernels/logprobs.py) — what `serve`'s logprobs add to a step.

Usage: python benchmarks/token_logprobs_cpu.py [--rows 1,8,32] [--vocab 32000,248320] [--repeats 30]

For each (rows, vocabulary): f32 logits [rows, V], every row scored against a random target with the top 20. "jnp"
is the reference rule as XLA CPU runs it (lax.top_k sorts each row); "native" the C++ custom call (one pass for the
maximum and the top 20 under a running threshold, one for Σ e^(x − max)). Minimum of --repeats after a warm-up.
GB/s = logit bytes ÷ time (each row is read twice by the kernel).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from timing import best_ms

from qcompile.kernels.logprobs import native_available, token_logprobs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--vocab", default="32000,248320")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    print(f"{'rows':>5} {'vocab':>7} {'jnp ms':>8} {'native ms':>10} {'native GB/s':>12} {'speed-up':>9}")
    for vocab in map(int, args.vocab.split(",")):
        for rows in map(int, args.rows.split(",")):
            logits = jax.random.normal(jax.random.PRNGKey(rows), (rows, vocab), jnp.float32) * 4
            index = jnp.arange(rows, dtype=jnp.int32)
            targets = jnp.asarray(np.random.default_rng(rows).integers(0, vocab, rows), jnp.int32)
            times = {}
            for rule in ("jnp", "native"):
                if rule == "native" and not native_available(jnp.float32):
                    continue
                times[rule] = best_ms(lambda x: token_logprobs(x, index, targets, use_native=rule == "native"),
                                      logits, repeats=args.repeats)
            native = times.get("native", float("nan"))
            print(f"{rows:>5} {vocab:>7} {times['jnp']:>8.2f} {native:>10.2f} "
                  f"{rows * vocab * 4 / native / 1e6:>12.1f} {times['jnp'] / native:>8.1f}x")


if __name__ == "__main__":
    main()
