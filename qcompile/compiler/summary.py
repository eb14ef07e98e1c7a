"""What the compile report says about a model: family, layers by type, parameter counts, bytes by dtype, op counts."""

from __future__ import annotations

import math

from qcompile.frontend.checkpoint import Checkpoint
from qcompile.ir.graph import Graph


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
