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

Before any of that, a request may adjust its logits, greedy requests too (the order of vLLM's sampler): OpenAI's
`logit_bias` is added; a repetition penalty r divides a positive logit by r and multiplies a negative one by r for
every token in the prompt or made so far (Hugging Face's and vLLM's rule); then OpenAI's frequency and presence
penalties subtract f × (times made) + p × (made at all), over the tokens made only. After the temperature, min-p
keeps the tokens at least min_p times as likely as the most likely one (vLLM's rule, before top-k and top-p). The
adjustments are one gather and one scatter over the (request, token) pairs they touch, which the host builds from each
request's `History` (only those pairs travel); a request that adjusts nothing costs nothing.
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
    min_p: float = 0.0  # 0: no min-p filter
    presence_penalty: float = 0.0  # subtracted from each token made at all (OpenAI's range: -2..2)
    frequency_penalty: float = 0.0  # subtracted per time a token was made (-2..2)
    repetition_penalty: float = 1.0  # a token of the prompt or made so far: logit / r if positive, else × r
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit: -100..100)

    def __attrs_post_init__(self):
        if not (self.temperature >= 0 and np.isfinite(self.temperature)):
            raise UsageError(f"temperature (--temperature) must be a finite number >= 0, got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)) or self.top_k < 0:
            raise UsageError(f"top_k (--top-k) must be an integer >= 0 (0: off), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"top_p (--top-p) must be in (0, 1], got {self.top_p}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) or not 0 <= self.seed < 2**32:
            raise UsageError(f"seed (--seed) must be an integer in 0..2^32-1, got {self.seed!r}")
        if not 0 <= self.min_p <= 1:
            raise UsageError(f"min_p (--min-p) must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise UsageError(f"{name} (--{name.replace('_', '-')}) must be in [-2, 2], got {getattr(self, name)}")
        if not (0 < self.repetition_penalty and np.isfinite(self.repetition_penalty)):
            raise UsageError(f"repetition_penalty (--repetition-penalty) must be a finite number > 0 (1: off), got "
                             f"{self.repetition_penalty}")
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) and t >= 0 and -100 <= b <= 100
                   for t, b in self.logit_bias):
            raise UsageError("logit_bias maps token ids >= 0 to biases in [-100, 100]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_history(self) -> bool:
        """Whether its logits depend on the tokens before (a penalty): the sampler needs its `History`."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def adjustments(self) -> dict:
        """min_p and the penalties that are set (not at their no-op values), by field name."""
        offs = {"min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
        return {name: getattr(self, name) for name, off in offs.items() if getattr(self, name) != off}

    @property
    def argmax(self) -> bool:
        """Whether its token is the raw logits' argmax: greedy with nothing adjusted (a step's own greedy ids)."""
        return self.greedy and not self.uses_history and not self.logit_bias


GREEDY = Sampling()


@attrs.define(eq=False)
class History:
    """What a request's penalties read, kept up to date as it makes tokens: the distinct tokens of its prompt (for a
    repetition penalty) and of what it made (`made`: the request's own list, read, not copied), sorted, with how
    many times each was made. A step adds a token or two (an insertion into arrays of ~thousands), so the pairs a
    step sends cost a few numpy operations per request, not a walk over everything it made."""

    made: list
    tokens: np.ndarray  # sorted distinct token ids
    times: np.ndarray  # float64: how many times each was made
    in_prompt: np.ndarray  # bool: in the prompt (read by the repetition penalty only)
    counted: int = 0  # how much of `made` is in `times`

    @classmethod
    def of(cls, prompt, made: list, sampling: Sampling) -> "History":
        seen = np.unique(np.asarray(prompt, np.int64)) if sampling.repetition_penalty != 1 else np.zeros(0, np.int64)
        return cls(made, seen, np.zeros(len(seen)), np.ones(len(seen), bool))

    def update(self) -> "History":
        """Count the tokens made since the last call."""
        if self.counted == len(self.made):
            return self
        new, times = np.unique(np.asarray(self.made[self.counted:], np.int64), return_counts=True)
        self.counted = len(self.made)
        at = np.searchsorted(self.tokens, new)
        present = at < len(self.tokens)
        present[present] = self.tokens[at[present]] == new[present]
        self.times[at[present]] += times[present]
        absent = ~present
        if absent.any():
            self.tokens = np.insert(self.tokens, at[absent], new[absent])
            self.times = np.insert(self.times, at[absent], times[absent].astype(np.float64))
            self.in_prompt = np.insert(self.in_prompt, at[absent], False)
        return self


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


def _adjusted(raw, pairs, penalties):
    """raw [n, V] with each (item, token) pair's adjustment applied (the module docstring's order). pairs = (items,
    tokens, bias, times made, in the prompt), one entry per distinct pair, each item's entries together in token
    order; an entry whose item is n (padding) changes nothing. penalties = per item (repetition, frequency,
    presence)."""
    items, tokens, bias, times, in_prompt = pairs
    repetition, frequency, presence = (a[jnp.minimum(items, raw.shape[0] - 1)] for a in penalties)
    value = raw.at[items, tokens].get(mode="fill", fill_value=0.0) + bias
    made = times > 0
    factor = jnp.where(made | (in_prompt > 0), repetition, 1.0)
    value = jnp.where(value > 0, value / factor, value * factor) - frequency * times - jnp.where(made, presence, 0.0)
    return raw.at[items, tokens].set(value, mode="drop")


def _with_pending(x, raw, pairs, spans, pending, penalties):
    """x (raw adjusted by `_adjusted`) with each item's pending token — made by the step before, still on the device,
    so not in the pairs' counts — counted once more: its logit adjusted from raw as a token made times + 1 times
    (its bias and count found by bisection in the item's span of the pairs). pending [n]: the token, -1 for none."""
    items, tokens, bias, times, _ = pairs
    if tokens.shape[0] == 0:  # no item is penalised (none has a pending token to count)
        return x
    start, end = spans
    rows = jnp.arange(x.shape[0])

    def halve(_, bounds):  # the first entry of the span whose token is >= pending
        lo, hi = bounds
        mid = (lo + hi) // 2
        below = tokens[jnp.minimum(mid, tokens.shape[0] - 1)] < pending
        return jnp.where((lo < hi) & below, mid + 1, lo), jnp.where((lo < hi) & ~below, mid, hi)

    steps = max(1, int(tokens.shape[0]).bit_length())
    at, _ = lax.fori_loop(0, steps, halve, (start, end))
    safe = jnp.minimum(at, tokens.shape[0] - 1)
    found = (at < end) & (tokens[safe] == pending) & (items[safe] == rows)
    repetition, frequency, presence = penalties
    count = jnp.where(found, times[safe], 0.0) + 1
    value = raw.at[rows, pending].get(mode="fill", fill_value=0.0) + jnp.where(found, bias[safe], 0.0)
    value = jnp.where(value > 0, value / repetition, value * repetition) - frequency * count - presence
    return x.at[jnp.where(pending >= 0, rows, x.shape[0]), jnp.maximum(pending, 0)].set(value, mode="drop")


def _min_p(x, min_p):
    """Tempered logits x [n, V] with the tokens less than min_p times as likely as the row's most likely at -inf."""
    floor = jnp.max(x, -1) + jnp.log(jnp.maximum(min_p, 1e-30))
    return jnp.where((min_p > 0)[:, None] & (x < floor[:, None]), -jnp.inf, x)


@functools.partial(jax.jit, static_argnames=())
def _sample(logits, rows, temperature, top_k, top_p, seeds, counters, min_p, pairs, spans, pending, penalties):
    unadjusted = logits[rows].astype(jnp.float32)
    raw = _adjusted(unadjusted, pairs, penalties)
    raw = lax.cond(jnp.any(pending >= 0), lambda: _with_pending(raw, unadjusted, pairs, spans, pending, penalties),
                   lambda: raw)
    greedy = greedy_cpu(raw)  # argmax as two vector reductions: XLA CPU's argmax took 13 ms at [32, 248320], this 2
    sampled = temperature > 0
    x = raw / jnp.where(sampled, temperature, 1.0)[:, None]
    top_k, top_p = jnp.where(sampled, top_k, 0), jnp.where(sampled, top_p, 1.0)  # greedy rows filter nothing
    min_p = jnp.where(sampled, min_p, 0.0)
    x = lax.cond(jnp.any(min_p > 0), lambda: _min_p(x, min_p), lambda: x)
    u = jax.vmap(lambda s, c: jax.random.uniform(jax.random.fold_in(jax.random.PRNGKey(s), c)))(seeds, counters)

    def among_candidates():
        values, ids, keep, settled = _candidates(x, top_k, top_p)
        # min-p's -inf past the candidates (their last is -inf): every token it keeps is among them
        settled = settled | (jnp.min(values, -1) == -jnp.inf)
        weight = jnp.where(keep, jnp.exp(values - jnp.max(values, -1, keepdims=True)), 0.0)
        return jnp.take_along_axis(ids, _draw(weight, u)[:, None], axis=-1)[:, 0].astype(jnp.int32), settled

    # Without a filter on any sampled row (temperature alone, serve's default) the candidates settle nothing: skip
    # their top_k (most of the sampler's time at a large vocabulary; docs/serving.md "Sampling").
    filtering = jnp.any(sampled & ((top_k > 0) | (top_p < 1) | (min_p > 0)))
    fast, settled = lax.cond(filtering, among_candidates,
                             lambda: (jnp.zeros_like(greedy), jnp.zeros(greedy.shape, jnp.bool_)))

    def whole_rows():
        kept = _keep_whole_rows(x, top_k, top_p)
        return _draw(jnp.where(kept, jnp.exp(x - jnp.max(x, -1, keepdims=True)), 0.0), u).astype(jnp.int32)

    slow = lax.cond(jnp.any(sampled & ~settled), whole_rows, lambda: jnp.zeros_like(fast))
    return jnp.where(sampled, jnp.where(settled, fast, slow), greedy).astype(jnp.int32)


def _pairs(params: list[Sampling], histories: list, items: int, vocab: int):
    """The (item, token) pairs of `_adjusted` as numpy arrays — (items, tokens, bias, times made, in the prompt), one
    entry per distinct pair, each item's together in token order — padded to a power of 4 from 1024 with entries of
    item `items` (dropped): one sampler program per size, each ~1.5 s to compile on 2 cores the first time a step
    needs it (five sizes cover 32 requests of 8000 distinct tokens each; a padded entry costs next to nothing); and
    each item's span of them (start, end). histories[i] is params[i]'s History (None when it uses none)."""
    parts, spans, at = [], ([0] * items, [0] * items), 0
    for index, (param, history) in enumerate(zip(params, histories)):
        if not param.uses_history and not param.logit_bias:
            continue
        if param.uses_history:
            history.update()
            tokens, times, in_prompt = history.tokens, history.times, history.in_prompt
        else:
            tokens, times, in_prompt = np.zeros(0, np.int64), np.zeros(0), np.zeros(0, bool)
        bias = np.zeros(len(tokens))
        if param.logit_bias:
            biased = dict(param.logit_bias)  # a token's last bias, as a JSON object's last key wins
            ids = np.array([t for t in biased if 0 <= t < vocab], np.int64)
            merged = np.union1d(tokens, ids)
            spread = np.searchsorted(merged, tokens)
            wide_times, wide_prompt = np.zeros(len(merged)), np.zeros(len(merged), bool)
            wide_times[spread], wide_prompt[spread] = times, in_prompt
            tokens, times, in_prompt, bias = merged, wide_times, wide_prompt, np.zeros(len(merged))
            bias[np.searchsorted(merged, ids)] = [biased[int(t)] for t in ids]
        parts.append((np.full(len(tokens), index), tokens, bias, times, in_prompt))
        spans[0][index], spans[1][index] = at, at + len(tokens)
        at += len(tokens)
    size = 0 if not parts else 1 << max(10, 2 * -(-(at - 1).bit_length() // 2))  # a power of 4 from 1024
    arrays = [np.concatenate([part[k] for part in parts]) if parts else np.zeros(0) for k in range(5)]
    fills = (items, 0, 0.0, 0.0, 0.0)
    dtypes = (np.int32, np.int32, np.float32, np.float32, np.float32)
    pairs = tuple(np.concatenate([a.astype(dt), np.full(size - at, fill, dt)])
                  for a, fill, dt in zip(arrays, fills, dtypes))
    return pairs, tuple(np.asarray(span, np.int32) for span in spans)


@functools.partial(jax.jit, static_argnames=("fill",))
def _penalised_pending(pending, penalised, fill: int):
    """pending padded with `fill` -1s, -1 where the item is not penalised."""
    return jnp.where(penalised, jnp.pad(pending, (0, fill), constant_values=-1), -1)


def sample(logits, rows: list[int], params: list[Sampling], counters: list[int], histories: list | None = None,
           pending=None):
    """The next token of each item (on the device): row rows[i] of logits [R, V], drawn with params[i] as the
    counters[i]-th token of its request, its logits adjusted by its penalties over histories[i] (a `History`; None
    for an item whose sampling uses none) and pending[i] (a device int32 array of len(rows), -1 for none): the
    token the step before made for it, which its History does not hold yet (a pipelined step). The result has R
    entries (or the power of two ≥ len(rows) if more; its first len(rows) are the tokens): items are padded to R
    with greedy copies of the first, so one program per logits shape (and number of adjusted (item, token) pairs,
    in powers of 4 from 1024) is ever compiled (a decode step's R is already the power of two its items were
    bucketed to; a padding row costs about what a sampled one does: 8 rows of 32000 took 2.4 ms, 1 row 0.6 ms, on
    2 cores)."""
    fill = max(logits.shape[0], 1 << max(0, (len(rows) - 1).bit_length())) - len(rows)  # more items than rows:
    # a power of two
    params = list(params) + [GREEDY] * fill
    histories = list(histories if histories is not None else [None] * len(rows)) + [None] * fill
    missing = [i for i, (p, h) in enumerate(zip(params, histories)) if p.uses_history and h is None]
    if missing:
        raise UsageError(f"item {missing[0]} samples with penalties but was given no History of its tokens")
    pairs, spans = _pairs(params, histories, len(params), logits.shape[-1])
    penalised = np.array([p.uses_history for p in params])
    if pending is None or not penalised.any():
        pending = jnp.full(len(params), -1, jnp.int32)
    else:  # only a penalised item counts its pending token
        pending = _penalised_pending(pending, jnp.asarray(penalised), fill)
    penalties = tuple(jnp.asarray([getattr(p, name) for p in params], jnp.float32)
                      for name in ("repetition_penalty", "frequency_penalty", "presence_penalty"))
    return _sample(logits, jnp.asarray(list(rows) + [rows[0]] * fill, jnp.int32),
                   jnp.asarray([p.temperature for p in params], jnp.float32),
                   jnp.asarray([p.top_k for p in params], jnp.int32),
                   jnp.asarray([p.top_p for p in params], jnp.float32),
                   jnp.asarray(np.array([p.seed for p in params], np.uint32)),
                   jnp.asarray(list(counters) + [0] * fill, jnp.int32),
                   jnp.asarray([p.min_p for p in params], jnp.float32), tuple(jnp.asarray(a) for a in pairs),
                   tuple(jnp.asarray(a) for a in spans), pending, penalties)


def pairs_sizes(pairs: int) -> list[int]:
    """The sizes the sampler's (request, token) pairs are padded to (`_pairs`) for up to `pairs` of them."""
    sizes = []
    while pairs > 0 and (not sizes or sizes[-1] < pairs):
        sizes.append(4 * sizes[-1] if sizes else 1024)
    return sizes


def warm_sampler(logits_shape: tuple[int, int], dtype, pairs: int = 0) -> None:
    """Compile the sampler for logits of `logits_shape` (the only program `sample` runs for that shape without
    penalties) and, for `pairs` > 0, its programs for every size of up to that many penalised (request, token) pairs
    (~1.5 s each on 2 cores: what a run that knows its penalties compiles before it is timed)."""
    logits = jnp.zeros(logits_shape, dtype)
    sample(logits, [0], [GREEDY], [0]).block_until_ready()
    n = logits_shape[0]
    for size in pairs_sizes(pairs):
        empty = (np.full(size, n, np.int32), np.zeros(size, np.int32), *(np.zeros(size, np.float32),) * 3)
        _sample(logits, jnp.zeros(n, jnp.int32), jnp.zeros(n), jnp.zeros(n, jnp.int32), jnp.ones(n),
                jnp.zeros(n, jnp.uint32), jnp.zeros(n, jnp.int32), jnp.zeros(n), tuple(map(jnp.asarray, empty)),
                (jnp.zeros(n, jnp.int32),) * 2, jnp.full(n, -1, jnp.int32),
                (jnp.ones(n), jnp.zeros(n), jnp.zeros(n))).block_until_ready()
