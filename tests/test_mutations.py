"""Mutation test of the fidelity check: deliberately wrong graphs must FAIL it, the unmutated graph must PASS it.

Each mutation is a plausible implementation mistake, applied as a graph rewrite of op attributes or operands
(qcompile.passes.rewrite) of the unoptimized graph; the mutated graph is run by the engine and compared with
transformers by the fidelity tests' own check (test_fidelity.assert_close: max |error| ≤ 1e-4 × max(1, max |ref|),
on test_fidelity.PROMPT). A mutation that passes that check would be a mistake the suite cannot see.

RMSNorm eps (1e-5 for the config's 1e-6) is the hard one. On the default checkpoint (input embeddings of std 1, so
every norm input has a mean square ~1) it moves the logits by only 7.8e-5 relative and passes the 1e-4 bound, with
top-1 agreement 1.00: eps cannot matter where mean(x²) ≫ eps. Real Qwen checkpoints have small embeddings (entries
~±0.01–0.03, mean square 1e-4…1e-3), where it does. So the mutations run on such a checkpoint: hf_oracle's
embed_scale=0.01 (first-layer norm input mean square ~1e-4; eps then changes that norm by ~4 %), and there the eps
mistake fails the check by a factor of ~6000 while the correct graph stays 25× inside the bound. The bound itself is
unchanged: tightening it to catch eps on the default checkpoint would leave only ~2× between the worst correct
fidelity case (1.8e-5, next-tied-mqa-gva1) and the mistake (7.8e-5).

Measured (seed 0, f32, PROMPT; relative error = max |error| / max(1, max |ref|); the check fails above 1e-4):

  mutation (graph rewrite)                 small-embed, 2 layers   small-embed, 4 layers   default ckpt, 4 layers
  none (the correct graph)                 3.8e-6                  1.2e-5                  7.0e-6
  rmsnorm-eps-1e-5                         0.66                    0.97                    7.8e-5 (passes!)
  gated-rmsnorm-eps-1e-5                   0.68                    1.6                     0.90
  plain-norm-weight (w for 1+w)            1.07                    0.96                    0.99
  rope-theta-x2                            0.026                   0.018                   0.12
  topk-renormalisation-flipped             0.45                    0.97                    0.77
  gate-up-swapped (experts and shared)     0.74                    1.3                     0.87
  gdn-gate-sign (g ↦ −g)                   nan (state overflows)   nan                     nan
  gdn-no-dt-bias (softplus(a))             0.51                    0.95                    0.44

The test runs the first column (one GDN and one attention layer: half the compile time). On qwen3_next with
embed_scale 0.01 the correct graph measured 7.3e-5, too close to the bound to use as a test checkpoint.
"""

from __future__ import annotations

import attrs
import jax.numpy as jnp
import numpy as np
import pytest

import hf_oracle
from qcompile.ir.ops.attention import Rope
from qcompile.ir.ops.core import Linear, Mul, Param, RmsNorm
from qcompile.ir.ops.gdn import GatedRmsNorm, GdnGates
from qcompile.ir.ops.moe import GroupedMatmul, RouterTopK
from qcompile.ir.types import TensorType
from qcompile.passes.rewrite import rewrite
from test_fidelity import PROMPT, assert_close, prompt_logits

# One GDN layer then one attention layer (half the compile time of the default four), input embeddings ×0.01.
SMALL_EMBED = dict(embed_scale=0.01, overrides={"num_hidden_layers": 2, "full_attention_interval": 2})


def _evolve(graph, params, cls, **changes):
    """Every op of `cls` with its attributes changed (a callable value maps the old op to the new value)."""
    def rule(b, node, ops):
        if type(node.op) is cls:
            new = {k: v(node.op) if callable(v) else v for k, v in changes.items()}
            return b.add(attrs.evolve(node.op, **new), *ops)
        return None

    new, count = rewrite(graph, rule)
    assert count > 0, f"no {cls.__name__} to mutate"
    return new, params


def _param_types(graph) -> dict[str, TensorType]:
    return {node.op.name: node.op.type for node in graph.find(Param)}


def _is_param(b, value, suffix: str) -> str | None:
    op = b._dag.nodes[value.node]["node"].op
    return op.name if isinstance(op, Param) and op.name.endswith(suffix) else None


def _swap_gate_up(graph, params):
    """SwiGLU as silu(up)·gate: the gate and up weights of every expert and shared expert change places."""
    types = _param_types(graph)

    def rule(b, node, ops):
        if not isinstance(node.op, (GroupedMatmul, Linear)):
            return None
        for this, other in (("gate_proj", "up_proj"), ("up_proj", "gate_proj")):
            name = _is_param(b, ops[1], this)
            if name:
                swapped = name[: -len(this)] + other
                return b.add(node.op, ops[0], b.param(swapped, types[swapped]), *ops[2:])
        return None

    new, count = rewrite(graph, rule)
    assert count >= 4, count
    return new, params


def _gdn_gate_extra(graph, params, make):
    """Rewrite every gdn_gates node with `make(b, node, ops, const, hv) -> (g, beta)`; `const(name, value, shape)`
    is a constant f32 tensor, passed to the graph as an extra parameter."""
    extra = {}

    def const(b, name, value, shape):
        extra[name] = np.full(shape, value, np.float32)
        return b.param(name, TensorType("f32", shape))

    def rule(b, node, ops):
        if isinstance(node.op, GdnGates):
            hv = node.types[0].shape[-1]
            return make(b, node, ops, lambda name, value, shape: const(b, name, value, shape), hv)
        return None

    new, count = rewrite(graph, rule)
    assert count > 0
    return new, {**params, **{k: jnp.asarray(v) for k, v in extra.items()}}


def _gdn_gate_sign(graph, params):
    """g = +exp(A_log)·softplus(a + dt_bias): the log-decay with the wrong sign (a growth instead of a decay)."""
    def make(b, node, ops, const, hv):
        g, beta = b.add(node.op, *ops)
        return b.add(Mul(), g, const("mutation.minus_one", -1.0, (1, hv))), beta

    return _gdn_gate_extra(graph, params, make)


def _gdn_no_dt_bias(graph, params):
    """g = -exp(A_log)·softplus(a): dt_bias left out."""
    def make(b, node, ops, const, hv):
        return b.add(node.op, ops[0], ops[1], ops[2], const("mutation.zero_dt_bias", 0.0, (hv,)))

    return _gdn_gate_extra(graph, params, make)


MUTATIONS = {
    "rmsnorm-eps-1e-5": lambda g, p: _evolve(g, p, RmsNorm, eps=1e-5),
    "gated-rmsnorm-eps-1e-5": lambda g, p: _evolve(g, p, GatedRmsNorm, eps=1e-5),
    "plain-norm-weight": lambda g, p: _evolve(g, p, RmsNorm, zero_centered=False),
    "rope-theta-x2": lambda g, p: _evolve(g, p, Rope, theta=lambda op: 2 * op.theta),
    "topk-renormalisation-flipped": lambda g, p: _evolve(g, p, RouterTopK, renormalize=lambda op: not op.renormalize),
    "gate-up-swapped": _swap_gate_up,
    "gdn-gate-sign": _gdn_gate_sign,
    "gdn-no-dt-bias": _gdn_no_dt_bias,
}


@pytest.fixture(scope="module")
def small_embed(hf_checkpoint, qc_model):
    path = hf_checkpoint("qwen3_5_moe", "small-embed-2layer", **SMALL_EMBED)
    return qc_model(path), hf_oracle.hf_logits(path, PROMPT)


def _relative_error(ours, ref) -> float:
    return float(np.abs(ours - ref).max() / max(1.0, float(np.abs(ref).max())))


def test_unmutated_graph_passes_the_fidelity_check(small_embed):
    model, ref = small_embed
    ours = prompt_logits(model, PROMPT)
    print(f"unmutated: relative error {_relative_error(ours, ref):.3g}")
    assert_close(ours, ref, "unmutated small-embed prompt logits")


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_mutation_fails_the_fidelity_check(mutation, small_embed):
    model, ref = small_embed
    graph, params = MUTATIONS[mutation](model.graph, model.params)
    assert graph is not model.graph
    ours = prompt_logits(attrs.evolve(model, graph=graph, params=params), PROMPT)
    print(f"{mutation}: relative error {_relative_error(ours, ref):.3g}")
    with pytest.raises(AssertionError):
        assert_close(ours, ref, f"{mutation} prompt logits")
