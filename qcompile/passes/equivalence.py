"""Numerical equivalence checking of graphs (design.md §5).

The reference (the unoptimized graph) runs with the reference lowering rules; every candidate runs with the
target's rules (`target`, e.g. "cpu"), so each fast target rule is checked on the user's own graph at compile time,
within the reassociating class. Two graphs are run, jit against jit, on the same seeded inputs: a ragged batch that mixes a decode token, a prefill
continuation and a fresh prefill, over caches made non-empty by a warm-up step of the reference graph. Every output —
the logits and every updated cache (KV pages, conv state, recurrent state) — is compared. The error of an output is
max |candidate − reference| / max |reference|. A check fails when that exceeds the bound, when the candidate has a
NaN or inf where the reference has none, when an output changed shape or dtype, or when a reference output is all
zeros (such a check could not fail, so it proves nothing). An output whose dtype changed (a cache the bf16-state pass
demoted) is compared up-cast, and each graph is given the check's caches in its own cache dtypes; a changed shape
fails — except KV pages, which are compared as each sequence's logical KV [sequences, max_context, Hkv, hd], so a
graph with another page size (kv-page-resize) is given the same logical caches in its own pages and compared
through its own layout's view. Lossy passes add a drift check: greedy decode steps, teacher-forced with the reference's tokens, comparing
each step's logits and greedy token (`Drift`: the largest logit error, the top-1 agreement, the first step where
the greedy tokens differ).

In a bf16 (or f16) graph every non-exact check's bound is at least NOISE_FACTOR times the unoptimized graph's own
rounding noise (`Noise`: the graph on its target's rules against the reference rules, on the check batch, measured
once per checker; a checker on the reference rules has none), capped at NOISE_CAP. A bf16 graph of some depth is further from itself than bf16's reassociating
1e-2 (8 layers of 64 experts top-8: 0.18; the bench preset in bf16: 0.18 — 3.8e-2 and 5.8e-2 while the bf16 cpu rules
were mostly XLA running the reference's own dots, before the native bf16 kernels, which sum in their own order;
`compile --passes none` then failed its own final check), because bf16 rounding flips MoE routes for a few tokens per
layer (design.md §5), and a rewrite
can only be held to what reordering the arithmetic does anyway. The probe runs the target's rules, so a wrong target
rule would widen its own check: the cap keeps a gross error (O(1)) failing, and f32 graphs — where the target rules
are held to 5e-5 — are never widened. What a bf16 check at that depth cannot see, an f32 check of the same pass and
rules can. The report says when a bound was widened.

A lossy comparison (`compare(..., jumps=True)`) forgives jumps: in each output at most one row in JUMP_EVERY (at
least one) may exceed the bound. A lossy change is not small everywhere the way a reordered sum is: where it moves an
MoE router's score across a near-tie, that token takes another expert set and its row (and what that sequence's
cache holds after it) moves by a discrete step — measured on tiny bf16 models with bf16 states, one logits row of 15
at 0.13–0.24 where the others stay under 1.5e-2, its router's expert set differing at that row and nowhere else. A
lossy change that is wrong moves most rows of the check's warm sequences (6 logits rows, 2 of 3 cache sequences), so
it still fails.
"""

from __future__ import annotations

import hashlib
import weakref

import attrs
import jax
import numpy as np

from qcompile.errors import CheckpointError, QCompileError
from qcompile.ir.abi import (CHANNEL_GROUPS, LOGITS, NEXT_TOKENS, CacheConfig, WorkItem, data_parallel_ranks, empty_caches,
                             from_cache_layout, graph_cache_types, pack_ranked, to_cache_layout,
                             token_bucket)
from qcompile.ir.graph import Graph
from qcompile.ir.lowering import is_sharded, local_view, lower_step, whole_view
from qcompile.ir.printer import print_graph
from qcompile.ir.target_layout import in_target_layout
from qcompile.ir.types import dtype_name, np_dtype
from qcompile.ir.weights import fold_weight_preparation, prepare_from, prepared_names

CHECK_PROMPTS = (5, 9)  # warm-up prefills that fill the caches (same 16-token bucket as the check: one compile)
CHECK_WORK = (1, 5, 9)  # then: a decode token, a 5-token continuation, a fresh 9-token prefill
JUMP_EVERY = 8  # a lossy comparison forgives at most one row in this many (at least one) beyond the bound: jumps
NOISE_FACTOR = 3.0  # a bf16 check's bound is at least this many times the unoptimized graph's own noise (Noise)
NOISE_CAP = 0.25  # ... but never over this: a target rule that is wrong (O(1) errors) cannot widen its own check away
NOISY_DTYPES = ("bf16", "f16")  # compute dtypes whose checks are held to the model's own noise; f32's bounds are fixed


def structural_hash(graph: Graph) -> str:
    """Hash of the graph's text form and its caches' channel layout (ir/abi.py CHANNEL_GROUPS, which the text does
    not show): equal for structurally identical graphs, whatever their node ids."""
    layout = repr(sorted(graph.meta.get(CHANNEL_GROUPS, {}).items()))
    return hashlib.sha256((print_graph(graph, "g") + layout).encode()).hexdigest()


_RUNNERS: "weakref.WeakKeyDictionary[Graph, dict]" = weakref.WeakKeyDictionary()
# Parameters from which a checker folds weight preparation out of the step (`PreparedWeights`): below it (the tiny
# test models, a few MB) the preparation costs less per step than compiling each recipe on its own.
FOLD_MIN_BYTES = 64 << 20


class PreparedWeights:
    """A checker's prepared weights: each graph's weight preparation (ir/weights.py) computed once from the
    checker's parameters, not in every step it runs — the drift decode of a fused graph concatenated every expert's
    gate and up weights at each of its 514 steps (bench preset in bf16: 0.55 s a step against 0.12 for the unfused
    graph). Names are recipe hashes, so graphs sharing a recipe share an array; only the last two graphs' are kept
    (a check runs two), so the checker holds at most two prepared copies beside the parameters."""

    def __init__(self, params: dict):
        self.params = params
        self.nbytes = sum(int(getattr(v, "nbytes", 0)) for v in params.values())
        self.arrays: dict = {}
        self.recent: list[set[str]] = []

    def for_graph(self, folded: Graph) -> dict:
        names = set(prepared_names(folded))
        if not self.recent or self.recent[-1] != names:
            self.recent = [*[r for r in self.recent if r != names][-1:], names]
            keep = set().union(*self.recent)
            self.arrays = {k: v for k, v in self.arrays.items() if k in keep}
        return prepare_from(folded, self.params, self.arrays)


def run_graph(graph: Graph, params: "dict | PreparedWeights", caches: dict, batch: dict, target: str = "reference",
              whole: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """Outputs of one step of `graph` lowered with `target`'s rules, its weights in the target's layout as weight
    preparation will lay them out (ir/target_layout.py; jitted, not donating: the inputs are reused); across
    processes each as this process holds it (`local_view`), except the outputs named in `whole`, gathered.

    Given `PreparedWeights` whose parameters take at least FOLD_MIN_BYTES, the graph's weight preparation is folded
    and computed once (`PreparedWeights`); given a plain dict of parameters, smaller ones (compiling each recipe
    costs more than preparing them in every step) or for a graph laid out on a mesh, it runs inside the step."""
    fold = isinstance(params, PreparedWeights) and params.nbytes >= FOLD_MIN_BYTES and not is_sharded(graph)
    runners = _RUNNERS.setdefault(graph, {})
    if (target, fold) not in runners:
        step_graph = fold_weight_preparation(graph, target) if fold else in_target_layout(graph, target)
        lowered = lower_step(step_graph, target)
        runners[target, fold] = (jax.jit(lambda p, c, b: lowered(p, {**c, **b})), step_graph)
    step, step_graph = runners[target, fold]
    if fold:
        params = params.for_graph(step_graph)
    elif isinstance(params, PreparedWeights):
        params = params.params
    return {k: whole_view(v) if k in whole else local_view(v) for k, v in step(params, caches, batch).items()}


def _held(ref: np.ndarray, got, ref_logits):
    """`ref`, `got` and the reference logits restricted to the rows of `got` this process holds (all of them unless
    `got` is masked: another process holds the rest)."""
    if not isinstance(got, np.ma.MaskedArray):
        return ref, got, ref_logits
    rows = ~np.ma.getmaskarray(got).reshape(got.shape[0], -1).any(axis=1) if got.ndim else np.ones((), bool)
    if ref_logits is not None and ref_logits.shape[0] == got.shape[0]:
        ref_logits = ref_logits[rows]
    return ref[rows], got.data[rows], ref_logits


class _Sequences:
    """Slots and pages for the checker's few sequences, placed so that any number of data-parallel ranks dividing
    `spread` finds each sequence's slot and pages on one rank: each sequence has a block of the slots and of the
    pages to itself (with spread 1: slot i, pages [i·M, (i+1)·M)), and on 8 devices the first 4 sequences take
    blocks 0, 2, 4, 6, so both processes of a 2-process mesh hold some."""

    def __init__(self, cache: CacheConfig, page_size: int, spread: int = 1):
        self.cache, self.page_size, self.spread = cache, page_size, spread
        self.pages_per_seq = cache.pages_per_seq(page_size)
        self.lengths: list[int] = []

    def add(self) -> int:
        self.lengths.append(0)
        return len(self.lengths) - 1

    def _place(self, seq: int) -> tuple[int, int]:
        """(slot, first page) of sequence `seq`."""
        # consecutive sequences `step` blocks apart, so a few sequences still reach every process's devices
        step = max(1, self.spread // 4) if self.spread % 4 == 0 else 1
        turn = seq * step
        block, index = (turn + turn // self.spread) % self.spread, seq // self.spread
        slot = block * (self.cache.max_seqs // self.spread) + index
        first = block * (self.cache.pool_pages(self.page_size) // self.spread) + index * self.pages_per_seq
        return slot, first

    def logical_kv(self, pages):
        """Each sequence's KV in this layout's pages, [sequences, max_context, Hkv, hd]: the view a cache compares
        in, whatever the page size (pages no sequence owns are left out)."""
        ma = isinstance(pages, np.ma.MaskedArray)
        views = []
        for seq in range(len(self.lengths)):
            _, first = self._place(seq)
            block = pages[first:first + self.pages_per_seq]
            views.append(block.reshape(-1, *block.shape[2:])[:self.cache.max_context])
        return (np.ma.stack if ma else np.stack)(views)

    def paged_kv(self, logical: np.ndarray, like_shape: tuple[int, ...], dtype) -> np.ndarray:
        """The pages of this layout that hold `logical` ([sequences, max_context, Hkv, hd]); the rest are zero."""
        pages = np.zeros((self.cache.pool_pages(self.page_size), self.page_size, *like_shape[2:]), dtype)
        span = self.pages_per_seq * self.page_size
        for seq in range(len(self.lengths)):
            _, first = self._place(seq)
            flat = np.zeros((span, *like_shape[2:]), dtype)
            flat[:self.cache.max_context] = logical[seq]
            pages[first:first + self.pages_per_seq] = flat.reshape(self.pages_per_seq, self.page_size,
                                                                   *like_shape[2:])
        return pages

    def pack(self, work: list[tuple[int, list[int]]], num_tokens: int, all_logits: bool = True,
             ranks: int = 1) -> tuple[dict, list[list[int]]]:
        """The batch for a graph with `ranks` ranks (token slots per rank: the bucket of the fullest rank's tokens,
        at least num_tokens // ranks) and each work item's logit rows. Advances the sequences."""
        items = []
        for seq, tokens in work:
            start = self.lengths[seq]
            used = -(-(start + len(tokens)) // self.page_size)
            slot, first = self._place(seq)
            items.append(WorkItem(slot, tuple(range(first, first + used)), start, tuple(tokens)))
            self.lengths[seq] += len(tokens)
        if ranks > 1:
            if self.spread % ranks:
                raise QCompileError(f"the check spreads its sequences over {self.spread} devices (the reference "
                                    f"graph's mesh), which {ranks} data-parallel ranks do not divide; give the "
                                    "reference graph the candidate's mesh")
            slots = self.cache.max_seqs // ranks
            fullest = max(sum(len(i.tokens) for i in items if i.slot // slots == r) for r in range(ranks))
            num_tokens = ranks * max(token_bucket(fullest), num_tokens // ranks, 1)
        rows = num_tokens if all_logits else self.cache.max_seqs
        return pack_ranked(items, num_tokens=num_tokens, rows=rows, max_seqs=self.cache.max_seqs,
                           pages_per_seq=self.pages_per_seq, pool_pages=self.cache.pool_pages(self.page_size),
                           all_logits=all_logits, ranks=ranks)


def outputs_by_item(outputs: dict, rows: list[list[int]]) -> dict:
    """The step's logits and tokens taken at the work items' rows, in work order (the row layout depends on the
    graph's ranks; padding rows are dropped); the caches as they are (their layout is the same for every rank count)."""
    index = np.array([r for item in rows for r in item], np.int64)
    return {name: value[index] if name in (LOGITS, NEXT_TOKENS) else value for name, value in outputs.items()}


@attrs.frozen
class CheckResult:
    ok: bool
    max_error: float  # largest relative error over the outputs
    bound: float
    errors: dict  # output name -> relative error
    reason: str = ""  # why it failed
    drift: float | None = None  # lossy passes: median relative logit error over the drift decode steps
    drift_max: float | None = None  # lossy passes: the largest step's
    agreement: float | None = None  # lossy passes: fraction of drift steps whose greedy tokens agree
    first_divergence: int | None = None  # lossy passes: first drift step whose greedy tokens differ (None: none)
    drift_steps: int | None = None
    retyped: dict = attrs.field(factory=dict)  # output name -> "f32 -> bf16" for outputs compared across dtypes
    # lossy comparisons: output name -> {"rows", "of", "max_error"} of the rows forgiven as jumps (a flipped MoE route;
    # max_error None for token ids); `errors` and `max_error` are then over the other rows
    jumps: dict = attrs.field(factory=dict)
    agreement_outside_ties: float | None = None  # lossy passes: `agreement` counting near-ties of the reference as kept
    class_bound: float | None = None  # the pass class's bound; `bound` is larger where the model's own noise is
    noise: float | None = None  # the unoptimized graph's own rounding noise on the check batch (`Noise.error`)

    def to_json(self) -> dict:
        return attrs.asdict(self)


def describe_check(check: dict) -> str:
    """A check's error for a report line (from `CheckResult.to_json()`): the max error and bound, and the rows a lossy
    comparison forgave as jumps."""
    if check.get("class_bound") is not None and check["bound"] > check["class_bound"]:
        text = (f"max error {check['max_error']:.2e} (bound {check['bound']:.2e}: {NOISE_FACTOR:g} x the unoptimized "
                f"graph's own rounding noise {check['noise']:.2e}, over the class's {check['class_bound']:.0e})")
    else:
        text = f"max error {check['max_error']:.2e} (bound {check['bound']:.0e})"
    jumps = [f"{name} {jump['rows']}/{jump['of']} rows" + ("" if jump["max_error"] is None
                                                           else f" to {jump['max_error']:.2e}")
             for name, jump in (check.get("jumps") or {}).items()]
    if jumps:
        text += f"; forgiven as jumps (where an MoE route flips): {', '.join(jumps)}"
    return text


@attrs.frozen
class Noise:
    """How far reordering the unoptimized graph's arithmetic alone moves its outputs on the check batch: the graph on
    its target's rules against the reference rules. Measured for bf16 and f16 graphs: in a bf16 graph of some depth
    it is the measure a rewrite is held to (module docstring)."""

    error: float  # the largest relative error over the float outputs
    token_rows: float  # the fraction of greedy-token rows whose ids differ


@attrs.frozen
class Drift:
    """A teacher-forced greedy decode compared step by step (step 0 is the prompt's last position)."""

    steps: int
    max_error: float  # largest relative logit error over the steps
    median_error: float  # the median step's: accumulated drift, not one step where an MoE router's near-tie flipped
    agreement: float  # fraction of steps whose greedy (argmax) tokens agree
    first_divergence: int | None  # first step whose greedy tokens differ
    # fraction of steps whose greedy tokens agree or differ only at a near-tie of the reference's own logits (the
    # candidate's token within `tie_bound` of the best, relative to the step's largest logit)
    agreement_outside_ties: float


def _jump_allowance(rows: int) -> int:
    """Rows of an output a lossy comparison may forgive as jumps: one in JUMP_EVERY, at least one."""
    return max(1, rows // JUMP_EVERY)


def _near_tie(logits: np.ndarray, chosen: np.ndarray, bound: float, scale: float) -> np.ndarray:
    """Whether each row's `chosen` token scores within `bound` × `scale` (the logits' largest magnitude) of the
    row's best: a differing greedy token there is a near-tie of the reference, not a change."""
    gap = logits.max(axis=-1) - np.take_along_axis(logits, chosen[..., None], axis=-1)[..., 0]
    return gap <= bound * scale


def _compare_token_ids(name: str, ref, got, ref_logits, bound: float, jumps: bool = False,
                       noise: float = 0.0) -> tuple[float, str, int]:
    """Integer outputs (greedy token ids) are compared as tokens, not numbers: the error is the fraction of rows whose
    ids differ. A differing row is forgiven where it is a near-tie in the reference's own logits — the
    candidate's token scores within `bound` (relative to the logits' scale) of the reference's best — because a
    pass in the reassociating class may legitimately flip an exact tie and nothing else; and, as jumps, where the
    rows left number at most one in JUMP_EVERY (`jumps`: a lossy comparison) or NOISE_FACTOR times the fraction
    `noise` of rows whose ids the unoptimized graph's own rounding noise changes. Returns (error, reason, rows
    forgiven as jumps)."""
    differ = np.asarray(ref != got).reshape(ref.shape[0], -1).any(axis=1) if ref.size else np.zeros(0, bool)
    if ref_logits is not None and differ.any() and ref_logits.shape[0] == ref.shape[0] and ref.ndim == 1:
        logits = np.asarray(ref_logits, np.float64)
        rows = np.flatnonzero(differ)
        chosen = np.clip(np.asarray(got)[rows].astype(np.int64), 0, logits.shape[1] - 1)
        in_range = (np.asarray(got)[rows] >= 0) & (np.asarray(got)[rows] < logits.shape[1])
        scale = float(np.abs(logits[np.isfinite(logits)]).max()) if logits.size else 0.0
        differ[rows[in_range & _near_tie(logits[rows], chosen, bound, scale)]] = False
    allowed = max(_jump_allowance(differ.size) if jumps else 0, int(NOISE_FACTOR * noise * differ.size))
    if 0 < differ.sum() <= allowed:
        return 0.0, "", int(differ.sum())
    fraction = float(differ.mean()) if differ.size else 0.0
    if fraction:
        return fraction, (f"output {name}: {int(differ.sum())} of {differ.size} token ids differ where the reference "
                          f"logits have no near-tie"), 0
    return 0.0, "", 0


def _row_errors(ref64: np.ndarray, got64: np.ndarray, scale: float) -> np.ndarray:
    """Each row's (leading index's) largest |candidate − reference| relative to the output's scale."""
    finite = np.isfinite(ref64)
    diff = np.where(finite, np.abs(got64 - np.where(finite, ref64, 0.0)), 0.0) / scale
    return diff.reshape(diff.shape[0] if diff.ndim else 1, -1).max(axis=1) if diff.size else np.zeros(0)


def compare(reference: dict, candidate: dict, bound: float, jumps: bool = False,
            noise: "Noise | None" = None) -> CheckResult:
    """Every output of `candidate` against `reference` within `bound` (module docstring); `jumps`: a lossy
    comparison, which forgives at most one row in JUMP_EVERY of each output beyond the bound; `noise`: the
    unoptimized graph's own rounding noise, which widens a non-zero bound to NOISE_FACTOR times it where that is
    larger."""
    class_bound = bound
    if noise is not None and bound > 0:  # the exact class stays bitwise in any dtype
        bound = max(bound, min(NOISE_CAP, NOISE_FACTOR * noise.error))
    errors, token_errors, reasons, retyped, jumped = {}, {}, [], {}, {}
    for name, ref in reference.items():
        got = candidate.get(name)
        if got is None:
            reasons.append(f"output {name} is missing")
            continue
        if got.shape != ref.shape:
            reasons.append(f"output {name} changed from {ref.dtype}{list(ref.shape)} to {got.dtype}{list(got.shape)}")
            continue
        if got.dtype != ref.dtype:
            retyped[name] = f"{dtype_name(ref.dtype)} -> {dtype_name(got.dtype)}"
        partial = isinstance(got, np.ma.MaskedArray)
        ref, got, ref_logits = _held(np.asarray(ref), got, reference.get(LOGITS))
        if np.issubdtype(ref.dtype, np.integer):
            token_errors[name], reason, forgiven = _compare_token_ids(
                name, ref, got, ref_logits, bound, jumps, noise.token_rows if noise is not None and bound > 0 else 0.0)
            if forgiven:
                jumped[name] = {"rows": forgiven, "of": int(ref.shape[0]) if ref.ndim else 1, "max_error": None}
            if reason:
                reasons.append(reason)
            continue
        if partial and not ref.size:
            continue  # another process holds every row of it (each process compares the blocks it holds)
        ref64, got64 = ref.astype(np.float64), got.astype(np.float64)
        bad = ~np.isfinite(got64) & np.isfinite(ref64)
        if bad.any():
            reasons.append(f"output {name} has {int(bad.sum())} NaN/inf values where the reference has none")
            errors[name] = float("inf")
            continue
        finite = ref64[np.isfinite(ref64)]
        if ref64.size and not finite.size:  # the unoptimized model itself: nothing here to compare against
            raise CheckpointError(f"the unoptimized model's output {name} is all NaN/inf on the check inputs: the "
                                  "checkpoint's weights or config give non-finite values (check them, e.g. for NaN "
                                  "tensors); no pass can be checked against it")
        scale = float(np.abs(finite).max()) if finite.size else 0.0
        if scale == 0.0 and partial:  # this process's blocks hold no check sequence (all padding): compare exactly
            scale = 1.0
        elif scale == 0.0:
            reasons.append(f"reference output {name} is all zeros, so the check cannot fail; refusing to pass it")
            continue
        rows = _row_errors(ref64, got64, scale)
        over = rows > bound
        if jumps and 0 < over.sum() <= _jump_allowance(rows.size):
            jumped[name] = {"rows": int(over.sum()), "of": int(rows.size), "max_error": float(rows.max())}
            rows = rows[~over]
        errors[name] = float(rows.max(initial=0.0))
        if errors[name] > bound:
            worst = f" ({int(over.sum())} of {rows.size} rows)" if jumps else ""
            reasons.append(f"output {name}: relative error {errors[name]:.3g} > bound {bound:.3g}{worst}")
    max_error = max(errors.values(), default=0.0)  # token outputs are a fraction of rows, not a relative error
    return CheckResult(not reasons, max_error, bound, {**errors, **token_errors}, "; ".join(reasons), retyped=retyped,
                       jumps=jumped, class_bound=class_bound, noise=noise.error if noise is not None else None)


class EquivalenceChecker:
    """Holds the seeded check inputs for one reference graph and its parameters; compares candidates with it.

    The reference runs with the reference rules; candidates run with `target`'s rules.
    """

    def __init__(self, reference: Graph, params: dict, seed: int = 0, target: str = "reference"):
        self.reference, self.params, self.seed, self.target = reference, params, seed, target
        self.prepared = PreparedWeights(params)
        rng = np.random.default_rng(seed)
        vocab = int(reference.meta["vocab_size"])
        page_size = self.page_size = int(reference.meta["page_size"])
        mesh = reference.meta.get("mesh")
        # Sequences spread over every device, so a candidate with any number of data-parallel ranks can run them.
        self.spread = mesh.size if mesh is not None else 1
        self.cache = CacheConfig(max_seqs=self.spread * -(-4 // self.spread), max_context=64, max_step_tokens=64)
        seqs = _Sequences(self.cache, page_size, self.spread)
        self.bucket = token_bucket(max(sum(CHECK_PROMPTS), sum(CHECK_WORK)))
        caches = empty_caches(graph_cache_types(reference), self.cache.sizes(page_size))
        warm = [seqs.add() for _ in CHECK_PROMPTS]
        warm_work = [(s, rng.integers(3, vocab, n).tolist()) for s, n in zip(warm, CHECK_PROMPTS)]
        # The warm-up runs through the same (non-donating) executable as the checks, so it costs no extra compile.
        # (a reproducer's reference may itself be laid out on data-parallel ranks)
        out = run_graph(reference, self.prepared, caches,
                        seqs.pack(warm_work, self.bucket, ranks=data_parallel_ranks(reference))[0])
        caches = {k: out[k] for k in caches}
        fresh = seqs.add()
        self.work = [(s, rng.integers(3, vocab, n).tolist()) for s, n in zip([*warm, fresh], CHECK_WORK)]
        self._seqs_after_warmup = list(seqs.lengths)
        self.batch, self.rows = self._pack(self.work, 1)
        self.caches = caches
        self._outputs: dict[tuple[str, str], dict] = {}
        self._noise: Noise | None = None
        self.reference_outputs = self.outputs(reference, "reference")

    def outputs(self, graph: Graph, target: str | None = None) -> dict:
        """`graph`'s outputs on the check inputs; KV page caches as each sequence's logical KV (`_Sequences.logical_kv`),
        so graphs with different page sizes compare."""
        target = self.target if target is None else target
        key = (structural_hash(graph), target)
        if key not in self._outputs:
            ranks, page_size = data_parallel_ranks(graph), int(graph.meta["page_size"])
            caches = self.caches
            if page_size != self.page_size:  # another layout: the same logical KV in its own pages
                mine = self._layout(page_size)
                caches = {name: mine.paged_kv(self._reference_layout().logical_kv(np.asarray(value)),
                                              value.shape, np.asarray(value).dtype) if is_kv_pages(name) else value
                          for name, value in caches.items()}
            caches = {name: to_cache_layout(graph, name, value) for name, value in caches.items()}
            if ranks == 1 and page_size == self.page_size:
                batch, rows = self.batch, self.rows
            else:
                batch, rows = self._pack(self.work, ranks, page_size)
            out = run_graph(graph, self.prepared, in_cache_dtypes(graph, caches), batch, target)
            self._outputs[key] = outputs_by_item(self.comparable(graph, out), rows)
        return self._outputs[key]

    def comparable(self, graph: Graph, out: dict) -> dict:
        """`graph`'s raw step outputs on the check batch with its KV page caches as each check sequence's logical KV
        (the form `outputs` compares) and regrouped channels (tensor parallelism's conv state) in the plain order."""
        after = self._layout(int(graph.meta["page_size"]), advanced=True)
        return {name: after.logical_kv(value) if is_kv_pages(name) else from_cache_layout(graph, name, value)
                for name, value in out.items()}

    def _layout(self, page_size: int, advanced: bool = False) -> "_Sequences":
        """The check's sequences in a layout of `page_size` (their lengths after the warm-up, or after the check
        batch too)."""
        seqs = _Sequences(self.cache, page_size, self.spread)
        seqs.lengths = list(self._seqs_after_warmup)
        if advanced:
            for seq, tokens in self.work:
                seqs.lengths[seq] += len(tokens)
        return seqs

    def _reference_layout(self) -> "_Sequences":
        return self._layout(self.page_size)

    def _pack(self, work, ranks: int, page_size: int | None = None):
        """The check batch (after the warm-up) laid out for `ranks` data-parallel ranks and pages of `page_size`
        (default: the reference's), and its logit rows."""
        return self._layout(self.page_size if page_size is None else page_size).pack(work, self.bucket, ranks=ranks)

    def check(self, candidate: Graph, bound: float, against: Graph | None = None, jumps: bool = False) -> CheckResult:
        """Compare `candidate` (target rules) with `against` (target rules; default: the unoptimized reference with
        the reference rules) on the check inputs; `jumps`: a lossy comparison (`compare`)."""
        base = self.reference_outputs if against is None else self.outputs(against)
        return compare(base, self.outputs(candidate), bound, jumps=jumps, noise=self.noise)

    @property
    def noise(self) -> Noise:
        """The unoptimized graph's own rounding noise on the check batch (`Noise`), measured once (the first check of a
        pass runs the same graph and rules, so it costs nothing more); none in f32 or on the reference rules."""
        if self._noise is None and (self.reference.meta["dtype"] not in NOISY_DTYPES or self.target == "reference"):
            self._noise = Noise(0.0, 0.0)
        if self._noise is None:
            reordered = self.outputs(self.reference, self.target)
            probe = compare(self.reference_outputs, reordered, float("inf"))
            tokens = 0.0
            if NEXT_TOKENS in reordered and NEXT_TOKENS in self.reference_outputs:
                got, ref = reordered[NEXT_TOKENS], self.reference_outputs[NEXT_TOKENS]
                held = ~(np.ma.getmaskarray(got) | np.ma.getmaskarray(ref))  # across processes: the rows held here
                if held.any():
                    tokens = float(np.mean((np.ma.getdata(got) != np.ma.getdata(ref))[held]))
            self._noise = Noise(probe.max_error, tokens)
        return self._noise

    def drift(self, candidate: Graph, steps: int, against: Graph | None = None, tie_bound: float = 0.0) -> Drift:
        """`steps` greedy decode steps after an 8-token prompt, both graphs teacher-forced with the reference's tokens:
        the largest relative logit error, the top-1 agreement (also counting a differing token as kept where the
        reference's own logits are within `tie_bound` of a tie) and the first step where the greedy tokens differ."""
        base = against or self.reference
        rng = np.random.default_rng(self.seed + 1)
        prompt = rng.integers(3, int(base.meta["vocab_size"]), 8).tolist()
        cache = CacheConfig(max_seqs=self.spread, max_context=len(prompt) + steps + 1)
        runs = []
        for graph, target in ((base, "reference" if against is None else self.target), (candidate, self.target)):
            page_size = int(graph.meta["page_size"])  # each graph in its own layout
            seqs = _Sequences(cache, page_size, self.spread)
            seqs.add()
            caches = empty_caches(graph_cache_types(graph), cache.sizes(page_size))
            runs.append([graph, target, seqs, caches])
        errors, token, agree, near_ties, first = [], None, 0, 0, None
        for step in range(steps + 1):
            tokens = prompt if step == 0 else [token]
            logits = []
            for run in runs:
                graph, target, seqs, caches = run
                batch, rows = seqs.pack([(0, tokens)], token_bucket(len(tokens)), all_logits=False,
                                        ranks=data_parallel_ranks(graph))
                out = run_graph(graph, self.prepared, caches, batch, target, whole=(LOGITS,))
                run[3] = {k: out[k] for k in caches}  # across processes, each feeds back the blocks it holds
                logits.append(out["logits"][rows[0][0]])
            ref, got = (np.asarray(x, np.float64) for x in logits)
            errors.append(float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30)))
            token, chosen = int(np.argmax(ref)), int(np.argmax(got))
            if chosen == token:
                agree += 1
                continue
            first = step if first is None else first
            near_ties += bool(_near_tie(ref, np.int64(chosen), tie_bound, float(np.abs(ref).max())))
        return Drift(steps + 1, max(errors), float(np.median(errors)), agree / (steps + 1), first,
                     (agree + near_ties) / (steps + 1))


def is_kv_pages(name: str) -> bool:
    return name.endswith((".k_pages", ".v_pages"))


def in_cache_dtypes(graph: Graph, caches: dict) -> dict:
    """The check's caches as `graph` declares them (a bf16 state cache gets the f32 values rounded to bf16)."""
    types = graph_cache_types(graph)
    return {name: value.astype(np_dtype(types[name].dtype)) if name in types else value
            for name, value in caches.items()}
