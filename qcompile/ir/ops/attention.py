"""Gated GQA attention ops: RoPE, paged KV cache write, paged causal attention (spec/model.md §3.3–3.4)."""

from __future__ import annotations

import attrs
import jax.numpy as jnp

from qcompile.ir.cost import Cost, cost, nbytes
from qcompile.ir.registry import expect, lowering, op, type_rule
from qcompile.kernels.paged_attention import (kv_cache_write_cpu, kv_cache_write_reference, paged_attention_cpu,
                                              paged_attention_reference)
from qcompile.kernels.pallas_paged_attention import paged_attention_tpu


@op("rope")
@attrs.frozen
class Rope:
    """rope(x[T,heads,hd], positions i32[T]): rotate_half RoPE on the first `rotary_dim` dims of each head.

    inv_freq[i] = theta^(-2i/rotary_dim); cos/sin are computed in f32 and rounded to x's dtype before use, as HF does.
    """

    theta: float
    rotary_dim: int


@type_rule(Rope)
def _rope_type(op_, x, positions):
    expect(x.rank == 3 and positions.rank == 1 and positions.dtype == "i32", f"rope wants x[T,h,d], i32[T]: {x}, {positions}")
    expect(op_.rotary_dim % 2 == 0 and op_.rotary_dim <= x.shape[2], f"rotary_dim {op_.rotary_dim} does not fit {x}")
    return x


@lowering(Rope)
def _rope(op_, x, positions):
    rd = op_.rotary_dim
    inv_freq = 1.0 / (op_.theta ** (jnp.arange(0, rd, 2, dtype=jnp.float32) / rd))
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    cos = jnp.cos(angles).astype(x.dtype)[:, None, :]
    sin = jnp.sin(angles).astype(x.dtype)[:, None, :]
    rot, rest = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    return jnp.concatenate([rot * cos + rotated * sin, rest], axis=-1)


@op("kv_cache_write")
@attrs.frozen
class KvCacheWrite:
    """kv_cache_write(pages[P,ps,Hkv,hd], kv[T,Hkv,hd], positions[T], query_start[B+1], page_table[B,M]) -> pages."""


@type_rule(KvCacheWrite)
def _kv_write_type(op_, pages, kv, positions, query_start, page_table):
    expect(pages.rank == 4 and tuple(pages.shape[2:]) == tuple(kv.shape[1:]), f"kv {kv} does not fit pages {pages}")
    expect(page_table.rank == 2 and page_table.dtype == "i32", f"page_table must be i32[B,M], got {page_table}")
    return pages


@lowering(KvCacheWrite)
def _kv_write(op_, pages, kv, positions, query_start, page_table):
    return kv_cache_write_reference(pages, kv, positions, query_start, page_table)


@lowering(KvCacheWrite, "cpu")
def _kv_write_cpu(op_, pages, kv, positions, query_start, page_table):
    """The reference's rows, scattered as integers when the cache is bf16 (XLA CPU would widen every page)."""
    return kv_cache_write_cpu(pages, kv, positions, query_start, page_table)


@op("paged_attention")
@attrs.frozen
class PagedAttention:
    """paged_attention(q[T,Hq,hd], k_pages, v_pages, positions, query_start, page_table) -> [T,Hq,hd].

    Causal softmax attention of each token over its own sequence's cached keys at positions ≤ its own; query head j
    reads KV head j // (Hq/Hkv). `page_size` is the cache page length in tokens.
    """

    scale: float
    page_size: int


@type_rule(PagedAttention)
def _attention_type(op_, q, k_pages, v_pages, positions, query_start, page_table):
    expect(k_pages == v_pages, f"k and v pages differ: {k_pages} vs {v_pages}")
    expect(k_pages.shape[1] == op_.page_size, f"pages {k_pages} do not have page_size {op_.page_size}")
    expect(q.rank == 3 and q.shape[2] == k_pages.shape[3], f"q {q} does not match pages {k_pages}")
    heads, kv_heads = q.shape[1], k_pages.shape[2]
    expect(isinstance(heads, int) and isinstance(kv_heads, int) and heads % kv_heads == 0,
           f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    return q


@lowering(PagedAttention)
def _attention(op_, q, k_pages, v_pages, positions, query_start, page_table):
    return paged_attention_reference(q, k_pages, v_pages, positions, query_start, page_table, op_.scale)


@lowering(PagedAttention, "cpu")
def _attention_cpu(op_, q, k_pages, v_pages, positions, query_start, page_table):
    """Cost follows each sequence's live context (blocks of keys up to its position, online softmax), not M·ps."""
    return paged_attention_cpu(q, k_pages, v_pages, positions, query_start, page_table, op_.scale)


@lowering(PagedAttention, "tpu")
def _attention_tpu(op_, q, k_pages, v_pages, positions, query_start, page_table):
    """The Pallas ragged paged attention kernel (kernels/pallas_paged_attention.py): each sequence's live pages only,
    every sequence of the ragged batch in one call."""
    return paged_attention_tpu(q, k_pages, v_pages, positions, query_start, page_table, op_.scale)


@cost(KvCacheWrite)
def _kv_write_cost(op_, operands, results, step):
    (pages, pages_shape), (kv, kv_shape), *_ = operands
    return Cost(0.0, nbytes(kv, kv_shape))


@cost(PagedAttention)
def _attention_cost(op_, operands, results, step):
    """Each sequence's live keys and values are read once; q·k and p·v for every (token, key) pair."""
    (_, q_shape), (pages, pages_shape), *_ = operands
    heads, head_dim = q_shape[1], q_shape[2]
    kv_row = nbytes(pages, pages_shape[2:])  # one token's keys (all KV heads)
    return Cost(4.0 * heads * head_dim * step.attended_keys(), 2.0 * kv_row * sum(step.contexts))
