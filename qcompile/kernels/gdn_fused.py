"""The fused Gated DeltaNet core (the gdn-conv-fusion pass's op): causal conv + SiLU + q/k L2 norm + gates + delta
rule in one call over a ragged batch, with both states in place.

Contract (ir/ops/gdn.py GatedDeltaNet): x [T, C] (columns [q | k | v], C = 2·Hk·dk + Hv·dv), a, b [T, Hv],
conv_state [S, C, K-1], conv_w [C, K], A_log, dt_bias [Hv], state [S, Hv, dk, dv], query_start [B+1],
state_slots [B] -> (o [T, Hv, dv] in x's dtype, new conv state, new state). Both states may be f32 or bf16 (the
bf16-state pass); they are computed in f32 and rounded once when stored. Padding rows give 0.

`gdn_fused_reference` composes the unfused ops' reference functions — the definition. `gdn_fused_cpu` runs the
native kernel (kernels/native/gdn_fused_f32.cc: one pass per token over the item's channels and states, each state
read once and written once per step, in place) when x is f32 or bf16, and the unfused CPU rules otherwise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qcompile.kernels import native
from qcompile.kernels.causal_conv1d import causal_conv1d_cpu, causal_conv1d_reference
from qcompile.kernels.gdn import gdn_chunked_reference, gdn_recurrence_cpu, gdn_recurrent_reference, normalized_heads
from qcompile.kernels.ragged import token_layout

# the native entry point by the states' dtypes: both f32, both bf16, or a bf16 conv state with an f32 recurrent state
NATIVE = {"f32": "qcompile_gdn_fused_f32", "bf16": "qcompile_gdn_fused_bf16_state",
          "bf16_conv": "qcompile_gdn_fused_bf16_conv"}


def gates(a, b, a_log, dt_bias):
    """g = −exp(A_log)·softplus(a + dt_bias) (f32), β = sigmoid(b) in b's dtype, then f32 (spec/model.md §3.5 e)."""
    g = -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(a.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    return g, jax.nn.sigmoid(b).astype(jnp.float32)


def split_heads(y, num_value_heads: int, key_dim: int, value_dim: int):
    """The conv output's columns as q, k [T,Hk,dk] and v [T,Hv,dv]."""
    num_tokens, channels = y.shape
    key_heads = (channels - num_value_heads * value_dim) // (2 * key_dim)
    kd = key_heads * key_dim
    return (y[:, :kd].reshape(num_tokens, key_heads, key_dim), y[:, kd:2 * kd].reshape(num_tokens, key_heads, key_dim),
            y[:, 2 * kd:].reshape(num_tokens, num_value_heads, value_dim))


def recurrence(q, k, v, g, beta, state, query_start, state_slots, mode: str, chunk: int, rule: str = "reference"):
    """The delta rule on the conv's heads, state in its own dtype (computed in f32); padding rows 0."""
    qf, kf, vf = normalized_heads(q, k, v)
    if rule == "cpu" and mode == "auto":  # the native kernel takes a bf16 state as it is (no full-cache up-cast)
        out, new = gdn_recurrence_cpu(qf, kf, vf, g, beta, state, query_start, state_slots, chunk)
    else:
        if mode == "auto":
            mode = "recurrent" if q.shape[0] <= query_start.shape[0] - 1 else "chunked"
        run = gdn_recurrent_reference if mode == "recurrent" else gdn_chunked_reference
        args = (chunk,) if mode == "chunked" else ()
        out, new = run(qf, kf, vf, g, beta, state.astype(jnp.float32), query_start, state_slots, *args)
    valid = token_layout(query_start, q.shape[0]).valid
    return (out * valid[:, None, None]).astype(v.dtype), new.astype(state.dtype)


def gdn_fused_reference(x, a, b, conv_state, conv_w, a_log, dt_bias, state, query_start, state_slots,
                        mode: str = "auto", chunk: int = 64):
    y, new_conv = causal_conv1d_reference(x, conv_state, conv_w, query_start, state_slots, "silu")
    q, k, v = split_heads(y, state.shape[1], state.shape[2], state.shape[3])
    g, beta = gates(a, b, a_log, dt_bias)
    out, new_state = recurrence(q, k, v, g, beta, state, query_start, state_slots, mode, chunk)
    return out, new_conv, new_state


def gdn_fused_native(x, a, b, conv_state, conv_w, a_log, dt_bias, state, query_start, state_slots,
                     out_dtype=jnp.float32):
    """The native kernel (the states f32 or bf16, computed in f32; a bf16 x — a bf16 graph — has the conv's output,
    SiLU and β rounded to bf16 in the kernel where the compiled reference rounds them: β's quotient not, as XLA drops
    a rounding followed at once by gates()' conversion to f32). x goes in as it is (f32 or bf16: the kernel widens
    each token's channels, where a conversion would write and read an f32 copy of the layer's largest activation),
    and the output comes out in `out_dtype`, f32 or bf16 (each value rounded once, as converting the f32 result
    would). Call only after `native.ensure(NATIVE[dtype])` returned True."""
    f32 = jnp.float32
    out_types = (jax.ShapeDtypeStruct((x.shape[0], *state.shape[1:2], state.shape[3]), out_dtype),
                 jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype), jax.ShapeDtypeStruct(state.shape, state.dtype))
    name = NATIVE[native_dtype(x, conv_state, state)]
    call = jax.ffi.ffi_call(name, out_types, input_output_aliases={3: 1, 7: 2})
    return call(x, a.astype(f32), b.astype(f32), conv_state, conv_w.astype(f32), a_log.astype(f32),
                dt_bias.astype(f32), state, query_start.astype(jnp.int32), state_slots.astype(jnp.int32),
                bf16_graph=int(x.dtype == jnp.bfloat16))


def native_dtype(x, conv_state, state) -> str | None:
    """The native kernel's variant for these operands (a key of NATIVE), or None: x neither f32 nor bf16, or states
    of other dtypes."""
    if x.dtype not in (jnp.float32, jnp.bfloat16):
        return None
    return {(jnp.dtype(jnp.float32),) * 2: "f32", (jnp.dtype(jnp.bfloat16),) * 2: "bf16",
            (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)): "bf16_conv"}.get(
        (jnp.dtype(conv_state.dtype), jnp.dtype(state.dtype)))


def gdn_fused_cpu(x, a, b, conv_state, conv_w, a_log, dt_bias, state, query_start, state_slots,
                  mode: str = "auto", chunk: int = 64):
    """gdn_fused_reference's contract on CPU: the native kernel for f32 or bf16 activations ("auto" mode; the explicit
    modes are honoured as the reference computes them), else the unfused CPU rules one after another."""
    variant = native_dtype(x, conv_state, state)
    if mode == "auto" and variant is not None and native.ensure(NATIVE[variant]):
        return gdn_fused_native(x, a, b, conv_state, conv_w, a_log, dt_bias, state, query_start, state_slots,
                                out_dtype=x.dtype)
    y, new_conv = causal_conv1d_cpu(x, conv_state, conv_w, query_start, state_slots, "silu")
    q, k, v = split_heads(y, state.shape[1], state.shape[2], state.shape[3])
    g, beta = gates(a, b, a_log, dt_bias)
    out, new_state = recurrence(q, k, v, g, beta, state, query_start, state_slots, mode, chunk, rule="cpu")
    return out, new_conv, new_state
