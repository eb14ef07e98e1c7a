"""hierarchical-collectives: staged reduce-scatter / all-gather equal the one-stage collectives block for block (8
simulated devices as 2x4, and the other way round as 4x2), the golden rewrite of a laid-out model, the cases it
leaves alone, a device order that splits local groups made adjacent, a wrong block permutation caught by the checker,
and the compiled step's collectives split into a local stage (groups of 4) and an across stage (groups of 2).
Across 2 real processes it runs in tests/test_multiprocess.py (`run --mesh 2x4` applies it).
"""

from __future__ import annotations

import attrs
import jax
import numpy as np
import pytest

from qcompile.ir.builder import Builder
from qcompile.ir.importer import build_graph
from qcompile.ir.lowering import lower
from qcompile.ir.mesh import parse_mesh_spec
from qcompile.ir.ops.collective import AllGather, ReduceScatter
from qcompile.ir.printer import print_graph
from qcompile.ir.registry import LOWERINGS
from qcompile.ir.types import Sharding, TensorType
from qcompile.ir.verifier import VerificationError, verify
from qcompile.ir.weights import fold_weight_preparation, load_params
from qcompile.passes.base import PassContext
from qcompile.passes.equivalence import EquivalenceChecker
from qcompile.passes.gqa_sharding import GQA_SHARDING
from qcompile.passes.hierarchical_collectives import HIERARCHICAL_COLLECTIVES
from qcompile.passes.moe_allgather_rs import MOE_ALLGATHER_RS


def _collectives_graph(spec: str, stages: bool):
    """A partial sum over `rows` reduce-scattered in dim 0, and a value split along `rows` all-gathered."""
    mesh = attrs.evolve(parse_mesh_spec(spec), rules={"rows": parse_mesh_spec(spec).axes})
    across, local = mesh.axes[:-1], mesh.axes[-1:]
    b = Builder()
    partial = b.input("partial", TensorType("f32", (16, 3), sharding=Sharding((None, None), ("rows",))))
    split = b.input("split", TensorType("f32", (16, 3), sharding=Sharding(("rows", None))))
    b.output("scattered", b.add(ReduceScatter(0, "rows", mesh.axes, stages=(local, across) if stages else ()),
                                partial))
    b.output("gathered", b.add(AllGather(0, "rows", mesh.axes, stages=(across, local) if stages else ()), split))
    return b.build({"mesh": mesh, "name": "collectives"})


@pytest.mark.parametrize("spec", ["2x4", "4x2"])
def test_staged_collectives_give_every_device_the_one_stage_block(spec):
    rng = np.random.default_rng(0)
    partial = rng.standard_normal((8 * 16, 3)).astype(np.float32)  # each device's own [16, 3] partial sum
    split = rng.standard_normal((16, 3)).astype(np.float32)
    outputs = []
    for stages in (False, True):
        graph = _collectives_graph(spec, stages)
        verify(graph)
        mesh = graph.meta["mesh"].jax_mesh()
        step = lower(graph)  # the per-device rules, run inside this test's own shard_map
        # the partial input: device k's block is rows [16k, 16k+16) of `partial` (a stack of per-device values)
        fn = jax.jit(jax.shard_map(lambda p, s: step({}, {"partial": p, "split": s}), mesh=mesh,
                                   in_specs=(jax.P(mesh.axis_names), jax.P(mesh.axis_names)),
                                   out_specs={"scattered": jax.P(mesh.axis_names), "gathered": jax.P()},
                                   check_vma=False))
        outputs.append(jax.tree.map(np.asarray, fn(partial, split)))
    flat, staged = outputs
    expected = partial.reshape(8, 16, 3).sum(axis=0)  # device k keeps rows [2k, 2k+2) of the sum
    np.testing.assert_allclose(flat["scattered"], expected, atol=1e-5)
    np.testing.assert_allclose(staged["scattered"], flat["scattered"], atol=1e-5)  # sums reordered
    assert np.array_equal(staged["gathered"][:16], split) and np.array_equal(flat["gathered"][:16], split)


def _gathered(graph, spec: str):
    graph = graph.__class__(graph.dag, graph.outputs, {**graph.meta, "mesh": parse_mesh_spec(spec)})
    return MOE_ALLGATHER_RS.run(GQA_SHARDING.run(graph, PassContext()).graph, PassContext()).graph


def test_golden_and_not_transformed(small):
    _, graph, _ = small
    result = HIERARCHICAL_COLLECTIVES.run(_gathered(graph, "2x4"), PassContext())
    assert result.changed and result.stats == {"reduce_scatters": 2, "all_gathers": 4, "local_axis": "model",
                                               "local_devices": 4, "device_order_changed": False}
    verify(result.graph)
    text = print_graph(result.graph)
    assert ('all_gather(%' in text and '{axis=0, over="batch", mesh_axes=["data", "model"], stages=[["data"], '
            '["model"]]} : f32[T,96]<_,_>' in text)
    assert ('reduce_scatter(%' in text and '{axis=0, over="experts", mesh_axes=["data", "model"], split="batch", '
            'stages=[["model"], ["data"]]} : f32[T,96]<batch,_>' in text)
    assert HIERARCHICAL_COLLECTIVES.run(result.graph, PassContext()).skipped.startswith("no all-gather")  # idempotent
    assert HIERARCHICAL_COLLECTIVES.run(_gathered(graph, "8"), PassContext()).skipped.startswith("no all-gather")
    assert HIERARCHICAL_COLLECTIVES.run(graph, PassContext()).skipped.startswith("no all-gather")
    # a device order that interleaves the processes' devices is made row-major (local groups adjacent)
    laid_out = _gathered(graph, "2x4")
    mesh = laid_out.meta["mesh"]
    shuffled = laid_out.__class__(laid_out.dag, laid_out.outputs,
                                  {**laid_out.meta, "mesh": attrs.evolve(mesh, devices=(0, 4, 1, 5, 2, 6, 3, 7))})
    reordered = HIERARCHICAL_COLLECTIVES.run(shuffled, PassContext())
    assert reordered.stats["device_order_changed"] and reordered.graph.meta["mesh"].devices == tuple(range(8))
    # stages that do not split the mesh axes into across + local are a verifier error
    bad = text.replace('stages=[["model"], ["data"]]', 'stages=[["data"], ["model"]]', 1)
    from qcompile.ir.parser import parse_graph

    with pytest.raises(VerificationError, match="local first"):
        verify(parse_graph(bad, "bad.qir"))


def test_numerics_and_a_wrong_block_order_caught(small, monkeypatch):
    checkpoint, graph, params = small
    reference = graph.__class__(graph.dag, graph.outputs, {**graph.meta, "mesh": parse_mesh_spec("2x4")})
    staged = HIERARCHICAL_COLLECTIVES.run(_gathered(graph, "2x4"), PassContext()).graph
    checker = EquivalenceChecker(reference, params)
    result = checker.check(staged, 1e-5)
    assert result.ok, result.reason

    def forgets_the_permutation(op_, x):  # local then across, without reordering the blocks first
        local, across = op_.stages
        x = jax.lax.psum_scatter(x, local, scatter_dimension=op_.axis, tiled=True)
        return jax.lax.psum_scatter(x, across, scatter_dimension=op_.axis, tiled=True)

    monkeypatch.setitem(LOWERINGS, (ReduceScatter, "reference"), forgets_the_permutation)
    wrong = HIERARCHICAL_COLLECTIVES.run(_gathered(build_graph(checkpoint, None, 16), "2x4"), PassContext()).graph
    result = EquivalenceChecker(reference, params).check(wrong, 1e-5)
    assert not result.ok and result.errors["logits"] > 1e-2


def test_the_compiled_step_has_a_local_and_an_across_stage(small):
    from qcompile.compiler.hlo import collective_stats
    from qcompile.runtime.engine import CacheConfig, Engine

    checkpoint, _, _ = small
    graph = fold_weight_preparation(build_graph(checkpoint, None, 16))
    params = load_params(checkpoint, graph, progress=False)
    staged = HIERARCHICAL_COLLECTIVES.run(_gathered(graph, "2x4"), PassContext()).graph
    engine = Engine(staged, params, CacheConfig(max_seqs=16, max_context=32, max_step_tokens=16))
    engine.step_tokens([(engine.add_sequence(), [3 + i]) for i in range(16)])
    stats = collective_stats(engine.program.executable(engine.params, engine.caches, engine.last_batch, False).as_text())
    rs, ag = stats["reduce-scatter"]["by_group"], stats["all-gather"]["by_group"]
    assert set(rs) == set(ag) == {4, 2} and rs[4]["count"] == rs[2]["count"] == 2  # 2 MoE layers, 2 stages each
    # the local stage sums the 4 devices of a process first, so each device sends one final [T/8, H] block across
    # (a one-stage ring over all 8 sends seven): 16 tokens x 96 f32 / 8 = 768 bytes per layer
    assert rs[2]["result_bytes"] == rs[2]["sent_bytes"] == 2 * 768 and rs[4]["result_bytes"] == 2 * 2 * 768
