"""OpenAI's `logprobs` objects from scored tokens: the completions API's (`tokens`, `token_logprobs`, `top_logprobs`,
`text_offset`) and the chat API's (`content`: token, logprob, bytes, top_logprobs). `serve` builds them from the
(token id, engine.TokenLogprob or None) pairs a choice or chunk reports (runtime/server.py), the token texts from
frontend/tokenizer.py's TokenStrings.

Shapes follow OpenAI's reference and, where it is silent, vLLM's server: a prompt's first token (echo) has no
log-probability (null); a completions `top_logprobs` entry holds the `logprobs` most likely tokens and the chosen one
(so up to logprobs + 1 keys, as OpenAI documents; tokens that spell the same text share a key); chat's `top_logprobs`
lists exactly the `top_logprobs` most likely. A log-probability too small for f32 (-inf) is written -9999.0, as vLLM
does: JSON has no infinity.
"""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = ["chat_logprobs", "completion_logprobs"]

FLOOR = -9999.0


def _finite(value: float) -> float:
    return value if math.isfinite(value) else FLOOR


def completion_logprobs(scored: list, top: int, strings: Callable, offset: int = 0) -> dict:
    """The completions API's logprobs of `scored` tokens whose text starts at `offset` in the choice's text."""
    tokens, values, tops, offsets = [], [], [], []
    for token, score in scored:
        text = strings(token)[0]
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if score is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(_finite(score.logprob))
        best: dict[str, float] = {}
        for t, lp in (*score.top[:top], (token, score.logprob)):  # most likely first; a shared key keeps the first
            best.setdefault(strings(t)[0], _finite(lp))
        tops.append(best)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def _chat_token(token: int, logprob: float, strings: Callable) -> dict:
    text, raw = strings(token)
    return {"token": text, "logprob": _finite(logprob), "bytes": raw}


def chat_logprobs(scored: list, top: int, strings: Callable) -> list[dict]:
    """The chat API's logprobs `content` list of `scored` tokens (every one scored)."""
    return [{**_chat_token(token, score.logprob, strings),
             "top_logprobs": [_chat_token(t, lp, strings) for t, lp in score.top[:top]]}
            for token, score in scored]
