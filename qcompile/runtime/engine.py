"""Engine: runs a step graph over paged caches — sequence slots, page allocation, shape buckets, greedy decoding.

Each `step` packs the scheduled sequences' new tokens into one ragged batch (prefill chunks and decode tokens mixed
freely), pads it to a power-of-two token bucket, and calls the jitted step function with the caches donated so they
are updated in place. A sequence owns one GDN state slot (zeroed when it is admitted) and KV pages allocated as it
grows. The scheduler proper (continuous batching policies) is a later layer on top of `step`.
"""

from __future__ import annotations

import functools
import math
import weakref
import attrs
import jax
import jax.numpy as jnp
import numpy as np

from qcompile.errors import UsageError
from qcompile.ir.graph import Graph
from qcompile.ir.lowering import lower
from qcompile.ir.ops.core import Input
from qcompile.ir.types import np_dtype

BATCH_INPUTS = ("token_ids", "positions", "query_start", "page_table", "state_slots", "logits_indices")


@attrs.frozen
class CacheConfig:
    max_seqs: int = 4  # B: sequence slots per step
    max_context: int = 512  # longest sequence (prompt + generated) in tokens
    num_pages: int | None = None  # P: KV pages in the pool (default: enough for max_seqs full sequences)

    def pages_per_seq(self, page_size: int) -> int:
        return math.ceil(self.max_context / page_size)

    def pool_pages(self, page_size: int) -> int:
        return self.num_pages or self.max_seqs * self.pages_per_seq(page_size)


@attrs.define
class Sequence:
    slot: int
    pages: list[int] = attrs.Factory(list)
    length: int = 0  # tokens already in the cache


_JITTED: "weakref.WeakKeyDictionary[Graph, object]" = weakref.WeakKeyDictionary()


def jitted_step(graph: Graph):
    """The graph's step function, jitted once per graph (engines of one graph share its compiled buckets).

    Signature: (params, caches, batch) -> outputs; the caches argument is donated so updates happen in place.
    """
    if graph not in _JITTED:
        lowered = lower(graph)
        _JITTED[graph] = jax.jit(lambda params, caches, batch: lowered(params, {**caches, **batch}),
                                 donate_argnums=(1,))
    return _JITTED[graph]


@functools.partial(jax.jit, donate_argnums=(0,))
def _reset_slot(caches, slot):
    """Zero one sequence slot of every GDN state cache (a new sequence starts from empty state)."""
    return {name: (arr.at[slot].set(0) if name.endswith("_state") else arr) for name, arr in caches.items()}


def token_bucket(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class Engine:
    def __init__(self, graph: Graph, params: dict, cache: CacheConfig = CacheConfig()):
        self.graph = graph
        self.params = params
        self.cache_cfg = cache
        self.page_size = int(graph.meta["page_size"])
        self.pages_per_seq = cache.pages_per_seq(self.page_size)
        self.sizes = {"B": cache.max_seqs, "M": self.pages_per_seq, "P": cache.pool_pages(self.page_size),
                      "S": cache.max_seqs}
        self.cache_names = list(graph.meta["caches"])
        self.caches = {name: self._zeros(name) for name in self.cache_names}
        self._step = jitted_step(graph)
        self._reset = _reset_slot
        self.free_slots = list(range(cache.max_seqs))
        self.free_pages = list(range(self.sizes["P"]))

    def _input_type(self, name: str):
        for node in self.graph.find(Input):
            if node.op.name == name:
                return node.op.type
        raise KeyError(name)

    def _zeros(self, name: str):
        type_ = self._input_type(name)
        return jnp.zeros(type_.bind(self.sizes), np_dtype(type_.dtype))

    # -- sequences -------------------------------------------------------------------------------------------------

    def add_sequence(self) -> Sequence:
        if not self.free_slots:
            raise UsageError(f"all {self.cache_cfg.max_seqs} sequence slots are in use; raise --max-seqs")
        seq = Sequence(self.free_slots.pop(0))
        self.caches = self._reset(self.caches, jnp.int32(seq.slot))
        return seq

    def release(self, seq: Sequence) -> None:
        self.free_pages.extend(seq.pages)
        self.free_slots.append(seq.slot)
        seq.pages, seq.length = [], 0

    def _reserve(self, seq: Sequence, new_tokens: int) -> None:
        total = seq.length + new_tokens
        if total > self.cache_cfg.max_context:
            raise UsageError(f"sequence of {total} tokens exceeds max context {self.cache_cfg.max_context}")
        need = math.ceil(total / self.page_size) - len(seq.pages)
        if need > len(self.free_pages):
            raise UsageError("KV page pool exhausted; raise the page budget")
        seq.pages.extend(self.free_pages[:need])
        del self.free_pages[:need]

    # -- one step --------------------------------------------------------------------------------------------------

    def step(self, work: list[tuple[Sequence, list[int]]], all_logits: bool = False) -> list[np.ndarray]:
        """Run one ragged step. Returns, per work item, logits [n, V] (all_logits) or [V] for its last token."""
        if len(work) > self.cache_cfg.max_seqs:
            raise UsageError(f"{len(work)} sequences in one step; at most {self.cache_cfg.max_seqs}")
        total = sum(len(tokens) for _, tokens in work)
        num_tokens = token_bucket(max(total, 1))
        rows = num_tokens if all_logits else self.cache_cfg.max_seqs
        batch = self._pack(work, num_tokens, rows, all_logits)
        outputs = self._step(self.params, self.caches, batch)
        self.caches = {name: outputs[name] for name in self.cache_names}
        logits = np.asarray(outputs["logits"])
        result, start = [], 0
        for index, (seq, tokens) in enumerate(work):
            seq.length += len(tokens)
            if all_logits:
                result.append(logits[start:start + len(tokens)])
            else:
                result.append(logits[index])
            start += len(tokens)
        return result

    def _pack(self, work, num_tokens: int, rows: int, all_logits: bool) -> dict:
        max_seqs = self.cache_cfg.max_seqs
        token_ids = np.zeros(num_tokens, np.int32)
        positions = np.zeros(num_tokens, np.int32)
        query_start = np.zeros(max_seqs + 1, np.int32)
        page_table = np.zeros((max_seqs, self.pages_per_seq), np.int32)
        state_slots = np.full(max_seqs, max_seqs, np.int32)  # unused rows: out-of-range slot, never touched
        logits_indices = np.zeros(rows, np.int32)
        start = 0
        for index, (seq, tokens) in enumerate(work):
            self._reserve(seq, len(tokens))
            n = len(tokens)
            token_ids[start:start + n] = tokens
            positions[start:start + n] = np.arange(seq.length, seq.length + n)
            page_table[index, :len(seq.pages)] = seq.pages
            state_slots[index] = seq.slot
            if not all_logits:
                logits_indices[index] = start + n - 1
            start += n
            query_start[index + 1:] = start
        if all_logits:
            logits_indices[:] = np.arange(rows)
        return {"token_ids": token_ids, "positions": positions, "query_start": query_start,
                "page_table": page_table, "state_slots": state_slots, "logits_indices": logits_indices}

    # -- generation ------------------------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], max_new_tokens: int, prompt_logits: bool = False,
                 progress=None) -> dict:
        """Greedy decoding of several prompts together: one prefill step, then one decode step per token."""
        seqs = [self.add_sequence() for _ in prompts]
        try:
            first = self.step(list(zip(seqs, prompts)), all_logits=prompt_logits)
            last = [x[-1] for x in first] if prompt_logits else first
            tokens = [[int(np.argmax(x))] for x in last]
            step_logits = [[x] for x in last]
            for _ in range(max_new_tokens - 1):
                out = self.step([(s, [t[-1]]) for s, t in zip(seqs, tokens)])
                for t, lg, x in zip(tokens, step_logits, out):
                    t.append(int(np.argmax(x)))
                    lg.append(x)
                if progress:
                    progress()
        finally:
            for seq in seqs:
                self.release(seq)
        result = {"tokens": [t[:max_new_tokens] for t in tokens], "step_logits": step_logits}
        if prompt_logits:
            result["prompt_logits"] = first
        return result
