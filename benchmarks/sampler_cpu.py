"""Time the on-device sampler (qcompile/runtime/sampling.py::sample) per call on CPU: greedy, temperature alone,
Qwen's recommended filters (temperature 0.7, top-k 20, top-p 0.8) and top-p 0.95 alone, for the bench preset's
vocabulary (32000) and Qwen3.5's (248320), 1 / 8 / 32 rows of random logits; and Qwen3.5's card's non-thinking
setting with its presence penalty 1.5 (and a repetition penalty 1.05 besides), each row having made 2048 tokens
(Zipf-distributed, ~1000 distinct) after a 1024-token prompt: the host's building of the (row, token) pairs counted.

Run: python benchmarks/sampler_cpu.py   (numbers quoted in docs/serving.md; run against another checkout with
PYTHONPATH=that/checkout to compare)."""
import time

import jax
import jax.numpy as jnp
import numpy as np

from qcompile.runtime.sampling import GREEDY, History, Sampling, sample

CARD = Sampling(temperature=0.7, top_k=20, top_p=0.8)
SETTINGS = (("greedy", GREEDY), ("temperature 0.7", Sampling(temperature=0.7)),
            ("0.7, top-k 20, top-p 0.8", CARD), ("1.0, top-p 0.95", Sampling(temperature=1.0, top_p=0.95)),
            ("card + presence 1.5", Sampling(0.7, 20, 0.8, presence_penalty=1.5)),
            ("+ repetition 1.05", Sampling(0.7, 20, 0.8, presence_penalty=1.5, repetition_penalty=1.05)))


def histories(param: Sampling, rows: int, vocab: int) -> list | None:
    if not param.uses_history:
        return None
    rng = np.random.default_rng(1)
    made = [(rng.zipf(1.3, 2048) % vocab).tolist() for _ in range(rows)]
    return [History.of(rng.integers(0, vocab, 1024), m, param) for m in made]


print("| vocab | rows | " + " | ".join(name for name, _ in SETTINGS) + " |")
print("|---|---|" + "---|" * len(SETTINGS))
for vocab in (32000, 248320):
    for rows in (1, 8, 32):
        logits = jnp.asarray(np.random.default_rng(0).standard_normal((rows, vocab)).astype(np.float32) * 3)
        cells = []
        for _, params in SETTINGS:
            args = (logits, list(range(rows)), [params] * rows, [0] * rows, histories(params, rows, vocab))
            jax.block_until_ready(sample(*args))
            best = float("inf")
            for _ in range(3):
                started = time.perf_counter()
                for _ in range(3):
                    jax.block_until_ready(sample(*args))
                best = min(best, (time.perf_counter() - started) / 3)
            cells.append(f"{best * 1e3:.1f} ms")
        print(f"| {vocab} | {rows} | " + " | ".join(cells) + " |", flush=True)
