"""Numerical equivalence checking of graphs (design.md §5).

Two graphs are run, jit against jit, on the same seeded inputs: a ragged batch that mixes a decode token, a prefill
continuation and a fresh prefill, over caches made non-empty by a warm-up step of the reference graph. Every output —
the logits and every updated cache (KV pages, conv state, recurrent state) — is compared. The error of an output is
max |candidate − reference| / max |reference|. A check fails when that exceeds the bound, when the candidate has a
NaN or inf where the reference has none, when an output changed shape or dtype, or when a reference output is all
zeros (such a check could not fail, so it proves nothing). Lossy passes add a drift check: greedy decode steps,
teacher-forced with the reference's tokens, each compared.
"""

from __future__ import annotations

import hashlib
import weakref

import attrs
import jax
import numpy as np

from qcompile.ir.graph import Graph
from qcompile.ir.lowering import lower
from qcompile.ir.printer import print_graph

CHECK_PROMPTS = (5, 9)  # warm-up prefills that fill the caches (same 16-token bucket as the check: one compile)
CHECK_WORK = (1, 5, 9)  # then: a decode token, a 5-token continuation, a fresh 9-token prefill


def structural_hash(graph: Graph) -> str:
    """Hash of the graph's text form: equal for structurally identical graphs, whatever their node ids."""
    return hashlib.sha256(print_graph(graph, "g").encode()).hexdigest()


_RUNNERS: "weakref.WeakKeyDictionary[Graph, object]" = weakref.WeakKeyDictionary()


def run_graph(graph: Graph, params: dict, caches: dict, batch: dict) -> dict[str, np.ndarray]:
    """Outputs of one step of `graph` (jitted, not donating: the inputs are reused)."""
    if graph not in _RUNNERS:
        lowered = lower(graph)
        _RUNNERS[graph] = jax.jit(lambda p, c, b: lowered(p, {**c, **b}))
    return {k: np.asarray(v) for k, v in _RUNNERS[graph](params, caches, batch).items()}


@attrs.frozen
class CheckResult:
    ok: bool
    max_error: float  # largest relative error over the outputs
    bound: float
    errors: dict  # output name -> relative error
    reason: str = ""  # why it failed
    drift: float | None = None  # lossy passes: max relative error over the drift decode

    def to_json(self) -> dict:
        return attrs.asdict(self)


def compare(reference: dict, candidate: dict, bound: float) -> CheckResult:
    errors, reasons = {}, []
    for name, ref in reference.items():
        got = candidate.get(name)
        if got is None:
            reasons.append(f"output {name} is missing")
            continue
        if got.shape != ref.shape or got.dtype != ref.dtype:
            reasons.append(f"output {name} changed from {ref.dtype}{list(ref.shape)} to {got.dtype}{list(got.shape)}")
            continue
        ref64, got64 = ref.astype(np.float64), got.astype(np.float64)
        bad = ~np.isfinite(got64) & np.isfinite(ref64)
        if bad.any():
            reasons.append(f"output {name} has {int(bad.sum())} NaN/inf values where the reference has none")
            errors[name] = float("inf")
            continue
        scale = float(np.abs(ref64[np.isfinite(ref64)]).max()) if ref64.size else 0.0
        if scale == 0.0:
            reasons.append(f"reference output {name} is all zeros, so the check cannot fail; refusing to pass it")
            continue
        finite = np.isfinite(ref64)
        errors[name] = float(np.abs(got64[finite] - ref64[finite]).max()) / scale
        if errors[name] > bound:
            reasons.append(f"output {name}: relative error {errors[name]:.3g} > bound {bound:.3g}")
    max_error = max(errors.values(), default=0.0)
    return CheckResult(not reasons, max_error, bound, errors, "; ".join(reasons))


class EquivalenceChecker:
    """Holds the seeded check inputs for one reference graph and its parameters; compares candidates with it."""

    def __init__(self, reference: Graph, params: dict, seed: int = 0, page_size: int | None = None):
        from qcompile.runtime.engine import CacheConfig, Engine

        self.reference, self.params, self.seed = reference, params, seed
        rng = np.random.default_rng(seed)
        vocab = int(reference.meta["vocab_size"])
        engine = Engine(reference, params, CacheConfig(max_seqs=4, max_context=64, max_step_tokens=64))
        bucket = engine.program.token_bucket(max(sum(CHECK_PROMPTS), sum(CHECK_WORK)))
        caches = {k: np.asarray(v) for k, v in engine.caches.items()}
        warm = [engine.add_sequence() for _ in CHECK_PROMPTS]
        warm_work = [(s, rng.integers(3, vocab, n).tolist()) for s, n in zip(warm, CHECK_PROMPTS)]
        # The warm-up runs through the same (non-donating) executable as the checks, so it costs no extra compile.
        out = run_graph(reference, params, caches, engine.pack(warm_work, bucket, bucket, all_logits=True))
        caches = {k: out[k] for k in caches}
        for seq, tokens in warm_work:
            seq.length += len(tokens)
        fresh = engine.add_sequence()
        work = [(s, rng.integers(3, vocab, n).tolist()) for s, n in zip([*warm, fresh], CHECK_WORK)]
        self.batch = engine.pack(work, bucket, bucket, all_logits=True)
        self.caches = caches
        self._outputs: dict[str, dict] = {}
        self.reference_outputs = self.outputs(reference)

    def outputs(self, graph: Graph) -> dict:
        key = structural_hash(graph)
        if key not in self._outputs:
            self._outputs[key] = run_graph(graph, self.params, self.caches, self.batch)
        return self._outputs[key]

    def check(self, candidate: Graph, bound: float, against: Graph | None = None) -> CheckResult:
        """Compare `candidate` with `against` (default: the unoptimized reference) on the check inputs."""
        base = self.reference_outputs if against is None else self.outputs(against)
        return compare(base, self.outputs(candidate), bound)

    def drift(self, candidate: Graph, steps: int, against: Graph | None = None) -> float:
        """Max relative logit error over `steps` greedy decode steps, teacher-forced with the reference's tokens."""
        from qcompile.runtime.engine import CacheConfig, Engine

        base = against or self.reference
        rng = np.random.default_rng(self.seed + 1)
        prompt = rng.integers(3, int(base.meta["vocab_size"]), 8).tolist()
        cfg = CacheConfig(max_seqs=1, max_context=8 + steps + 1)
        engines = [Engine(g, self.params, cfg) for g in (base, candidate)]
        seqs = [e.add_sequence() for e in engines]
        outs = [e.step([(s, prompt)])[0] for e, s in zip(engines, seqs)]
        worst = 0.0
        for _ in range(steps):
            worst = max(worst, float(np.abs(outs[1] - outs[0]).max() / max(np.abs(outs[0]).max(), 1e-30)))
            token = int(np.argmax(outs[0]))
            outs = [e.step([(s, [token])])[0] for e, s in zip(engines, seqs)]
        return worst
