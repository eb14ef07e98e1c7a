"""Passes defined by the tests to exercise the pass machinery until the real optimization passes land.

Each is a real rewrite of the IR with a declared tolerance class; some are broken on purpose so that the manager's
audits, verifier and numerics checks are seen to catch them.
"""

from __future__ import annotations

import attrs

from qcompile.ir.ops.core import Add, Cast, Concat, Linear, RmsNorm, Slice
from qcompile.ir.ops.gdn import GdnRecurrence
from qcompile.ir.types import TensorType
from qcompile.passes.base import Pass, PassContext, PassResult
from qcompile.passes.rewrite import rewrite


def _swap_add(graph, ctx: PassContext) -> PassResult:
    """add(x, y) -> add(y, x): exact (IEEE addition commutes). Idempotent by marking: only when x's node id < y's."""
    def rule(b, node, ops):
        if isinstance(node.op, Add) and ops[0].node < ops[1].node:
            return b.add(Add(), ops[1], ops[0])
        return None

    new, count = rewrite(graph, rule)
    return PassResult(new, count > 0, {"swapped": count})


def _split_linear(graph, ctx: PassContext) -> PassResult:
    """linear(x, W) with an even output width -> concat(linear(x, W[:n/2]), linear(x, W[n/2:])): reassociating."""
    def rule(b, node, ops):
        if not isinstance(node.op, Linear):
            return None
        w = b.type_of(ops[1])
        rows = w.shape[0]
        if rows % 2 or rows < 4 or not _is_param(b, ops[1]):
            return None
        half = rows // 2
        top = b.add(Linear(), ops[0], b.add(Slice(0, 0, half), ops[1]))
        bottom = b.add(Linear(), ops[0], b.add(Slice(0, half, rows), ops[1]))
        return b.add(Concat(-1), top, bottom)

    new, count = rewrite(graph, rule)
    return PassResult(new, count > 0, {"split": count})


def _is_param(b, value) -> bool:
    node = b._dag.nodes[value.node]["node"]
    return node.op.op_name == "param"


def _loosen_eps(graph, ctx: PassContext) -> PassResult:
    """BROKEN on purpose: changes every rmsnorm's eps from 1e-6 to 1e-2 — small, but not a reassociation."""
    def rule(b, node, ops):
        if isinstance(node.op, RmsNorm) and node.op.eps != 1e-2:
            return b.add(attrs.evolve(node.op, eps=1e-2), *ops)
        return None

    new, count = rewrite(graph, rule)
    return PassResult(new, count > 0, {"norms": count})


def _wrong_types(graph, ctx: PassContext) -> PassResult:
    """BROKEN on purpose: re-creates the first linear with a wrong result type (bypasses type inference)."""
    done = []

    def rule(b, node, ops):
        if isinstance(node.op, Linear) and not done:
            done.append(node)
            t = node.types[0]
            return b.add_typed(node.op, ops, (TensorType(t.dtype, (*t.shape[:-1], 7)),))
        return None

    new, count = rewrite(graph, rule)
    return PassResult(new, count > 0)


def _liar(graph, ctx: PassContext) -> PassResult:
    """BROKEN on purpose: rewrites like swap-add but reports no change."""
    result = _swap_add(graph, ctx)
    return attrs.evolve(result, changed=False)


def _round_state(graph, ctx: PassContext) -> PassResult:
    """Stores the GDN recurrent state rounded to bf16 (and back): lossy, like the real bf16-state pass will be.

    Not idempotent (a second run rounds again), so it is kept out of GOOD and the property tests.
    """
    def rule(b, node, ops):
        if isinstance(node.op, GdnRecurrence):
            out, state = b.add(node.op, *ops)
            return out, b.add(Cast("f32"), b.add(Cast("bf16"), state))
        return None

    new, count = rewrite(graph, rule)
    return PassResult(new, count > 0, {"states": count})


def _skip(graph, ctx: PassContext) -> PassResult:
    return PassResult(graph, False, skipped=f"needs 2+ devices, have {ctx.num_devices}")


def _crash(graph, ctx: PassContext) -> PassResult:
    raise RuntimeError("boom")


SWAP_ADD = Pass("swap-add", "Swap add operands (exact).", _swap_add, "exact")
SPLIT_LINEAR = Pass("split-linear", "Split linears into two halves (reassociating).", _split_linear, "reassociating")
SKIPPER = Pass("needs-devices", "Skips on one device.", _skip, "exact", requires=("2+ devices",),
               cpu_note="cost structure only on cpu")
GOOD = {p.name: p for p in (SWAP_ADD, SPLIT_LINEAR, SKIPPER)}

LOOSEN_EPS = Pass("loosen-eps", "Broken: changes rmsnorm eps.", _loosen_eps, "reassociating")
WRONG_TYPES = Pass("wrong-types", "Broken: emits a wrong result type.", _wrong_types, "exact")
LIAR = Pass("liar", "Broken: changes the graph but says it did not.", _liar, "exact")
CRASH = Pass("crash", "Broken: raises.", _crash, "exact")
ROUND_STATE = Pass("round-state", "Lossy: recurrent state rounded to bf16.", _round_state, "lossy", lossy_bound=2e-2,
                   drift_steps=8)
ROUND_STATE_TIGHT = Pass("round-state-tight", "Lossy with a bound it cannot meet.", _round_state, "lossy",
                         lossy_bound=1e-6, drift_steps=8)
BROKEN = {p.name: p for p in (LOOSEN_EPS, WRONG_TYPES, LIAR, CRASH)}
