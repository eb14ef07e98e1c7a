"""Decode-step time against the cache's capacity: the same 32 sequences (128-token prompts, the `all` build) with
the engine's cache sized for max_context 160 and 2048 — a step should cost what the live context costs, not what the
cache could hold.

Run: python benchmarks/cache_capacity_cpu.py CHECKPOINT [--concurrency 32] [--contexts 160,2048] [--steps 20]
(median and min of the decode steps; numbers quoted in docs/cpu_rules.md, "bf16 caches"). QCOMPILE_NATIVE=off gives
the rules without the native cache-row kernels."""

from __future__ import annotations

import argparse
import time

import numpy as np

from qcompile.ir.abi import CacheConfig
from qcompile.passes.base import PassContext
from qcompile.passes.manager import run_pipeline
from qcompile.passes.registry import parse_spec
from qcompile.runtime.model import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--contexts", default="160,2048")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--passes", default="all")
    args = ap.parse_args()
    model = load_model(args.checkpoint, progress=False, rewrite=lambda g: run_pipeline(
        g, parse_spec(args.passes), PassContext(), verify_mode="none").graph)
    for context in map(int, args.contexts.split(",")):
        eng = model.engine(CacheConfig(max_seqs=args.concurrency, max_context=context, max_step_tokens=512))
        seqs = [eng.add_sequence() for _ in range(args.concurrency)]
        rng = np.random.default_rng(0)
        last = eng.prefill([(s, rng.integers(3, 32000, 128).tolist()) for s in seqs], with_logits=False)
        times = []
        for step in range(args.steps + 3):
            start = time.perf_counter()
            last = eng.step_tokens([(s, [t]) for s, t in zip(seqs, last)])
            if step >= 3:
                times.append(time.perf_counter() - start)
        print(f"concurrency {args.concurrency}, max_context {context}: decode step median "
              f"{np.median(times) * 1e3:.1f} ms, min {min(times) * 1e3:.1f} ms", flush=True)


if __name__ == "__main__":
    main()
