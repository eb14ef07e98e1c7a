"""MoE dispatch and combine on CPU: qcompile's native kernels (kernels/native/moe_routes.cc, XLA FFI custom calls).

`dispatch_native(x[T,H], ids i32[T,k], num_experts)` -> (rows[T*k,H] sorted by expert, group_sizes i32[E],
order i32[T*k]): the contract of moe_dispatch (ir/ops/moe.py) — a stable sort of the routes by expert, rows copied
from x — for ids in [0, E] (E: a route to no expert here, placed after every group and not counted; the router and
the expert-parallel dispatch give no other). Any element type (rows are moved as bytes).

`combine_native(rows[T*k,H], order i32[T*k], weights[T,k])` -> [T,H] = Σ_j weights[t,j] · rows[the row route t·k+j
became]: f32 (the reassociating class of moe_combine's reference: products and their sum in f32), or bf16 rounded
as the reference rounds it (each product to bf16, the sum over k in f32, the result once).

Why: XLA CPU lowers the reference rules to a sort, a bincount scatter, a row gather with a bounds select, a zero fill
and a scatter of every row back into route order — ~24 ms per MoE layer at 1024 tokens × top-8 on the bench preset
(`python benchmarks/moe_routes_cpu.py`; docs/cpu_rules.md, "moe_dispatch and moe_combine"). The kernels count-sort
the routes and copy or read each row once. Call only after `native.ensure` of their target returned True.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NATIVE_DISPATCH = "qcompile_moe_dispatch"
NATIVE_COMBINE_F32 = "qcompile_moe_combine_f32"
NATIVE_COMBINE_BF16 = "qcompile_moe_combine_bf16"


def dispatch_native(x, ids, num_experts: int):
    n = ids.shape[0] * ids.shape[1]
    call = jax.ffi.ffi_call(NATIVE_DISPATCH, (jax.ShapeDtypeStruct((n, x.shape[1]), x.dtype),
                                              jax.ShapeDtypeStruct((num_experts,), jnp.int32),
                                              jax.ShapeDtypeStruct((n,), jnp.int32)))
    return tuple(call(x, ids.astype(jnp.int32)))


def combine_kernel(rows, weights) -> str | None:
    """The combine kernel for these dtypes: f32, or bf16 rows and weights; None for anything else."""
    if rows.dtype == weights.dtype == jnp.float32:
        return NATIVE_COMBINE_F32
    return NATIVE_COMBINE_BF16 if rows.dtype == weights.dtype == jnp.bfloat16 else None


def combine_native(rows, order, weights):
    call = jax.ffi.ffi_call(combine_kernel(rows, weights),
                            jax.ShapeDtypeStruct((weights.shape[0], rows.shape[1]), rows.dtype))
    return call(rows, order.astype(jnp.int32), weights)
