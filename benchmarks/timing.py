"""Shared by the benchmark scripts: the minimum wall time of a jitted call (the least noisy statistic on a machine
shared with other jobs), after one untimed warm-up call that compiles it."""

from __future__ import annotations

import time

import jax


def best_ms(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - started)
    return min(times) * 1e3
