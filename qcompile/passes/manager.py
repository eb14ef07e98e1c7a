"""The pass manager: runs a pipeline of passes and makes each one prove itself.

For every pass it: runs the pure pass function; audits the "changed" flag against a structural hash of the graph
(and that the input graph was not mutated); runs the verifier after every change; checks numerics against the graph
before the pass (`--verify each`) with the pass's tolerance class; times the pass and its check; and records
applied / skipped (with the reason) / failed. At the end (`each` or `final`) it compares the optimized graph with
the unoptimized one. A failure names the pass and the passes that ran before it; a numerics failure also writes a
reproducer directory that `qcompile reproduce DIR` re-runs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import attrs

from qcompile.errors import NumericsError, QCompileError, VerificationError
from qcompile.ir.graph import Graph
from qcompile.ir.printer import print_graph
from qcompile.ir.verifier import verify
from qcompile.passes.base import TARGET_RULES, Pass, PassContext, PassResult
from qcompile.passes.equivalence import CheckResult, EquivalenceChecker, describe_check, structural_hash

VERIFY_MODES = ("each", "final", "none")


class PassError(QCompileError):
    """A pass raised or broke its contract; exit code 1 (an internal error of that pass)."""


@attrs.frozen
class PassRecord:
    name: str
    status: str  # applied | skipped | failed
    changed: bool
    stats: dict
    reason: str = ""
    seconds: float = 0.0
    check: dict | None = None  # CheckResult.to_json() when a check ran
    check_seconds: float = 0.0
    note: str = ""  # the pass's cpu_note when the target is cpu: what it buys there, or why `all` keeps it

    def line(self) -> str:
        """One human-readable line: status, what changed, max error, time."""
        if self.status == "skipped":
            return f"  {self.name:<26} skipped   {self.reason}"
        what = ", ".join(f"{k}={v}" for k, v in self.stats.items() if not isinstance(v, (list, dict)))  # details:
        what = what or ("changed" if self.changed else "no change")  # the JSON report has them
        err = ""
        if self.check is not None:
            err = "  " + describe_check(self.check)
            if self.check.get("drift") is not None:
                first = self.check["first_divergence"]
                err += (f"; over {self.check['drift_steps']} decode steps logit error median "
                        f"{self.check['drift']:.2e} max {self.check['drift_max']:.2e}, greedy tokens agree "
                        f"{self.check['agreement']:.1%} ({self.check['agreement_outside_ties']:.1%} counting the "
                        "reference's near-ties)"
                        + (f", first difference at step {first}" if first is not None else ""))
        status = "FAILED" if self.status == "failed" else "applied"
        return f"  {self.name:<26} {status:<9} {what}{err}  {self.seconds + self.check_seconds:.2f}s"

    def to_json(self) -> dict:
        return attrs.asdict(self)


@attrs.frozen
class PipelineResult:
    graph: Graph
    records: tuple[PassRecord, ...]
    final_check: CheckResult | None

    def to_json(self) -> dict:
        return {"passes": [r.to_json() for r in self.records],
                "final_check": None if self.final_check is None else self.final_check.to_json()}


@attrs.define
class Instruments:
    """Debugging hooks: --print-ir-after PASS|all, --print-ir-after-change, --dump-dir DIR."""

    print_after: tuple[str, ...] = ()  # pass names, or ("all",)
    print_after_change: bool = False
    dump_dir: Path | None = None
    emit: Callable[[str], None] = print

    def start(self, graph: Graph) -> None:
        if self.dump_dir is not None:
            self.dump_dir.mkdir(parents=True, exist_ok=True)
            (self.dump_dir / "000_input.qir").write_text(print_graph(graph))

    def after(self, index: int, pass_: Pass, graph: Graph, changed: bool) -> None:
        text = None
        wanted = "all" in self.print_after or pass_.name in self.print_after
        if wanted or (self.print_after_change and changed):
            text = print_graph(graph)
            self.emit(f"// ----- IR after {pass_.name}{'' if changed else ' (unchanged)'} -----\n{text}")
        if self.dump_dir is not None:
            (self.dump_dir / f"{index:03d}_{pass_.name}.qir").write_text(text or print_graph(graph))


@attrs.define
class Reproducer:
    """Where and with what to write a reproducer when a numerics check fails."""

    root: Path
    checkpoint: str | None = None
    settings: dict = attrs.Factory(dict)  # dtype, page size, verify-layers: what `reproduce` needs to rebuild

    def write(self, *, failing: str, before: list[str], input_graph: Graph, reference: Graph,
              pipeline: list[str], result: CheckResult, seed: int, target: str = "reference") -> Path:
        stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
        path = self.root / f"{failing}-{stamp}"
        suffix = 1
        while path.exists():
            suffix += 1
            path = self.root / f"{failing}-{stamp}-{suffix}"
        path.mkdir(parents=True)
        (path / "input.qir").write_text(print_graph(input_graph))
        (path / "reference.qir").write_text(print_graph(reference))
        (path / "pipeline.txt").write_text(",".join(pipeline) + "\n")
        info = {"failing_pass": failing, "passes_before": before, "pipeline": pipeline, "seed": seed,
                "bound": result.bound, "max_error": result.max_error, "errors": result.errors,
                "reason": result.reason, "drift_steps": result.drift_steps, "target": target,
                "checkpoint": self.checkpoint, **self.settings}
        (path / "repro.json").write_text(json.dumps(info, indent=2) + "\n")
        return path


def _run_one(pass_: Pass, graph: Graph, ctx: PassContext, before: list[str]) -> tuple[PassResult, float]:
    trail = f" (after: {', '.join(before)})" if before else " (first pass)"
    input_hash = structural_hash(graph)
    started = time.perf_counter()
    try:
        result = pass_.run(graph, ctx)
    except QCompileError:
        raise
    except Exception as err:  # noqa: BLE001 - named and re-raised as this pass's failure
        raise PassError(f"pass {pass_.name} raised {type(err).__name__}: {err}{trail}") from err
    seconds = time.perf_counter() - started
    if not isinstance(result, PassResult):
        raise PassError(f"pass {pass_.name} returned {type(result).__name__}, not a PassResult{trail}")
    if structural_hash(graph) != input_hash:
        raise VerificationError(f"pass {pass_.name} mutated its input graph; passes must return a new graph{trail}")
    output_hash = structural_hash(result.graph)
    if result.changed != (output_hash != input_hash):
        claim = "changed" if result.changed else "no change"
        raise VerificationError(f"pass {pass_.name} reported {claim} but the graph is "
                                f"{'identical' if result.changed else 'different'}{trail}")
    return result, seconds


def with_drift(check, drift, pass_: Pass, dtype: str):
    """The check with a lossy pass's drift decode: the median step's logit error within the pass's bound (one step
    can jump where a perturbation flips an MoE router's near-tie — a discrete change the max would report as drift),
    and the greedy tokens agreeing with the reference's on at least `min_agreement` of the steps, a step whose tokens
    differ only at a near-tie of the reference's logits (within the bound) counting as agreeing: measured on tiny
    random bf16 and FP8 models with bf16 states (flat logits: many near-ties), raw agreement 0.92–0.98 and 0.97–0.99
    counting near-ties."""
    reasons = []
    bound = max(pass_.bound(dtype), check.bound)  # the check's bound: widened where the model's own noise is larger
    if drift.median_error > bound:
        reasons.append(f"median logit error over {drift.steps} decode steps {drift.median_error:.3g} > bound {bound:.3g}")
    if pass_.min_agreement is not None and drift.agreement_outside_ties < pass_.min_agreement:
        reasons.append(f"greedy tokens agree on {drift.agreement_outside_ties:.1%} of {drift.steps} decode steps "
                       f"counting near-ties, {drift.agreement:.1%} not counting them, < {pass_.min_agreement:.0%} "
                       f"(first difference at step {drift.first_divergence})")
    return attrs.evolve(check, drift=drift.median_error, drift_max=drift.max_error, agreement=drift.agreement,
                        agreement_outside_ties=drift.agreement_outside_ties,
                        first_divergence=drift.first_divergence, drift_steps=drift.steps, ok=check.ok and not reasons,
                        reason="; ".join(r for r in (check.reason, *reasons) if r))


def check_pass(checker: EquivalenceChecker, pass_: Pass, candidate: Graph, against: Graph, dtype: str,
               bound: float | None = None):
    """One pass's check: its output against its input (both with the target's rules) within its class's bound (or
    `bound`, a reproducer's); a lossy pass's comparison forgives jumps (`compare`) and adds the drift decode when the
    check batch holds."""
    bound = pass_.bound(dtype) if bound is None else bound
    check = checker.check(candidate, bound, against=against, jumps=pass_.tolerance == "lossy")
    if check.ok and pass_.drift_steps:
        drift = checker.drift(candidate, pass_.drift_steps, against=against, tie_bound=check.bound)
        check = with_drift(check, drift, pass_, dtype)
    return check


def run_pipeline(graph: Graph, passes: list[Pass], ctx: PassContext = PassContext(), *, verify_mode: str = "each",
                 checker: EquivalenceChecker | None = None, instruments: Instruments | None = None,
                 reproducer: Reproducer | None = None,
                 on_record: Callable[[PassRecord], None] | None = None) -> PipelineResult:
    """Run `passes` in order on `graph` (the unoptimized reference); see the module docstring."""
    if verify_mode not in VERIFY_MODES:
        raise ValueError(f"verify_mode must be one of {VERIFY_MODES}")
    if verify_mode != "none" and checker is None:
        raise ValueError("numerics checks need an EquivalenceChecker")
    instruments = instruments or Instruments()
    instruments.start(graph)
    reference, current = graph, graph
    records: list[PassRecord] = []
    ran: list[str] = []
    budget = 0.0  # final-check bound: the applied passes' bounds add up (first-order error accumulation)
    lossy = False  # a lossy pass applied: the final comparison forgives jumps too
    for index, pass_ in enumerate(passes, start=1):
        result, seconds = _run_one(pass_, current, ctx, ran)
        trail = f" (after: {', '.join(ran)})" if ran else " (first pass)"
        check, check_seconds = None, 0.0
        if result.skipped is not None:
            record = PassRecord(pass_.name, "skipped", False, dict(result.stats), result.skipped, seconds,
                                note=pass_.cpu_note if ctx.target == "cpu" else "")
        else:
            if result.changed:
                try:
                    verify(result.graph)
                except VerificationError as err:
                    raise VerificationError(f"IR verification failed after pass {pass_.name}{trail}: {err}") from None
                if verify_mode == "each":
                    started = time.perf_counter()
                    check = check_pass(checker, pass_, result.graph, current, graph.meta["dtype"])
                    check_seconds = time.perf_counter() - started
                budget += pass_.bound(graph.meta["dtype"])
                lossy = lossy or pass_.tolerance == "lossy"
            record = PassRecord(pass_.name, "applied", result.changed, dict(result.stats), "", seconds,
                                check.to_json() if check else None, check_seconds,
                                pass_.cpu_note if ctx.target == "cpu" else "")
            if check is not None and not check.ok:
                record = attrs.evolve(record, status="failed", reason=check.reason)
                if on_record:
                    on_record(record)
                where = ""
                if reproducer is not None:
                    path = reproducer.write(failing=pass_.name, before=list(ran), input_graph=current,
                                            reference=current, pipeline=[pass_.name], result=check,
                                            seed=checker.seed, target=checker.target)
                    where = f"; reproducer written to {path} (re-run: qcompile reproduce {path})"
                raise NumericsError(f"numerics check failed after pass {pass_.name}{trail}: {check.reason}{where}")
            ran.append(pass_.name)
            current = result.graph
        records.append(record)
        if on_record:
            on_record(record)
        instruments.after(index, pass_, current, result.changed)
    final = None
    if verify_mode != "none" and checker.target != "reference":
        budget += TARGET_RULES[graph.meta["dtype"]]  # the target's rules against the reference rules
    if verify_mode != "none" and (current is not reference or checker.target != "reference"):
        final = checker.check(current, budget, against=None, jumps=lossy)
        if not final.ok:
            where = ""
            if reproducer is not None:
                path = reproducer.write(failing="final", before=list(ran), input_graph=reference, reference=reference,
                                        pipeline=list(ran), result=final, seed=checker.seed,
                                        target=checker.target)
                where = f"; reproducer written to {path} (re-run: qcompile reproduce {path})"
            raise NumericsError(f"numerics check of the optimized graph against the unoptimized one failed "
                                f"(passes: {', '.join(ran)}): {final.reason}{where}")
    return PipelineResult(current, tuple(records), final)

