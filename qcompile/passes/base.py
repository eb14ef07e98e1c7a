"""What a pass is: a name, a summary, a tolerance class, its requirements, and a pure function.

A pass function takes the graph and a frozen PassContext and returns a PassResult: the new graph (or the same object
when nothing changed), whether it changed, statistics (what it matched and rewrote), and — when it does not apply —
the reason it was skipped. It never mutates its input; the manager audits that.

Tolerance classes (design.md §5), relative to the largest magnitude of the reference output:
  exact          bitwise equal (pure relayout, operand reordering)
  reassociating  f32: 1e-5, bf16: 1e-2 (fusions that change summation order)
  lossy          a bound declared by the pass itself, plus the dtype's reassociating bound (in a bf16 graph every
                 activation after the lossy change is rounded to bf16 again, so the comparison carries bf16
                 arithmetic's own noise: measured with bf16 states on tiny bf16/FP8 models, rows up to 2.4e-2 where
                 the same pass on f32 models stays under 6e-3), and a drift check over decode steps: the logits'
                 median error stays within that bound and the greedy tokens agree with the reference's at least
                 `min_agreement` of the steps (near-ties of the reference counted as agreeing); its comparisons
                 forgive jumps (equivalence.compare)
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from qcompile.ir.graph import Graph

TOLERANCE_CLASSES = ("exact", "reassociating", "lossy")
REASSOCIATING = {"f32": 1e-5, "bf16": 1e-2, "f16": 1e-3}
# The whole graph lowered with a target's rules against the reference rules: every op's summation order changes at
# once and the differences compound through the layers. Measured f32 on the tiny checkpoints: 6.9e-7 (Qwen3.5-MoE)
# to 1.1e-5 (Qwen3-Next, seed 3, whose GDN states amplify them); 5e-5 keeps 4.5x room and stays half of the 1e-4
# fidelity bound against transformers, so the target's rules cannot use up what the user is promised.
TARGET_RULES = {"f32": 5e-5, "bf16": 1e-2, "f16": 1e-3}


@attrs.frozen
class PassContext:
    """Everything a pass may look at besides the graph. Frozen: passes get configuration, not global state."""

    target: str = "cpu"
    num_devices: int = 1
    options: tuple[tuple[str, object], ...] = ()

    def option(self, key: str, default=None):
        return dict(self.options).get(key, default)


@attrs.frozen
class PassResult:
    graph: Graph
    changed: bool
    stats: dict = attrs.field(factory=dict)
    skipped: str | None = None  # reason, when the pass does not apply


@attrs.frozen
class Pass:
    name: str  # kebab-case, unique
    summary: str  # one line
    run: Callable[[Graph, PassContext], PassResult]
    tolerance: str = attrs.field(default="exact", validator=attrs.validators.in_(TOLERANCE_CLASSES))
    requires: tuple[str, ...] = ()  # human-readable preconditions, e.g. ("MoE layers", "2+ devices")
    in_all: bool = True  # selected by `all`
    lossy_bound: float | None = None  # relative bound, lossy passes only
    drift_steps: int = 0  # decode steps of the drift check, lossy passes only
    min_agreement: float | None = None  # lossy passes: least top-1 agreement with the reference over the drift decode
    cpu_note: str = ""  # what it buys on the cpu target, or why `all` keeps it there (shown by `qcompile passes`)

    def __attrs_post_init__(self):
        if self.tolerance == "lossy" and self.lossy_bound is None:
            raise ValueError(f"lossy pass {self.name} must declare lossy_bound")

    def bound(self, dtype: str) -> float:
        """Allowed relative error for this pass's class in a graph of `dtype`."""
        if self.tolerance == "exact":
            return 0.0
        if self.tolerance == "reassociating":
            return REASSOCIATING[dtype]
        return float(self.lossy_bound) + REASSOCIATING.get(dtype, 0.0)
