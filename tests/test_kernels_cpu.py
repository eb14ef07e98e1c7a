"""CPU kernels (paged_attention_cpu, gdn_recurrence_cpu, causal_conv1d_cpu) against their jnp references.

Random ragged batches: decode, prefill, mixed, empty sequences, padding slots, shuffled and shared pages, GQA.
Errors are max|new - reference| / max|reference| over every row (padding rows included: the new kernels give the
references' padding values); 1e-5 for f32 inputs, 1e-2 for bf16 inputs. The GDN reference is the op's auto mode
(recurrent when T <= B, chunked otherwise), which is what gdn_recurrence_cpu follows row for row.
"""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qcompile.kernels.causal_conv1d import causal_conv1d_cpu, causal_conv1d_reference
from qcompile.kernels.gdn import gdn_chunked_reference, gdn_recurrence_cpu, gdn_recurrent_reference
from qcompile.kernels.paged_attention import paged_attention_cpu, paged_attention_reference

F32_REL, BF16_REL = 1e-5, 1e-2


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.all(np.isfinite(got))
    return float(np.max(np.abs(got - want))) / max(float(np.max(np.abs(want))), 1e-30)


def starts(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


# ----------------------------------------------------------------------------------------------------------------
# Paged attention
# ----------------------------------------------------------------------------------------------------------------

PS, HD, M = 4, 16, 12  # page size, head dim, pages per sequence (max_context 48)


def attention_batch(rng, lengths, history, num_tokens, hq, hkv, dtype=np.float32, shared=False):
    """Pages shuffled across sequences; with shared=True later sequences reuse an earlier sequence's first pages
    (a shared prefix) and unused table entries point at live pages of other sequences."""
    num_seqs = len(lengths)
    num_pages = num_seqs * M + 3
    table = rng.permutation(num_pages)[: num_seqs * M].reshape(num_seqs, M).astype(np.int32)
    if shared and num_seqs > 1:
        table[1:, :2] = table[0, :2]
        table[-1, 6:] = table[0, :6]
    qs = starts(lengths)
    positions = rng.integers(0, M * PS, num_tokens).astype(np.int32)  # padding rows: plausible junk
    for b, (n, h) in enumerate(zip(lengths, history)):
        positions[qs[b]:qs[b + 1]] = np.arange(h, h + n)
    k_pages = rng.standard_normal((num_pages, PS, hkv, HD)).astype(dtype)
    v_pages = rng.standard_normal((num_pages, PS, hkv, HD)).astype(dtype)
    q = (2 * rng.standard_normal((num_tokens, hq, HD))).astype(dtype)
    return [jnp.asarray(a) for a in (q, k_pages, v_pages, positions, qs, table)]


attention_ref = jax.jit(paged_attention_reference, static_argnames="scale")
attention_new = jax.jit(paged_attention_cpu, static_argnames=("scale", "decode_block_pages", "prefill_block_pages",
                                                              "tile"))

# (lengths, history, T), all with B = 6 and T = 6 (T <= B: every token is a vectorised item) or T = 32 (T > B: decode
# rows vectorised, multi-token sequences in query tiles), so that the cases share two compiled shapes.
ATTN_CASES = {
    "decode": ([1] * 6, [5, 17, 0, 40, 33, 11], 6),
    "decode_padded_bucket": ([1, 1, 1, 0, 0, 0], [8, 47, 20, 0, 0, 0], 6),
    "mixed_small_bucket": ([3, 1, 0, 1, 0, 0], [2, 9, 0, 30, 0, 0], 6),
    "decode_padding_T_gt_B": ([1, 1, 1, 0, 0, 0], [3, 30, 12, 0, 0, 0], 32),
    "prefill_one": ([29, 0, 0, 0, 0, 0], [0] * 6, 32),
    "prefill_continuation": ([0, 13, 0, 0, 0, 0], [0, 30, 0, 0, 0, 0], 32),
    "mixed": ([1, 9, 0, 1, 14, 2], [20, 3, 0, 44, 0, 30], 32),
    "empty_and_padding": ([0, 5, 0, 0, 0, 0], [0, 22, 0, 0, 0, 0], 32),
}


@pytest.mark.parametrize("name", sorted(ATTN_CASES))
def test_paged_attention_cpu_matches_reference(name):
    """GQA 4:2, pages shuffled and shared between sequences; default and small blocks / tiles."""
    lengths, history, num_tokens = ATTN_CASES[name]
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    args = attention_batch(rng, lengths, history, num_tokens, 4, 2, shared=True)
    scale = HD**-0.5
    want = attention_ref(*args, scale=scale)
    assert rel_err(attention_new(*args, scale=scale), want) <= F32_REL
    # Small blocks and tiles: several KV blocks, several tiles per sequence, tiles ending mid-sequence.
    got = attention_new(*args, scale=scale, decode_block_pages=1, prefill_block_pages=2, tile=4)
    assert rel_err(got, want) <= F32_REL


@pytest.mark.parametrize("hq,hkv", [(4, 1), (6, 2)])
@pytest.mark.parametrize("name", ["decode", "mixed"])
def test_paged_attention_cpu_gqa_ratios(name, hq, hkv):
    lengths, history, num_tokens = ATTN_CASES[name]
    rng = np.random.default_rng(zlib.crc32(f"{name}/{hq}/{hkv}".encode()))
    args = attention_batch(rng, lengths, history, num_tokens, hq, hkv)
    want = attention_ref(*args, scale=0.3)
    assert rel_err(attention_new(*args, scale=0.3), want) <= F32_REL


def test_paged_attention_cpu_bf16():
    rng = np.random.default_rng(7)
    lengths, history, num_tokens = ATTN_CASES["mixed"]
    args = attention_batch(rng, lengths, history, num_tokens, 4, 2, dtype=jnp.bfloat16)
    want = attention_ref(*args, scale=HD**-0.5)
    got = attention_new(*args, scale=HD**-0.5)
    assert got.dtype == jnp.bfloat16
    assert rel_err(got, want) <= BF16_REL


def test_paged_attention_cpu_ignores_dead_context():
    """Keys past every token's position (stale pages, huge values) never matter, and max_context does not either."""
    rng = np.random.default_rng(3)
    q, k_pages, v_pages, positions, qs, table = attention_batch(rng, [1, 4, 0, 0, 0, 0], [10, 2, 0, 0, 0, 0], 32, 4, 2)
    want = attention_new(q, k_pages, v_pages, positions, qs, table, scale=0.25)
    live = np.zeros(k_pages.shape[:2], bool)
    for b, (lo, hi) in enumerate(zip(np.asarray(qs)[:-1], np.asarray(qs)[1:])):
        if hi == lo:
            continue
        for p in range(int(np.asarray(positions)[hi - 1]) + 1):
            live[np.asarray(table)[b, p // PS], p % PS] = True
    junk = jnp.asarray(np.where(live[..., None, None], 0.0, 1e4).astype(np.float32))
    got = attention_new(q, k_pages + junk, v_pages + junk, positions, qs, table, scale=0.25)
    valid = np.arange(32) < int(qs[-1])
    np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(want)[valid], rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------------------------------------------
# GDN recurrence
# ----------------------------------------------------------------------------------------------------------------

GH, DK, DV = 2, 16, 8


def gdn_batch(rng, lengths, num_tokens, num_slots):
    def l2(x):
        return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)

    q = l2(rng.standard_normal((num_tokens, GH, DK))) * DK**-0.5
    k = l2(rng.standard_normal((num_tokens, GH, DK)))
    v = rng.standard_normal((num_tokens, GH, DV))
    g = -np.abs(rng.standard_normal((num_tokens, GH))) * 0.5
    beta = rng.uniform(0, 1, (num_tokens, GH))
    state = rng.standard_normal((num_slots, GH, DK, DV))
    slots = rng.permutation(num_slots)[: len(lengths)].astype(np.int32)
    return [jnp.asarray(a.astype(np.float32)) for a in (q, k, v, g, beta, state)] + [
        jnp.asarray(starts(lengths)), jnp.asarray(slots)]


gdn_new = jax.jit(gdn_recurrence_cpu, static_argnames=("chunk", "chunked_min_tokens"))
gdn_rec = jax.jit(gdn_recurrent_reference)
gdn_chk = jax.jit(gdn_chunked_reference, static_argnames="chunk")

GDN_CASES = {  # (lengths, T, slots): shapes (B 8, T 8, S 8), (B 8, T 4, S 8) (S > T: scan only), (B 4, T 40, S 6)
    "decode": ([1] * 8, 8, 8),
    "decode_padded_bucket": ([1, 1, 0, 1, 0, 1, 1, 0], 8, 8),
    "decode_more_slots_than_tokens": ([0, 1, 0, 1, 1, 0, 0, 0], 4, 8),
    "mixed_T_le_B": ([3, 1, 0, 2, 0, 0, 0, 0], 8, 8),
    "empty": ([0] * 8, 8, 8),
    "decode_T_gt_B": ([1, 0, 1, 1], 40, 6),  # one-step path, padding rows zero (the chunked reference's rule)
    "mixed_T_gt_B": ([20, 1, 0, 9], 40, 6),
    "prefill_one": ([37, 0, 0, 0], 40, 6),
}


@pytest.mark.parametrize("name,chunked_min_tokens", [(name, None) for name in sorted(GDN_CASES)] + [
    (name, 0) for name in ("decode_T_gt_B", "mixed_T_gt_B", "prefill_one")])  # 0: chunked form when T > B
def test_gdn_recurrence_cpu_matches_auto_reference(name, chunked_min_tokens):
    lengths, num_tokens, num_slots = GDN_CASES[name]
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    args = gdn_batch(rng, lengths, num_tokens, num_slots)
    chunk = 8
    if num_tokens <= len(lengths):
        want_out, want_state = gdn_rec(*args)
    else:
        want_out, want_state = gdn_chk(*args, chunk=chunk)
    got_out, got_state = gdn_new(*args, chunk=chunk, chunked_min_tokens=chunked_min_tokens)
    assert rel_err(got_out, want_out) <= F32_REL
    assert rel_err(got_state, want_state) <= F32_REL
    untouched = np.setdiff1d(np.arange(num_slots), np.asarray(args[-1])[np.asarray(lengths) > 0])
    np.testing.assert_array_equal(np.asarray(got_state)[untouched], np.asarray(args[5])[untouched])


def test_gdn_recurrence_cpu_decode_steps_chain():
    """Three decode steps equal one 3-token recurrent step of each sequence (the one-step path carries state)."""
    rng = np.random.default_rng(11)
    q, k, v, g, beta, state, _, _ = gdn_batch(rng, [3, 3], 6, 2)
    slots = jnp.asarray([1, 0], jnp.int32)
    want_out, want_state = gdn_rec(q, k, v, g, beta, state, jnp.asarray([0, 3, 6], jnp.int32), slots)
    s, outs = state, []
    for i in range(3):
        rows = jnp.asarray([i, 3 + i])
        o, s = gdn_new(q[rows], k[rows], v[rows], g[rows], beta[rows], s, jnp.asarray([0, 1, 2], jnp.int32), slots)
        outs.append(o)
    got_out = jnp.stack(outs, axis=1).reshape(6, GH, DV)
    assert rel_err(got_out, want_out) <= F32_REL
    assert rel_err(s, want_state) <= F32_REL


# ----------------------------------------------------------------------------------------------------------------
# Causal conv1d
# ----------------------------------------------------------------------------------------------------------------

CONV_CASES = {  # lengths; all with T = 16 and 8 state slots (one compiled shape)
    "decode": [1] * 6,
    "decode_padded": [1, 0, 1, 0, 0, 1],
    "prefill": [15, 0, 0, 0, 0, 0],
    "mixed": [1, 2, 0, 7, 1, 3],
    "short_sequences": [2, 1, 2, 3, 0, 0],  # fewer new tokens than taps: state columns shift
}


@functools.lru_cache(maxsize=None)
def _conv_jits(activation):
    return (jax.jit(functools.partial(causal_conv1d_reference, activation=activation)),
            jax.jit(functools.partial(causal_conv1d_cpu, activation=activation)))


@pytest.mark.parametrize("name", sorted(CONV_CASES))
@pytest.mark.parametrize("activation,dtype", [("silu", np.float32), (None, np.float32), ("silu", jnp.bfloat16)])
def test_causal_conv1d_cpu_matches_reference(name, activation, dtype):
    lengths, num_tokens, num_slots = CONV_CASES[name], 16, 8
    rng = np.random.default_rng(zlib.crc32(f"{name}/{activation}".encode()))
    channels, width = 24, 3
    x = jnp.asarray(rng.standard_normal((num_tokens, channels)).astype(dtype))
    state = jnp.asarray(rng.standard_normal((num_slots, channels, width)).astype(dtype))
    weight = jnp.asarray(rng.standard_normal((channels, width + 1)).astype(dtype))
    slots = jnp.asarray(rng.permutation(num_slots)[: len(lengths)].astype(np.int32))
    ref, new = _conv_jits(activation)
    args = (x, state, weight, jnp.asarray(starts(lengths)), slots)
    (want_y, want_state), (got_y, got_state) = ref(*args), new(*args)
    assert got_y.dtype == want_y.dtype and got_state.dtype == want_state.dtype
    assert rel_err(got_y, want_y) <= (F32_REL if dtype == np.float32 else BF16_REL)
    np.testing.assert_array_equal(np.asarray(got_state, np.float32), np.asarray(want_state, np.float32))
