"""Paged KV cache write and causal gated-GQA attention over a ragged batch (jnp reference).

The cache holds pages [P, page_size, Hkv, hd]; sequence b's token at position p lives in page
page_table[b, p // page_size] at row p % page_size. A token at position p attends to its own sequence's keys at
positions 0..p (the write happens first, so the current chunk is included).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qcompile.kernels import native
from qcompile.kernels.cache_rows import page_reader, scatter_rows
from qcompile.kernels.ragged import token_layout

HIGHEST = jax.lax.Precision.HIGHEST
NATIVE_DECODE = "qcompile_paged_decode_attention"


def kv_cache_write_reference(pages, kv, positions, query_start, page_table):
    """pages [P,ps,Hkv,hd], kv [T,Hkv,hd] -> pages with each valid token's row written."""
    num_pages, page_size = pages.shape[:2]
    lay = token_layout(query_start, kv.shape[0])
    page = page_table[lay.seq, jnp.clip(positions // page_size, 0, page_table.shape[1] - 1)]
    page = jnp.where(lay.valid, page, num_pages)
    return pages.at[page, positions % page_size].set(kv.astype(pages.dtype), mode="drop")


def kv_cache_write_cpu(pages, kv, positions, query_start, page_table):
    """kv_cache_write_reference, bit for bit: each valid token's row page·ps + pos mod ps of the pages, written in
    place through scatter_rows (narrow-float caches never widened or copied whole)."""
    num_pages, page_size = pages.shape[:2]
    lay = token_layout(query_start, kv.shape[0])
    page = page_table[lay.seq, jnp.clip(positions // page_size, 0, page_table.shape[1] - 1)]
    page = jnp.where(page < 0, page + num_pages, page)  # as jnp's scatter normalises it
    row = jnp.where(lay.valid & (page >= 0) & (page < num_pages), page * page_size + positions % page_size, -1)
    return scatter_rows(pages, row, kv)


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


def _flash_blocks(qi, row_pos, item_pages, read_k, read_v, num_blocks, block_pages: int, page_size: int):
    """Online-softmax attention of W work items over their first `num_blocks` KV blocks (a traced bound).

    qi [W,Hkv,R,hd] f32 (already scaled); row_pos [W,R] (a row sees keys at positions ≤ row_pos; -1: none);
    item_pages [W,M] page table row of each item; read_k / read_v: page_reader of the pages (a block's pages are read
    and widened alone). Returns [W,Hkv,R,hd] f32 (rows that see no key: 0).
    """
    items, kv_heads, num_rows, head_dim = qi.shape
    pages_per_seq = item_pages.shape[1]
    block = block_pages * page_size
    max_keys = pages_per_seq * page_size

    def body(carry):
        i, m, l, acc = carry
        cols = jnp.clip(i * block_pages + jnp.arange(block_pages), 0, pages_per_seq - 1)
        pages = item_pages[:, cols]  # [W,nbp]
        kb = jnp.swapaxes(read_k(pages), 1, 2)  # [W,Hkv,blk,hd]
        vb = jnp.swapaxes(read_v(pages), 1, 2)
        key_pos = i * block + jnp.arange(block)
        s = jnp.einsum("whrd,whkd->whrk", qi, kb, precision=HIGHEST)  # [W,Hkv,R,blk]
        ok = (key_pos[None, None, :] <= row_pos[:, :, None]) & (key_pos < max_keys)[None, None, :]  # [W,R,blk]
        s = jnp.where(ok[:, None], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[..., None])
        l = l * alpha + jnp.sum(p, axis=-1)
        acc = acc * alpha[..., None] + jnp.einsum("whrk,whkd->whrd", p, vb, precision=HIGHEST)
        return i + 1, m_new, l, acc

    shape = (items, kv_heads, num_rows)
    init = (jnp.int32(0), jnp.full(shape, -1e30, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros((*shape, head_dim), jnp.float32))
    _, _, l, acc = jax.lax.while_loop(lambda c: c[0] < num_blocks, body, init)
    return acc / jnp.where(l > 0, l, 1.0)[..., None]


def _decode_native(qi, row_pos, item_pages, k_pages, v_pages):
    """_flash_blocks' result for every block up to each item's last position, by the native kernel
    (kernels/native/paged_attention_f32.cc): each (item, KV head) streams its keys and values once."""
    call = jax.ffi.ffi_call(NATIVE_DECODE, jax.ShapeDtypeStruct(qi.shape, jnp.float32))
    return call(qi, k_pages, v_pages, item_pages.astype(jnp.int32), row_pos.astype(jnp.int32))


def _prefill_native(qf, positions, query_start, page_table, lay, offsets, k_pages, v_pages, tile: int):
    """The multi-token sequences' rows by the native kernel in one call: every query tile of `tile` tokens (tile w
    of sequence b, offsets[b] <= w < offsets[b+1]) is an item whose rows are its tokens' GQA groups, each row seeing
    the keys up to its own position (the kernel's register-tiled path for many rows). The tiles are laid out
    statically — at most T // tile + B of them — and the tiles past offsets[B] see no key. Returns [T, Hq, hd] f32
    (rows of one-token sequences and padding: whatever the tile layout gives; the caller selects)."""
    num_tokens, num_heads, head_dim = qf.shape
    num_seqs = page_table.shape[0]
    kv_heads = k_pages.shape[2]
    group = num_heads // kv_heads
    items = num_tokens // tile + num_seqs
    w = jnp.arange(items, dtype=jnp.int32)
    b = jnp.clip(jnp.searchsorted(offsets[:-1], w, side="right").astype(jnp.int32) - 1, 0, num_seqs - 1)
    first = (w - offsets[b]) * tile
    tok = query_start[b][:, None] + first[:, None] + jnp.arange(tile, dtype=jnp.int32)[None, :]  # [W, tile]
    live = (w < offsets[-1])[:, None] & (first[:, None] + jnp.arange(tile)[None, :] < lay.lengths[b][:, None])
    tok_c = jnp.clip(tok, 0, num_tokens - 1)
    qi = qf[tok_c].reshape(items, tile, kv_heads, group, head_dim)
    qi = jnp.moveaxis(qi, 2, 1).reshape(items, kv_heads, tile * group, head_dim)
    row_pos = jnp.repeat(jnp.where(live, positions[tok_c], -1), group, axis=1)  # [W, tile·group]: token-major rows
    o = _decode_native(qi, row_pos, page_table[b], k_pages, v_pages)
    o = jnp.moveaxis(o.reshape(items, kv_heads, tile, group, head_dim), 1, 2).reshape(items * tile, num_heads, head_dim)
    # token t of a multi-token sequence sits in tile offsets[seq] + local // tile, row local % tile
    local = lay.local
    where = jnp.clip(offsets[lay.seq] + local // tile, 0, items - 1) * tile + local % tile
    return o[where]


def _num_blocks(max_pos, block: int, limit: int):
    return jnp.clip((max_pos + block) // block, 1, limit)


def paged_attention_cpu(q, k_pages, v_pages, positions, query_start, page_table, scale: float, *,
                        decode_block_pages: int | None = None, prefill_block_pages: int | None = None,
                        tile: int = 32):
    """Same contract and result as paged_attention_reference; the cost follows the live context, not max_context.

    Flash decoding in f32: a while_loop walks KV blocks of a few pages up to the live bound (a traced value), with
    an online softmax, gathering each block once per work item (never a per-token copy of every page).
    - T ≤ B (decode buckets): every token slot is one work item. Where the native kernel is built (f32 or bf16
      pages, default blocks), each (item, KV head) streams its own live keys once (kernels/native/
      paged_attention_f32.cc); otherwise all items advance together, up to the largest position in the batch.
    - T > B: tokens of one-token sequences (decode rows of a mixed batch) go as above (≤ B items, vectorised); the
      sequences with ≥ 2 tokens are cut into query tiles of `tile` tokens: where the native kernel is built (f32 or
      bf16 pages, default blocks) every tile is an item of one call (_prefill_native, the kernel's register-tiled
      path), else they are processed one tile at a time (a while_loop over a traced count); each tile walks only the
      KV blocks up to its own last position (causal skip).
    Blocks are read through page_reader, so no step widens (or copies) the whole bf16 cache. Padding rows get the
    reference's value (attention to key 0 of sequence B-1). Defaults (measured on CPU at the
    bench preset, docs/cpu_rules_attention.md): decode blocks of 32 keys, prefill tiles of 32 tokens and blocks of
    64 keys.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    num_seqs, pages_per_seq = page_table.shape
    group = num_heads // kv_heads
    dbp = max(1, min(pages_per_seq, decode_block_pages or max(1, 32 // page_size)))
    pbp = max(1, min(pages_per_seq, prefill_block_pages or max(1, 64 // page_size)))
    lay = token_layout(query_start, num_tokens)
    qf = q.astype(jnp.float32) * scale
    read_k, read_v = page_reader(k_pages), page_reader(v_pages)
    native_kernel = k_pages.dtype in (jnp.float32, jnp.bfloat16) and native.ensure(NATIVE_DECODE)
    native_decode = native_kernel and decode_block_pages is None
    native_prefill = native_kernel and prefill_block_pages is None

    def vectorised(tok, seq, ok):
        """Items = single tokens `tok` [W] of sequences `seq` [W] (ok [W]: is a live token) -> [W,Hq,hd]."""
        rows = tok.shape[0]
        qi = qf[tok].reshape(rows, kv_heads, group, head_dim)  # [W,Hkv,g,hd]: one row per head of the group
        row_pos = jnp.repeat(jnp.where(ok, positions[tok], -1)[:, None], group, axis=1)
        if native_decode:
            return _decode_native(qi, row_pos, page_table[seq], k_pages, v_pages).reshape(rows, num_heads, head_dim)
        nb = _num_blocks(jnp.max(jnp.where(ok, positions[tok], 0)), dbp * page_size, -(-pages_per_seq // dbp))
        out = _flash_blocks(qi, row_pos, page_table[seq], read_k, read_v, nb, dbp, page_size)
        return out.reshape(rows, num_heads, head_dim)

    if num_tokens <= num_seqs:
        out = vectorised(jnp.arange(num_tokens), lay.seq, lay.valid)
    else:
        # Decode rows: sequence b's single token.
        single = lay.lengths == 1
        tok_b = jnp.clip(query_start[:-1], 0, num_tokens - 1)
        dec = vectorised(tok_b, jnp.arange(num_seqs), single)  # [B,Hq,hd]
        # Multi-token sequences: query tiles, one at a time.
        tiles = jnp.where(lay.lengths >= 2, (lay.lengths + tile - 1) // tile, 0)
        offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(tiles).astype(jnp.int32)])
        q_pad = jnp.concatenate([qf, jnp.zeros((tile, num_heads, head_dim), jnp.float32)])
        pos_pad = jnp.concatenate([positions, jnp.zeros((tile,), positions.dtype)])
        blocks_max = -(-pages_per_seq // pbp)

        def tile_body(carry):
            w, buf = carry
            b = jnp.clip(jnp.searchsorted(offsets[:-1], w, side="right").astype(jnp.int32) - 1, 0, num_seqs - 1)
            first = (w - offsets[b]) * tile
            start = query_start[b] + first
            rows = jnp.minimum(tile, lay.lengths[b] - first)
            live = jnp.arange(tile) < rows
            qt = jax.lax.dynamic_slice_in_dim(q_pad, start, tile).reshape(tile, kv_heads, group, head_dim)
            qt = jnp.moveaxis(qt, 1, 0).reshape(1, kv_heads, tile * group, head_dim)
            pt = jax.lax.dynamic_slice_in_dim(pos_pad, start, tile)
            row_pos = jnp.repeat(jnp.where(live, pt, -1), group)[None]
            nb = _num_blocks(jnp.max(jnp.where(live, pt, 0)), pbp * page_size, blocks_max)
            o = _flash_blocks(qt, row_pos, page_table[b][None], read_k, read_v, nb, pbp, page_size)
            o = jnp.moveaxis(o.reshape(kv_heads, tile, group, head_dim), 0, 1).reshape(tile, num_heads, head_dim)
            old = jax.lax.dynamic_slice_in_dim(buf, start, tile)
            buf = jax.lax.dynamic_update_slice_in_dim(buf, jnp.where(live[:, None, None], o, old), start, 0)
            return w + 1, buf

        if native_prefill:
            tiled = _prefill_native(qf, positions, query_start, page_table, lay, offsets, k_pages, v_pages, tile)
            out = jnp.where(single[lay.seq][:, None, None], dec[lay.seq], tiled)
        else:
            buf = jnp.zeros((num_tokens + tile, num_heads, head_dim), jnp.float32)
            _, buf = jax.lax.while_loop(lambda c: c[0] < offsets[-1], tile_body, (jnp.int32(0), buf))
            out = jnp.where(single[lay.seq][:, None, None], dec[lay.seq], buf[:num_tokens])
    pad = read_v(page_table[num_seqs - 1, :1][None])[0, 0]  # [Hkv,hd]: the reference's padding row
    out = jnp.where(lay.valid[:, None, None], out, jnp.repeat(pad, group, axis=0)[None])
    return out.astype(q.dtype)
