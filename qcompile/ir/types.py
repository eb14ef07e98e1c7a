"""Tensor types of IR values: a dtype and a shape whose dims are integers or symbolic expressions.

Why symbolic: one step graph serves every shape bucket (design.md §3). Batch-like dims are named — `T` tokens in the
step, `B` sequences, `R` logit rows, `P` KV pages, `M` pages per sequence, `S` state slots — and the runtime binds
them per bucket. A dim is an int or a small expression over those names (`T*8`, `B+1`).

A type may carry a sharding: per dim, the logical axis it is split along (`experts`, `kv_heads`, `batch`; None =
whole on every device), and the logical axes over which the value is an unreduced partial sum. Shapes stay global
(the whole tensor's); the mesh's rules table (ir/mesh.py) maps logical axes to mesh axes. A sharding is an annotation,
not part of type identity: two types that differ only in sharding compare equal, so type rules need not propagate it.

    f32[64,1024,256]<experts,_,_>      split along dim 0 by whatever mesh axes `experts` maps to
    f32[T,1024]<_,_|kv_heads>          whole on every device, each holding a partial sum over `kv_heads`
"""

from __future__ import annotations

import re
from typing import Union

import attrs
import numpy as np

Dim = Union[int, str]
DTYPES = ("f32", "bf16", "f16", "f8e4m3", "i32", "bool")  # f8e4m3: FP8 weights (ir/ops/quant.py)
_EXPR = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*([*+][A-Za-z0-9_]+)*$")


def np_dtype(name: str):
    """numpy / JAX dtype for an IR dtype name."""
    import ml_dtypes

    return {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "f16": np.float16, "f8e4m3": ml_dtypes.float8_e4m3fn,
            "i32": np.int32, "bool": np.bool_}[name]


def dtype_name(dtype) -> str:
    """IR dtype name for a numpy / JAX dtype."""
    import ml_dtypes

    table = {np.dtype(np.float32): "f32", np.dtype(ml_dtypes.bfloat16): "bf16", np.dtype(np.float16): "f16",
             np.dtype(ml_dtypes.float8_e4m3fn): "f8e4m3", np.dtype(np.int32): "i32", np.dtype(np.bool_): "bool"}
    return table[np.dtype(dtype)]


def check_dim(dim: Dim) -> Dim:
    if isinstance(dim, bool) or not isinstance(dim, (int, str)):
        raise TypeError(f"dim must be int or str, got {dim!r}")
    if isinstance(dim, int) and dim < 0:
        raise ValueError(f"negative dim {dim}")
    if isinstance(dim, str) and not _EXPR.match(dim.replace(" ", "")):
        raise ValueError(f"bad symbolic dim {dim!r}")
    return dim


def dim_mul(a: Dim, b: Dim) -> Dim:
    """Product of two dims, folded when both are integers."""
    if isinstance(a, int) and isinstance(b, int):
        return a * b
    if a == 1:
        return b
    if b == 1:
        return a
    return f"{a}*{b}"


def evaluate(dim: Dim, sizes: dict[str, int]) -> int:
    """Value of a dim once the symbols are bound."""
    if isinstance(dim, int):
        return dim
    try:
        return int(eval(dim, {"__builtins__": {}}, dict(sizes)))  # noqa: S307 - checked by _EXPR
    except NameError as err:
        raise KeyError(f"symbolic dim {dim!r} needs a size: {err}") from None


def num_elements_key(shape: tuple[Dim, ...]) -> tuple[int, tuple[str, ...]]:
    """(integer factor, sorted symbolic factors) of a shape's element count, for reshape checks."""
    const, syms = 1, []
    for dim in shape:
        factors = [dim] if isinstance(dim, int) else dim.split("*")
        for f in factors:
            if isinstance(f, int) or f.isdigit():
                const *= int(f)
            else:
                syms.append(f)
    return const, tuple(sorted(syms))


_AXIS = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")


def _axes(value) -> tuple:
    return tuple(value)


@attrs.frozen
class Sharding:
    """Per dim the logical axis it is split along (None: not split), and the logical axes the value is a partial
    (unreduced) sum over."""

    dims: tuple[str | None, ...] = attrs.field(converter=_axes)
    partial: tuple[str, ...] = attrs.field(default=(), converter=_axes)

    def __attrs_post_init__(self):
        named = [a for a in self.dims if a is not None] + list(self.partial)
        for axis in named:
            if not isinstance(axis, str) or not _AXIS.match(axis):
                raise ValueError(f"bad logical axis {axis!r} in a sharding")
        if len(set(named)) != len(named):
            raise ValueError(f"a logical axis appears twice in sharding {self}")

    def with_dim(self, index: int, axis: str | None) -> "Sharding":
        dims = list(self.dims)
        dims[index] = axis
        return Sharding(tuple(dims), self.partial)

    def __str__(self) -> str:
        text = ",".join("_" if a is None else a for a in self.dims)
        return f"<{text}{'|' + ','.join(self.partial) if self.partial else ''}>"


def parse_sharding(text: str) -> Sharding:
    """Inverse of str(Sharding): `<a,_,b>` or `<a,_|p,q>`."""
    m = re.fullmatch(r"<([^|>]*)(?:\|([^>]*))?>", text.strip())
    if not m:
        raise ValueError(f"bad sharding {text!r}")
    dims = [d.strip() for d in m.group(1).split(",")] if m.group(1).strip() else []
    partial = [p.strip() for p in (m.group(2) or "").split(",") if p.strip()]
    return Sharding(tuple(None if d == "_" else d for d in dims), tuple(partial))


@attrs.frozen
class TensorType:
    """dtype + shape (+ an optional sharding annotation, ignored by ==); prints as `f32[T,96]` (`f32[T,96]<batch,_>`)."""

    dtype: str = attrs.field(validator=attrs.validators.in_(DTYPES))
    shape: tuple[Dim, ...] = attrs.field(converter=tuple)
    sharding: Sharding | None = attrs.field(default=None, eq=False, kw_only=True)

    def __attrs_post_init__(self):
        for dim in self.shape:
            check_dim(dim)
        if self.sharding is not None and len(self.sharding.dims) != len(self.shape):
            raise ValueError(f"sharding {self.sharding} has {len(self.sharding.dims)} dims for a rank-"
                             f"{len(self.shape)} type")

    def with_sharding(self, sharding: Sharding | None) -> "TensorType":
        return TensorType(self.dtype, self.shape, sharding=sharding)

    @property
    def rank(self) -> int:
        return len(self.shape)

    def with_shape(self, shape) -> "TensorType":
        return TensorType(self.dtype, tuple(shape))

    def with_dtype(self, dtype: str) -> "TensorType":
        return TensorType(dtype, self.shape, sharding=self.sharding)

    def bind(self, sizes: dict[str, int]) -> tuple[int, ...]:
        return tuple(evaluate(d, sizes) for d in self.shape)

    def __str__(self) -> str:
        text = f"{self.dtype}[{','.join(str(d) for d in self.shape)}]"
        return text if self.sharding is None else text + str(self.sharding)


def parse_type(text: str) -> TensorType:
    """Inverse of str(TensorType)."""
    m = re.fullmatch(r"(\w+)\[([^\]]*)\](<[^>]*>)?", text.strip())
    if not m:
        raise ValueError(f"bad tensor type {text!r}")
    dims = [d.strip() for d in m.group(2).split(",") if d.strip()]
    sharding = parse_sharding(m.group(3)) if m.group(3) else None
    return TensorType(m.group(1), tuple(int(d) if d.isdigit() else d for d in dims), sharding=sharding)
