"""Sampling the next token on the device: temperature, top-k and top-p (nucleus) per request, with a per-request
seed, so that only token ids leave the device.

Each request's draw for its n-th generated token uses the key fold_in(PRNGKey(seed), n): what a request samples
depends on its seed, its logits and how many tokens it has made — not on which other requests share the step, on
the batch's row order or on a preemption that recomputed its cache — so a seeded request is reproducible alone, in
any batch and across restarts. Temperature 0 (the default) is greedy: the step's own argmax, no sampling at all.

The filters apply in the order of Hugging Face's and vLLM's samplers: logits / temperature, then top-k (the k
largest; 0 keeps all), then top-p (the smallest set of the most likely tokens whose probability reaches p; 1 keeps
all); ties at a threshold are kept.

Nothing sorts the vocabulary (two sorts per row made a sampled c = 32 decode step 3.3x a greedy one; docs/serving.md
"Sampling"): each row's 256 largest logits (lax.top_k) settle the filters whenever the kept tokens are all among
them, and the token is drawn there; the other rows — temperature alone, k > 256, a nucleus wider than 256 tokens —
are drawn over the whole row, their thresholds found exactly by bisection over the float order. A draw is the
inverse CDF at one uniform per request.
"""

from __future__ import annotations

import functools

import attrs
import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from qcompile.errors import UsageError
from qcompile.kernels.linear import greedy_cpu


@attrs.frozen
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1: no nucleus filter
    seed: int = 0

    def __attrs_post_init__(self):
        if not (self.temperature >= 0 and np.isfinite(self.temperature)):
            raise UsageError(f"temperature (--temperature) must be a finite number >= 0, got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)) or self.top_k < 0:
            raise UsageError(f"top_k (--top-k) must be an integer >= 0 (0: off), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"top_p (--top-p) must be in (0, 1], got {self.top_p}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) or not 0 <= self.seed < 2**32:
            raise UsageError(f"seed (--seed) must be an integer in 0..2^32-1, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = Sampling()


CANDIDATES = 256  # a draw whose filters settle among a row's 256 largest logits never looks at the rest of the row
BLOCK = 1024  # a draw over a whole row goes in two levels: a block of 1024 tokens, then a token in it


def _order_keys(x):
    """uint32 keys ordered as the f32 values x (−inf lowest; −0.0 and 0.0 one key); x holds no NaN."""
    bits = lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.uint32)
    return jnp.where(bits >> 31 != 0, ~bits, bits | jnp.uint32(0x80000000))


def _largest_key(keys, enough):
    """Per row, the largest uint32 t with enough(keys >= t) — enough: [n, V] mask → [n] bool, monotone, true at
    t = 0 — by bisection over the 2^32 keys: 32 passes over the row, exact, no sort."""
    rows = keys.shape[0]

    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2 + ((hi - lo) & 1)  # the upper middle; lo + ... cannot wrap around
        ok = enough(keys >= mid[:, None])
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    lo, _ = lax.fori_loop(0, 32, halve, (jnp.zeros(rows, jnp.uint32), jnp.full(rows, 0xFFFFFFFF, jnp.uint32)))
    return lo


def _keep_whole_rows(x, top_k, top_p):
    """Which tokens top-k and then top-p keep, [n, V] bool, over whole rows of tempered logits x (top_k 0 and top_p 1:
    off). Exactly the sorted-order rule — keep the k largest, then the most likely tokens until their probability
    reaches p, ties at either threshold kept — computed as two value thresholds by bisection instead of sorting
    (a sort of a [32, 248320] row block took 1.7 s on 2 cores, the bisections ~0.1 s each)."""
    rows, vocab = x.shape
    keys = _order_keys(x)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    zero = jnp.zeros(rows, jnp.uint32)
    # the k-th largest value: the largest t with at least k tokens >= t
    kth = lax.cond(jnp.any(k < vocab), lambda: _largest_key(keys, lambda m: jnp.sum(m, -1) >= k), lambda: zero)
    kept = keys >= kth[:, None]
    weight = jnp.where(kept, jnp.exp(x - jnp.max(x, -1, keepdims=True)), 0.0)
    need = top_p * jnp.sum(weight, -1)  # the nucleus's mass, of what top-k kept
    # the nucleus's last value: the largest t whose tokens >= t (of those top-k kept) carry at least p of the mass
    last = lax.cond(jnp.any(top_p < 1),
                    lambda: _largest_key(keys, lambda m: jnp.sum(jnp.where(m, weight, 0.0), -1) >= need),
                    lambda: zero)
    return keys >= jnp.maximum(kth, jnp.where(top_p < 1, last, zero))[:, None]


def filtered_logits(logits, temperature, top_k, top_p):
    """logits [n, V] (f32) scaled by 1/temperature with everything outside top-k and top-p set to -inf."""
    x = logits / jnp.maximum(temperature, 1e-6)[:, None]
    return jnp.where(_keep_whole_rows(x, top_k, top_p), x, -jnp.inf)


def _candidates(x, top_k, top_p):
    """The filters applied to each row's K = min(V, 256) largest tempered logits (lax.top_k: ~0.5 ms per row of
    248320 on 2 cores): (values [n, K] descending, token ids [n, K], keep [n, K], settled [n]). A row is settled when
    its kept tokens are all among the candidates, exactly as `_keep_whole_rows` would keep them: top-k with k ≤ K,
    or top-p whose nucleus the candidates reach, and no tie at the threshold running past the last candidate.
    Unsettled: temperature alone (every token may be drawn), k > K, or a nucleus wider than K tokens."""
    rows, vocab = x.shape
    count = min(vocab, CANDIDATES)
    # No slice of `values` or `ids` below except from 0 (max and min instead of the first and last, a triangular
    # matmul instead of cumsum, whose CPU lowering slices at odd offsets): XLA CPU turns a top_k with such a user
    # back into a sort of the whole row (1.8 s instead of 18 ms at [32, 248320]; tests/test_sampling.py checks).
    values, ids = lax.top_k(x, count)
    first, below = jnp.max(values, -1), jnp.min(values, -1)  # every token past the candidates is <= below
    complete = count == vocab
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(values, jnp.clip(k, 1, count)[:, None] - 1, axis=-1)[:, 0]
    by_k = (top_k > 0) & (k <= count)
    keep = ~by_k[:, None] | (values >= kth[:, None])
    weight = jnp.where(keep, jnp.exp(values - first[:, None]), 0.0)
    kept_mass = jnp.sum(weight, -1)
    # the nucleus is a share of what top-k kept: the candidates' kept mass when top-k settled, else the whole row's
    row_mass = lax.cond(jnp.any(~by_k & (top_p < 1)),
                        lambda: jnp.sum(jnp.exp(x - first[:, None]), -1), lambda: kept_mass)
    total = jnp.where(by_k | complete, kept_mass, row_mass)
    before = _running_sum(weight) - weight  # the mass of the more likely candidates
    needed = jnp.sum(keep & (before < (top_p * total)[:, None]), -1)
    last = jnp.take_along_axis(values, jnp.maximum(needed - 1, 0)[:, None], axis=-1)[:, 0]
    nucleus = top_p < 1
    keep = keep & (~nucleus[:, None] | (values >= last[:, None]))
    settled = (complete | (by_k & (below < kth))
               | (nucleus & (top_k == 0) & (kept_mass >= top_p * total) & (below < last)))
    return values, ids, keep, settled


def _running_sum(weight):
    """Inclusive running sums along the last axis (≤ BLOCK entries) as a matmul with a triangle of ones: no slices
    (see `_candidates`), in f32 (HIGHEST: a TPU's default f32 matmul would round the weights to bf16)."""
    length = weight.shape[-1]
    triangle = jnp.triu(jnp.ones((length, length), jnp.float32))
    return jnp.matmul(weight, triangle, precision=lax.Precision.HIGHEST)


def _draw(weight, u):
    """Per row, an index i drawn with probability weight_i / Σ weight, by the inverse CDF at u ∈ [0, 1); weight ≥ 0
    with a positive sum. Rows longer than BLOCK go in two levels — the block, then the index inside it — so no
    running sum spans more than BLOCK entries (one uniform per row: the Gumbel trick would draw V of them)."""
    rows, length = weight.shape
    if length <= BLOCK:
        running = _running_sum(weight)  # nondecreasing: its max is the total (no slice: see `_candidates`)
        index = jnp.sum(running <= jnp.maximum(u * jnp.max(running, -1), 0.0)[:, None], -1)
        return jnp.minimum(index, _last_positive(weight))
    blocks = -(-length // BLOCK)
    tiled = jnp.pad(weight, ((0, 0), (0, blocks * BLOCK - length))).reshape(rows, blocks, BLOCK)
    sums = jnp.sum(tiled, -1)
    running = jnp.cumsum(sums, -1)
    block = jnp.minimum(jnp.sum(running <= (u * running[:, -1])[:, None], -1), _last_positive(sums))
    inside = jnp.take_along_axis(tiled, block[:, None, None], axis=1)[:, 0]
    before = jnp.take_along_axis(running - sums, block[:, None], axis=-1)[:, 0]
    return block * BLOCK + _draw(inside, (u * running[:, -1] - before) / jnp.sum(inside, -1))


def _last_positive(weight):
    return weight.shape[-1] - 1 - jnp.argmax(weight[:, ::-1] > 0, axis=-1)


@functools.partial(jax.jit, static_argnames=())
def _sample(logits, rows, temperature, top_k, top_p, seeds, counters):
    raw = logits[rows].astype(jnp.float32)
    greedy = greedy_cpu(raw)  # argmax as two vector reductions: XLA CPU's argmax took 13 ms at [32, 248320], this 2
    sampled = temperature > 0
    x = raw / jnp.where(sampled, temperature, 1.0)[:, None]
    top_k, top_p = jnp.where(sampled, top_k, 0), jnp.where(sampled, top_p, 1.0)  # greedy rows filter nothing
    u = jax.vmap(lambda s, c: jax.random.uniform(jax.random.fold_in(jax.random.PRNGKey(s), c)))(seeds, counters)

    def among_candidates():
        values, ids, keep, settled = _candidates(x, top_k, top_p)
        weight = jnp.where(keep, jnp.exp(values - jnp.max(values, -1, keepdims=True)), 0.0)
        return jnp.take_along_axis(ids, _draw(weight, u)[:, None], axis=-1)[:, 0].astype(jnp.int32), settled

    # Without a filter on any sampled row (temperature alone, serve's default) the candidates settle nothing: skip
    # their top_k (most of the sampler's time at a large vocabulary; docs/serving.md "Sampling").
    filtering = jnp.any(sampled & ((top_k > 0) | (top_p < 1)))
    fast, settled = lax.cond(filtering, among_candidates,
                             lambda: (jnp.zeros_like(greedy), jnp.zeros(greedy.shape, jnp.bool_)))

    def whole_rows():
        kept = _keep_whole_rows(x, top_k, top_p)
        return _draw(jnp.where(kept, jnp.exp(x - jnp.max(x, -1, keepdims=True)), 0.0), u).astype(jnp.int32)

    slow = lax.cond(jnp.any(sampled & ~settled), whole_rows, lambda: jnp.zeros_like(fast))
    return jnp.where(sampled, jnp.where(settled, fast, slow), greedy).astype(jnp.int32)


def sample(logits, rows: list[int], params: list[Sampling], counters: list[int]):
    """The next token of each item (on the device): row rows[i] of logits [R, V], drawn with params[i] as the
    counters[i]-th token of its request. The result has R entries (or the power of two ≥ len(rows) if more; its
    first len(rows) are the tokens): items are padded to R with greedy copies of the first, so one program per
    logits shape is ever compiled (a decode step's R is already the power of two its items were bucketed to; a
    padding row costs about what a sampled one does: 8 rows of 32000 took 2.4 ms, 1 row 0.6 ms, on 2 cores)."""
    fill = max(logits.shape[0], 1 << max(0, (len(rows) - 1).bit_length())) - len(rows)  # more items than rows:
    # a power of two
    params = list(params) + [GREEDY] * fill
    return _sample(logits, jnp.asarray(list(rows) + [rows[0]] * fill, jnp.int32),
                   jnp.asarray([p.temperature for p in params], jnp.float32),
                   jnp.asarray([p.top_k for p in params], jnp.int32),
                   jnp.asarray([p.top_p for p in params], jnp.float32),
                   jnp.asarray(np.array([p.seed for p in params], np.uint32)),
                   jnp.asarray(list(counters) + [0] * fill, jnp.int32))


def warm_sampler(logits_shape: tuple[int, int], dtype) -> None:
    """Compile the sampler for logits of `logits_shape` (the only program `sample` runs for that shape)."""
    sample(jnp.zeros(logits_shape, dtype), [0], [GREEDY], [0]).block_until_ready()
