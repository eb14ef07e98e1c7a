"""The device mesh of a graph: named axes with sizes, the device order, and the one table mapping logical axes to mesh
axes.

Why: values are annotated in logical axes — what a dim means (`experts`, `kv_heads`, `batch`) — and the same graph
can be laid out on different meshes by changing only this table. A pass that shards says "split the experts", the
rules say which mesh axes that is; the verifier checks that every sharded dim divides; the lowering turns a sharding
into a `jax.sharding.PartitionSpec` over a `jax.sharding.Mesh` built from the device order. The mesh lives in
`graph.meta["mesh"]` and prints as the graph's first statement:

    mesh {axes=["data", "model"], shape=[2, 4], devices=[0, 1, 2, 3, 4, 5, 6, 7], rules=[["experts", "data", "model"], ["kv_heads", "model"]]}

`--mesh SPEC`: `8` is one axis of 8 devices; `4x2` two axes (outer × inner: chips × cores, processes × devices),
named `data` and `model` unless given (`parse_mesh_spec`).
"""

from __future__ import annotations

import math
import re

import attrs

from qcompile.ir.types import Sharding, TensorType

#: Axis names a --mesh SPEC's axes get, outermost first.
DEFAULT_AXIS_NAMES = {1: ("model",), 2: ("data", "model"), 3: ("host", "data", "model")}
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")


def _tuple(value) -> tuple:
    return tuple(value)


def _rules(value) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """A dict or pairs of logical axis -> mesh axes (a tuple of names, or one name)."""
    items = value.items() if isinstance(value, dict) else value
    return tuple((logical, (axes,) if isinstance(axes, str) else tuple(axes)) for logical, axes in items)


@attrs.frozen
class Mesh:
    axes: tuple[str, ...] = attrs.field(converter=_tuple)
    shape: tuple[int, ...] = attrs.field(converter=_tuple)
    devices: tuple[int, ...] = attrs.field(converter=_tuple)
    #: logical axis -> the mesh axes it is split along (in order, outer first)
    rules: tuple[tuple[str, tuple[str, ...]], ...] = attrs.field(default=(), converter=_rules)

    def __attrs_post_init__(self):
        if not self.axes or len(self.axes) != len(self.shape):
            raise ValueError(f"a mesh needs one size per axis: axes {list(self.axes)}, shape {list(self.shape)}")
        for name in self.axes:
            if not isinstance(name, str) or not _NAME.match(name):
                raise ValueError(f"bad mesh axis name {name!r}")
        if len(set(self.axes)) != len(self.axes):
            raise ValueError(f"mesh axis names repeat: {list(self.axes)}")
        if any(not isinstance(n, int) or n < 1 for n in self.shape):
            raise ValueError(f"mesh axis sizes must be positive integers, got {list(self.shape)}")
        if sorted(self.devices) != list(range(self.size)):
            raise ValueError(f"device order must be a permutation of 0..{self.size - 1}, got {list(self.devices)}")
        seen: set[str] = set()
        for logical, mesh_axes in self.rules:
            if logical in seen:
                raise ValueError(f"logical axis {logical!r} has two rules")
            seen.add(logical)
            unknown = [a for a in mesh_axes if a not in self.axes]
            if unknown or len(set(mesh_axes)) != len(mesh_axes):
                raise ValueError(f"rule {logical!r} -> {list(mesh_axes)}: mesh axes must be distinct names of "
                                 f"{list(self.axes)}")

    @classmethod
    def of(cls, axes: dict[str, int], rules: dict[str, tuple[str, ...]] | None = None,
           devices: tuple[int, ...] | None = None) -> "Mesh":
        shape = tuple(axes.values())
        return cls(tuple(axes), shape, devices if devices is not None else tuple(range(math.prod(shape))),
                   rules or {})

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def axis_size(self, name: str) -> int:
        return self.shape[self.axes.index(name)]

    def rule(self, logical: str) -> tuple[str, ...]:
        """The mesh axes logical axis `logical` is split along; KeyError when the table has no rule for it."""
        for name, mesh_axes in self.rules:
            if name == logical:
                return mesh_axes
        raise KeyError(logical)

    def ways(self, logical: str) -> int:
        """How many pieces a dim split along `logical` is cut into."""
        return math.prod(self.axis_size(a) for a in self.rule(logical))

    def partition_spec(self, sharding: Sharding | None):
        """The jax PartitionSpec of a sharding (partial sums have none: they are reduced before leaving a step)."""
        from jax.sharding import PartitionSpec

        if sharding is None:
            return PartitionSpec()
        entries = []
        for logical in sharding.dims:
            axes = () if logical is None else self.rule(logical)
            entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        return PartitionSpec(*entries)

    def named_sharding(self, type_: TensorType, jax_mesh=None):
        """The jax NamedSharding of a value of `type_` on this mesh (on `jax_mesh`, default `self.jax_mesh()`)."""
        import jax

        return jax.sharding.NamedSharding(self.jax_mesh() if jax_mesh is None else jax_mesh,
                                          self.partition_spec(type_.sharding))

    def jax_mesh(self, devices=None):
        """A jax.sharding.Mesh of these axes over `devices` (default: jax.devices()) in this mesh's device order."""
        import jax
        import numpy as np

        devices = list(jax.devices() if devices is None else devices)
        if len(devices) < self.size:
            raise ValueError(f"the mesh needs {self.size} devices; {len(devices)} are available")
        ordered = np.array([devices[i] for i in self.devices], dtype=object).reshape(self.shape)
        return jax.sharding.Mesh(ordered, self.axes)

    # -- text form -------------------------------------------------------------------------------------------------

    def attributes(self) -> dict:
        """The attributes of the `mesh {...}` statement (printer and parser)."""
        return {"axes": list(self.axes), "shape": list(self.shape), "devices": list(self.devices),
                "rules": [[logical, *mesh_axes] for logical, mesh_axes in self.rules]}

    @classmethod
    def from_attributes(cls, attributes: dict) -> "Mesh":
        missing = [k for k in ("axes", "shape", "devices") if k not in attributes]
        if missing:
            raise ValueError(f"mesh statement lacks {', '.join(missing)}")
        extra = set(attributes) - {"axes", "shape", "devices", "rules"}
        if extra:
            raise ValueError(f"unknown mesh attribute {sorted(extra)[0]!r}")
        rules = attributes.get("rules", ())
        if any(not isinstance(r, (list, tuple)) or len(r) < 1 for r in rules):
            raise ValueError("mesh rules are lists [logical, mesh_axis, ...]")
        return cls(attributes["axes"], attributes["shape"], attributes["devices"],
                   [(r[0], tuple(r[1:])) for r in rules])


def parse_mesh_spec(spec: str, names: tuple[str, ...] | None = None) -> Mesh:
    """`8`, `4x2`, `2x2x2` -> a Mesh with default axis names (outer first) and no rules; ValueError on bad input."""
    parts = spec.strip().lower().split("x")
    if not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--mesh {spec!r}: expected sizes like 8, 4x2 or 2x4")
    names = names or DEFAULT_AXIS_NAMES.get(len(parts))
    if names is None or len(names) != len(parts):
        raise ValueError(f"--mesh {spec!r}: at most {max(DEFAULT_AXIS_NAMES)} axes")
    return Mesh.of(dict(zip(names, (int(p) for p in parts))))


def sharding_problems(mesh: Mesh | None, type_: TensorType) -> list[str]:
    """Why `type_`'s sharding does not fit `mesh` (empty when it does): logical axes without a rule, a mesh axis
    used twice, an integer dim that the split does not divide. Symbolic dims are checked when bound."""
    sharding = type_.sharding
    if sharding is None:
        return []
    if mesh is None:
        return [f"{type_} is sharded but the graph has no mesh"]
    problems, used = [], []
    for index, logical in enumerate(sharding.dims):
        if logical is None:
            continue
        try:
            axes = mesh.rule(logical)
        except KeyError:
            problems.append(f"logical axis {logical!r} of {type_} has no rule in the mesh")
            continue
        used.extend(axes)
        dim, ways = type_.shape[index], mesh.ways(logical)
        if isinstance(dim, int) and dim % ways:
            problems.append(f"dim {index} of {type_} ({dim}) is not divisible by the {ways} pieces of {logical!r} "
                            f"({' x '.join(axes)})")
    for logical in sharding.partial:
        try:
            used.extend(mesh.rule(logical))
        except KeyError:
            problems.append(f"partial axis {logical!r} of {type_} has no rule in the mesh")
    repeated = sorted({a for a in used if used.count(a) > 1})
    if repeated:
        problems.append(f"{type_} uses mesh axis {repeated[0]!r} twice")
    return problems


def request_host_devices(count: int) -> int:
    """Ask JAX for `count` host (CPU) devices — effective only before JAX starts — and return how many it has."""
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", max(count, jax.config.jax_num_cpu_devices or 1))
    except RuntimeError:
        pass  # JAX already started (a second command in one process): its devices must do
    return len(jax.devices("cpu"))
