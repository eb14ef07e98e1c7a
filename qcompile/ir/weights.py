"""Weights of a step graph: compile-time weight preparation and reading parameters one tensor at a time.

Why: a pass or a target rule may want a weight in another layout — gate and up concatenated, transposed, cast,
padded to a block multiple, quantized, later sharded. It says so in the graph, as ordinary ops on `param`s. The part
of the graph that depends on parameters only is then evaluated once, not every step: `fold_weight_preparation`
replaces each params-only value that a step op consumes by a new `param` named `prepared.<hash>`, and records how to
compute it — a small graph in the IR's text form — in `graph.meta["prepared"]`. `load_params` is the one place
parameters are made: a plain name is read from the checkpoint, a prepared one is computed from its recipe, reading
only the tensors that recipe names. It runs at compile time for the artifact (which then stores the prepared
weights, so `run ARTIFACT` prepares nothing) and at load time for `run CHECKPOINT`; the checker, the artifact writer,
`bench` and `reproduce` all go through it. One tensor at a time: the host never holds more than one recipe's inputs
beyond the device copies, so preparing a 400 GB checkpoint never holds it in memory.

    before:  %3 = param "layers.0.mlp.gate_proj" : f32[56,96]
             %4 = param "layers.0.mlp.up_proj" : f32[56,96]
             %5 = concat(%3, %4) {axis=0} : f32[112,96]
             %9 = linear(%8, %5) : f32[T,112]
    after:   %5 = param "prepared.3f2a9c0e11b4" : f32[112,96]      meta["prepared"]["prepared.3f2a9c0e11b4"] =
             %9 = linear(%8, %5) : f32[T,112]                       the text of param, param, concat, return
"""

from __future__ import annotations

import hashlib
import math
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from qcompile.frontend.checkpoint import Checkpoint
from qcompile.ir.builder import Builder
from qcompile.ir.graph import Graph, Value
from qcompile.ir.ops.core import Input, Param
from qcompile.ir.types import TensorType, np_dtype

PREPARED_PREFIX = "prepared."
_RECIPE_OUTPUT = "value"


def params_only(graph: Graph) -> set[int]:
    """Ids of the non-leaf nodes whose inputs are all parameters (transitively), except the dequantizes of FP8
    weights that stay in the step (ir/fp8_layout.py `kept_dequantizes`: the weight stays FP8 in memory)."""
    from qcompile.ir.fp8_layout import kept_dequantizes

    kept = kept_dequantizes(graph)
    pure: set[int] = set()
    leaves: set[int] = set()
    for node in graph.nodes():
        if isinstance(node.op, Param):
            leaves.add(node.id)
        elif not isinstance(node.op, Input) and node.id not in kept and node.operands and all(
                v.node in pure or v.node in leaves for v in node.operands):
            pure.add(node.id)
    return pure


def _recipe(graph: Graph, value: Value) -> Graph:
    """The params-only subgraph computing `value`, as its own graph with one output."""
    needed: set[int] = set()
    stack = [value.node]
    while stack:
        node_id = stack.pop()
        if node_id not in needed:
            needed.add(node_id)
            stack.extend(v.node for v in graph.node(node_id).operands)
    b = Builder()
    mapping: dict[Value, Value] = {}
    for node in graph.nodes():
        if node.id not in needed:
            continue
        if isinstance(node.op, Param):
            new = (b.param(node.op.name, node.op.type),)
        else:
            out = b.add_typed(node.op, [mapping[v] for v in node.operands], node.types)
            new = out if isinstance(out, tuple) else (out,)
        mapping.update(zip(node.results, new))
    b.output(_RECIPE_OUTPUT, mapping[value])
    return b.build({})


def fold_weight_preparation(graph: Graph, target: str | None = None) -> Graph:
    """Replace every params-only value used by a step op with a prepared param (see the module docstring), after
    putting the weights in `target`'s layout (ir/target_layout.py; None: as the graph has them).

    Returns the same graph object when there is nothing to fold.
    """
    from qcompile.ir.fp8_layout import sink_dequantize
    from qcompile.ir.printer import print_graph
    from qcompile.ir.target_layout import in_target_layout

    graph = sink_dequantize(in_target_layout(graph, target))  # FP8 weights' layout changes on their values and scales: prepared FP8 stays FP8
    pure = params_only(graph)
    if not pure:
        return graph
    step_nodes = [n for n in graph.nodes() if n.id not in pure and not isinstance(n.op, Param)]
    used = {v for n in step_nodes for v in n.operands} | set(graph.outputs.values())
    recipes = dict(graph.meta.get("prepared", {}))
    b = Builder()
    mapping: dict[Value, Value] = {}
    for node in graph.nodes():
        if node.id in pure:
            for value in node.results:
                if value in used:
                    text = print_graph(_recipe(graph, value), "recipe")
                    name = PREPARED_PREFIX + hashlib.sha256(text.encode()).hexdigest()[:12]
                    recipes[name] = text
                    mapping[value] = b.param(name, graph.type_of(value))
        elif isinstance(node.op, Param):
            if any(v in used for v in node.results):
                mapping[node.results[0]] = b.param(node.op.name, node.op.type)
        elif isinstance(node.op, Input):
            mapping[node.results[0]] = b.input(node.op.name, node.op.type)
        else:
            out = b.add_typed(node.op, [mapping[v] for v in node.operands], node.types)
            mapping.update(zip(node.results, out if isinstance(out, tuple) else (out,)))
    for name, value in graph.outputs.items():
        b.output(name, mapping[value])
    return b.build({**graph.meta, "prepared": recipes})


def prepared_names(graph: Graph) -> list[str]:
    return [n.op.name for n in graph.find(Param) if n.op.name in graph.meta.get("prepared", {})]


_EVALUATORS: dict[str, object] = {}


def _evaluate(recipe_text: str, read) -> object:
    """Compute a prepared weight from its recipe, reading each parameter it names with `read(name, type)`."""
    from qcompile.ir.lowering import lower
    from qcompile.ir.parser import parse_graph

    recipe = parse_graph(recipe_text, "<prepared weight recipe>")
    names = [n.op.name for n in recipe.find(Param)]
    inputs = [read(n.op.name, n.op.type) for n in recipe.find(Param)]
    # Recipes that differ only in the parameters they name (the same layout change in every layer) share one
    # compiled function.
    counter = iter(range(len(names) + 1))
    shape_key = re.sub(r'param "(?:[^"\\]|\\.)*"', lambda _: f'param "arg{next(counter)}"', recipe_text)
    fn = _EVALUATORS.get(shape_key)
    if fn is None:
        lowered = lower(recipe)
        fn = _EVALUATORS[shape_key] = jax.jit(
            lambda args: lowered(dict(zip(names, args)), {})[_RECIPE_OUTPUT])
    return fn(inputs)


def prepare_from(graph: Graph, params: dict, have: dict) -> dict:
    """The weights a folded `graph` names, from `params` (the arrays of the graph it was folded from): plain names
    as they are, prepared names from `have` or computed from their recipe (and added to `have`, the caller's cache:
    a prepared name is its recipe's hash, so graphs sharing a recipe share the array)."""
    recipes = graph.meta.get("prepared", {})
    out = {}
    for node in graph.find(Param):
        name = node.op.name
        if name in params:
            out[name] = params[name]
        else:
            if name not in have:
                have[name] = _evaluate(recipes[name], lambda source, _type: params[source])
            out[name] = have[name]
    return out


#: Largest piece `weight_pieces` makes at once: what bounds the host memory of streaming a checkpoint.
PIECE_BYTES = 32 << 20
#: Recipe ops that act on every row (axis 0) independently, so a recipe made of them can be evaluated a slab of rows
#: at a time from the same rows of its inputs.
_ROW_WISE = ("Concat", "Cast", "Slice", "Transpose")


def param_types(graph: Graph) -> dict[str, TensorType]:
    """Every parameter the graph names, with its type, in graph order: the weights' shapes and dtypes, known without
    reading a byte (what an export needs)."""
    return {node.op.name: node.op.type for node in graph.find(Param)}


def _row_factor(recipe: Graph, rows: int) -> int | None:
    """Source rows per row of the prepared weight when its recipe is row-wise — row slab [a, b) of the result is
    computed from rows [a·f, b·f) of every source — else None. f = 1 but for one reshape that splits axis 0 into
    [rows, f, ...] (a weight cut into column panels, ir/target_layout.py). A reshape that keeps axis 0 and regroups
    the others (experts [E, K, Nout] cut into [E, K, Nout/64, 64] panels, panels regrouped into pair order) is
    row-wise with f = 1 in a recipe without a splitting one, and after the split (axis 0 is then the result's)."""
    factor, keeps_rows = 1, False
    for node in recipe.nodes():
        op = node.op
        if isinstance(op, Param):
            if not op.type.shape:
                return None
        elif type(op).__name__ == "Reshape":
            source = recipe.type_of(node.operands[0]).shape
            shape = node.types[0].shape
            if shape and source and shape[0] == source[0]:  # row-wise; before a split it must stay the only kind
                keeps_rows = keeps_rows or factor == 1
                continue
            if factor != 1 or keeps_rows or len(shape) != len(source) + 1 or shape[0] * shape[1] != source[0] \
                    or tuple(shape[2:]) != tuple(source[1:]):
                return None
            factor = shape[1]
        elif type(op).__name__ not in _ROW_WISE:
            return None
        elif hasattr(op, "axis") and op.axis % len(node.types[0].shape) == 0:
            return None
        elif hasattr(op, "perm") and tuple(op.perm)[0] != 0:
            return None
    if any(n.op.type.shape[0] != rows * factor for n in recipe.find(Param)):
        return None
    return factor


def _slab_recipe(recipe: Graph, rows: int, factor: int) -> str:
    """The text of a row-wise recipe with a reshape for a slab of `rows` result rows: its sources `rows`·factor rows
    long and the reshape's leading size `rows` (the other ops' attributes do not name axis 0)."""
    from qcompile.ir.ops.core import Reshape
    from qcompile.ir.printer import print_graph

    b = Builder()
    mapping: dict[Value, Value] = {}
    for node in recipe.nodes():
        op = node.op
        if isinstance(op, Param):
            new = b.param(op.name, op.type.with_shape((rows * factor, *op.type.shape[1:])))
        elif isinstance(op, Reshape):
            new = b.add(Reshape((rows, *op.shape[1:])), mapping[node.operands[0]])
        else:
            new = b.add(op, *[mapping[v] for v in node.operands])
        mapping[node.results[0]] = new
    for out, v in recipe.outputs.items():
        b.output(out, mapping[v])
    return print_graph(b.build(recipe.meta), "recipe")


def weight_pieces(checkpoint: Checkpoint, graph: Graph, name: str, piece_bytes: int | None = None):
    """Parameter `name` of `graph` as host arrays, in consecutive slabs along axis 0 of at most `piece_bytes` each
    (one piece for a scalar or a recipe that is not row-wise). A plain parameter is read from the checkpoint and cast
    per slab (a zero-copy view of the mapped file when no cast is needed); a prepared one is computed per slab from the
    same rows of its recipe's inputs. Each slab's source pages are dropped from the process once it is consumed, so
    streaming a whole checkpoint through this keeps the resident set at about one slab, whatever the model's size."""
    type_ = param_types(graph)[name]
    dtype = np_dtype(type_.dtype)
    recipe_text = graph.meta.get("prepared", {}).get(name)
    piece_bytes = PIECE_BYTES if piece_bytes is None else piece_bytes
    rows = type_.shape[0] if type_.shape else 0
    row_bytes = math.prod(type_.shape[1:]) * np.dtype(dtype).itemsize
    step = max(1, piece_bytes // max(1, row_bytes))
    raw = type_.dtype == "f8e4m3"  # a weight kept in FP8: its values, not multiplied out
    if recipe_text is None:
        if not rows:
            yield np.asarray(checkpoint.load(name, raw)).astype(dtype)
            return
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            yield checkpoint.load_rows(name, start, stop, raw).astype(dtype, copy=False)
            checkpoint.release_rows(name, start, stop)
        return
    from qcompile.ir.parser import parse_graph

    recipe = parse_graph(recipe_text, "<prepared weight recipe>")
    sources = [(n.op.name, np_dtype(n.op.type.dtype)) for n in recipe.find(Param)]
    fp8 = {n.op.name for n in recipe.find(Param) if n.op.type.dtype == "f8e4m3"}
    factor = _row_factor(recipe, rows) if rows else None
    if factor is None:
        def read(source: str, source_type):
            return jnp.asarray(checkpoint.load(source, source in fp8).astype(np_dtype(source_type.dtype)))

        yield np.asarray(_evaluate(recipe_text, read))
        for source, _ in sources:
            if source in checkpoint.params:  # (a scale has no mapped rows to drop)
                checkpoint.release_rows(source, 0, checkpoint.params[source].shape[0])
        return
    reshaped = any(type(n.op).__name__ == "Reshape" for n in recipe.nodes())  # (sizes naming axis 0: per slab)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        first, last = start * factor, stop * factor
        piece = {source: checkpoint.load_rows(source, first, last, source in fp8).astype(d, copy=False)
                 for source, d in sources}
        text = _slab_recipe(recipe, stop - start, factor) if reshaped else recipe_text
        yield np.asarray(_evaluate(text, lambda source, _type: piece[source]))
        for source, _ in sources:
            checkpoint.release_rows(source, first, last)


def to_device(host: np.ndarray) -> tuple[jax.Array, bool]:
    """`host` on the default device, and whether the device array aliases `host`'s memory instead of copying it.

    On CPU, `jax.device_put` of a read-only, C-contiguous host array that starts on a 64-byte boundary maps it without
    a copy (measured with jax 0.10, benchmarks/memory.py: a 1 GiB memory-mapped tensor placed in 10 ms with no growth
    of the resident set, against 725 ms and 2 GiB resident to copy it; 8-, 16- and 32-byte-aligned and transposed
    views are copied). So a weight whose bytes lie aligned in a memory-mapped checkpoint or artifact is held once — as
    the file's pages, shared with the page cache and with any other process serving the same file — and the file must
    not be modified while the model runs. `jnp.asarray` always copies."""
    array = jax.block_until_ready(jax.device_put(host, may_alias=True))
    try:
        aliased = host.nbytes > 0 and array.unsafe_buffer_pointer() == host.ctypes.data
    except (AttributeError, NotImplementedError, RuntimeError, ValueError):  # not a single local buffer
        aliased = False
    return array, aliased


def load_params(checkpoint: Checkpoint, graph: Graph, progress: bool | None = None, loaded: dict | None = None) -> dict:
    """Every parameter the graph names, on the default device, made one tensor at a time: plain names read from the
    checkpoint and cast to the graph's dtype (or taken from `loaded`, arrays already made for another graph of the
    same checkpoint); prepared names computed from their recipe. A plain name whose checkpoint bytes need no cast and
    are aligned is used in place (`to_device`); any other is copied once and its mapped pages dropped."""
    nodes = graph.find(Param)
    recipes = graph.meta.get("prepared", {})
    show = sys.stderr.isatty() if progress is None else progress

    def read(name: str, type_, kept: bool = True):
        """The device array of plain parameter `name`; `kept`: it stays (a recipe's input is dropped after use)."""
        have = (loaded or {}).get(name)
        if have is not None and tuple(have.shape) == tuple(type_.shape) and have.dtype == np_dtype(type_.dtype):
            return have
        source = checkpoint.load(name, type_.dtype == "f8e4m3")  # FP8 kept: the values, not multiplied out
        want = np_dtype(type_.dtype)
        host = source if source.dtype == want else source.astype(want)
        array, aliased = to_device(host)
        rows = type_.shape[0] if type_.shape else 1
        if not kept:
            used.append((name, rows))
        elif not (aliased and host is source and not source.flags.owndata):
            # Not used in place from the mapped file: drop the mapped pages it was read from, so the resident set
            # holds the weights once, not also every page of the checkpoint ever read.
            checkpoint.release_rows(name, 0, rows)
        return array

    params = {}
    used: list[tuple[str, int]] = []  # a recipe's inputs, whose mapped pages are dropped once it is computed
    for node in tqdm(nodes, desc="loading weights", unit="tensor", disable=not show, file=sys.stderr):
        name = node.op.name
        if name in recipes:
            params[name] = jax.block_until_ready(
                _evaluate(recipes[name], lambda source, type_: read(source, type_, kept=False)))
            for source, rows in used:
                checkpoint.release_rows(source, 0, rows)
            used.clear()
        else:
            params[name] = read(name, node.op.type)
    return params
