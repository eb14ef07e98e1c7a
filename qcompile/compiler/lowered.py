"""The planned step lowered for the target's platform: `jax.export` of the decode step from abstract arguments.

Why: `plan` predicts from the graph; lowering the same graph with the target's rules is as far as JAX goes without
the hardware (the XLA compiler of another platform is not on this host), and it shows what the prediction assumes:
that every op has a rule for the platform, that the shardings fit the target's mesh, which Pallas kernels (Mosaic
`tpu_custom_call`s) the step holds, and that the collectives the cost model charges are the ones in the program (the
StableHLO collectives, counted by kind, beside the graph's). Nothing is allocated or compiled: weights, caches and
batch are ShapeDtypeStructs, laid out by their shardings on the process's CPU devices (a mesh needs as many; `plan`
asks JAX for them before it starts).
"""

from __future__ import annotations

import re
import time

from qcompile.ir.abi import batch_specs, cache_specs, data_parallel_ranks, graph_cache_types
from qcompile.ir.graph import Graph
from qcompile.ir.lowering import is_sharded, step_function
from qcompile.ir.ops.collective import COLLECTIVE_KINDS
from qcompile.ir.types import np_dtype
from qcompile.ir.weights import param_types

#: jax.export's platform name of each lowering table
PLATFORMS = {"cpu": "cpu", "tpu": "tpu", "gpu": "cuda"}
_STABLEHLO_COLLECTIVE = re.compile(r"stablehlo\.(all_reduce|all_gather|reduce_scatter|all_to_all)\b")


def graph_collectives(graph: Graph) -> dict[str, int]:
    """The graph's collective ops, counted by kind — a staged one (hierarchical-collectives: one collective over
    several mesh axes run as one per group of axes) once per stage, as it lowers."""
    counts: dict[str, int] = {}
    for node in graph.nodes():
        kind = COLLECTIVE_KINDS.get(type(node.op))
        if kind is not None:
            counts[kind] = counts.get(kind, 0) + max(1, len(getattr(node.op, "stages", ()) or ()))
    return dict(sorted(counts.items()))


def module_summary(text: str) -> dict:
    """Mosaic kernels and collectives (by kind) of an exported StableHLO module's text."""
    collectives: dict[str, int] = {}
    for match in _STABLEHLO_COLLECTIVE.finditer(text):
        kind = match.group(1).replace("_", "-")  # stablehlo.all_gather -> all-gather
        collectives[kind] = collectives.get(kind, 0) + 1
    return {"mosaic_kernels": text.count("@tpu_custom_call"), "collectives": dict(sorted(collectives.items())),
            "module_bytes": len(text)}


def abstract_arguments(folded: Graph, sizes: dict[str, int]) -> tuple[dict, dict, dict]:
    """(params, caches, batch) of a folded step graph as ShapeDtypeStructs at `sizes` (T tokens, R rows, B, M, P, S)."""
    import jax

    params = {name: jax.ShapeDtypeStruct(t.bind(sizes), np_dtype(t.dtype)) for name, t in param_types(folded).items()}
    caches = cache_specs(graph_cache_types(folded), sizes)
    return params, caches, batch_specs(sizes["T"], sizes["R"], sizes, data_parallel_ranks(folded))


def lowered_step(folded: Graph, sizes: dict[str, int], lowering: str) -> dict:
    """The decode step (T = R = sizes["T"]) of a folded graph exported for `lowering`'s platform: {platform, tokens,
    seconds, mosaic_kernels, collectives, graph_collectives, module_bytes}; {platform, skipped} when this process
    lacks the mesh's devices, {platform, error} when JAX refuses the program (a qcompile bug: please report it)."""
    import jax

    from qcompile.compiler.export import mesh_shardings
    from qcompile.kernels import native

    platform = PLATFORMS[lowering]
    needed = folded.meta["mesh"].size if is_sharded(folded) else 1
    available = len(jax.devices())
    if available < needed:
        return {"platform": platform, "skipped": f"the mesh needs {needed} devices; JAX started with {available} "
                                                 "in this process (qcompile plan asks for them in a fresh process)"}
    tokens = sizes["T"]
    params, caches, batch = abstract_arguments(folded, sizes)
    step = jax.jit(step_function(folded, lowering, with_logits=False), **mesh_shardings(folded, False))
    allow = [jax.export.DisabledSafetyCheck.custom_call(name) for name in native.KERNELS]
    started = time.perf_counter()
    try:
        exported = jax.export.export(step, platforms=[platform], disabled_checks=allow)(params, caches, batch)
        text = exported.mlir_module()
    except Exception as err:  # noqa: BLE001 - reported in the plan, which stands without it
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return {"platform": platform, "error": f"{type(err).__name__}: {first}"}
    return {"platform": platform, "tokens": tokens, "seconds": time.perf_counter() - started,
            **module_summary(text), "graph_collectives": graph_collectives(folded)}
