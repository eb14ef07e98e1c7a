"""Sampling on the device (runtime/sampling.py): top-k and top-p keep exactly the tokens they should, draws follow
softmax(logits / temperature) (a sampler that multiplied by the temperature, or ignored it, would not), temperature 0
and top-k 1 are greedy, bad parameters are refused; through the scheduler, a seeded request samples the same tokens
alone, in a batch with others and after a preemption, and different seeds sample differently.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from qcompile.errors import UsageError
from qcompile.ir.abi import CacheConfig
from qcompile.runtime import sampling
from qcompile.runtime.sampling import GREEDY, Sampling, filtered_logits, sample
from qcompile.runtime.scheduler import Request, Scheduler

LOGITS = np.array([[3.0, 2.0, 1.0, 0.0, -1.0]], np.float32)


def _kept(temperature=1.0, top_k=0, top_p=1.0) -> set[int]:
    x = filtered_logits(jnp.asarray(LOGITS), jnp.asarray([temperature]), jnp.asarray([top_k]), jnp.asarray([top_p]))
    return {int(i) for i in np.flatnonzero(np.isfinite(np.asarray(x)[0]))}


def test_top_k_and_top_p_keep_exactly_the_right_tokens():
    # softmax([3, 2, 1, 0, -1]) = [0.636, 0.234, 0.086, 0.032, 0.012]
    assert _kept() == {0, 1, 2, 3, 4}
    assert _kept(top_k=2) == {0, 1} and _kept(top_k=1) == {0} and _kept(top_k=9) == {0, 1, 2, 3, 4}
    assert _kept(top_p=0.5) == {0} and _kept(top_p=0.7) == {0, 1} and _kept(top_p=0.9) == {0, 1, 2}
    assert _kept(top_k=2, top_p=0.99) == {0, 1}  # top-p over what top-k left
    assert _kept(temperature=0.25, top_p=0.9) == {0}  # a sharper distribution: the first token alone has 0.98


def test_draws_follow_the_tempered_softmax():
    n, temperature = 6000, 0.7
    params = [Sampling(temperature=temperature, seed=42)] * n
    logits = jnp.asarray(LOGITS)
    drawn = np.asarray(sample(logits, [0] * n, params, list(range(n))))[:n]
    freq = np.bincount(drawn, minlength=5) / n
    expected = np.exp(LOGITS[0] / temperature) / np.exp(LOGITS[0] / temperature).sum()
    assert np.abs(freq - expected).max() < 0.02, (freq, expected)
    wrong = np.exp(LOGITS[0] * temperature) / np.exp(LOGITS[0] * temperature).sum()  # temperature multiplied
    assert np.abs(freq - wrong).max() > 0.1
    # the same seed and counter draw the same token; greedy and top-k 1 are the argmax whatever the seed
    again = np.asarray(sample(logits, [0] * 50, params[:50], list(range(50))))[:50]
    assert np.array_equal(again, drawn[:50])
    for greedy in (GREEDY, Sampling(temperature=1.0, top_k=1, seed=7)):
        assert set(np.asarray(sample(logits, [0] * 20, [greedy] * 20, list(range(20))))[:20].tolist()) == {0}


def _kept_by_sorting(x: np.ndarray, top_k: int, top_p: float) -> set[int]:
    """The filters' definition, by sorting one row of tempered logits (ties at a threshold kept)."""
    ordered = np.sort(x)[::-1].astype(np.float64)
    if top_k > 0:
        x = np.where(x < ordered[min(top_k, x.size) - 1], -np.inf, x)
    probs = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
    ordered = np.sort(probs)[::-1]
    before = np.cumsum(ordered) - ordered
    last = max(int(np.sum(before < top_p)) - 1, 0)
    return set(np.flatnonzero(probs >= ordered[last]).tolist()) if top_p < 1 else set(np.flatnonzero(x > -np.inf).tolist())


FILTERS = [(0, 0.5), (0, 0.9), (0, 0.999), (1, 1.0), (7, 1.0), (20, 0.8), (256, 1.0), (256, 0.95), (257, 0.9),
           (300, 1.0), (0, 1.0), (5000, 0.7), (0, 0.578)]


def _plateau(vocab: int) -> np.ndarray:
    """vocab // 8 tokens at 3, then vocab // 4 tied at 2: at vocab 2000, top-p 0.578's nucleus ends 3 tokens into
    the tie, 6 candidates before the last one — a tie at the nucleus's threshold that runs past the candidates."""
    row = np.full(vocab, -30.0)
    row[:vocab // 8], row[vocab // 8:vocab // 8 + vocab // 4] = 3.0, 2.0
    return np.random.default_rng(0).permutation(row)


@pytest.mark.parametrize("vocab", [200, 2000])
def test_filters_keep_what_sorting_keeps_whole_rows_and_candidates(vocab):
    """Without a sort: the whole-row bisection keeps exactly the sorted-order rule's tokens, and where the fast path
    says its 256 candidates settle a row, it keeps the same tokens. Logits rounded to a few levels make ties at the
    thresholds (kept), sharp and flat rows make nuclei narrower and wider than the candidates; k > 256 and a nucleus
    wider than 256 tokens must not be settled by the candidates."""
    rng = np.random.default_rng(vocab)
    rows = [np.round(rng.standard_normal(vocab) * 3) / 2, rng.standard_normal(vocab) * 6, rng.standard_normal(vocab) * 0.05,
            np.round(rng.standard_normal(vocab) * 8), _plateau(vocab)]
    x = jnp.asarray(np.repeat(np.stack(rows).astype(np.float32), len(FILTERS), axis=0))
    top_k = jnp.asarray([k for k, _ in FILTERS] * len(rows), jnp.int32)
    top_p = jnp.asarray([p for _, p in FILTERS] * len(rows), jnp.float32)
    whole = np.asarray(sampling._keep_whole_rows(x, top_k, top_p))
    _, ids, keep, settled = (np.asarray(a) for a in sampling._candidates(x, top_k, top_p))
    settled_count = 0
    for i in range(x.shape[0]):
        expected = _kept_by_sorting(np.asarray(x[i]), int(top_k[i]), float(top_p[i]))
        assert set(np.flatnonzero(whole[i]).tolist()) == expected, (i, FILTERS[i % len(FILTERS)])
        if settled[i]:
            settled_count += 1
            assert set(ids[i][keep[i]].tolist()) == expected, (i, FILTERS[i % len(FILTERS)])
        if vocab > sampling.CANDIDATES and len(expected) > sampling.CANDIDATES:
            assert not settled[i], (i, FILTERS[i % len(FILTERS)])
    assert settled_count >= (x.shape[0] if vocab <= sampling.CANDIDATES else 12)  # the fast path is taken
    zeros = filtered_logits(jnp.asarray([[1.0, -0.0, 0.0, -1.0]]), jnp.ones(1), jnp.asarray([2]), jnp.ones(1))
    assert np.isfinite(np.asarray(zeros)[0]).tolist() == [True, True, True, False]  # -0.0 ties 0.0


def test_draws_over_whole_rows_follow_the_filtered_softmax():
    """Rows the candidates cannot settle (temperature alone over 3000 tokens; a nucleus wider than 256 tokens; top-k
    of 400) are drawn over the whole row in blocks of 1024: the draws follow the tempered softmax across block edges
    and never leave what the filters keep."""
    vocab, n = 3000, 4000
    logits = np.full(vocab, -40.0, np.float32)
    hot = [3, 1023, 1024, 2047, 2999]
    logits[hot] = [2.0, 1.0, 0.5, 0.0, -0.5]
    params = [Sampling(temperature=0.8, seed=3)] * n
    drawn = np.asarray(sample(jnp.asarray(logits[None]), [0] * n, params, list(range(n))))[:n]
    freq = np.array([np.mean(drawn == t) for t in hot])
    expected = np.exp(logits[hot] / 0.8) / np.exp(logits[hot] / 0.8).sum()
    assert set(drawn.tolist()) <= set(hot) and np.abs(freq - expected).max() < 0.025, (freq, expected)
    flat = np.random.default_rng(1).standard_normal((1, vocab)).astype(np.float32) * 0.1
    for param in (Sampling(temperature=1.0, top_p=0.5, seed=4), Sampling(temperature=1.0, top_k=400, seed=5)):
        kept = _kept_by_sorting(flat[0], param.top_k, param.top_p)
        assert len(kept) > sampling.CANDIDATES
        drawn = np.asarray(sample(jnp.asarray(flat), [0] * 512, [param] * 512, list(range(512))))[:512]
        assert set(drawn.tolist()) <= kept and len(set(drawn.tolist())) > 200  # many distinct tokens, all kept


def test_the_compiled_sampler_never_sorts_the_vocabulary():
    """XLA CPU turns a top_k whose outputs are sliced at an offset back into a sort of the whole row (100x slower at
    Qwen's vocabulary): the compiled sampler keeps the TopK and has no sort."""
    import jax

    n, vocab = 8, 4096
    for pairs in (0, 256):  # without and with penalties
        specs = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in
                 (((n, vocab), jnp.float32), ((n,), jnp.int32), ((n,), jnp.float32), ((n,), jnp.int32),
                  ((n,), jnp.float32), ((n,), jnp.uint32), ((n,), jnp.int32), ((n,), jnp.float32))]
        adjust = tuple(jax.ShapeDtypeStruct((pairs,), dtype)
                       for dtype in (jnp.int32, jnp.int32, jnp.float32, jnp.float32, jnp.float32))
        spans = (jax.ShapeDtypeStruct((n,), jnp.int32),) * 2
        penalties = (jax.ShapeDtypeStruct((n,), jnp.float32),) * 3
        text = sampling._sample.lower(*specs, adjust, spans, jax.ShapeDtypeStruct((n,), jnp.int32),
                                      penalties).compile().as_text()
        assert "TopK" in text and " sort(" not in text


def test_one_sampler_program_per_logits_shape():
    """Items are padded to the logits' rows, so steps with 1, 3 or 8 items compile the sampler once (a server warms
    one program per bucket, not one per item count)."""
    logits = jnp.asarray(np.random.default_rng(2).standard_normal((8, 40)).astype(np.float32))
    before = sampling._sample._cache_size()
    for count in (1, 3, 8):
        drawn = sample(logits, list(range(count)), [Sampling(temperature=0.5, seed=count)] * count, [0] * count)
        assert drawn.shape == (8,)
    assert sampling._sample._cache_size() == before + 1


@pytest.mark.parametrize("kwargs, message", [({"temperature": -1.0}, "temperature"), ({"top_k": -2}, "top_k"),
                                             ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
                                             ({"seed": -1}, "seed"), ({"temperature": float("nan")}, "temperature")])
def test_bad_parameters_are_refused(kwargs, message):
    with pytest.raises(UsageError, match=message):
        Sampling(**kwargs)


@pytest.fixture(scope="module")
def model(tmp_path_factory, qc_model):
    from conftest import write_small

    return qc_model(write_small(tmp_path_factory.mktemp("sample") / "m", seed=5))


def test_a_seeded_request_samples_the_same_tokens_alone_in_a_batch_and_after_preemption(model):
    prompts = [[3, 17, 42, 9, 250], [(7 * i + 5) % 500 + 3 for i in range(23)], [11, 12], [400, 3, 99, 7]]
    params = [Sampling(temperature=1.0, seed=1), Sampling(temperature=0.8, top_p=0.9, seed=2), GREEDY,
              Sampling(temperature=1.2, top_k=20, seed=3)]

    def serve(cache, indices):
        scheduler = Scheduler(model.engine(cache))
        requests = [Request(prompts[i], 8, id=i, sampling=params[i]) for i in indices]
        scheduler.run(requests)
        return {r.id: r.tokens for r in requests}, sum(r.preemptions for r in requests)

    alone, _ = serve(CacheConfig(max_seqs=1, max_context=64, max_step_tokens=8), range(4))  # one at a time
    tight, preemptions = serve(CacheConfig(max_seqs=4, max_context=64, max_step_tokens=16, num_pages=3), [3, 2, 1, 0])
    assert tight == alone and preemptions > 0  # four in one batch, in another order, with preemptions
    other = Scheduler(model.engine(CacheConfig(max_seqs=1, max_context=64, max_step_tokens=8)))
    request = Request(prompts[0], 8, sampling=Sampling(temperature=1.0, seed=99))
    other.run([request])
    assert request.tokens != alone[0]  # another seed, another draw


def test_run_samples_each_prompt_with_its_own_seed(tmp_path, capsys):
    """`run --temperature`: prompt i draws with seed + i, so the first prompt's tokens are the same alone and with
    another prompt beside it; a bad --top-p is one line, exit 2, before anything loads."""
    from conftest import write_small
    from qcompile.cli import main

    path = write_small(tmp_path / "m")
    outputs = []
    for prompts in (["1,2,3", "7,8"], ["1,2,3"]):
        argv = ["run", str(path), "--max-new-tokens", "6", "--ignore-eos", "--temperature", "0.9", "--seed", "4"]
        for ids in prompts:
            argv += ["--prompt-ids", ids]
        with pytest.raises(SystemExit) as done:
            main(argv)
        assert done.value.code == 0
        outputs.append(capsys.readouterr().out.splitlines())
    assert outputs[0][0] == outputs[1][0] and len(outputs[0]) == 2
    with pytest.raises(SystemExit) as done:
        main(["run", str(tmp_path / "missing"), "--prompt-ids", "1", "--top-p", "0"])
    assert done.value.code == 2 and "--top-p" in capsys.readouterr().err
