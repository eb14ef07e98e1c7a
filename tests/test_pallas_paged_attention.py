"""The Pallas ragged paged attention kernel (kernels/pallas_paged_attention.py) against the jnp reference: interpreted
plainly and with TPU semantics (uninitialised memory is NaN and the parallel KV-head axis runs on two simulated cores
with race detection), on ragged batches drawn fresh each run (empty sequences, decodes, prefills spanning several
query blocks and pages, GQA groups of 1-4, page sizes 4-16, f32 and bf16); pages past a sequence's live context are
never read (poisoned with NaN, the result is unchanged); lowered for platform tpu it is one Mosaic kernel.
The op-level comparison on the suite's prefill/decode/mixed batches is in tests/test_target_rules.py.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from qcompile.kernels.paged_attention import paged_attention_reference
from qcompile.kernels.pallas_paged_attention import paged_attention_pallas
from qcompile.kernels.ragged import token_layout


def _batch(rng, dtype, lengths, cached, page_size, kv_heads, groups, head_dim=16, spare_tokens=3):
    """A ragged batch: sequence b has cached[b] tokens in the cache and lengths[b] new ones (queries)."""
    pages_per_seq = -(-max(c + n for c, n in zip(cached, lengths)) // page_size) + 1
    num_seqs = len(lengths) + 1  # one padding sequence slot
    num_pages = num_seqs * pages_per_seq
    page_table = rng.permutation(num_pages).astype(np.int32).reshape(num_seqs, pages_per_seq)
    num_tokens = sum(lengths) + spare_tokens
    positions = np.zeros(num_tokens, np.int32)
    query_start = np.zeros(num_seqs + 1, np.int32)
    t = 0
    for b, (n, c) in enumerate(zip(lengths, cached)):
        positions[t:t + n] = np.arange(c, c + n)
        t += n
        query_start[b + 1] = t
    query_start[len(lengths) + 1:] = t
    k = rng.standard_normal((num_pages, page_size, kv_heads, head_dim)).astype(dtype)
    v = rng.standard_normal((num_pages, page_size, kv_heads, head_dim)).astype(dtype)
    q = rng.standard_normal((num_tokens, kv_heads * groups, head_dim)).astype(dtype)
    return q, k, v, positions, query_start, page_table


def _error(got, ref, query_start):
    valid = np.asarray(token_layout(query_start, got.shape[0]).valid)
    got64, ref64 = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert not np.any(got64[~valid]), "padding rows must come back 0"
    return np.abs(got64[valid] - ref64[valid]).max() / np.abs(ref64[valid]).max()


@pytest.mark.parametrize("interpret", [pytest.param("plain", marks=pytest.mark.slow), "tpu"])
def test_kernel_matches_the_reference_on_random_ragged_batches(interpret):
    from jax.experimental.pallas import tpu as pltpu

    mode = True if interpret == "plain" else pltpu.InterpretParams(num_cores_or_threads=2, detect_races=True)
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    for dtype, bound in ((np.float32, 1e-5), (ml_dtypes.bfloat16, 1.5e-2)):
        lengths = [int(n) for n in rng.choice([0, 1, 1, 5, 19], int(rng.integers(1, 4)))]
        lengths[0] = max(lengths[0], 1)
        cached = [int(c) for c in rng.integers(0, 30, len(lengths))]
        page_size, kv_heads, groups = int(rng.choice([4, 8, 16])), int(rng.integers(1, 3)), int(rng.integers(1, 5))
        q, k, v, pos, qs, pt = _batch(rng, dtype, lengths, cached, page_size, kv_heads, groups)
        scale = q.shape[2] ** -0.5
        ref = paged_attention_reference(q, k, v, pos, qs, pt, scale)
        got = paged_attention_pallas(q, k, v, pos, qs, pt, scale, interpret=mode)
        assert got.dtype == q.dtype
        err = _error(got, ref, qs)
        assert err <= bound, (f"seed {seed}: {np.dtype(dtype).name} lengths {lengths} cached {cached} page size "
                              f"{page_size} {kv_heads}x{groups} heads: relative error {err:.3g}")


def test_pages_past_the_live_context_are_never_read():
    """A decode token at position 2 with 4-token pages reads one page; the rest of its page table (and every page of
    other slots) holds NaN, which any read would spread into the result."""
    rng = np.random.default_rng(3)
    q, k, v, pos, qs, pt = _batch(rng, np.float32, [1, 3], [2, 4], 4, 2, 2)
    ref = paged_attention_reference(q, k, v, pos, qs, pt, 0.25)
    live = {int(pt[0, 0])} | {int(p) for p in pt[1, :2]}  # sequence 1: positions 4..6 reach its second page
    poisoned_k, poisoned_v = k.copy(), v.copy()
    for page in set(range(k.shape[0])) - live:
        poisoned_k[page] = np.nan
        poisoned_v[page] = np.nan
    got = paged_attention_pallas(q, poisoned_k, poisoned_v, pos, qs, pt, 0.25, interpret=True)
    assert np.isfinite(np.asarray(got)).all() and _error(got, ref, qs) <= 1e-5


def test_a_kernel_that_reads_one_page_too_few_is_caught(monkeypatch):
    """The comparison can fail: attention over every page but the last one a sequence reaches."""
    import jax

    from qcompile.kernels import pallas_paged_attention as kernel

    rng = np.random.default_rng(5)
    q, k, v, pos, qs, pt = _batch(rng, np.float32, [5], [6], 4, 1, 2)
    ref = paged_attention_reference(q, k, v, pos, qs, pt, 0.25)
    real_fori = jax.lax.fori_loop
    pages = {"calls": 0}

    def short_fori(lower, upper, body, init):  # the page loop is the only one whose init is a tuple of states
        if isinstance(init, tuple):
            pages["calls"] += 1
            return real_fori(lower, upper - 1, body, init)
        return real_fori(lower, upper, body, init)

    monkeypatch.setattr(jax.lax, "fori_loop", short_fori)
    got = kernel.paged_attention_pallas(q, k, v, pos, qs, pt, 0.25, interpret=True)
    monkeypatch.undo()
    assert pages["calls"] > 0 and _error(got, ref, qs) > 1e-2


def test_lowered_for_tpu_it_is_one_mosaic_kernel():
    import jax
    from jax import export

    q, k, v, pos, qs, pt = _batch(np.random.default_rng(0), np.float32, [1, 4], [3, 0], 8, 2, 2)
    fn = jax.jit(lambda *a: paged_attention_pallas(*a, 0.25, interpret=False))
    exported = export.export(fn, platforms=["tpu"])(*(jax.ShapeDtypeStruct(x.shape, x.dtype)
                                                      for x in (q, k, v, pos, qs, pt)))
    assert exported.mlir_module().count("@tpu_custom_call") == 1
