"""Paged KV cache write and causal gated-GQA attention over a ragged batch (jnp reference).

The cache holds pages [P, page_size, Hkv, hd]; sequence b's token at position p lives in page
page_table[b, p // page_size] at row p % page_size. A token at position p attends to its own sequence's keys at
positions 0..p (the write happens first, so the current chunk is included).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qcompile.kernels.ragged import token_layout

HIGHEST = jax.lax.Precision.HIGHEST


def kv_cache_write_reference(pages, kv, positions, query_start, page_table):
    """pages [P,ps,Hkv,hd], kv [T,Hkv,hd] -> pages with each valid token's row written."""
    num_pages, page_size = pages.shape[:2]
    lay = token_layout(query_start, kv.shape[0])
    page = page_table[lay.seq, jnp.clip(positions // page_size, 0, page_table.shape[1] - 1)]
    page = jnp.where(lay.valid, page, num_pages)
    return pages.at[page, positions % page_size].set(kv.astype(pages.dtype), mode="drop")


def paged_attention_reference(q, k_pages, v_pages, positions, query_start, page_table, scale: float):
    """q [T,Hq,hd] -> [T,Hq,hd]: softmax(q·kᵀ·scale) over the sequence's keys at positions ≤ the token's, f32 math."""
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    num_seqs, pages_per_seq = page_table.shape
    lay = token_layout(query_start, num_tokens)
    keys = k_pages[page_table].reshape(num_seqs, pages_per_seq * page_size, kv_heads, head_dim)
    values = v_pages[page_table].reshape(num_seqs, pages_per_seq * page_size, kv_heads, head_dim)
    group = num_heads // kv_heads
    qg = q.reshape(num_tokens, kv_heads, group, head_dim).astype(jnp.float32)
    kt = keys[lay.seq].astype(jnp.float32)  # [T,Lk,Hkv,hd]
    scores = jnp.einsum("thgd,tshd->thgs", qg, kt, precision=HIGHEST) * scale
    key_pos = jnp.arange(pages_per_seq * page_size)
    mask = (key_pos[None, :] <= positions[:, None]) & lay.valid[:, None]
    mask = mask | (~lay.valid[:, None] & (key_pos[None, :] == 0))  # padding rows attend to one key: no NaN
    scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_pages.dtype)
    out = jnp.einsum("thgs,tshd->thgd", probs, values[lay.seq], precision=HIGHEST, preferred_element_type=jnp.float32)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
