"""`qcompile reproduce DIR`: re-run the pass pipeline of a failed numerics check from its reproducer directory.

A reproducer holds the graph the failing pass received (`input.qir`), the graph it was compared with
(`reference.qir`), the passes to run (`pipeline.txt`), and `repro.json` (seed, bound, measured errors, the graph
metadata, and the checkpoint whose weights the graphs name). Re-running parses both graphs, loads those weights,
runs the passes on the input and checks the result against the reference with the same seed and bound.
"""

from __future__ import annotations

import json
from pathlib import Path

from qcompile.errors import CheckpointError
from qcompile.frontend.checkpoint import Checkpoint
from qcompile.ir.parser import parse_graph
from qcompile.passes.equivalence import EquivalenceChecker
from qcompile.passes.manager import run_pipeline
from qcompile.passes.registry import parse_spec
from qcompile.ir.weights import load_params


def reproduce(directory: Path) -> tuple[bool, str]:
    """(still passes?, one-line summary)."""
    directory = Path(directory)
    try:
        info = json.loads((directory / "repro.json").read_text())
        input_text = (directory / "input.qir").read_text()
        reference_text = (directory / "reference.qir").read_text()
        pipeline = (directory / "pipeline.txt").read_text().strip()
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{directory}: not a qcompile reproducer ({err})") from None
    meta = info.get("meta") or {}
    graph = parse_graph(input_text, str(directory / "input.qir"), meta=meta)
    reference = parse_graph(reference_text, str(directory / "reference.qir"), meta=meta)
    if not info.get("checkpoint"):
        raise CheckpointError(f"{directory}/repro.json: names no checkpoint to take the weights from")
    params = load_params(Checkpoint.open(info["checkpoint"]), reference)
    checker = EquivalenceChecker(reference, params, seed=int(info["seed"]))
    passes = parse_spec(pipeline)
    result = run_pipeline(graph, passes, verify_mode="none")
    check = checker.check(result.graph, float(info["bound"]))
    names = ", ".join(p.name for p in passes) or "none"
    if check.ok:
        return True, f"passes {names}: no longer fails (max error {check.max_error:.3g}, bound {check.bound:.3g})"
    return False, f"passes {names}: {check.reason}"
