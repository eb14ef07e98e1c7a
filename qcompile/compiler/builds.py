"""Checkpoint → one or more checked builds (pass pipelines) sharing one set of loaded weights: what `bench` measures
and `serve` serves.

Each build runs its pass pipeline with the pass manager, checked (unless verify is "none") against the unoptimized
graph with the host target's rules against the reference rules, then folds its weight preparation; prepared weights
are computed one tensor at a time from the weights already loaded. Only arrays some build uses stay resident.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import attrs

from qcompile.compiler.measure import log
from qcompile.ir.lowering import host_target


@attrs.define
class Build:
    label: str  # the SPEC it was built from
    passes: list[str]
    graph: object
    check: dict | None
    params: dict | None = None  # None: the artifact's


def builds_from_checkpoint(source: Path, specs: list[str], dtype: str | None = None, mesh=None,
                           options: tuple = (), verify: str = "final", seed: int = 0,
                           emit: Callable[[str], None] = print, progress: Callable[[str], None] = log):
    """(checkpoint, params, builds, target) for each pass SPEC in `specs`; builds of the same passes, or whose
    pipelines made the same graph (passes with no work here, e.g. the mesh passes on one device), are merged and
    measured once. `emit` gets each build's check line, `progress` what is being done (stderr)."""
    from qcompile.frontend.checkpoint import Checkpoint
    from qcompile.ir.importer import build_graph
    from qcompile.ir.weights import fold_weight_preparation, load_params
    from qcompile.passes.base import PassContext
    from qcompile.passes.equivalence import EquivalenceChecker, describe_check, structural_hash
    from qcompile.passes.manager import run_pipeline
    from qcompile.passes.registry import parse_spec

    ckpt = Checkpoint.open(source)
    if mesh is not None:
        from qcompile.compiler.driver import check_mesh_fits

        check_mesh_fits(ckpt, mesh)
    graph = build_graph(ckpt, dtype)
    if mesh is not None:
        graph.meta["mesh"] = mesh
    selections = [(spec, parse_spec(spec)) for spec in specs]  # a bad SPEC fails before anything loads
    progress(f"loading weights of {source}")
    params = load_params(ckpt, graph)
    target = host_target()
    checker = None
    if verify != "none":
        progress("preparing the numerics check")
        checker = EquivalenceChecker(graph, params, seed=seed, target=target)
    builds: dict[tuple[str, ...], Build] = {}
    by_graph: dict[str, tuple[str, ...]] = {}  # structural hash of a pipeline's graph -> the build that has it
    for spec, selected in selections:
        key = tuple(p.name for p in selected)
        if key in builds:
            builds[key].label += f" = {spec}"
            continue
        result = run_pipeline(graph, selected, PassContext(target=target, options=options), verify_mode=verify,
                              checker=checker)
        same = by_graph.setdefault(structural_hash(result.graph), key)
        if same != key:
            differ = [name for name in dict.fromkeys(key + same) if (name in key) != (name in same)]
            emit(f"build {spec}: the same graph as build {builds[same].label.split(' = ')[0]} "
                 f"({', '.join(differ)} had no work here); measured once")
            builds[same].label += f" = {spec}"
            continue
        check = None if result.final_check is None else result.final_check.to_json()
        folded = fold_weight_preparation(result.graph, target)
        build_params = params if folded is graph else load_params(ckpt, folded, loaded=params)
        builds[key] = Build(spec, list(key), folded, check, build_params)
        if check is not None:
            emit(f"build {spec}: passes {', '.join(key) or 'none'}; checked against the unoptimized graph "
                 f"({target} rules vs reference): {describe_check(check)}")
    # Keep only the arrays some build uses: the unoptimized graph's own weights (for the check) that every build
    # replaced by a prepared layout would otherwise stay resident beside it (bench peaked at 4.0 GiB on the 1.9 GiB
    # bench preset).
    del checker
    used = {id(array) for build in builds.values() for array in build.params.values()}
    params = {name: array for name, array in params.items() if id(array) in used}
    return ckpt, params, list(builds.values()), target
