"""kv-page-resize: the paged KV cache's page size chosen for the target, and the cache capacity it buys reported.

What: every `layers.{i}.k_pages` / `v_pages` cache [P, page, Hkv, hd] gets the target's page length (TARGET_PAGE_SIZE,
a power of two, never longer than the longest context the build is for, rounded up to a power of two), and every
paged_attention op the matching `page_size`; nothing else changes. The step ABI derives the pool (P pages) and the
page tables (M = ⌈max_context / page⌉ per sequence) from the graph's page size, so the engine, the artifact and the
checker follow. The GDN state is a pool of its own — one slot per concurrent sequence (the S = max_seqs slots of the
step ABI; a padding row names slot S, which every kernel drops, so no extra null slot is needed) — so attention pages
are never stretched to align with a state slot's bytes, and the memory a page-aligned state pool would spend on
slots for every page goes to KV pages instead.

Why (design.md §4 item 7): on TPU the ragged paged attention kernel moves one page per DMA and wants long pages (256
tokens for this model); on CPU small pages waste less of each sequence's last page. The pass is the page size's one
home: with `--page-size N` the user fixes it, the importer uses N and this pass keeps it (and says so); without it the
importer's default stands until this pass picks the target's. Reassociating class: a relayout, but the attention rules walk keys in blocks of pages, so sums regroup; the checker compares caches
through each layout's view of every sequence's logical KV (passes/equivalence.py), not page by page.

The report: the page size before and after and why, KV bytes per token and GDN state bytes per sequence, and, for a
memory budget (`--memory-budget`), the capacity before and after: the longest context every one of `concurrency`
sequences can have, and how many sequences of `max_context` tokens fit.
"""

from __future__ import annotations

import attrs

from qcompile.ir.graph import Graph
from qcompile.ir.ops.attention import PagedAttention
from qcompile.ir.ops.core import Input, Param
from qcompile.ir.types import np_dtype
from qcompile.passes.base import Pass, PassContext, PassResult
from qcompile.passes.rewrite import retype_inputs

#: Page length per target, in tokens. tpu: the ragged paged attention kernel's DMA unit (256 in the system that
#: serves this model on TPU, design.md §4.7); gpu: vLLM's default block; cpu: measured with `qcompile bench` on the
#: bench preset (docs/benchmarks.md: decode and prefill within noise from 16 to 64, so the least padding wins).
TARGET_PAGE_SIZE = {"tpu": 256, "gpu": 16, "cpu": 16}
KV_SUFFIXES = (".k_pages", ".v_pages")


def kv_inputs(graph: Graph) -> dict:
    caches = set(graph.meta.get("caches", ()))
    return {node.op.name: node.op.type for node in graph.find(Input)
            if node.op.name in caches and node.op.name.endswith(KV_SUFFIXES)}


def _itemsize(t) -> int:
    return np_dtype(t.dtype)(0).itemsize


def _static(shape) -> int:
    out = 1
    for d in shape:
        out *= d if isinstance(d, int) else 1
    return out


@attrs.frozen
class CacheFacts:
    """Bytes the caches and weights take, read off the step graph (whole model, all devices)."""

    kv_bytes_per_token: int  # K and V of every attention layer
    state_bytes_per_sequence: int  # one slot of every GDN state cache
    weight_bytes: int

    @classmethod
    def of(cls, graph: Graph) -> "CacheFacts":
        caches = set(graph.meta.get("caches", ()))
        kv = state = 0
        for node in graph.find(Input):
            t = node.op.type
            if node.op.name not in caches:
                continue
            if node.op.name.endswith(KV_SUFFIXES):
                kv += _static(t.shape[2:]) * _itemsize(t)
            elif node.op.name.endswith("_state"):
                state += _static(t.shape[1:]) * _itemsize(t)
        weights = sum(_static(node.op.type.shape) * _itemsize(node.op.type) for node in graph.find(Param))
        return cls(kv, state, weights)

    def sequence_bytes(self, context: int, page_size: int) -> int:
        """One sequence of `context` tokens: its state slot and its pages (the last one padded)."""
        return self.state_bytes_per_sequence + -(-context // page_size) * page_size * self.kv_bytes_per_token

    def capacity(self, budget: int, page_size: int, concurrency: int, context: int) -> dict:
        """What `budget` bytes (weights included) hold with pages of `page_size`."""
        free = budget - self.weight_bytes
        per_seq = free // concurrency - self.state_bytes_per_sequence if concurrency else 0
        pages = max(0, per_seq) // (page_size * self.kv_bytes_per_token) if self.kv_bytes_per_token else 0
        return {"page_size": page_size,
                "context_at_concurrency": {"concurrency": concurrency, "tokens": int(pages * page_size)},
                "sequences_at_context": {"context": context,
                                         "sequences": max(0, free // self.sequence_bytes(context, page_size))},
                "cache_bytes_per_sequence": self.sequence_bytes(context, page_size)}


def target_page_size(target: str, max_context: int | None) -> int:
    size = TARGET_PAGE_SIZE.get(target)
    if size is None:
        return 0
    if max_context:
        size = min(size, 1 << max(0, (int(max_context) - 1).bit_length()))
    return size


def run(graph: Graph, ctx: PassContext) -> PassResult:
    kv = kv_inputs(graph)
    if not kv:
        return PassResult(graph, False, {}, skipped="no paged KV cache (no attention layer)")
    current = int(graph.meta["page_size"])
    facts = CacheFacts.of(graph)
    concurrency, context = int(ctx.option("concurrency", 1) or 1), int(ctx.option("max_context", 0) or 0)
    fixed = ctx.option("page_size")
    if fixed is not None:
        chosen, why = int(fixed), f"fixed by --page-size {fixed}"
    else:
        chosen = target_page_size(ctx.target, context)
        why = (f"{ctx.target}: {TARGET_PAGE_SIZE[ctx.target]}-token pages"
               + (f", capped at the {context}-token context" if chosen < TARGET_PAGE_SIZE[ctx.target] else "")
               if chosen else f"no page size is set for target {ctx.target!r}")
        chosen = chosen or current
    stats = {"page_size": f"{current} -> {chosen}", "why": why, "kv_bytes_per_token": facts.kv_bytes_per_token,
             "state_bytes_per_sequence": facts.state_bytes_per_sequence,
             "state_slots": f"{concurrency} (one per concurrent sequence; padding rows use a dropped slot)"}
    budget = ctx.option("memory_budget")
    if budget:
        capacity = {"budget_bytes": int(budget), "weight_bytes": facts.weight_bytes,
                    "before": facts.capacity(int(budget), current, concurrency, context or current),
                    "after": facts.capacity(int(budget), chosen, concurrency, context or chosen)}
        stats["capacity"] = capacity

        def line(c: dict) -> str:
            return (f"{c['context_at_concurrency']['concurrency']} x {c['context_at_concurrency']['tokens']} tokens "
                    f"or {c['sequences_at_context']['sequences']} x {c['sequences_at_context']['context']}")

        stats["capacity_in_budget"] = f"{line(capacity['before'])} -> {line(capacity['after'])}"
    if chosen == current:
        return PassResult(graph, False, stats, skipped=f"the page size is {current} already ({why})")
    types = {name: t.with_shape((t.shape[0], chosen, *t.shape[2:])) for name, t in kv.items()}
    meta = {**graph.meta, "page_size": chosen}
    new_graph, retyped = retype_inputs(
        graph, types, lambda op_: attrs.evolve(op_, page_size=chosen) if isinstance(op_, PagedAttention) else None,
        meta=meta)
    stats["ops"] = retyped
    return PassResult(new_graph, True, stats)


KV_PAGE_RESIZE = Pass(
    name="kv-page-resize",
    summary="KV cache page size chosen per target (256 tokens on TPU, 16 on CPU); capacity for --memory-budget "
            "reported before and after",
    run=run,
    tolerance="reassociating",  # a relayout, but the attention rules' key blocks follow the page size
    requires=("attention layers",),
    cpu_note="keeps 16-token pages on cpu (the import default; measured within noise of 32 and 64); on tpu it "
             "moves to 256-token pages for the Pallas kernel",
)
