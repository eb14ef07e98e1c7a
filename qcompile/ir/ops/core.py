"""Core ops: graph inputs and parameters, embedding, norms, linear algebra, shape plumbing, elementwise math.

Dtype policy mirrors transformers' CPU forward (spec/model.md §3.7): norms compute in f32 and cast once at the end;
matmuls take and return the activation dtype with f32 accumulation.
"""

from __future__ import annotations

import math

import attrs
import jax
import jax.numpy as jnp

from qcompile.ir.cost import Cost, cost, nbytes
from qcompile.ir.registry import expect, local_form, lowering, op, type_rule
from qcompile.ir.types import Sharding, TensorType, num_elements_key, np_dtype
from qcompile.kernels.grouped_matmul import from_pair_order, swiglu_halves
from qcompile.kernels.fp8 import QuantizedWeight, materialized
from qcompile.kernels.linear import PANEL, greedy_cpu, linear_cpu, linear_panels_cpu
from qcompile.kernels.pallas_linear import fits as linear_fits, linear_fp8_tpu

HIGHEST = jax.lax.Precision.HIGHEST


@op("input")
@attrs.frozen
class Input:
    """A named runtime input of the step graph (token ids, batch metadata, a cache)."""

    name: str
    type: TensorType


@op("param")
@attrs.frozen
class Param:
    """A weight: names a canonical checkpoint parameter (see frontend.checkpoint); the graph holds no data."""

    name: str
    type: TensorType


@type_rule(Input)
@type_rule(Param)
def _leaf_type(op_):
    return op_.type


@op("embed")
@attrs.frozen
class Embed:
    """embed(table[V,H], ids[T]) -> [T,H]: row lookup."""


@type_rule(Embed)
def _embed_type(op_, table, ids):
    expect(table.rank == 2 and ids.rank == 1 and ids.dtype == "i32", f"embed wants table[V,H], ids i32[T]; got {table}, {ids}")
    return TensorType(table.dtype, (ids.shape[0], table.shape[1]))


@lowering(Embed)
def _embed(op_, table, ids):
    return jnp.take(table, ids, axis=0, mode="clip")


@op("rmsnorm")
@attrs.frozen
class RmsNorm:
    """rmsnorm(x[...,D], w[D]): x·rsqrt(mean(x²)+eps)·(1+w if zero_centered else w), in f32, cast once to x's dtype."""

    eps: float
    zero_centered: bool


@type_rule(RmsNorm)
def _rmsnorm_type(op_, x, w):
    expect(w.rank == 1 and x.shape[-1] == w.shape[0], f"rmsnorm weight {w} does not match input {x}")
    return x


@lowering(RmsNorm)
def _rmsnorm(op_, x, w):
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + op_.eps)
    wf = w.astype(jnp.float32)
    return (y * (1.0 + wf if op_.zero_centered else wf)).astype(x.dtype)


@op("linear")
@attrs.frozen
class Linear:
    """linear(x[...,K], w[N,K]) -> [...,N] = x·wᵀ (HF stores weights [out, in]); f32 accumulation."""


@type_rule(Linear)
def _linear_type(op_, x, w):
    expect(w.rank == 2 and x.shape[-1] == w.shape[1], f"linear weight {w} does not match input {x}")
    expect(x.dtype == w.dtype, f"linear dtypes differ: {x.dtype} vs {w.dtype}")
    return TensorType(x.dtype, (*x.shape[:-1], w.shape[0]))


@lowering(Linear)
def _linear(op_, x, w):
    y = jnp.einsum("...k,nk->...n", x, w, precision=HIGHEST, preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


@op("linear_f32")
@attrs.frozen
class LinearF32:
    """linear_f32(x[...,K], w[N,K]) -> f32[...,N]: linear's product left in its f32 accumulator instead of rounded to
    x's dtype — a row-parallel projection's partial sum under tensor parallelism, all-reduced in f32 and rounded once
    (passes/gqa_sharding.py), as one device's whole product is rounded once. In bf16, rounding each device's partial
    and summing in bf16 measured 2.6e-2 on the logits of a tiny model against the 1e-2 reassociating bound."""


@type_rule(LinearF32)
def _linear_f32_type(op_, x, w):
    return _linear_type(op_, x, w).with_dtype("f32")


@lowering(LinearF32)
def _linear_f32(op_, x, w):
    return jnp.einsum("...k,nk->...n", x, w, precision=HIGHEST, preferred_element_type=jnp.float32)


@lowering(LinearF32, "tpu", takes_quantized=True)
def _linear_f32_tpu(op_, x, w):
    """A row-parallel projection's f32 partial sums: the FP8 linear kernel writing f32 (kernels/pallas_linear.py) on
    Qwen's layout, else the reference on the (dequantized) weight."""
    if isinstance(w, QuantizedWeight) and linear_fits(w):
        return linear_fp8_tpu(x, w, out_dtype=jnp.float32)
    return _linear_f32(op_, x, materialized(w))


@lowering(Linear, "cpu", takes_quantized=True)
def _linear_cpu(op_, x, w):
    """The native few-row kernel at decode, XLA's dot otherwise (kernels/linear.py)."""
    return linear_cpu(x, w)


@lowering(Linear, "tpu", takes_quantized=True)
def _linear_tpu(op_, x, w):
    """FP8 weights in Qwen's layout (128 × 128 blocks = the kernel's tiles): the Pallas kernel reading FP8 tiles
    (kernels/pallas_linear.py); anything else: XLA's dot on the (dequantized) weight, as the reference."""
    if isinstance(w, QuantizedWeight) and linear_fits(w):
        return linear_fp8_tpu(x, w)
    return _linear(op_, x, materialized(w))


@op("linear_swiglu")
@attrs.frozen
class LinearSwiglu:
    """linear_swiglu(x[...,K], w[2I,K]) -> [...,I] = silu(y[..., :I]) · y[..., I:] with y = linear(x, w): a SwiGLU
    MLP's gate and up projections as one matmul over the fused [gate ; up] weight (the swiglu-fusion pass)."""


@type_rule(LinearSwiglu)
def _linear_swiglu_type(op_, x, w):
    y = _linear_type(op_, x, w)
    expect(isinstance(w.shape[0], int) and w.shape[0] % 2 == 0, f"linear_swiglu: {w} is not [gate ; up]")
    return y.with_shape((*x.shape[:-1], w.shape[0] // 2))


@lowering(LinearSwiglu)
def _linear_swiglu(op_, x, w):
    return swiglu_halves(_linear(op_, x, w))


@lowering(LinearSwiglu, "tpu", takes_quantized=True)
def _linear_swiglu_tpu(op_, x, w):
    """The FP8 linear kernel over [gate ; up] (one sweep of the FP8 weight), then the halves."""
    return swiglu_halves(_linear_tpu(op_, x, w))


@lowering(LinearSwiglu, "cpu", takes_quantized=True)
def _linear_swiglu_cpu(op_, x, w):
    """One weight sweep for gate and up (the native few-row kernel at decode), then the halves."""
    return swiglu_halves(linear_cpu(x, w))


@op("linear_panels")
@attrs.frozen
class LinearPanels:
    """linear_panels(x[...,K], w[P,K,64]) -> [...,64P] = linear(x, v) with v[64p + c, k] = w[p, k, c]: a linear whose
    weight is prepared in column panels of 64, each stored k-major — the layout the CPU's native kernel streams
    (ir/target_layout.py rewrites linear and linear_swiglu so for the cpu target). swiglu: linear_swiglu's halves
    on top (-> [...,32P]). pair_order: each panel stored in pair order (kernels/grouped_matmul.py to_pair_order: the
    weights of k = 2i and 2i + 1 side by side, as AMX tiles read them), same shape."""

    swiglu: bool = False
    pair_order: bool = False


@type_rule(LinearPanels)
def _linear_panels_type(op_, x, w):
    expect(w.rank == 3 and w.shape[2] == PANEL and x.shape[-1] == w.shape[1],
           f"linear_panels weight {w} is not [P,K,{PANEL}] panels for input {x}")
    expect(x.dtype == w.dtype, f"linear_panels dtypes differ: {x.dtype} vs {w.dtype}")
    expect(not op_.pair_order or (isinstance(w.shape[1], int) and w.shape[1] % 2 == 0),
           f"linear_panels in pair order needs an even K: {w}")
    n = w.shape[0] * PANEL
    return TensorType(x.dtype, (*x.shape[:-1], n // 2 if op_.swiglu else n))


@lowering(LinearPanels)
def _linear_panels(op_, x, w):
    if op_.pair_order:
        w = from_pair_order(w)
    p, k, c = w.shape
    y = jnp.einsum("...k,pkc->...pc", x, w, precision=HIGHEST, preferred_element_type=jnp.float32)
    y = y.reshape(*x.shape[:-1], p * c).astype(x.dtype)
    return swiglu_halves(y) if op_.swiglu else y


@lowering(LinearPanels, "cpu", takes_quantized=True)
def _linear_panels_cpu(op_, x, w):
    """The native panel kernel at every row count (kernels/linear.py; FP8 panels as they are), with linear_swiglu's
    halves if asked (in the kernel's epilogue where it computes them as the reference does)."""
    return linear_panels_cpu(x, w, swiglu=op_.swiglu, pair_order=op_.pair_order)


@op("reshape")
@attrs.frozen
class Reshape:
    """reshape(x) to `shape` (same element count)."""

    shape: tuple = attrs.field(converter=tuple)


@type_rule(Reshape)
def _reshape_type(op_, x):
    expect(num_elements_key(x.shape) == num_elements_key(op_.shape), f"reshape {x} to {list(op_.shape)} changes size")
    return x.with_shape(op_.shape)


@local_form(Reshape)
def _local_reshape(op_, result_types, mesh):
    """The target shape of one device's block: each split dim of fixed size divided by its pieces."""
    (result,) = result_types
    if result.sharding is None:
        return op_
    shape = tuple(d // mesh.ways(axis) if axis is not None and isinstance(d, int) else d
                  for d, axis in zip(op_.shape, result.sharding.dims))
    return op_ if shape == tuple(op_.shape) else attrs.evolve(op_, shape=shape)


@lowering(Reshape)
def _reshape(op_, x):
    sizes = [d if isinstance(d, int) else -1 for d in op_.shape]
    return x.reshape(sizes)


@op("transpose")
@attrs.frozen
class Transpose:
    """transpose(x) = x with its axes permuted: result axis i is x's axis perm[i] (jnp.transpose's convention)."""

    perm: tuple = attrs.field(converter=tuple)


@type_rule(Transpose)
def _transpose_type(op_, x):
    expect(sorted(op_.perm) == list(range(x.rank)), f"transpose perm {list(op_.perm)} is not a permutation of {x}'s axes")
    sharding = x.sharding and Sharding(tuple(x.sharding.dims[i] for i in op_.perm), x.sharding.partial)
    return TensorType(x.dtype, tuple(x.shape[i] for i in op_.perm), sharding=sharding)


@lowering(Transpose)
def _transpose(op_, x):
    return jnp.transpose(x, op_.perm)


@op("slice")
@attrs.frozen
class Slice:
    """slice(x) = x[..., start:stop, ...] along `axis`."""

    axis: int
    start: int
    stop: int


@type_rule(Slice)
def _slice_type(op_, x):
    dim = x.shape[op_.axis]
    expect(isinstance(dim, int) and 0 <= op_.start < op_.stop <= dim, f"slice {op_.start}:{op_.stop} out of {x}")
    shape = list(x.shape)
    shape[op_.axis] = op_.stop - op_.start
    keep = x.sharding is not None and x.sharding.dims[op_.axis % x.rank] is None  # a split dim is not cut locally
    return TensorType(x.dtype, tuple(shape), sharding=x.sharding if keep else None)


@lowering(Slice)
def _slice(op_, x):
    return jax.lax.slice_in_dim(x, op_.start, op_.stop, axis=op_.axis % x.ndim)


@op("concat")
@attrs.frozen
class Concat:
    """concat(x0, x1, ...) along `axis`; every other dim and the dtype must agree."""

    axis: int


@type_rule(Concat)
def _concat_type(op_, *xs):
    expect(len(xs) >= 1, "concat needs operands")
    first = xs[0]
    axis = op_.axis % first.rank
    for x in xs[1:]:
        expect(x.dtype == first.dtype and x.rank == first.rank, f"concat operands differ: {first} vs {x}")
        expect(all(a == b for i, (a, b) in enumerate(zip(first.shape, x.shape)) if i != axis),
               f"concat operands differ off axis {axis}: {first} vs {x}")
    total = 0
    for x in xs:
        dim = x.shape[axis]
        expect(isinstance(dim, int), f"concat along a symbolic dim {dim!r} is not supported")
        total += dim
    shape = list(first.shape)
    shape[axis] = total
    sharding = first.sharding  # kept when every operand is laid out alike and the joined dim is not split
    keep = (sharding is not None and sharding.dims[axis] is None and not sharding.partial
            and all(x.sharding == sharding for x in xs))
    return TensorType(first.dtype, tuple(shape), sharding=sharding if keep else None)


@lowering(Concat)
def _concat(op_, *xs):
    return jnp.concatenate(xs, axis=op_.axis)


@op("take_rows")
@attrs.frozen
class TakeRows:
    """take_rows(x[T,...], idx i32[R]) -> [R,...]: rows picked by index (e.g. the tokens whose logits are wanted)."""


@type_rule(TakeRows)
def _take_rows_type(op_, x, idx):
    expect(idx.rank == 1 and idx.dtype == "i32", f"take_rows index must be i32[R], got {idx}")
    return x.with_shape((idx.shape[0], *x.shape[1:]))


@lowering(TakeRows)
def _take_rows(op_, x, idx):
    return jnp.take(x, idx, axis=0, mode="clip")


def _broadcast(a: TensorType, b: TensorType, what: str) -> TensorType:
    expect(a.dtype == b.dtype, f"{what}: dtypes differ ({a}, {b})")
    expect(a.rank == b.rank, f"{what}: ranks differ ({a}, {b})")
    shape = []
    for x, y in zip(a.shape, b.shape):
        expect(x == y or x == 1 or y == 1, f"{what}: shapes {a} and {b} do not broadcast")
        shape.append(y if x == 1 else x)
    return a.with_shape(shape)


@op("add")
@attrs.frozen
class Add:
    """add(x, y): elementwise sum with size-1 broadcasting, in the operands' dtype."""


@op("mul")
@attrs.frozen
class Mul:
    """mul(x, y): elementwise product with size-1 broadcasting, in the operands' dtype."""


@type_rule(Add)
@type_rule(Mul)
def _binary_type(op_, x, y):
    return _broadcast(x, y, op_.op_name)


@lowering(Add)
def _add(op_, x, y):
    return x + y


@lowering(Mul)
def _mul(op_, x, y):
    return x * y


ACTIVATIONS = {"silu": jax.nn.silu, "sigmoid": jax.nn.sigmoid}


@op("activation")
@attrs.frozen
class Activation:
    """activation(x) {fn = silu | sigmoid}, elementwise in x's dtype."""

    fn: str = attrs.field(validator=attrs.validators.in_(tuple(ACTIVATIONS)))


@type_rule(Activation)
def _activation_type(op_, x):
    return x


@lowering(Activation)
def _activation(op_, x):
    return ACTIVATIONS[op_.fn](x)


@op("cast")
@attrs.frozen
class Cast:
    """cast(x) to `dtype` (round to nearest even for narrowing float casts)."""

    dtype: str


@type_rule(Cast)
def _cast_type(op_, x):
    return x.with_dtype(op_.dtype)


@lowering(Cast)
def _cast(op_, x):
    return x.astype(np_dtype(op_.dtype))


@op("greedy")
@attrs.frozen
class Greedy:
    """greedy(logits[R,V]) -> i32[R]: the index of each row's largest logit (lowest index on ties), on the device,
    so a decode step hands the host R token ids instead of R×V floats."""


@type_rule(Greedy)
def _greedy_type(op_, logits):
    expect(logits.rank == 2, f"greedy wants logits[R,V], got {logits}")
    return TensorType("i32", (logits.shape[0],))


@lowering(Greedy)
def _greedy(op_, logits):
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


@lowering(Greedy, "cpu")
def _greedy_cpu(op_, logits):
    """Two plain reductions instead of XLA CPU's slow (value, index) reduction (kernels/linear.py)."""
    return greedy_cpu(logits)


# -- costs (qcompile/ir/cost.py) -------------------------------------------------------------------------------------


@cost(Embed)
def _embed_cost(op_, operands, results, step):
    (out, out_shape), = results
    return Cost(0.0, nbytes(out, out_shape))  # the rows read


@cost(Linear)
@cost(LinearF32)
@cost(LinearSwiglu)
def _linear_cost(op_, operands, results, step):
    (_, x_shape), (w, w_shape) = operands
    rows = math.prod(x_shape[:-1])
    return Cost(2.0 * rows * w_shape[0] * w_shape[1], nbytes(w, w_shape) if rows else 0)


@cost(LinearPanels)
def _linear_panels_cost(op_, operands, results, step):
    (_, x_shape), (w, w_shape) = operands
    rows = math.prod(x_shape[:-1])
    return Cost(2.0 * rows * math.prod(w_shape), nbytes(w, w_shape) if rows else 0)
