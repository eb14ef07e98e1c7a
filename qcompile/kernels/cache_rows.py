"""Cache rows moved without touching the rest of the cache: rows written in place, KV page blocks read widened.

XLA CPU has no bf16 scatter or gather: it "float-normalises" them, converting the whole operand to f32 and back, and
hoists the widening of a loop-invariant cache out of attention's block loop. On a bf16 KV cache or conv state that
is a cost per step that follows the cache's capacity, not the live batch (measured in docs/cpu_rules.md, "bf16
caches"). The native kernels (kernels/native/cache_rows.cc) touch only the named rows; without them, integer
scatters and gathers of the same bits (as_bits) avoid the conversion but not a copy. f32 caches go through XLA, which
scatters them in place already.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qcompile.kernels import native

NATIVE_SCATTER = "qcompile_scatter_rows"
NATIVE_GATHER = "qcompile_kv_gather_f32"


def as_bits(x):
    """A narrow float array (bf16, f16, fp8) as the same-width unsigned integers; f32 and wider as it is.

    Integer scatters and gathers move the same bits as bf16 ones without XLA CPU's float normalisation, but XLA CPU
    materialises the bitcast (a copy of the cache): the fallback when the native kernels are off, ~3x cheaper than
    the float-normalised form.
    """
    if x.dtype.itemsize >= 4:
        return x
    return jax.lax.bitcast_convert_type(x, {2: jnp.uint16, 1: jnp.uint8}[x.dtype.itemsize])


def from_bits(bits, dtype):
    """Inverse of as_bits."""
    return bits if bits.dtype == dtype else jax.lax.bitcast_convert_type(bits, dtype)


def page_reader(pages):
    """pages [P,ps,Hkv,hd] -> read(ids i32[W,n]) -> f32 [W, n·ps, Hkv, hd], pages[ids] widened.

    f32: XLA's gather. bf16: the native gather-and-widen (no step touches pages it does not read), else the integer
    gather of as_bits.
    """
    num_pages, page_size, *row = pages.shape

    def shaped(block, ids):
        return block.reshape(ids.shape[0], ids.shape[1] * page_size, *row).astype(jnp.float32)

    if pages.dtype == jnp.float32:
        return lambda ids: shaped(pages[ids], ids)
    if pages.dtype == jnp.bfloat16 and native.ensure(NATIVE_GATHER):
        def read(ids):
            out = jax.ShapeDtypeStruct((ids.shape[0], ids.shape[1] * page_size, *row), jnp.float32)
            return jax.ffi.ffi_call(NATIVE_GATHER, out)(pages, ids.astype(jnp.int32))
        return read
    bits = as_bits(pages)
    return lambda ids: shaped(from_bits(bits[ids], pages.dtype), ids)


def scatter_rows(array, index, rows, after=()):
    """array [R0,..,Rj, D...], rows [N, D...] -> array with row index[i] (the leading dims flattened into
    R = R0·..·Rj rows) set to rows[i], for index in [0, R); other indices are dropped (callers normalise negative
    ones first, as jnp would). In place where the array's buffer is donated.

    after: values computed from the old array that the caller returns; the write waits for them (else XLA must copy
    the whole array to keep their reads safe)."""
    rows, index = rows.astype(array.dtype), index.astype(jnp.int32)
    if array.dtype.itemsize < 4 and native.ensure(NATIVE_SCATTER):
        call = jax.ffi.ffi_call(NATIVE_SCATTER, jax.ShapeDtypeStruct(array.shape, array.dtype),
                                input_output_aliases={0: 0})
        return call(array, rows, index, *after)
    lead = array.shape[:array.ndim - rows.ndim + 1]
    flat = as_bits(array).reshape(-1, *rows.shape[1:])
    dropped = jnp.where((index >= 0) & (index < flat.shape[0]), index, flat.shape[0])
    return from_bits(flat.at[dropped].set(as_bits(rows), mode="drop").reshape(*lead, *rows.shape[1:]), array.dtype)
