"""Ragged batch layout shared by every kernel: which sequence each token of the step belongs to.

A step carries T token slots; sequence b owns slots [query_start[b], query_start[b+1]); slots from
query_start[B] on are padding. Prefill, decode and mixed batches are all this one layout.
"""

from __future__ import annotations

import attrs
import jax.numpy as jnp


@attrs.frozen
class TokenLayout:
    seq: object  # i32[T]: owning sequence (clipped into 0..B-1 for padding slots)
    valid: object  # bool[T]: False for padding slots
    local: object  # i32[T]: index of the token within its sequence's new tokens
    lengths: object  # i32[B]: new tokens per sequence


def token_layout(query_start, num_tokens: int) -> TokenLayout:
    num_seqs = query_start.shape[0] - 1
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(query_start, t, side="right").astype(jnp.int32) - 1, 0, num_seqs - 1)
    valid = t < query_start[-1]
    local = t - query_start[seq]
    return TokenLayout(seq, valid, local, query_start[1:] - query_start[:-1])


def slot_or_drop(valid, slots, num_slots: int):
    """State slot per row, or an out-of-range index (dropped by scatters, zero-filled by gathers) where invalid."""
    return jnp.where(valid, slots, num_slots).astype(jnp.int32)
