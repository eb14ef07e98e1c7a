"""The step ABI: what one call of a step program takes and returns, defined once for every caller.

Why here, below the passes: the runtime engine, the artifact (export and load) and the equivalence checker all build
step inputs; if each wrote its own packing they would drift apart. Everything in this file is pure — slots and pages
are passed in, nothing is allocated — so the checker can pack a batch without a runtime.

A step program is called as `fn(params, caches, batch)`:

    batch      token_ids i32[T], positions i32[T], query_start i32[B+1], page_table i32[B,M], state_slots i32[B],
               logits_indices i32[R]  (BATCH_INPUTS; T and R are the bucket, B/M fixed by the cache config)
    caches     the graph's cache inputs (KV pages [P,...], GDN state slots [S,...]), donated and returned updated
    returns    next_tokens i32[R] (greedy, computed on the device), every cache, and — in buckets that ask for
               them — logits f32[R,V]

Sizes: B = max_seqs sequence slots, M = pages per sequence (max_context / page_size, rounded up), P = pool pages,
S = B state slots. Token buckets are powers of two up to max(max_step_tokens, max_seqs).

Attention data parallelism (gqa-sharding): a graph whose mesh maps the logical axis `batch` to D devices has D ranks.
Rank r owns state slots [r·S/D, (r+1)·S/D) and pages [r·P/D, (r+1)·P/D); a sequence lives on the rank of its slot,
and its pages must be that rank's. The batch is D rank-local batches of equal size, concatenated: T/D token slots,
B/D+1 query starts (so query_start holds B+D entries), B/D page-table rows and state slots, and R/D logit rows per
rank, every slot, page and token index local to its rank (`pack_ranked`). The caches keep their global layout:
rank r's pool is block r of every cache's first dim, so a sequence's KV and state sit at the same global place
whatever the number of ranks.
"""

from __future__ import annotations

import math

import attrs
import jax
import numpy as np

from qcompile.errors import UsageError
from qcompile.ir.types import TensorType, np_dtype

BATCH_INPUTS = ("token_ids", "positions", "query_start", "page_table", "state_slots", "logits_indices")
LOGITS, NEXT_TOKENS = "logits", "next_tokens"


INDEX_LIMIT = 2**31 - 1  # token positions, page ids and KV slots are int32 in the step ABI
MAX_CONTEXT = 2**24  # tokens a sequence may hold (CacheConfig.max_context)
MAX_SEQS = 2**20  # sequence slots (CacheConfig.max_seqs; also the most `qcompile plan` takes as a concurrency)


def _positive(name: str, flag: str, most: int = MAX_CONTEXT):
    def check(instance, attribute, value):
        if value is None and attribute.name == "num_pages":
            return
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise UsageError(f"{flag} must be a positive integer, got {value!r}")
        if value > most:
            raise UsageError(f"{flag} {value} is more than qcompile supports ({most})")

    return check


@attrs.frozen
class CacheConfig:
    """Static sizes of the caches and of the largest step; every size is validated (a usage error, exit 2)."""

    max_seqs: int = attrs.field(default=4, validator=_positive("max_seqs", "--max-seqs", MAX_SEQS))
    max_context: int = attrs.field(default=512, validator=_positive("max_context", "--max-context", MAX_CONTEXT))
    num_pages: int | None = attrs.field(default=None, validator=_positive("num_pages", "--num-pages", 2**28))
    max_step_tokens: int = attrs.field(default=256, validator=_positive("max_step_tokens", "--max-step-tokens"))

    def pages_per_seq(self, page_size: int) -> int:
        return math.ceil(self.max_context / page_size)

    def pool_pages(self, page_size: int) -> int:
        return self.num_pages or self.max_seqs * self.pages_per_seq(page_size)

    def sizes(self, page_size: int) -> dict[str, int]:
        """The bound symbolic dims of the caches and batch metadata (a pool whose token slots int32 cannot index is
        a usage error here, before anything is built)."""
        pool = self.pool_pages(page_size)
        if pool * page_size > INDEX_LIMIT:
            raise UsageError(f"a KV pool of {pool} pages of {page_size} tokens has more token slots than int32 indexes "
                             f"({INDEX_LIMIT}); lower --max-seqs, --max-context, --num-pages or --page-size")
        return {"B": self.max_seqs, "M": self.pages_per_seq(page_size), "P": pool, "S": self.max_seqs}

    def to_json(self, page_size: int) -> dict:
        return {"max_seqs": self.max_seqs, "max_context": self.max_context, "num_pages": self.num_pages,
                "max_step_tokens": self.max_step_tokens, "sizes": self.sizes(page_size)}

    @classmethod
    def from_json(cls, data: dict) -> "CacheConfig":
        return cls(max_seqs=data["max_seqs"], max_context=data["max_context"], num_pages=data["num_pages"],
                   max_step_tokens=data["max_step_tokens"])


def token_bucket(n: int) -> int:
    """The power-of-two token bucket a step of `n` tokens is padded to."""
    return 1 << max(0, (n - 1).bit_length())


def bucket_shapes(cache: CacheConfig, ranks: int = 1) -> list[tuple[int, int]]:
    """(T tokens, R rows) of every bucket an artifact exports: R = B (last token of each sequence) and R = T. With
    data-parallel ranks every rank has the same bucket: T = ranks · t and R = ranks · (B/ranks or t), t a power of two
    up to what one rank may take (a whole step can land on one rank)."""
    slots = cache.max_seqs // ranks
    largest = token_bucket(max(cache.max_step_tokens, slots, 1))
    shapes: list[tuple[int, int]] = []
    t = 1
    while t <= largest:
        for rows in (slots, t):
            if (ranks * t, ranks * rows) not in shapes:
                shapes.append((ranks * t, ranks * rows))
        t *= 2
    return shapes


def graph_cache_types(graph) -> dict[str, TensorType]:
    """Cache name -> type (symbolic dims) of a step graph's cache inputs."""
    from qcompile.ir.ops.core import Input

    caches = graph.meta["caches"]
    return {node.op.name: node.op.type for node in graph.find(Input) if node.op.name in caches}


def mesh_ranks(mesh) -> int:
    """How many attention data-parallel ranks a mesh has: the pieces it cuts the logical `batch` axis into."""
    if mesh is None or "batch" not in dict(mesh.rules):
        return 1
    return mesh.ways("batch")


def data_parallel_ranks(graph) -> int:
    """The data-parallel ranks of a step graph (`mesh_ranks` of its mesh)."""
    return mesh_ranks(graph.meta.get("mesh"))


def batch_specs(tokens: int, rows: int, sizes: dict[str, int], ranks: int = 1) -> dict:
    """ShapeDtypeStructs of the batch inputs, laid out exactly as `pack_batch` (`pack_ranked`) builds them."""
    shapes = {"token_ids": (tokens,), "positions": (tokens,), "query_start": (sizes["B"] + ranks,),
              "page_table": (sizes["B"], sizes["M"]), "state_slots": (sizes["B"],), "logits_indices": (rows,)}
    return {name: jax.ShapeDtypeStruct(shapes[name], np.int32) for name in BATCH_INPUTS}


def cache_specs(cache_types: dict[str, TensorType], sizes: dict[str, int]) -> dict:
    return {name: jax.ShapeDtypeStruct(t.bind(sizes), np_dtype(t.dtype)) for name, t in cache_types.items()}


def empty_caches(cache_types: dict[str, TensorType], sizes: dict[str, int]) -> dict[str, np.ndarray]:
    return {name: np.zeros(t.bind(sizes), np_dtype(t.dtype)) for name, t in cache_types.items()}


@attrs.frozen
class WorkItem:
    """One sequence's part of a step: its state slot, its KV pages (already covering the new tokens), how many
    tokens it has in the cache before this step, and the new token ids."""

    slot: int
    pages: tuple[int, ...]
    start: int
    tokens: tuple[int, ...]


def pack_batch(work: list[WorkItem], *, num_tokens: int, rows: int, max_seqs: int, pages_per_seq: int,
               all_logits: bool) -> dict[str, np.ndarray]:
    """The batch inputs of one step, padded to `num_tokens` token slots and `rows` logit rows.

    Rows: with `all_logits`, row r is token slot r (rows == num_tokens); otherwise row b is the last new token of
    work item b. Unused sequence rows get the out-of-range state slot `max_seqs`, which every kernel drops.
    """
    if len(work) > max_seqs:
        raise UsageError(f"{len(work)} sequences in one step; at most {max_seqs}")
    total = sum(len(item.tokens) for item in work)
    if total > num_tokens:
        raise ValueError(f"{total} tokens do not fit a {num_tokens}-token bucket")
    token_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    query_start = np.zeros(max_seqs + 1, np.int32)
    page_table = np.zeros((max_seqs, pages_per_seq), np.int32)
    state_slots = np.full(max_seqs, max_seqs, np.int32)
    logits_indices = np.zeros(rows, np.int32)
    start = 0
    for index, item in enumerate(work):
        n = len(item.tokens)
        if len(item.pages) > pages_per_seq:
            raise ValueError(f"sequence in slot {item.slot} holds {len(item.pages)} pages; at most {pages_per_seq}")
        token_ids[start:start + n] = item.tokens
        positions[start:start + n] = np.arange(item.start, item.start + n)
        page_table[index, :len(item.pages)] = item.pages
        state_slots[index] = item.slot
        if not all_logits:
            logits_indices[index] = start + n - 1
        start += n
        query_start[index + 1:] = start
    if all_logits:
        logits_indices[:] = np.arange(rows)
    return {"token_ids": token_ids, "positions": positions, "query_start": query_start,
            "page_table": page_table, "state_slots": state_slots, "logits_indices": logits_indices}


def item_rows(work: list[WorkItem], all_logits: bool) -> list[list[int]]:
    """The logit rows `pack_batch` gives each work item: every token's with `all_logits`, else its last token's."""
    rows, start = [], 0
    for index, item in enumerate(work):
        n = len(item.tokens)
        rows.append(list(range(start, start + n)) if all_logits else [index])
        start += n
    return rows


def pack_ranked(work: list[WorkItem], *, num_tokens: int, rows: int, max_seqs: int, pages_per_seq: int,
                pool_pages: int, all_logits: bool, ranks: int = 1) -> tuple[dict[str, np.ndarray], list[list[int]]]:
    """The batch inputs of one step for a graph with `ranks` data-parallel ranks (module docstring), and the logit
    rows of each work item. Slots and pages are global here; each item goes to its slot's rank, and its pages must
    lie in that rank's share of the pool (ValueError otherwise: the allocator placed it wrong)."""
    if ranks == 1:
        batch = pack_batch(work, num_tokens=num_tokens, rows=rows, max_seqs=max_seqs, pages_per_seq=pages_per_seq,
                           all_logits=all_logits)
        return batch, item_rows(work, all_logits)
    for total, what in ((num_tokens, "token slots"), (rows, "logit rows"), (max_seqs, "sequence slots"),
                        (pool_pages, "pages")):
        if total % ranks:
            raise ValueError(f"{total} {what} do not split into {ranks} data-parallel ranks")
    slots, pages = max_seqs // ranks, pool_pages // ranks
    per_rank: list[list[tuple[int, WorkItem]]] = [[] for _ in range(ranks)]
    for index, item in enumerate(work):
        rank = item.slot // slots
        if not 0 <= rank < ranks:
            raise ValueError(f"state slot {item.slot} is outside the {max_seqs} slots")
        local = [p - rank * pages for p in item.pages]
        if any(not 0 <= p < pages for p in local):
            raise ValueError(f"sequence in slot {item.slot} (rank {rank}) holds pages outside rank {rank}'s "
                             f"[{rank * pages}, {(rank + 1) * pages})")
        per_rank[rank].append((index, WorkItem(item.slot - rank * slots, tuple(local), item.start, item.tokens)))
    parts, item_row = [], [[] for _ in work]
    for rank, items in enumerate(per_rank):
        local_work = [item for _, item in items]
        parts.append(pack_batch(local_work, num_tokens=num_tokens // ranks, rows=rows // ranks, max_seqs=slots,
                                pages_per_seq=pages_per_seq, all_logits=all_logits))
        for (index, _), local_rows in zip(items, item_rows(local_work, all_logits)):
            item_row[index] = [rank * (rows // ranks) + r for r in local_rows]
    batch = {name: np.concatenate([part[name] for part in parts]) for name in BATCH_INPUTS}
    return batch, item_row


#: graph.meta key: caches whose channels a layout regrouped — name -> (axis, sections, groups). Tensor parallelism
#: splits a GDN layer's conv state [S, q | k | v, K-1] by heads, so each device's contiguous block must hold its own
#: heads' q, k and v channels: the channels are regrouped as groups × [q_j | k_j | v_j] (`grouped_order`).
CHANNEL_GROUPS = "channel_groups"


def grouped_order(sections, groups: int) -> np.ndarray:
    """Position i of the grouped layout holds channel `order[i]` of the plain [s0 | s1 | ...] layout: group j holds
    the j-th 1/groups of every section, sections in order."""
    starts = np.cumsum([0, *sections[:-1]])
    return np.concatenate([np.arange(start + j * (size // groups), start + (j + 1) * (size // groups))
                           for j in range(groups) for start, size in zip(starts, sections)])


def to_cache_layout(graph, name: str, value):
    """A cache in the plain (reference) channel order, put into `graph`'s layout of that cache."""
    axis, sections, groups = graph.meta.get(CHANNEL_GROUPS, {}).get(name, (None, None, None))
    if axis is None:
        return value
    return value[(slice(None),) * axis + (grouped_order(sections, groups),)]


def from_cache_layout(graph, name: str, value):
    """`graph`'s layout of a cache back in the plain channel order (the inverse of `to_cache_layout`)."""
    axis, sections, groups = graph.meta.get(CHANNEL_GROUPS, {}).get(name, (None, None, None))
    if axis is None:
        return value
    return value[(slice(None),) * axis + (np.argsort(grouped_order(sections, groups)),)]
