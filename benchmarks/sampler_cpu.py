"""Time the on-device sampler (qcompile/runtime/sampling.py::sample) per call on CPU: greedy, temperature alone,
Qwen's recommended filters (temperature 0.7, top-k 20, top-p 0.8) and top-p 0.95 alone, for the bench preset's
vocabulary (32000) and Qwen3.5's (248320), 1 / 8 / 32 rows of random logits.

Run: python benchmarks/sampler_cpu.py   (numbers quoted in docs/serving.md; run against another checkout with
PYTHONPATH=that/checkout to compare)."""
import time

import jax
import jax.numpy as jnp
import numpy as np

from qcompile.runtime.sampling import GREEDY, Sampling, sample

SETTINGS = (("greedy", GREEDY), ("temperature 0.7", Sampling(temperature=0.7)),
            ("0.7, top-k 20, top-p 0.8", Sampling(temperature=0.7, top_k=20, top_p=0.8)),
            ("1.0, top-p 0.95", Sampling(temperature=1.0, top_p=0.95)))
print("| vocab | rows | " + " | ".join(name for name, _ in SETTINGS) + " |")
print("|---|---|" + "---|" * len(SETTINGS))
for vocab in (32000, 248320):
    for rows in (1, 8, 32):
        logits = jnp.asarray(np.random.default_rng(0).standard_normal((rows, vocab)).astype(np.float32) * 3)
        cells = []
        for _, params in SETTINGS:
            args = (logits, list(range(rows)), [params] * rows, [0] * rows)
            jax.block_until_ready(sample(*args))
            best = float("inf")
            for _ in range(3):
                started = time.perf_counter()
                for _ in range(3):
                    jax.block_until_ready(sample(*args))
                best = min(best, (time.perf_counter() - started) / 3)
            cells.append(f"{best * 1e3:.1f} ms")
        print(f"| {vocab} | {rows} | " + " | ".join(cells) + " |", flush=True)
