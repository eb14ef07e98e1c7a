"""Gated DeltaNet ops: causal conv with state, decay/β gates, the delta-rule recurrence, the gated RMSNorm
(spec/model.md §3.5)."""

from __future__ import annotations

import attrs
import jax
import jax.numpy as jnp
import numpy as np

from qcompile.ir.cost import Cost, cost, nbytes
from qcompile.ir.registry import expect, local_form, lowering, op, type_rule
from qcompile.ir.types import TensorType
from qcompile.kernels.causal_conv1d import causal_conv1d_cpu, causal_conv1d_reference
from qcompile.kernels.gdn_fused import gates, gdn_fused_cpu, gdn_fused_reference, recurrence
from qcompile.kernels.pallas_gdn import gdn_fused_tpu


MODES = ("auto", "chunked", "recurrent")
STATE_DTYPES = ("f32", "bf16")


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
    return gates(a, b, a_log, dt_bias)


@op("gdn_recurrence")
@attrs.frozen
class GdnRecurrence:
    """gdn_recurrence(q[T,Hk,dk], k[T,Hk,dk], v[T,Hv,dv], g, beta, state[S,Hv,dk,dv], query_start, state_slots)
    -> (o[T,Hv,dv] in v's dtype, new state in the state's dtype).

    q and k are L2-normalised over dk (x·rsqrt(Σx²+1e-6)), q scaled by dk^-0.5, both repeated to the value heads
    (value head j reads key head j // (Hv/Hk)); then the gated delta rule with the read after the write, in f32 (a
    bf16 state — the bf16-state pass — is read into f32 and rounded once when stored). Padding rows give 0.
    mode: "chunked" (prefill-friendly), "recurrent" (decode-friendly) or "auto" (recurrent when the bucket has at most
    one token slot per sequence slot, chunked otherwise). All modes compute the same function.
    """

    mode: str = attrs.field(default="auto", validator=attrs.validators.in_(MODES))
    chunk_size: int = 64


def _check_state(state, hv, dk, dv):
    expect(state.rank == 4 and tuple(state.shape[1:]) == (hv, dk, dv) and state.dtype in STATE_DTYPES,
           f"state {state} must be f32 or bf16 [S,{hv},{dk},{dv}]")


@type_rule(GdnRecurrence)
def _recurrence_type(op_, q, k, v, g, beta, state, query_start, slots):
    expect(q == k and q.rank == 3 and v.rank == 3, f"q {q} / k {k} / v {v} do not match")
    hk, hv = q.shape[1], v.shape[1]
    expect(isinstance(hk, int) and isinstance(hv, int) and hv % hk == 0, f"value heads {hv} not a multiple of key heads {hk}")
    expect(g.shape == beta.shape == (v.shape[0], hv), f"gates {g} do not match values {v}")
    _check_state(state, hv, q.shape[2], v.shape[2])
    return v, state


@lowering(GdnRecurrence, "cpu")
def _recurrence_cpu(op_, q, k, v, g, beta, state, query_start, slots):
    """Decode batches update every state slot in one vectorised step; other batches scan token by token (faster on
    CPU than the chunked form at every measured size); the native kernel where it is available
    (kernels/gdn.py::gdn_recurrence_cpu). An explicit mode is honoured as in the reference."""
    return recurrence(q, k, v, g, beta, state, query_start, slots, op_.mode, op_.chunk_size, rule="cpu")


@lowering(GdnRecurrence)
def _recurrence(op_, q, k, v, g, beta, state, query_start, slots):
    return recurrence(q, k, v, g, beta, state, query_start, slots, op_.mode, op_.chunk_size)


@op("gated_delta_net")
@attrs.frozen
class GatedDeltaNet:
    """gated_delta_net(x[T,C], a[T,Hv], b[T,Hv], conv_state[S,C,K-1], conv_w[C,K], A_log[Hv], dt_bias[Hv],
    state[S,Hv,dk,dv], query_start, state_slots) -> (o[T,Hv,dv] in x's dtype, new conv state, new state).

    The GDN layer's core as one op (the gdn-conv-fusion pass): causal_conv1d(silu) of x, its columns split as
    [q: Hk·dk | k: Hk·dk | v: Hv·dv], gdn_gates(a, b, A_log, dt_bias), then gdn_recurrence — the same function as
    those ops in sequence. Both states may be f32 or bf16 (computed in f32). Padding rows give 0. `mode` as
    gdn_recurrence's. `groups` > 1: x's channels (and the conv weight's and conv state's) are laid out as groups ×
    [q_j | k_j | v_j] (ir/abi.py `grouped_order`) — tensor parallelism's layout, where each device's block is one
    group and sees `groups` 1 (its local form).
    """

    mode: str = attrs.field(default="auto", validator=attrs.validators.in_(MODES))
    chunk_size: int = 64
    groups: int = attrs.field(default=1, validator=attrs.validators.ge(1))


@type_rule(GatedDeltaNet)
def _gdn_type(op_, x, a, b, conv_state, conv_w, a_log, dt_bias, state, query_start, slots):
    expect(x.rank == 2 and conv_w.rank == 2 and x.shape[1] == conv_w.shape[0],
           f"conv weight {conv_w} does not match {x}")
    expect(conv_state.rank == 3 and conv_state.shape[1] == x.shape[1] and conv_state.shape[2] == conv_w.shape[1] - 1
           and conv_state.dtype in (x.dtype, "bf16"), f"conv state {conv_state} does not match weight {conv_w}")
    expect(state.rank == 4, f"state {state} must be [S,Hv,dk,dv]")
    hv, dk, dv = state.shape[1:]
    _check_state(state, hv, dk, dv)
    qk = x.shape[1] - hv * dv
    expect(qk > 0 and qk % (2 * dk) == 0 and hv % (qk // (2 * dk)) == 0,
           f"{x} does not split into [q | k | v] for {hv} value heads of {dk}x{dv}")
    expect(a.shape == b.shape == (x.shape[0], hv) and a_log.shape == dt_bias.shape == (hv,),
           f"gates {a} {b} {a_log} {dt_bias} do not match {hv} value heads")
    expect(all(size % op_.groups == 0 for size in (qk // 2, hv * dv)),
           f"{x}: [q | k | v] does not split into {op_.groups} groups")
    return TensorType(x.dtype, (x.shape[0], hv, dv)), conv_state, state


def _plain_channels(rule):
    """`rule` run on x, conv weight and conv state in the plain [q | k | v] channel order when the op's channels are
    grouped (groups > 1, outside a mesh), its new conv state regrouped. One group (a device's block) runs as is."""

    def grouped(op_, x, a, b, conv_state, conv_w, a_log, dt_bias, state, query_start, slots):
        if op_.groups == 1:
            return rule(op_, x, a, b, conv_state, conv_w, a_log, dt_bias, state, query_start, slots)
        from qcompile.ir.abi import grouped_order

        values = state.shape[1] * state.shape[3]
        keys = (x.shape[1] - values) // 2
        order = grouped_order((keys, keys, values), op_.groups)
        plain = np.argsort(order)
        o, conv_new, state_new = rule(op_, x[:, plain], a, b, conv_state[:, plain], conv_w[plain], a_log, dt_bias,
                                      state, query_start, slots)
        return o, conv_new[:, order], state_new

    return grouped


@local_form(GatedDeltaNet)
def _local_gdn(op_, result_types, mesh):
    """A device's block holds groups / (the pieces its heads are split into) groups."""
    heads = result_types[0].sharding.dims[1] if result_types[0].sharding is not None else None
    return op_ if heads is None or op_.groups == 1 else attrs.evolve(op_, groups=op_.groups // mesh.ways(heads))


@lowering(GatedDeltaNet)
@_plain_channels
def _gdn(op_, x, a, b, conv_state, conv_w, a_log, dt_bias, state, query_start, slots):
    return gdn_fused_reference(x, a, b, conv_state, conv_w, a_log, dt_bias, state, query_start, slots, op_.mode,
                               op_.chunk_size)


@lowering(GatedDeltaNet, "cpu")
@_plain_channels
def _gdn_cpu(op_, x, a, b, conv_state, conv_w, a_log, dt_bias, state, query_start, slots):
    """The native fused kernel (kernels/native/gdn_fused_f32.cc) for f32 activations; else the unfused CPU rules."""
    return gdn_fused_cpu(x, a, b, conv_state, conv_w, a_log, dt_bias, state, query_start, slots, op_.mode,
                         op_.chunk_size)


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


@cost(GatedDeltaNet)
def _gdn_cost(op_, operands, results, step):
    """The conv's taps and the recurrence's work; both states read and written once per sequence, x read once."""
    (x, x_shape), _, _, (cs, cs_shape), (w, w_shape), _, _, (state, state_shape), *_ = operands
    heads, dk, dv = state_shape[1:]
    flops = 2.0 * x_shape[0] * w_shape[0] * w_shape[1] + 7.0 * x_shape[0] * heads * dk * dv
    per_seq = nbytes(cs, cs_shape[1:]) + nbytes(state, state_shape[1:])
    return Cost(flops, nbytes(w, w_shape) + 2.0 * step.sequences * per_seq)


@lowering(GatedDeltaNet, "tpu")
@_plain_channels
def _gdn_tpu(op_, x, a, b, conv_state, conv_w, a_log, dt_bias, state, query_start, slots):
    """The Pallas kernel (kernels/pallas_gdn.py): each sequence's state in VMEM across its tokens; decode, prefill and
    mixed batches in one call (every mode computes the same function)."""
    return gdn_fused_tpu(x, a, b, conv_state, conv_w, a_log, dt_bias, state, query_start, slots)
