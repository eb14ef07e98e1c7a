"""Engine: runs a step program over paged caches — sequence slots, page allocation, shape buckets, greedy decoding.

A step program is anything with `page_size`, `cache_types` (cache name → TensorType with symbolic dims),
`token_bucket(n)` and `__call__(params, caches, batch) -> outputs`: `GraphProgram` jits a step graph here; the
artifact loader provides one backed by exported executables. Each `step` packs the scheduled sequences' new tokens into one ragged batch (prefill chunks and decode tokens mixed
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
    max_step_tokens: int = 256  # longer prompts are prefilled in chunks of at most this many tokens per step

    def pages_per_seq(self, page_size: int) -> int:
        return math.ceil(self.max_context / page_size)

    def pool_pages(self, page_size: int) -> int:
        return self.num_pages or self.max_seqs * self.pages_per_seq(page_size)


@attrs.define
class Sequence:
    slot: int
    pages: list[int] = attrs.Factory(list)
    length: int = 0  # tokens already in the cache


class GraphProgram:
    """A step graph lowered with the reference rules and jitted (caches donated so updates happen in place).

    Programs are cached per graph, so every engine of one graph shares its compiled shape buckets.
    """

    _cache: "weakref.WeakKeyDictionary[Graph, GraphProgram]" = weakref.WeakKeyDictionary()

    def __init__(self, graph: Graph):
        self.graph = graph
        self.page_size = int(graph.meta["page_size"])
        self.cache_types = {node.op.name: node.op.type for node in graph.find(Input) if node.op.name in graph.meta["caches"]}
        lowered = lower(graph)
        self._jitted = jax.jit(lambda params, caches, batch: lowered(params, {**caches, **batch}), donate_argnums=(1,))

    @classmethod
    def of(cls, graph: Graph) -> "GraphProgram":
        if graph not in cls._cache:
            cls._cache[graph] = cls(graph)
        return cls._cache[graph]

    @staticmethod
    def token_bucket(n: int) -> int:
        return 1 << max(0, (n - 1).bit_length())

    def __call__(self, params, caches, batch):
        return self._jitted(params, caches, batch)


@functools.partial(jax.jit, donate_argnums=(0,))
def _reset_slot(caches, slot):
    """Zero one sequence slot of every GDN state cache (a new sequence starts from empty state)."""
    return {name: (arr.at[slot].set(0) if name.endswith("_state") else arr) for name, arr in caches.items()}


class Engine:
    def __init__(self, program, params: dict, cache: CacheConfig = CacheConfig()):
        if isinstance(program, Graph):
            program = GraphProgram.of(program)
        self.program = program
        self.params = params
        self.cache_cfg = cache
        self.page_size = int(program.page_size)
        self.pages_per_seq = cache.pages_per_seq(self.page_size)
        self.sizes = {"B": cache.max_seqs, "M": self.pages_per_seq, "P": cache.pool_pages(self.page_size),
                      "S": cache.max_seqs}
        self.cache_names = list(program.cache_types)
        self.caches = {name: jnp.zeros(t.bind(self.sizes), np_dtype(t.dtype)) for name, t in program.cache_types.items()}
        self._reset = _reset_slot
        self.free_slots = list(range(cache.max_seqs))
        self.free_pages = list(range(self.sizes["P"]))

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
        num_tokens = self.program.token_bucket(max(total, 1))
        rows = num_tokens if all_logits else self.cache_cfg.max_seqs
        batch = self.pack(work, num_tokens, rows, all_logits)
        outputs = self.program(self.params, self.caches, batch)
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

    def pack(self, work, num_tokens: int, rows: int, all_logits: bool) -> dict:
        """The batch inputs of one step (reserving KV pages for the new tokens), padded to the given bucket."""
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

    def prefill(self, work: list[tuple[Sequence, list[int]]], all_logits: bool = False) -> list[np.ndarray]:
        """Feed whole prompts, at most `max_step_tokens` tokens per step (chunked prefill); same results as `step`."""
        budget = self.cache_cfg.max_step_tokens
        pending = [list(tokens) for _, tokens in work]
        pieces: list[list[np.ndarray]] = [[] for _ in work]
        while any(pending):
            batch, owners, left = [], [], budget
            for index, ((seq, _), rest) in enumerate(zip(work, pending)):
                if rest and left > 0:
                    take = rest[:left]
                    del rest[:len(take)]
                    batch.append((seq, take))
                    owners.append(index)
                    left -= len(take)
            for index, out in zip(owners, self.step(batch, all_logits=all_logits)):
                pieces[index].append(out)
        if all_logits:
            return [np.concatenate(p) for p in pieces]
        return [p[-1] for p in pieces]

    # -- generation ------------------------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], max_new_tokens: int, prompt_logits: bool = False,
                 progress=None) -> dict:
        """Greedy decoding of several prompts together: chunked prefill, then one decode step per token."""
        seqs = [self.add_sequence() for _ in prompts]
        try:
            first = self.prefill(list(zip(seqs, prompts)), all_logits=prompt_logits)
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
