"""Laying a step graph out on a device mesh outside the checked pipeline: what `run CHECKPOINT --mesh` does.

`run` on a checkpoint serves the unoptimized graph without a pass pipeline; with `--mesh` it applies gqa-sharding,
moe-allgather-rs and hierarchical-collectives (on a mesh of 2+ axes), the layout `--passes all` gives (structurally verified, not numerically checked: `compile --mesh N`
and `bench --mesh N` check them), so the model runs data-parallel over the mesh's devices. A mesh the pass cannot use (experts that do not split) is a usage
error, not a silent single-device run.
"""

from __future__ import annotations

from qcompile.errors import UsageError
from qcompile.ir.graph import Graph
from qcompile.ir.mesh import Mesh
from qcompile.ir.verifier import verify
from qcompile.passes.base import PassContext
from qcompile.passes.gqa_sharding import GQA_SHARDING
from qcompile.passes.hierarchical_collectives import HIERARCHICAL_COLLECTIVES
from qcompile.passes.moe_allgather_rs import MOE_ALLGATHER_RS


def lay_out(graph: Graph, mesh: Mesh, concurrency: int, max_context: int, gather_moe: bool = True,
            hierarchical: bool = True, layout: str | None = None) -> Graph:
    """`graph` laid out on `mesh` by gqa-sharding, its MoE layers as all-gather/reduce-scatter (moe-allgather-rs), in
    two stages on a two-level mesh (hierarchical-collectives, unless `hierarchical` is False); with `gather_moe`
    False, as gqa-sharding's all-to-all dispatch; `layout` names gqa-sharding's plan (dp4xtp2, ...) instead of its
    choice. The input graph is not modified."""
    if mesh.size == 1:
        return graph
    with_mesh = Graph(graph.dag, graph.outputs, {**graph.meta, "mesh": mesh})
    result = GQA_SHARDING.run(with_mesh, PassContext(num_devices=mesh.size, options=(
        ("concurrency", concurrency), ("max_context", max_context), *((("layout", layout),) if layout else ()))))
    if result.skipped:
        raise UsageError(f"--mesh {'x'.join(map(str, mesh.shape))}: cannot lay the model out ({result.skipped})")
    laid_out = result.graph
    if gather_moe:
        laid_out = MOE_ALLGATHER_RS.run(laid_out, PassContext(num_devices=mesh.size)).graph
        if hierarchical:
            laid_out = HIERARCHICAL_COLLECTIVES.run(laid_out, PassContext(num_devices=mesh.size)).graph
    verify(laid_out)
    return laid_out
