"""IR parser: the text form reads back into the same graph (same text, same verified types, same numbers), and
malformed text fails with `<source>:<line>: <problem>` and exit code 65."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from qcompile.errors import VerificationError
from qcompile.frontend.checkpoint import canonical_params
from qcompile.frontend.config import parse_config
from qcompile.frontend.tiny import full_config
from qcompile.ir.builder import Builder
from qcompile.ir.importer import ImportOptions, import_graph
from qcompile.ir.lowering import lower
from qcompile.ir.ops.core import Input, Param, Reshape
from qcompile.ir.parser import IRParseError, parse_graph
from qcompile.ir.printer import print_graph
from qcompile.ir.types import TensorType, np_dtype
from qcompile.ir.verifier import verify

PREFIX = {"qwen3_5_moe": "model.language_model.", "qwen3_next": "model."}
SIZES = {"T": 8, "B": 2, "R": 8, "P": 8, "M": 4, "S": 2}


def imported(family: str, dtype: str):
    cfg = parse_config(full_config("tiny", family, "f32"))
    shapes = {name: ref.shape for name, ref in canonical_params(cfg, set(), PREFIX[family]).items()}
    return cfg, import_graph(cfg, shapes, ImportOptions(dtype=dtype, page_size=16, gdn_mode="auto"))


def random_arguments(graph, vocab_size: int):
    """Params and inputs for every leaf of `graph`, symbolic dims bound by SIZES: two sequences of 5 and 3 tokens."""
    rng = np.random.default_rng(0)
    metadata = {
        "token_ids": rng.integers(0, vocab_size, SIZES["T"]),
        "positions": np.array([3, 4, 5, 6, 7, 0, 1, 2]),
        "query_start": np.array([0, 5, 8]),
        "page_table": np.arange(SIZES["B"] * SIZES["M"]).reshape(SIZES["B"], SIZES["M"]),
        "state_slots": np.array([0, 1]),
        "logits_indices": np.arange(SIZES["R"]),
    }
    params, inputs = {}, {}
    for node in graph.nodes():
        if isinstance(node.op, (Input, Param)):
            t = node.types[0]
            if node.op.name in metadata:
                array = metadata[node.op.name].astype(np.int32)
            else:
                array = (0.2 * rng.standard_normal(t.bind(SIZES))).astype(np.float32).astype(np_dtype(t.dtype))
            (params if isinstance(node.op, Param) else inputs)[node.op.name] = array
    return params, inputs


@pytest.mark.parametrize("family,dtype", [("qwen3_5_moe", "f32"), ("qwen3_next", "bf16")])
def test_imported_graph_round_trips_to_the_same_text_types_and_jaxpr(family, dtype):
    cfg, graph = imported(family, dtype)
    text = print_graph(graph)
    parsed = parse_graph(text, f"{family}.qir")
    assert print_graph(parsed) == text
    assert parsed.meta["name"] == graph.meta["name"] == family
    verify(parsed)
    assert [(n.op, n.types) for n in parsed.nodes()] == [(n.op, n.types) for n in graph.nodes()]
    params, inputs = random_arguments(graph, cfg.vocab_size)
    assert str(jax.make_jaxpr(lower(parsed))(params, inputs)) == str(jax.make_jaxpr(lower(graph))(params, inputs))


def test_parsed_graph_computes_bitwise_the_same_outputs():
    """qwen3_next in bf16: GDN, attention, MoE and the final cast; ~15 s, two compilations."""
    cfg, graph = imported("qwen3_next", "bf16")
    parsed = parse_graph(print_graph(graph))
    assert {"gdn_recurrence", "paged_attention", "moe_dispatch", "cast"} <= {n.op.op_name for n in graph.nodes()}
    params, inputs = random_arguments(graph, cfg.vocab_size)
    expected = jax.jit(lower(graph))(params, inputs)
    got = jax.jit(lower(parsed))(params, inputs)
    assert expected.keys() == got.keys() == graph.outputs.keys()
    for name in expected:
        a, b = np.asarray(expected[name]), np.asarray(got[name])
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), name
    assert np.isfinite(np.asarray(got["logits"])).all()


HAND_WRITTEN = """
// a hand-written reproducer
graph @demo {

  %x = input "x" : f32[T,8]
  %w = param "w" : f32[4,8]
  // comment lines may sit anywhere
  %h = linear(%x, %w) : f32[T,4]
  %y = reshape(%h) {shape=["T", 2, 2]} : f32[T,2,2]
  %n = param "n" : f32[2]
  %z = rmsnorm(%y, %n) {eps=1e-06, zero_centered=true} : f32[T,2,2]
  return out=%z, hidden=%h
}
"""


def test_hand_written_graph_parses_and_verifies():
    graph = parse_graph(HAND_WRITTEN, meta={"dtype": "f32", "name": "ignored"})
    verify(graph)
    assert graph.meta == {"dtype": "f32", "name": "demo"}
    assert list(graph.outputs) == ["out", "hidden"]
    assert graph.find(Reshape)[0].op.shape == ("T", 2, 2)
    assert print_graph(graph).startswith('graph @demo {\n  %0 = input "x" : f32[T,8]\n')
    assert "  %5 = rmsnorm(%3, %4) {eps=1e-06, zero_centered=true} : f32[T,2,2]\n  return out=%5, hidden=%2\n" \
        in print_graph(graph)


@pytest.mark.parametrize("name", ['a,b {"c"}', 'x : f32[1] } ] // y', 'back\\slash\\"q\\n', "%0 = add(%0)"])
def test_awkward_strings_round_trip(name):
    b = Builder()
    b.output("y", b.add(Reshape((8,)), b.param(name, TensorType("f32", (4, 2)))))
    text = print_graph(b.build({"name": "strings"}))
    parsed = parse_graph(text)
    verify(parsed)
    assert parsed.find(Param)[0].op.name == name
    assert print_graph(parsed) == text


def test_string_escapes():
    text = 'graph @g {\n  %0 = param "tab\\there, new\\nline \\\\ \\"q\\"" : f32[2]\n  return y=%0\n}\n'
    assert parse_graph(text).find(Param)[0].op.name == 'tab\there, new\nline \\ "q"'
    with pytest.raises(IRParseError, match=r"<text>:2: unknown escape \\x"):
        parse_graph(text.replace("\\t", "\\x"))


def test_attribute_values_of_every_kind():
    text = """graph @g {
  %0 = input "x" : f32[T,4]
  %1 = reshape(%0) {shape=["T", 2, 2]} : f32[T,2,2]
  %2 = slice(%1) {axis=-1, start=0, stop=1} : f32[T,2,1]
  %3 = input "pos" : i32[T]
  %4 = rope(%1, %3) {theta=-inf, rotary_dim=2} : f32[T,2,2]
  %5 = rope(%1, %3) {theta=1e+16, rotary_dim=2} : f32[T,2,2]
  return a=%2, b=%4, c=%5
}
"""
    graph = parse_graph(text)
    verify(graph)
    ops = [n.op for n in graph.nodes()]
    assert ops[2].axis == -1 and ops[4].theta == float("-inf") and ops[5].theta == 1e16
    assert print_graph(graph) == text


GOOD = ["graph @g {", '  %0 = input "x" : f32[T,4]', "  %1 = add(%0, %0) : f32[T,4]", "  return y=%1", "}"]


def broken(line: int, replacement: str | None) -> str:
    """GOOD with line `line` (1-based) replaced, or deleted when replacement is None."""
    lines = list(GOOD)
    if replacement is None:
        del lines[line - 1]
    else:
        lines[line - 1] = replacement
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("text,line,message", [
    (broken(3, "  %1 = add(%0, %7) : f32[T,4]"), 3, "operand %7 is not defined"),
    (broken(3, "  %0 = add(%0, %0) : f32[T,4]"), 3, "%0 is already defined on line 2"),
    (broken(3, "  %1 = frobnicate(%0) : f32[T,4]"), 3, "unknown op 'frobnicate'"),
    (broken(3, "  %1 = activation(%0) {fun=\"silu\"} : f32[T,4]"), 3, "op 'activation' has no attribute 'fun'"),
    (broken(3, "  %1 = activation(%0) {fn=\"tanh\"} : f32[T,4]"), 3, "bad attributes for op 'activation'"),
    (broken(3, "  %1 = activation(%0) : f32[T,4]"), 3, "op 'activation' is missing attribute 'fn'"),
    (broken(3, "  %1, %2 = add(%0, %0) : f32[T,4]"), 3, "2 result name(s) but 1 type(s)"),
    (broken(3, "  %1 = add(%0, %0) : f32[T,4], f32[T,4]"), 3, "1 result name(s) but 2 type(s)"),
    (broken(3, "  %1 = add(%0, %0) : f33[T,4]"), 3, "malformed type 'f33[T,4]'"),
    (broken(2, '  %0 = input "x" : f32[T,4'), 2, "malformed type 'f32[T,4'"),
    (broken(3, "  %1 = add(%0, %0)"), 3, "expected ':' before the result types, got end of line"),
    (broken(3, "  %1 = add(%0) : f32[T,4]"), 3, "op 'add' cannot take 1 operand(s)"),
    (broken(5, None), 4, "missing closing '}'"),
    (broken(3, "  this is not IR"), 3, "expected a %result name, got 'this'"),
    (broken(3, "  %1 = add(%0, %0) {x=[1, 2} : f32[T,4]"), 3, "expected ',' or ']', got '}'"),
    (broken(3, '  %1 = activation(%0) {fn="silu} : f32[T,4]'), 3, "cannot read"),
    (broken(4, "  return y=%9"), 4, "output 'y' refers to undefined value %9"),
    (broken(4, "  return y=%1, y=%0"), 4, "output 'y' set twice"),
    (broken(4, None), 4, "missing 'return' line"),
    (broken(4, "  return y=%1,"), 4, "expected an output name, got end of line"),
    (broken(4, "  return y=%1 z=%1"), 4, "expected ',' between outputs, got 'z'"),
    (broken(3, "  %1 = add(%0, %0) {} : f32[T,4] extra"), 3, "malformed type 'f32[T,4] extra'"),
    (broken(3, "  %1 = add(%0 %0) : f32[T,4]"), 3, "expected ',' or ')', got '%0'"),
    (broken(3, "  %1, %1 = router_topk(%0) {k=1, renormalize=false} : f32[T,1], i32[T,1]"), 3, "%1 is defined twice"),
    (broken(2, "  %0 = input x : f32[T,4]"), 2, "expected a quoted input name, got 'x'"),
    (broken(1, "graph demo {"), 1, "expected 'graph @name {'"),
    (broken(5, "}\n  %2 = add(%1, %1) : f32[T,4]"), 6, "text after the closing '}'"),
])
def test_malformed_text_is_a_one_line_error_with_its_line_number(text, line, message):
    with pytest.raises(IRParseError) as info:
        parse_graph(text, "bad.qir")
    err = info.value
    assert str(err).startswith(f"bad.qir:{line}: "), str(err)
    assert message in str(err)
    assert "\n" not in str(err) and err.exit_code == 65 and err.line == line


def test_wrong_result_type_parses_but_does_not_verify():
    graph = parse_graph(broken(3, "  %1 = add(%0, %0) : f32[T,5]"))
    assert str(graph.node(1).types[0]) == "f32[T,5]"
    with pytest.raises(VerificationError, match=r"expected f32\[T,4\]"):
        verify(graph)
