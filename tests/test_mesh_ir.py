"""Meshes and shardings in the IR: the mesh statement and sharded types in the text form (round trip), the verifier's
sharding checks, the collectives' type rules, `--mesh` specs, and the collectives lowered with `jax.shard_map` on 8
CPU devices (in a fresh process: the device count is fixed when JAX starts) against numpy.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from qcompile.errors import VerificationError
from qcompile.ir.builder import Builder
from qcompile.ir.mesh import Mesh, parse_mesh_spec, sharding_problems
from qcompile.ir.ops.collective import AllGather, AllReduce, AllToAll, ReduceScatter
from qcompile.ir.ops.core import Linear
from qcompile.ir.parser import IRParseError, parse_graph
from qcompile.ir.printer import print_graph
from qcompile.ir.registry import OpTypeError, infer_types
from qcompile.ir.types import Sharding, TensorType, parse_type
from qcompile.ir.verifier import verify

MESH = Mesh.of({"data": 2, "model": 4}, rules={"model": ("model",), "rows": ("data", "model")},
               devices=(0, 1, 4, 5, 2, 3, 6, 7))


def sharded(dtype: str, shape, dims, partial=()) -> TensorType:
    return TensorType(dtype, shape, sharding=Sharding(dims, partial))


def collective_graph(mesh: Mesh = MESH):
    """linear with its contraction dim split along `model` (a partial sum), then every collective."""
    b = Builder()
    x = b.input("x", sharded("f32", (4, 16), (None, "model")))
    w = b.param("w", sharded("f32", (8, 16), (None, "model")))
    z = b.input("z", sharded("f32", (8, 8), ("rows", None)))
    partial = b.add_typed(Linear(), [x, w], [sharded("f32", (4, 8), (None, None), ("model",))])
    summed = b.add(AllReduce("model", ("model",)), partial)
    scattered = b.add(ReduceScatter(1, "model", ("model",)), partial)
    gathered = b.add(AllGather(1, "model", ("model",)), scattered)
    moved = b.add(AllToAll(1, 0, "rows", ("data", "model")), z)
    back = b.add(AllGather(1, "rows", ("data", "model")), moved)
    for name, value in (("summed", summed), ("scattered", scattered), ("gathered", gathered), ("moved", moved),
                        ("back", back)):
        b.output(name, value)
    return b.build({"mesh": mesh, "name": "collectives"})


def test_sharded_types_print_and_parse():
    for text in ("f32[64,1024,256]<experts,_,_>", "f32[T,1024]<_,_|kv_heads>", "bf16[S,8,128,128]<batch,_,_,_>",
                 "f32[T,96]", "i32[4]<_|a,b>"):
        assert str(parse_type(text)) == text
    assert parse_type("f32[8,4]<rows,_>") == TensorType("f32", (8, 4))  # an annotation, not identity
    for bad in ("f32[8,4]<rows>", "f32[8]<rows,rows>", "f32[8]<9x>", "f32[8]<a|a>"):
        with pytest.raises(ValueError):
            parse_type(bad)


def test_a_graph_with_a_mesh_and_collectives_round_trips_and_verifies():
    graph = collective_graph()
    verify(graph)
    text = print_graph(graph)
    assert text.splitlines()[1].startswith('  mesh {axes=["data", "model"], shape=[2, 4], devices=[0, 1, 4, 5')
    assert "all_to_all(%2) {split_axis=1, concat_axis=0, over=\"rows\", mesh_axes=[\"data\", \"model\"], split=\"\"}" in text
    again = parse_graph(text, "t.qir")
    assert again.meta["mesh"] == MESH
    assert print_graph(again) == text
    verify(again)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace("shape=[2, 4]", "shape=[2, 3]"), "device order must be a permutation"),
    (lambda t: t.replace('["model", "model"]', '["model", "cores"]'), "mesh axes must be distinct names"),
    (lambda t: t.replace("mesh {", "mesh {color=1, "), "unknown mesh attribute 'color'"),
    (lambda t: t.replace("  mesh {", "  %9 = input \"q\" : f32[1]\n  mesh {"), "comes once, first"),
])
def test_a_malformed_mesh_statement_is_a_parse_error(edit, message):
    text = edit(print_graph(collective_graph()))
    with pytest.raises(IRParseError, match=message):
        parse_graph(text, "t.qir")


def _verify_text(text: str):
    verify(parse_graph(text, "t.qir"))


@pytest.mark.parametrize("edit, message", [
    # 16 columns split 4 ways divide; 18 do not
    (lambda t: t.replace('input "x" : f32[4,16]<_,model>', 'input "x" : f32[4,18]<_,model>')
     .replace('param "w" : f32[8,16]<_,model>', 'param "w" : f32[8,18]<_,model>'), "not divisible by the 4 pieces"),
    (lambda t: t.replace('f32[8,8]<rows,_>', 'f32[8,8]<lanes,_>', 1), "'lanes' of f32[8,8]<lanes,_> has no rule"),
    (lambda t: t.replace('f32[8,8]<rows,_>', 'f32[8,8]<rows,model>', 1), "uses mesh axis 'model' twice"),
    (lambda t: t.replace('over="rows", mesh_axes=["data", "model"]', 'over="rows", mesh_axes=["model"]', 1),
     "runs on mesh axes ['model'], but the mesh maps 'rows' to ['data', 'model']"),
])
def test_the_verifier_checks_shardings_against_the_mesh(edit, message):
    text = print_graph(collective_graph())
    _verify_text(text)
    with pytest.raises(VerificationError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _verify_text(edit(text))


def test_a_partial_sum_may_not_leave_the_step_and_a_sharding_needs_a_mesh():
    graph = collective_graph()
    text = print_graph(graph).replace("return summed=", "return leaked=%3, summed=")
    with pytest.raises(VerificationError, match="output 'leaked' is a partial sum over"):
        _verify_text(text)
    no_mesh = "\n".join(line for line in print_graph(graph).splitlines() if not line.strip().startswith("mesh"))
    with pytest.raises(VerificationError, match="is sharded but the graph has no mesh"):
        _verify_text(no_mesh)
    assert sharding_problems(None, TensorType("f32", (4,))) == []


@pytest.mark.parametrize("op, operand, message", [
    (AllGather(0, "model", ("model",)), sharded("f32", (8, 4), (None, "model")), "is not split that way"),
    (AllGather(0, "model", ("model",)), TensorType("f32", (8, 4)), "needs a sharded operand"),
    (ReduceScatter(0, "model", ("model",)), sharded("f32", (8, 4), (None, None)), "not a partial sum over it"),
    (ReduceScatter(0, "model", ("model",)), sharded("f32", (8, 4), ("rows", None), ("model",)), "already split"),
    (AllReduce("model", ("model",)), sharded("f32", (8,), (None,), ("rows",)), "not a partial sum over it"),
    (AllToAll(0, 0, "rows", ("data", "model")), sharded("f32", (8, 8), ("rows", None)), "the same dim"),
    (AllToAll(1, 0, "rows", ("data", "model")), sharded("f32", (8, 8), (None, "rows")), "not split along it"),
    (AllGather(2, "model", ("model",)), sharded("f32", (8, 4), (None, "model")), "out of range"),
])
def test_collective_type_rules_refuse_operands_that_are_not_laid_out_for_them(op, operand, message):
    with pytest.raises(OpTypeError, match=message):
        infer_types(op, [operand])


def test_collective_type_rules_move_the_sharding_and_keep_the_shape():
    (out,) = infer_types(ReduceScatter(1, "model", ("model",)), [sharded("f32", (4, 8), (None, None), ("model",))])
    assert out.shape == (4, 8) and out.sharding == Sharding((None, "model"))
    (out,) = infer_types(AllToAll(1, 0, "rows", ("data",)), [sharded("f32", (8, 8), ("rows", None))])
    assert out.sharding == Sharding((None, "rows"))


@pytest.mark.parametrize("spec, axes, shape", [("8", ("model",), (8,)), ("4x2", ("data", "model"), (4, 2)),
                                               ("2x4", ("data", "model"), (2, 4)),
                                               ("2x2x2", ("host", "data", "model"), (2, 2, 2))])
def test_mesh_specs(spec, axes, shape):
    mesh = parse_mesh_spec(spec)
    assert (mesh.axes, mesh.shape, mesh.devices) == (axes, shape, tuple(range(mesh.size)))


@pytest.mark.parametrize("spec", ["", "0", "4x", "x2", "4*2", "2x2x2x2", "-8"])
def test_bad_mesh_specs(spec):
    with pytest.raises(ValueError, match="--mesh"):
        parse_mesh_spec(spec)


def test_collectives_lowered_on_8_cpu_devices_match_numpy():
    """In a fresh process with 8 host devices: the graph above under jax.shard_map on a 2x4 mesh (permuted device
    order), each collective's output against numpy on the whole arrays."""
    script = textwrap.dedent("""
        import jax
        jax.config.update("jax_num_cpu_devices", 8)
        import numpy as np
        from test_mesh_ir import collective_graph
        from qcompile.ir.lowering import lower_on_mesh

        rng = np.random.default_rng(0)
        x = rng.standard_normal((4, 16)).astype(np.float32)
        w = rng.standard_normal((8, 16)).astype(np.float32)
        z = rng.standard_normal((8, 8)).astype(np.float32)
        out = jax.jit(lower_on_mesh(collective_graph()))({"w": w}, {"x": x, "z": z})
        want = x @ w.T
        for name in ("summed", "scattered", "gathered"):
            np.testing.assert_allclose(np.asarray(out[name]), want, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(out["moved"]), z)
        np.testing.assert_array_equal(np.asarray(out["back"]), z)
        assert out["scattered"].sharding.spec == jax.sharding.PartitionSpec(None, "model")
        assert {s.data.shape for s in out["scattered"].addressable_shards} == {(4, 2)}
        assert {s.data.shape for s in out["moved"].addressable_shards} == {(8, 1)}
        text = jax.jit(lower_on_mesh(collective_graph())).lower({"w": w}, {"x": x, "z": z}).as_text()
        for name in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all"):
            assert name in text, name
        print("ok", len(jax.devices()))
    """)
    import os
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["ok", "8"]
