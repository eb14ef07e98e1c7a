"""Pallas TPU kernel for the fused Gated DeltaNet core (tpu rule of gated_delta_net): causal conv + SiLU + q/k L2
norm + gates + delta rule, each sequence's recurrent state resident in VMEM across its tokens.

Contract: kernels/gdn_fused.py's `gdn_fused_reference` (the tests compare the two, interpreted with TPU semantics).

Grid: one program per value head h ("parallel": heads split across the TensorCores). The head's inputs are VMEM
blocks in head-major layout prepared by the wrapper (x's q and k columns of key head h // (Hv/Hk) and v columns of
h as [T, dk] / [T, dv]; the conv weights [K, ·]; a, b as [T, 1]; the sequences' conv windows [B, K-1, ·], gathered
by slot). Inside, a loop over the batch's sequences (query_start and state_slots are scalar-prefetch operands):
the sequence's [dk, dv] state is copied from HBM (the state array is never blocked: `pl.ANY`, aliased to the new
state, so only the batch's slots move) into a VMEM scratch and stays there across all its tokens, which run in two
forms within the same call:
  - chunked (prefill): each whole chunk of `chunk` tokens (64) in closed form on the MXU — conv over the chunk as
    shifted slices, the decay matrix from per-segment sums, the unit lower-triangular system inverted as a product
    of log2(C) matrix squarings (the jnp reference's _solve_chunk, same algebra);
  - recurrent (decode, and a prefill's last partial chunk): token by token, the read taken before the write
    (o = e·(Sᵀq) + (k·q)·δ, design.md §4.5, so the state is read once per token).
So decode, prefill and mixed ragged batches are one call and each sequence takes the form its own length calls
for. The state is copied back once per sequence. A bf16 state (the bf16-state pass) is copied in as bf16, computed
in f32, rounded once on the way out.

The wrapper scatters the new conv windows (K-1 columns per slot) back into the conv state; padding rows of o are 0.

Interpret switch as kernels/pallas_gmm.py: `interpret=True` or `pltpu.InterpretParams()` runs Pallas' interpreter on
any backend; `gdn_fused_tpu` picks the compiled kernel on TPU and the interpreter elsewhere at lowering time.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from qcompile.kernels.ragged import token_layout


def _softplus(x):
    """log(1 + eˣ), written out (Mosaic has rules for max, abs, exp and log1p)."""
    return jnp.maximum(x, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(x)))


def _chunk_step(s, q, k, v, g, beta, chunk: int):
    """One chunk of C tokens of one head in closed form (the jnp reference's _solve_chunk, on the MXU): s [dk, dv];
    q, k [C, dk] (normalised); v [C, dv]; g, beta [C, 1] -> (o [C, dv], new s).

    Γ_ij = exp(Σ_{j<t≤i} g_t) is summed over each segment (a product of 0/1 masks and g), not as γ_i − γ_j, for the
    precision the reference documents. (I + A)⁻¹ of the unit lower-triangular system (A strictly lower, nilpotent) is
    the product Π_m (I + (−A)^(2^m)) over log2(C) squarings — matmuls, no row-by-row substitution."""
    f32 = jnp.float32
    row = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    upto = (col <= row).astype(f32)  # [i, t]: t ≤ i
    after = (row > col).astype(f32)  # [t, j]: j < t
    g_row = jnp.transpose(g)  # [1, C]
    seg = jnp.dot(upto * g_row, after, preferred_element_type=f32)  # [i, j] = Σ_{j<t≤i} g_t
    decay = jnp.where(col <= row, jnp.exp(seg), 0.0)
    gamma = jnp.dot(upto, g, preferred_element_type=f32)  # [C, 1] prefix sums
    seg_last = jnp.dot(jnp.transpose(after), g, preferred_element_type=f32)  # [C, 1]: Σ_{t>j} g_t
    dims = (((1,), (1,)), ((), ()))  # x · yᵀ
    a = jnp.where(col < row, beta * jax.lax.dot_general(k, k, dims, preferred_element_type=f32) * decay, 0.0)
    inverse = jnp.eye(chunk, dtype=f32) - a
    power = a
    steps = max(1, (chunk - 1).bit_length())
    for _ in range(steps - 1):
        power = jnp.dot(power, power, preferred_element_type=f32)
        inverse = jnp.dot(inverse, jnp.eye(chunk, dtype=f32) + power, preferred_element_type=f32)
    u = jnp.dot(inverse, beta * v, preferred_element_type=f32)
    w = jnp.dot(inverse, beta * jnp.exp(gamma) * k, preferred_element_type=f32)
    v_new = u - jnp.dot(w, s, preferred_element_type=f32)
    qk = jax.lax.dot_general(q, k, dims, preferred_element_type=f32) * decay
    out = jnp.dot(q * jnp.exp(gamma), s, preferred_element_type=f32) + jnp.dot(qk, v_new, preferred_element_type=f32)
    k_last = k * jnp.exp(seg_last)
    s_new = jnp.exp(gamma[chunk - 1:chunk]) * s + jax.lax.dot_general(
        k_last, v_new, (((0,), (0,)), ((), ())), preferred_element_type=f32)
    return out, s_new


def _kernel(query_start, slots,  # scalar prefetch
            xq_ref, xk_ref, xv_ref, wq_ref, wk_ref, wv_ref, a_ref, b_ref, alog_ref, dtb_ref,
            winq_ref, wink_ref, winv_ref, state_hbm,
            o_ref, new_winq_ref, new_wink_ref, new_winv_ref, state_out_hbm,
            state_vmem, state_io, sem, *, num_seqs: int, num_slots: int, chunk: int, act_dtype):
    h = pl.program_id(0)
    dk = xq_ref.shape[-1]
    o_ref[...] = jnp.zeros_like(o_ref)
    wq, wk, wv = (r[...].astype(jnp.float32) for r in (wq_ref, wk_ref, wv_ref))  # [K, ·]
    width = wq.shape[0] - 1
    a_log = alog_ref[...].astype(jnp.float32)  # [1, 1]
    dt_bias = dtb_ref[...].astype(jnp.float32)

    def rounded(z):  # where the unfused ops round to the activations' dtype (bf16 models), so does the kernel
        return z if act_dtype == jnp.float32 else z.astype(act_dtype).astype(jnp.float32)

    def conv(window, w, x):  # window [K-1, c] oldest first, x [n, c] -> (silu(y) [n, c], new window)
        rows = x.shape[0]
        ext = jnp.concatenate([window, x], axis=0)  # [K-1+n, c]
        y = w[width:] * x
        for j in range(width):
            y = y + w[j:j + 1] * ext[j:j + rows]
        y = rounded(y)
        return rounded(y * jax.nn.sigmoid(y)), ext[rows:]

    def inputs(t, rows, windows):
        """Conv, SiLU, L2 norm and gates of tokens [t, t + rows) -> (q, k, v, g, beta, windows)."""
        win_q, win_k, win_v = windows
        q, win_q = conv(win_q, wq, xq_ref[pl.ds(t, rows), :].astype(jnp.float32))
        k, win_k = conv(win_k, wk, xk_ref[pl.ds(t, rows), :].astype(jnp.float32))
        v, win_v = conv(win_v, wv, xv_ref[pl.ds(t, rows), :].astype(jnp.float32))
        q = q * jax.lax.rsqrt(jnp.sum(q * q, axis=-1, keepdims=True) + 1e-6) * dk**-0.5
        k = k * jax.lax.rsqrt(jnp.sum(k * k, axis=-1, keepdims=True) + 1e-6)
        g = -jnp.exp(a_log) * _softplus(a_ref[pl.ds(t, rows), :].astype(jnp.float32) + dt_bias)  # [rows, 1]
        beta = rounded(jax.nn.sigmoid(b_ref[pl.ds(t, rows), :].astype(jnp.float32)))
        return q, k, v, g, beta, (win_q, win_k, win_v)

    def sequence(seq, carry):
        t0, t1 = query_start[seq], query_start[seq + 1]
        slot = slots[seq]
        in_range = jnp.logical_and(slot >= 0, slot < num_slots)
        safe = jnp.clip(slot, 0, num_slots - 1)

        @pl.when(jnp.logical_and(t1 > t0, in_range))
        def _load():
            copy = pltpu.make_async_copy(state_hbm.at[safe, h], state_io, sem.at[0])
            copy.start()
            copy.wait()
            state_vmem[...] = state_io[...].astype(jnp.float32)

        @pl.when(jnp.logical_and(t1 > t0, jnp.logical_not(in_range)))
        def _zero():
            state_vmem[...] = jnp.zeros_like(state_vmem)

        def chunk_body(c, windows):
            t = t0 + c * chunk
            q, k, v, g, beta, windows = inputs(t, chunk, windows)
            out, new_state = _chunk_step(state_vmem[...], q, k, v, g, beta, chunk)
            state_vmem[...] = new_state
            o_ref[pl.ds(t, chunk), :] = out
            return windows

        def token(t, windows):
            q, k, v, g, beta, windows = inputs(t, 1, windows)
            e = jnp.exp(g)
            s = state_vmem[...]  # [dk, dv]
            k_col = jnp.transpose(k)  # [dk, 1]
            kst = jnp.sum(k_col * s, axis=0, keepdims=True)  # [1, dv]: Sᵀk
            qst = jnp.sum(jnp.transpose(q) * s, axis=0, keepdims=True)  # Sᵀq, same read of S
            delta = beta * (v - e * kst)
            o_ref[pl.ds(t, 1), :] = e * qst + jnp.sum(k * q, axis=-1, keepdims=True) * delta
            state_vmem[...] = e * s + k_col * delta
            return windows

        windows = (winq_ref[seq].astype(jnp.float32), wink_ref[seq].astype(jnp.float32),
                   winv_ref[seq].astype(jnp.float32))
        # Prefill: whole chunks in closed form, then token by token (lax.div: t1 ≥ t0, and jnp's // lowers via `sign`).
        full = jax.lax.div(t1 - t0, chunk) if chunk > 1 else 0
        if chunk > 1:
            windows = jax.lax.fori_loop(0, full, chunk_body, windows)
        win_q, win_k, win_v = jax.lax.fori_loop(t0 + full * chunk, t1, token, windows)
        new_winq_ref[seq] = win_q.astype(new_winq_ref.dtype)
        new_wink_ref[seq] = win_k.astype(new_wink_ref.dtype)
        new_winv_ref[seq] = win_v.astype(new_winv_ref.dtype)

        @pl.when(jnp.logical_and(t1 > t0, in_range))
        def _store():
            state_io[...] = state_vmem[...].astype(state_io.dtype)
            copy = pltpu.make_async_copy(state_io, state_out_hbm.at[safe, h], sem.at[1])
            copy.start()
            copy.wait()

        return carry

    jax.lax.fori_loop(0, num_seqs, sequence, 0)


def gdn_fused_pallas(x, a, b, conv_state, conv_w, a_log, dt_bias, state, query_start, state_slots, *,
                     interpret=False, chunk: int = 64):
    """gated_delta_net by the Pallas kernel (module docstring); `interpret` as pallas_call's; `chunk`: tokens per
    closed-form chunk (a multiple of 8; 0 or 1: every token by the recurrent form)."""
    num_tokens, channels = x.shape
    num_slots, hv, dk, dv = state.shape
    width = conv_state.shape[2]
    hk = (channels - hv * dv) // (2 * dk)
    ratio, kd = hv // hk, hk * dk
    num_seqs = state_slots.shape[0]
    padded = -(-max(num_tokens, 1) // 8) * 8  # token rows: a multiple of the 8-row sublane tile
    if chunk > padded:  # no sequence of this bucket can fill a chunk: every token by the recurrent form
        chunk = 0
    xp = jnp.pad(x, ((0, padded - num_tokens), (0, 0)))

    def heads(cols, n, d):  # [rows, n·d] -> [n, rows, d]
        return jnp.swapaxes(cols.reshape(cols.shape[0], n, d), 0, 1)

    xq, xk, xv = heads(xp[:, :kd], hk, dk), heads(xp[:, kd:2 * kd], hk, dk), heads(xp[:, 2 * kd:], hv, dv)
    wt = conv_w.T  # [K, C]
    wq, wk, wv = heads(wt[:, :kd], hk, dk), heads(wt[:, kd:2 * kd], hk, dk), heads(wt[:, 2 * kd:], hv, dv)
    seq_state = jnp.swapaxes(conv_state[jnp.clip(state_slots, 0, num_slots - 1)], 1, 2)  # [B, K-1, C]

    def window_heads(lo, hi, n, d):  # [B, K-1, n·d] -> [n, B, K-1, d]
        return jnp.moveaxis(seq_state[:, :, lo:hi].reshape(num_seqs, width, n, d), 2, 0)

    win_q, win_k, win_v = (window_heads(0, kd, hk, dk), window_heads(kd, 2 * kd, hk, dk),
                           window_heads(2 * kd, channels, hv, dv))
    a_h = jnp.pad(a, ((0, padded - num_tokens), (0, 0))).T[:, :, None]  # [Hv, rows, 1]
    b_h = jnp.pad(b, ((0, padded - num_tokens), (0, 0))).T[:, :, None]
    # lax.div, not //: jnp's floor division of signed ints lowers through `sign`, which Mosaic cannot lower off a
    # TPU host (h ≥ 0, so truncation is the floor).
    key = lambda h, *_: (jax.lax.div(h, ratio), 0, 0)  # noqa: E731
    value = lambda h, *_: (h, 0, 0)  # noqa: E731
    win_key = lambda h, *_: (jax.lax.div(h, ratio), 0, 0, 0)  # noqa: E731
    win_value = lambda h, *_: (h, 0, 0, 0)  # noqa: E731
    f32 = jnp.float32
    out_shapes = (jax.ShapeDtypeStruct((hv, padded, dv), f32),
                  jax.ShapeDtypeStruct((hv, num_seqs, width, dk), conv_state.dtype),
                  jax.ShapeDtypeStruct((hv, num_seqs, width, dk), conv_state.dtype),
                  jax.ShapeDtypeStruct((hv, num_seqs, width, dv), conv_state.dtype),
                  jax.ShapeDtypeStruct(state.shape, state.dtype))
    call = pl.pallas_call(
        functools.partial(_kernel, num_seqs=num_seqs, num_slots=num_slots, chunk=chunk, act_dtype=x.dtype),
        out_shape=out_shapes,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(hv,),
            in_specs=[pl.BlockSpec((None, padded, dk), key), pl.BlockSpec((None, padded, dk), key),
                      pl.BlockSpec((None, padded, dv), value),
                      pl.BlockSpec((None, width + 1, dk), key), pl.BlockSpec((None, width + 1, dk), key),
                      pl.BlockSpec((None, width + 1, dv), value),
                      pl.BlockSpec((None, padded, 1), value), pl.BlockSpec((None, padded, 1), value),
                      pl.BlockSpec((None, 1, 1), value), pl.BlockSpec((None, 1, 1), value),
                      pl.BlockSpec((None, num_seqs, width, dk), win_key),
                      pl.BlockSpec((None, num_seqs, width, dk), win_key),
                      pl.BlockSpec((None, num_seqs, width, dv), win_value),
                      pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=[pl.BlockSpec((None, padded, dv), value),
                       pl.BlockSpec((None, num_seqs, width, dk), win_value),
                       pl.BlockSpec((None, num_seqs, width, dk), win_value),
                       pl.BlockSpec((None, num_seqs, width, dv), win_value),
                       pl.BlockSpec(memory_space=pl.ANY)],
            scratch_shapes=[pltpu.VMEM((dk, dv), f32), pltpu.VMEM((dk, dv), state.dtype),
                            pltpu.SemaphoreType.DMA((2,))],
        ),
        input_output_aliases={15: 4},  # the state (after the 2 scalar-prefetch operands) is updated in place
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
    )
    qs = query_start.astype(jnp.int32)
    slots = state_slots.astype(jnp.int32)
    o, new_q, new_k, new_v, new_state = call(
        qs, slots, xq, xk, xv, wq, wk, wv, a_h, b_h, a_log.reshape(hv, 1, 1), dt_bias.reshape(hv, 1, 1),
        win_q, win_k, win_v, state)
    out = jnp.swapaxes(o, 0, 1)[:num_tokens]  # [T, Hv, dv]
    valid = token_layout(qs, num_tokens).valid
    out = (out * valid[:, None, None]).astype(x.dtype)
    # New conv windows: q/k from the first value head of each key head, v from every head; [B, K-1, C] -> slots.
    cols = jnp.concatenate([jnp.moveaxis(new_q[::ratio], 0, 2).reshape(num_seqs, width, kd),
                            jnp.moveaxis(new_k[::ratio], 0, 2).reshape(num_seqs, width, kd),
                            jnp.moveaxis(new_v, 0, 2).reshape(num_seqs, width, hv * dv)], axis=2)
    lengths = qs[1:] - qs[:-1]
    target = jnp.where(lengths > 0, slots, num_slots)
    new_conv = conv_state.at[target].set(jnp.swapaxes(cols, 1, 2).astype(conv_state.dtype), mode="drop")
    return out, new_conv, new_state


def gdn_fused_tpu(x, a, b, conv_state, conv_w, a_log, dt_bias, state, query_start, state_slots):
    """The tpu lowering rule: the compiled kernel on TPU, the interpreted one on any other platform."""
    return jax.lax.platform_dependent(
        x, a, b, conv_state, conv_w, a_log, dt_bias, state, query_start, state_slots,
        tpu=functools.partial(gdn_fused_pallas, interpret=False),
        default=functools.partial(gdn_fused_pallas, interpret=True))
