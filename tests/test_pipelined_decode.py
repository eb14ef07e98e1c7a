"""Pipelined decoding: `Engine.launch_tokens` dispatches a step without waiting for it, and the next step takes the
launched step's tokens on the device (`LaunchedStep.token(i)`), so the host packs and dispatches step N + 1 while
step N computes. The tokens must be exactly those of steps read back one at a time; the launched step must really
stay unread until after the next is dispatched; EOS found a step late drops the extra token; where pending tokens
cannot be fed on the device they are read back first, with the same result."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from qcompile.ir.abi import CacheConfig
from qcompile.runtime.engine import LaunchedStep

PROMPTS = [[3, 17, 42, 9, 250, 8], [11, 12, 400]]
STEPS = 6


@pytest.fixture(scope="module")
def model(tmp_path_factory, qc_model):
    from conftest import write_small

    return qc_model(write_small(tmp_path_factory.mktemp("pipe") / "m", seed=7))


def _engine(model):
    return model.engine(CacheConfig(max_seqs=2, max_context=64, max_step_tokens=16))


@pytest.fixture(scope="module")
def read_back(model):
    """Each prompt's greedy tokens, every decode step read back before the next (`step_tokens` on host ids)."""
    engine = _engine(model)
    seqs = [engine.add_sequence() for _ in PROMPTS]
    tokens = [[t] for t in engine.prefill(list(zip(seqs, PROMPTS)), with_logits=False)]
    for _ in range(STEPS):
        for out, t in zip(tokens, engine.step_tokens([(s, [out[-1]]) for s, out in zip(seqs, tokens)])):
            out.append(t)
    return tokens


def _pipelined(engine, steps: int = STEPS):
    """Decode with each step launched on the previous one's pending tokens; returns the tokens and whether each
    launched step was still unread when the next one had been dispatched."""
    seqs = [engine.add_sequence() for _ in PROMPTS]
    tokens = [[t] for t in engine.prefill(list(zip(seqs, PROMPTS)), with_logits=False)]
    launched: LaunchedStep | None = None
    unread_at_next_launch = []
    for _ in range(steps):
        work = [(s, [launched.token(i) if launched else out[-1]]) for i, (s, out) in enumerate(zip(seqs, tokens))]
        following = engine.launch_tokens(work)
        if launched is not None:
            unread_at_next_launch.append(not launched.read)
            for out, t in zip(tokens, launched.tokens()):
                out.append(t)
        launched = following
    for out, t in zip(tokens, launched.tokens()):
        out.append(t)
    return tokens, unread_at_next_launch


def test_launched_steps_feed_the_next_on_the_device(model, read_back):
    engine = _engine(model)
    tokens, unread = _pipelined(engine)
    assert tokens == read_back
    assert len(set(map(tuple, read_back))) == 2 and len({t for out in read_back for t in out[1:]}) > 2  # not constant
    assert unread == [True] * (STEPS - 1)  # nothing was read back to launch a step
    assert isinstance(engine.last_batch["token_ids"], jax.Array)  # the ids were put together on the device


def test_without_device_feeding_pending_tokens_are_read_first(model, read_back):
    """A mesh's program (or one process of several) takes numpy batches: there the pending tokens are read back
    before the step is packed — same tokens."""
    engine = _engine(model)
    engine.feeds_on_device = False
    tokens, unread = _pipelined(engine)
    assert tokens == read_back
    assert unread == [False] * (STEPS - 1)
    assert isinstance(engine.last_batch["token_ids"], np.ndarray)


def test_a_token_of_a_step_already_read_is_fed_from_the_host(model, read_back):
    engine = _engine(model)
    seqs = [engine.add_sequence() for _ in PROMPTS]
    first = engine.launch_tokens(list(zip(seqs, PROMPTS)))
    assert first.tokens() == [out[0] for out in read_back]
    second = engine.launch_tokens([(s, [first.token(i)]) for i, s in enumerate(seqs)])
    assert isinstance(engine.last_batch["token_ids"], np.ndarray)
    assert second.tokens() == [out[1] for out in read_back]


def test_generate_stops_at_eos_found_a_step_late(model, read_back):
    """generate launches step N + 1 before it reads step N: a sequence whose step-N token is EOS has one more token
    made on the device, which is dropped — its tokens end at the EOS, the other sequence's are untouched."""
    stop = read_back[0][3]
    cut = read_back[0].index(stop) + 1
    out = _engine(model).generate(PROMPTS, STEPS + 1, eos_ids=(stop,))
    assert out["tokens"][0] == read_back[0][:cut] and out["finish_reasons"][0] == "eos"
    other = read_back[1][:read_back[1].index(stop) + 1] if stop in read_back[1] else read_back[1]
    assert out["tokens"][1] == other
    plain = _engine(model).generate(PROMPTS, STEPS + 1)
    assert plain["tokens"] == read_back and plain["finish_reasons"] == ["length", "length"]


def test_the_scheduler_launches_each_step_before_reading_the_one_in_flight(model, read_back, monkeypatch):
    """Continuous batching pipelines too: every step after the first is launched while the one before is unread,
    and each request gets the tokens of steps read back one at a time; a request does not get a step past its max
    new tokens (no step is launched after the last tokens)."""
    from qcompile.runtime.engine import Engine
    from qcompile.runtime.scheduler import Request, Scheduler

    launched: list[LaunchedStep] = []
    unread = []
    real = Engine.launch_tokens

    def recording(self, work, *args):
        if launched:
            unread.append(not launched[-1].read)
        launched.append(real(self, work, *args))
        return launched[-1]

    monkeypatch.setattr(Engine, "launch_tokens", recording)
    requests = [Request(p, STEPS + 1, id=i) for i, p in enumerate(PROMPTS)]
    Scheduler(_engine(model)).run(requests)
    assert [r.tokens for r in requests] == read_back
    assert unread == [True] * STEPS  # the prefill step, then STEPS decode steps, each launched ahead
