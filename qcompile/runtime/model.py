"""Checkpoint → verified step graph → device parameters: the path `run CHECKPOINT` and the tests take to a runnable model."""

from __future__ import annotations

import attrs

from qcompile.frontend.checkpoint import Checkpoint
from qcompile.ir.graph import Graph
from qcompile.ir.importer import build_graph
from qcompile.ir.lowering import host_target
from qcompile.ir.weights import fold_weight_preparation, load_params
from qcompile.runtime.engine import CacheConfig, Engine


@attrs.define
class LoadedModel:
    checkpoint: Checkpoint
    graph: Graph
    params: dict

    def engine(self, cache: CacheConfig = CacheConfig(), target: str | None = None,
               memory_budget: int | None = None) -> Engine:
        return Engine(self.graph, self.params, cache, target, memory_budget)


def load_model(path, dtype: str | None = None, page_size: int = 16, gdn_mode: str = "auto",
               progress: bool | None = None, fp8: str = "keep", layout: bool = True, rewrite=None) -> LoadedModel:
    """The checkpoint's unoptimized graph with its weight preparation folded (prepared weights computed here, one
    tensor at a time) and its device parameters. `fp8`: an FP8 checkpoint's weights kept FP8 or multiplied out
    (ir/importer.py `build_graph`). `layout`: weights in the host target's layout (ir/target_layout.py), as a build
    for this host runs them; False keeps the checkpoint's layout — the graph passes see (the compile pipeline lays
    weights out after the passes). `rewrite`: a graph → graph function applied before the weights are prepared and
    laid out (`run --mesh` lays the graph out on its mesh there: the passes want the checkpoint's layout)."""
    checkpoint = Checkpoint.open(path)
    graph = build_graph(checkpoint, dtype, page_size, gdn_mode, fp8=fp8)
    if rewrite is not None:
        graph = rewrite(graph)
    graph = fold_weight_preparation(graph, host_target() if layout else None)
    return LoadedModel(checkpoint, graph, load_params(checkpoint, graph, progress))
