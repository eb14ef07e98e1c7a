"""Token log-probabilities on the device: what a server's `logprobs` option returns.

`token_logprobs(logits[R, V], rows[n], targets[n]) -> (logprob f32[n], top_logprobs f32[n, K], top_ids i32[n, K])`:
for each i, row rows[i] of the logits as the model's distribution over the next token (log-softmax in f32 of the raw
logits: before temperature, top-k or top-p, as vLLM's default `raw_logprobs` and OpenAI's API report), the
log-probability of targets[i] (the token drawn there, or the prompt's next token) and the K = TOP_LOGPROBS most
likely tokens, most likely first, the lower id first among equal logits. Only these n·(2K + 1) numbers leave the
device; a server trims the top list to what each request asked for.

Two rules, same results: the jnp one (any target, and the reference the tests hold the other to) and, on CPU, the
native kernel kernels/native/token_logprobs.cc, one pass over each row for its maximum and the top K (a running
K-th-largest threshold rejects almost every logit with one compare) and one for the sum of exponentials. XLA CPU
spent 18 ms on the jnp rule at [32, 248320] — 11.6 of them in lax.top_k, which sorts — against a 57 ms c = 32 decode
step on the bench preset; the kernel's time is in docs/serving.md "Logprobs".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from qcompile.kernels import native

TOP_LOGPROBS = 20  # the most any request may ask for: OpenAI's chat `top_logprobs` limit, vLLM's default max_logprobs
NATIVE = {jnp.dtype(jnp.float32): "qcompile_token_logprobs_f32", jnp.dtype(jnp.bfloat16): "qcompile_token_logprobs_bf16"}


def token_logprobs_reference(logits, rows, targets, k: int = TOP_LOGPROBS):
    """The jnp rule (see the module docstring)."""
    x = logits[rows].astype(jnp.float32)
    top = jnp.max(x, axis=-1, keepdims=True)
    normaliser = top + jnp.log(jnp.sum(jnp.exp(x - top), axis=-1, keepdims=True))
    chosen = jnp.take_along_axis(x, targets[:, None].astype(jnp.int32), axis=-1)[:, 0] - normaliser[:, 0]
    values, ids = lax.top_k(x, k)  # descending; equal values: the lower index first
    return chosen, values - normaliser, ids.astype(jnp.int32)


def _native_call(logits, rows, targets, k: int):
    n = rows.shape[0]
    call = jax.ffi.ffi_call(NATIVE[jnp.dtype(logits.dtype)],
                            (jax.ShapeDtypeStruct((n,), jnp.float32), jax.ShapeDtypeStruct((n, k), jnp.float32),
                             jax.ShapeDtypeStruct((n, k), jnp.int32)))
    return call(logits, rows.astype(jnp.int32), targets.astype(jnp.int32))


def native_available(dtype) -> bool:
    """Whether the native kernel serves logits of `dtype` in this process (CPU, kernel built)."""
    name = NATIVE.get(jnp.dtype(dtype))
    return name is not None and jax.default_backend() == "cpu" and native.ensure(name)


@functools.partial(jax.jit, static_argnames=("k", "use_native"))
def _token_logprobs(logits, rows, targets, k: int, use_native: bool):
    if use_native:
        return _native_call(logits, rows, targets, k)
    return token_logprobs_reference(logits, rows, targets, k)


def token_logprobs(logits, rows, targets, k: int = TOP_LOGPROBS, use_native: bool | None = None):
    """See the module docstring. rows and targets: int arrays of one length n (targets may be a device array, e.g.
    the step's drawn tokens); `use_native` None picks the native kernel where it is available."""
    if not 0 < k <= logits.shape[-1]:
        raise ValueError(f"k must be in 1..{logits.shape[-1]}, got {k}")
    if use_native is None:
        use_native = native_available(logits.dtype)
    return _token_logprobs(logits, jnp.asarray(rows, jnp.int32), jnp.asarray(targets, jnp.int32), k, use_native)
