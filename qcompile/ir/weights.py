"""Weights of a step graph: reading the parameters a graph names from a checkpoint, one tensor at a time.

`load_params` is the one way a checkpoint's tensors become the arrays a step program takes: each `param` op of the
graph is read (memory-mapped, converted to the graph's dtype) and placed on the default device before the next one
is read, so the host never holds more than one converted tensor beyond the device copies.
"""

from __future__ import annotations

import sys

import jax.numpy as jnp
from tqdm import tqdm

from qcompile.frontend.checkpoint import Checkpoint
from qcompile.ir.graph import Graph
from qcompile.ir.ops.core import Param
from qcompile.ir.types import np_dtype


def load_params(checkpoint: Checkpoint, graph: Graph, progress: bool | None = None) -> dict:
    """Read every parameter the graph names, cast to its dtype, onto the default device (one tensor at a time)."""
    nodes = graph.find(Param)
    show = sys.stderr.isatty() if progress is None else progress
    params = {}
    for node in tqdm(nodes, desc="loading weights", unit="tensor", disable=not show, file=sys.stderr):
        params[node.op.name] = jnp.asarray(checkpoint.load(node.op.name).astype(np_dtype(node.op.type.dtype)))
    return params
