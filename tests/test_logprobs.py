"""Log-probabilities: the device rule (kernels/logprobs.py: the native kernel against the jnp rule and both against
numpy's log-softmax and stable sort, ties and bf16 included), each token's bytes and text (TokenStrings), what the
engine and scheduler score (made tokens and prompt tokens, against the log-softmax of a reference step's logits;
sampled tokens scored at the token drawn; the tokens themselves unchanged; a preempted request's scores the same),
and `serve`'s logprobs in OpenAI's completions (echo too) and chat shapes, streamed and whole alike.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from qcompile.frontend.tokenizer import TokenStrings
from qcompile.ir.abi import CacheConfig
from qcompile.kernels.logprobs import TOP_LOGPROBS, native_available, token_logprobs, token_logprobs_reference
from qcompile.runtime.sampling import Sampling
from qcompile.runtime.scheduler import Request, Scheduler


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    top = x.max(-1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(-1, keepdims=True))


def _expected(logits: np.ndarray, rows, targets, k: int):
    """The definition: log-softmax in f64, the k largest by a stable sort (the lower id first among equals)."""
    lp = _log_softmax(logits.astype(np.float32)[rows])
    order = np.argsort(-logits.astype(np.float32)[rows], axis=-1, kind="stable")[:, :k]
    return lp[np.arange(len(rows)), targets], np.take_along_axis(lp, order, -1), order


@pytest.mark.parametrize("vocab, dtype", [(20, np.float32), (63, np.float32), (64, ml_dtypes.bfloat16),
                                          (65, np.float32), (1000, ml_dtypes.bfloat16), (5003, np.float32)])
@pytest.mark.parametrize("rule", ["reference", "native"])
def test_token_logprobs_follow_the_definition(vocab, dtype, rule):
    """Random rows (repeated and out of order), random targets, logits rounded so ties are common (bf16 logits tie
    often): the log-probabilities within f32 rounding of numpy's, the top ids exactly the stable sort's. A rule that
    skipped the normaliser, broke ties the other way, or missed a late large logit fails."""
    if rule == "native" and not native_available(dtype):
        pytest.skip("the native kernel cannot be built here")
    rng = np.random.default_rng(vocab)
    logits = np.round(rng.normal(0, 3, (6, vocab)) * 2) / 2 + 0.0  # half-integers: many equal logits (no -0.0,
    # which lax.top_k ranks below 0.0)
    logits[2, -1] = 50.0  # the largest logit of a row in its last, partial block
    logits = logits.astype(dtype)
    rows, targets = [3, 0, 2, 2, 5], rng.integers(0, vocab, 5)
    k = min(TOP_LOGPROBS, vocab)
    got = token_logprobs(jnp.asarray(logits), rows, targets, k, use_native=rule == "native")
    chosen, top, ids = (np.asarray(a) for a in got)
    want_chosen, want_top, want_ids = _expected(np.asarray(logits), rows, targets, k)
    assert np.array_equal(ids, want_ids)
    np.testing.assert_allclose(chosen, want_chosen, atol=2e-5, rtol=0)
    np.testing.assert_allclose(top, want_top, atol=2e-5, rtol=0)
    assert ids[2, 0] == vocab - 1 and top[2, 0] > -1e-6  # 50 dwarfs the rest: probability ~1


def test_every_id_ranked_when_k_is_the_vocabulary():
    """k = V: every entry written, the ids a permutation in the stable order (nothing left from a buffer)."""
    logits = (np.round(np.random.default_rng(1).normal(0, 2, (3, 40)), 1) + 0.0).astype(np.float32)
    for use_native in ([False, True] if native_available(np.float32) else [False]):
        _, top, ids = (np.asarray(a) for a in token_logprobs(jnp.asarray(logits), [0, 1, 2], [0, 0, 0], 40,
                                                               use_native=use_native))
        assert all(sorted(row) == list(range(40)) for row in ids)
        assert np.array_equal(ids, np.argsort(-logits, -1, kind="stable"))
        np.testing.assert_allclose(np.exp(top.astype(np.float64)).sum(-1), 1.0, atol=1e-5)


def test_the_reference_rule_is_what_jnp_computes():
    logits = jnp.asarray(np.random.default_rng(2).normal(size=(4, 300)), jnp.float32)
    chosen, _, ids = token_logprobs_reference(logits, jnp.asarray([1, 3]), jnp.asarray([7, 8]), 5)
    np.testing.assert_allclose(np.asarray(chosen), _expected(np.asarray(logits), [1, 3], [7, 8], 5)[0], atol=1e-5)
    assert ids.shape == (2, 5) and ids.dtype == jnp.int32


def test_token_strings_give_each_tokens_own_bytes():
    """The bytes of a text's tokens, one after another, are the text's UTF-8 (a token may end inside a character:
    its text is then U+FFFD); special tokens are their content; an id past the tokenizer is token_id:N."""
    from qcompile.frontend.tokenizer import TokenStrings, train_tiny_tokenizer

    tokenizer = train_tiny_tokenizer(512)
    strings = TokenStrings(tokenizer)
    text = "Grüße, 世界 — a compiler reads </s>"
    ids = tokenizer.encode(text).ids
    assert b"".join(bytes(strings(t)[1]) for t in ids) == text.encode("utf-8")
    assert any("\ufffd" in strings(t)[0] for t in ids)  # the CJK characters are split across byte tokens
    assert strings(2) == ("</s>", list(b"</s>")) and strings(9999) == ("token_id:9999", None)
    assert strings(ids[1])[0] == tokenizer.decode([ids[1]])


# -- engine and scheduler -----------------------------------------------------------------------------------------

PROMPTS = [[3, 17, 42, 9, 250], [(7 * i + 5) % 500 + 3 for i in range(23)], [11, 12]]


@pytest.fixture(scope="module")
def model(tmp_path_factory, qc_model):
    from conftest import write_small

    from qcompile.frontend.tokenizer import TOKENIZER_FILE, train_tiny_tokenizer

    path = write_small(tmp_path_factory.mktemp("logprobs") / "m", seed=5)
    train_tiny_tokenizer(512).save(str(path / TOKENIZER_FILE))
    return qc_model(path)


def _reference(model, tokens: list[int]) -> np.ndarray:
    """log-softmax of every row of one whole step over `tokens` (f64)."""
    engine = model.engine(CacheConfig(max_seqs=1, max_context=64, max_step_tokens=64))
    seq = engine.add_sequence()
    logits = engine.step([(seq, tokens)], all_logits=True)[0]
    engine.release(seq)
    return _log_softmax(logits)


def _check_scores(model, request: Request) -> None:
    lp = _reference(model, request.prompt + request.tokens)
    assert [s.token for s in request.prompt_scores] == request.prompt[1:]
    assert [s.token for s in request.token_logprobs] == request.tokens
    for position, score in enumerate([*request.prompt_scores, *request.token_logprobs]):
        assert abs(score.logprob - lp[position, score.token]) < 2e-5, position
        order = np.argsort(-lp[position], kind="stable")[:TOP_LOGPROBS]
        assert [t for t, _ in score.top] == list(order), position
        np.testing.assert_allclose([v for _, v in score.top], lp[position, order], atol=2e-5)


def test_the_scheduler_scores_prompt_and_made_tokens(model):
    """Prompts fed in chunks of 8 beside other requests' decodes, greedy and sampled: every prompt token after the
    first and every made token scored as the whole sequence's reference step scores it (a chunk boundary that lost
    or repeated a row, or a score taken at the wrong row, fails); the tokens are those made without logprobs."""
    def run(scored: bool):
        engine = model.engine(CacheConfig(max_seqs=2, max_context=64, max_step_tokens=8))
        requests = [Request(p, 5, id=i, logprobs=scored, prompt_logprobs=scored and i != 2,
                            sampling=Sampling(0.8, seed=i) if i == 1 else Sampling()) for i, p in enumerate(PROMPTS)]
        Scheduler(engine).run(requests)
        return requests

    plain, scored = run(False), run(True)
    assert [r.tokens for r in scored] == [r.tokens for r in plain]
    assert not any(r.token_logprobs or r.prompt_scores for r in plain)
    for request in scored[:2]:
        _check_scores(model, request)
    assert scored[2].prompt_scores == [] and len(scored[2].token_logprobs) == 5
    assert scored[0].token_logprobs[0].top[0][0] == scored[0].tokens[0]  # greedy: the most likely token


def test_a_preempted_request_keeps_one_score_per_token(model):
    """Three requests in a pool too small for all: the one preempted is fed again from scratch, and its prompt is
    not scored twice (nor its made tokens): the same scores as alone."""
    prompts = [[(13 * i + 7 * r) % 490 + 5 for i in range(10)] for r in range(3)]
    engine = model.engine(CacheConfig(max_seqs=3, max_context=32, num_pages=4, max_step_tokens=8))
    requests = [Request(p, 12, id=i, logprobs=True, prompt_logprobs=True) for i, p in enumerate(prompts)]
    Scheduler(engine).run(requests)
    assert sum(r.preemptions for r in requests) >= 1
    for request in requests:
        _check_scores(model, request)


def test_a_recompute_scores_only_what_was_not_scored():
    """After a preemption the prompt is fed again in chunks that need not fall where the first ones did: a chunk
    that straddles the scored part asks for its rows' targets and keeps only the new scores."""
    request = Request(list(range(10, 20)), 4, prompt_logprobs=True)
    request.feed, request.prompt_scores = list(request.prompt), ["s1", "s2", "s3", "s4", "s5"]  # prompt[1..5]
    request.prefilled = 0
    assert Scheduler._prompt_targets(request, 4) == []  # rows 0..3 score prompt[1..4]: all scored
    request.prefilled = 3
    assert Scheduler._prompt_targets(request, 4) == [14, 15, 16, 17]  # prompt[4..7]: two are new
    Scheduler._keep_prompt_scores(request, 3, ["a4", "a5", "a6", "a7"])
    assert request.prompt_scores == ["s1", "s2", "s3", "s4", "s5", "a6", "a7"]
    request.prefilled = 8
    assert Scheduler._prompt_targets(request, 4) == [19]  # the last prompt token; the rest is decoding
    request.prefilled = 10
    assert Scheduler._prompt_targets(request, 1) == []


# -- serve --------------------------------------------------------------------------------------------------------

httpx = pytest.importorskip("httpx")


@pytest.fixture(scope="module")
def server(model):
    pytest.importorskip("uvicorn")
    from server_harness import Server

    from qcompile.frontend.chat import TINY_CHAT_TEMPLATE, ChatTemplate
    from qcompile.frontend.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model.checkpoint.path, "test")
    template = ChatTemplate.compile(TINY_CHAT_TEMPLATE, "tiny", {"bos_token": "<s>", "eos_token": "</s>"})
    srv = Server(model.engine(CacheConfig(max_seqs=2, max_context=64, max_step_tokens=8)), tokenizer,
                 chat_template=template)
    srv.tokenizer = tokenizer
    yield srv
    srv.close()


def _post(server, path: str, body: dict):
    response = httpx.post(server.url + path, json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _streamed(server, path: str, body: dict) -> list[dict]:
    response = httpx.post(server.url + path, json={**body, "stream": True}, timeout=120)
    events = [line[len("data: "):] for line in response.text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e)["choices"][0] for e in events[:-1]]


def _joined(chunks: list[dict]) -> dict:
    """The completions logprobs of a stream's chunks, one after another."""
    parts = [c["logprobs"] for c in chunks if c["logprobs"] is not None]
    return {key: [v for part in parts for v in part[key]] for key in ("tokens", "token_logprobs", "top_logprobs",
                                                                        "text_offset")}


def test_completion_logprobs_in_openais_shape(server, model):
    """logprobs = 3: each made token's text, log-probability (the reference's), the 3 most likely and the chosen
    (4 keys at most, the chosen among them), offsets into the text; streamed chunks add up to the same."""
    prompt = PROMPTS[1]
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 3}
    choice = _post(server, "/v1/completions", body)["choices"][0]
    logprobs, ids = choice["logprobs"], choice["token_ids"]
    lp = _reference(model, prompt + ids)
    assert len(logprobs["tokens"]) == len(ids) == 6
    strings = TokenStrings(server.tokenizer)
    for j, (token, value, top) in enumerate(zip(ids, logprobs["token_logprobs"], logprobs["top_logprobs"])):
        row = lp[len(prompt) - 1 + j]
        assert abs(value - row[token]) < 2e-5 and logprobs["tokens"][j] == strings(token)[0]
        best = np.argsort(-row, kind="stable")[:3]
        # the 3 most likely and the chosen, by text (tokens that spell the same text share a key: the likelier's)
        assert list(top) == list(dict.fromkeys([strings(t)[0] for t in [*best, token]]))
        assert top[strings(best[0])[0]] == pytest.approx(row.max(), abs=2e-5)
    assert logprobs["text_offset"][0] == 0
    assert np.all(np.diff(logprobs["text_offset"]) == [len(t) for t in logprobs["tokens"][:-1]])
    streamed = _streamed(server, "/v1/completions", body)
    assert _joined(streamed) == logprobs
    assert all(c["logprobs"] is None for c in _post(server, "/v1/completions", {**body, "logprobs": None})["choices"])


def test_echo_scores_the_prompt(server, model):
    """echo with logprobs (how evaluation harnesses score a text): the text starts with the prompt's, the first
    prompt token has no log-probability, every other one its reference value; max_tokens 0 makes nothing; streamed,
    the first chunk leads with the prompt."""
    tokenizer = server.tokenizer
    text = "A compiler reads a program"
    prompt = tokenizer.encode(text).ids
    lp = _reference(model, prompt)
    whole = _post(server, "/v1/completions", {"prompt": text, "max_tokens": 0, "echo": True, "logprobs": 1})
    choice = whole["choices"][0]
    assert choice["text"] == text and choice["token_ids"] == [] and choice["finish_reason"] == "length"
    assert whole["usage"]["completion_tokens"] == 0
    logprobs = choice["logprobs"]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert len(logprobs["tokens"]) == len(prompt)
    np.testing.assert_allclose(logprobs["token_logprobs"][1:], lp[np.arange(len(prompt) - 1), prompt[1:]],
                               atol=2e-5)
    assert "".join(logprobs["tokens"]) == text
    body = {"prompt": text, "max_tokens": 3, "echo": True, "logprobs": 2, "temperature": 0}
    made = _post(server, "/v1/completions", body)["choices"][0]
    assert made["text"].startswith(text) and len(made["logprobs"]["tokens"]) == len(prompt) + 3
    assert made["logprobs"]["token_logprobs"][:len(prompt)] == logprobs["token_logprobs"]
    chunks = _streamed(server, "/v1/completions", body)
    assert chunks[0]["text"].startswith(text) and "".join(c["text"] for c in chunks) == made["text"]
    assert _joined(chunks) == made["logprobs"]
    echoed = _post(server, "/v1/completions", {"prompt": text, "max_tokens": 2, "echo": True, "temperature": 0})
    assert echoed["choices"][0]["text"].startswith(text) and echoed["choices"][0]["logprobs"] is None


def test_chat_logprobs_in_openais_shape(server, model):
    """logprobs true with top_logprobs 2: content lists each made token with its bytes, log-probability and the 2
    most likely; streamed deltas carry the same entries; without top_logprobs the lists are empty."""
    body = {"messages": [{"role": "user", "content": "What is a compiler?"}], "max_tokens": 5, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}
    choice = _post(server, "/v1/chat/completions", body)["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == len(choice["token_ids"]) == 5
    for entry, token in zip(content, choice["token_ids"]):
        assert entry["bytes"] == list(entry["token"].encode()) or "\ufffd" in entry["token"]
        assert len(entry["top_logprobs"]) == 2 and entry["top_logprobs"][0]["logprob"] >= entry["logprob"] - 1e-6
        assert entry["top_logprobs"][0]["token"] == entry["token"]  # greedy: the chosen is the most likely
    chunks = _streamed(server, "/v1/chat/completions", body)
    assert [e for c in chunks if c["logprobs"] for e in c["logprobs"]["content"]] == content
    plain = _post(server, "/v1/chat/completions", {**body, "top_logprobs": None})["choices"][0]["logprobs"]
    assert [e["top_logprobs"] for e in plain["content"]] == [[]] * 5
    assert [e["logprob"] for e in plain["content"]] == [e["logprob"] for e in content]
