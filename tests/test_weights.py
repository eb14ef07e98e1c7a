"""Compile-time weight preparation: params-only parts of a graph are folded into prepared parameters, computed
once by `load_params` (one recipe at a time), stored in the artifact, and never recomputed by `run ARTIFACT`."""

from __future__ import annotations

import json

import numpy as np
import pytest

import toy_passes
from qcompile.frontend.checkpoint import Checkpoint
from qcompile.ir.importer import build_graph
from qcompile.ir.ops.core import Param, Slice, Transpose
from qcompile.ir.ops.moe import GroupedMatmul
from qcompile.ir.parser import parse_graph
from qcompile.ir.verifier import verify
from qcompile.ir.weights import PREPARED_PREFIX, fold_weight_preparation, load_params, prepared_names
from qcompile.passes import registry
from qcompile.passes.base import PassContext
from qcompile.passes.equivalence import EquivalenceChecker
from test_cli import cli


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from conftest import write_small

    return write_small(tmp_path_factory.mktemp("weights") / "m", family="qwen3_5_moe", seed=4)


@pytest.fixture(scope="module")
def split(ckpt):
    """The unoptimized graph and the graph after the toy split-linear pass (slices of parameters)."""
    graph = build_graph(Checkpoint.open(ckpt))
    result = toy_passes.GOOD["split-linear"].run(graph, PassContext())
    assert result.changed
    return graph, result.graph


def test_unoptimized_graph_prepares_expert_weights_in_the_grouped_matmul_layout(split):
    """The importer writes the checkpoints' [E, Nout, K] expert weights as transposes to grouped_matmul's [E, K, Nout]:
    each folds into one prepared parameter; a graph with nothing left to fold comes back as the same object."""
    graph, _ = split
    transposes = graph.find(Transpose)
    assert len(transposes) == len(graph.find(GroupedMatmul)) > 0
    folded = fold_weight_preparation(graph)
    assert not folded.find(Transpose) and len(prepared_names(folded)) == len(transposes)
    assert fold_weight_preparation(folded) is folded


def test_params_only_values_become_prepared_params(split):
    _, optimized = split
    folded = fold_weight_preparation(optimized)
    verify(folded)
    def weight_slices(g):
        return [n for n in g.find(Slice) if isinstance(g.node(n.operands[0].node).op, Param)]

    assert weight_slices(optimized) and not weight_slices(folded)  # every slice of a weight was folded
    names = prepared_names(folded)
    assert names and all(name.startswith(PREPARED_PREFIX) for name in names)
    assert len(names) == len(weight_slices(optimized)) + len(optimized.find(Transpose))
    for name in names:  # each recipe is IR text naming only checkpoint parameters
        recipe = parse_graph(folded.meta["prepared"][name])
        assert all(not n.op.name.startswith(PREPARED_PREFIX) for n in recipe.find(Param))
        assert [n.op.op_name for n in recipe.nodes()] in (["param", "slice"], ["param", "transpose"])
    assert fold_weight_preparation(folded) is folded  # idempotent


def test_folded_graph_computes_the_same_function(ckpt, split):
    graph, optimized = split
    folded = fold_weight_preparation(optimized)
    checkpoint = Checkpoint.open(ckpt)
    raw = load_params(checkpoint, graph, progress=False)
    prepared = load_params(checkpoint, folded, progress=False, loaded=raw)
    assert set(prepared) == {n.op.name for n in folded.find(Param)}
    checker = EquivalenceChecker(graph, raw)
    a = checker.outputs(optimized, "reference")
    from qcompile.passes.equivalence import outputs_by_item, run_graph

    b = outputs_by_item(checker.comparable(folded, run_graph(folded, prepared, checker.caches, checker.batch)),
                        checker.rows)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)  # slices folded ahead of time: bitwise equal


def test_load_params_reads_recipe_inputs_only(ckpt, split, monkeypatch):
    _, optimized = split
    folded = fold_weight_preparation(optimized)
    checkpoint = Checkpoint.open(ckpt)
    reads: list[str] = []
    real = Checkpoint.load
    monkeypatch.setattr(Checkpoint, "load", lambda self, name, raw=False: (reads.append(name), real(self, name, raw))[1])
    load_params(checkpoint, folded, progress=False)
    wanted = {n.op.name for n in folded.find(Param) if not n.op.name.startswith(PREPARED_PREFIX)}
    for name in prepared_names(folded):
        wanted |= {n.op.name for n in parse_graph(folded.meta["prepared"][name]).find(Param)}
    assert set(reads) == wanted and all(not r.startswith(PREPARED_PREFIX) for r in reads)


@pytest.mark.slow
def test_artifact_stores_prepared_weights_and_run_prepares_nothing(ckpt, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(registry, "PASSES", {"split-linear": toy_passes.GOOD["split-linear"]})
    out = tmp_path / "art"
    code, _, err = cli(capsys, "--passes", "split-linear", str(ckpt), "-o", str(out), "--max-seqs", "2",
                       "--max-context", "32", "--max-step-tokens", "8")
    assert code == 0, err
    manifest = json.loads((out / "manifest.json").read_text())
    prepared = manifest["prepared_weights"]
    assert prepared and all(k.startswith(PREPARED_PREFIX) for k in prepared)
    from qcompile.frontend.safetensors_io import SafetensorsFile

    stored = set(SafetensorsFile(out / "weights.safetensors").tensors)
    assert set(prepared) <= stored

    import qcompile.ir.weights as weights

    def no_preparation(*args, **kwargs):
        raise AssertionError("run ARTIFACT must not prepare weights")

    monkeypatch.setattr(weights, "_evaluate", no_preparation)
    code, from_artifact, err = cli(capsys, "run", str(out), "--prompt-ids", "5,6,7,8", "--max-new-tokens", "4",
                                   "--ignore-eos")
    assert code == 0, err
    monkeypatch.undo()
    code, from_checkpoint, err = cli(capsys, "run", str(ckpt), "--prompt-ids", "5,6,7,8", "--max-new-tokens", "4",
                                     "--ignore-eos")
    assert code == 0, err
    assert from_artifact.strip() == from_checkpoint.strip()


def test_the_checker_prepares_each_graphs_weights_once(ckpt, monkeypatch):
    """The checker folds a graph's weight preparation and computes it once, not in every step it runs (the drift
    decode of a fused bench-preset graph took 527 s of a 564 s compile that way; 50 s now): each recipe evaluated once
    over a 6-step drift of two graphs that share their recipes, outputs bitwise those of the unfolded step, and only
    the last two graphs' prepared weights kept."""
    from qcompile.ir import weights
    from qcompile.passes.equivalence import outputs_by_item, run_graph
    from qcompile.passes.gdn_conv_fusion import GDN_CONV_FUSION
    from qcompile.passes.swiglu_fusion import SWIGLU_FUSION

    from qcompile.passes import equivalence

    monkeypatch.setattr(equivalence, "FOLD_MIN_BYTES", 0)  # a tiny model's weights, folded as a large model's are
    checkpoint = Checkpoint.open(ckpt)
    graph = build_graph(checkpoint)
    checker = EquivalenceChecker(graph, load_params(checkpoint, graph, progress=False), target="cpu")
    fused = SWIGLU_FUSION.run(graph, PassContext()).graph
    both = GDN_CONV_FUSION.run(fused, PassContext()).graph
    evaluated = []
    real = weights._evaluate
    monkeypatch.setattr(weights, "_evaluate", lambda text, read: evaluated.append(text) or real(text, read))
    had = set(checker.prepared.arrays)  # the unoptimized graph's, prepared for the warm-up (panels, attention)
    checker.drift(both, 6, against=fused)
    names = set(prepared_names(fold_weight_preparation(fused, "cpu")))
    assert names == set(prepared_names(fold_weight_preparation(both, "cpu")))  # same weights, shared recipes
    assert len(evaluated) == len(set(evaluated)) == len(names - had) > 0  # once each, not per step or per graph
    plain = outputs_by_item(checker.comparable(both, run_graph(both, checker.params, checker.caches, checker.batch,
                                                               "cpu")), checker.rows)
    folded = checker.outputs(both, "cpu")
    for key in plain:
        np.testing.assert_array_equal(plain[key], folded[key], err_msg=key)
    checker.outputs(graph, "cpu")  # a third set of recipes: the first graph's are dropped
    assert set(checker.prepared.arrays) <= names | set(prepared_names(fold_weight_preparation(graph, "cpu")))
    assert set(checker.prepared.arrays) != names
