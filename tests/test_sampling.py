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
