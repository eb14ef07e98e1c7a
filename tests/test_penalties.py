"""Penalties, logit bias and min-p (runtime/sampling.py): the adjusted logits are exactly OpenAI's and vLLM's
formulas (a penalty over the prompt where it belongs to the made tokens only, a repetition penalty that subtracts or
ignores a negative logit's sign, a bias applied after the penalties would all fail), the repetition penalty and min-p
are Hugging Face transformers' own processors; through the scheduler, greedy decoding with penalties makes
transformers' tokens on a tiny checkpoint (`generate(repetition_penalty=...)`, and a transformers decode loop with
the OpenAI penalties), and a penalised sampled request is the same alone, in a batch and after a preemption.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from qcompile.errors import UsageError
from qcompile.ir.abi import CacheConfig
from qcompile.runtime import sampling
from qcompile.runtime.sampling import GREEDY, History, Sampling, sample
from qcompile.runtime.scheduler import Request, Scheduler

VOCAB = 64


def _penalties(params: list[Sampling]):
    return tuple(jnp.asarray([getattr(p, name) for p in params], jnp.float32)
                 for name in ("repetition_penalty", "frequency_penalty", "presence_penalty"))


def _adjusted(logits: np.ndarray, params: list[Sampling], histories: list, pending=None) -> np.ndarray:
    """The sampler's adjusted logits of items 0..len(params)-1 (pending: each item's token still on the device)."""
    pairs, spans = sampling._pairs(params, histories, len(params), logits.shape[-1])
    pairs, spans = tuple(jnp.asarray(a) for a in pairs), tuple(jnp.asarray(a) for a in spans)
    raw = jnp.asarray(logits[:len(params)])
    x = sampling._adjusted(raw, pairs, _penalties(params))
    if pending is not None:
        x = sampling._with_pending(x, raw, pairs, spans, jnp.asarray(pending, jnp.int32), _penalties(params))
    return np.asarray(x)


def _by_formula(row: np.ndarray, param: Sampling, prompt: list[int], made: list[int], *, presence_on_prompt=False,
                subtract_repetition=False, bias_last=False) -> np.ndarray:
    """One row adjusted as OpenAI's and vLLM's docs define it, token by token (and three plausible mistakes)."""
    x = row.astype(np.float64).copy()
    bias = dict(param.logit_bias)
    if not bias_last:
        for token, value in bias.items():
            x[token] += value
    for token in set(prompt) | set(made):
        r = param.repetition_penalty
        if subtract_repetition:
            x[token] -= r - 1
        else:
            x[token] = x[token] / r if x[token] > 0 else x[token] * r
    counted = made + (prompt if presence_on_prompt else [])
    for token in set(counted):
        x[token] -= param.frequency_penalty * counted.count(token) + param.presence_penalty
    if bias_last:
        for token, value in bias.items():
            x[token] += value
    return x


def test_adjusted_logits_follow_the_formulas_and_transformers_repetition_penalty():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    rng = np.random.default_rng(7)
    logits = (rng.standard_normal((4, VOCAB)) * 3).astype(np.float32)  # both signs among the penalised tokens
    prompt, made = [3, 5, 5, 9, 11, 40], [5, 12, 12, 12, 41, 3, 9]
    params = [Sampling(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3,
                       logit_bias=((9, 2.0), (12, -1.5), (60, 7.0))),
              Sampling(repetition_penalty=1.7),
              Sampling(temperature=0.8, presence_penalty=-0.4, frequency_penalty=1.1, seed=2),
              Sampling(temperature=1.0, seed=3)]  # adjusts nothing: untouched
    histories = [History.of(prompt, made, p) if p.uses_history else None for p in params]
    got = _adjusted(logits, params, histories)
    for row, param in enumerate(params):
        expected = _by_formula(logits[row], param, prompt if param.repetition_penalty != 1 else [], made)
        np.testing.assert_allclose(got[row], expected, rtol=1e-6, atol=1e-6, err_msg=str(row))
    assert np.array_equal(got[3], logits[3])
    grown = History.of(prompt, made[:3], params[0])  # counted as the request makes its tokens, step by step
    _adjusted(logits[:1], params[:1], [grown])
    for token in made[3:]:
        grown.made.append(token)
        if token != 3:
            _adjusted(logits[:1], params[:1], [grown])
    np.testing.assert_array_equal(_adjusted(logits[:1], params[:1], [grown])[0], got[0])
    assert (logits[0][[3, 5, 9, 11, 12, 40, 41]] < 0).any() and (logits[0][[3, 5, 9, 11, 12, 40, 41]] > 0).any()
    for mistake in ({"presence_on_prompt": True}, {"subtract_repetition": True}, {"bias_last": True}):
        wrong = _by_formula(logits[0], params[0], prompt, made, **mistake)
        assert np.abs(wrong - got[0]).max() > 0.05, mistake  # the data tells each mistake apart
    # the repetition penalty is transformers' (over the prompt and the made tokens alike)
    ids = torch.tensor([prompt + made])
    reference = RepetitionPenaltyLogitsProcessor(1.7)(ids, torch.tensor(logits[1:2])).numpy()[0]
    np.testing.assert_allclose(got[1], reference, rtol=1e-6, atol=1e-6)


def test_a_token_still_on_the_device_counts_as_if_its_history_held_it():
    """A pipelined step's sampler counts each penalised item's pending token (made by the step before, not read yet)
    on the device: the logits equal those of a History that holds it — a token made before (count + 1), a new one
    (presence, repetition, frequency 1), one with a bias, one in the prompt only — and an unpenalised item's or a
    -1's logits are untouched."""
    rng = np.random.default_rng(11)
    logits = (rng.standard_normal((5, VOCAB)) * 3).astype(np.float32)
    prompt, made = [3, 5, 9, 40], [5, 12, 12, 41]
    param = Sampling(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.4, logit_bias=((50, 1.5),))
    params = [param, param, param, param, Sampling(logit_bias=((2, 1.0),))]
    pending = [12, 33, 50, 9, 7]  # made twice before; new; biased; in the prompt only; unpenalised item
    with_pending = _adjusted(logits, params, [History.of(prompt, list(made), p) for p in params[:4]] + [None],
                             pending)
    for item in range(4):
        held = _adjusted(logits[item:item + 1], params[:1], [History.of(prompt, made + [pending[item]], param)])
        np.testing.assert_allclose(with_pending[item], held[0], rtol=1e-6, atol=1e-6, err_msg=str(item))
        without = _adjusted(logits[item:item + 1], params[:1], [History.of(prompt, list(made), param)])
        assert not np.allclose(with_pending[item], without[0])  # the pending token moved something
    assert np.array_equal(with_pending[4], _adjusted(logits[4:], params[4:], [None])[0])
    before = _adjusted(logits[:1], params[:1], [History.of(prompt, list(made), param)])
    np.testing.assert_array_equal(_adjusted(logits[:1], params[:1], [History.of(prompt, list(made), param)], [-1]),
                                  before)


def test_min_p_keeps_what_transformers_keeps_and_draws_renormalise():
    from transformers.generation.logits_process import MinPLogitsWarper

    rng = np.random.default_rng(3)
    vocab, n = 3000, 4000
    sharp = np.full(vocab, -20.0, np.float32)
    hot = [7, 1500, 2999, 300]
    sharp[hot] = [2.0, 1.6, 0.2, -3.0]  # min_p 0.1 at temperature 1 keeps the first three
    flat = (rng.standard_normal(vocab) * 0.05).astype(np.float32)  # min_p 0.5 keeps nearly all: past the candidates
    for row, min_p, temperature in ((sharp, 0.1, 1.0), (flat, 0.5, 0.7), (sharp, 0.3, 0.5)):
        tempered = jnp.asarray(row[None] / temperature)
        ours = np.isfinite(np.asarray(sampling._min_p(tempered, jnp.asarray([min_p]))))[0]
        theirs = np.isfinite(MinPLogitsWarper(min_p)(None, torch.tensor(np.asarray(tempered))).numpy())[0]
        assert np.array_equal(ours, theirs), (min_p, temperature)
    assert np.flatnonzero(ours).tolist() == [7, 1500]  # at temperature 0.5 min_p 0.3 drops the third (0.06)
    drawn = np.asarray(sample(jnp.asarray(sharp[None]), [0] * n, [Sampling(1.0, min_p=0.1, seed=5)] * n,
                              list(range(n))))[:n]
    weights = np.exp(sharp[hot[:3]] - sharp.max())
    freq = np.array([np.mean(drawn == t) for t in hot[:3]])
    assert set(drawn.tolist()) <= set(hot[:3]) and np.abs(freq - weights / weights.sum()).max() < 0.025, freq
    kept = set(np.flatnonzero(flat / 0.7 >= flat.max() / 0.7 + np.log(0.5)).tolist())
    assert len(kept) > sampling.CANDIDATES  # drawn over the whole row
    drawn = np.asarray(sample(jnp.asarray(flat[None]), [0] * 512, [Sampling(0.7, min_p=0.5, seed=6)] * 512,
                              list(range(512))))[:512]
    assert set(drawn.tolist()) <= kept and len(set(drawn.tolist())) > 200
    greedy = sample(jnp.asarray(sharp[None]), [0], [Sampling(min_p=0.9)], [0])
    assert int(greedy[0]) == 7  # greedy: min-p cannot move the argmax


@pytest.mark.parametrize("kwargs, message", [({"min_p": 1.5}, "min_p"), ({"presence_penalty": 2.5}, "presence"),
                                             ({"frequency_penalty": -3}, "frequency"),
                                             ({"repetition_penalty": 0.0}, "repetition"),
                                             ({"repetition_penalty": float("inf")}, "repetition"),
                                             ({"logit_bias": ((3, 101.0),)}, "logit_bias"),
                                             ({"logit_bias": ((-1, 1.0),)}, "logit_bias")])
def test_bad_adjustments_are_refused(kwargs, message):
    with pytest.raises(UsageError, match=message):
        Sampling(**kwargs)


def test_a_penalised_item_without_its_history_is_refused():
    with pytest.raises(UsageError, match="History"):
        sample(jnp.zeros((1, 8)), [0], [Sampling(presence_penalty=1.0)], [0])


@pytest.fixture(scope="module")
def checkpoint(hf_checkpoint):
    return hf_checkpoint("qwen3_5_moe")


def _ours(qc_model, path, prompt, param, steps, stop=(2,)):
    scheduler = Scheduler(qc_model(path).engine(CacheConfig(max_seqs=2, max_context=64, max_step_tokens=16)))
    request = Request(list(prompt), steps, stop_ids=stop, sampling=param)
    scheduler.run([request])
    return request.tokens


@torch.no_grad()
def _transformers_openai_penalties(path, prompt, steps, presence, frequency):
    """transformers' model decoded greedily, each step's logits adjusted by OpenAI's penalties over the tokens made."""
    import hf_oracle

    model = hf_oracle.hf_load(path)
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    made: list[int] = []
    for _ in range(steps):
        x = out.logits[0, -1].double().numpy().copy()
        for token in set(made):
            x[token] -= frequency * made.count(token) + presence
        made.append(int(np.argmax(x)))
        if made[-1] == 2:
            break
        out = model(input_ids=torch.tensor([[made[-1]]]), cache=out.cache, use_cache=True)
    return made


def test_greedy_decoding_with_penalties_makes_transformers_tokens(checkpoint, qc_model):
    import hf_oracle

    prompt, steps = [5, 17, 99, 3, 250, 41, 7], 20
    plain = _ours(qc_model, checkpoint, prompt, GREEDY, steps)
    model = hf_oracle.hf_load(checkpoint)
    for r in (1.5, 0.8):  # < 1 rewards repeats
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, repetition_penalty=r,
                                  eos_token_id=2, pad_token_id=0)[0, len(prompt):].tolist()
        assert _ours(qc_model, checkpoint, prompt, Sampling(repetition_penalty=r), steps) == expected, r
        assert expected != plain
    for presence, frequency in ((1.5, 0.0), (0.0, 0.7), (-0.5, 1.2)):
        expected = _transformers_openai_penalties(checkpoint, prompt, steps, presence, frequency)
        param = Sampling(presence_penalty=presence, frequency_penalty=frequency)
        assert _ours(qc_model, checkpoint, prompt, param, steps) == expected, (presence, frequency)
    bias = Sampling(logit_bias=((plain[3], -100.0), (77, 5.0)))
    banned = _ours(qc_model, checkpoint, prompt, bias, steps)
    assert plain[3] not in banned and banned != plain


def test_a_penalised_sampled_request_is_the_same_alone_in_a_batch_and_after_preemption(checkpoint, qc_model):
    prompts = [[3, 17, 42, 9, 250], [(7 * i + 5) % 500 + 3 for i in range(23)], [11, 12], [400, 3, 99, 7]]
    params = [Sampling(temperature=1.0, seed=1, presence_penalty=1.5, min_p=0.05),
              Sampling(temperature=0.8, top_p=0.9, seed=2, frequency_penalty=0.8, repetition_penalty=1.2),
              GREEDY, Sampling(repetition_penalty=1.3, logit_bias=((5, 3.0),))]

    def serve(cache, indices):
        scheduler = Scheduler(qc_model(checkpoint).engine(cache))
        requests = [Request(prompts[i], 10, id=i, sampling=params[i]) for i in indices]
        scheduler.run(requests)
        return {r.id: r.tokens for r in requests}, sum(r.preemptions for r in requests)

    alone, _ = serve(CacheConfig(max_seqs=1, max_context=64, max_step_tokens=8), range(4))
    tight, preemptions = serve(CacheConfig(max_seqs=4, max_context=64, max_step_tokens=16, num_pages=3), [3, 2, 1, 0])
    assert tight == alone and preemptions > 0
    assert len(set(alone[0])) == len(alone[0])  # presence 1.5 on a tiny model: nothing made twice


def test_run_applies_the_penalties_and_refuses_bad_ones_before_loading(checkpoint, capsys):
    """`run --repetition-penalty` makes transformers' generate(repetition_penalty) tokens; a presence penalty
    outside -2..2 is one line and exit 2."""
    import hf_oracle
    from qcompile.cli import main

    prompt = [5, 17, 99, 3, 250, 41, 7]
    expected = hf_oracle.hf_load(checkpoint).generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                                      repetition_penalty=1.4, eos_token_id=2, pad_token_id=0)
    with pytest.raises(SystemExit) as done:
        main(["run", str(checkpoint), "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", "12",
              "--repetition-penalty", "1.4"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == ",".join(map(str, expected[0, len(prompt):].tolist()))
    with pytest.raises(SystemExit) as done:
        main(["run", str(checkpoint), "--prompt-ids", "1,2", "--presence-penalty", "3"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "presence_penalty" in err and len(err.strip().splitlines()) == 1


def test_pending_tokens_come_from_the_device_or_from_the_host_once_read():
    """A work item's PendingToken is taken from its launched step's device array while that step is unread, and
    from the host once read (a mesh engine reads it to feed it); -1 where an item feeds known tokens."""
    from qcompile.runtime.engine import LaunchedStep, PendingToken, _pending_tokens

    step = LaunchedStep(jnp.asarray([40, 41, 42, 43], jnp.int32), [2, 0])
    work = [(None, [PendingToken(step, 0)]), (None, [5, 6]), (None, [PendingToken(step, 1)])]
    assert np.asarray(_pending_tokens(work)).tolist() == [42, -1, 40]
    assert step.tokens() == [42, 40]  # read now
    assert np.asarray(_pending_tokens(work)).tolist() == [42, -1, 40]


def test_warming_the_sampler_for_pairs_compiles_what_penalised_steps_run():
    """A run that knows its penalties compiles the sampler's programs for every size of pairs it will send before
    it is timed (bench): penalised steps of up to that many pairs then compile nothing."""
    from qcompile.runtime.sampling import pairs_sizes, warm_sampler

    assert pairs_sizes(0) == [] and pairs_sizes(1024) == [1024] and pairs_sizes(1025) == [1024, 4096]
    logits = jnp.zeros((4, 3000), jnp.float32)
    warm_sampler(tuple(logits.shape), logits.dtype, 4 * 700)
    compiled = sampling._sample._cache_size()
    param = Sampling(0.7, 20, 0.8, 1, presence_penalty=1.5, repetition_penalty=1.1)
    for made in (3, 200, 600):  # 1024 and 4096 pairs
        histories = [History.of([1, 2], list(range(i, i + made)), param) for i in range(4)]
        sample(logits, list(range(4)), [param] * 4, [0] * 4, histories, jnp.asarray([5, -1, 7, 9], jnp.int32))
    assert sampling._sample._cache_size() == compiled
