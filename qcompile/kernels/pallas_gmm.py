"""Pallas TPU grouped matmul, block-sparse over expert groups, with the SwiGLU epilogue fused (tpu rule of
grouped_matmul_swiglu), and its plain form on FP8 weights (tpu rule of grouped_matmul given FP8 weights).

out[N, I] = silu(y[:, :I]) · y[:, I:] with y[r] = rows[r] · w[e(r)], w[E, K, 2I] = [gate | up], rows sorted by expert
(group e owns the consecutive rows [start_e, start_e + g_e); rows past Σg come back 0) — the contract of
kernels/grouped_matmul.py's `grouped_matmul_swiglu_reference`, which the tests compare it with.

Block-sparse: rows are cut into tiles of `tm`; a *visit* is one (row tile, expert group) pair that overlaps, so a tile
that straddles a group boundary is visited once per group and a tile inside one group once; tiles with no routed
row get one visit that only zeroes them. Visits are computed on the device from group_sizes (`group_visits`, at most
num_tiles + E of them, a static bound) and passed to the kernel as scalar-prefetch operands, which the block index
maps read: the rows block of a visit is its tile, the weight blocks are its group's [tk, tn] slices of the gate
half (column block j) and of the up half (column block j + I/tn). Only the experts the batch routed to are read,
each once per tile it touches.

Grid (I/tn, visits, K/tk), k innermost: two f32 accumulators [tm, tn] in VMEM (gate and up) sum over k; at the last
k block the epilogue computes silu(gate) · up in the rows' dtype (as the unfused graph rounds each projection to
it first) for the rows of the visit's group and adds it into the output tile, which stays resident across the
consecutive visits of one tile (its first visit zeroes it). Nothing [N, 2I]-sized is written.

Interpret switch: `interpret=True` runs the kernel through Pallas' interpreter on any backend (tests on CPU compare it
with the reference); `gmm_swiglu_tpu` is the lowering rule: on TPU the compiled kernel (Mosaic), elsewhere the
interpreter, chosen per platform at lowering time (`jax.lax.platform_dependent`), so a graph lowered for `tpu` on a CPU
host exports the real kernel (a `tpu_custom_call`) while the same rule still runs — interpreted — in CPU checks.
Block sizes: 128 (the MXU / lane width), rows in tiles of min(128, N rounded up to 8); K below 128 is one whole
block; otherwise K and I are padded with zeros to multiples of 128 (Mosaic wants a block's last dim to be a multiple
of 128 or the whole dim; K: zero products; I: silu(0)·0 = 0, sliced off) and N to a multiple of the row tile (rows in
no group). Padding the weights per call costs
a copy; weights whose I and K are multiples of 128 (every published Qwen3.5/Qwen3-Next MoE shape) need none.

FP8 weights (`gmm_swiglu_fp8_pallas`, and `gmm_fp8_pallas` for the plain grouped matmul — the experts' down
projection —: the tpu rules given a deferred FP8 weight, kernels/fp8.py): the weight blocks
are read as FP8 — one byte a weight from HBM — with the expert's block scales ([K/tk, 2I/tn] f32, one per weight
tile) in SMEM, and each [tk, tn] tile is dequantized in VMEM (FP8 → f32 × its scale → the rows' dtype: the same
single rounding as the reference's dequantize) just before its dot. It takes Qwen's layout — blocks of 1 × 128 ×
128 over the [E, K, 2I] weight, tiles = blocks, I and K multiples of 128 — and the tpu rule dequantizes any other
layout first.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from qcompile.kernels.fp8 import QuantizedWeight

BLOCK = 128


def group_visits(group_sizes, num_rows: int, tm: int):
    """(tile, group, first, valid) per visit, each i32[num_tiles + E], and the groups' (start, end) row bounds.

    Visits are ordered by tile, then group; a tile's first visit zeroes its output tile. Invalid visits (past the
    real count) repeat the last tile and group with valid = 0 (no compute, no write: the output tile stays resident).
    """
    num_groups = group_sizes.shape[0]
    num_tiles = -(-num_rows // tm)
    sizes = jnp.clip(group_sizes.astype(jnp.int32), 0, None)
    ends = jnp.minimum(jnp.cumsum(sizes), num_rows).astype(jnp.int32)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    total = ends[-1]
    nonempty = ends > starts
    # Non-empty groups in row order, padded with an empty slot at the end.
    compact = jnp.argsort(~nonempty, stable=True).astype(jnp.int32)
    compact_ends = jnp.where(nonempty[compact], ends[compact], jnp.iinfo(jnp.int32).max)
    tile_lo = jnp.arange(num_tiles, dtype=jnp.int32) * tm
    tile_hi = jnp.minimum(tile_lo + tm, total) - 1  # last routed row in the tile (if any)
    has_rows = tile_lo < total
    first_group = jnp.searchsorted(compact_ends, tile_lo, side="right").astype(jnp.int32)
    last_group = jnp.searchsorted(compact_ends, tile_hi, side="right").astype(jnp.int32)
    count = jnp.where(has_rows, last_group - first_group + 1, 1)
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(count).astype(jnp.int32)])
    num_visits = num_tiles + num_groups
    v = jnp.arange(num_visits, dtype=jnp.int32)
    valid = v < offsets[-1]
    last = offsets[-1] - 1
    vv = jnp.where(valid, v, last)
    tile = jnp.clip(jnp.searchsorted(offsets, vv, side="right").astype(jnp.int32) - 1, 0, num_tiles - 1)
    local = vv - offsets[tile]
    slot = jnp.clip(first_group[tile] + local, 0, num_groups - 1)
    group = jnp.where(has_rows[tile], compact[slot], 0)
    first = (local == 0) & valid
    return (tile, group, first.astype(jnp.int32), valid.astype(jnp.int32)), (starts, ends)


def _grouped_kernel(tile_ref, group_ref, first_ref, valid_ref, start_ref, end_ref, x_ref, w_refs, out_ref, accs, *,
                    tm: int, epilogue):
    """One (column block, visit, k block) step: each weight ref's f32 accumulator sums x · w over k; at the last k
    block `epilogue(accumulators)` of the visit's group's rows is added into the output tile (zeroed by the tile's
    first visit)."""
    v, kk = pl.program_id(1), pl.program_id(2)
    valid = valid_ref[v] == 1

    @pl.when(kk == 0)
    def _zero_accumulators():
        for acc in accs:
            acc[...] = jnp.zeros_like(acc)

    @pl.when(valid & (kk == 0) & (first_ref[v] == 1))
    def _zero_output_tile():
        out_ref[...] = jnp.zeros_like(out_ref)

    @pl.when(valid)
    def _accumulate():
        x = x_ref[...]
        for acc, w_ref in zip(accs, w_refs):
            acc[...] += jnp.dot(x, w_ref[...], preferred_element_type=jnp.float32)

    @pl.when(valid & (kk == pl.num_programs(2) - 1))
    def _epilogue():
        group = group_ref[v]
        row = tile_ref[v] * tm + jax.lax.broadcasted_iota(jnp.int32, accs[0].shape, 0)
        mine = (row >= start_ref[group]) & (row < end_ref[group])
        y = epilogue(*(acc[...] for acc in accs))
        out_ref[...] += jnp.where(mine, y, jnp.zeros_like(y)).astype(out_ref.dtype)


def _kernel(tile_ref, group_ref, first_ref, valid_ref, start_ref, end_ref, x_ref, wg_ref, wu_ref, out_ref,
            acc_gate, acc_up, *, tm: int, dtype):
    """The SwiGLU kernel: gate and up accumulators, silu(gate) · up in the rows' dtype (as the unfused graph rounds
    each projection to it first)."""
    _grouped_kernel(tile_ref, group_ref, first_ref, valid_ref, start_ref, end_ref, x_ref, (wg_ref, wu_ref), out_ref,
                    (acc_gate, acc_up), tm=tm,
                    epilogue=lambda gate, up: jax.nn.silu(gate.astype(dtype)) * up.astype(dtype))


class DequantizedTile:
    """An FP8 weight tile ref as the kernels read it (ref[...]): times its block scale, rounded to the rows' dtype."""

    def __init__(self, ref, scale, dtype):
        self.ref, self.scale, self.dtype = ref, scale, dtype

    def __getitem__(self, index):
        return (self.ref[index].astype(jnp.float32) * self.scale).astype(self.dtype)


def _kernel_fp8(tile_ref, group_ref, first_ref, valid_ref, start_ref, end_ref, x_ref, wg_ref, wu_ref, sg_ref,
                su_ref, out_ref, acc_gate, acc_up, *, tm: int, dtype, col_blocks: int):
    """_kernel on FP8 weight tiles: each tile times its block scale (SMEM), rounded to the rows' dtype, then the dot."""
    j, kk = pl.program_id(0), pl.program_id(2)
    _kernel(tile_ref, group_ref, first_ref, valid_ref, start_ref, end_ref, x_ref,
            DequantizedTile(wg_ref, sg_ref[kk, j], dtype), DequantizedTile(wu_ref, su_ref[kk, j + col_blocks], dtype),
            out_ref, acc_gate, acc_up, tm=tm, dtype=dtype)


def _kernel_gmm_fp8(tile_ref, group_ref, first_ref, valid_ref, start_ref, end_ref, x_ref, w_ref, s_ref, out_ref, acc,
                    *, tm: int, dtype):
    """The plain grouped matmul (the down projection) on FP8 weight tiles: one accumulator, rounded to the rows'
    dtype."""
    j, kk = pl.program_id(0), pl.program_id(2)
    _grouped_kernel(tile_ref, group_ref, first_ref, valid_ref, start_ref, end_ref, x_ref,
                    (DequantizedTile(w_ref, s_ref[kk, j], dtype),), out_ref, (acc,), tm=tm,
                    epilogue=lambda y: y.astype(dtype))


def fp8_tiles_fit(w_shape, block, tk: int = BLOCK, tn: int = BLOCK, fused: bool = True) -> bool:
    """Whether an FP8 weight in blocks of `block` is in the layout the FP8 kernels take: [E, K, 2I] for
    gmm_swiglu_fp8_pallas (`fused`), [E, K, N] for gmm_fp8_pallas."""
    _, k, cols = w_shape
    return tuple(block) == (1, tk, tn) and k % tk == 0 and (cols // 2 if fused else cols) % tn == 0


def gmm_swiglu_fp8_pallas(rows, values, scale, group_sizes, *, interpret=False, tm: int = BLOCK, tk: int = BLOCK,
                          tn: int = BLOCK):
    """grouped_matmul_swiglu on FP8 weights [E, K, 2I] with scales [E, K/tk, 2I/tn] (blocks = tiles; see the module
    docstring)."""
    n, k = rows.shape
    half = values.shape[2] // 2
    if n == 0 or half == 0:
        return jnp.zeros((n, half), rows.dtype)
    tm = min(tm, -(-n // 8) * 8)
    x = pad_to(rows, 0, tm)
    col_blocks = half // tn
    (tile, group, first, valid), (starts, ends) = group_visits(group_sizes, n, tm)
    grid = (col_blocks, tile.shape[0], k // tk)
    kb, nb = scale.shape[1:]

    x_map, gate_map, up_map, out_map = _index_maps(col_blocks)

    def scale_map(j, v, kk, tile, group, first, valid, starts, ends):  # the visit's expert's whole scale table
        return group[v], 0, 0

    scale_spec = pl.BlockSpec((None, kb, nb), scale_map, memory_space=pltpu.SMEM)
    call = pl.pallas_call(
        functools.partial(_kernel_fp8, tm=tm, dtype=rows.dtype, col_blocks=col_blocks),
        out_shape=jax.ShapeDtypeStruct((x.shape[0], half), rows.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=grid,
            in_specs=[pl.BlockSpec((tm, tk), x_map),
                      pl.BlockSpec((None, tk, tn), gate_map),
                      pl.BlockSpec((None, tk, tn), up_map),
                      scale_spec, scale_spec],
            out_specs=pl.BlockSpec((tm, tn), out_map),
            scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32), pltpu.VMEM((tm, tn), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        interpret=interpret,
    )
    scale = scale.astype(jnp.float32)
    return call(tile, group, first, valid, starts, ends, x, values, values, scale, scale)[:n]


def gmm_fp8_pallas(rows, values, scale, group_sizes, *, interpret=False, tm: int = BLOCK, tk: int = BLOCK,
                   tn: int = BLOCK):
    """grouped_matmul (rows [N, K] · w[e] [K, N_out], no epilogue: the experts' down projection) on FP8 weights
    [E, K, N_out] with scales [E, K/tk, N_out/tn] — blocks = tiles, as gmm_swiglu_fp8_pallas."""
    n, k = rows.shape
    out_cols = values.shape[2]
    if n == 0 or out_cols == 0:
        return jnp.zeros((n, out_cols), rows.dtype)
    tm = min(tm, -(-n // 8) * 8)
    x = pad_to(rows, 0, tm)
    (tile, group, first, valid), (starts, ends) = group_visits(group_sizes, n, tm)
    x_map, w_map, _, out_map = _index_maps(out_cols // tn)
    kb, nb = scale.shape[1:]

    def scale_map(j, v, kk, tile, group, first, valid, starts, ends):
        return group[v], 0, 0

    call = pl.pallas_call(
        functools.partial(_kernel_gmm_fp8, tm=tm, dtype=rows.dtype),
        out_shape=jax.ShapeDtypeStruct((x.shape[0], out_cols), rows.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(out_cols // tn, tile.shape[0], k // tk),
            in_specs=[pl.BlockSpec((tm, tk), x_map), pl.BlockSpec((None, tk, tn), w_map),
                      pl.BlockSpec((None, kb, nb), scale_map, memory_space=pltpu.SMEM)],
            out_specs=pl.BlockSpec((tm, tn), out_map),
            scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        interpret=interpret,
    )
    return call(tile, group, first, valid, starts, ends, x, values, scale.astype(jnp.float32))[:n]


def gmm_fp8_tpu(rows, w: QuantizedWeight, group_sizes):
    """gmm_fp8_pallas as a lowering rule (a deferred FP8 weight whose layout `fp8_tiles_fit(..., fused=False)`):
    compiled on TPU, interpreted on any other platform."""
    return jax.lax.platform_dependent(
        rows, w.values, w.scale, group_sizes,
        tpu=functools.partial(gmm_fp8_pallas, interpret=False),
        default=functools.partial(gmm_fp8_pallas, interpret=True))


def _index_maps(col_blocks: int):
    """The block index maps of grid (column block j, visit v, k block kk) over the scalar-prefetched visit table:
    the visit's row tile of x, its group's gate and up weight tiles (up is column block j + col_blocks of the fused
    weight), its output tile."""

    def x_map(j, v, kk, tile, group, first, valid, starts, ends):
        return tile[v], kk

    def gate_map(j, v, kk, tile, group, first, valid, starts, ends):
        return group[v], kk, j

    def up_map(j, v, kk, tile, group, first, valid, starts, ends):
        return group[v], kk, j + col_blocks

    def out_map(j, v, kk, tile, group, first, valid, starts, ends):
        return tile[v], j

    return x_map, gate_map, up_map, out_map


def pad_to(x, axis: int, multiple: int):
    size = x.shape[axis]
    pad = -size % multiple
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def gmm_swiglu_pallas(rows, w, group_sizes, *, interpret=False, tm: int = BLOCK, tk: int = BLOCK,
                      tn: int = BLOCK):
    """grouped_matmul_swiglu by the Pallas kernel (see the module docstring); `interpret` is passed to pallas_call
    (False: compile for TPU; True or pltpu.InterpretParams(): Pallas' interpreter, any backend)."""
    n, k = rows.shape
    half = w.shape[2] // 2
    if n == 0 or half == 0:
        return jnp.zeros((n, half), rows.dtype)
    tm = min(tm, -(-n // 8) * 8)  # few rows (decode): one tile of a multiple of 8 rows, not 128
    tk = min(tk, max(k, 1))  # a block's last dim: a multiple of 128, or the whole dim (Mosaic's tiling rule)
    x = pad_to(pad_to(rows, 0, tm), 1, tk)
    fused = w
    if k % tk or half % tn:
        fused = jnp.concatenate([pad_to(pad_to(w[:, :, :half], 1, tk), 2, tn),
                                 pad_to(pad_to(w[:, :, half:], 1, tk), 2, tn)], axis=2)
    rows_p, k_p = x.shape
    half_p = fused.shape[2] // 2
    col_blocks = half_p // tn
    (tile, group, first, valid), (starts, ends) = group_visits(group_sizes, n, tm)
    grid = (col_blocks, tile.shape[0], k_p // tk)

    x_map, gate_map, up_map, out_map = _index_maps(col_blocks)

    call = pl.pallas_call(
        functools.partial(_kernel, tm=tm, dtype=rows.dtype),
        out_shape=jax.ShapeDtypeStruct((rows_p, half_p), rows.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=grid,
            in_specs=[pl.BlockSpec((tm, tk), x_map),
                      pl.BlockSpec((None, tk, tn), gate_map),
                      pl.BlockSpec((None, tk, tn), up_map)],
            out_specs=pl.BlockSpec((tm, tn), out_map),
            scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32), pltpu.VMEM((tm, tn), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        interpret=interpret,
    )
    out = call(tile, group, first, valid, starts, ends, x, fused, fused)
    # Rows in no group: tiles entirely past the routed rows are zeroed by their single visit; rows past Σg inside a
    # visited tile were masked out of every epilogue. Slice the padding off.
    return out[:n, :half]


def gmm_swiglu_tpu(rows, w, group_sizes):
    """The tpu lowering rule: the compiled kernel on TPU, the interpreted one on any other platform. A deferred FP8
    weight in Qwen's layout goes to the FP8 kernel as it is; any other is dequantized first."""
    if isinstance(w, QuantizedWeight):
        if fp8_tiles_fit(w.shape, w.block):
            return jax.lax.platform_dependent(
                rows, w.values, w.scale, group_sizes,
                tpu=functools.partial(gmm_swiglu_fp8_pallas, interpret=False),
                default=functools.partial(gmm_swiglu_fp8_pallas, interpret=True))
        w = w.dequantize()
    return jax.lax.platform_dependent(
        rows, w, group_sizes,
        tpu=functools.partial(gmm_swiglu_pallas, interpret=False),
        default=functools.partial(gmm_swiglu_pallas, interpret=True))
