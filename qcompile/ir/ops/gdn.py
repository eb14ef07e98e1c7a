"""Gated DeltaNet ops: causal conv with state, decay/β gates, the delta-rule recurrence, the gated RMSNorm
(spec/model.md §3.5)."""

from __future__ import annotations

import attrs
import jax
import jax.numpy as jnp

from qcompile.ir.cost import Cost, cost, nbytes
from qcompile.ir.registry import expect, lowering, op, type_rule
from qcompile.ir.types import TensorType
from qcompile.kernels.causal_conv1d import causal_conv1d_cpu, causal_conv1d_reference
from qcompile.kernels.gdn import gdn_chunked_reference, gdn_recurrence_cpu, gdn_recurrent_reference


@op("causal_conv1d")
@attrs.frozen
class CausalConv1d:
    """causal_conv1d(x[T,C], state[S,C,K-1], w[C,K], query_start, state_slots) -> (silu(conv(x)), new state).

    Depthwise, no bias, tap K-1 on the current token; earlier taps read the sequence's cached columns.
    """

    activation: str = "silu"


@type_rule(CausalConv1d)
def _conv_type(op_, x, state, w, query_start, slots):
    expect(x.rank == 2 and w.rank == 2 and x.shape[1] == w.shape[0], f"conv weight {w} does not match {x}")
    expect(state.rank == 3 and state.shape[1] == x.shape[1] and state.shape[2] == w.shape[1] - 1,
           f"conv state {state} does not match weight {w}")
    return x, state


@lowering(CausalConv1d)
def _conv(op_, x, state, w, query_start, slots):
    return causal_conv1d_reference(x, state, w, query_start, slots, op_.activation)


@lowering(CausalConv1d, "cpu")
def _conv_cpu(op_, x, state, w, query_start, slots):
    """Shifted slices of x instead of a [T,K,C] window gather; the state read only where a tap reaches it."""
    return causal_conv1d_cpu(x, state, w, query_start, slots, op_.activation)


@op("gdn_gates")
@attrs.frozen
class GdnGates:
    """gdn_gates(a[T,Hv], b[T,Hv], A_log[Hv], dt_bias[Hv]) -> (g, beta), f32.

    g = -exp(A_log)·softplus(a + dt_bias) (log-decay, f32); beta = sigmoid(b) computed in b's dtype, then f32.
    """


@type_rule(GdnGates)
def _gates_type(op_, a, b, a_log, dt_bias):
    expect(a.shape == b.shape and a.shape[-1] == a_log.shape[0] == dt_bias.shape[0], f"gate shapes differ: {a} {b} {a_log}")
    f32 = TensorType("f32", a.shape)
    return f32, f32


@lowering(GdnGates)
def _gates(op_, a, b, a_log, dt_bias):
    g = -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(a.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    beta = jax.nn.sigmoid(b).astype(jnp.float32)
    return g, beta


@op("gdn_recurrence")
@attrs.frozen
class GdnRecurrence:
    """gdn_recurrence(q[T,Hk,dk], k[T,Hk,dk], v[T,Hv,dv], g, beta, state[S,Hv,dk,dv], query_start, state_slots)
    -> (o[T,Hv,dv] in v's dtype, new state f32).

    q and k are L2-normalised over dk (x·rsqrt(Σx²+1e-6)), q scaled by dk^-0.5, both repeated to the value heads
    (value head j reads key head j // (Hv/Hk)); then the gated delta rule with the read after the write.
    mode: "chunked" (prefill-friendly), "recurrent" (decode-friendly) or "auto" (recurrent when the bucket has at most
    one token slot per sequence slot, chunked otherwise). All modes compute the same function.
    """

    mode: str = attrs.field(default="auto", validator=attrs.validators.in_(("auto", "chunked", "recurrent")))
    chunk_size: int = 64


@type_rule(GdnRecurrence)
def _recurrence_type(op_, q, k, v, g, beta, state, query_start, slots):
    expect(q == k and q.rank == 3 and v.rank == 3, f"q {q} / k {k} / v {v} do not match")
    hk, hv = q.shape[1], v.shape[1]
    expect(isinstance(hk, int) and isinstance(hv, int) and hv % hk == 0, f"value heads {hv} not a multiple of key heads {hk}")
    expect(g.shape == beta.shape == (v.shape[0], hv), f"gates {g} do not match values {v}")
    expect(state.rank == 4 and tuple(state.shape[1:]) == (hv, q.shape[2], v.shape[2]) and state.dtype == "f32",
           f"state {state} must be f32[S,{hv},{q.shape[2]},{v.shape[2]}]")
    return v, state


def l2_normalize(x, eps: float = 1e-6):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _normalized(q, k, v):
    """q, k L2-normalised (q also scaled by dk^-0.5) and repeated to the value heads; v in f32."""
    ratio = v.shape[1] // q.shape[1]
    dk = q.shape[2]
    qf = jnp.repeat(l2_normalize(q.astype(jnp.float32)) * dk**-0.5, ratio, axis=1)
    kf = jnp.repeat(l2_normalize(k.astype(jnp.float32)), ratio, axis=1)
    return qf, kf, v.astype(jnp.float32)


@lowering(GdnRecurrence, "cpu")
def _recurrence_cpu(op_, q, k, v, g, beta, state, query_start, slots):
    """Decode batches update every state slot in one vectorised step; other batches scan token by token (faster on
    CPU than the chunked form at every measured size). An explicit mode is honoured as in the reference."""
    if op_.mode != "auto":
        return _recurrence(op_, q, k, v, g, beta, state, query_start, slots)
    qf, kf, vf = _normalized(q, k, v)
    out, new_state = gdn_recurrence_cpu(qf, kf, vf, g, beta, state, query_start, slots, op_.chunk_size)
    return out.astype(v.dtype), new_state


@lowering(GdnRecurrence)
def _recurrence(op_, q, k, v, g, beta, state, query_start, slots):
    ratio = v.shape[1] // q.shape[1]
    dk = q.shape[2]
    qf = jnp.repeat(l2_normalize(q.astype(jnp.float32)) * dk**-0.5, ratio, axis=1)
    kf = jnp.repeat(l2_normalize(k.astype(jnp.float32)), ratio, axis=1)
    vf = v.astype(jnp.float32)
    mode = op_.mode
    if mode == "auto":
        mode = "recurrent" if q.shape[0] <= query_start.shape[0] - 1 else "chunked"
    if mode == "recurrent":
        out, new_state = gdn_recurrent_reference(qf, kf, vf, g, beta, state, query_start, slots)
    else:
        out, new_state = gdn_chunked_reference(qf, kf, vf, g, beta, state, query_start, slots, op_.chunk_size)
    return out.astype(v.dtype), new_state


@op("gated_rmsnorm")
@attrs.frozen
class GatedRmsNorm:
    """gated_rmsnorm(x[...,d], z[...,d], w[d]): ((w · rmsnorm(x)→dtype) · silu(z_f32)) → dtype; plain weight (no 1+)."""

    eps: float


@type_rule(GatedRmsNorm)
def _gated_norm_type(op_, x, z, w):
    expect(x == z and w.rank == 1 and w.shape[0] == x.shape[-1], f"gated_rmsnorm operands differ: {x} {z} {w}")
    return x


@lowering(GatedRmsNorm)
def _gated_norm(op_, x, z, w):
    xf = x.astype(jnp.float32)
    normed = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + op_.eps)).astype(x.dtype)
    return ((w.astype(x.dtype) * normed) * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)


@cost(CausalConv1d)
def _conv_cost(op_, operands, results, step):
    (x, x_shape), (state, state_shape), (w, w_shape), *_ = operands
    per_seq = nbytes(state, state_shape[1:])
    return Cost(2.0 * x_shape[0] * w_shape[0] * w_shape[1], nbytes(w, w_shape) + 2.0 * step.sequences * per_seq)


@cost(GdnRecurrence)
def _recurrence_cost(op_, operands, results, step):
    """State read and written once per sequence; per token and head: decay, Sᵀk, the rank-1 update and Sᵀq."""
    (_, q_shape), _, _, _, _, (state, state_shape), *_ = operands
    heads, dk, dv = state_shape[1:]
    return Cost(7.0 * q_shape[0] * heads * dk * dv, 2.0 * step.sequences * nbytes(state, state_shape[1:]))
