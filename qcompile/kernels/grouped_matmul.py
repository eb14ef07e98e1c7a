"""Grouped matmul (the MoE expert matmul) for the CPU backend.

`grouped_matmul(rows[N,K], w[E,K,Nout], group_sizes[E]) -> [N,Nout]`: rows are token-expert rows already sorted by
expert, group e owns the consecutive rows [off[e], off[e] + group_sizes[e]) with off the exclusive cumsum; rows from
sum(group_sizes) on are padding. Every function here computes rows_g · w[e] with f32 accumulation and returns
rows.dtype; padding rows come back 0.

The weights are [E, K, Nout] (in × out per expert, ragged_dot's own layout), not the checkpoints' [E, Nout, K]: the
importer transposes them once, as weight preparation (ir/weights.py), because every CPU strategy below ran 1.4-1.9×
faster against [K, Nout] slices than against [Nout, K] ones (the dot then needs no transposed operand; table in
docs/cpu_rules.md), and ragged_dot itself takes this layout without a per-call transpose.

Why: the reference rule, `jax.lax.ragged_dot`, is expanded by JAX 0.10.2 on CPU into a dense product of every row with
every expert (E× the FLOPs and an [E,N,Nout]-sized temporary): on the bench preset one MoE layer took 0.55 s at 4
tokens. The strategies below do work proportional to N (plus one block per routed expert), never to E×N:

- `grouped_matmul_blocks_loop`: rows are cut into blocks of `block` rows that never straddle two experts (a group of
  g rows takes ceil(g/block) blocks); a `lax.while_loop` runs only over the blocks actually used, each one
  dynamic_slice of `block` rows times its expert's weight slice w[e] ([in, out]; XLA materialises the dynamically
  indexed slice, one weight copy per block — `dynamic-slice_bitcast_fusion` in profiles) and written back with
  dynamic_update_slice. Rows of a block past its group's end are computed with the wrong
  expert but are overwritten by the next group's blocks (blocks run in row order), or zeroed at the end when they are
  padding. Weight bytes read = one expert slice per block.
- `grouped_matmul_blocks_batched`: the same block table, but all blocks at once: a static block count
  nb = ceil(N/block) + min(E, N) - 1 (an upper bound on Σ ceil(g_e/block)), rows gathered into [nb, block, K],
  weights gathered per block into [nb, K, Nout] and one batched einsum; each row then takes its result back with a
  gather. Costs a copy of nb weight slices (unused blocks included).
- `grouped_matmul_experts_unrolled`: a static Python loop over the E experts, each under `lax.cond(g_e > 0)` with a
  while-loop over its blocks; the weight slice has a static index, so XLA does not copy it per block. Fast (and the
  only fast bf16 form), but E conditionals cost 4-30 s of XLA compile per call site at E=64 (4-5 s on a quiet machine).
- `grouped_matmul_rowwise`: each row times its own expert's weight (a per-row weight gather [N, K, Nout] and a
  batched matvec). Best at N ≤ 8, collapses from N=32 on.

`grouped_matmul_cpu`, the CPU rule, runs the native kernel for f32 where it can be built (below) and otherwise the
jnp strategy `choose_strategy` picks per static shape (`grouped_matmul_jnp`; see the rule and the table it came from).

- `grouped_matmul_native`: qcompile's C++ kernel (kernels/native/grouped_matmul_f32.cc, an XLA FFI custom call built
  on first use, kernels/native.py): reads each routed expert's weights once where they lie (no slice copy),
  register-tiled rows, XLA's intra-op threads. Measured 1.3-5× faster than the best jnp strategy at every bench-preset
  shape (docs/cpu_rules.md, "native"); f32 only (bf16 keeps the jnp strategies).

Measured (docs/cpu_rules.md, section "grouped_matmul", has the commands, the reading of the table and the
precision check): `python benchmarks/grouped_matmul_cpu.py`, jax 0.10.2 CPU, 2 shared cores, E=64, top-8 random
routing, N = tokens*8; minimum over repeats and over three runs; GB/s = bytes of the experts' weights actually hit
÷ time; **bold** = what `grouped_matmul_cpu` picks.

The full table (194 rows) is in docs/cpu_rules.md; the rule in `choose_strategy` cites the rows it rests on.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp

from qcompile.kernels import native
from qcompile.kernels.fp8 import QuantizedWeight, unit_leading

HIGHEST = jax.lax.Precision.HIGHEST


def grouped_matmul_reference(rows, w, group_sizes):
    """The op's reference rule (qcompile/ir/ops/moe.py): ragged_dot with f32 accumulation, cast to rows.dtype."""
    out = jax.lax.ragged_dot(rows, w, group_sizes, precision=HIGHEST,
                             preferred_element_type=jnp.float32)
    return out.astype(rows.dtype)


# ----------------------------------------------------------------------------------------------------------------
# block table


def max_blocks(num_rows: int, num_experts: int, block: int) -> int:
    """Static upper bound on Σ_e ceil(g_e / block) for Σ g_e ≤ num_rows: each non-empty group wastes < 1 block."""
    if num_rows == 0:
        return 0
    return -(-num_rows // block) + min(num_experts, num_rows) - 1


def _group_offsets(group_sizes, num_rows):
    """Clipped group sizes (so that Σ ≤ N), exclusive starts and the number of real rows."""
    gs = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(gs), num_rows)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    return ends - starts, starts, ends[-1]


def _block_table(group_sizes, num_rows: int, block: int, nb: int):
    """Per block j < nb: (expert, first row); plus the number of used blocks and each expert's first block."""
    gs, starts, total = _group_offsets(group_sizes, num_rows)
    nblk = (gs + block - 1) // block
    blk_end = jnp.cumsum(nblk)
    blk_start = blk_end - nblk
    used = blk_end[-1]
    j = jnp.arange(nb, dtype=jnp.int32)
    expert = jnp.minimum(jnp.searchsorted(blk_end, j, side="right"), gs.shape[0] - 1).astype(jnp.int32)
    first_row = starts[expert] + (j - blk_start[expert]) * block
    return expert, first_row, used, blk_start, starts, total


def _zero_padding(out, total):
    valid = jnp.arange(out.shape[0], dtype=jnp.int32) < total
    return jnp.where(valid[:, None], out, jnp.zeros((), out.dtype))


def _dot(x, we, upcast: bool):
    """x[..., K] · we[K, Nout] in f32."""
    if upcast:
        x = x.astype(jnp.float32)
        we = we.astype(jnp.float32)
    return jax.lax.dot_general(x, we, (((x.ndim - 1,), (0,)), ((), ())), precision=HIGHEST,
                               preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------------------------------------------
# strategies


def grouped_matmul_blocks_loop(rows, w, group_sizes, *, block: int = 16, upcast: bool | None = None):
    """While-loop over the used row blocks; each block = dynamic_slice(rows) · w[e] (see module docstring).

    upcast: convert each block's operands to f32 before the dot (default: when rows are not f32; XLA's CPU bf16 dot
    is far slower than the f32 one for skinny products).
    """
    n, k = rows.shape
    e, _, nout = w.shape
    if upcast is None:
        upcast = rows.dtype != jnp.float32
    if n == 0:
        return jnp.zeros((0, nout), rows.dtype)
    block = max(1, min(block, n))
    nb = max_blocks(n, e, block)
    expert, first_row, used, _, _, total = _block_table(group_sizes, n, block, nb)
    padded = jnp.concatenate([rows, jnp.zeros((block, k), rows.dtype)], axis=0)  # no slice ever clamps
    out = jnp.zeros((n + block, nout), rows.dtype)

    def body(carry):
        j, out = carry
        r0 = first_row[j]
        x = jax.lax.dynamic_slice_in_dim(padded, r0, block, axis=0)
        we = jax.lax.dynamic_index_in_dim(w, expert[j], axis=0, keepdims=False)
        y = _dot(x, we, upcast).astype(rows.dtype)
        return j + 1, jax.lax.dynamic_update_slice_in_dim(out, y, r0, axis=0)

    _, out = jax.lax.while_loop(lambda c: c[0] < used, body, (jnp.int32(0), out))
    return _zero_padding(out[:n], total)


def grouped_matmul_blocks_batched(rows, w, group_sizes, *, block: int = 16, upcast: bool | None = None):
    """All blocks in one batched einsum against per-block gathered weights (see module docstring)."""
    n, k = rows.shape
    e, _, nout = w.shape
    if upcast is None:
        upcast = rows.dtype != jnp.float32
    if n == 0:
        return jnp.zeros((0, nout), rows.dtype)
    block = max(1, min(block, n))
    nb = max_blocks(n, e, block)
    expert, first_row, _, blk_start, starts, total = _block_table(group_sizes, n, block, nb)
    idx = jnp.minimum(first_row[:, None] + jnp.arange(block, dtype=jnp.int32)[None, :], n - 1)
    x = jnp.take(rows, idx, axis=0)  # [nb, block, K]
    wb = jnp.take(w, expert, axis=0)  # [nb, K, Nout]
    if upcast:
        x, wb = x.astype(jnp.float32), wb.astype(jnp.float32)
    y = jnp.einsum("bik,bko->bio", x, wb, precision=HIGHEST, preferred_element_type=jnp.float32)
    r = jnp.arange(n, dtype=jnp.int32)
    ends = jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0))
    row_expert = jnp.minimum(jnp.searchsorted(ends, r, side="right"), e - 1)
    p = r - starts[row_expert]
    flat = (blk_start[row_expert] + p // block) * block + p % block
    flat = jnp.clip(flat, 0, nb * block - 1)
    out = jnp.take(y.reshape(nb * block, nout), flat, axis=0).astype(rows.dtype)
    return _zero_padding(out, total)


def grouped_matmul_experts_unrolled(rows, w, group_sizes, *, block: int = 8, upcast: bool | None = None):
    """A static Python loop over the E experts; expert e runs under `lax.cond(g_e > 0)` a while-loop over its
    ceil(g_e/block) row blocks, each dynamic_slice(rows) · w[e] written back with dynamic_update_slice.

    The weight slice w[e] has a static index, so XLA does not copy it per block as it does for a dynamic index
    (see `grouped_matmul_blocks_loop`); experts with no rows cost one predicate. Rows of a block past its group's end
    are overwritten by later experts (experts run in row order) or zeroed at the end as padding. The graph holds E
    conditionals (compile time grows with E).
    """
    n, k = rows.shape
    e, _, nout = w.shape
    if upcast is None:
        upcast = rows.dtype != jnp.float32
    if n == 0:
        return jnp.zeros((0, nout), rows.dtype)
    block = max(1, min(block, n))
    gs, starts, total = _group_offsets(group_sizes, n)
    nblk = (gs + block - 1) // block
    padded = jnp.concatenate([rows, jnp.zeros((block, k), rows.dtype)], axis=0)
    out = jnp.zeros((n + block, nout), rows.dtype)
    for ex in range(e):
        def expert(out, ex=ex):
            we = w[ex]
            if upcast:
                we = we.astype(jnp.float32)

            def body(carry):
                i, out = carry
                r0 = starts[ex] + i * block
                x = jax.lax.dynamic_slice_in_dim(padded, r0, block, axis=0)
                y = _dot(x.astype(we.dtype), we, False).astype(rows.dtype)
                return i + 1, jax.lax.dynamic_update_slice_in_dim(out, y, r0, axis=0)

            return jax.lax.while_loop(lambda c: c[0] < nblk[ex], body, (jnp.int32(0), out))[1]

        out = jax.lax.cond(nblk[ex] > 0, expert, lambda o: o, out)
    return _zero_padding(out[:n], total)


def grouped_matmul_rowwise(rows, w, group_sizes, *, upcast: bool | None = None):
    """Each row times its own expert's weight: gather w per row, batched matvec. Decode sizes only."""
    n, k = rows.shape
    e, _, nout = w.shape
    if upcast is None:
        upcast = rows.dtype != jnp.float32
    _, _, total = _group_offsets(group_sizes, n)
    ends = jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0))
    row_expert = jnp.minimum(jnp.searchsorted(ends, jnp.arange(n, dtype=jnp.int32), side="right"), e - 1)
    wr = jnp.take(w, row_expert, axis=0)  # [N, K, Nout]
    x = rows
    if upcast:
        x, wr = x.astype(jnp.float32), wr.astype(jnp.float32)
    y = jnp.einsum("nk,nko->no", x, wr, precision=HIGHEST, preferred_element_type=jnp.float32)
    return _zero_padding(y.astype(rows.dtype), total)


# ----------------------------------------------------------------------------------------------------------------
# the CPU rule


def choose_strategy(num_rows: int, num_experts: int, k: int, nout: int, dtype) -> str:
    """The strategy name for a static shape, as benchmarks/grouped_matmul_cpu.py names them: "rowwise",
    "loop b<block>" (grouped_matmul_blocks_loop), "experts b<block>" (grouped_matmul_experts_unrolled).

    From the [E, K, Nout] table in docs/cpu_rules.md (E=64, K/Nout = 1024/256 and 256/1024, top-8, f32, min of 7;
    both matrices give the same ordering within the noise):
    - N ≤ 8 rows (one decode token): "rowwise" (per-row weight gather + batched matvec): 0.27 ms vs 0.35-0.54 for
      "loop b1" and 80-96 ms for ragged_dot. It falls off a cliff from N=32 on (15-40 ms), so only here.
    - N ≤ 64: "loop b2": 1.07-1.10 ms at N=32 (b1 1.45-1.79, b4 1.22-1.24), 1.81-2.11 at N=64 (b4 1.78-2.34).
    - N ≤ 128: "loop b4": 2.42-2.82 ms (b8 2.59-3.00, b16 3.38-4.64).
    - N ≤ 512: "loop b8": 3.00-3.13 ms at N=256 (b16 3.65-4.48, the former [E, Nout, K] rule's 4.7-5.3), 4.0-5.0 at
      N=512 (b16 3.7-5.8).
    - N > 512: "loop b32": 4.5-5.1 ms at N=1024 (b16 4.7-5.5), 6.9-8.0 at N=2048 (b16 7.4-9.2) (a rerun of these
      two rows, min of 9; the first run's 13 ms for gate/up at N=1024 was noise).
    "experts" (no per-block weight copy) costs 4-30 s of XLA compile per call site at E=64 (E unrolled
    conditionals), so it is never chosen. bf16 takes the same blocks: XLA's bf16 dot on CPU is slow for skinny
    products whatever the strategy (docs/cpu_rules.md); fast bf16 MoE on CPU wants f32 expert weights prepared at
    compile time, not another kernel.
    """
    del num_experts, k, nout, dtype
    if num_rows <= 8:
        return "rowwise"
    if num_rows <= 64:
        return "loop b2"
    if num_rows <= 128:
        return "loop b4"
    return "loop b8" if num_rows <= 512 else "loop b32"


NATIVE_F32 = "qcompile_grouped_matmul_f32"


def grouped_matmul_native(rows, w, group_sizes):
    """The native f32 kernel (kernels/native/grouped_matmul_f32.cc, an XLA FFI custom call): each routed expert's
    weights read once where they lie, register-tiled rows, XLA's intra-op threads. Call only after
    `native.ensure(NATIVE_F32)` returned True."""
    n, nout = rows.shape[0], w.shape[2]
    if n == 0:
        return jnp.zeros((0, nout), rows.dtype)
    call = jax.ffi.ffi_call(NATIVE_F32, jax.ShapeDtypeStruct((n, nout), jnp.float32))
    return call(rows.astype(jnp.float32), w.astype(jnp.float32), group_sizes.astype(jnp.int32))


NATIVE_FP8 = "qcompile_grouped_matmul_fp8"
NATIVE_SWIGLU_FP8 = "qcompile_grouped_matmul_swiglu_fp8"


def grouped_matmul_fp8_native(rows, w: QuantizedWeight, group_sizes, swiglu: bool):
    """The native kernel on FP8 expert weights [E, K, Nout] (block scales [E, ceil(K/bk), ceil(Nout/bn)]): each k
    block's slab of a routed expert's weights is dequantized into an L2-resident buffer just before it is multiplied
    (kernels/native/grouped_matmul_f32.cc). Call only after `native.ensure` of its target returned True."""
    n, nout = rows.shape[0], w.shape[2]
    width = nout // 2 if swiglu else nout
    if n == 0:
        return jnp.zeros((0, width), rows.dtype)
    w = unit_leading(w, 1)
    call = jax.ffi.ffi_call(NATIVE_SWIGLU_FP8 if swiglu else NATIVE_FP8, jax.ShapeDtypeStruct((n, width), jnp.float32))
    return call(rows.astype(jnp.float32), w.values,
                w.scale.astype(jnp.float32), group_sizes.astype(jnp.int32), block_k=w.block[1], block_n=w.block[2])


def _fp8_native(rows, w) -> str | None:
    """The FP8 kernel's target when `w` is a deferred FP8 weight the native kernels can take here, else None."""
    if not isinstance(w, QuantizedWeight) or rows.dtype != jnp.float32 or w.dtype != jnp.float32:
        return None
    return NATIVE_FP8


def grouped_matmul_cpu(rows, w, group_sizes):
    """The CPU lowering of grouped_matmul: the native kernel for f32 when it is available (docs/cpu_rules.md,
    "native") — on FP8 weights as they are — else the jnp strategy `choose_strategy` picks for this static shape (FP8
    weights dequantized first)."""
    if _fp8_native(rows, w) and native.ensure(NATIVE_FP8):
        return grouped_matmul_fp8_native(rows, w, group_sizes, swiglu=False)
    if isinstance(w, QuantizedWeight):
        w = w.dequantize()
    if rows.dtype == jnp.float32 and w.dtype == jnp.float32 and native.ensure(NATIVE_F32):
        return grouped_matmul_native(rows, w, group_sizes)
    if _amx(rows, w):
        return grouped_matmul_amx(rows, w, group_sizes)
    if _bf16_native(rows, w) and native.ensure(NATIVE_BF16):
        return grouped_matmul_bf16_native(rows, w, group_sizes)
    return grouped_matmul_jnp(rows, w, group_sizes)


NATIVE_BF16 = "qcompile_grouped_matmul_bf16"


NATIVE_AMX = "qcompile_grouped_matmul_amx"
#: from 8 rows per expert on average AMX is the faster (measured on the bench preset's expert weights of one step, from
#: memory, 2 threads: at 8 rows/expert 51 ms AMX vs 61 FMA, at 6 equal, at 4 49 vs 41 — the AMX kernel streams the
#: weights once whatever the rows, the FMA kernel turns compute-bound; docs/cpu_rules.md, "AMX thresholds"; on expert
#: panels against the VDPBF16PS pair kernel: 46 vs 46 ms at 8, 46 vs 63 at 12, 26 vs 19 at 1 — docs/cpu_rules.md,
#: "bf16 panels in pair order on a CPU with AMX")
AMX_MIN_ROWS_PER_EXPERT = 8


def _bf16_native(rows, w) -> bool:
    return w.dtype == jnp.bfloat16 and rows.dtype in (jnp.float32, jnp.bfloat16)


def _amx(rows, w) -> bool:
    """bf16 rows and weights on a CPU with AMX tiles, K % 32 == 0, Nout % 64 == 0, at prefill-sized row counts."""
    return (rows.dtype == w.dtype == jnp.bfloat16 and rows.shape[1] % 32 == 0 and w.shape[2] % 64 == 0
            and rows.shape[0] >= AMX_MIN_ROWS_PER_EXPERT * w.shape[0]
            and native.amx_bf16() and native.ensure(NATIVE_AMX))


def grouped_matmul_amx(rows, w, group_sizes):
    """bf16 rows times a bf16 checkpoint's experts on AMX tiles (kernels/native/amx_bf16.cc): each work item repacks
    its expert's weights into the tiles' pair-interleaved layout as its first row block multiplies them, f32
    accumulation;
    the result rounded once to bf16. Call only when `_amx` is True."""
    call = jax.ffi.ffi_call(NATIVE_AMX, jax.ShapeDtypeStruct((rows.shape[0], w.shape[2]), jnp.float32))
    return call(rows, w, group_sizes.astype(jnp.int32)).astype(rows.dtype)


def grouped_matmul_bf16_native(rows, w, group_sizes):
    """The native kernel on a bf16 checkpoint's expert weights [E, K, Nout] as they are (widened in registers for
    items of few rows, a slab at a time into an L2-resident f32 buffer for more; kernels/native/grouped_matmul_f32.cc),
    rows widened before and the f32 result rounded once to the rows' dtype (the reference's f32 accumulation). Call
    only after `native.ensure(NATIVE_BF16)` returned True."""
    n, nout = rows.shape[0], w.shape[2]
    if n == 0:
        return jnp.zeros((0, nout), rows.dtype)
    call = jax.ffi.ffi_call(NATIVE_BF16, jax.ShapeDtypeStruct((n, nout), jnp.float32))
    return call(rows.astype(jnp.float32), w, group_sizes.astype(jnp.int32)).astype(rows.dtype)


def grouped_matmul_jnp(rows, w, group_sizes):
    """The best jnp strategy for this static shape (`choose_strategy`); bf16, and f32 without the native kernel."""
    name = choose_strategy(rows.shape[0], w.shape[0], rows.shape[1], w.shape[2], rows.dtype)
    if name == "rowwise":
        return grouped_matmul_rowwise(rows, w, group_sizes)
    kind, block = name.split(" b")
    fn = grouped_matmul_blocks_loop if kind == "loop" else grouped_matmul_experts_unrolled
    return fn(rows, w, group_sizes, block=int(block))


# ----------------------------------------------------------------------------------------------------------------
# SwiGLU-fused form (the swiglu-fusion pass): w = [gate | up] along Nout = 2I, result [N, I]


NATIVE_SWIGLU_F32 = "qcompile_grouped_matmul_swiglu_f32"


def swiglu_halves(y):
    """silu(y[..., :I]) · y[..., I:] in y's dtype — what silu(gate) · up computes in the unfused graph."""
    half = y.shape[-1] // 2
    return jax.nn.silu(y[..., :half]) * y[..., half:]


def grouped_matmul_swiglu_reference(rows, w, group_sizes):
    """The fused op's reference rule: one ragged_dot over the 2I columns, then the SwiGLU halves."""
    return swiglu_halves(grouped_matmul_reference(rows, w, group_sizes))


def grouped_matmul_swiglu_native(rows, w, group_sizes):
    """The native f32 kernel with the SwiGLU epilogue (kernels/native/grouped_matmul_f32.cc); call only after
    `native.ensure(NATIVE_SWIGLU_F32)` returned True."""
    n, half = rows.shape[0], w.shape[2] // 2
    if n == 0:
        return jnp.zeros((0, half), rows.dtype)
    call = jax.ffi.ffi_call(NATIVE_SWIGLU_F32, jax.ShapeDtypeStruct((n, half), jnp.float32))
    return call(rows.astype(jnp.float32), w.astype(jnp.float32), group_sizes.astype(jnp.int32))


def grouped_matmul_swiglu_cpu(rows, w, group_sizes):
    """CPU rule of the fused op: the native kernel with its epilogue for f32 (on FP8 weights as they are), else the
    jnp strategy over the 2I columns (one weight sweep instead of two) and the halves."""
    if _fp8_native(rows, w) and native.ensure(NATIVE_SWIGLU_FP8):
        return grouped_matmul_fp8_native(rows, w, group_sizes, swiglu=True)
    if isinstance(w, QuantizedWeight):
        w = w.dequantize()
    if rows.dtype == jnp.float32 and w.dtype == jnp.float32 and native.ensure(NATIVE_SWIGLU_F32):
        return grouped_matmul_swiglu_native(rows, w, group_sizes)
    # bf16: the product rounded to bf16, then the halves as the reference takes them. An epilogue on the f32 products
    # rounds in other places than the reference does, and in a deep bf16 MoE that flips routes: 0.62 relative logit
    # error against the unoptimized graph's own 0.18 on tests/test_check_noise.py's 8-layer model.
    if _amx(rows, w):
        return swiglu_halves(grouped_matmul_amx(rows, w, group_sizes))
    if _bf16_native(rows, w) and native.ensure(NATIVE_BF16):
        return swiglu_halves(grouped_matmul_bf16_native(rows, w, group_sizes))
    return swiglu_halves(grouped_matmul_jnp(rows, w, group_sizes))


# -- experts in column panels (the cpu target's layout of f32, bf16 and FP8 experts) ----------------------------------

PANEL = 64  # columns per panel: the native kernel's register tile width
NATIVE_PANELS_F32 = "qcompile_grouped_matmul_panels_f32"
NATIVE_SWIGLU_PANELS_F32 = "qcompile_grouped_matmul_swiglu_panels_f32"
NATIVE_PANELS_BF16 = "qcompile_grouped_matmul_panels_bf16"
NATIVE_PANELS_BF16_PAIRS = "qcompile_grouped_matmul_panels_bf16_pairs"  # bf16 rows too, on VDPBF16PS
NATIVE_SWIGLU_PANELS_BF16_PAIRS = "qcompile_grouped_matmul_swiglu_panels_bf16_pairs"  # ... SwiGLU as bf16 rounds it
NATIVE_PANELS_FP8 = "qcompile_grouped_matmul_panels_fp8"
NATIVE_SWIGLU_PANELS_FP8 = "qcompile_grouped_matmul_swiglu_panels_fp8"


def panel_kernel(dtype, swiglu: bool, fp8: bool = False) -> str | None:
    """The native entry point reading experts of `dtype` in panels (None: none for that dtype). bf16 experts go into
    panels on every CPU: where it has AMX tiles, in pair order, which its AMX kernel reads in place at prefill-sized
    rows and VDPBF16PS below (docs/cpu_rules.md, "bf16 panels in pair order on a CPU with AMX"). `fp8`: FP8 experts
    dequantized to `dtype` (f32 or bf16) in the kernel."""
    if fp8:  # bf16: SwiGLU in the kernel as a bf16 graph rounds it (a bf16 result)
        return (NATIVE_SWIGLU_PANELS_FP8 if swiglu else NATIVE_PANELS_FP8) if dtype in ("f32", "bf16") else None
    if dtype == "f32":
        return NATIVE_SWIGLU_PANELS_F32 if swiglu else NATIVE_PANELS_F32
    if dtype == "bf16":
        return NATIVE_PANELS_BF16
    return None


NATIVE_PANELS_AMX = "qcompile_grouped_matmul_panels_amx"  # bf16 rows and expert panels on AMX tiles


def _amx_panels(rows, w) -> bool:
    """bf16 rows and expert panels [E, P, K, 64] on a CPU with AMX tiles, K % 32 == 0, at prefill-sized row counts
    (from AMX_MIN_ROWS_PER_EXPERT per expert on average, as `_amx`)."""
    return (rows.dtype == w.dtype == jnp.bfloat16 and w.ndim == 4 and w.shape[3] == PANEL
            and rows.shape[1] % 32 == 0 and rows.shape[0] >= AMX_MIN_ROWS_PER_EXPERT * w.shape[0]
            and native.amx_bf16() and native.ensure(NATIVE_PANELS_AMX))


NATIVE_PAIR_PANELS_AMX = "qcompile_grouped_matmul_pair_panels_amx"  # ... the panels in pair order, read in place
NATIVE_PAIR_PANELS_BF16 = "qcompile_grouped_matmul_pair_panels_bf16"  # panels in pair order on VDPBF16PS
NATIVE_SWIGLU_PAIR_PANELS_BF16 = "qcompile_grouped_matmul_swiglu_pair_panels_bf16"  # ... SwiGLU as bf16 rounds it
#: expert panels in pair order go to AMX from this many rows per expert on average, below to VDPBF16PS (eight layers'
#: routed experts of a bench-preset step: 4 rows 33.4 vs 35.1 ms, 6 rows 39.4 vs 37.3; docs/cpu_rules.md "bf16 panels
#: in pair order on a CPU with AMX")
AMX_PAIR_MIN_ROWS_PER_EXPERT = 5


def _amx_pair_panels(rows, w) -> bool:
    """bf16 rows and expert panels in pair order on a CPU with AMX tiles, K % 32 == 0, from
    AMX_PAIR_MIN_ROWS_PER_EXPERT rows per expert on average."""
    return (rows.dtype == w.dtype == jnp.bfloat16 and w.ndim == 4 and w.shape[3] == PANEL and rows.shape[1] % 32 == 0
            and rows.shape[0] >= AMX_PAIR_MIN_ROWS_PER_EXPERT * w.shape[0]
            and native.amx_bf16() and native.ensure(NATIVE_PAIR_PANELS_AMX))


def to_pair_order(panels):
    """Panels [..., K, 64] in pair order, the layout AMX's TDPBF16PS reads its B tile in: the weights of k = 2i and
    2i + 1 for column c side by side, at flat position 128·i + 2·c + (k mod 2) of the panel (K even). Same shape."""
    *lead, k, c = panels.shape
    return jnp.swapaxes(panels.reshape(*lead, k // 2, 2, c), -1, -2).reshape(*lead, k, c)


def from_pair_order(panels):
    """The inverse of `to_pair_order`: panels [..., K, 64] stored in pair order back in k order."""
    *lead, k, c = panels.shape
    return jnp.swapaxes(panels.reshape(*lead, k // 2, c, 2), -1, -2).reshape(*lead, k, c)


def from_panels(w):
    """[E, P, K, 64] panels back to [E, K, 64P]: v[e, k, 64p + c] = w[e, p, k, c]."""
    e, p, k, c = w.shape
    return jnp.transpose(w, (0, 2, 1, 3)).reshape(e, k, p * c)


def grouped_matmul_panels_reference(rows, w, group_sizes, swiglu: bool, pair_order: bool = False):
    """The panel op's reference rule: the weights back in [E, K, Nout] (out of pair order first when `pair_order`), then
    grouped_matmul's (and SwiGLU's)."""
    y = grouped_matmul_reference(rows, from_panels(from_pair_order(w) if pair_order else w), group_sizes)
    return swiglu_halves(y) if swiglu else y


def grouped_matmul_panels_fp8_native(rows, w: QuantizedWeight, group_sizes, swiglu: bool):
    """The native kernel on FP8 panels: values [E, P, K, 64] with block scales [E, ceil(P/bp), ceil(K/bk), 1] (blocks
    of 1 x bp panels x bk rows x the whole panel width, what ir/fp8_layout.py makes of Qwen's 128 x 128 blocks), each
    panel row dequantized in registers as it streams by (kernels/native/grouped_matmul_f32.cc), SwiGLU in the
    kernel's epilogue. bf16 (the weight dequantized to bf16, bf16 rows): each weight rounded to bf16 in the kernel as
    the reference's dequantize rounds it — a panel at a time into bf16 pairs on VDPBF16PS where the CPU has
    AVX512_BF16 (K even), else the rows widened exactly —, and a bf16 result: the f32 product rounded once, or
    SwiGLU's halves computed as the reference's bf16 ops round them (native/bf16.h swiglu_bf16). Call only after
    `native.ensure` of the entry point returned True."""
    n, nout = rows.shape[0], w.shape[1] * w.shape[3]
    bf16 = w.dtype == jnp.bfloat16
    width = nout // 2 if swiglu else nout
    if n == 0:
        return jnp.zeros((0, width), rows.dtype)
    w = unit_leading(w, 1)
    scale = w.scale.astype(jnp.float32).reshape(w.scale.shape[:3])
    call = jax.ffi.ffi_call(NATIVE_SWIGLU_PANELS_FP8 if swiglu else NATIVE_PANELS_FP8,
                            jax.ShapeDtypeStruct((n, width), jnp.bfloat16 if bf16 else jnp.float32))
    pairs = bf16 and rows.shape[1] % 2 == 0 and native.avx512_bf16()  # bf16 rows on VDPBF16PS, as they are
    return call(rows if pairs else rows.astype(jnp.float32), w.values, scale, group_sizes.astype(jnp.int32),
                block_p=w.block[1], block_k=w.block[2], bf16_weights=int(bf16)).astype(rows.dtype)


def fp8_panels_fit(rows, w) -> bool:
    """Whether `w` is a deferred FP8 weight in panels the FP8 panel kernel takes with these rows: rows in the weight's
    compute dtype (f32 or bf16), one scale across each panel's 64 columns."""
    return (isinstance(w, QuantizedWeight) and rows.dtype == w.dtype and w.dtype in (jnp.float32, jnp.bfloat16)
            and w.values.ndim == 4 and w.block[3] == w.shape[3] == PANEL)


def grouped_matmul_panels_native(rows, w, group_sizes, swiglu: bool):
    """The native kernel on panels (kernels/native/grouped_matmul_f32.cc): each routed expert's panels streamed front
    to back, a row tile's accumulators in registers over all of K. f32: the SwiGLU epilogue in the kernel when
    `swiglu`; bf16 weights (read as they are: bf16 rows with them multiplied in pairs on VDPBF16PS where the CPU has
    AVX512_BF16, else the weights widened in registers and the rows before): the f32 product rounded once to the
    rows' dtype — bf16 pairs: in the kernel, with SwiGLU's halves as the reference's bf16 ops round them
    (native/bf16.h swiglu_bf16) —, else SwiGLU's halves after it as the reference takes them. Call only after
    `native.ensure` of the entry point returned True."""
    n, nout = rows.shape[0], w.shape[1] * w.shape[3]
    fused = swiglu and w.dtype == jnp.float32
    width = nout // 2 if fused else nout
    if n == 0:
        return jnp.zeros((0, nout // 2 if swiglu else nout), rows.dtype)
    if _amx_panels(rows, w):  # prefill-sized: the f32 product rounded once, then SwiGLU's halves as the reference
        call = jax.ffi.ffi_call(NATIVE_PANELS_AMX, jax.ShapeDtypeStruct((n, nout), jnp.float32))
        y = call(rows, w, group_sizes.astype(jnp.int32)).astype(rows.dtype)
        return swiglu_halves(y) if swiglu else y
    if w.dtype == jnp.bfloat16:
        entry = NATIVE_SWIGLU_PANELS_BF16_PAIRS if swiglu else NATIVE_PANELS_BF16_PAIRS
        if (rows.dtype == jnp.bfloat16 and rows.shape[1] % 2 == 0 and native.avx512_bf16()
                and native.ensure(entry)):  # bf16 pairs multiplied as they are, a bf16 result
            call = jax.ffi.ffi_call(entry, jax.ShapeDtypeStruct((n, nout // 2 if swiglu else nout), jnp.bfloat16))
            return call(rows, w, group_sizes.astype(jnp.int32))
        call = jax.ffi.ffi_call(NATIVE_PANELS_BF16, jax.ShapeDtypeStruct((n, width), jnp.float32))
        y = call(rows.astype(jnp.float32), w, group_sizes.astype(jnp.int32)).astype(rows.dtype)
        return swiglu_halves(y) if swiglu else y
    call = jax.ffi.ffi_call(NATIVE_SWIGLU_PANELS_F32 if swiglu else NATIVE_PANELS_F32,
                            jax.ShapeDtypeStruct((n, width), jnp.float32))
    return call(rows.astype(jnp.float32), w.astype(jnp.float32), group_sizes.astype(jnp.int32))


def grouped_matmul_panels_cpu(rows, w, group_sizes, swiglu: bool, pair_order: bool = False):
    """CPU rule of the panel op: the native kernel (the layout is chosen only where it can be built), else the
    unpacked weights through the [E, K, Nout] CPU rule. `pair_order`: bf16 panels in pair order (`to_pair_order`), read
    where they lie — by AMX tiles from AMX_PAIR_MIN_ROWS_PER_EXPERT rows per expert, by VDPBF16PS below (its operand's
    order: no interleaving) —, else put back in k order first (correct, slower)."""
    if pair_order:
        n, nout = rows.shape[0], w.shape[1] * w.shape[3]
        bf16 = rows.dtype == w.dtype == jnp.bfloat16 and w.ndim == 4 and w.shape[3] == PANEL
        if n == 0 and bf16:
            return jnp.zeros((0, nout // 2 if swiglu else nout), rows.dtype)
        if _amx_pair_panels(rows, w):
            call = jax.ffi.ffi_call(NATIVE_PAIR_PANELS_AMX, jax.ShapeDtypeStruct((n, nout), jnp.float32))
            y = call(rows, w, group_sizes.astype(jnp.int32)).astype(rows.dtype)
            return swiglu_halves(y) if swiglu else y
        entry = NATIVE_SWIGLU_PAIR_PANELS_BF16 if swiglu else NATIVE_PAIR_PANELS_BF16
        if bf16 and rows.shape[1] % 2 == 0 and native.avx512_bf16() and native.ensure(entry):
            call = jax.ffi.ffi_call(entry, jax.ShapeDtypeStruct((n, nout // 2 if swiglu else nout), jnp.bfloat16))
            return call(rows, w, group_sizes.astype(jnp.int32))  # SwiGLU's halves as the reference's bf16 ops
        w = from_pair_order(w)
    if fp8_panels_fit(rows, w) and native.ensure(panel_kernel("f32" if w.dtype == jnp.float32 else "bf16", swiglu,
                                                              fp8=True)):
        return grouped_matmul_panels_fp8_native(rows, w, group_sizes, swiglu)
    if isinstance(w, QuantizedWeight):
        w = w.dequantize()
    f32 = rows.dtype == w.dtype == jnp.float32
    bf16 = w.dtype == jnp.bfloat16 and rows.dtype in (jnp.float32, jnp.bfloat16)
    name = NATIVE_SWIGLU_PANELS_F32 if swiglu else NATIVE_PANELS_F32
    if (f32 and native.ensure(name)) or (bf16 and native.ensure(NATIVE_PANELS_BF16)):
        return grouped_matmul_panels_native(rows, w, group_sizes, swiglu)
    if swiglu:
        return grouped_matmul_swiglu_cpu(rows, from_panels(w), group_sizes)
    return grouped_matmul_cpu(rows, from_panels(w), group_sizes)
