"""Reference lowering: a Graph becomes one JAX function `fn(params, inputs) -> outputs` built from the ops' jnp rules.

The function is pure and traceable: the runtime jits it (donating the cache inputs) and `jax.export` can serialise
it. Weights are arguments, not constants, so one compiled executable serves any checkpoint of the same shape.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from qcompile.errors import QCompileError
from qcompile.ir.graph import Graph, Value
from qcompile.ir.ops.core import Input, Param
from qcompile.ir.printer import describe_node
from qcompile.ir.registry import LOCAL_FORMS, LOWERINGS, lowering_rule, takes_quantized
from qcompile.kernels.fp8 import QuantizedWeight, materialized


class LoweringError(QCompileError):
    """An op could not be lowered (operands that do not fit its rule); names the op in the graph's text form.

    Exit code 4, like a verification failure: the graph is malformed for that op's rule (a pass, the importer or a
    hand-written graph built it wrong), not the user's input. The message says what to do about it.
    """

    exit_code = 4
    HINT = ("the graph does not fit this op's lowering rule; compile with --verify each to find the pass that "
            "produced it, and report this op (a qcompile bug)")

    def __str__(self) -> str:
        text = super().__str__()
        return text if self.HINT in text else f"{text} — {self.HINT}"


#: jax.default_backend() -> lowering target of this host.
_HOST_TARGETS = {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}


def host_target() -> str:
    """The lowering target of the platform this process runs on (the reference rules for an unknown platform)."""
    import jax

    return _HOST_TARGETS.get(jax.default_backend(), "reference")


def lower(graph: Graph, target: str = "reference", taps: dict[str, Value] | None = None) -> Callable[[dict, dict], dict]:
    """`fn(params, inputs) -> outputs` with each op lowered by `target`'s rule (the reference rule where it has none).

    `taps` names extra values to return beside the graph's outputs (e.g. the router's choices, for the roofline).
    FP8 weights' layout ops are first applied to their values and scales (ir/fp8_layout.py), so each dequantize
    meets its matmul as it will once weight preparation is folded (a folded graph is unchanged by this; taps name
    values of a folded graph).
    """
    if not taps:
        from qcompile.ir.fp8_layout import sink_dequantize

        graph = sink_dequantize(graph)
    nodes = list(graph.nodes())
    rules = _rules(graph, nodes, target)
    outputs = {**graph.outputs, **(taps or {})}

    def step(params: dict, inputs: dict) -> dict:
        env: dict[Value, object] = {}
        _evaluate(graph, nodes, rules, env, params, inputs)
        return {name: materialized(env[value]) for name, value in outputs.items()}

    return step


def _rules(graph: Graph, nodes, target: str) -> dict:
    """op class -> its rule for `target`; a rule that does not take deferred FP8 weights (registry TAKES_QUANTIZED)
    is wrapped to receive them dequantized."""
    rules = {}
    for node in nodes:
        cls = type(node.op)
        if cls in rules or isinstance(node.op, (Input, Param)):
            continue
        rule = lowering_rule(cls, target)
        rules[cls] = rule if takes_quantized(cls, target) else _dequantizing(rule)
    return rules


def _dequantizing(rule):
    def run(op, *operands):
        if any(isinstance(x, QuantizedWeight) for x in operands):
            operands = [materialized(x) for x in operands]
        return rule(op, *operands)

    return run


def _evaluate(graph: Graph, nodes, rules: dict, env: dict, params: dict, inputs: dict, ops: dict | None = None) -> None:
    """Run `nodes` in order into `env` (values already in `env` are given); `ops` replaces a node's op (by id) —
    the local form of an op under shard_map."""
    for node in nodes:
        op = node.op
        if isinstance(op, Input):
            results = (inputs[op.name],)
        elif isinstance(op, Param):
            results = (params[op.name],)
        else:
            if ops is not None:
                op = ops.get(node.id, op)
            try:
                out = rules[type(op)](op, *(env[v] for v in node.operands))
            except Exception as err:
                raise LoweringError(f"while lowering {describe_node(graph, node)}: {err}") from err
            results = out if isinstance(out, tuple) else (out,)
        for value, result in zip(node.results, results):
            env[value] = result


def step_function(graph: Graph, target: str = "reference", with_logits: bool = True) -> Callable:
    """`fn(params, caches, batch) -> outputs`, the step ABI (ir/abi.py) of `graph` lowered for `target`.

    Without logits the step returns next_tokens and the caches only, so XLA need not materialise [R, V] floats as an
    output and the host receives R token ids.
    """
    lowered = lower_step(graph, target)

    def step(params, caches, batch):
        outputs = lowered(params, {**caches, **batch})
        if not with_logits:
            outputs.pop("logits", None)
        return outputs

    return step


def target_rules_used(graph: Graph, target: str) -> list[str]:
    """Names of the ops of `graph` that `target` lowers with a rule of its own (not the reference rule)."""
    if target == "reference":
        return []
    return sorted({node.op.op_name for node in graph.nodes() if (type(node.op), target) in LOWERINGS})


def lower_on_mesh(graph: Graph, target: str = "reference", devices=None) -> Callable[[dict, dict], dict]:
    """`fn(params, inputs) -> outputs` over the graph's mesh (meta["mesh"], ir/mesh.py): `lower(graph, target)` run
    inside `jax.shard_map`, each parameter, input and output laid out by its type's sharding (whole where it has
    none), so every op's rule sees one device's block and the collectives exchange blocks over the mesh axes.

    Weight preparation (the params-only part of the graph, ir/weights.py) runs before the shard_map, on whole
    weights: a preparation may move rows between devices' blocks (tensor parallelism permutes a fused projection's
    columns so each device's block holds its own heads), which no block-local computation could. Its results enter
    the shard_map laid out by their own types, as prepared weights do once folded. Inside, an op whose attributes
    name global sizes along a split dim gets its local form (`local_op`: a reshape's target shape).
    """
    import jax

    from qcompile.ir.fp8_layout import sink_dequantize
    from qcompile.ir.weights import params_only

    graph = sink_dequantize(graph)
    mesh = graph.meta.get("mesh")
    if mesh is None:
        raise QCompileError("the graph has no mesh (meta['mesh']); lower it with lower()")
    spec = lambda type_: mesh.partition_spec(type_.sharding)  # noqa: E731
    nodes = list(graph.nodes())
    rules = _rules(graph, nodes, target)
    pure = params_only(graph)
    prep_nodes = [n for n in nodes if n.id in pure or isinstance(n.op, Param)]
    step_nodes = [n for n in nodes if n.id not in pure and not isinstance(n.op, Param)]
    used = {v for n in step_nodes for v in n.operands} | set(graph.outputs.values())
    direct = {n.op.name: spec(n.op.type) for n in graph.find(Param) if n.results[0] in used}
    prepared = {f"%{v.node}.{v.index}": v for n in nodes if n.id in pure for v in n.results if v in used}
    param_specs = {**direct, **{key: spec(graph.type_of(v)) for key, v in prepared.items()}}
    input_specs = {node.op.name: spec(node.op.type) for node in graph.find(Input)}
    out_specs = {name: spec(graph.type_of(value)) for name, value in graph.outputs.items()}
    local_ops = {n.id: local for n in step_nodes if (local := local_op(n.op, n.types, mesh)) is not n.op}
    param_values = {n.results[0]: n.op.name for n in graph.find(Param)}

    def body(params: dict, inputs: dict) -> dict:
        env: dict[Value, object] = {v: params[key] for key, v in prepared.items()}
        env.update({v: params[name] for v, name in param_values.items() if name in params})
        _evaluate(graph, step_nodes, rules, env, params, inputs, local_ops)
        return {name: materialized(env[value]) for name, value in graph.outputs.items()}

    mapped = jax.shard_map(body, mesh=mesh.jax_mesh(devices), in_specs=(param_specs, input_specs),
                           out_specs=out_specs, check_vma=False)

    def step(params: dict, inputs: dict) -> dict:  # shard_map wants exactly the graph's names
        env: dict[Value, object] = {}
        if prepared:
            _evaluate(graph, prep_nodes, rules, env, params, inputs)
        args = {name: params[name] for name in direct}
        args.update({key: materialized(env[v]) for key, v in prepared.items()})
        return mapped(args, {name: inputs[name] for name in input_specs})

    return step


def local_op(op, result_types, mesh):
    """`op` as one device's blocks see it (the op's `LOCAL_FORMS` entry; the op itself when it has none)."""
    form = LOCAL_FORMS.get(type(op))
    return op if form is None else form(op, result_types, mesh)


def is_sharded(graph: Graph) -> bool:
    """Whether the graph is laid out over its mesh (a sharding pass gave the mesh its rules table)."""
    mesh = graph.meta.get("mesh")
    return mesh is not None and bool(mesh.rules)


def lower_step(graph: Graph, target: str = "reference", taps: dict[str, Value] | None = None):
    """`lower_on_mesh` for a sharded graph, `lower` otherwise: what every caller that runs a step graph uses."""
    if is_sharded(graph):
        if taps:
            raise QCompileError("taps are not supported on a sharded graph")
        return lower_on_mesh(graph, target)
    return lower(graph, target, taps)


def whole_view(array) -> np.ndarray:
    """A step output on the host, whole in every process (gathered from the others' blocks across processes)."""
    if getattr(array, "is_fully_addressable", True):
        return np.asarray(array)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def local_view(array) -> np.ndarray:
    """A step output on the host: the whole array when this process holds all of it; across processes
    (jax.distributed), a masked array holding this process's blocks and masking the rest — so each process compares
    only what it holds (no gather of other processes' KV pages)."""
    if getattr(array, "is_fully_addressable", True):
        return np.asarray(array)
    data = np.zeros(array.shape, array.dtype)
    hidden = np.ones(array.shape, bool)
    for shard in array.addressable_shards:
        data[shard.index] = np.asarray(shard.data)
        hidden[shard.index] = False
    return np.ma.MaskedArray(data, hidden)
