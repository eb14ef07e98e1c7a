"""The cost side table: FLOPs and the bytes that must move for one op in one step, and their sum over a step graph.

Why: `qcompile bench` reports "% of roofline", the time a step must take at the machine's measured ceilings divided
by the time it took (design.md §7). The roofline counts what no implementation can avoid: the weights the batch
actually touches (for routed experts, only the experts its tokens chose), the KV cache the live tokens read, and the
recurrent and conv state read and written once per sequence; FLOPs are those of the matmul-like work. Activations
are not counted (a fused implementation keeps them in cache). Padding is not work: shapes are bound with the live
token count T and the logit rows R actually asked for.

A cost rule is `fn(op, operand types (bound), result types (bound), step: StepShape) -> Cost`, registered with
`@cost(OpClass)` next to the op's type and lowering rules; ops without a rule cost nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import attrs

from qcompile.ir.graph import Graph
from qcompile.ir.types import TensorType, np_dtype

COSTS: dict[type, Callable] = {}


@attrs.frozen
class Cost:
    flops: float = 0.0
    bytes: float = 0.0

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.flops + other.flops, self.bytes + other.bytes)

    def seconds(self, bytes_per_s: float, flops_per_s: float) -> float:
        """Roofline time: the larger of the memory time and the compute time."""
        return max(self.bytes / bytes_per_s, self.flops / flops_per_s)


@attrs.frozen
class StepShape:
    """The live work of one step: new tokens and context length (after the step) per sequence, logit rows asked
    for, and how many distinct experts the batch routed to, per MoE layer (mean over layers)."""

    new_tokens: tuple[int, ...]
    contexts: tuple[int, ...]
    rows: int
    experts_touched: float

    @property
    def tokens(self) -> int:
        return sum(self.new_tokens)

    @property
    def sequences(self) -> int:
        return sum(1 for n in self.new_tokens if n > 0)

    def attended_keys(self) -> int:
        """Σ over new tokens of the keys each attends to (causal: the token at position p reads p+1 keys)."""
        total = 0
        for n, ctx in zip(self.new_tokens, self.contexts):
            start = ctx - n
            total += n * start + n * (n + 1) // 2
        return total


def cost(cls):
    def register(fn):
        COSTS[cls] = fn
        return fn

    return register


def nbytes(t: TensorType, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * np_dtype(t.dtype)(0).itemsize


def dequantized_reads(graph: Graph) -> dict:
    """Value -> the type its consumers are costed with: a dequantized FP8 weight is read as its FP8 values (the matmul
    rules dequantize it in cache); the dequantize's own rule counts the scale."""
    return {node.results[0]: graph.type_of(node.operands[0]) for node in graph.nodes()
            if node.op.op_name == "dequantize"}


def step_cost(graph: Graph, sizes: dict[str, int], step: StepShape) -> Cost:
    """Cost of one step of `graph`: symbolic dims bound by `sizes`, with T and R replaced by the live work."""
    bound = {**sizes, "T": step.tokens, "R": step.rows}
    read_as = dequantized_reads(graph)
    total = Cost()
    for node in graph.nodes():
        rule = COSTS.get(type(node.op))
        if rule is None:
            continue
        types = [read_as.get(v) or graph.type_of(v) for v in node.operands]
        operands = [(t, t.bind(bound)) for t in types]
        results = [(t, t.bind(bound)) for t in node.types]
        total = total + rule(node.op, operands, results, step)
    return total
