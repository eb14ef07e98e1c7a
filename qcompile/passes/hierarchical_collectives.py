"""hierarchical-collectives: a reduce-scatter or all-gather over a two-level mesh runs as two collectives — the
reduce-scatter over the local (inner) axis first, then across; the all-gather across first, then over the local axis.

What: every `reduce_scatter` / `all_gather` whose mesh axes span more than the mesh's innermost axis gets `stages`:
(local, across) for a reduce-scatter, (across, local) for an all-gather, where local is the innermost mesh axis —
the devices of one process on `--mesh 2x4` (processes × devices), the two cores of a chip on `4x2` — and across the
outer axes. The lowering permutes blocks so every device ends with exactly the block the one-stage collective gives
it (ir/ops/collective.py), so nothing downstream changes. The mesh's device order keeps each local group adjacent
(one process's devices, consecutive ids); a mesh whose order does not is given the row-major order that does.

Why (design.md §4.3): the reduce-scatter's local stage sums the L devices of a group before anything leaves it, so
the slow across stage carries 1/L of the bytes a flat ring would; the all-gather is its transpose (across first
moves each block once per remote group, the local stage then fans it out). tpu-inference measured +14% at 8K/1K,
concurrency 64 (3,258 → 3,720 tok/s/chip). Class: reassociating (the partial sums are added in a different order).
Skipped without a collective that spans two mesh levels (one device, a one-axis mesh such as `--mesh 8`).
"""

from __future__ import annotations

import attrs

from qcompile.ir.graph import Graph
from qcompile.ir.ops.collective import AllGather, ReduceScatter
from qcompile.passes.base import Pass, PassContext, PassResult
from qcompile.passes.rewrite import rebuild


def _levels(mesh, mesh_axes: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """(across, local) of a collective's mesh axes, or None when it does not span two levels in mesh order."""
    local = mesh.axes[-1]
    if len(mesh_axes) < 2 or mesh_axes[-1] != local:
        return None
    if list(mesh_axes) != sorted(mesh_axes, key=mesh.axes.index):
        return None
    return tuple(mesh_axes[:-1]), (local,)


def _local_groups_adjacent(mesh) -> bool:
    """Whether each group of the innermost axis is a run of consecutive device ids (one process's devices)."""
    inner = mesh.shape[-1]
    devices = list(mesh.devices)
    return all(devices[i:i + inner] == list(range(devices[i], devices[i] + inner)) and devices[i] % inner == 0
               for i in range(0, len(devices), inner))


def run(graph: Graph, ctx: PassContext) -> PassResult:
    mesh = graph.meta.get("mesh")
    kinds = (AllGather, ReduceScatter)
    staged = {node.id: levels for node in graph.nodes() if isinstance(node.op, kinds) and not node.op.stages
              and mesh is not None and (levels := _levels(mesh, tuple(node.op.mesh_axes)))}
    if not staged:
        why = ("no all-gather or reduce-scatter spans two mesh levels (needs a laid-out graph on a mesh of 2+ axes, "
               "e.g. --mesh 2x4)")
        return PassResult(graph, False, {}, skipped=why)

    def stage(builder, node, operands, mapping):
        if node.id not in staged:
            return None
        across, local = staged[node.id]
        stages = (across, local) if isinstance(node.op, AllGather) else (local, across)
        return builder.add_typed(attrs.evolve(node.op, stages=stages), operands, node.types)

    meta = dict(graph.meta)
    reordered = not _local_groups_adjacent(mesh)
    if reordered:
        meta["mesh"] = attrs.evolve(mesh, devices=tuple(range(mesh.size)))
    new_graph, _ = rebuild(graph, stage, meta)
    gathers = sum(isinstance(graph.node(i).op, AllGather) for i in staged)
    return PassResult(new_graph, True, {"reduce_scatters": len(staged) - gathers, "all_gathers": gathers,
                                        "local_axis": mesh.axes[-1], "local_devices": mesh.shape[-1],
                                        "device_order_changed": reordered})


HIERARCHICAL_COLLECTIVES = Pass(
    name="hierarchical-collectives",
    summary="reduce-scatter local axis first then across, all-gather across then local (two-level meshes)",
    run=run,
    tolerance="reassociating",
    requires=("a laid-out graph on a mesh of 2+ axes (--mesh 2x4)",),
    cpu_note="cost structure only on the cpu target; across real processes the across stage is the slow one",
)
