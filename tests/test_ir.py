"""IR: the op catalogue is complete, the printer is the one text form, the verifier catches malformed graphs."""

from __future__ import annotations

import attrs
import networkx as nx
import pytest

from qcompile.errors import VerificationError
from qcompile.frontend.config import parse_config
from qcompile.frontend.tiny import full_config
from qcompile.ir.builder import Builder
from qcompile.ir.graph import Graph, Node, Value
from qcompile.ir.importer import ImportOptions, import_graph
from qcompile.ir.ops.core import Add, Linear, Mul, Reshape
from qcompile.ir.printer import print_graph
from qcompile.ir.registry import LOWERINGS, OPS, TYPE_RULES, OpTypeError
from qcompile.ir.types import TensorType, parse_type
from qcompile.ir.verifier import verify


def tiny_graph(family="qwen3_5_moe", **opts):
    cfg = parse_config(full_config("tiny", family, "f32"))
    from qcompile.frontend.checkpoint import canonical_params

    prefix = "model.language_model." if family == "qwen3_5_moe" else "model."
    shapes = {name: ref.shape for name, ref in canonical_params(cfg, set(), prefix).items()}
    return import_graph(cfg, shapes, ImportOptions(**opts))


def test_every_op_has_a_docstring_a_type_rule_and_a_lowering():
    assert len(OPS) >= 20
    for name, cls in OPS.items():
        assert attrs.has(cls) and cls.__attrs_attrs__ is not None
        assert cls.__doc__ and len(cls.__doc__) > 15, f"op {name} needs a docstring stating its semantics"
        assert cls in TYPE_RULES, f"op {name} has no type rule"
        if name not in ("input", "param"):
            assert (cls, "reference") in LOWERINGS, f"op {name} has no reference lowering rule"
        assert cls.__setattr__.__name__ == "_frozen_setattrs", f"op {name} must be a frozen attrs class"


def test_ordered_operands_keep_x_plus_x():
    b = Builder()
    x = b.input("x", TensorType("f32", ("T", 4)))
    y = b.add(Add(), x, x)
    b.output("y", y)
    graph = b.build()
    node = graph.node(y.node)
    assert node.operands == (x, x) and graph.dag.number_of_edges() == 1
    verify(graph)
    assert "add(%0, %0)" in print_graph(graph)


def test_printed_form_of_a_small_graph():
    b = Builder()
    x = b.input("x", TensorType("f32", ("T", 8)))
    w = b.param("w", TensorType("f32", (4, 8)))
    h = b.add(Linear(), x, w)
    b.output("out", b.add(Reshape(("T", 2, 2)), b.add(Mul(), h, h)))
    assert print_graph(b.build(), "demo") == (
        "graph @demo {\n"
        '  %0 = input "x" : f32[T,8]\n'
        '  %1 = param "w" : f32[4,8]\n'
        "  %2 = linear(%0, %1) : f32[T,4]\n"
        "  %3 = mul(%2, %2) : f32[T,4]\n"
        '  %4 = reshape(%3) {shape=["T", 2, 2]} : f32[T,2,2]\n'
        "  return out=%4\n"
        "}\n"
    )


def test_type_rules_reject_mismatched_operands():
    b = Builder()
    x = b.input("x", TensorType("f32", ("T", 8)))
    w = b.param("w", TensorType("f32", (4, 9)))
    with pytest.raises(OpTypeError, match="linear"):
        b.add(Linear(), x, w)
    with pytest.raises(OpTypeError, match="changes size"):
        b.add(Reshape(("T", 3)), x)


def _tamper(graph: Graph, node_id: int, **changes) -> Graph:
    dag = graph.dag.copy()
    old = dag.nodes[node_id]["node"]
    dag.nodes[node_id]["node"] = attrs.evolve(old, **changes)
    return Graph(dag, graph.outputs, graph.meta)


def test_verifier_catches_wrong_result_type():
    graph = tiny_graph()
    linear = next(n for n in graph.nodes() if isinstance(n.op, Linear))
    bad = _tamper(graph, linear.id, types=(TensorType("f32", ("T", 7)),))
    with pytest.raises(VerificationError, match="type rule"):
        verify(bad)


def test_verifier_catches_undefined_operand_and_cycles():
    graph = tiny_graph()
    linear = next(n for n in graph.nodes() if isinstance(n.op, Linear))
    with pytest.raises(VerificationError, match="not defined"):
        verify(_tamper(graph, linear.id, operands=(Value(10_000), linear.operands[1])))
    dag = graph.dag.copy()
    last = graph.order()[-1]
    dag.add_edge(last, graph.order()[0])
    with pytest.raises(VerificationError, match="cycle"):
        verify(Graph(dag, graph.outputs, graph.meta))


def test_verifier_catches_edges_that_do_not_match_operands():
    graph = tiny_graph()
    dag = graph.dag.copy()
    order = graph.order()
    dag.add_edge(order[0], order[-1])  # an edge with no operand behind it
    with pytest.raises(VerificationError, match="edges"):
        verify(Graph(dag, graph.outputs, graph.meta))


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_imported_graph_structure(family):
    graph = tiny_graph(family, page_size=8)
    verify(graph)
    text = print_graph(graph)
    counts = {}
    for node in graph.nodes():
        counts[node.op.op_name] = counts.get(node.op.op_name, 0) + 1
    assert counts["gdn_recurrence"] == 3 and counts["paged_attention"] == 1
    assert counts["router_topk"] == 4 and counts["grouped_matmul"] == 12
    assert set(graph.outputs) == {"logits", "next_tokens", *graph.meta["caches"]}
    assert graph.type_of(graph.outputs["logits"]) == TensorType("f32", ("R", 512))
    assert "page_size=8" in text and 'input "layers.3.k_pages" : f32[P,8,2,64]' in text
    assert 'input "layers.0.recurrent_state" : f32[S,4,16,32]' in text
    # Parameters name canonical checkpoint tensors; the graph holds no data.
    params = [n for n in graph.nodes() if n.op.op_name == "param"]
    assert all(isinstance(n.op.name, str) for n in params) and len(params) == len({n.op.name for n in params})


def test_graph_import_is_linear_in_layers():
    """Node count grows by a constant per layer pattern (no quadratic step)."""
    sizes = []
    for layers in (4, 8, 16):
        cfg_dict = full_config("tiny", "qwen3_5_moe", "f32")
        cfg_dict["text_config"]["num_hidden_layers"] = layers
        cfg_dict["text_config"]["layer_types"] = [
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
        cfg = parse_config(cfg_dict)
        from qcompile.frontend.checkpoint import canonical_params

        shapes = {n: r.shape for n, r in canonical_params(cfg, set(), "model.language_model.").items()}
        sizes.append(len(import_graph(cfg, shapes)))
    assert sizes[2] - sizes[1] == 2 * (sizes[1] - sizes[0])


def test_type_text_round_trips():
    for text in ("f32[T,96]", "i32[B+1]", "bf16[P,16,2,64]", "f32[T*8,40]", "i32[]"):
        assert str(parse_type(text)) == text
    assert Node(0, Add(), (), (TensorType("f32", (1,)),)).results == (Value(0, 0),)
    assert nx.is_directed_acyclic_graph(tiny_graph().dag)
