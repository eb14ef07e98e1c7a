"""The op catalogue and its side tables: type rules and reference (jnp) lowering rules, keyed by op class.

An op class is a frozen attrs class holding only attributes; `@op("name")` registers it under its text name.
`@type_rule(Cls)` registers `fn(op, *operand_types) -> tuple[TensorType, ...]`; `@lowering(Cls)` registers
`fn(op, *operand_arrays) -> array | tuple[array, ...]`, the op's one reference semantics. A test checks that every
registered op has both.
"""

from __future__ import annotations

from collections.abc import Callable

OPS: dict[str, type] = {}
TYPE_RULES: dict[type, Callable] = {}
LOWERINGS: dict[type, Callable] = {}


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


def lowering(cls):
    def register(fn):
        LOWERINGS[cls] = fn
        return fn

    return register


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise OpTypeError(message)


def infer_types(op_instance, operand_types) -> tuple:
    rule = TYPE_RULES[type(op_instance)]
    result = rule(op_instance, *operand_types)
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)
