"""Kernel references (qcompile/kernels) against independent float64 NumPy loops written from spec/model.md §3.3, §3.5.

Every kernel is called through jax.jit in float32; the oracles below are plain per-sequence / per-token Python loops in
float64, deliberately not sharing any vectorised code with the kernels.

Tolerances. Errors are measured as max|kernel - f64| / max|f64| (relative to the largest magnitude of the compared
array). Spec §5 measures the fp32 chunked form at ~1e-7..4e-7 absolute on outputs of ~0.05 (≈2e-6..1e-5 relative,
the top end only at T = 512 with dk = dv = 128) and the recurrent form at ~1e-8 (≈2e-7 relative). Here sequences are
≤ 70 tokens with dk = 16, dv = 8, so fp32 rounding should sit around 1e-7..1e-6 relative; GDN_REL = 1e-5 leaves ~10x
headroom over that while still catching any real algebra mistake (a wrong decay order, a missing beta, a read before
the write, a state carried to the wrong slot all produce O(1e-2..1) relative errors). The conv is a 4-tap dot product
(CONV_REL = 1e-6) and attention a softmax over ≤ 16 keys (ATTN_REL = 2e-6), both only a few fp32 ulps of real error.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qcompile.kernels.causal_conv1d import causal_conv1d_reference
from qcompile.kernels.gdn import gdn_chunked_reference, gdn_recurrent_reference
from qcompile.kernels.paged_attention import kv_cache_write_reference, paged_attention_reference

GDN_REL = 1e-5
CONV_REL = 1e-6
ATTN_REL = 2e-6

recurrent_jit = jax.jit(gdn_recurrent_reference)
chunked_jit = jax.jit(gdn_chunked_reference, static_argnames="chunk")
conv_jit = jax.jit(causal_conv1d_reference, static_argnames="activation")
kv_write_jit = jax.jit(kv_cache_write_reference)
attention_jit = jax.jit(paged_attention_reference, static_argnames="scale")


def rel_err(got, want) -> float:
    want = np.asarray(want, np.float64)
    scale = max(float(np.max(np.abs(want))), 1e-30)
    return float(np.max(np.abs(np.asarray(got, np.float64) - want))) / scale


def assert_rel(got, want, tol, what=""):
    err = rel_err(got, want)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"
    return err


def starts(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


# ----------------------------------------------------------------------------------------------------------------
# Gated DeltaNet
# ----------------------------------------------------------------------------------------------------------------

H, DK, DV, S_GDN = 2, 16, 8, 4


def gdn_f64(q, k, v, g, beta, state, query_start, state_slots):
    """Spec §3.5 (f): per sequence, per token: decay, predict, delta write, read after the write. float64."""
    q, k, v, g, beta = (np.asarray(a, np.float64) for a in (q, k, v, g, beta))
    new_state = np.array(state, np.float64)
    out = np.zeros(v.shape, np.float64)  # padding slots stay zero
    query_start = np.asarray(query_start)
    for b, slot in enumerate(np.asarray(state_slots)):
        lo, hi = int(query_start[b]), int(query_start[b + 1])
        if hi == lo:
            continue
        s = new_state[slot].copy()  # [H,dk,dv]
        for t in range(lo, hi):
            for h in range(q.shape[1]):
                s[h] = np.exp(g[t, h]) * s[h]
                u = s[h].T @ k[t, h]
                s[h] = s[h] + np.outer(k[t, h], beta[t, h] * (v[t, h] - u))
                out[t, h] = s[h].T @ q[t, h]
        new_state[slot] = s
    return out, new_state


def l2(x, eps=1e-6):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def gdn_inputs(rng, num_tokens, decay_scale=1.0):
    """Realistic inputs: q,k L2-normalised (q scaled by dk^-0.5), g = -exp(A_log)·softplus(a) ≤ 0, beta = sigmoid(b)."""
    q = l2(rng.standard_normal((num_tokens, H, DK))) * DK**-0.5
    k = l2(rng.standard_normal((num_tokens, H, DK)))
    v = rng.standard_normal((num_tokens, H, DV))
    a_log = rng.uniform(-1.0, 0.5, size=H)
    g = -np.exp(a_log) * np.logaddexp(0.0, rng.standard_normal((num_tokens, H)) - 1.0) * decay_scale
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((num_tokens, H))))
    return [np.asarray(x, np.float32) for x in (q, k, v, g, beta)]


def gdn_state(rng, slots=S_GDN):
    return (0.5 * rng.standard_normal((slots, H, DK, DV))).astype(np.float32)


def run_gdn(fn, inputs, state, query_start, state_slots, **kw):
    args = [jnp.asarray(x) for x in inputs]
    o, s = fn(*args, jnp.asarray(state), jnp.asarray(query_start, jnp.int32), jnp.asarray(state_slots, jnp.int32), **kw)
    return np.asarray(o), np.asarray(s)


# The main ragged batch: lengths 1, 70, 5 and an unused row, 4 padding slots; slots permuted, slot 1 untouched and
# the unused row's slot out of range (≥ S), which must be ignored.
MAIN_T = 80
MAIN_LENGTHS = [1, 70, 5, 0]
MAIN_SLOTS = [2, 0, 3, S_GDN + 5]
UNTOUCHED = 1


def _check_gdn_batch(inputs, state, lengths, slots, chunk, tol=GDN_REL):
    qs = starts(lengths)
    want_o, want_s = gdn_f64(*inputs, state, qs, slots)
    rec_o, rec_s = run_gdn(recurrent_jit, inputs, state, qs, slots)
    chk_o, chk_s = run_gdn(chunked_jit, inputs, state, qs, slots, chunk=chunk)
    n = int(qs[-1])
    errs = {
        "recurrent o": assert_rel(rec_o[:n], want_o[:n], tol, "recurrent output vs f64"),
        "recurrent S": assert_rel(rec_s, want_s, tol, "recurrent state vs f64"),
        "chunked o": assert_rel(chk_o[:n], want_o[:n], tol, "chunked output vs f64"),
        "chunked S": assert_rel(chk_s, want_s, tol, "chunked state vs f64"),
        "chunk-rec o": assert_rel(chk_o[:n], rec_o[:n], tol, "chunked vs recurrent output"),
        "chunk-rec S": assert_rel(chk_s, rec_s, tol, "chunked vs recurrent state"),
    }
    touched = {int(s) for s, ln in zip(slots, lengths) if ln > 0 and s < state.shape[0]}
    for slot in range(state.shape[0]):
        if slot not in touched:
            np.testing.assert_array_equal(rec_s[slot], state[slot], err_msg=f"recurrent touched slot {slot}")
            np.testing.assert_array_equal(chk_s[slot], state[slot], err_msg=f"chunked touched slot {slot}")
    return errs, (rec_o, rec_s), (chk_o, chk_s)


@pytest.mark.parametrize("chunk", [64, 16])
def test_gdn_ragged_batch_matches_f64(chunk):
    rng = np.random.default_rng(0)
    inputs = gdn_inputs(rng, MAIN_T)
    state = gdn_state(rng)
    _, _, (chk_o, _) = _check_gdn_batch(inputs, state, MAIN_LENGTHS, MAIN_SLOTS, chunk)
    n = sum(MAIN_LENGTHS)
    np.testing.assert_array_equal(chk_o[n:], 0.0)  # chunked form zeroes the padding slots


def test_gdn_weak_decay_matches_f64():
    """Weak decay (g × 0.001) is where the chunk's (I+A)^-1 amplifies rounding most (spec §5 pitfall 9)."""
    rng = np.random.default_rng(1)
    inputs = gdn_inputs(rng, MAIN_T, decay_scale=1e-3)
    state = gdn_state(rng)
    _check_gdn_batch(inputs, state, MAIN_LENGTHS, MAIN_SLOTS, 64)


def test_gdn_zero_initial_state_single_sequence():
    """All slots zero, one long sequence in a non-zero slot, the rest unused (slots out of range)."""
    rng = np.random.default_rng(2)
    inputs = gdn_inputs(rng, MAIN_T)
    state = np.zeros((S_GDN, H, DK, DV), np.float32)
    _check_gdn_batch(inputs, state, [0, 77, 0, 0], [S_GDN + 1, 3, S_GDN, S_GDN + 2], 64)


@pytest.mark.parametrize("chunk", [16, 64])
def test_gdn_exact_chunk_multiples_no_padding(chunk):
    """Lengths that are exact multiples of the chunk, an empty row in the middle, and no padding slots at all."""
    rng = np.random.default_rng(5)
    inputs = gdn_inputs(rng, MAIN_T)
    state = gdn_state(rng)
    _check_gdn_batch(inputs, state, [16, 48, 0, 16], [3, 1, S_GDN + 7, 0], chunk)


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_gdn_padding_does_not_leak(form):
    """Garbage (large, finite) in the padding slots changes neither valid outputs nor any state, bit for bit."""
    rng = np.random.default_rng(3)
    inputs = gdn_inputs(rng, MAIN_T)
    state = gdn_state(rng)
    n = sum(MAIN_LENGTHS)
    garbage = [x.copy() for x in inputs]
    for x in garbage:
        x[n:] = rng.uniform(-50.0, 50.0, size=x[n:].shape).astype(np.float32)
    garbage[3][n:] = -np.abs(garbage[3][n:])  # keep g ≤ 0 (a log decay)
    fn, kw = (recurrent_jit, {}) if form == "recurrent" else (chunked_jit, {"chunk": 64})
    qs = starts(MAIN_LENGTHS)
    o1, s1 = run_gdn(fn, inputs, state, qs, MAIN_SLOTS, **kw)
    o2, s2 = run_gdn(fn, garbage, state, qs, MAIN_SLOTS, **kw)
    np.testing.assert_array_equal(o1[:n], o2[:n])
    np.testing.assert_array_equal(s1, s2)
    assert np.all(np.isfinite(o2))


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_gdn_continuation_two_steps_equals_one(form):
    """Running each sequence's tokens in two steps (state carried through the slot) equals running them in one."""
    rng = np.random.default_rng(4)
    lengths = [1, 70, 5, 0]
    first = [0, 33, 4, 0]  # seq 0 only in the second step; seq 2 gets a single decode token in the second step
    second = [a - b for a, b in zip(lengths, first)]
    inputs = gdn_inputs(rng, MAIN_T)
    state = gdn_state(rng)
    fn, kw = (recurrent_jit, {}) if form == "recurrent" else (chunked_jit, {"chunk": 64})

    qs_all, qs1, qs2 = starts(lengths), starts(first), starts(second)

    def pick(part_qs, offset):
        idx = np.full(MAIN_T, -1)
        for b in range(len(lengths)):
            seg = np.arange(part_qs[b], part_qs[b + 1])
            idx[seg] = qs_all[b] + offset[b] + (seg - part_qs[b])
        return idx

    idx1, idx2 = pick(qs1, [0] * 4), pick(qs2, first)

    def gather(idx):
        return [np.where((idx >= 0).reshape(-1, *[1] * (x.ndim - 1)), x[np.maximum(idx, 0)], 0).astype(np.float32)
                for x in inputs]

    o_one, s_one = run_gdn(fn, inputs, state, qs_all, MAIN_SLOTS, **kw)
    o1, s_mid = run_gdn(fn, gather(idx1), state, qs1, MAIN_SLOTS, **kw)
    o2, s_two = run_gdn(fn, gather(idx2), s_mid, qs2, MAIN_SLOTS, **kw)
    o_split = np.zeros_like(o_one)
    o_split[idx1[idx1 >= 0]] = o1[idx1 >= 0]
    o_split[idx2[idx2 >= 0]] = o2[idx2 >= 0]
    n = sum(lengths)
    assert_rel(o_split[:n], o_one[:n], GDN_REL, "two-step vs one-step output")
    assert_rel(s_two, s_one, GDN_REL, "two-step vs one-step state")
    want_o, want_s = gdn_f64(*inputs, state, qs_all, MAIN_SLOTS)
    assert_rel(o_split[:n], want_o[:n], GDN_REL, "two-step output vs f64")
    assert_rel(s_two, want_s, GDN_REL, "two-step state vs f64")
    np.testing.assert_array_equal(s_two[UNTOUCHED], state[UNTOUCHED])


HYP_BUCKETS = (48, 128)  # T is the smallest bucket holding the tokens plus random padding: few shapes to compile


@settings(max_examples=15, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 40), min_size=3, max_size=3),
    active=st.integers(1, 3),
    extra_pad=st.integers(0, 7),
    slot_perm=st.permutations(range(S_GDN)),
    seed=st.integers(0, 2**31 - 1),
)
def test_gdn_chunked_equals_recurrent_property(lengths, active, extra_pad, slot_perm, seed):
    lengths = [ln if b < active else 0 for b, ln in enumerate(lengths)]
    total = sum(lengths)
    num_tokens = next(t for t in HYP_BUCKETS if t >= total + extra_pad)
    slots = [s if ln > 0 else S_GDN + b for b, (s, ln) in enumerate(zip(slot_perm[:3], lengths))]
    rng = np.random.default_rng(seed)
    inputs = gdn_inputs(rng, num_tokens)
    state = gdn_state(rng)
    qs = starts(lengths)
    rec_o, rec_s = run_gdn(recurrent_jit, inputs, state, qs, slots)
    chk_o, chk_s = run_gdn(chunked_jit, inputs, state, qs, slots, chunk=16)
    if total:
        assert_rel(chk_o[:total], rec_o[:total], GDN_REL, "chunked vs recurrent output")
    assert_rel(chk_s, rec_s, GDN_REL, "chunked vs recurrent state")
    touched = {s for s, ln in zip(slots, lengths) if ln > 0}
    for slot in set(range(S_GDN)) - touched:
        np.testing.assert_array_equal(rec_s[slot], state[slot])
        np.testing.assert_array_equal(chk_s[slot], state[slot])
    if total and seed % 3 == 0:  # spot-check against the f64 loop too (it is the slow part)
        want_o, want_s = gdn_f64(*inputs, state, qs, slots)
        assert_rel(chk_o[:total], want_o[:total], GDN_REL, "chunked vs f64")
        assert_rel(rec_s, want_s, GDN_REL, "recurrent state vs f64")


# ----------------------------------------------------------------------------------------------------------------
# Causal depthwise conv1d
# ----------------------------------------------------------------------------------------------------------------

C_CONV, K_CONV, S_CONV, T_CONV = 6, 4, 4, 12


def conv_f64(x, state, weight, query_start, state_slots, activation="silu"):
    """Spec §3.5 (b): Y[t,c] = act(Σ_j w[c,j]·X[t-(K-1)+j, c]) with X before the sequence start read from the slot."""
    x, weight = np.asarray(x, np.float64), np.asarray(weight, np.float64)
    new_state = np.array(state, np.float64)
    kernel = weight.shape[1]
    y = np.zeros(x.shape, np.float64)
    for b, slot in enumerate(np.asarray(state_slots)):
        lo, hi = int(query_start[b]), int(query_start[b + 1])
        if hi == lo:
            continue
        history = new_state[slot].T  # [K-1, C], row K-2 most recent
        seq = np.concatenate([history, x[lo:hi]], axis=0)  # [K-1+n, C]
        for i in range(hi - lo):
            acc = np.zeros(x.shape[1])
            for j in range(kernel):
                acc += weight[:, j] * seq[i + j]  # seq index (K-1)+i-(K-1)+j
            y[lo + i] = acc / (1.0 + np.exp(-acc)) if activation == "silu" else acc
        new_state[slot] = seq[-(kernel - 1):].T
    return y, new_state


def conv_case(rng):
    x = rng.standard_normal((T_CONV, C_CONV)).astype(np.float32)
    state = rng.standard_normal((S_CONV, C_CONV, K_CONV - 1)).astype(np.float32)
    weight = (0.5 * rng.standard_normal((C_CONV, K_CONV))).astype(np.float32)
    return x, state, weight


def run_conv(x, state, weight, qs, slots, activation="silu"):
    y, s = conv_jit(jnp.asarray(x), jnp.asarray(state), jnp.asarray(weight), jnp.asarray(qs, jnp.int32),
                    jnp.asarray(slots, jnp.int32), activation=activation)
    return np.asarray(y), np.asarray(s)


CONV_LENGTHS = [1, 2, 6, 0]
CONV_SLOTS = [3, 0, 2, S_CONV + 2]  # slot 1 untouched; unused row's slot out of range


@pytest.mark.parametrize("activation", ["silu", None])
def test_conv_ragged_batch_matches_f64(activation):
    rng = np.random.default_rng(10)
    x, state, weight = conv_case(rng)
    qs = starts(CONV_LENGTHS)
    y, new_state = run_conv(x, state, weight, qs, CONV_SLOTS, activation)
    want_y, want_s = conv_f64(x, state, weight, qs, CONV_SLOTS, activation)
    n = int(qs[-1])
    assert_rel(y[:n], want_y[:n], CONV_REL, "conv output")
    np.testing.assert_array_equal(new_state, want_s.astype(np.float32))  # state is a pure copy: exact
    np.testing.assert_array_equal(new_state[1], state[1])


def test_conv_padding_does_not_leak():
    rng = np.random.default_rng(11)
    x, state, weight = conv_case(rng)
    qs = starts(CONV_LENGTHS)
    n = int(qs[-1])
    x2 = x.copy()
    x2[n:] = 1e3 * rng.standard_normal(x2[n:].shape)
    y1, s1 = run_conv(x, state, weight, qs, CONV_SLOTS)
    y2, s2 = run_conv(x2, state, weight, qs, CONV_SLOTS)
    np.testing.assert_array_equal(y1[:n], y2[:n])
    np.testing.assert_array_equal(s1, s2)


def test_conv_continuation_two_steps_equals_one():
    """Tokens split over two steps (1+0, 1+1, 2+4 tokens) give the same outputs and state as one step."""
    rng = np.random.default_rng(12)
    x, state, weight = conv_case(rng)
    lengths, first = CONV_LENGTHS, [1, 1, 2, 0]
    second = [a - b for a, b in zip(lengths, first)]
    qs_all, qs1, qs2 = starts(lengths), starts(first), starts(second)
    x1, x2 = np.zeros_like(x), np.zeros_like(x)
    for b in range(len(lengths)):
        x1[qs1[b]:qs1[b + 1]] = x[qs_all[b]:qs_all[b] + first[b]]
        x2[qs2[b]:qs2[b + 1]] = x[qs_all[b] + first[b]:qs_all[b + 1]]
    y_one, s_one = run_conv(x, state, weight, qs_all, CONV_SLOTS)
    y1, s_mid = run_conv(x1, state, weight, qs1, CONV_SLOTS)
    y2, s_two = run_conv(x2, s_mid, weight, qs2, CONV_SLOTS)
    for b in range(len(lengths)):
        np.testing.assert_allclose(y1[qs1[b]:qs1[b + 1]], y_one[qs_all[b]:qs_all[b] + first[b]], rtol=0, atol=1e-6)
        np.testing.assert_allclose(y2[qs2[b]:qs2[b + 1]], y_one[qs_all[b] + first[b]:qs_all[b + 1]], rtol=0, atol=1e-6)
    np.testing.assert_array_equal(s_two, s_one)


# ----------------------------------------------------------------------------------------------------------------
# Paged KV cache write + causal GQA attention
# ----------------------------------------------------------------------------------------------------------------

PAGE_SIZE, NUM_PAGES, PAGES_PER_SEQ, HD, HQ, T_ATTN = 4, 16, 4, 8, 4, 16
# Per sequence: (cached history length, new tokens this step). Seq 0: history 7 + chunk 5 (crosses pages);
# seq 1: fresh prefill of 6; seq 2: decode of 1 after 9 cached; seq 3: unused row.
ATTN_SEQS = [(7, 5), (0, 6), (9, 1), (0, 0)]


def attention_f64(q, keys, values, scale):
    """Dense causal GQA attention of one sequence: q [n,Hq,hd] at the last n positions of keys/values [L,Hkv,hd]."""
    q, keys, values = (np.asarray(a, np.float64) for a in (q, keys, values))
    n, hq, _ = q.shape
    length, hkv = keys.shape[:2]
    out = np.zeros(q.shape)
    for i in range(n):
        pos = length - n + i
        for j in range(hq):
            kv = j // (hq // hkv)
            scores = np.array([q[i, j] @ keys[p, kv] for p in range(pos + 1)]) * scale
            w = np.exp(scores - scores.max())
            w /= w.sum()
            out[i, j] = sum(w[p] * values[p, kv] for p in range(pos + 1))
    return out


def make_page_table(rng):
    """Distinct, shuffled (non-contiguous, out-of-order) pages per sequence; the unused row points at live pages."""
    perm = rng.permutation(NUM_PAGES)
    table = perm[: 4 * PAGES_PER_SEQ].reshape(4, PAGES_PER_SEQ).copy()
    table[3] = table[0]  # unused row aliases seq 0's pages: must not matter since it has no tokens
    return table.astype(np.int32)


def pack_step(rows):
    """rows: per sequence (positions, k, v, q or None) -> padded [T_ATTN] arrays + query_start."""
    lengths = [len(r[0]) for r in rows]
    qs = starts(lengths)
    n = int(qs[-1])
    positions = np.zeros(T_ATTN, np.int32)
    positions[n:] = np.arange(T_ATTN - n) % (PAGES_PER_SEQ * PAGE_SIZE)  # padding positions look plausible
    packed = {}
    for name, col in (("k", 1), ("v", 2), ("q", 3)):
        parts = [r[col] for r in rows if len(r[0])]
        if parts[0] is None:
            continue
        body = np.concatenate(parts)
        pad = 1e3 * np.ones((T_ATTN - n, *body.shape[1:]), np.float32)  # loud garbage in padding rows
        packed[name] = np.concatenate([body, pad]).astype(np.float32)
    positions[:n] = np.concatenate([r[0] for r in rows if len(r[0])])
    return qs, positions, packed


@pytest.mark.parametrize("hkv", [2, 1])
def test_paged_attention_matches_dense_f64(hkv):
    rng = np.random.default_rng(20 + hkv)
    table = make_page_table(rng)
    hist = [(rng.standard_normal((h, hkv, HD)).astype(np.float32), rng.standard_normal((h, hkv, HD)).astype(np.float32))
            for h, _ in ATTN_SEQS]
    new = [(rng.standard_normal((n, hkv, HD)).astype(np.float32), rng.standard_normal((n, hkv, HD)).astype(np.float32),
            rng.standard_normal((n, HQ, HD)).astype(np.float32)) for _, n in ATTN_SEQS]
    k_pages = rng.standard_normal((NUM_PAGES, PAGE_SIZE, hkv, HD)).astype(np.float32)  # stale junk everywhere
    v_pages = rng.standard_normal((NUM_PAGES, PAGE_SIZE, hkv, HD)).astype(np.float32)
    jtable = jnp.asarray(table)

    def write(pages, kv, positions, qs):
        return np.asarray(kv_write_jit(jnp.asarray(pages), jnp.asarray(kv), jnp.asarray(positions), jnp.asarray(qs),
                                       jtable))

    def check_write(before, after, rows, qs, positions, kv):
        expected = before.copy()
        for b, (pos, _, _, _) in enumerate(rows):
            for i, p in enumerate(pos):
                expected[table[b, p // PAGE_SIZE], p % PAGE_SIZE] = kv[qs[b] + i]
        np.testing.assert_array_equal(after, expected)  # written rows exact, every other row bit-identical

    # Step 1: write the cached history (padding rows carry garbage and must not land anywhere).
    rows1 = [(np.arange(h, dtype=np.int32), hk, hv, None) for (h, _), (hk, hv) in zip(ATTN_SEQS, hist)]
    qs1, pos1, p1 = pack_step(rows1)
    k1, v1 = write(k_pages, p1["k"], pos1, qs1), write(v_pages, p1["v"], pos1, qs1)
    check_write(k_pages, k1, rows1, qs1, pos1, p1["k"])
    check_write(v_pages, v1, rows1, qs1, pos1, p1["v"])

    # Step 2: write the new chunk, then attend.
    rows2 = [(np.arange(h, h + n, dtype=np.int32), nk, nv, nq) for (h, n), (nk, nv, nq) in zip(ATTN_SEQS, new)]
    qs2, pos2, p2 = pack_step(rows2)
    k2, v2 = write(k1, p2["k"], pos2, qs2), write(v1, p2["v"], pos2, qs2)
    check_write(k1, k2, rows2, qs2, pos2, p2["k"])
    check_write(v1, v2, rows2, qs2, pos2, p2["v"])

    scale = HD**-0.5
    out = np.asarray(attention_jit(jnp.asarray(p2["q"]), jnp.asarray(k2), jnp.asarray(v2), jnp.asarray(pos2),
                                   jnp.asarray(qs2), jtable, scale=scale))
    assert np.all(np.isfinite(out))
    for b, ((h, n), (hk, hv), (nk, nv, nq)) in enumerate(zip(ATTN_SEQS, hist, new)):
        if n == 0:
            continue
        want = attention_f64(nq, np.concatenate([hk, nk]), np.concatenate([hv, nv]), scale)
        assert_rel(out[qs2[b]:qs2[b + 1]], want, ATTN_REL, f"attention seq {b}")
