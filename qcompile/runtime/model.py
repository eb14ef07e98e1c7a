"""Checkpoint → verified step graph → device parameters: the path every command and test takes to a runnable model."""

from __future__ import annotations

import math
import sys

import attrs
import jax.numpy as jnp
from tqdm import tqdm

from qcompile.errors import UsageError
from qcompile.frontend.checkpoint import Checkpoint
from qcompile.ir.graph import Graph
from qcompile.ir.importer import ImportOptions, import_graph
from qcompile.ir.ops.core import Param
from qcompile.ir.types import np_dtype
from qcompile.ir.verifier import verify
from qcompile.runtime.engine import CacheConfig, Engine

DTYPE_CHOICES = ("f32", "bf16")


@attrs.define
class LoadedModel:
    checkpoint: Checkpoint
    graph: Graph
    params: dict

    def engine(self, cache: CacheConfig = CacheConfig()) -> Engine:
        return Engine(self.graph, self.params, cache)


def build_graph(checkpoint: Checkpoint, dtype: str | None = None, page_size: int = 16,
                gdn_mode: str = "auto", layers: tuple[int, ...] | None = None) -> Graph:
    """The verified, unoptimized step graph of a checkpoint (dtype defaults to the checkpoint's own)."""
    dtype = dtype or checkpoint.config.dtype
    if dtype == "f16":
        dtype = "f32"  # f16 checkpoints compute in f32: f16 overflows in these models' MLPs
    if dtype not in DTYPE_CHOICES:
        raise UsageError(f"unsupported compute dtype {dtype!r}; choose one of {', '.join(DTYPE_CHOICES)}")
    if page_size <= 0 or page_size & (page_size - 1):
        raise UsageError(f"page size must be a power of two, got {page_size}")
    shapes = {name: ref.shape for name, ref in checkpoint.params.items()}
    graph = import_graph(checkpoint.config, shapes, ImportOptions(dtype=dtype, page_size=page_size, gdn_mode=gdn_mode,
                                                                    layers=layers))
    verify(graph)
    return graph


def load_params(checkpoint: Checkpoint, graph: Graph, progress: bool | None = None) -> dict:
    """Read every parameter the graph names, cast to its dtype, onto the default device (one tensor at a time)."""
    nodes = graph.find(Param)
    show = sys.stderr.isatty() if progress is None else progress
    params = {}
    for node in tqdm(nodes, desc="loading weights", unit="tensor", disable=not show, file=sys.stderr):
        params[node.op.name] = jnp.asarray(checkpoint.load(node.op.name).astype(np_dtype(node.op.type.dtype)))
    return params


def load_model(path, dtype: str | None = None, page_size: int = 16, gdn_mode: str = "auto",
               progress: bool | None = None) -> LoadedModel:
    checkpoint = Checkpoint.open(path)
    graph = build_graph(checkpoint, dtype, page_size, gdn_mode)
    return LoadedModel(checkpoint, graph, load_params(checkpoint, graph, progress))


def summarize(checkpoint: Checkpoint, graph: Graph) -> dict:
    """What the compile report says about the model: family, layers by type, parameter counts, bytes by dtype."""
    cfg = checkpoint.config
    numel = {source: math.prod(checkpoint.store.info(source).shape)
             for ref in checkpoint.params.values() for source in ref.sources}
    routed = sum(math.prod(ref.shape) for name, ref in checkpoint.params.items() if ".mlp.experts." in name)
    total = sum(numel.values())
    inactive = routed - routed * cfg.top_k // max(cfg.num_experts, 1)
    ops: dict[str, int] = {}
    for node in graph.nodes():
        ops[node.op.op_name] = ops.get(node.op.op_name, 0) + 1
    return {
        "family": cfg.family,
        "model_type": cfg.model_type,
        "checkpoint_dtype": cfg.dtype,
        "compute_dtype": graph.meta["dtype"],
        "layers": {
            "total": cfg.num_layers,
            "linear_attention": cfg.layer_types.count("linear_attention"),
            "full_attention": cfg.layer_types.count("full_attention"),
            "moe": sum(cfg.moe_layers),
            "dense_mlp": cfg.num_layers - sum(cfg.moe_layers),
            "pattern": "".join("A" if t == "full_attention" else "L" for t in cfg.layer_types),
        },
        "parameters": {"total": total, "routed_experts": routed, "active_per_token": total - inactive},
        "bytes_by_dtype": checkpoint.bytes_by_dtype(),
        "tensors": {"used": len(numel), "ignored": len(checkpoint.ignored), "unknown": checkpoint.unknown},
        "graph": {"nodes": len(graph), "ops": dict(sorted(ops.items()))},
        "config": cfg.to_json(),
    }
