"""The op catalogue and its side tables: type rules and reference (jnp) lowering rules, keyed by op class.

An op class is a frozen attrs class holding only attributes; `@op("name")` registers it under its text name.
`@type_rule(Cls)` registers `fn(op, *operand_types) -> tuple[TensorType, ...]`; `@lowering(Cls)` registers
`fn(op, *operand_arrays) -> array | tuple[array, ...]`, the op's one reference semantics (target "reference").
`@lowering(Cls, target="cpu")` registers a faster rule for one target; `lowering_rule(Cls, target)` returns the
target's rule, falling back to the reference rule. Every target rule must compute the reference's function within
the reassociating tolerance: the compile-time checker runs the user's graph with the target's rules against the
reference rules, and a test fails when a target rule has no test comparing it with its reference.
A test checks that every registered op has a type rule and a reference rule.
"""

from __future__ import annotations

from collections.abc import Callable

OPS: dict[str, type] = {}
TYPE_RULES: dict[type, Callable] = {}
#: (op class, target) -> lowering rule; target "reference" is the op's one semantics.
LOWERINGS: dict[tuple[type, str], Callable] = {}
#: (op class, target) of the rules that take a deferred FP8 weight (kernels/fp8.py `QuantizedWeight`) as it is and
#: dequantize it themselves; every other rule is given the dequantized array (ir/lowering.py).
TAKES_QUANTIZED: set[tuple[type, str]] = set()
#: Targets a lowering table can be keyed by.
LOWERING_TARGETS = ("reference", "cpu", "tpu", "gpu")
#: op class -> fn(op, result_types, mesh) -> op: the op as one device's blocks see it inside `jax.shard_map`, for ops
#: whose attributes name global sizes along a dim that can be split (a reshape's target shape). Ops without an entry
#: are size-agnostic: their rules read sizes off their operands.
LOCAL_FORMS: dict[type, Callable] = {}


class OpTypeError(Exception):
    """An op's operands do not fit its type rule."""


def op(name: str):
    def register(cls):
        if name in OPS:
            raise ValueError(f"op {name!r} registered twice")
        cls.op_name = name
        OPS[name] = cls
        return cls

    return register


def type_rule(cls):
    def register(fn):
        TYPE_RULES[cls] = fn
        return fn

    return register


def local_form(cls):
    def register(fn):
        LOCAL_FORMS[cls] = fn
        return fn

    return register


def lowering(cls, target: str = "reference", takes_quantized: bool = False):
    if target not in LOWERING_TARGETS:
        raise ValueError(f"unknown lowering target {target!r}; one of {LOWERING_TARGETS}")

    def register(fn):
        if (cls, target) in LOWERINGS:
            raise ValueError(f"{cls.__name__} has two {target} lowering rules")
        LOWERINGS[(cls, target)] = fn
        if takes_quantized:
            TAKES_QUANTIZED.add((cls, target))
        return fn

    return register


def lowering_rule(cls, target: str = "reference") -> Callable:
    """The rule that lowers ops of `cls` for `target`: the target's own rule, else the reference rule."""
    if target not in LOWERING_TARGETS:
        raise ValueError(f"unknown lowering target {target!r}; one of {LOWERING_TARGETS}")
    return LOWERINGS.get((cls, target)) or LOWERINGS[(cls, "reference")]


def takes_quantized(cls, target: str) -> bool:
    """Whether `lowering_rule(cls, target)` takes deferred FP8 weights (TAKES_QUANTIZED)."""
    return (cls, target) in TAKES_QUANTIZED


def target_rules(target: str | None = None) -> list[tuple[type, str]]:
    """(op class, target) of every rule that is not a reference rule (optionally for one target)."""
    return sorted(((cls, t) for cls, t in LOWERINGS if t != "reference" and (target is None or t == target)),
                  key=lambda key: (key[0].op_name, key[1]))


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise OpTypeError(message)


def infer_types(op_instance, operand_types) -> tuple:
    rule = TYPE_RULES[type(op_instance)]
    result = rule(op_instance, *operand_types)
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)
