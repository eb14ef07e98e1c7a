"""Sampling the next token on the device: temperature, top-k and top-p (nucleus) per request, with a per-request
seed, so that only token ids leave the device.

Each request's draw for its n-th generated token uses the key fold_in(PRNGKey(seed), n): what a request samples
depends on its seed, its logits and how many tokens it has made — not on which other requests share the step, on
the batch's row order or on a preemption that recomputed its cache — so a seeded request is reproducible alone, in
any batch and across restarts. Temperature 0 (the default) is greedy: the step's own argmax, no sampling at all.

The filters apply in the order of Hugging Face's and vLLM's samplers: logits / temperature, then top-k (the k
largest; 0 keeps all), then top-p (the smallest set of the most likely tokens whose probability reaches p; 1 keeps
all); ties at a threshold are kept.
"""

from __future__ import annotations

import functools

import attrs
import jax
import jax.numpy as jnp
import numpy as np

from qcompile.errors import UsageError


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


def filtered_logits(logits, temperature, top_k, top_p):
    """logits [n, V] (f32) scaled by 1/temperature with everything outside top-k and top-p set to -inf."""
    x = logits / jnp.maximum(temperature, 1e-6)[:, None]
    ordered = jnp.sort(x, axis=-1)[:, ::-1]  # descending
    vocab = x.shape[-1]
    kth = jnp.take_along_axis(ordered, (jnp.clip(top_k, 1, vocab) - 1)[:, None], axis=-1)
    x = jnp.where((top_k[:, None] > 0) & (x < kth), -jnp.inf, x)
    probs = jax.nn.softmax(x, axis=-1)
    sorted_probs = jnp.sort(probs, axis=-1)[:, ::-1]
    before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs  # mass of the more likely tokens
    last = jnp.maximum(jnp.sum(before < top_p[:, None], axis=-1) - 1, 0)  # the last token the nucleus needs
    threshold = jnp.take_along_axis(sorted_probs, last[:, None], axis=-1)
    return jnp.where(probs < threshold, -jnp.inf, x)


@functools.partial(jax.jit, static_argnames=())
def _sample(logits, rows, temperature, top_k, top_p, seeds, counters):
    x = logits[rows].astype(jnp.float32)
    greedy = jnp.argmax(x, axis=-1).astype(jnp.int32)
    keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.PRNGKey(s), c))(seeds, counters)
    drawn = jax.vmap(jax.random.categorical)(keys, filtered_logits(x, temperature, top_k, top_p)).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, greedy)


def sample(logits, rows: list[int], params: list[Sampling], counters: list[int]):
    """The next token of each item (on the device): row rows[i] of logits [R, V], drawn with params[i] as the
    counters[i]-th token of its request. The result has a power-of-two length ≥ len(rows) (its first len(rows)
    entries are the tokens): items are padded with greedy copies of the first so that only one program per
    (R, padded count) is ever compiled, not one per count (`sampler_shapes` lists them, for a warm-up)."""
    padded = 1 << max(0, (len(rows) - 1).bit_length())
    fill = padded - len(rows)
    params = list(params) + [GREEDY] * fill
    return _sample(logits, jnp.asarray(list(rows) + [rows[0]] * fill, jnp.int32),
                   jnp.asarray([p.temperature for p in params], jnp.float32),
                   jnp.asarray([p.top_k for p in params], jnp.int32),
                   jnp.asarray([p.top_p for p in params], jnp.float32),
                   jnp.asarray(np.array([p.seed for p in params], np.uint32)),
                   jnp.asarray(list(counters) + [0] * fill, jnp.int32))


def warm_sampler(logits_shape: tuple[int, int], dtype) -> None:
    """Compile the sampler for logits of `logits_shape` and every padded item count up to its rows."""
    logits = jnp.zeros(logits_shape, dtype)
    count = 1
    while count <= logits_shape[0]:
        sample(logits, [0] * count, [GREEDY] * count, [0] * count).block_until_ready()
        count *= 2
