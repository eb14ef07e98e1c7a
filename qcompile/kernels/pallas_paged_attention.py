"""Pallas TPU kernel for ragged paged attention (tpu rule of paged_attention): every sequence of a ragged batch —
decode tokens, prefill chunks, or a mix — in one call, each reading only its own live pages.

Contract: kernels/paged_attention.py's `paged_attention_reference` on the valid rows (the tests compare the two,
interpreted with TPU semantics; padding rows come back 0).

Grid: one program per KV head h ("parallel": KV heads split across the TensorCores). Its query heads (the G = Hq/Hkv
heads that read KV head h) are one VMEM block [G, rows, hd] in head-major layout prepared by the wrapper, with each
token's position as a [rows, 1] column. The pages stay in HBM (`pl.ANY`); query_start, the flattened page table and
the positions are scalar-prefetch operands. Inside, a loop over the batch's sequences, and for each sequence over
blocks of `block_q` of its tokens: the block's last position says how many pages it reaches, and a loop over those
pages copies page j's [page_size, hd] keys and values of head h (a strided DMA out of the [P, page_size, Hkv, hd]
cache, no gather of the whole context) into VMEM and folds them into an online softmax (running max, sum and
accumulator per query row, f32), masked causally by position. So a decode token reads ⌈(pos+1)/page_size⌉ pages,
not the whole page table's, and the same call serves prefill chunks and decodes. A block's rows that belong to the
next sequence are computed and discarded (the store is masked), so rows stay in place with no gather.

Interpret switch as kernels/pallas_gdn.py: `interpret=True` or `pltpu.InterpretParams()` runs Pallas' interpreter
on any backend; `paged_attention_tpu` picks the compiled kernel on TPU and the interpreter elsewhere.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from qcompile.kernels.ragged import token_layout

#: a finite "minus infinity": masked scores exp to 0 and fully masked rows (discarded) stay finite
_MASKED = -1e30


def _kernel(query_start, page_table, positions,  # scalar prefetch
            q_ref, pos_ref, k_hbm, v_hbm,
            o_ref,
            k_vmem, v_vmem, sem, *, num_seqs: int, pages_per_seq: int, page_size: int, block_q: int, scale: float):
    h = pl.program_id(0)
    groups, _, head_dim = q_ref.shape
    num_pages = k_hbm.shape[0]
    f32 = jnp.float32
    o_ref[...] = jnp.zeros_like(o_ref)
    key_offsets = jax.lax.broadcasted_iota(jnp.int32, (1, page_size), 1)
    row_offsets = jax.lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)

    def sequence(seq, carry):
        t0, t1 = query_start[seq], query_start[seq + 1]
        blocks = jax.lax.div(t1 - t0 + block_q - 1, block_q)

        def query_block(i, carry):
            start = t0 + i * block_q
            last = jnp.minimum(start + block_q, t1) - 1
            reach = jnp.minimum(jax.lax.div(positions[last], page_size) + 1, pages_per_seq)
            row_pos = pos_ref[pl.ds(start, block_q), :]  # [bq, 1]
            queries = [q_ref[g, pl.ds(start, block_q), :].astype(f32) * scale for g in range(groups)]

            def page(j, state):
                index = jnp.clip(page_table[seq * pages_per_seq + j], 0, num_pages - 1)
                copies = (pltpu.make_async_copy(k_hbm.at[index, :, h], k_vmem, sem.at[0]),
                          pltpu.make_async_copy(v_hbm.at[index, :, h], v_vmem, sem.at[1]))
                for copy in copies:
                    copy.start()
                for copy in copies:
                    copy.wait()
                keys, values = k_vmem[...].astype(f32), v_vmem[...]
                visible = (j * page_size + key_offsets) <= row_pos  # [bq, ps]: causal, by position
                new = []
                for q, (m, total, acc) in zip(queries, state):
                    s = jax.lax.dot_general(q, keys, (((1,), (1,)), ((), ())), preferred_element_type=f32)
                    s = jnp.where(visible, s, _MASKED)
                    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
                    p = jnp.exp(s - m_new)
                    alpha = jnp.exp(m - m_new)
                    total = alpha * total + jnp.sum(p, axis=1, keepdims=True)
                    acc = alpha * acc + jnp.dot(p.astype(values.dtype), values, preferred_element_type=f32)
                    new.append((m_new, total, acc))
                return tuple(new)

            init = tuple((jnp.full((block_q, 1), _MASKED, f32), jnp.zeros((block_q, 1), f32),
                          jnp.zeros((block_q, head_dim), f32)) for _ in range(groups))
            final = jax.lax.fori_loop(0, reach, page, init)
            mine = (start + row_offsets) < t1  # rows past the sequence's end belong to the next one
            for g, (_, total, acc) in enumerate(final):
                out = acc / jnp.maximum(total, 1e-30)
                o_ref[g, pl.ds(start, block_q), :] = jnp.where(mine, out, o_ref[g, pl.ds(start, block_q), :])
            return carry

        return jax.lax.fori_loop(0, blocks, query_block, carry)

    jax.lax.fori_loop(0, num_seqs, sequence, 0)


def paged_attention_pallas(q, k_pages, v_pages, positions, query_start, page_table, scale: float, *,
                           interpret=False, block_q: int = 8):
    """paged_attention by the Pallas kernel (module docstring); `interpret` as pallas_call's; `block_q`: query rows
    per block (a multiple of 8, the sublane tile)."""
    num_tokens, num_heads, head_dim = q.shape
    num_pages, page_size, kv_heads, _ = k_pages.shape
    num_seqs, pages_per_seq = page_table.shape
    groups = num_heads // kv_heads
    rows = -(-max(num_tokens, 1) // block_q) * block_q + block_q  # a block may start at the last token
    qh = jnp.pad(q, ((0, rows - num_tokens), (0, 0), (0, 0)))
    qh = jnp.moveaxis(qh.reshape(rows, kv_heads, groups, head_dim), 0, 2)  # [Hkv, G, rows, hd]
    qs = query_start.astype(jnp.int32)
    pos = jnp.pad(positions.astype(jnp.int32), (0, rows - num_tokens))
    call = pl.pallas_call(
        functools.partial(_kernel, num_seqs=num_seqs, pages_per_seq=pages_per_seq, page_size=page_size,
                          block_q=block_q, scale=scale),
        out_shape=jax.ShapeDtypeStruct((kv_heads, groups, rows, head_dim), jnp.float32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(kv_heads,),
            in_specs=[pl.BlockSpec((None, groups, rows, head_dim), lambda h, *_: (h, 0, 0, 0)),
                      pl.BlockSpec((rows, 1), lambda h, *_: (0, 0)),
                      pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((None, groups, rows, head_dim), lambda h, *_: (h, 0, 0, 0)),
            scratch_shapes=[pltpu.VMEM((page_size, head_dim), k_pages.dtype),
                            pltpu.VMEM((page_size, head_dim), v_pages.dtype), pltpu.SemaphoreType.DMA((2,))],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
    )
    out = call(qs, page_table.reshape(-1).astype(jnp.int32), pos, qh, pos[:, None], k_pages, v_pages)
    out = jnp.moveaxis(out, 2, 0).reshape(rows, num_heads, head_dim)[:num_tokens]
    valid = token_layout(qs, num_tokens).valid
    return (out * valid[:, None, None]).astype(q.dtype)


def paged_attention_tpu(q, k_pages, v_pages, positions, query_start, page_table, scale: float):
    """The tpu lowering rule: the compiled kernel on TPU, the interpreted one on any other platform."""
    return jax.lax.platform_dependent(
        q, k_pages, v_pages, positions, query_start, page_table,
        tpu=functools.partial(paged_attention_pallas, scale=scale, interpret=False),
        default=functools.partial(paged_attention_pallas, scale=scale, interpret=True))
