"""Continuous batching: requests of different lengths, more than the engine's sequence slots, arriving while others
run, each get exactly the tokens they get alone; slots and pages are all free at the end; when pages run out the
youngest request is preempted and recomputed, with the same tokens; what can never be served is refused up front."""

from __future__ import annotations

from collections import deque

import pytest

from qcompile.errors import UsageError
from qcompile.ir.abi import CacheConfig
from qcompile.runtime.scheduler import Request, Scheduler

PROMPTS = [[3, 17, 42, 9, 250], [(7 * i + 5) % 500 + 3 for i in range(23)], [11, 12], [400, 3, 99, 7, 7, 7, 2]]
NEW = [6, 3, 9, 4]


@pytest.fixture(scope="module")
def model(tmp_path_factory, qc_model):
    from conftest import write_small

    return qc_model(write_small(tmp_path_factory.mktemp("sched") / "m", seed=5))


@pytest.fixture(scope="module")
def alone(model):
    """Each prompt's greedy tokens generated on its own."""
    engine = model.engine(CacheConfig(max_seqs=1, max_context=64, max_step_tokens=8))
    return [engine.generate([p], n)["tokens"][0] for p, n in zip(PROMPTS, NEW)]


def test_requests_beyond_the_slots_queue_and_each_gets_its_own_tokens(model, alone):
    engine = model.engine(CacheConfig(max_seqs=2, max_context=64, max_step_tokens=8))
    scheduler = Scheduler(engine)
    requests = [Request(p, n, id=i) for i, (p, n) in enumerate(zip(PROMPTS, NEW))]
    streamed: dict[int, list[int]] = {i: [] for i in range(len(requests))}
    for request, token in scheduler.stream(requests):
        streamed[request.id].append(token)
        assert len(scheduler.running) <= 2
    assert [r.tokens for r in requests] == alone == [streamed[i] for i in range(len(requests))]
    assert all(r.finish_reason == "length" for r in requests)
    assert all(r.submitted_at <= r.first_token_at <= r.finished_at for r in requests)
    assert sorted(engine.free_slots) == [0, 1] and len(engine.free_pages) == engine.sizes["P"]
    # chunked prefill of the 23-token prompt under an 8-token budget, mixed with decodes: more steps than one
    # request alone would take, fewer than all of them one after another
    assert max(NEW) + 3 <= scheduler.steps < sum(NEW) + sum(-(-len(p) // 8) for p in PROMPTS)


def test_a_stop_id_ends_a_request_and_frees_its_slot_for_the_next(model, alone):
    engine = model.engine(CacheConfig(max_seqs=1, max_context=64, max_step_tokens=8))
    stop = alone[0][2]
    first, second = Request(PROMPTS[0], NEW[0], stop_ids=(stop,)), Request(PROMPTS[2], NEW[2])
    Scheduler(engine).run([first, second])
    assert first.finish_reason == "stop" and first.tokens == alone[0][:alone[0].index(stop) + 1]
    assert second.tokens == alone[2] and second.finish_reason == "length"


def test_when_pages_run_out_the_youngest_request_is_preempted_and_recomputed(model):
    """Three requests of 10 + 12 tokens (two 16-token pages each at the end) in a pool of 4 pages: all three are
    admitted on their prompts' pages, and when their decodes cross into a second page only two fit — the youngest is
    preempted, fed again from scratch (prompt + its tokens so far) when pages free up, and still makes exactly the
    tokens it makes alone. A plausible mistake (feeding only the prompt again, or losing the last token) changes them."""
    prompts = [[(13 * i + 7 * r) % 490 + 5 for i in range(10)] for r in range(3)]
    single = model.engine(CacheConfig(max_seqs=1, max_context=32, max_step_tokens=8))
    alone = [single.generate([p], 12)["tokens"][0] for p in prompts]
    engine = model.engine(CacheConfig(max_seqs=3, max_context=32, num_pages=4, max_step_tokens=8))
    requests = [Request(p, 12, id=i) for i, p in enumerate(prompts)]
    Scheduler(engine).run(requests)
    assert [r.tokens for r in requests] == alone
    assert requests[0].preemptions == 0 and sum(r.preemptions for r in requests) >= 1
    assert sorted(engine.free_slots) == [0, 1, 2] and len(engine.free_pages) == 4


def test_what_can_never_be_served_is_refused_when_submitted(model):
    engine = model.engine(CacheConfig(max_seqs=1, max_context=32, num_pages=1, max_step_tokens=8))
    scheduler = Scheduler(engine)
    with pytest.raises(UsageError, match="exceed the max context 32"):
        scheduler.submit(Request(list(range(3, 30)), 10))
    with pytest.raises(UsageError, match="needs 2 KV pages; the pool has 1"):
        scheduler.submit(Request(list(range(3, 20)), 2))
    with pytest.raises(UsageError, match="non-empty prompt"):
        scheduler.submit(Request([], 2))


@pytest.mark.parametrize("count", [pytest.param(40, id="40"), pytest.param(2000, id="2000", marks=pytest.mark.slow)])
def test_a_soak_with_cancellations_loses_nothing_and_leaks_nothing(model, alone, count):
    """Short requests over 7 prompts (each prompt's alone-tokens known; 40 in the default suite, 2000 in the slow
    tier), 4 slots (3 for requests) and a pool of 5 pages, so requests queue and get preempted; a run of one prompt is
    linked as a request's choices (forked from the first's prefill, when they fit); finished sequences, a shared
    first page's snapshots are kept (prefix cache) and released as later requests need the room, and a
    conversation's prompt end (its next turn leaves the reply out) is reached, though rarely kept (one slot; the
    cyclic soak below keeps many); a third are
    cancelled — some while
    waiting, some mid-stream. Every request ends (length or cancelled, none lost), each uncancelled one made exactly
    its alone tokens (a cancelled one a prefix of them), and the slots and pages are all free again."""
    import numpy as np

    # a fifth prompt that starts in one page and grows into a second while it decodes: the first four requests are
    # it, so four running requests need four new pages with one free, and preemption is certain
    growing = [(5 * i + 40) % 500 + 3 for i in range(15)]
    sharing = PROMPTS[1][:16] + [9, 8, 7, 6]  # PROMPTS[1]'s first page: a prefix that gets snapshotted
    single = model.engine(CacheConfig(max_seqs=1, max_context=64, max_step_tokens=16))
    # the next turn of a conversation that began with `sharing`, its reply's first 2 tokens left out (a thinking
    # model's template): it snapshots its own prompt's end (32 tokens)
    later = sharing + single.generate([sharing], 8)["tokens"][0][2:] + [5, 4, 3, 2, 1, 9, 8, 7, 6, 5]
    prompts, new = [*PROMPTS, growing, sharing, later], [*NEW, 6, 8, 4]
    alone = [*alone, *(single.generate([p], n)["tokens"][0] for p, n in ((growing, 6), (sharing, 8), (later, 4)))]
    engine = model.engine(CacheConfig(max_seqs=4, max_context=64, max_step_tokens=16, num_pages=5))
    forks, fork = [], engine.fork
    engine.fork = lambda source: forks.append(source.slot) or fork(source)
    # finished sequences and snapshots kept, then released for later requests; three requests run at most, the
    # fourth slot is the prefix cache's
    scheduler = Scheduler(engine, prefix_cache=True, max_running=3)
    ends, take = [], scheduler._take_snapshot
    scheduler._take_snapshot = lambda request, at, end: ends.append(end) or take(request, at, end)
    rng = np.random.default_rng(11)
    picks = np.concatenate([[4] * 4, rng.integers(0, len(prompts), count - 4)])
    requests = [Request(prompts[k], new[k], id=i) for i, k in enumerate(picks)]
    for i in range(5, len(requests)):  # a run of one prompt: choices of one request, sharing the first's prefill
        if picks[i] == picks[i - 1]:
            requests[i].parent = requests[i - 1].parent or requests[i - 1]
    doomed = {i for i in range(4, len(requests)) if rng.random() < 1 / 3}
    early = [r for r in requests if r.id in doomed and r.id % 2]  # cancelled before any token
    for request in requests:
        scheduler.submit(request)
    for request in early:
        assert scheduler.cancel(request)
    for steps, (request, _) in enumerate(scheduler.stream(), 1):
        assert steps < 100 * count and len(scheduler.running) <= 3
        if request.id in doomed and request.finish_reason is None:
            assert scheduler.cancel(request)  # mid-stream, after its first token
    assert all(r.finish_reason in ("length", "cancelled") for r in requests)
    assert {r.id for r in requests if r.finish_reason == "cancelled"} == doomed
    for request, k in zip(requests, picks):
        expected = alone[k] if request.id not in doomed else alone[k][:len(request.tokens)]
        assert request.tokens == expected
    assert all(len(r.tokens) == 1 for r in requests if r.id in doomed and not r.id % 2 and r.tokens)
    assert sum(r.preemptions for r in requests) > 0 and not scheduler.cancel(requests[0])
    assert len(forks) >= count // 40, len(forks)  # runs of one prompt forked
    assert scheduler.snapshots >= 1 and scheduler.prefix_hits >= count // 40 and sum(ends) >= count // 400
    assert scheduler.kept()[0] >= 1
    scheduler.release_kept()
    assert len(engine.free_slots) == 4 and len(engine.free_pages) == 5
    assert not scheduler.running and not scheduler.waiting


def _fed_tokens(engine) -> list[int]:
    """Record how many tokens each step of `engine` feeds."""
    fed, real = [], engine.launch_tokens

    def counting(work, *args):
        fed.append(sum(len(tokens) for _, tokens in work))
        return real(work, *args)

    engine.launch_tokens = counting
    return fed


@pytest.mark.parametrize("dtype", [None, "bf16"])
def test_a_forked_sequence_continues_as_its_source_would(tmp_path_factory, qc_model, model, dtype):
    """Engine.fork copies a sequence's state slot and shares its whole KV pages (copying a partly written last one):
    the source and two forks, fed the same last prompt token, give the logits of the whole prompt fed at once; fed
    different tokens, they part (what they write is their own); every page is back in the pool once all are
    released. bf16 caches go through the native row gather and scatter."""
    import numpy as np

    if dtype is not None:
        model = qc_model(model.checkpoint.path, dtype)
    engine = model.engine(CacheConfig(max_seqs=4, max_context=64, max_step_tokens=64))
    prompt = PROMPTS[1] + PROMPTS[0] * 2  # 33 tokens: three 16-token pages, the last one partly filled
    whole = engine.add_sequence()
    want = engine.step([(whole, prompt)])[0]
    engine.release(whole)
    source = engine.add_sequence()
    engine.step([(source, prompt[:-1])])
    free = len(engine.free_pages)
    forks = [engine.fork(source), engine.fork(source)]
    # its two whole pages are shared, not copied: no page taken from the pool
    assert all(f.length == 32 and f.pages == source.pages for f in forks) and len(engine.free_pages) == free
    outs = engine.step([(source, prompt[-1:]), *((f, prompt[-1:]) for f in forks)])
    for out in outs:
        np.testing.assert_allclose(out, want, atol=1e-5 if dtype is None else 0.02)
    assert len({f.pages[2] for f in [source, *forks]}) == 3  # the token after them went into a page of each one's own
    parted = engine.step([(forks[0], [5]), (forks[1], [9]), (source, [5])])
    assert np.array_equal(parted[0], parted[2]) and not np.allclose(parted[0], parted[1])
    # a fork of 34 tokens shares the two whole pages and copies the third, partly written
    third = engine.fork(source)
    assert third.pages[:2] == source.pages[:2] and third.pages[2] not in source.pages and len(third.pages) == 3
    again = engine.step([(source, [7]), (third, [7])])
    assert np.array_equal(again[0], again[1])
    assert engine.fork(source) is None  # the fourth slot was the last
    for seq in [source, *forks, third]:
        engine.release(seq)
    assert len(engine.free_pages) == engine.sizes["P"] and not engine.page_holders.any()


def test_choices_of_one_prompt_share_its_prefill(model):
    """Four sampled choices of a 37-token prompt, the later ones linked to the first (as `serve` does for n): the
    same tokens as four independent requests, with the prompt fed once plus each choice's last token (the others
    fork the first's cache); slots and pages all free at the end. With one slot, or the first cancelled before its
    prefill ends, the choices are fed on their own and still get their tokens."""
    from qcompile.runtime.sampling import Sampling

    prompt = [(7 * i + 5) % 500 + 3 for i in range(37)]

    def run(link: bool, max_seqs: int = 4, cancel_first: bool = False):
        engine = model.engine(CacheConfig(max_seqs=max_seqs, max_context=64, max_step_tokens=16))
        fed = _fed_tokens(engine)
        requests = [Request(prompt, 6, id=i, sampling=Sampling(0.9, seed=100 + i)) for i in range(4)]
        for request in requests[1:]:
            request.parent = requests[0] if link else None
        scheduler = Scheduler(engine)
        for request in requests:
            scheduler.submit(request)
        if cancel_first:
            scheduler.step()
            scheduler.cancel(requests[0])
        while scheduler.waiting or scheduler.running:
            scheduler.step()
        assert sorted(engine.free_slots) == list(range(max_seqs)) and len(engine.free_pages) == engine.sizes["P"]
        return [r.tokens for r in requests], sum(fed)

    alone, fed_alone = run(False)
    shared, fed_shared = run(True)
    assert shared == alone and len({tuple(t) for t in alone}) == 4
    assert fed_alone >= 4 * 37 and fed_shared <= 37 + 3 + 4 * 6  # the prompt once, 3 more last tokens, decodes
    one_slot, fed_one_slot = run(True, max_seqs=1)
    assert one_slot == alone and fed_one_slot >= 4 * 37
    cancelled, _ = run(True, cancel_first=True)
    assert cancelled[1:] == alone[1:]


def test_a_group_of_choices_is_admitted_when_all_can_fork(model):
    """Two prompts of four choices each in six slots: the second prompt's first choice waits until its whole group
    fits beside the slots the first group's choices will fork into (admitted at once, two of its choices would find
    none and be fed on their own), so both prompts are fed once; the tokens are those of eight independent
    requests."""
    from qcompile.runtime.sampling import Sampling

    prompts = [[(7 * i + 5 + k) % 500 + 3 for i in range(37)] for k in range(2)]

    def run(link: bool):
        engine = model.engine(CacheConfig(max_seqs=6, max_context=64, max_step_tokens=16))
        fed = _fed_tokens(engine)
        requests = [Request(p, 6, id=4 * k + j, sampling=Sampling(0.9, seed=4 * k + j))
                    for k, p in enumerate(prompts) for j in range(4)]
        for index, request in enumerate(requests):
            request.parent = requests[index - index % 4] if link and index % 4 else None
        Scheduler(engine).run(requests)
        return [r.tokens for r in requests], sum(fed)

    alone, _ = run(False)
    shared, fed = run(True)
    assert shared == alone and fed <= 2 * (37 + 3) + 8 * 6


def test_a_prompt_that_continues_a_finished_sequence_continues_its_cache(model):
    """The prefix cache: a finished request's sequence is kept with the tokens its cache holds; the next turn of the
    conversation (its prompt: the last prompt, the reply and new tokens) continues it, feeding only the new tokens,
    and makes the tokens it makes from scratch. A prompt that does not continue a kept sequence, or needs its slot,
    gets it released (oldest first); kept sequences count as free in the end."""
    engine = model.engine(CacheConfig(max_seqs=2, max_context=96, max_step_tokens=16))
    fed = _fed_tokens(engine)
    scheduler = Scheduler(engine, prefix_cache=True)
    first = Request(PROMPTS[1], 5)
    scheduler.run([first])
    assert scheduler.kept() == (1, 2)  # 23 + 5 tokens: two pages, the last token not fed (none launched after it)
    follow = first.prompt + first.tokens + [7, 8, 9]
    second = Request(follow, 4)
    before = sum(fed)
    scheduler.run([second])
    assert sum(fed) - before == 3 + 1 + 3  # the reply's last token and the new three, then three decode tokens
    assert scheduler.prefix_hits == 1 and scheduler.prefix_hit_tokens == len(first.prompt) + 4
    scratch = model.engine(CacheConfig(max_seqs=1, max_context=96, max_step_tokens=16))
    assert second.tokens == scratch.generate([follow], 4)["tokens"][0]
    # a reply ended by a stop id, with a step launched ahead that fed it: the kept tokens include it, and a prompt
    # continuing the reply still gets the tokens made from scratch
    stop = scratch.generate([PROMPTS[2]], 6)["tokens"][0][3]
    ended = Request(PROMPTS[2], 6, stop_ids=(stop,))
    scheduler.run([ended])
    assert ended.finish_reason == "stop" and ended.tokens[-1] == stop
    after = ended.prompt + ended.tokens + [11]
    third = Request(after, 3)
    scheduler.run([third])
    assert scheduler.prefix_hits == 2 and third.tokens == scratch.generate([after], 3)["tokens"][0]
    # two unrelated prompts need both slots: the kept sequence is released for them
    others = [Request(PROMPTS[0], 3), Request(PROMPTS[3], 3)]
    scheduler.run(others)
    assert [r.tokens for r in others] == [scratch.generate([r.prompt], 3)["tokens"][0] for r in others]
    assert scheduler.prefix_hits == 2 and scheduler.kept()[0] == 2
    scheduler.release_kept()
    assert sorted(engine.free_slots) == [0, 1] and len(engine.free_pages) == engine.sizes["P"]


SHARED = [(11 * i + 4) % 480 + 7 for i in range(40)]  # a 40-token prefix (two whole 16-token pages) prompts share


def test_prompts_sharing_a_prefix_start_from_its_snapshot(model):
    """The prefix cache's snapshots: the first prompt with a prefix is fed whole; the second finds the prefix's whole
    pages seen before, stops its prefill at their end (32 tokens) and leaves a copy there; every later prompt that
    starts with them gets a copy of the snapshot (which stays) and feeds only its own tokens. Each makes the tokens
    it makes from scratch. With max_running below the slots, the snapshot keeps its slot while the requests fill
    theirs; a prompt that shares less than a page neither hits nor snapshots."""
    engine = model.engine(CacheConfig(max_seqs=3, max_context=96, max_step_tokens=16))
    fed = _fed_tokens(engine)
    scheduler = Scheduler(engine, prefix_cache=True, max_running=2)
    scratch = model.engine(CacheConfig(max_seqs=1, max_context=96, max_step_tokens=16))
    tails = [[5, 6, 7], [300, 2, 9, 9, 1, 4], [8], [70, 71], [44, 45, 46, 47]]
    requests = [Request(SHARED + tail, 3, id=i) for i, tail in enumerate(tails)]
    for request in requests[:2]:
        scheduler.run([request])
    assert scheduler.snapshots == 1 and scheduler.prefix_hits == 0  # the second one made it
    kept = [(len(k.tokens), k.shared) for k in scheduler.prefix_cache]
    assert kept == [(len(requests[0].prompt) + 2, False), (32, True), (len(requests[1].prompt) + 2, False)]
    before = sum(fed)
    scheduler.run([requests[2]])
    assert sum(fed) - before == 40 + 1 - 32 + 2  # from the snapshot: its own 9 tokens, then two decode tokens
    assert scheduler.prefix_hits == 1 and scheduler.prefix_hit_tokens == 32
    # its slot came from the least recently used kept sequence (the first prompt's), and the snapshot it used is
    # now more recently used than the second prompt's sequence
    kept = [(len(k.tokens), k.shared) for k in scheduler.prefix_cache]
    assert kept == [(len(requests[1].prompt) + 2, False), (32, True), (len(requests[2].prompt) + 2, False)]
    # two at once, every request slot taken: both copy the snapshot, which keeps the third slot
    scheduler.run(requests[3:])
    assert scheduler.prefix_hits == 3 and scheduler.snapshots == 1
    assert any(k.shared for k in scheduler.prefix_cache)
    for request in requests:
        assert request.tokens == scratch.generate([request.prompt], 3)["tokens"][0], request.id
    # a prompt sharing only 8 tokens: fed whole, no snapshot; the slot it needs is a finished sequence's, not the
    # snapshot's (the least recently used, but prompts start from it)
    assert [k.shared for k in scheduler.prefix_cache] == [True, False, False]
    other = Request(SHARED[:8] + [1] * 30, 3)
    scheduler.run([other])
    assert scheduler.prefix_hits == 3 and scheduler.snapshots == 1
    assert [k.shared for k in scheduler.prefix_cache] == [True, False, False]
    assert other.tokens == scratch.generate([other.prompt], 3)["tokens"][0]
    scheduler.release_kept()
    assert sorted(engine.free_slots) == [0, 1, 2] and len(engine.free_pages) == engine.sizes["P"]


def test_prompts_arriving_together_wait_for_the_snapshot_of_their_prefix(model):
    """Four prompts with one 40-token prefix submitted at once, three running at most: the first is fed whole, the
    second snapshots the prefix's two pages, and the third — which could run now — waits the two steps until the
    snapshot is there and starts from it, as the fourth does when a slot frees: two hits, the same tokens."""
    engine = model.engine(CacheConfig(max_seqs=4, max_context=96, max_step_tokens=16))
    scheduler = Scheduler(engine, prefix_cache=True, max_running=3)
    prefix = [(7 * i + 9) % 470 + 11 for i in range(40)]
    requests = [Request(prefix + [k, k + 1], 3, id=k) for k in range(4)]
    scheduler.run(requests)
    assert scheduler.snapshots == 1 and scheduler.prefix_hits == 2 and scheduler.prefix_hit_tokens == 64
    scratch = model.engine(CacheConfig(max_seqs=1, max_context=96, max_step_tokens=16))
    assert [r.tokens for r in requests] == [scratch.generate([r.prompt], 3)["tokens"][0] for r in requests]
    scheduler.release_kept()
    assert len(engine.free_slots) == 4 and len(engine.free_pages) == engine.sizes["P"]


def test_requests_started_from_a_snapshot_share_its_pages(model):
    """Copies of a snapshot share its whole pages: three prompts of 43 tokens that start from a 32-token snapshot
    run together in a pool of 6 pages (the snapshot's 2 and one of each one's own; copied pages would need 11),
    with no preemption, and make the tokens made from scratch; the pool is whole again at the end."""
    engine = model.engine(CacheConfig(max_seqs=4, max_context=64, max_step_tokens=16, num_pages=6))
    scheduler = Scheduler(engine, prefix_cache=True, max_running=3)
    requests = [Request(SHARED + [k, k + 1, k + 2], 3, id=k) for k in range(5)]
    for request in requests[:2]:
        scheduler.run([request])  # the second makes the snapshot
    together = 0
    for _ in scheduler.stream(requests[2:]):
        together = max(together, len(scheduler.running))
    assert together == 3 and scheduler.preemptions == 0 and scheduler.prefix_hits == 3 and scheduler.snapshots == 1
    # kept: the snapshot (2 pages) and the last finished sequences, whose first two pages are the snapshot's
    kept = scheduler.prefix_cache
    assert kept[0].shared and all(k.seq.pages[:2] == kept[0].seq.pages for k in kept)
    assert scheduler.kept() == (len(kept), 2 + len(kept) - 1)
    scratch = model.engine(CacheConfig(max_seqs=1, max_context=64, max_step_tokens=16))
    assert [r.tokens for r in requests] == [scratch.generate([r.prompt], 3)["tokens"][0] for r in requests]
    scheduler.release_kept()
    assert len(engine.free_pages) == 6 and not engine.page_holders.any() and len(engine.free_slots) == 4


def test_the_next_turn_of_a_conversation_goes_before_new_ones(model):
    """Five conversations of two turns, two running at once and one slot for kept sequences; a second turn is
    submitted when its first finishes, behind first turns still waiting. Admitted in arrival order, each first turn
    would release a kept sequence whose next turn is waiting; a next turn goes first instead and takes its sequence
    over, so every second turn continues its first (5 hits), with the tokens made from scratch."""
    engine = model.engine(CacheConfig(max_seqs=3, max_context=96, max_step_tokens=16))
    scheduler = Scheduler(engine, prefix_cache=True, max_running=2)
    firsts = [Request([(13 * i + 7 * k) % 480 + 9 for i in range(20)], 3, id=k) for k in range(5)]
    seconds = []
    for request, _ in scheduler.stream(firsts):
        if request.finish_reason is not None and request in firsts:
            seconds.append(Request(request.prompt + request.tokens + [5, 6], 3, id=10 + request.id))
            scheduler.submit(seconds[-1])
    assert len(seconds) == 5 and scheduler.prefix_hits == 5 and scheduler.snapshots == 0
    scratch = model.engine(CacheConfig(max_seqs=1, max_context=96, max_step_tokens=16))
    for request in firsts + seconds:
        assert request.tokens == scratch.generate([request.prompt], 3)["tokens"][0]
    scheduler.release_kept()
    assert len(engine.free_slots) == 3 and len(engine.free_pages) == engine.sizes["P"]


def test_continuations_pass_the_oldest_waiting_request_at_most_max_running_times(model):
    """One request running at once: a conversation's turns continue each other while a new request waits; the
    second turn passes it, the third does not (it has been passed max_running = 1 times) and waits behind it."""
    engine = model.engine(CacheConfig(max_seqs=2, max_context=96, max_step_tokens=16))
    scheduler = Scheduler(engine, prefix_cache=True, max_running=1)
    turn, other, turns = Request(PROMPTS[1], 2, id=0), Request(PROMPTS[0], 2, id=9), []
    scheduler.submit(turn)
    scheduler.submit(other)
    for request, _ in scheduler.stream():
        if request.finish_reason is not None and request.id < 2:
            turns.append(Request(request.prompt + request.tokens + [4], 2, id=request.id + 1))
            scheduler.submit(turns[-1])
    second, third = turns[:2]
    assert second.first_token_at < other.first_token_at < third.first_token_at
    assert scheduler.prefix_hits >= 1  # the second turn continued the first
    scheduler.release_kept()


def test_max_running_leaves_slots_only_kept_sequences_use(model):
    """Requests run at most max_running at once however many slots the engine has; a max_running the ranks cannot
    split, or above the slots, is refused."""
    engine = model.engine(CacheConfig(max_seqs=3, max_context=64, max_step_tokens=8))
    scheduler = Scheduler(engine, prefix_cache=True, max_running=1)
    requests = [Request(p, n) for p, n in zip(PROMPTS, NEW)]
    for _ in scheduler.stream(requests):
        assert len(scheduler.running) <= 1
    assert all(r.finish_reason == "length" for r in requests)
    scheduler.release_kept()
    for bad in (0, 4):
        with pytest.raises(UsageError, match="max_running"):
            Scheduler(engine, max_running=bad)


def _conversation(scheduler, first, turns, new_tokens, history):
    """Run a conversation of `turns` requests through `scheduler`, each sent when the one before finishes with the
    prompt history(last request) + its next new tokens; returns the requests."""
    requests = [first]
    for request, _ in scheduler.stream([first]):
        if request.finish_reason is not None and len(requests) < turns:
            requests.append(Request(history(request) + new_tokens[len(requests) - 1], request.max_new_tokens,
                                    id=len(requests)))
            scheduler.submit(requests[-1])
    return requests


TURN_NEW = [[(5 * i + 3) % 400 + 20 for i in range(8 + 6 * k)] for k in range(3)]  # each later turn's new tokens


@pytest.mark.parametrize("dropped, ending", [(0, False), (2, False), (0, True)])
def test_a_turn_that_leaves_the_reply_out_starts_from_the_last_prompts_end(model, dropped, ending):
    """A thinking model's template renders earlier replies without their reasoning, so the next turn's prompt leaves
    the last turn's sequence right at its prompt's end (or, `dropped`: a template whose generation prompt opened the
    reasoning block, Qwen3.5's `<think>\\n`, leaves out the prompt's last tokens too); the only state it could start
    from is the last prompt's end. Turn 2 recognises that it starts with the whole first prompt (but for `dropped`
    tokens) and then leaves its sequence, so it stops its prefill at its own prompt's end (as many final tokens left
    out, rounded down to a page), keeps a snapshot there in place of its finished sequence, and turn 3 takes it over
    and feeds only the rest — the tokens made from scratch; one slot for the prefix cache is enough. (`ending`: the
    history renders the reply's last 2 tokens differently — a stop token, a trailing newline —, and the reply's
    tokens before them still show it is the reply.)"""
    engine = model.engine(CacheConfig(max_seqs=2, max_context=128, max_step_tokens=16))
    fed = _fed_tokens(engine)
    scheduler = Scheduler(engine, prefix_cache=True, max_running=1)
    reasoning, made = 3, 10 if ending else 8  # the reply's first tokens, which the next turn's history leaves out

    def history(request):
        reply = request.tokens[reasoning:-2] + [7, 7] if ending else request.tokens[reasoning:]
        return request.prompt[:len(request.prompt) - dropped] + reply

    first, second, third = _conversation(scheduler, Request(PROMPTS[1] + SHARED[:15], made, id=0), 3, TURN_NEW,
                                         history)
    point, after = ((len(r.prompt) - max(dropped, 1)) // 16 * 16 for r in (second, third))
    assert scheduler.snapshots == 2 and scheduler.prefix_hits == 1 and scheduler.prefix_hit_tokens == point
    # the third feeds from the snapshot: 16-token chunks to its own snapshot point, the rest, then decode tokens
    steps = [16] * ((after - point) // 16) + [len(third.prompt) - after] + [1] * (made - 1)
    assert fed[-len(steps):] == steps
    # the third turn's own prompt end, for a fourth, in place of its finished sequence
    assert [(len(k.tokens), k.shared, k.prompt_end) for k in scheduler.prefix_cache] == [(after, False, True)]
    scratch = model.engine(CacheConfig(max_seqs=1, max_context=128, max_step_tokens=16))
    for request in (first, second, third):
        assert request.tokens == scratch.generate([request.prompt], made)["tokens"][0]
    scheduler.release_kept()
    assert len(engine.free_slots) == 2 and len(engine.free_pages) == engine.sizes["P"]


def test_a_turn_that_renders_the_reply_as_made_keeps_no_prompt_end(model):
    """A template that renders the reply as the model made it: the next turn continues the finished sequence, and
    no prompt-end snapshot is made — even when the finished sequence was released before the next turn came (it
    is recognised by the finished sequence's tokens, remembered at the prompt's end; nor a snapshot of the pages it
    shares with the last prompt: the next turn continues its own finished sequence) — nor for a prompt that starts
    with only an earlier prompt's first pages, or leaves out more than MAX_DROPPED of its final tokens."""
    engine = model.engine(CacheConfig(max_seqs=2, max_context=128, max_step_tokens=16))
    scheduler = Scheduler(engine, prefix_cache=True, max_running=1)
    _conversation(scheduler, Request(PROMPTS[1] + SHARED[:15], 4, id=0), 3, TURN_NEW,
                  lambda request: request.prompt + request.tokens)
    assert scheduler.prefix_hits == 2 and scheduler.snapshots == 0

    def released(request):  # the finished sequence is gone when the next turn comes
        scheduler.release_kept()
        return request.prompt + request.tokens

    start = Request(SHARED + [9, 8, 7], 4, id=0)
    _conversation(scheduler, start, 2, TURN_NEW, released)
    assert scheduler.prefix_hits == 2 and scheduler.snapshots == 0
    assert [(k.shared, k.prompt_end) for k in scheduler.prefix_cache] == [(False, False)]  # its finished sequence
    for keep in (len(start.prompt) - 5, 20):  # five final tokens left out; only the first page shared
        scheduler.run([Request(start.prompt[:keep] + TURN_NEW[2], 2)])
        assert not any(k.prompt_end for k in scheduler.prefix_cache)
    scheduler.release_kept()


def test_first_turns_snapshot_their_prompts_end_once_later_turns_leave_replies_out(model):
    """Once the later turns seen leave their replies out (the server's template drops reasoning), a conversation's
    first turn snapshots its own prompt's end too, in place of its finished sequence, and its second turn starts
    there (it fed the whole first prompt before); the tokens are those made from scratch."""
    engine = model.engine(CacheConfig(max_seqs=2, max_context=128, max_step_tokens=16))
    scheduler = Scheduler(engine, prefix_cache=True, max_running=1)

    def history(request):
        return request.prompt + request.tokens[3:]

    _conversation(scheduler, Request(SHARED + [1, 2, 3], 8, id=0), 2, TURN_NEW, history)
    assert (scheduler.prefix_hits, scheduler.snapshots) == (0, 1)  # the second turn's own end
    first, second = _conversation(scheduler, Request(PROMPTS[1] + SHARED[:15], 8, id=0), 2, TURN_NEW, history)
    point = (len(first.prompt) - 1) // 16 * 16
    assert scheduler.prefix_hits == 1 and scheduler.prefix_hit_tokens == point and scheduler.snapshots == 3
    scratch = model.engine(CacheConfig(max_seqs=1, max_context=128, max_step_tokens=16))
    for request in (first, second):
        assert request.tokens == scratch.generate([request.prompt], 8)["tokens"][0]
    scheduler.release_kept()
    assert len(engine.free_slots) == 2 and len(engine.free_pages) == engine.sizes["P"]


def test_a_prompt_end_is_not_released_for_another_and_unusable_sequences_are_not_kept(model):
    """Two conversations, both running, one slot for the prefix cache; each later turn leaves the reply out. The
    second turns reach their prompts' ends one after the other: the first keeps the slot and the other's end is not
    snapshotted (a prompt end serves one next turn: releasing it for another's would serve none), and where replies
    are left out no finished sequence is kept (no turn could continue it): the slots stay free for admissions, and
    the third turn of the conversation that kept its end starts there."""
    engine = model.engine(CacheConfig(max_seqs=3, max_context=128, max_step_tokens=16))
    scheduler = Scheduler(engine, prefix_cache=True, max_running=2)
    starts = [Request(PROMPTS[1] + SHARED[:15], 8, id=(0, 0)), Request(SHARED + TURN_NEW[2][:12], 8, id=(1, 0))]
    turns, seconds, kept_after_second = [], [], None
    for request, _ in scheduler.stream(starts):
        conversation, turn = request.id
        if request.finish_reason is None or turn == 2:
            continue
        seconds += [request] if turn == 1 else []
        if turn == 1 and len(seconds) < 2:
            continue
        if turn == 1:
            kept_after_second = [(len(k.tokens), k.prompt_end) for k in scheduler.prefix_cache]
        for last in seconds if turn == 1 else [request]:  # the third turns once both second turns finished
            turns.append(Request(last.prompt + last.tokens[3:] + TURN_NEW[last.id[1]], 8, id=(last.id[0], turn + 1)))
            scheduler.submit(turns[-1])
    points = [(len(r.prompt) - 1) // 16 * 16 for r in seconds]
    assert sorted(points) == [48, 64] and kept_after_second == [(48, True)]  # the first to its end (shorter)
    assert scheduler.prefix_hits == 1 and scheduler.prefix_hit_tokens == 48
    scratch = model.engine(CacheConfig(max_seqs=1, max_context=128, max_step_tokens=16))
    for request in starts + turns:
        assert request.tokens == scratch.generate([request.prompt], 8)["tokens"][0]
    scheduler.release_kept()
    assert len(engine.free_slots) == 3 and len(engine.free_pages) == engine.sizes["P"]


def test_cyclic_conversations_beyond_the_prefix_slots_keep_the_first_ends_until_their_turns(model):
    """More conversations than prefix slots, served as a client with one connection sends them (each turn queued
    behind every other conversation's: a cycle); each later turn leaves the reply out. Least recently used would
    release every prompt end just before its turn (no hit at all). The second turns' round (nothing kept yet for
    them) shows, in the two rules simulated side by side, that protection would serve turns and LRU none; from then
    on an unused prompt end is protected for twice the distance between a conversation's turns, so two
    conversations' third turns start from their ends (2 slots: 2 hits a round) and the others are fed whole. An
    abandoned conversation's
    end ages out: after enough other requests, a new conversation's first turn takes a slot and its second turn
    starts there. Every request makes the tokens it makes from scratch."""
    engine = model.engine(CacheConfig(max_seqs=3, max_context=128, max_step_tokens=16))
    scheduler = Scheduler(engine, prefix_cache=True, max_running=1)
    served, skipped = [], {}  # each request, and the prompt tokens it did not feed (it started from a kept end)

    def serve(request):
        before = scheduler.prefix_hit_tokens
        scheduler.run([request])
        served.append(request)
        skipped[request.id] = scheduler.prefix_hit_tokens - before

    queue = deque(Request([(7 * i + 31 * k) % 480 + 5 for i in range(38 + k)], 8, id=(k, 0)) for k in range(4))
    while queue:
        request = queue.popleft()
        serve(request)
        conversation, turn = request.id
        if turn < 2:
            queue.append(Request(request.prompt + request.tokens[3:] + TURN_NEW[turn], 8, id=(conversation, turn + 1)))
    ends = {r.id: (len(r.prompt) - 1) // 16 * 16 for r in served}
    hits = {k: v for k, v in skipped.items() if v}
    assert len(hits) == 2 and all(turn == 2 and hits[c, turn] == ends[c, 1] for c, turn in hits), hits
    # the second turns' round taught the scheduler that protection would have served turns and LRU none
    assert scheduler._protecting() and not any(lru for lru, _ in scheduler._simulated_hits)
    assert sorted(k.made_by.id for k in scheduler.prefix_cache) == sorted(hits)  # their own ends, for a fourth
    for filler in range(6):  # short requests (no prompt end of their own) until those abandoned ends age out
        serve(Request([5 + filler, 9, 4], 2, id=(10 + filler, 0)))
    assert sorted(k.made_by.id for k in scheduler.prefix_cache) == sorted(hits)
    first = Request(SHARED + PROMPTS[3], 8, id=(20, 0))
    serve(first)
    serve(Request(first.prompt + first.tokens[3:] + TURN_NEW[0], 8, id=(20, 1)))
    assert skipped[20, 1] == (len(first.prompt) - 1) // 16 * 16
    scratch = model.engine(CacheConfig(max_seqs=1, max_context=128, max_step_tokens=16))
    for request in served:
        assert request.tokens == scratch.generate([request.prompt], request.max_new_tokens)["tokens"][0]
    scheduler.release_kept()
    assert len(engine.free_slots) == 3 and len(engine.free_pages) == engine.sizes["P"]


def test_next_turns_sent_at_once_keep_least_recently_used_where_running_requests_hold_the_ends(model):
    """Conversations whose next turn comes as soon as the last finishes (in-process, or a client with a connection
    per conversation), more running than prefix slots; each later turn leaves the reply out. The prefix cache never
    releases an end whose request still runs to keep another's, so the end kept is the one whose turn comes first:
    least recently used serves those turns, and its simulation (which releases as the cache does) counts exactly the
    hits the cache made; protection would have served no more, so it is not switched on. Every request makes the
    tokens it makes from scratch."""
    engine = model.engine(CacheConfig(max_seqs=3, max_context=160, max_step_tokens=16))
    scheduler = Scheduler(engine, prefix_cache=True, max_running=2)
    simulated, simulate_turn = [], scheduler._simulate_turn

    def counted(order):  # whether each simulated rule holds the end a later turn comes for
        simulated.append(tuple(order in scheduler._simulated[rule] for rule in ("lru", "protect")))
        simulate_turn(order)

    scheduler._simulate_turn = counted
    served = [Request([(7 * i + 31 * k) % 480 + 5 for i in range(38 + 3 * k)], 8, id=(k, 0)) for k in range(4)]
    for request in served[:]:
        scheduler.submit(request)
    for request, _ in scheduler.stream():
        conversation, turn = request.id
        if request.finish_reason is not None and turn < 3:
            served.append(Request(request.prompt + request.tokens[3:] + TURN_NEW[turn], 8, id=(conversation, turn + 1)))
            scheduler.submit(served[-1])
    lru, protect = (sum(hits[rule] for hits in simulated) for rule in (0, 1))
    assert scheduler.prefix_hits == lru >= 3 and protect <= lru and not scheduler._protecting()
    scratch = model.engine(CacheConfig(max_seqs=1, max_context=160, max_step_tokens=16))
    for request in served:
        assert request.tokens == scratch.generate([request.prompt], request.max_new_tokens)["tokens"][0]
    scheduler.release_kept()
    assert len(engine.free_slots) == 3 and len(engine.free_pages) == engine.sizes["P"]


@pytest.mark.parametrize("count, turns", [pytest.param(12, 4, id="12x4"),
                                          pytest.param(30, 6, id="30x6", marks=pytest.mark.slow)])
def test_cyclic_conversations_under_cancellation_and_preemption_lose_and_leak_nothing(model, count, turns):
    """Conversations (each later turn leaves the reply's first 2 tokens out) through a client-side queue of 2
    connections, so their turns come back in a cycle and prompt ends are protected; 2 requests run, 3 slots are the
    prefix cache's; two of every six conversations are one 95-token prompt that makes 20 tokens, and 13 pages hold two
    of those only until they decode past their sixth page, so requests are preempted (and recomputed) and kept ends
    released for room; a fifth of the requests are cancelled after their first token (their conversation ends
    there). Prompt ends are kept and later turns start from them (a few: the pages are tight); every request ends
    (length or cancelled), each made the tokens it makes from scratch (a cancelled one a prefix), and the slots and
    pages are all free again."""
    import numpy as np

    engine = model.engine(CacheConfig(max_seqs=5, max_context=96 + 8 * turns, max_step_tokens=16, num_pages=13))
    scheduler = Scheduler(engine, prefix_cache=True, max_running=2)
    kept_ends, take = [], scheduler._take_snapshot

    def taking(request, at, end):  # whether each prompt end reached was kept
        take(request, at, end)
        kept_ends.extend([request.prompt_end_kept] if end else [])

    scheduler._take_snapshot = taking
    rng = np.random.default_rng(7)
    queue = deque(Request([int(t) for t in rng.integers(3, 500, 95)], 20, id=(k, 0)) if k % 6 >= 4 else
                  Request([int(t) for t in rng.integers(3, 500, 20 + 3 * (k % 4))], 6, id=(k, 0))
                  for k in range(count))
    served, in_flight, protecting = [], 0, False
    for _ in range(100_000):
        while queue and in_flight < 2:
            served.append(queue.popleft())
            scheduler.submit(served[-1])
            in_flight += 1
        if not (scheduler.running or scheduler.waiting):
            break
        for request, _ in scheduler.step():
            if request.finish_reason is None and len(request.tokens) == 1 and rng.random() < 0.2:
                assert scheduler.cancel(request)  # mid-stream: its conversation ends
            if request.finish_reason is None:
                continue
            in_flight -= 1
            conversation, turn = request.id
            if request.finish_reason == "length" and turn + 1 < turns and len(request.prompt) != 95:
                new = [int(t) for t in rng.integers(3, 500, 4)]
                queue.append(Request(request.prompt + request.tokens[2:] + new, 6, id=(conversation, turn + 1)))
        protecting = protecting or scheduler._protecting()
    assert not queue and all(r.finish_reason in ("length", "cancelled") for r in served)
    assert protecting and sum(kept_ends) >= count // 3 and scheduler.prefix_hits >= 2
    assert sum(r.preemptions for r in served) > 0 and any(r.finish_reason == "cancelled" for r in served)
    scratch = model.engine(CacheConfig(max_seqs=1, max_context=96 + 8 * turns, max_step_tokens=16))
    for request in served:
        alone = scratch.generate([request.prompt], request.max_new_tokens)["tokens"][0]
        assert request.tokens == (alone if request.finish_reason == "length" else alone[:len(request.tokens)])
    scheduler.release_kept()
    assert len(engine.free_slots) == 5 and len(engine.free_pages) == 13


def test_a_cycle_longer_than_the_turns_remembered_keeps_protecting(model):
    """24 conversations of 5 turns through a client-side queue of one connection, 2 prefix slots; each later turn
    leaves the reply's first tokens out and adds a short message, so a conversation's turns end on the same page.
    Each later turn is recognised as the next of its latest turn (the tail that agrees longest: the distance between
    turns is the cycle of 24 requests, not twice it). The turns where protection and least recently used differ
    are few — protection serves 2 a round, least recently used none, and the other 22 neither — and they are what
    decides: a window of the latest 16 turns of any kind would lose them within a round and hand the protected ends
    back (no hit at all). Protection starts when the third turns' round shows it would have served (the ends kept
    then are the last two conversations'), and from then on those 2 conversations start every turn from their last
    prompt's end — also a turn whose own end is the point it started from (its prompt ends on the same page), which
    snapshots it again as it is admitted — each making the tokens it makes from scratch."""
    engine = model.engine(CacheConfig(max_seqs=3, max_context=128, max_step_tokens=16))
    scheduler = Scheduler(engine, prefix_cache=True, max_running=1)
    queue = deque(Request([(7 * i + 31 * k) % 480 + 5 for i in range(20 + k % 7)], 8, id=(k, 0)) for k in range(24))
    hits = []
    while queue:
        request = queue.popleft()
        before = scheduler.prefix_hits
        scheduler.run([request])
        hits += [request] if scheduler.prefix_hits > before else []
        conversation, turn = request.id
        if turn < 4:
            queue.append(Request(request.prompt + request.tokens[3:] + [9 + turn, 8, 7, 6], 8,
                                 id=(conversation, turn + 1)))
    assert scheduler._cycle() == 24 and scheduler._protecting()
    assert sorted(r.id for r in hits) == [(c, t) for c in (22, 23) for t in (2, 3, 4)], [r.id for r in hits]
    scratch = model.engine(CacheConfig(max_seqs=1, max_context=128, max_step_tokens=16))
    for request in hits:
        assert request.tokens == scratch.generate([request.prompt], 8)["tokens"][0]
    scheduler.release_kept()
    assert len(engine.free_slots) == 3 and len(engine.free_pages) == engine.sizes["P"]
