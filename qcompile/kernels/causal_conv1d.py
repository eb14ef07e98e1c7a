"""Causal depthwise conv over a ragged batch, with per-sequence conv state slots (spec/model.md §3.5 b, §4.1).

Tap K-1 multiplies the current token; the earlier taps read earlier tokens of the same sequence, or the cached
pre-conv columns of that sequence (state keeps the last K-1 columns; column K-2 is the most recent). The new state of
each sequence that had tokens this step is the last K-1 columns of [state ‖ new tokens].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from qcompile.kernels.cache_rows import scatter_rows
from qcompile.kernels.ragged import slot_or_drop, token_layout


def _new_state(x, state, query_start, state_slots, lengths, write=None):
    """Each sequence with n_b > 0 new tokens: column m of its new state is position n_b-(K-1)+m of [state ‖ x_b].

    write(state, slots, columns): how the rows land (default jnp's scatter; slots outside [0, S) are dropped)."""
    num_tokens = x.shape[0]
    num_slots, _, width = state.shape
    seq_slot = jnp.clip(state_slots, 0, num_slots - 1)
    rel_s = lengths[:, None] - width + jnp.arange(width)[None, :]  # [B,K-1]
    src_tok = jnp.clip(query_start[:-1, None] + rel_s, 0, num_tokens - 1)
    new_from_x = jnp.swapaxes(x[src_tok], 1, 2)  # [B,C,K-1]
    old = state[seq_slot]  # [B,C,K-1]
    new_from_state = jnp.take_along_axis(old, jnp.clip(width + rel_s, 0, width - 1)[:, None, :], axis=2)
    new_cols = jnp.where((rel_s >= 0)[:, None, :], new_from_x, new_from_state).astype(state.dtype)
    target = slot_or_drop(lengths > 0, state_slots, num_slots)
    if write is None:
        return state.at[target].set(new_cols, mode="drop")
    return write(state, jnp.where(target < 0, target + num_slots, target), new_cols)  # normalised as jnp would


def causal_conv1d_reference(x, state, weight, query_start, state_slots, activation: str | None = "silu"):
    """x [T,C], state [S,C,K-1], weight [C,K] -> (y [T,C] in x.dtype, new state [S,C,K-1])."""
    num_tokens, channels = x.shape
    num_slots, _, width = state.shape
    taps = width + 1
    lay = token_layout(query_start, num_tokens)
    slot = jnp.clip(state_slots[lay.seq], 0, num_slots - 1)
    rel = lay.local[:, None] + jnp.arange(taps)[None, :] - width  # [T,K] position within the sequence
    src = jnp.arange(num_tokens)[:, None] + jnp.arange(taps)[None, :] - width  # [T,K] token slot of each tap
    from_x = jnp.take(x, jnp.clip(src, 0, num_tokens - 1), axis=0)  # [T,K,C]
    cached = state[slot]  # [T,C,K-1]
    from_state = jnp.take_along_axis(cached, jnp.clip(width + rel, 0, width - 1)[:, None, :], axis=2)  # [T,C,K]
    window = jnp.where((rel >= 0)[:, :, None], from_x, jnp.swapaxes(from_state, 1, 2))
    y = jnp.einsum("tkc,ck->tc", window.astype(jnp.float32), weight.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
    y = y.astype(x.dtype)
    if activation == "silu":
        y = jax.nn.silu(y)

    return y, _new_state(x, state, query_start, state_slots, lay.lengths)


def causal_conv1d_cpu(x, state, weight, query_start, state_slots, activation: str | None = "silu"):
    """Same contract and result as causal_conv1d_reference, without its [T,K,C] window gathers and [T,C,K-1] state
    copy: tap j is a shifted slice of x (zero-padded in front), replaced by the cached column of the token's
    sequence only where the tap reaches before the sequence's first new token, accumulated in f32 as fused
    multiply-adds (the reference's per-channel einsum runs as C tiny dot products on CPU). The new state's rows are
    written in place (scatter_rows: a bf16 state is never widened whole)."""
    num_tokens, channels = x.shape
    num_slots, _, width = state.shape
    lay = token_layout(query_start, num_tokens)
    slot = jnp.clip(state_slots[lay.seq], 0, num_slots - 1)
    cached = jnp.swapaxes(state, 1, 2).reshape(num_slots * width, channels)  # row slot*(K-1)+col
    x_pad = jnp.concatenate([jnp.zeros((width, channels), x.dtype), x])
    w = weight.astype(jnp.float32)
    acc = x.astype(jnp.float32) * w[:, width]  # tap K-1: the token itself
    for j in range(width):
        rel = lay.local + j - width  # position of tap j within the sequence
        from_state = cached[slot * width + jnp.clip(width + rel, 0, width - 1)]
        src = jnp.where((rel < 0)[:, None], from_state, x_pad[j:j + num_tokens])
        acc = acc + src.astype(jnp.float32) * w[:, j]
    y = acc.astype(x.dtype)
    if activation == "silu":
        y = jax.nn.silu(y)

    write = functools.partial(scatter_rows, after=(y,))  # y's reads of the old state first: no copy of it
    return y, _new_state(x, state, query_start, state_slots, lay.lengths, write=write)
