"""Mixture-of-experts ops: router top-k, dispatch into expert-sorted groups, grouped matmul, combine
(spec/model.md §3.6).

The routed MLP is written as dispatch → grouped_matmul(gate), grouped_matmul(up) → silu·mul → grouped_matmul(down)
→ combine, so that later passes can fuse the SwiGLU into one grouped matmul or replace dispatch/combine by
collectives without touching the rest.
"""

from __future__ import annotations

import math

import attrs
import jax
import jax.numpy as jnp

from qcompile.ir.cost import Cost, cost, nbytes
from qcompile.ir.registry import expect, lowering, op, type_rule
from qcompile.kernels.grouped_matmul import (PANEL, grouped_matmul_cpu, grouped_matmul_panels_cpu,
                                             grouped_matmul_panels_reference, grouped_matmul_reference,
                                             grouped_matmul_swiglu_cpu, grouped_matmul_swiglu_reference)
from qcompile.kernels import native
from qcompile.kernels.fp8 import QuantizedWeight, materialized
from qcompile.kernels.moe_routes import NATIVE_DISPATCH, combine_kernel, combine_native, dispatch_native
from qcompile.kernels.pallas_gmm import fp8_tiles_fit, gmm_fp8_tpu, gmm_swiglu_tpu
from qcompile.ir.types import TensorType, dim_mul



@op("router_topk")
@attrs.frozen
class RouterTopK:
    """router_topk(logits[T,E]) -> (weights[T,k] in logits' dtype, expert ids i32[T,k]).

    softmax in f32, top-k (descending), renormalised to sum 1 in f32 when `renormalize`, then cast.
    """

    k: int
    renormalize: bool


@type_rule(RouterTopK)
def _router_type(op_, logits):
    expect(logits.rank == 2 and isinstance(logits.shape[1], int) and op_.k <= logits.shape[1],
           f"router wants [T,E] with E ≥ {op_.k}, got {logits}")
    shape = (logits.shape[0], op_.k)
    return TensorType(logits.dtype, shape), TensorType("i32", shape)


@lowering(RouterTopK)
def _router(op_, logits):
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, op_.k)
    if op_.renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights.astype(logits.dtype), ids.astype(jnp.int32)


@op("moe_dispatch")
@attrs.frozen
class MoeDispatch:
    """moe_dispatch(x[T,H], ids[T,k]) -> (rows[T*k,H] sorted by expert, group_sizes i32[E], order i32[T*k]).

    order[r] is the flattened (token·k + slot) assignment that sorted row r came from; stable in token order.
    """

    num_experts: int


@type_rule(MoeDispatch)
def _dispatch_type(op_, x, ids):
    expect(x.rank == 2 and ids.rank == 2 and ids.shape[0] == x.shape[0] and ids.dtype == "i32", f"dispatch: {x}, {ids}")
    rows = dim_mul(x.shape[0], ids.shape[1])
    return x.with_shape((rows, x.shape[1])), TensorType("i32", (op_.num_experts,)), TensorType("i32", (rows,))


@lowering(MoeDispatch)
def _dispatch(op_, x, ids):
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    rows = jnp.take(x, order // ids.shape[1], axis=0)
    group_sizes = jnp.bincount(flat, length=op_.num_experts).astype(jnp.int32)
    return rows, group_sizes, order


@lowering(MoeDispatch, "cpu")
def _dispatch_cpu(op_, x, ids):
    """A counting sort and one copy per row (kernels/moe_routes.py), where the native kernel can be built."""
    if native.ensure(NATIVE_DISPATCH):
        return dispatch_native(x, ids, op_.num_experts)
    return _dispatch(op_, x, ids)


@op("grouped_matmul")
@attrs.frozen
class GroupedMatmul:
    """grouped_matmul(rows[N,K], w[E,K,Nout], group_sizes[E]) -> [N,Nout]: consecutive row groups times their expert's w.

    w is in × out per expert (ragged_dot's layout); checkpoints store [E, Nout, K], which the importer transposes as
    weight preparation (folded into a prepared parameter once, never per step).
    """


@type_rule(GroupedMatmul)
def _gmm_type(op_, rows, w, group_sizes):
    expect(w.rank == 3 and rows.rank == 2 and rows.shape[1] == w.shape[1], f"grouped_matmul: {rows} vs {w}")
    expect(group_sizes.shape == (w.shape[0],), f"group_sizes {group_sizes} do not match {w.shape[0]} experts")
    expect(rows.dtype == w.dtype, f"grouped_matmul dtypes differ: {rows.dtype} vs {w.dtype}")
    return rows.with_shape((rows.shape[0], w.shape[2]))


@lowering(GroupedMatmul, "cpu", takes_quantized=True)
def _gmm_cpu(op_, rows, w, group_sizes):
    """Without ragged_dot's E× expansion: qcompile's native kernel for f32 (kernels/native.py), else one matvec per
    routed row at decode sizes or a loop over the row blocks in use (kernels/grouped_matmul.py has the measurements)."""
    return grouped_matmul_cpu(rows, w, group_sizes)


@lowering(GroupedMatmul, "tpu", takes_quantized=True)
def _gmm_tpu(op_, rows, w, group_sizes):
    """FP8 weights in Qwen's layout (128 × 128 blocks = the kernel's tiles): the Pallas kernel reading FP8 tiles
    (kernels/pallas_gmm.py); anything else: ragged_dot, native on TPU, on the (dequantized) weight."""
    if isinstance(w, QuantizedWeight) and fp8_tiles_fit(w.shape, w.block, fused=False):
        return gmm_fp8_tpu(rows, w, group_sizes)
    return grouped_matmul_reference(rows, materialized(w), group_sizes)


@lowering(GroupedMatmul)
def _gmm(op_, rows, w, group_sizes):
    return grouped_matmul_reference(rows, w, group_sizes)


@op("grouped_matmul_swiglu")
@attrs.frozen
class GroupedMatmulSwiglu:
    """grouped_matmul_swiglu(rows[N,K], w[E,K,2I], group_sizes[E]) -> [N,I] = silu(y[:, :I]) · y[:, I:] with
    y = grouped_matmul(rows, w, group_sizes): an expert MLP's gate and up projections as one matmul over the fused
    [gate | up] weight, SwiGLU applied to its result (the swiglu-fusion pass; kernels fuse it into the epilogue)."""


@type_rule(GroupedMatmulSwiglu)
def _gmm_swiglu_type(op_, rows, w, group_sizes):
    out = _gmm_type(op_, rows, w, group_sizes)
    expect(isinstance(w.shape[2], int) and w.shape[2] % 2 == 0, f"grouped_matmul_swiglu: {w} is not [gate | up]")
    return out.with_shape((rows.shape[0], w.shape[2] // 2))


@lowering(GroupedMatmulSwiglu, "cpu", takes_quantized=True)
def _gmm_swiglu_cpu(op_, rows, w, group_sizes):
    """The native kernel with the SwiGLU epilogue for f32, else the jnp rule over 2I columns (kernels/grouped_matmul.py)."""
    return grouped_matmul_swiglu_cpu(rows, w, group_sizes)


@lowering(GroupedMatmulSwiglu, "tpu", takes_quantized=True)
def _gmm_swiglu_tpu(op_, rows, w, group_sizes):
    """The Pallas kernel, block-sparse over expert groups with the SwiGLU epilogue (kernels/pallas_gmm.py); compiled
    on TPU, interpreted when this rule runs on another platform (checks on a CPU host)."""
    return gmm_swiglu_tpu(rows, w, group_sizes)


@lowering(GroupedMatmulSwiglu)
def _gmm_swiglu(op_, rows, w, group_sizes):
    return grouped_matmul_swiglu_reference(rows, w, group_sizes)


@op("grouped_matmul_panels")
@attrs.frozen
class GroupedMatmulPanels:
    """grouped_matmul_panels(rows[N,K], w[E,P,K,64], group_sizes[E]) -> [N,64P] = grouped_matmul(rows, v,
    group_sizes) with v[e, k, 64p + c] = w[e, p, k, c]: expert weights prepared in column panels of 64, each stored
    k-major — the layout the CPU's native kernel streams (ir/target_layout.py rewrites grouped_matmul and
    grouped_matmul_swiglu so for the cpu target). swiglu: grouped_matmul_swiglu's halves on top (-> [N,32P]).
    pair_order: each panel stored in pair order (kernels/grouped_matmul.py to_pair_order), same shape."""

    swiglu: bool = False
    pair_order: bool = False


@type_rule(GroupedMatmulPanels)
def _gmm_panels_type(op_, rows, w, group_sizes):
    expect(w.rank == 4 and w.shape[3] == PANEL and rows.rank == 2 and rows.shape[1] == w.shape[2],
           f"grouped_matmul_panels weight {w} is not [E,P,K,{PANEL}] panels for rows {rows}")
    expect(group_sizes.shape == (w.shape[0],), f"group_sizes {group_sizes} do not match {w.shape[0]} experts")
    expect(rows.dtype == w.dtype, f"grouped_matmul_panels dtypes differ: {rows.dtype} vs {w.dtype}")
    expect(not op_.pair_order or (isinstance(w.shape[2], int) and w.shape[2] % 2 == 0),
           f"grouped_matmul_panels in pair order needs an even K: {w}")
    n = w.shape[1] * PANEL
    return rows.with_shape((rows.shape[0], n // 2 if op_.swiglu else n))


@lowering(GroupedMatmulPanels)
def _gmm_panels(op_, rows, w, group_sizes):
    return grouped_matmul_panels_reference(rows, w, group_sizes, op_.swiglu, op_.pair_order)


@lowering(GroupedMatmulPanels, "cpu", takes_quantized=True)
def _gmm_panels_cpu(op_, rows, w, group_sizes):
    """The native panel kernel (with the SwiGLU epilogue when asked; FP8 panels dequantized in registers),
    kernels/grouped_matmul.py."""
    return grouped_matmul_panels_cpu(rows, w, group_sizes, op_.swiglu, op_.pair_order)


@op("moe_combine")
@attrs.frozen
class MoeCombine:
    """moe_combine(rows[T*k,H], order[T*k], weights[T,k]) -> [T,H] = Σ_slot weight · row (products in the rows' dtype, sum in f32)."""


@type_rule(MoeCombine)
def _combine_type(op_, rows, order, weights):
    expect(rows.rank == 2 and weights.rank == 2 and rows.shape[0] == order.shape[0], f"combine: {rows}, {order}, {weights}")
    return rows.with_shape((weights.shape[0], rows.shape[1]))


@lowering(MoeCombine)
def _combine(op_, rows, order, weights):
    tokens, k = weights.shape
    return weighted_route_sum(jnp.zeros_like(rows).at[order].set(rows).reshape(tokens, k, rows.shape[1]), weights)


@lowering(MoeCombine, "cpu")
def _combine_cpu(op_, rows, order, weights):
    """Each routed row read once where it lies, each token written once (kernels/moe_routes.py): f32, or bf16 with
    each product rounded to bf16 as the reference rounds it."""
    kernel = combine_kernel(rows, weights)
    if kernel is not None and native.ensure(kernel):
        return combine_native(rows, order, weights)
    return _combine(op_, rows, order, weights)


def weighted_route_sum(routes, weights):
    """Σ_j weights[t, j] · routes[t, j, :] for routes [T, k, H] in token order: each product rounded to the model
    dtype, as HF does, the sum over the k routes in f32."""
    weighted = routes * weights.astype(routes.dtype)[:, :, None]
    return jnp.sum(weighted.astype(jnp.float32), axis=1).astype(routes.dtype)


@cost(GroupedMatmul)
@cost(GroupedMatmulSwiglu)
def _gmm_cost(op_, operands, results, step):
    """Each routed row is multiplied once; only the experts the batch chose are read."""
    (_, rows_shape), (w, w_shape), _ = operands
    experts = min(step.experts_touched, w_shape[0])
    return Cost(2.0 * rows_shape[0] * w_shape[1] * w_shape[2], experts * nbytes(w, w_shape[1:]))


@cost(GroupedMatmulPanels)
def _gmm_panels_cost(op_, operands, results, step):
    """As grouped_matmul's: w[E, P, K, 64] holds the same weights."""
    (_, rows_shape), (w, w_shape), _ = operands
    experts = min(step.experts_touched, w_shape[0])
    return Cost(2.0 * rows_shape[0] * math.prod(w_shape[1:]), experts * nbytes(w, w_shape[1:]))
