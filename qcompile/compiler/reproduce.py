"""`qcompile reproduce DIR`: re-run the pass pipeline of a failed numerics check from its reproducer directory.

A reproducer holds the graph the failing pass received (`input.qir`), the graph it was compared with
(`reference.qir`), the passes to run (`pipeline.txt`), and `repro.json` (seed, bound, measured errors, the graph
metadata, and the checkpoint whose weights the graphs name). Re-running parses both graphs, loads those weights,
runs the passes on the input and checks the result as the pipeline did: with the same seed, bound and target rules
(`target` in repro.json: a failure of a cpu kernel is re-run on the cpu rules, not the reference ones), one failing
pass against its input graph and — for a lossy pass — with its drift decode, a `final` failure against the reference.
"""

from __future__ import annotations

import json
from pathlib import Path

from qcompile.errors import CheckpointError
from qcompile.frontend.checkpoint import Checkpoint
from qcompile.ir.parser import parse_graph
from qcompile.ir.registry import LOWERING_TARGETS
from qcompile.passes.equivalence import EquivalenceChecker
from qcompile.passes.manager import check_pass, run_pipeline
from qcompile.passes.registry import parse_spec
from qcompile.ir.weights import load_params


def reproducer_devices(directory: Path) -> int:
    """Devices the reproducer's graphs are laid out on (their `mesh` statement; 1 without one), read before JAX
    starts so the replay runs on the same simulated mesh. Unreadable input is left to `reproduce` to report."""
    from qcompile.ir.parser import parse_mesh_statement

    try:
        mesh = parse_mesh_statement((Path(directory) / "input.qir").read_text())
    except (OSError, UnicodeDecodeError, CheckpointError):  # reported by reproduce() itself
        return 1
    return mesh.size if mesh is not None else 1


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
    if not isinstance(info, dict) or not isinstance(info.get("meta") or {}, dict):
        raise CheckpointError(f"{directory}/repro.json: not a qcompile reproducer (expected a JSON object)")

    def refuse(why: str) -> CheckpointError:
        return CheckpointError(f"{directory}/repro.json: {why}; write it again with the failing compile's "
                               "--repro-dir")

    seed, bound = info.get("seed"), info.get("bound")
    if type(seed) is not int or not 0 <= seed < 2**32:
        raise refuse(f"'seed' must be an integer in 0..2^32-1, got {json.dumps(seed)}")
    if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not 0 < bound < float("inf"):
        raise refuse(f"'bound' must be a positive number, got {json.dumps(bound)}")  # NaN: every error passes
    experts = info.get("verify_experts")
    if experts is not None and type(experts) is not int:
        raise refuse(f"'verify_experts' must be an integer, got {json.dumps(experts)}")
    target = info.get("target") or "reference"
    if target not in LOWERING_TARGETS:
        raise refuse(f"'target' must be one of {', '.join(LOWERING_TARGETS)}, got {json.dumps(target)}")
    if not info.get("checkpoint") or not isinstance(info["checkpoint"], str):
        raise refuse("it names no checkpoint (a path) to take the weights from")
    meta = info.get("meta") or {}
    try:
        graph = parse_graph(input_text, str(directory / "input.qir"), meta=meta)
        reference = parse_graph(reference_text, str(directory / "reference.qir"), meta=meta)
        checkpoint = Checkpoint.open(info["checkpoint"])
        if experts:  # the check ran on a slice restricted to its first N routed experts
            checkpoint = checkpoint.with_experts(experts)
        params = load_params(checkpoint, reference)
        checker = EquivalenceChecker(reference, params, seed=seed, target=target)
    except KeyError as err:
        raise refuse(f"its 'meta' lacks {err}") from None
    except ValueError as err:
        raise refuse(str(err)) from None
    passes = parse_spec(pipeline)
    result = run_pipeline(graph, passes, verify_mode="none")
    bound = float(bound)
    names = ", ".join(p.name for p in passes) or "none"
    lossy = any(p.tolerance == "lossy" for p in passes)
    if info.get("failing_pass") == "final":  # the whole pipeline (target rules) against the reference (reference rules)
        check = checker.check(result.graph, bound, jumps=lossy)
    elif len(passes) == 1:  # one pass: its output against its input (target rules), as the pipeline checked it
        check = check_pass(checker, passes[0], result.graph, reference, reference.meta["dtype"], bound)
    else:
        check = checker.check(result.graph, bound, against=reference, jumps=lossy)
    where = f" on the {target} rules" if target != "reference" else ""
    if check.ok:
        return True, (f"passes {names}: no longer fails{where} (max error {check.max_error:.3g}, "
                      f"bound {check.bound:.3g})")
    return False, f"passes {names}: {check.reason}"
