"""Laying a step graph out on a device mesh outside the checked pipeline: what `run CHECKPOINT --mesh` does.

`run` on a checkpoint serves the unoptimized graph without a pass pipeline; with `--mesh` it applies gqa-sharding
alone (structurally verified, not numerically checked: `compile --mesh N` and `bench --mesh N` check it), so the
model runs data-parallel over the mesh's devices. A mesh the pass cannot use (experts that do not split) is a usage
error, not a silent single-device run.
"""

from __future__ import annotations

from qcompile.errors import UsageError
from qcompile.ir.graph import Graph
from qcompile.ir.mesh import Mesh
from qcompile.ir.verifier import verify
from qcompile.passes.base import PassContext
from qcompile.passes.gqa_sharding import GQA_SHARDING


def lay_out(graph: Graph, mesh: Mesh, concurrency: int, max_context: int) -> Graph:
    """`graph` laid out on `mesh` by gqa-sharding (the input graph is not modified)."""
    if mesh.size == 1:
        return graph
    with_mesh = Graph(graph.dag, graph.outputs, {**graph.meta, "mesh": mesh})
    result = GQA_SHARDING.run(with_mesh, PassContext(num_devices=mesh.size, options=(
        ("concurrency", concurrency), ("max_context", max_context))))
    if result.skipped:
        raise UsageError(f"--mesh {'x'.join(map(str, mesh.shape))}: cannot lay the model out ({result.skipped})")
    verify(result.graph)
    return result.graph
