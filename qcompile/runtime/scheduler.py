"""Continuous batching: requests arrive and finish at different times; every engine step mixes the running
requests' decode tokens with prefill chunks of newly admitted ones, under a token budget.

Why: lock-step generation (`Engine.generate`) holds a batch until its longest request ends and admits nothing
meanwhile; served workloads keep the batch full instead. Policy, per step:

    1. admit waiting requests, oldest first, while a sequence slot is free and the KV pool has pages for what the
       request must feed now (its prompt, and one more token) — not for its whole future context;
    2. plan one decode token for every request whose prompt is in the cache, then prompt chunks, oldest request
       first, with the rest of the budget (`max_step_tokens` of the engine's cache configuration);
    3. when the plan needs more new pages than are free, preempt the youngest running request — its slot and pages
       go back, and it waits at the head of the queue to be fed again from scratch (prompt + the tokens it already
       made: preemption by recompute, as vLLM does) — and plan again;
    4. one engine step (greedy, or each request's own sampling, on the device; only token ids come back); a request whose last prompt chunk or decode
       token ran gets its next token, and finishes on a stop id or at its max new tokens, freeing its slot and pages.

Steps are pipelined (Engine.launch_tokens): `step()` plans and launches the next step on top of the one in flight —
its decode tokens taken on the device, requests that reach their max new tokens with the step in flight left out —
and only then reads the step in flight and returns its tokens. So the host's planning, packing and dispatch overlap
the device's step. A request whose token turns out to be a stop id has had one more token made for it, which is
dropped; a plan that would need a preemption is not launched ahead: the step in flight is read first and the next
call plans on what it made, as without pipelining.

Choices of one prompt (a request's `n`) share its prefill: a request whose `parent` is an earlier one with the same
prompt waits while the parent feeds all of the prompt but its last token, then gets a copy of the parent's cache
(Engine.fork: its GDN state slot and KV pages, copied on the device after the step that filled them), and every
choice feeds the last token itself, so each draws its first token with its own sampling. A prompt fed once instead
of n times; the tokens are the same as without sharing. A child that cannot get a slot or the pages at that moment,
or whose parent finished or was cancelled first, is fed as any other request (never a deadlock: the parent does not
wait for its children).

With `prefix_cache`, a finished request's sequence is kept (slot and pages) with the tokens its cache holds, and a
later request whose feed starts with all of them takes it over and feeds the rest (a GDN state is only reusable at
the end of what it summarised: the next turn of a conversation continues the last). Kept sequences are released,
oldest first, whenever admission, a fork or a step needs their slots or pages — before any request is preempted.

With data-parallel ranks (engine.ranks > 1) pages are counted per rank: a request is admitted when the rank it
would go to has the pages, and the request preempted is the youngest on a rank whose plan outgrows its pool.

`Scheduler.stream(requests)` yields `(request, token)` as tokens are made; `run` returns every request finished.
`cancel(request)` stops a waiting or running request between steps (a client that went away): its slot and pages
are freed at once and it finishes as "cancelled".
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterable, Iterator

import attrs

from qcompile.errors import UsageError
from qcompile.runtime.engine import Engine, LaunchedStep, PendingToken, Sequence
from qcompile.runtime.sampling import GREEDY, Sampling


@attrs.define(eq=False)
class Request:
    prompt: list[int]
    max_new_tokens: int
    stop_ids: tuple[int, ...] = ()
    id: object = None
    tokens: list[int] = attrs.Factory(list)
    finish_reason: str | None = None  # "stop" (a stop id, included in tokens), "length" or "cancelled"
    submitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    seq: Sequence | None = None
    feed: list[int] | None = None  # what must be in the cache before decoding: the prompt (+ made tokens after a
    prefilled: int = 0             # preemption); how much of it is
    preemptions: int = 0
    sampling: Sampling = GREEDY  # temperature / top-k / top-p / seed (runtime/sampling.py); greedy by default
    logprobs: bool = False  # score each made token: `token_logprobs` (engine.TokenLogprob, with the top ids there)
    prompt_logprobs: bool = False  # score each prompt token after the first: `prompt_scores`
    token_logprobs: list = attrs.Factory(list)
    prompt_scores: list = attrs.Factory(list)
    # Another choice of the same prompt, submitted before this one: this request's cache is forked from its
    # prefill (all but the last prompt token) instead of computed again; None once forked, or when it cannot be.
    parent: "Request | None" = None
    children: list = attrs.Factory(list)  # requests waiting to fork from this one's prefill


class Scheduler:
    def __init__(self, engine: Engine, prefix_cache: bool = False):
        self.engine = engine
        # finished sequences kept with the tokens their cache holds, oldest first, for a later prompt that continues
        # one (the next turn of a conversation); None: released when they finish
        self.prefix_cache: list[tuple[list[int], Sequence]] | None = [] if prefix_cache else None
        self.prefix_hits = 0  # requests that continued a kept sequence
        self.prefix_hit_tokens = 0  # the prompt tokens those did not feed again
        self.budget = engine.cache_cfg.max_step_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.steps = 0
        self.preemptions = 0  # requests preempted (and later recomputed) so far
        self.forks = 0  # choices forked from their prompt's prefill so far
        self.shared_prompt_tokens = 0  # the prompt tokens those forks did not feed again
        # the step launched and not read yet, with its plan and each item's first fed position
        self._in_flight: tuple[LaunchedStep, list[tuple[Request, list, bool]], list[int]] | None = None

    def _pages(self, request: Request) -> int:
        return math.ceil((len(request.prompt) + request.max_new_tokens) / self.engine.page_size)

    def submit(self, request: Request) -> None:
        """Queue a request; refuses (exit 2) one that could never be served by this engine. A request whose `parent`
        has the same prompt (of two or more tokens) and is not finished waits to fork from its prefill."""
        self.check(request)
        request.submitted_at = time.perf_counter()
        parent = request.parent
        if parent is not None and len(request.prompt) > 1 and parent.prompt == request.prompt and \
                parent.finish_reason is None and parent.submitted_at is not None and \
                parent.prefilled <= self._fork_point(parent):
            parent.children.append(request)
        else:
            request.parent = None
        self.waiting.append(request)

    def check(self, request: Request) -> None:
        """Raise UsageError for a request this engine could never serve (reads only static sizes: safe from any
        thread)."""
        if not request.prompt or request.max_new_tokens < 1:
            raise UsageError("a request needs a non-empty prompt and max_new_tokens >= 1")
        total = len(request.prompt) + request.max_new_tokens
        if total > self.engine.cache_cfg.max_context:
            raise UsageError(f"request {request.id!r}: {total} tokens exceed the max context "
                             f"{self.engine.cache_cfg.max_context}")
        pool = self.engine.sizes["P"] // self.engine.ranks
        if self._pages(request) > pool:
            where = f" of each of {self.engine.ranks} ranks" if self.engine.ranks > 1 else ""
            raise UsageError(f"request {request.id!r} needs {self._pages(request)} KV pages; the pool{where} has "
                             f"{pool}")

    def cancel(self, request: Request) -> bool:
        """Stop `request` now, waiting or running: its slot and pages go back to the pool and it finishes as
        "cancelled" with the tokens it made so far. False when it had finished already (or was never submitted)."""
        if request.finish_reason is not None:
            return False
        if request in self.running:
            self.engine.release(request.seq)
            request.seq = None
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        else:
            return False
        request.finish_reason, request.finished_at = "cancelled", time.perf_counter()
        return True

    def _new_pages(self, request: Request, tokens: int) -> int:
        """Pages `request` must take from the pool to add `tokens` tokens to its cache."""
        held = len(request.seq.pages) if request.seq is not None else 0
        length = request.seq.length if request.seq is not None else 0
        return max(0, math.ceil((length + tokens) / self.engine.page_size) - held)

    def _rank(self, request: Request) -> int:
        return self.engine.rank_of(request.seq)

    def _spare_pages(self, rank: int) -> int:
        """Free pages on `rank` beyond those its running requests' next decode tokens will take."""
        return len(self.engine.free_pages_by_rank[rank]) - sum(
            self._new_pages(r, 1) for r in self.running if r.prefilled == len(r.feed) and self._rank(r) == rank)

    def _room(self, rank: int) -> tuple[int, int]:
        """(slots, pages) free on `rank` beyond what its running requests need next: their decode tokens' pages and
        the slots and pages of their choices still to fork."""
        slots, spare = len(self.engine.free_slots_by_rank[rank]), self._spare_pages(rank)
        for parent in self.running:
            if parent.children and self._rank(parent) == rank:
                waiting = sum(map(self._to_fork, parent.children))
                slots -= waiting
                spare -= waiting * math.ceil(len(parent.prompt) / self.engine.page_size)
        return slots, spare

    def _admit(self) -> None:
        self._fork()
        for request in list(self.waiting):  # oldest first
            if self._awaits_fork(request):
                continue
            if request.feed is None:
                request.feed = list(request.prompt)
            if not self._admitted(request):
                break  # oldest first: later requests wait behind it rather than starve it

    def _admitted(self, request: Request) -> bool:
        """Admit a waiting request if there is room — on a kept sequence its feed continues, else on a new one —
        releasing kept sequences (oldest first) to make room; False when there is none."""
        hit = self._continued(request)
        if hit is not None:  # continue a kept sequence: its slot and pages are the request's now
            tokens, seq = hit
            rank = self.engine.rank_of(seq)
            need = math.ceil((len(request.feed) + 1) / self.engine.page_size) - len(seq.pages)
            while need > self._room(rank)[1]:
                if not self._evict(rank, keep=seq):
                    return False
            self.prefix_cache.remove(hit)
            self.waiting.remove(request)
            request.seq, request.prefilled = seq, len(tokens)
            self.running.append(request)
            self.prefix_hits += 1
            self.prefix_hit_tokens += len(tokens)
            return True
        # pages the running requests' next decode tokens will take come first (on the rank it would go to), then
        # the slots and pages of the choices still to fork from running requests; a request with choices to fork
        # waits for room for them all too, where an idle rank would have it
        rank, pages = self.engine.next_rank(), math.ceil((len(request.feed) + 1) / self.engine.page_size)
        group = 1 + sum(map(self._to_fork, request.children))
        if group > self.engine.cache_cfg.max_seqs // self.engine.ranks or \
                group * pages > self.engine.sizes["P"] // self.engine.ranks:
            group = 1  # could never fit together: the choices that cannot fork are fed on their own
        while True:
            slots, spare = self._room(rank)
            if slots >= group and group * pages <= spare:
                break
            if not self._evict(rank):
                return False
        self.waiting.remove(request)
        request.seq = self.engine.add_sequence()
        self.running.append(request)
        return True

    @staticmethod
    def _fork_point(request: Request) -> int:
        """How much of a prompt a parent prefills before its children fork: all but the last token, which each
        choice then feeds itself (its first token is drawn there, with its own sampling)."""
        return len(request.prompt) - 1

    @staticmethod
    def _to_fork(child: Request) -> bool:
        """Whether a child is still waiting to fork (not cancelled, not fed on its own): O(1), unlike a search of
        the waiting queue."""
        return child.parent is not None and child.seq is None and child.finish_reason is None

    def _awaits_fork(self, request: Request) -> bool:
        """Whether a waiting request is still to be forked from its parent's prefill (else it is fed as any other:
        its parent finished, went past the fork point, or it was never linked)."""
        parent = request.parent
        if parent is not None and parent.finish_reason is None and request in parent.children and \
                parent.prefilled <= self._fork_point(parent):
            return True
        request.parent = None
        return False

    def _fork(self) -> None:
        """Fork the children of every running request whose prefill stands at the fork point (launched: the copy
        follows that step on the device); a child that cannot have a slot or the pages now is fed on its own."""
        for parent in self.running:
            if not parent.children or parent.prefilled != self._fork_point(parent) or \
                    parent.seq.length != self._fork_point(parent):
                continue
            for child in parent.children:
                if not self._to_fork(child):  # cancelled meanwhile
                    continue
                pages, rank = math.ceil(len(child.prompt) / self.engine.page_size), self._rank(parent)
                while (pages > self._spare_pages(rank) or not self.engine.free_slots_by_rank[rank]) and \
                        self._evict(rank):
                    pass
                seq = self.engine.fork(parent.seq) if pages <= self._spare_pages(rank) else None
                child.parent = None
                if seq is None:
                    continue
                child.seq, child.feed, child.prefilled = seq, list(child.prompt), parent.prefilled
                self.forks += 1
                self.shared_prompt_tokens += parent.prefilled
                self.waiting.remove(child)
                self.running.append(child)
            parent.children = []

    def _preempt(self, request: Request) -> None:
        self.engine.release(request.seq)
        request.seq, request.prefilled, request.preemptions = None, 0, request.preemptions + 1
        self.preemptions += 1
        request.feed = list(request.prompt) + list(request.tokens)
        self.running.remove(request)
        self.waiting.appendleft(request)

    def _plan(self, pending: dict | None = None) -> list[tuple[Request, list, bool]]:
        """(request, tokens to feed, whether its next token comes out) for one step under the budget. `pending`:
        the requests that get a token from the step in flight -> that token (still on the device); a request
        whose pending token is its last (max new tokens) sits this step out."""
        plan, left = [], self.budget
        for request in self.running:
            if request.prefilled == len(request.feed) and left > 0:
                if pending and request in pending:
                    if len(request.tokens) + 1 >= request.max_new_tokens:
                        continue
                    plan.append((request, [pending[request]], True))
                else:
                    plan.append((request, [request.tokens[-1]], True))
                left -= 1
        for request in self.running:
            rest = len(request.feed) - request.prefilled
            if request.children and request.prefilled < self._fork_point(request):  # stop where its children fork
                rest = self._fork_point(request) - request.prefilled
            if rest and left > 0:
                take = min(rest, left)
                plan.append((request, request.feed[request.prefilled:request.prefilled + take],
                             request.prefilled + take == len(request.feed)))
                left -= take
        return plan

    def _short_rank(self, plan) -> int | None:
        """A rank whose part of the plan needs more new pages than it has free (None when every rank has them)."""
        need = [0] * self.engine.ranks
        for request, tokens, _ in plan:
            need[self._rank(request)] += self._new_pages(request, len(tokens))
        for rank, pages in enumerate(need):
            if pages > len(self.engine.free_pages_by_rank[rank]):
                return rank
        return None

    def step(self) -> list[tuple[Request, int]]:
        """One engine step: launch the next step (planned on top of the one in flight, if any), then read the step
        in flight; returns the (request, new token) pairs it made (empty when nothing is left to do)."""
        if self._in_flight is None:
            self._in_flight = self._launch(self._plan_now())
            if self._in_flight is None:
                return []
        following = self._launch_ahead()
        made = self._read(*self._in_flight)
        self._in_flight = following
        return made

    def _plan_now(self) -> list[tuple[Request, list, bool]]:
        """Admit, plan, and preempt until the plan fits the pages (nothing in flight)."""
        self._admit()
        plan = self._plan()
        while (short := self._short_rank(plan)) is not None:
            # kept sequences give their pages back first; then, as a request needs at most a rank's pool (submit),
            # a short rank runs two or more: preempt its youngest
            if not self._evict(short):
                if len(self.running) < 2:
                    break
                self._preempt([r for r in self.running if self._rank(r) == short][-1])
            plan = self._plan()
        return plan

    def _launch_ahead(self):
        """The next step planned on top of the one in flight and launched, or None: nothing to plan, or the plan
        would need a preemption (the step in flight is read first, and the next call plans without it)."""
        step, plan, _ = self._in_flight
        pending = {request: step.token(index) for index, (request, _, emits) in enumerate(plan)
                   if emits and request.finish_reason is None}
        self._admit()
        ahead = self._plan(pending)
        if self._short_rank(ahead) is not None:
            return None
        return self._launch(ahead)

    def _launch(self, plan):
        """Launch `plan` (its prompt chunks marked fed); (the launched step, plan), or None for an empty plan."""
        if not plan:
            return None
        counters, targets, starts = [], [], []
        for request, tokens, _ in plan:
            targets.append(self._prompt_targets(request, len(tokens)))
            starts.append(request.prefilled)
            if request.prefilled < len(request.feed):
                request.prefilled += len(tokens)
            counters.append(len(request.tokens) + isinstance(tokens[0], PendingToken))
        launched = self.engine.launch_tokens([(request.seq, tokens) for request, tokens, _ in plan],
                                             [request.sampling for request, _, _ in plan], counters,
                                             [request.logprobs and emits for request, _, emits in plan],
                                             targets if any(targets) else None)
        self.steps += 1
        return launched, plan, starts

    @staticmethod
    def _prompt_targets(request: Request, fed: int) -> list[int]:
        """For a request scoring its prompt: the prompt tokens that follow the `fed` tokens it feeds now (a prompt
        chunk) and are not scored yet, one per fed token from the first; [] when none (a decode token, a chunk past
        the prompt, a recompute after preemption of what was scored before it)."""
        start, prompt = request.prefilled, request.prompt
        if not request.prompt_logprobs or start >= len(request.feed):
            return []
        count = min(fed, len(prompt) - 1 - start)  # row j scores prompt[start + j + 1]
        if count <= 0 or start + count <= len(request.prompt_scores):
            return []
        return list(prompt[start + 1:start + 1 + count])

    @staticmethod
    def _keep_prompt_scores(request: Request, start: int, scores) -> None:
        """Record the prompt scores a step made for `request` feeding from position `start` (those a recompute after
        preemption made again are already there)."""
        if scores:
            request.prompt_scores += scores[len(request.prompt_scores) - start:]

    def _read(self, step: LaunchedStep, plan, starts: list[int]) -> list[tuple[Request, int]]:
        """The tokens of a launched step, given to the requests that were waiting for them (not to one that has
        finished since it was launched: a stop id in the step before, or cancelled)."""
        nexts = step.tokens()
        scored = step.logprobs()
        now = time.perf_counter()
        made = []
        for (request, _, emits), token, scores, start in zip(plan, nexts, scored, starts):
            if request.finish_reason is not None:
                continue
            self._keep_prompt_scores(request, start, scores.prompt)
            if not emits:
                continue
            if scores.next is not None:
                request.token_logprobs.append(scores.next)
            request.tokens.append(token)
            request.first_token_at = request.first_token_at or now
            made.append((request, token))
            if token in request.stop_ids:
                request.finish_reason = "stop"
            elif len(request.tokens) >= request.max_new_tokens:
                request.finish_reason = "length"
            if request.finish_reason:
                request.finished_at = now
                self._retire(request)
                request.seq = None
                self.running.remove(request)
        return made

    # -- the prefix cache: finished sequences a later prompt may continue -----------------------------------------

    def _retire(self, request: Request) -> None:
        """A finished request's sequence: kept (prefix cache) with the tokens its cache holds — its prompt and
        tokens up to its length, which counts a token a step launched ahead fed it — or released."""
        seq = request.seq
        if self.prefix_cache is None or request.prompt_logprobs or seq.length < 2:
            self.engine.release(seq)
            return
        self.prefix_cache.append(((list(request.prompt) + list(request.tokens))[:seq.length], seq))

    def _continued(self, request: Request) -> tuple[list[int], Sequence] | None:
        """The kept sequence whose tokens the request's feed continues (the longest; at least one token left to
        feed, which makes its next token), or None. Not for a request scoring its prompt."""
        if not self.prefix_cache or request.prompt_logprobs:
            return None
        feed = request.feed
        hits = [entry for entry in self.prefix_cache
                if len(entry[0]) < len(feed) and feed[:len(entry[0])] == entry[0]]
        return max(hits, key=lambda entry: len(entry[0]), default=None)

    def _evict(self, rank: int, keep: Sequence | None = None) -> bool:
        """Release the oldest kept sequence on `rank` (but `keep`); False when it keeps none."""
        for index, (_, seq) in enumerate(self.prefix_cache or ()):
            if self.engine.rank_of(seq) == rank and seq is not keep:
                del self.prefix_cache[index]
                self.engine.release(seq)
                return True
        return False

    def release_kept(self) -> None:
        """Release every kept sequence (the engine's slots and pages all free again once nothing runs)."""
        while self.prefix_cache:
            self.engine.release(self.prefix_cache.pop()[1])

    def kept(self) -> tuple[int, int]:
        """(sequences, KV pages) the prefix cache holds."""
        entries = self.prefix_cache or ()
        return len(entries), sum(len(seq.pages) for _, seq in entries)

    def stream(self, requests: Iterable[Request] = ()) -> Iterator[tuple[Request, int]]:
        """Submit `requests` and step until every submitted request has finished, yielding tokens as they come."""
        for request in requests:
            self.submit(request)
        while self.waiting or self.running:
            made = self.step()
            if not made and not self.running and self.waiting:
                raise UsageError("the waiting requests can never be admitted (too few sequence slots or pages)")
            yield from made

    def run(self, requests: Iterable[Request]) -> list[Request]:
        requests = list(requests)
        for _ in self.stream(requests):
            pass
        return requests
