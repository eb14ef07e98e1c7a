"""CPU grouped_matmul strategies (qcompile/kernels/grouped_matmul.py) against the ragged_dot reference rule.

Oracles: `grouped_matmul_reference` (the op's rule, jax.lax.ragged_dot with f32 accumulation) for every case, and an
independent float64 NumPy per-group loop for one case. Errors are max|kernel - oracle| / max|oracle|. f32: every
strategy accumulates in f32 over K ≤ 64 terms, so real differences are a few ulps (~1e-7 relative); F32_REL = 1e-5
catches any wrong expert / wrong row (O(1) errors). bf16: operands are bf16, accumulation f32, one final rounding to
bf16 (2^-8 ≈ 4e-3 relative at worst); BF16_REL = 1e-2. Padding rows (past sum(group_sizes)) must come back 0, as the
reference's do.

These tests run in a process of their own (`test_strategies_in_a_fresh_process` below starts it). They compile many
small executables; in the long single-process suite XLA crashed here (SIGSEGV / SIGABRT inside a compile) once the
process reached Linux's limit of 65,530 memory mappings — every XLA CPU executable maps its code. conftest.py now
clears JAX's caches after each module, and this file, the heaviest compiler of distinct executables, also keeps its
own mappings out of the suite's process.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qcompile.kernels import grouped_matmul as gm

IN_OWN_PROCESS = os.environ.get("QCOMPILE_GMM_TESTS") == "1"
in_own_process = pytest.mark.skipif(not IN_OWN_PROCESS, reason="run in a fresh process by the test at the end")

F32_REL = 1e-5
BF16_REL = 1e-2

STRATEGIES = {
    "loop_b1": functools.partial(gm.grouped_matmul_blocks_loop, block=1),
    "loop_b4": functools.partial(gm.grouped_matmul_blocks_loop, block=4),
    "batched_b4": functools.partial(gm.grouped_matmul_blocks_batched, block=4),
    "experts_b1": functools.partial(gm.grouped_matmul_experts_unrolled, block=1),
    "experts_b4": functools.partial(gm.grouped_matmul_experts_unrolled, block=4),
    "rowwise": gm.grouped_matmul_rowwise,
    "jnp": gm.grouped_matmul_jnp,
    "cpu": gm.grouped_matmul_cpu,  # the native kernel for f32 (built on first use), the jnp rule for bf16
}
JITTED = {name: jax.jit(fn) for name, fn in STRATEGIES.items()}
reference = jax.jit(gm.grouped_matmul_reference)

# One static shape (N=24 rows, E=6 experts, K=16, Nout=8) so that each strategy compiles once per dtype; group_sizes
# are runtime values: empty groups, one expert holding every row, padding rows, nothing routed, a single routed row,
# groups longer and shorter than the block sizes, distinct experts of one row each (decode-like).
N, E, K, NOUT = 24, 6, 16, 8
GROUPS = {
    "mixed_with_empty": [5, 0, 13, 0, 3, 3],
    "one_expert": [0, 0, 24, 0, 0, 0],
    "padding_rows": [2, 0, 9, 1, 0, 0],
    "all_padding": [0, 0, 0, 0, 0, 0],
    "single_row": [0, 0, 0, 0, 0, 1],
    "last_expert_only_with_padding": [0, 0, 0, 0, 0, 7],
    "one_row_each": [1, 1, 1, 1, 1, 1],
}


def make_case(case, dtype, seed=0, shape=(N, E, K, NOUT)):
    n, e, k, nout = shape
    rng = np.random.default_rng(seed)
    rows = rng.standard_normal((n, k)).astype(np.float32)
    w = rng.standard_normal((e, k, nout)).astype(np.float32)  # the op's [E, K, Nout] layout
    return jnp.asarray(rows, dtype), jnp.asarray(w, dtype), jnp.asarray(GROUPS[case], jnp.int32)


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)


def check(got, want, rel, gs):
    assert got.shape == want.shape and got.dtype == want.dtype
    if np.abs(np.asarray(want, np.float64)).max() > 0:
        assert rel_err(got, want) <= rel
    total = int(np.asarray(gs).sum())
    assert not np.asarray(got, np.float64)[total:].any(), "padding rows must be 0"


def _strategies():
    """The unrolled-experts strategy (not chosen by grouped_matmul_cpu) compiles E conditionals: slow tier only."""
    return [pytest.param(name, marks=pytest.mark.slow) if name.startswith("experts") else name for name in STRATEGIES]


@in_own_process
@pytest.mark.parametrize("strategy", _strategies())
def test_f32_matches_reference(strategy):
    for case in GROUPS:
        rows, w, gs = make_case(case, jnp.float32)
        check(JITTED[strategy](rows, w, gs), reference(rows, w, gs), F32_REL, gs)


@in_own_process
@pytest.mark.parametrize("strategy", _strategies())
def test_bf16_matches_reference(strategy):
    for case in ("mixed_with_empty", "one_expert", "padding_rows", "one_row_each"):
        rows, w, gs = make_case(case, jnp.bfloat16, seed=1)
        check(JITTED[strategy](rows, w, gs), reference(rows, w, gs), BF16_REL, gs)


@in_own_process
@pytest.mark.parametrize("strategy", ["loop_b4", "batched_b4", "jnp", "cpu"])
def test_single_row_and_decode_shapes(strategy):
    # N=1 (block sizes clip to N) and a decode-like N=8 of 16 experts, 8 distinct ones routed.
    for shape, gs in (((1, 3, 8, 4), [0, 1, 0]), ((8, 16, 32, 16), [1, 0] * 8)):
        rows, w, _ = make_case("single_row", jnp.float32, shape=shape)
        gs = jnp.asarray(gs, jnp.int32)
        check(JITTED[strategy](rows, w, gs), reference(rows, w, gs), F32_REL, gs)


@in_own_process
def test_against_float64_numpy_loop():
    rows, w, gs = make_case("mixed_with_empty", jnp.float32, seed=2)
    r, wn, g = np.asarray(rows, np.float64), np.asarray(w, np.float64), np.asarray(gs)
    want = np.zeros((r.shape[0], wn.shape[2]))
    start = 0
    for e, size in enumerate(g):
        for i in range(start, start + size):
            for o in range(wn.shape[2]):
                want[i, o] = sum(r[i, j] * wn[e, j, o] for j in range(r.shape[1]))
        start += size
    assert rel_err(reference(rows, w, gs), want) <= F32_REL
    for name, fn in JITTED.items():
        assert rel_err(fn(rows, w, gs), want) <= F32_REL, name


@in_own_process
def test_block_bound_is_tight_enough():
    # Σ ceil(g/b) over every composition hitting the worst case: each non-empty group wastes b-1 rows at most.
    for n, e, b in [(8, 64, 4), (37, 6, 16), (100, 3, 7), (1, 1, 1)]:
        worst = n // b + (1 if n % b else 0)
        gs = [1] * (min(e, n) - 1) + [n - min(e, n) + 1]
        used = sum(-(-g // b) for g in gs)
        assert used <= gm.max_blocks(n, e, b) and worst <= gm.max_blocks(n, e, b)


def _run_in_a_fresh_process(marker: str) -> None:
    env = {**os.environ, "QCOMPILE_GMM_TESTS": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marker, __file__],
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " failed" not in run.stdout


@pytest.mark.skipif(IN_OWN_PROCESS, reason="the runner itself")
def test_strategies_in_a_fresh_process():
    _run_in_a_fresh_process("not slow")


@pytest.mark.slow
@pytest.mark.skipif(IN_OWN_PROCESS, reason="the runner itself")
def test_slow_strategies_in_a_fresh_process():
    """The slow-tier cases (the unrolled-experts strategy) in their own process too."""
    _run_in_a_fresh_process("slow")
