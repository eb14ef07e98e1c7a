"""Gated DeltaNet delta rule over a ragged batch: a recurrent form (decode) and a chunked form (prefill).

Both take q, k already L2-normalised (q also scaled by dk^-0.5) and expanded to the value heads, work in f32, and
keep one state per sequence in a slot array S[slot] ∈ R^{Hv×dk×dv} (spec/model.md §3.5 f–g):

    S = exp(g)·S;  S = S + k ⊗ β(v − Sᵀk);  o = Sᵀq          (read after the write)

Recurrent: one scan step per token slot, gathering and scattering that token's sequence state.
Chunked: each sequence's tokens are laid out in chunks of C (zero padded: padded rows have g = β = k = 0, which
leaves the state exactly unchanged); one scan step per chunk solves the chunk in closed form with a unit-triangular
solve. The two agree to f32 rounding.
Native (CPU, f32): the recurrent form in C++ (kernels/native/gdn_recurrent_f32.cc), sequences × heads in parallel,
each state updated in place with one read pass and one write pass per token.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from qcompile.kernels import native
from qcompile.kernels.ragged import slot_or_drop, token_layout

HIGHEST = jax.lax.Precision.HIGHEST


def _mm(spec, *args):
    return jnp.einsum(spec, *args, precision=HIGHEST)


def l2_normalize(x, eps: float = 1e-6):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def normalized_heads(q, k, v):
    """The recurrence's inputs from the conv's: q, k [T,Hk,dk] L2-normalised over dk (q also scaled by dk^-0.5) and
    repeated to the value heads (value head j reads key head j // (Hv/Hk)); all three in f32."""
    ratio = v.shape[1] // q.shape[1]
    dk = q.shape[2]
    qf = jnp.repeat(l2_normalize(q.astype(jnp.float32)) * dk**-0.5, ratio, axis=1)
    kf = jnp.repeat(l2_normalize(k.astype(jnp.float32)), ratio, axis=1)
    return qf, kf, v.astype(jnp.float32)


def gdn_recurrent_reference(q, k, v, g, beta, state, query_start, state_slots):
    """q,k [T,H,dk], v [T,H,dv], g,beta [T,H] (f32), state [S,H,dk,dv] f32 -> (o [T,H,dv] f32, new state)."""
    num_tokens = q.shape[0]
    num_slots = state.shape[0]
    lay = token_layout(query_start, num_tokens)
    slots = slot_or_drop(lay.valid, state_slots[lay.seq], num_slots)

    def step(states, xs):
        qt, kt, vt, gt, bt, slot = xs
        s = states.at[slot].get(mode="fill", fill_value=0.0)  # [H,dk,dv]
        s = s * jnp.exp(gt)[:, None, None]
        predicted = _mm("hkv,hk->hv", s, kt)
        s = s + kt[:, :, None] * (bt[:, None] * (vt - predicted))[:, None, :]
        out = _mm("hkv,hk->hv", s, qt)
        return states.at[slot].set(s, mode="drop"), out

    new_state, out = jax.lax.scan(step, state, (q, k, v, g, beta, slots))
    return out, new_state


def _chunk_layout(query_start, num_tokens: int, chunk: int):
    """Padded position of each token and (sequence, used) of each chunk in a chunk-aligned ragged layout."""
    num_seqs = query_start.shape[0] - 1
    lay = token_layout(query_start, num_tokens)
    padded = (lay.lengths + chunk - 1) // chunk * chunk
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(padded).astype(jnp.int32)])
    num_chunks = -(-(num_tokens + num_seqs * (chunk - 1)) // chunk)
    position = jnp.where(lay.valid, offsets[lay.seq] + lay.local, num_chunks * chunk)
    start = jnp.arange(num_chunks, dtype=jnp.int32) * chunk
    chunk_seq = jnp.clip(jnp.searchsorted(offsets[:-1], start, side="right").astype(jnp.int32) - 1, 0, num_seqs - 1)
    used = start < offsets[chunk_seq] + padded[chunk_seq]
    return lay, position, chunk_seq, used, num_chunks


def _unit_lower_solve(a, rhs):
    """X with (I + a) X = rhs, a [H,C,C] strictly lower triangular, rhs [H,C,n]: forward substitution, one row at a
    time (rows not yet solved are zero, and a is zero on and above the diagonal, so each row reads only solved ones).

    Not jax.scipy.linalg.solve_triangular: on the CPU its LAPACK kernel splits the batch over the host's intra-op
    thread pool and blocks on it, and with several simulated devices running one program (a mesh) those blocked
    kernels can hold every pool thread — the step deadlocked about one run in six on 8 CPU devices (gdb: all workers
    in jax::ParallelBatchMap under lapack_strsm_ffi). transformers solves it the same way, row by row."""

    def row(i, x):
        return x.at[:, i].set(rhs[:, i] - _mm("hj,hjn->hn", a[:, i], x))

    return jax.lax.fori_loop(0, a.shape[1], row, jnp.zeros_like(rhs))


def _solve_chunk(s, q, k, v, g, beta):
    """One chunk for all heads. s [H,dk,dv]; q,k [C,H,dk]; v [C,H,dv]; g,beta [C,H]."""
    size = q.shape[0]
    gamma = jnp.cumsum(g, axis=0)  # [C,H]
    # log Γ_ij = Σ_{j<t≤i} g_t, summed over the segment itself, not as γ_i − γ_j: the prefix sums γ reach −10³ within
    # one chunk (g down to −30 per token), where their f32 rounding (|γ|·2⁻²⁴ ≈ 5e-5) became a relative error of Γ_ij
    # and cost 10x in the outputs against float64. A segment of same-signed terms sums to f32 relative precision.
    # Zero above the diagonal (those entries are masked below).
    pos = jnp.arange(size)
    seg = jnp.cumsum(jnp.where((pos[:, None] > pos[None, :])[:, :, None], g[:, None, :], 0.0), axis=0)  # [i,j,H]
    causal = jnp.tril(jnp.ones((size, size), bool))[:, :, None]
    decay = jnp.where(causal, jnp.exp(seg), 0.0)  # Γ_ij, diagonal 1
    strict = jnp.tril(jnp.ones((size, size), bool), -1)[:, :, None]
    a = jnp.where(strict, beta[:, None, :] * _mm("ihd,jhd->ijh", k, k) * decay, 0.0)
    rhs = jnp.concatenate([beta[..., None] * v, (beta * jnp.exp(gamma))[..., None] * k], axis=-1)  # [C,H,dv+dk]
    sol = _unit_lower_solve(jnp.moveaxis(a, 2, 0), jnp.moveaxis(rhs, 1, 0))  # [H,C,dv+dk]
    dv = v.shape[-1]
    u, w = jnp.moveaxis(sol[..., :dv], 0, 1), jnp.moveaxis(sol[..., dv:], 0, 1)  # [C,H,dv], [C,H,dk]
    v_new = u - _mm("chk,hkv->chv", w, s)
    out = _mm("chk,hkv->chv", q * jnp.exp(gamma)[..., None], s) + _mm("ijh,jhv->ihv", _mm("ihk,jhk->ijh", q, k) * decay, v_new)
    last = gamma[-1]  # [H]
    s_new = s * jnp.exp(last)[:, None, None] + _mm("chk,chv->hkv", k * jnp.exp(seg[-1])[..., None], v_new)  # Γ_{C-1,j}
    return out, s_new


def gdn_chunked_reference(q, k, v, g, beta, state, query_start, state_slots, chunk: int = 64):
    """Same contract as gdn_recurrent_reference, computed chunk by chunk."""
    num_tokens, heads, _ = q.shape
    dv = v.shape[-1]
    num_slots = state.shape[0]
    lay, position, chunk_seq, used, num_chunks = _chunk_layout(query_start, num_tokens, chunk)

    def to_chunks(x):
        buf = jnp.zeros((num_chunks * chunk, *x.shape[1:]), x.dtype).at[position].set(x, mode="drop")
        return buf.reshape(num_chunks, chunk, *x.shape[1:])

    slots = slot_or_drop(used, state_slots[chunk_seq], num_slots)

    def step(states, xs):
        qc, kc, vc, gc, bc, slot = xs
        s = states.at[slot].get(mode="fill", fill_value=0.0)
        out, s = _solve_chunk(s, qc, kc, vc, gc, bc)
        return states.at[slot].set(s, mode="drop"), out

    xs = (to_chunks(q), to_chunks(k), to_chunks(v), to_chunks(g), to_chunks(beta), slots)
    new_state, out = jax.lax.scan(step, state, xs)
    out = out.reshape(num_chunks * chunk, heads, dv)
    return jnp.take(out, jnp.clip(position, 0, num_chunks * chunk - 1), axis=0) * lay.valid[:, None, None], new_state


def _gdn_one_step(q, k, v, g, beta, state, slots):
    """Every token slot is its sequence's only token: one vectorised update. slots [T] (out of range: padding).

    Dense over the state slots, without gathering or scattering states: each slot takes the inputs of the token that
    owns it (a slot without one gets g = β = k = 0, which leaves it bit-identical), so the state is read and written
    once. XLA CPU's gather/scatter of [T,H,dk,dv] states, fused with the update, ran 5-10x slower than the
    token-by-token scan. Returns (out [T,H,dv], new state); padding rows get the output of a zero state (as
    gdn_recurrent_reference gives them).
    """
    num_tokens = q.shape[0]
    num_slots = state.shape[0]
    owner = jnp.full((num_slots,), num_tokens, jnp.int32).at[slots].set(jnp.arange(num_tokens, dtype=jnp.int32),
                                                                        mode="drop")
    hit = owner < num_tokens
    tok = jnp.clip(owner, 0, num_tokens - 1)

    def per_slot(x):
        return jnp.where(hit.reshape(-1, *([1] * (x.ndim - 1))), x[tok], 0.0)

    qs, ks, vs, gs, bs = (per_slot(x) for x in (q, k, v, g, beta))
    s = state * jnp.exp(gs)[:, :, None, None]
    predicted = _mm("shkv,shk->shv", s, ks)
    predicted = jax.lax.optimization_barrier(predicted)  # not recomputed inside the update's fusion
    s = s + ks[..., None] * (bs[..., None] * (vs - predicted))[:, :, None, :]
    out_slot = _mm("shkv,shk->shv", s, qs)
    valid = slots < num_slots
    zero_state = (jnp.sum(k * q, axis=-1) * beta)[..., None] * v  # padding rows: (β v ⊗ k)ᵀ q of a zero state
    out = jnp.where(valid[:, None, None], out_slot[jnp.clip(slots, 0, num_slots - 1)], zero_state)
    return out, s


NATIVE_F32 = "qcompile_gdn_recurrent_f32"
NATIVE_BF16_STATE = "qcompile_gdn_recurrent_bf16_state"


def native_kernel(state) -> str:
    """The native recurrence's entry point for this state's dtype (f32, or bf16 from the bf16-state pass)."""
    return NATIVE_BF16_STATE if state.dtype == jnp.bfloat16 else NATIVE_F32


def gdn_recurrent_native(q, k, v, g, beta, state, query_start, state_slots):
    """gdn_recurrent_reference's contract by the native kernel (kernels/native/gdn_recurrent_f32.cc): each sequence's
    state read once and written once per step, in place (the new state aliases `state`; XLA copies first only if
    the input is still needed); a bf16 state is computed in f32 and rounded once when stored. Call only after
    `native.ensure(native_kernel(state))` returned True."""
    f32 = jnp.float32
    state_dtype = jnp.bfloat16 if state.dtype == jnp.bfloat16 else f32
    call = jax.ffi.ffi_call(native_kernel(state), (jax.ShapeDtypeStruct(v.shape, f32),
                                                   jax.ShapeDtypeStruct(state.shape, state_dtype)),
                            input_output_aliases={5: 1})
    return call(q.astype(f32), k.astype(f32), v.astype(f32), g.astype(f32), beta.astype(f32), state.astype(state_dtype),
                query_start.astype(jnp.int32), state_slots.astype(jnp.int32))


def gdn_recurrence_cpu(q, k, v, g, beta, state, query_start, state_slots, chunk: int = 64,
                       chunked_min_tokens: int | None = None, dense_state_bytes: int = 8 << 20):
    """Same contract as gdn_recurrent_reference / gdn_chunked_reference, and the op's "auto" mode row for row.

    `state` is f32, or bf16 (the bf16-state pass: the native kernel computes it in f32 and returns it bf16; the jnp
    forms return it f32). Where the native kernel is available it serves every batch but the chunked form:
    decode, prefill and mixed alike, each state read and written once per token in place (docs/cpu_rules.md,
    "gdn_recurrence": 1.3× the jnp rule at decode B=32, 2.4-5× at prefill and mixed). Without it, a runtime lax.cond on the sequence lengths: when every sequence has ≤ 1 token (decode) all slots are updated at
    once in one vectorised step (_gdn_one_step, dense over the S state slots; used when S ≤ T and, in T ≤ B buckets,
    the states fit in dense_state_bytes; otherwise the scan below serves decode too). Otherwise a static choice:
    the token-by-token scan, or the chunked form when T > B and T ≥ chunked_min_tokens. On CPU the scan was faster
    than the chunked form at every measured size (T up to 256, chunk 16/32/64; docs/cpu_rules_attention.md), and the
    chunked form's time varied 10x with load, so the default (None) never picks the chunked form; pass
    chunked_min_tokens=0 for the op's "auto" rule.
    Padding rows follow the auto rule whichever form runs: T ≤ B → the output of a zero state (like
    gdn_recurrent_reference), T > B → zeros (like gdn_chunked_reference). Sequences must not share a state slot
    within one step (neither the one-step path nor the native kernel, which runs sequences in parallel, chains them).
    """
    num_tokens = q.shape[0]
    num_seqs = query_start.shape[0] - 1
    num_slots = state.shape[0]
    auto_recurrent = num_tokens <= num_seqs
    use_chunked = not auto_recurrent and chunked_min_tokens is not None and num_tokens >= chunked_min_tokens
    lay = token_layout(query_start, num_tokens)
    if not use_chunked and native.ensure(native_kernel(state)):
        out, new_state = gdn_recurrent_native(q, k, v, g, beta, state, query_start, state_slots)
        return (out if auto_recurrent else out * lay.valid[:, None, None]), new_state
    state = state.astype(jnp.float32)  # the jnp forms run in f32 (a bf16 state is rounded back by the caller)

    def one_step(_):
        slots = slot_or_drop(lay.valid, state_slots[lay.seq], num_slots)
        return _gdn_one_step(q, k, v, g, beta, state, slots)

    def general(_):
        if use_chunked:
            return gdn_chunked_reference(q, k, v, g, beta, state, query_start, state_slots, chunk)
        return gdn_recurrent_reference(q, k, v, g, beta, state, query_start, state_slots)

    # The one-step update is dense over the S slots. With more slots than token slots the scan (T steps, each
    # touching one state in place) moves less memory; in a T ≤ B bucket whose states exceed ~8 MB (B = 32 at Hv 8,
    # dk = dv = 128: 16 MB) the scan also measured faster (2.7 vs 5-7 ms), so the scan serves decode there too.
    state_bytes = num_slots * math.prod(state.shape[1:]) * 4
    dense = num_slots <= num_tokens and (not auto_recurrent or state_bytes <= dense_state_bytes)
    if not dense and not use_chunked:
        out, new_state = general(None)
    else:
        out, new_state = jax.lax.cond(jnp.max(lay.lengths) <= 1, one_step, general, None)
    if not auto_recurrent:
        out = out * lay.valid[:, None, None]
    return out, new_state
