"""Engine: runs a step program over paged caches — sequence slots, page allocation, shape buckets, greedy decoding.

A step program is anything with `page_size`, `cache_types` (cache name → TensorType with symbolic dims),
`token_bucket(n)` and `__call__(params, caches, batch, with_logits)` following the step ABI (qcompile/ir/abi.py):
`GraphProgram` jits a step graph here, lowered with the host target's rules; the artifact loader provides one backed
by exported executables. Each `step` packs the scheduled sequences' new tokens into one ragged batch (prefill chunks
and decode tokens mixed freely) with `ir.abi.pack_batch`, pads it to a power-of-two token bucket, and calls the
program with the caches donated so they are updated in place. Greedy sampling happens on the device: a decode step
brings back one token id per sequence, and logits only when asked. A sequence owns one GDN state slot (zeroed when
it is admitted) and KV pages allocated as it grows. `launch_tokens` dispatches a step without waiting for it, and a
decode step may take the tokens of the step before on the device (pipelined decoding: `generate`, `bench`'s waves and
the scheduler pack and dispatch step N + 1 while step N computes).

On a graph laid out with attention data parallelism (gqa-sharding; `ranks` > 1) each rank has its own share of the
slots and of the page pool (ir/abi.py): a new sequence goes to the rank with the most free slots, its pages come from
that rank's pool, and a step's token bucket is the fullest rank's. The parameters and caches are placed on the mesh
with their shardings once, so a step moves no weights.
"""

from __future__ import annotations

import functools
import math
import time

import attrs
import jax
import jax.numpy as jnp
import numpy as np

from qcompile.errors import UsageError
from qcompile.ir.abi import (LOGITS, NEXT_TOKENS, CacheConfig, WorkItem, batch_specs, cache_specs, graph_cache_types,
                             mesh_ranks, pack_ranked, token_bucket)
from qcompile.ir.graph import Graph
from qcompile.ir.lowering import host_target, step_function
from qcompile.ir.types import TensorType, np_dtype
from qcompile.ir.weights import param_types
from qcompile.kernels import native
from qcompile.kernels.cache_rows import NATIVE_GATHER, as_bits, from_bits, page_reader, scatter_rows
from qcompile.kernels.logprobs import token_logprobs
from qcompile.runtime.distributed import to_host
from qcompile.runtime.sampling import GREEDY, sample, warm_sampler
from qcompile.runtime.memory import (CompiledBuckets, cache_bytes, compiled_memory, gib, peak_rss, resident,
                                     step_intermediates, weight_bytes)

ZERO_SLOT = "qcompile_zero_slot"

__all__ = ["CacheConfig", "Engine", "GraphProgram", "ItemLogprobs", "LaunchedStep", "PendingToken", "Sequence",
           "TokenLogprob"]


@attrs.define
class Sequence:
    slot: int
    pages: list[int] = attrs.Factory(list)
    length: int = 0  # tokens already in the cache


@attrs.frozen
class TokenLogprob:
    """A token's log-probability where the model put it, and the TOP_LOGPROBS most likely tokens there (id,
    log-probability), most likely first (kernels/logprobs.py)."""
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@attrs.frozen
class ItemLogprobs:
    """What a launched step scored for one work item: its fed tokens' successors (`prompt`, in feeding order) and
    the token it made (`next`), each where asked."""
    prompt: tuple[TokenLogprob, ...] = ()
    next: TokenLogprob | None = None


NOTHING_SCORED = ItemLogprobs()  # (frozen: one instance serves every unscored item)


class LaunchedStep:
    """A step dispatched to the device (`Engine.launch_tokens`) whose next tokens may not be back yet: `tokens()`
    waits for them and reads them, once; `token(i)` names work item i's token without reading it, for the next step
    to take as its input on the device (pipelined decoding); `logprobs()` reads what the step scored."""

    def __init__(self, produced, rows: list[int], scored=None):
        self.produced = produced  # the device array of next-token ids
        self.rows = rows          # each work item's entry in it
        self._tokens: list[int] | None = None
        # (device (logprob, top logprobs, top ids, scored token), per item (fed tokens scored, next token scored?))
        self._scored = scored
        self._logprobs: list[ItemLogprobs] | None = None

    def logprobs(self) -> list[ItemLogprobs]:
        """Per work item, the log-probabilities the step was asked for (empty ones where none were)."""
        if self._logprobs is None:
            if self._scored is None:
                self._logprobs = [NOTHING_SCORED] * len(self.rows)
                return self._logprobs
            arrays, layout = self._scored
            chosen, top_logprob, top_id, targets = (to_host(a) for a in arrays)
            entries = [TokenLogprob(int(targets[j]), float(chosen[j]),
                                    tuple(zip(map(int, top_id[j]), map(float, top_logprob[j]))))
                       for j in range(sum(count + wants for count, wants in layout))]
            self._logprobs, at = [], 0
            for count, wants in layout:
                self._logprobs.append(ItemLogprobs(tuple(entries[at:at + count]),
                                                   entries[at + count] if wants else None))
                at += count + wants
        return self._logprobs

    def token(self, index: int) -> "PendingToken":
        return PendingToken(self, index)

    @property
    def read(self) -> bool:
        return self._tokens is not None

    def tokens(self) -> list[int]:
        if self._tokens is None:
            host = to_host(self.produced)
            self._tokens = [int(host[row]) for row in self.rows]
        return self._tokens


@attrs.frozen(eq=False)
class PendingToken:
    """Work item `index`'s next token of a launched step, still on the device: a work item may feed it as its one
    new token, and the step that does reads it there (or from the host, where it is back already or the engine
    cannot take it on the device)."""
    step: LaunchedStep
    index: int


def _pending_tokens(work: list[tuple[Sequence, list]]):
    """Per work item, the token it feeds when that is a PendingToken (a device int32 array; -1 for an item that
    feeds known tokens): what a penalised item's sampler counts besides its History (runtime/sampling.py). One
    launched step's tokens are taken on the device; any other's (and read ones) from the host."""
    refs = [tokens[-1] if tokens and isinstance(tokens[-1], PendingToken) else None for _, tokens in work]
    unread = [ref.step for ref in refs if ref is not None and not ref.step.read]
    source = unread[0] if unread else None
    at = [ref.step.rows[ref.index] if ref is not None and ref.step is source else -1 for ref in refs]
    known = [ref.step.tokens()[ref.index] if ref is not None and ref.step is not source else -1 for ref in refs]
    if source is None:
        return jnp.asarray(known, jnp.int32)
    return _take_pending(source.produced, jnp.asarray(at, jnp.int32), jnp.asarray(known, jnp.int32))


@jax.jit
def _take_pending(produced, at, known):
    return jnp.where(at >= 0, produced[jnp.maximum(at, 0)].astype(jnp.int32), known)


@jax.jit
def _scored_tokens(drawn, source, fixed):
    """The token each scored row is scored against: drawn[source] where source >= 0 (a made token), else fixed."""
    return jnp.where(source >= 0, drawn[jnp.maximum(source, 0)].astype(jnp.int32), fixed)


@jax.jit
def _feed_tokens(token_ids, produced, rows):
    """token_ids with each placeholder -j (j = 1, 2, ...) replaced by produced[rows[j - 1]], on the device."""
    fed = token_ids < 0
    return jnp.where(fed, produced[rows[jnp.where(fed, -token_ids - 1, 0)]].astype(token_ids.dtype), token_ids)


class MeshPlacement:
    """Where a laid-out step program's parameters and caches live: each array with its NamedSharding on the mesh,
    placed once (a step then moves no weights). On one device everything stays as given. A tensor-parallel layout
    has one data-parallel rank but still spans the mesh (an artifact of one was called with single-device arrays and
    refused: "exported for 2 devices and called in a context with 1")."""

    def __init__(self, mesh, cache_types: dict[str, TensorType], param_types: dict[str, TensorType]):
        self.ranks = mesh_ranks(mesh)
        self.mesh = mesh if mesh is not None and mesh.size > 1 else None
        self._devices = self.mesh.jax_mesh() if self.mesh is not None else None
        self.cache_types, self.param_types = cache_types, param_types

    def _named(self, type_: TensorType):
        return self.mesh.named_sharding(type_, self._devices)

    def place_params(self, params: dict) -> dict:
        """The parameters on the mesh, each with its sharding (unchanged without a mesh)."""
        if self.mesh is None:
            return params
        return {name: jax.device_put(value, self._named(self.param_types[name])) if name in self.param_types
                else value for name, value in params.items()}

    def place_caches(self, caches: dict) -> dict:
        """The caches on the mesh, each rank's slots and pages on its device (unchanged without a mesh)."""
        if self.mesh is None:
            return caches
        return {name: jax.device_put(value, self._named(self.cache_types[name])) for name, value in caches.items()}


class GraphProgram:
    """A step graph lowered with one target's rules and jitted (caches donated so updates happen in place).

    Programs are cached on their graph, per target, so every engine of one graph shares its compiled shape buckets,
    and they go when the graph goes (a weak-keyed table could not let go: each program holds its graph).
    """

    def __init__(self, graph: Graph, target: str | None = None):
        self.graph = graph
        self.target = target or host_target()
        self.page_size = int(graph.meta["page_size"])
        self.cache_types = graph_cache_types(graph)
        self._jitted = {flag: jax.jit(step_function(graph, self.target, flag), donate_argnums=(1,))
                        for flag in (True, False)}
        self.compiled_buckets = CompiledBuckets()
        self.placement = MeshPlacement(graph.meta.get("mesh"), self.cache_types, param_types(graph))
        self.ranks = self.placement.ranks

    def place_params(self, params: dict) -> dict:
        return self.placement.place_params(params)

    def place_caches(self, caches: dict) -> dict:
        return self.placement.place_caches(caches)

    @classmethod
    def of(cls, graph: Graph, target: str | None = None) -> "GraphProgram":
        target = target or host_target()
        programs = graph.__dict__.setdefault("_step_programs", {})
        if target not in programs:
            programs[target] = cls(graph, target)
        return programs[target]

    token_bucket = staticmethod(token_bucket)

    def executable(self, params, caches, batch, with_logits: bool = True):
        """The compiled executable of this bucket (compiled on first use; `caches` and `batch` may be
        ShapeDtypeStructs, so a bucket can be compiled — and its memory analysed — before any cache exists)."""
        return self.compiled_buckets.compiled(self._jitted[with_logits], params, caches, batch, with_logits)

    def __call__(self, params, caches, batch, with_logits: bool = True):
        return self.executable(params, caches, batch, with_logits)(params, caches, batch)


def _zero_slot(arr, slot, native_ok: bool = True):
    """arr with arr[slot] = 0, in place. bf16 arrays go through the native kernel `qcompile_zero_slot` where it can be
    built: XLA CPU runs a bf16 dynamic-update-slice as a convert fusion over the whole array (measured 3-5 ms per
    8.6 MB state cache, once per layer per new sequence: 170 ms of a 32-sequence prefill step with bf16 states)."""
    if native_ok and arr.dtype == jnp.bfloat16 and native.ensure(ZERO_SLOT):
        call = jax.ffi.ffi_call(ZERO_SLOT, jax.ShapeDtypeStruct(arr.shape, arr.dtype), input_output_aliases={0: 0})
        return call(arr, jnp.asarray(slot, jnp.int32))
    return arr.at[slot].set(0)


@functools.partial(jax.jit, donate_argnums=(0,), static_argnums=(2,))
def _reset_slot(caches, slot, native_ok: bool = True):
    """Zero one sequence slot of every GDN state cache (a new sequence starts from empty state). On a mesh, XLA's
    partitioner updates the devices that hold the slot (the native kernel would see a whole array)."""
    return {name: (_zero_slot(arr, slot, native_ok) if name.endswith("_state") else arr)
            for name, arr in caches.items()}


def _read_rows(arr, index, native_ok: bool):
    """arr[index] (rows of the leading axis). A bf16 array is read through the native gather (widened, then narrowed
    back: exact) where it can be: XLA CPU converts the whole array to gather from it (kernels/cache_rows.py)."""
    if arr.dtype == jnp.bfloat16 and arr.ndim >= 2 and native_ok and native.ensure(NATIVE_GATHER):
        return page_reader(arr)(index[None, :]).reshape(index.shape[0], *arr.shape[1:]).astype(arr.dtype)
    return from_bits(as_bits(arr)[index], arr.dtype)


@functools.partial(jax.jit, donate_argnums=(0,), static_argnums=(5,))
def _copy_sequence(caches, src_slot, dst_slot, src_pages, dst_pages, native_ok: bool = True):
    """Every cache with a forked sequence's rows: its state slot and the KV pages given (its partly written last
    page, or a page onto itself) copied from the source's, in place."""
    out = {}
    for name, arr in caches.items():
        src, dst = (src_slot[None], dst_slot[None]) if name.endswith("_state") else (src_pages, dst_pages)
        rows = _read_rows(arr, src, native_ok)
        out[name] = scatter_rows(arr, dst, rows) if native_ok else arr.at[dst].set(rows)
    return out


class Engine:
    def __init__(self, program, params: dict, cache: CacheConfig = CacheConfig(), target: str | None = None,
                 memory_budget: int | None = None):
        if isinstance(program, Graph):
            program = GraphProgram.of(program, target)
        self.program = program
        self.ranks = getattr(program, "ranks", 1)
        if cache.max_seqs % self.ranks:
            raise UsageError(f"{cache.max_seqs} sequence slots do not split over {self.ranks} data-parallel ranks; "
                             f"give --max-seqs a multiple of {self.ranks}")
        self.params = program.place_params(params)  # on the mesh when there is one (as given on one device)
        self.cache_cfg = cache
        self.page_size = int(program.page_size)
        self.pages_per_seq = cache.pages_per_seq(self.page_size)
        self.sizes = cache.sizes(self.page_size)
        self.cache_names = list(program.cache_types)
        self.pool_note: str | None = None
        if memory_budget is not None:
            if cache.num_pages is None and isinstance(program, GraphProgram):
                self._fit_pool(memory_budget)
            self.check_memory_budget(memory_budget)
        cache = self.cache_cfg
        self.caches = {name: jnp.zeros(t.bind(self.sizes), np_dtype(t.dtype)) for name, t in program.cache_types.items()}
        self.caches = program.place_caches(self.caches)
        if self.sizes["P"] % self.ranks:
            raise UsageError(f"{self.sizes['P']} KV pages do not split over {self.ranks} data-parallel ranks; give "
                             f"--num-pages a multiple of {self.ranks}")
        # Per data-parallel rank: its free slots and pages (one rank without a mesh).
        slots, pages = cache.max_seqs // self.ranks, self.sizes["P"] // self.ranks
        self.free_slots_by_rank = [list(range(r * slots, (r + 1) * slots)) for r in range(self.ranks)]
        self.free_pages_by_rank = [list(range(r * pages, (r + 1) * pages)) for r in range(self.ranks)]
        # sequences holding each page: a forked sequence shares its source's whole pages (never written again: a
        # sequence writes at its length and after), and a page goes back to the pool when the last holder lets go
        self.page_holders = np.zeros(self.sizes["P"], np.int32)
        self.last_batch: dict | None = None
        # Pending tokens are fed on the device where the program runs on one device in one process (a mesh's
        # program takes its batch replicated or split in every process, as numpy arrays; those are read back first).
        self.feeds_on_device = (getattr(getattr(program, "placement", None), "mesh", None) is None
                                and jax.process_count() == 1)

    @property
    def free_slots(self) -> list[int]:
        return [slot for free in self.free_slots_by_rank for slot in free]

    @property
    def free_pages(self) -> list[int]:
        return [page for free in self.free_pages_by_rank for page in free]

    def rank_of(self, seq: "Sequence") -> int:
        return seq.slot // (self.cache_cfg.max_seqs // self.ranks)

    # -- memory ----------------------------------------------------------------------------------------------------

    def largest_step(self) -> tuple[int, int]:
        """(tokens, logit rows) of the largest step this engine makes without prompt logits."""
        if self.ranks > 1:  # every rank's bucket as large as the whole step could be
            return self.ranks * token_bucket(max(self.cache_cfg.max_step_tokens, self.cache_cfg.max_seqs)), \
                self.cache_cfg.max_seqs
        return self.program.token_bucket(max(self.cache_cfg.max_step_tokens, self.cache_cfg.max_seqs)), \
            self.cache_cfg.max_seqs

    def compile_all_buckets(self, sampling: bool = False, pairs: int = 0) -> None:
        """Compile, ahead of any step, every bucket a step without prompt logits can use: T = 1, 2, 4, ... up to the
        largest step, with min(T, max_seqs) logit rows (so a server's first requests do not wait for XLA). With
        `sampling`, also the buckets that return logits and the on-device sampler for each (what a step with a
        sampled request runs). And the small program that feeds a pipelined step the tokens of the one before
        (~60 ms of XLA each, for each bucket after each size of result: a mixed stream meets most of them).
        `pairs`: with `sampling`, the sampler's programs for up to that many penalised (request, token) pairs too
        (runtime/sampling.py `warm_sampler`)."""
        tokens, _ = self.largest_step()
        caches = cache_specs(self.program.cache_types, self.sizes)
        t, slots, buckets, produced = 1, self.cache_cfg.max_seqs // self.ranks, [], set()
        while t * self.ranks <= tokens:
            rows = self.ranks * min(t, slots)
            batch = batch_specs(t * self.ranks, rows, self.sizes, self.ranks)
            self.program.executable(self.params, caches, batch, False)
            buckets.append(t)
            produced.add(rows)  # the size of the token ids this bucket gives the next step
            if sampling:
                logits = self.program.executable(self.params, caches, batch, True).out_info[LOGITS]
                warm_sampler(tuple(logits.shape), logits.dtype, pairs)
                produced.add(int(logits.shape[0]))  # the sampler's result: one draw per logits row
            t *= 2
        if self.feeds_on_device:  # the token feed of a pipelined step, for every bucket after every result size
            for t in buckets:
                for n in sorted(produced):
                    _feed_tokens(np.zeros(t, np.int32), jnp.zeros(n, jnp.int32), np.zeros(t, np.int32))

    def _fit_pool(self, budget: int) -> None:
        """Without --num-pages, a budget that cannot hold every slot at max_context gets the KV pool that fits it
        (whole pages, a multiple of the ranks), as long as one sequence of max_context still fits per rank: more
        sequences of mixed lengths are served than full-length ones, the scheduler preempting when pages run out.
        `pool_note` says what was chosen."""
        estimate = self.memory_estimate()
        if estimate["needed_bytes"] <= budget:
            return
        full = self.sizes["P"]
        page_bytes = estimate["kv_pages"] // full
        spare = budget - (estimate["needed_bytes"] - estimate["kv_pages"])
        pages = (max(0, spare) // max(page_bytes, 1)) // self.ranks * self.ranks
        if pages < self.pages_per_seq * self.ranks:
            return  # not even one full-length sequence per rank: check_memory_budget refuses, saying why
        self.cache_cfg = attrs.evolve(self.cache_cfg, num_pages=int(pages))
        self.sizes = self.cache_cfg.sizes(self.page_size)
        self.pool_note = (f"--memory-budget: {pages} KV pages of {self.page_size} tokens fit (every one of the "
                          f"{self.cache_cfg.max_seqs} slots at {self.cache_cfg.max_context} tokens would need {full}); "
                          f"{pages // self.pages_per_seq} sequences at full length, more when shorter")

    def memory_estimate(self) -> dict:
        """Bytes this engine's configuration needs: weights, caches by kind, the largest step's temporaries (XLA's
        analysis of its compiled bucket) and the process's own memory."""
        weights = weight_bytes(self.params)
        caches = cache_bytes({n: (t.bind(self.sizes), np_dtype(t.dtype)) for n, t in self.program.cache_types.items()})
        tokens, rows = self.largest_step()
        analysis = compiled_memory(self.program.executable(
            self.params, cache_specs(self.program.cache_types, self.sizes),
            batch_specs(tokens, rows, self.sizes, self.ranks), False)) or {}
        temporaries = analysis.get("temporaries", 0)
        # The process's own memory (the JAX runtime, XLA and the executables compiled so far): what is resident now
        # beyond the weights' copies; weights used in place from a mapped file are not resident yet.
        runtime = max(0, resident()["total"] - (weights["bytes"] - weights["mapped_bytes"]))
        need = weights["bytes"] + sum(caches.values()) + temporaries + runtime
        return {"needed_bytes": need, "weights_bytes": weights["bytes"], **caches, "temporaries_bytes": temporaries,
                "runtime_bytes": runtime, "step": (tokens, rows)}

    def check_memory_budget(self, budget: int) -> dict:
        """Refuse (exit 2), before any cache is allocated, a cache configuration whose weights + caches + the largest
        step's temporaries + the process's own memory would exceed `budget` bytes. The largest bucket is compiled
        for it (XLA's memory analysis; the same executable then serves that step). Returns the estimate."""
        estimate = {"budget_bytes": budget, **self.memory_estimate()}
        need, (tokens, _) = estimate["needed_bytes"], estimate.pop("step")
        weights = {"bytes": estimate["weights_bytes"]}
        caches = {"kv_pages": estimate["kv_pages"], "gdn_state": estimate["gdn_state"]}
        temporaries, runtime = estimate["temporaries_bytes"], estimate["runtime_bytes"]
        if need > budget:
            fixed = weights["bytes"] + runtime
            seqs = f"{self.cache_cfg.max_seqs} sequence{'s' * (self.cache_cfg.max_seqs != 1)}"
            advice = (f"the weights and the runtime alone need {gib(fixed)}: raise the budget (or compile with "
                      "fewer layers or a smaller dtype)" if fixed > budget else
                      "serve fewer or shorter sequences (--max-seqs / --max-context) or raise the budget")
            raise UsageError(
                f"{gib(need)} needed, over --memory-budget {gib(budget)}: weights {gib(weights['bytes'])}, KV pages "
                f"{gib(caches['kv_pages'])} + GDN state {gib(caches['gdn_state'])} for {seqs} of "
                f"{self.cache_cfg.max_context} tokens, temporaries {gib(temporaries)} (T{tokens} step), runtime "
                f"{gib(runtime)}; {advice}")
        return estimate

    def memory(self, graph: Graph | None = None) -> dict:
        """Where this engine's memory goes (runtime/memory.py): peak and current resident set, weight bytes (and
        how many are used in place from a mapped file), cache bytes by kind, XLA's analysis of every bucket
        compiled so far with the largest temporaries, and — given the step graph — its largest IR values at the
        largest step."""
        analyses = {label: stats for label, stats in self.program.compiled_buckets.labelled().items() if stats}
        largest = max(analyses.items(), key=lambda item: item[1]["temporaries"], default=(None, None))
        out = {"peak_rss_bytes": peak_rss(), "resident_bytes": resident(), "weights": weight_bytes(self.params),
               "caches": cache_bytes({n: (a.shape, a.dtype) for n, a in self.caches.items()}),
               "temporaries": {"largest_bytes": largest[1]["temporaries"] if largest[1] else None,
                               "largest_bucket": largest[0], "buckets": analyses}}
        if graph is not None:
            tokens, rows = self.largest_step()
            out["temporaries"]["largest_values"] = step_intermediates(graph, {**self.sizes, "T": tokens, "R": rows})
        return out

    # -- sequences -------------------------------------------------------------------------------------------------

    def next_rank(self) -> int:
        """The rank `add_sequence` places the next sequence on: the one with the most free slots (the lowest first)."""
        return max(range(self.ranks), key=lambda r: (len(self.free_slots_by_rank[r]), -r))

    def add_sequence(self) -> Sequence:
        rank = self.next_rank()
        if not self.free_slots_by_rank[rank]:
            raise UsageError(f"all {self.cache_cfg.max_seqs} sequence slots are in use; raise --max-seqs")
        seq = Sequence(self.free_slots_by_rank[rank].pop(0))
        self.caches = _reset_slot(self.caches, jnp.int32(seq.slot), self._caches_on_one_device())
        return seq

    def fork_pages(self, source: Sequence) -> int:
        """Pages `fork(source)` takes from the pool: a copy of its partly written last page, if it has one (its
        whole pages are shared)."""
        return int(source.length % self.page_size > 0)

    def fork(self, source: Sequence) -> Sequence | None:
        """A new sequence whose cache holds what `source`'s holds, after every step launched so far, on the same
        rank: its state slot copied on the device, its whole KV pages shared (no sequence writes into a page below
        its length again) and a partly written last page copied; None when that rank has no free slot or not the
        page. A request's n choices share one prefill, and prompts a snapshot of their common prefix, this way
        (runtime/scheduler.py)."""
        rank = self.rank_of(source)
        if not self.free_slots_by_rank[rank] or self.fork_pages(source) > len(self.free_pages_by_rank[rank]):
            return None
        seq = Sequence(self.free_slots_by_rank[rank].pop(0))
        if not source.length:
            self.caches = _reset_slot(self.caches, jnp.int32(seq.slot), self._caches_on_one_device())
            return seq
        whole = source.length // self.page_size
        seq.pages = list(source.pages[:whole])
        self.page_holders[seq.pages] += 1
        self._reserve(seq, source.length)  # the partly written page, if any
        seq.length = source.length
        # the state slot, and the partly written page (else a whole page onto itself: the same values)
        src, dst = ([source.pages[whole]], [seq.pages[whole]]) if self.fork_pages(source) else \
            ([source.pages[0]], [source.pages[0]])
        self.caches = _copy_sequence(self.caches, jnp.int32(source.slot), jnp.int32(seq.slot),
                                     jnp.asarray(src, jnp.int32), jnp.asarray(dst, jnp.int32),
                                     self._caches_on_one_device())
        return seq

    def _caches_on_one_device(self) -> bool:
        """Whether the native cache kernels may see the caches whole: a tensor-parallel state is split over its
        heads even with one data-parallel rank, a data-parallel cache over the ranks, and a custom call's result
        would come back replicated; XLA's partitioner moves their rows instead."""
        return all(len(arr.sharding.device_set) == 1 for arr in self.caches.values() if hasattr(arr, "sharding"))

    def release(self, seq: Sequence) -> None:
        """Give `seq`'s slot back, and each of its pages no other sequence holds."""
        rank = self.rank_of(seq)
        self.page_holders[seq.pages] -= 1
        self.free_pages_by_rank[rank].extend(page for page in seq.pages if not self.page_holders[page])
        self.free_slots_by_rank[rank].append(seq.slot)
        seq.pages, seq.length = [], 0

    def pages_held(self, seqs) -> int:
        """Pages that `seqs` hold and no other sequence does (what releasing them all would give back)."""
        held = [page for seq in seqs for page in seq.pages]
        if not held:
            return 0
        pages, counts = np.unique(np.asarray(held), return_counts=True)
        return int(np.sum(self.page_holders[pages] == counts))

    def _reserve(self, seq: Sequence, new_tokens: int) -> None:
        total = seq.length + new_tokens
        if total > self.cache_cfg.max_context:
            raise UsageError(f"sequence of {total} tokens exceeds the max context {self.cache_cfg.max_context}; "
                             "raise --max-context")
        need = math.ceil(total / self.page_size) - len(seq.pages)
        free = self.free_pages_by_rank[self.rank_of(seq)]
        if need > len(free):
            where = f" (rank {self.rank_of(seq)}'s share)" if self.ranks > 1 else ""
            raise UsageError(f"the KV page pool ({self.sizes['P']} pages of {self.page_size} tokens){where} is "
                             "exhausted; raise --max-context or --num-pages")
        self.page_holders[free[:need]] = 1
        seq.pages.extend(free[:need])
        del free[:need]

    # -- one step --------------------------------------------------------------------------------------------------

    def _run(self, work: list[tuple[Sequence, list[int]]], all_logits: bool, with_logits: bool) -> dict:
        if len(work) > self.cache_cfg.max_seqs:
            raise UsageError(f"{len(work)} sequences in one step; at most {self.cache_cfg.max_seqs}")
        # Tokens per rank: all of them with one rank; the fullest rank's bucket sets every rank's otherwise.
        per_rank = [0] * self.ranks
        for seq, tokens in work:
            per_rank[self.rank_of(seq)] += len(tokens)
        bucket = self.program.token_bucket(max(max(per_rank), 1))
        num_tokens = bucket * self.ranks
        # Logit rows: every token slot (all_logits), else one per sequence — as few as the bucket allows: a T-token
        # step has at most T sequences, so a step smaller than the slot count uses R = T (an artifact exports (T, T)
        # for every T) instead of computing lm_head and greedy for max_seqs rows (one live sequence of a 32-slot
        # artifact decoded at 26-28 tok/s with R = 32, 38-41 with R = 1).
        slots = self.cache_cfg.max_seqs // self.ranks
        rows = num_tokens if all_logits else self.ranks * min(bucket, slots)
        items, source, fed = [], None, []

        def host_or_placeholder(token):
            """A token id, or for a pending token fed on the device its placeholder -j (the j-th fed)."""
            nonlocal source
            if not isinstance(token, PendingToken):
                return token
            if token.step.read or not self.feeds_on_device or source not in (None, token.step):
                return token.step.tokens()[token.index]
            source = token.step
            fed.append(token.step.rows[token.index])
            return -len(fed)

        for seq, tokens in work:
            self._reserve(seq, len(tokens))
            items.append(WorkItem(seq.slot, tuple(seq.pages), seq.length, tuple(map(host_or_placeholder, tokens))))
        batch, item_rows = pack_ranked(items, num_tokens=num_tokens, rows=rows, max_seqs=self.cache_cfg.max_seqs,
                                       pages_per_seq=self.pages_per_seq, pool_pages=self.sizes["P"],
                                       all_logits=all_logits, ranks=self.ranks)
        if fed:  # one small program per token bucket: the rows padded to the bucket
            padded = np.zeros(len(batch["token_ids"]), np.int32)
            padded[:len(fed)] = fed
            batch["token_ids"] = _feed_tokens(batch["token_ids"], source.produced, padded)
        self.last_batch = batch  # the packed inputs of the latest step (for probes and debugging)
        outputs = self.program(self.params, self.caches, batch, with_logits)
        self.caches = {name: outputs[name] for name in self.cache_names}
        for seq, tokens in work:
            seq.length += len(tokens)
        outputs["item_rows"] = item_rows
        return outputs

    def step(self, work: list[tuple[Sequence, list[int]]], all_logits: bool = False) -> list[np.ndarray]:
        """Run one ragged step. Returns, per work item, logits [n, V] (all_logits) or [V] for its last token."""
        outputs = self._run(work, all_logits, True)
        logits = to_host(outputs[LOGITS])
        if not all_logits:
            return [logits[rows[0]] for rows in outputs["item_rows"]]
        return [logits[rows[0]:rows[-1] + 1] for rows in outputs["item_rows"]]

    def step_tokens(self, work: list[tuple[Sequence, list]], sampling: list | None = None,
                    counters: list[int] | None = None) -> list[int]:
        """Run one ragged step; returns the next token of each work item (only token ids leave the device): greedy,
        or drawn with sampling[i] (runtime/sampling.py) as the counters[i]-th token of its request."""
        return self.launch_tokens(work, sampling, counters).tokens()

    def launch_tokens(self, work: list[tuple[Sequence, list]], sampling: list | None = None,
                      counters: list[int] | None = None, logprobs: list[bool] | None = None,
                      prompt_targets: list[list[int] | None] | None = None,
                      histories: list | None = None) -> LaunchedStep:
        """`step_tokens` without waiting for the step: dispatch it and return at once. A work item's tokens may
        hold pending tokens of an earlier launched step (`LaunchedStep.token(i)`), which this step takes on the
        device: a decode loop launches step N + 1 before it reads step N's tokens, so the host's part of a step
        (packing, dispatch: ~1 ms) runs while the device computes the one before (one sequence of the bench preset:
        11.7 ms a step read back each time, 9.8 ms pipelined; docs/benchmarks.md).

        Log-probabilities (kernels/logprobs.py; read with `LaunchedStep.logprobs()`): `logprobs[i]` scores work item
        i's next token; `prompt_targets[i]`, the tokens that follow its first fed tokens (a prompt's next tokens),
        scores each of those — that step then computes every fed token's logits row, as `step(all_logits=True)`.
        `histories[i]` (runtime/sampling.py's History): the tokens sampling[i]'s penalties read, where it has any.
        Log-probabilities score the model's own logits, before any penalty or bias (vLLM's default)."""
        wants_next = list(logprobs) if logprobs is not None else [False] * len(work)
        targets = [list(t or ()) for t in prompt_targets] if prompt_targets is not None else [[] for _ in work]
        scoring = any(wants_next) or any(targets)
        if not scoring and (sampling is None or all(p.argmax for p in sampling)):
            outputs = self._run(work, False, False)
            return LaunchedStep(outputs[NEXT_TOKENS], [rows[0] for rows in outputs["item_rows"]])
        # An artifact exports logits with its R = T buckets only (R = B ones return greedy ids): sample from those,
        # each item's last row. Scoring fed tokens needs every token's row.
        all_rows = not getattr(self.program, "samples", True) or any(targets)
        outputs = self._run(work, all_rows, True)
        item_rows = outputs["item_rows"]
        drawn = sample(outputs[LOGITS], [rows[-1] for rows in item_rows], sampling or [GREEDY] * len(work),
                       counters if counters is not None else [0] * len(work), histories,
                       _pending_tokens(work) if histories is not None and any(histories) else None)
        scored = self._score(outputs[LOGITS], drawn, item_rows, wants_next, targets) if scoring else None
        return LaunchedStep(drawn, list(range(len(work))), scored)

    def _score(self, logits, drawn, item_rows, wants_next: list[bool], targets: list[list[int]]):
        """Launch the log-probabilities a step was asked for: per item, its first len(targets[i]) rows scored
        against those tokens, then (wants_next[i]) its last row against the token drawn there. One call for the
        step, its length padded to a power of two (one program per size)."""
        rows, fixed, source, layout = [], [], [], []
        for index, (item, wants, known) in enumerate(zip(item_rows, wants_next, targets)):
            if len(known) > len(item):
                raise UsageError(f"work item {index}: {len(known)} tokens to score over {len(item)} rows")
            rows += item[:len(known)]
            fixed += known
            source += [-1] * len(known)
            if wants:
                rows.append(item[-1])
                fixed.append(0)
                source.append(index)
            layout.append((len(known), bool(wants)))
        size = 1 << max(0, (len(rows) - 1).bit_length())
        pad = size - len(rows)
        rows, fixed, source = rows + [rows[0]] * pad, fixed + [0] * pad, source + [-1] * pad
        chosen = _scored_tokens(drawn, jnp.asarray(source, jnp.int32), jnp.asarray(fixed, jnp.int32))
        native_ok = None if self.feeds_on_device else False  # a mesh's logits: the jnp rule (sharded like them)
        arrays = token_logprobs(logits, jnp.asarray(rows, jnp.int32), chosen, use_native=native_ok)
        return (*arrays, chosen), layout

    def prefill(self, work: list[tuple[Sequence, list[int]]], all_logits: bool = False,
                with_logits: bool = True) -> list:
        """Feed whole prompts, at most `max_step_tokens` tokens per step (chunked prefill); same results as `step`.

        Returns per prompt: logits [n, V] (all_logits), logits [V] of its last token (with_logits), or its greedy
        next token.
        """
        budget = self.cache_cfg.max_step_tokens
        pending = [list(tokens) for _, tokens in work]
        pieces: list[list] = [[] for _ in work]
        while any(pending):
            batch, owners, left = [], [], budget
            for index, ((seq, _), rest) in enumerate(zip(work, pending)):
                if rest and left > 0:
                    take = rest[:left]
                    del rest[:len(take)]
                    batch.append((seq, take))
                    owners.append(index)
                    left -= len(take)
            outs = (self.step(batch, all_logits=all_logits) if all_logits or with_logits
                    else self.step_tokens(batch))
            for index, out in zip(owners, outs):
                pieces[index].append(out)
        if all_logits:
            return [np.concatenate(p) for p in pieces]
        return [p[-1] for p in pieces]

    # -- generation ------------------------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], max_new_tokens: int, prompt_logits: bool = False,
                 step_logits: bool = False, eos_ids: tuple[int, ...] = (), progress=None) -> dict:
        """Greedy decoding of several prompts together: chunked prefill, then one decode step per token.

        A sequence stops after `max_new_tokens` tokens ("length") or after emitting one of `eos_ids` ("eos", the
        EOS token included in its tokens). Returns tokens and finish_reasons per prompt, plus prompt_logits
        ([n, V] per prompt) and step_logits ([V] per generated token) when asked; otherwise only token ids leave
        the device, and each step is launched on the tokens of the one before still on the device (a sequence whose
        token turns out to be EOS then drops the one extra token made for it).
        """
        if max_new_tokens < 1:
            raise UsageError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        eos = set(eos_ids)
        seqs = [self.add_sequence() for _ in prompts]
        kept: list[list[np.ndarray]] = [[] for _ in prompts]
        try:
            first = self.prefill(list(zip(seqs, prompts)), all_logits=prompt_logits, with_logits=step_logits)
            first_token_at = time.perf_counter()
            if prompt_logits:
                last = [x[-1] for x in first]
            else:
                last = first
            if prompt_logits or step_logits:
                tokens = [[int(np.argmax(x))] for x in last]
                if step_logits:
                    for keep, x in zip(kept, last):
                        keep.append(x)
            else:
                tokens = [[int(t)] for t in last]
            reasons: list[str | None] = [None] * len(prompts)

            def finish(index: int) -> None:
                if tokens[index][-1] in eos:
                    reasons[index] = "eos"
                elif len(tokens[index]) >= max_new_tokens:
                    reasons[index] = "length"

            for index in range(len(prompts)):
                finish(index)
            while step_logits:
                live = [i for i, r in enumerate(reasons) if r is None]
                if not live:
                    break
                outs = self.step([(seqs[i], [tokens[i][-1]]) for i in live])
                for i, x in zip(live, outs):
                    kept[i].append(x)
                    tokens[i].append(int(np.argmax(x)))
                    finish(i)
                if progress:
                    progress()
            # Token ids only: pipelined — step N + 1 is launched on step N's tokens before they are read, for every
            # sequence that may go on (one that then turns out to have emitted EOS drops its extra token).
            launched, launched_for = None, []
            while not step_logits:
                ahead = {i: k for k, i in enumerate(launched_for)}
                live = [i for i, r in enumerate(reasons)
                        if r is None and len(tokens[i]) + (i in ahead) < max_new_tokens]
                if not live and launched is None:
                    break
                following = self.launch_tokens(
                    [(seqs[i], [launched.token(ahead[i]) if i in ahead else tokens[i][-1]]) for i in live]) \
                    if live else None
                if launched is not None:
                    for i, t in zip(launched_for, launched.tokens()):
                        if reasons[i] is None:
                            tokens[i].append(t)
                            finish(i)
                    if progress:
                        progress()
                launched, launched_for = following, live
        finally:
            for seq in seqs:
                self.release(seq)
        result = {"tokens": tokens, "finish_reasons": reasons, "first_token_at": first_token_at}
        if step_logits:
            result["step_logits"] = kept
        if prompt_logits:
            result["prompt_logits"] = first
        return result
