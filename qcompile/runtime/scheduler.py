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
call plans on what it made, as without pipelining. A penalised request's sampler counts the token in flight on the
device too (runtime/sampling.py: its History holds the tokens read so far, the pending one is looked up there).

Choices of one prompt (a request's `n`) share its prefill: a request whose `parent` is an earlier one with the same
prompt waits while the parent feeds all of the prompt but its last token, then gets a copy of the parent's cache
(Engine.fork: its GDN state slot copied on the device after the step that filled it, its whole KV pages shared),
and every choice feeds the last token itself, so each draws its first token with its own sampling. A prompt fed
once instead of n times, its pages held once; the tokens are the same as without sharing. A child that cannot get a slot or the pages at that moment,
or whose parent finished or was cancelled first, is fed as any other request (never a deadlock: the parent does not
wait for its children).

With `prefix_cache`, a finished request's sequence is kept (slot and pages) with the tokens its cache holds, and a
later request whose feed starts with all of them takes it over and feeds the rest (a GDN state is only reusable at
the end of what it summarised: the next turn of a conversation continues the last). A prefix that prompts share
(a system prompt, an agent's instructions and tools) is kept apart as a snapshot: each admitted prompt's whole pages
are hashed (chained, as vLLM's block hashes), and one that starts with pages an earlier prompt had stops its prefill
at the end of the longest such run, where its sequence is copied (Engine.fork) into a kept snapshot; a later prompt
that starts with a snapshot's tokens gets a copy of it (the snapshot stays) and feeds the rest; one that arrives
while the snapshot is being prefilled waits for it. So the second prompt with a common prefix makes the snapshot
and every later one skips the prefix. Kept sequences are released whenever admission, a fork or a step needs their
slots or pages — before any request is preempted —, least recently used first, snapshots that prompts have started
from last; a waiting request that continues a kept finished sequence is admitted ahead of older ones (bounded:
_admit_continuations). `max_running` below the engine's slots leaves slots that only kept sequences use: a snapshot
then survives a full batch (serve's --prefix-slots).

A thinking model's chat template renders earlier replies without their reasoning, so a conversation's next turn
leaves the last turn's sequence right at its prompt's end (or a few tokens before: Qwen3.5's generation prompt opens
the reasoning block) and never continues a finished sequence. A prompt that starts with an earlier prompt (but for at
most MAX_DROPPED final tokens) and then holds the end of that prompt's reply is such a later turn: it stops its
prefill at its own prompt's end (as many final tokens left out, rounded down to a page) for a snapshot that is kept in
place of its finished sequence, and its next turn takes it over — each turn feeds only the last reply and the new
message (vLLM keeps hybrid models' states at block ends for the same reason). Once most later turns seen lately left
their replies out, first turns snapshot their prompt's end too, and finished sequences are no longer kept. A prompt
end serves one turn: making one releases neither a snapshot prompts started from nor another conversation's end
while its request still runs; past that, least recently used — unless protection would serve more turns. With more
conversations than prefix slots that come back in a cycle (a client queueing requests in arrival order), least
recently used releases every end just before its turn and serves none; protected for twice the usual distance
between a conversation's turns, the ends made first wait for their turns (as many conversations served as there
are slots) and an abandoned conversation's end ages out. Where next turns come at once, least recently used serves
more (abandoned ends go first). Both rules are simulated side by side, each releasing as the cache does, and the one
that would have served more of the latest later turns where they differ runs (_protecting).

With data-parallel ranks (engine.ranks > 1) pages are counted per rank: a request is admitted when the rank it
would go to has the pages, and the request preempted is the youngest on a rank whose plan outgrows its pool.

`Scheduler.stream(requests)` yields `(request, token)` as tokens are made; `run` returns every request finished.
`cancel(request)` stops a waiting or running request between steps (a client that went away): its slot and pages
are freed at once and it finishes as "cancelled".
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator

import attrs

from qcompile.errors import UsageError
from qcompile.runtime.engine import Engine, LaunchedStep, PendingToken, Sequence
from qcompile.runtime.sampling import GREEDY, History, Sampling


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
    history: History | None = None  # what its sampling's penalties read (made at its first step; None: no penalty)
    logprobs: bool = False  # score each made token: `token_logprobs` (engine.TokenLogprob, with the top ids there)
    prompt_logprobs: bool = False  # score each prompt token after the first: `prompt_scores`
    token_logprobs: list = attrs.Factory(list)
    prompt_scores: list = attrs.Factory(list)
    # Another choice of the same prompt, submitted before this one: this request's cache is forked from its
    # prefill (all but the last prompt token) instead of computed again; None once forked, or when it cannot be.
    parent: "Request | None" = None
    children: list = attrs.Factory(list)  # requests waiting to fork from this one's prefill
    # where its prefill stops for a snapshot of a prefix earlier prompts shared (the prefix cache); None: no stop
    snapshot_at: int | None = None
    # a later turn of a conversation whose template leaves the last reply out (a thinking model's drops its
    # reasoning): where its prefill stops for a snapshot of its own prompt's end, which the next turn will start
    # with; once made, that snapshot is kept in place of its finished sequence (`prompt_end_kept`)
    prompt_end_at: int | None = None
    prompt_end_kept: bool = False
    # its prompt continues an earlier prompt and its reply (_turn_end): "left out" or "rendered"; None: no later turn
    later_turn: str | None = None
    # the hash of its prompt's last whole page before its last token, where its end and its finished request are
    # remembered (_shared_prefix); None: not remembered
    last_page: int | None = None
    order: int = -1  # its place among the requests admitted (the age of its prompt end: Scheduler._protected)


@attrs.define(eq=False)
class Kept:
    """A sequence the prefix cache holds: its cache holds exactly `tokens`. A finished request's, or the state at a
    prompt's end kept in its place (`prompt_end`; the next turn of a conversation that leaves the reply out starts
    there) — each taken over by the prompt that continues it —, or a `shared` snapshot of a common prefix (copied for
    each prompt that starts with it)."""

    tokens: list[int]
    seq: Sequence
    shared: bool = False
    hits: int = 0  # prompts that started from it (a snapshot)
    made_by: Request | None = None  # the request whose prompt's end it is (a prompt-end snapshot)

    @property
    def prompt_end(self) -> bool:
        return self.made_by is not None


#: Page hashes remembered for finding prefixes that prompts share (about 100 bytes each).
SEEN_PAGES = 1 << 16
#: Prompts (and their finished sequences) remembered per page they end after.
ENDS_PER_PAGE = 8
#: A later turn may leave out this many of the last prompt's final tokens and still continue it: Qwen3.5's thinking
#: template opens the reasoning block in the generation prompt (`<think>\n`) and renders earlier replies without it.
MAX_DROPPED = 4
#: A later turn's prompt shows it continues a reply by holding this many of the reply's last tokens: its very last
#: ones, or those just before its last 2 (a template may render the reply's last tokens differently: a stop token, a
#: trailing newline).
REPLY_END = 4
#: Later turns whose kind (replies left out or not) decides whether first turns snapshot their prompt's end, and
#: whose distances from their last turn decide how long an unused prompt end is protected; and later turns where the
#: simulated rules differ, which decide whether prompt ends are protected.
TURNS_REMEMBERED = 16
#: An unused prompt end is protected from making room for another until this many times the median distance (in
#: requests admitted) between a conversation's turns seen lately has passed since its request was admitted.
PROTECT_TURNS = 2


@attrs.frozen
class PageEnds:
    """What ended after a remembered page: the tails (tokens past the page) of the prompts whose last whole page
    before their last token it is, each with its request's `order`, and of their finished requests: (length, hash)
    of the cached tokens past the page, the reply's last REPLY_END + 2 tokens and the reply's length."""

    tails: tuple[tuple[tuple[int, ...], int], ...] = ()
    finished: tuple[tuple[int, int, tuple[int, ...], int], ...] = ()


class Scheduler:
    def __init__(self, engine: Engine, prefix_cache: bool = False, max_running: int | None = None):
        self.engine = engine
        # kept sequences, least recently used first, for a later prompt that continues one (the next turn of a
        # conversation) or starts with one (a shared prefix's snapshot); None: released when they finish
        self.prefix_cache: list[Kept] | None = [] if prefix_cache else None
        self.prefix_hits = 0  # requests that continued a kept sequence or started from a snapshot
        self.prefix_hit_tokens = 0  # the prompt tokens those did not feed again
        self.snapshots = 0  # shared prefixes snapshotted so far
        self._passed: tuple[Request | None, int] = (None, 0)  # the oldest waiting request, times a continuation passed it
        # whether each of the latest later turns left its last reply out (_turn_end), and how many of the last
        # prompt's final tokens the latest that did left out too
        self._turns_left_reply_out: deque[bool] = deque(maxlen=TURNS_REMEMBERED)
        self._dropped = 0
        # requests admitted between each of the latest later turns and its last turn (_protected)
        self._turn_distances: deque[int] = deque(maxlen=TURNS_REMEMBERED)
        self._admissions = 0  # requests admitted so far (the clock of _protected)
        # the prompt ends (their makers' admission orders, oldest first) that the prefix cache would hold under least
        # recently used and under protection, simulated side by side whichever rule runs, and whether each of the
        # latest later turns that left the reply out and found its last prompt's end in one simulated cache but not
        # the other found it in each (_protecting)
        self._simulated: dict[str, list[int]] = {"lru": [], "protect": []}
        self._simulated_hits: deque[tuple[bool, bool]] = deque(maxlen=TURNS_REMEMBERED)
        # chained hashes of admitted prompts' whole pages -> what ended after that page (None: nothing)
        self._seen_pages: OrderedDict[int, PageEnds | None] = OrderedDict()
        # requests running at once (at most the engine's slots); slots beyond it are only for kept sequences
        self.max_running = engine.cache_cfg.max_seqs if max_running is None else max_running
        if not 0 < self.max_running <= engine.cache_cfg.max_seqs or self.max_running % engine.ranks:
            raise UsageError(f"max_running {self.max_running} must be a multiple of the {engine.ranks} data-parallel "
                             f"ranks in 1..{engine.cache_cfg.max_seqs} (the engine's slots)")
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

    def _reserved(self, rank: int) -> tuple[int, int]:
        """(slots, pages) on `rank` that the choices still to fork from its running requests will take."""
        slots = pages = 0
        for parent in self.running:
            if parent.children and self._rank(parent) == rank:
                waiting = sum(map(self._to_fork, parent.children))
                slots += waiting
                pages += waiting * self._child_pages(parent)
        return slots, pages

    def _child_pages(self, parent: Request) -> int:
        """Pages a choice forked from `parent` takes to feed the prompt's last token and make its first: those past
        the whole pages it shares with its parent at the fork point."""
        page = self.engine.page_size
        return math.ceil((len(parent.prompt) + 1) / page) - self._fork_point(parent) // page

    def _admit(self) -> None:
        self._fork()
        self._snapshot()
        self._admit_continuations()
        for request in list(self.waiting):  # oldest first
            if self._awaits_fork(request):
                continue
            self._prepare(request)
            if self._awaits_snapshot(request):
                continue
            if not self._admitted(request):
                break  # oldest first: later requests wait behind it rather than starve it
        self._snapshot()  # a request admitted right at its point (it started from a kept sequence that ends there)

    def _prepare(self, request: Request) -> None:
        """A request's feed (its prompt) and snapshot point, when it is first considered for admission: the end of
        the prefix it shares with earlier prompts, or — a later turn of a conversation that leaves the last reply out
        (_turn_end) — its own prompt's end, for its next turn. (A first turn's prompt end: _first_turn_end, when it
        is admitted.)"""
        if request.feed is None:
            request.feed = list(request.prompt)
            shared, request.prompt_end_at, request.later_turn = self._shared_prefix(request)
            request.snapshot_at = shared or None

    def _admit_continuations(self) -> None:
        """Admit, ahead of older requests, waiting requests that continue a finished sequence the prefix cache keeps
        (the next turn of a conversation takes its last turn's slot and pages over): with more conversations than
        slots, admitting first turns in arrival order would release, one after another, the very sequences whose
        next turns are waiting (every turn fed again). Bounded: the oldest waiting request is passed at most
        max_running times."""
        if not self.prefix_cache or not self.waiting or len(self.running) >= self.max_running or \
                all(kept.shared for kept in self.prefix_cache):
            return
        head = self.waiting[0]
        if head is not self._passed[0]:
            self._passed = (head, 0)
        for request in list(self.waiting):
            if self._passed[1] >= self.max_running or len(self.running) >= self.max_running:
                return
            if request.prompt_logprobs or self._awaits_fork(request):
                continue
            self._prepare(request)
            hit = self._continued(request)
            if hit is not None and not hit.shared and self._admitted(request) and request is not head:
                self._passed = (head, self._passed[1] + 1)

    def _admitted(self, request: Request) -> bool:
        """Admit a waiting request if there is room — on a kept sequence its feed continues, on a copy of a snapshot
        it starts with, else on a new one — releasing kept sequences (least recently used first) to make room; False
        when there is none."""
        if not self._started_from_kept(request):
            # pages the running requests' next decode tokens will take come first (on the rank it would go to), then
            # the slots and pages of the choices still to fork from running requests; a request with choices to
            # fork waits for room for them all too, where an idle rank would have it
            if not self._make_room(self.engine.next_rank(), *self._group(request)):
                return False
            self.waiting.remove(request)
            request.seq = self.engine.add_sequence()
            self.running.append(request)
        if request.snapshot_at is not None and request.snapshot_at <= request.prefilled:
            request.snapshot_at = None  # what it starts from covers the shared prefix already
        if request.prompt_end_at is None and request.later_turn is None and not request.preemptions:
            request.prompt_end_at = self._first_turn_end(request)
        if request.prompt_end_at is not None and request.prompt_end_at < request.prefilled:
            request.prompt_end_at = None  # (at it, a resent prompt took its own snapshot over: _snapshot copies it)
        if request.order < 0:  # first admitted: where its prompt ends is remembered, with when (_turn_end)
            request.order, self._admissions = self._admissions, self._admissions + 1
            if request.last_page is not None:
                start = (len(request.prompt) - 1) // self.engine.page_size * self.engine.page_size
                self._mark(request.last_page, tail=(tuple(request.prompt[start:]), request.order))
        return True

    def _group(self, request: Request, shared: int = 0) -> tuple[int, int]:
        """(slots, pages) admitting `request` takes on its rank: its own pages for its feed and one more token, past
        `shared` whole pages it starts with (a snapshot's), and those of its choices still to fork past the ones
        they will share; its own alone when they could never fit together (those are then fed on their own)."""
        own = math.ceil((len(request.feed) + 1) / self.engine.page_size) - shared
        children = sum(map(self._to_fork, request.children))
        slots, pages = 1 + children, own + children * self._child_pages(request)
        if slots > self.max_running // self.engine.ranks or pages > self.engine.sizes["P"] // self.engine.ranks:
            return 1, own
        return slots, pages

    def _make_room(self, rank: int, slots: int, pages: int, keep: Sequence | None = None,
                   takes_over: bool = False) -> bool:
        """Whether `rank` can run `slots` more requests that take `pages` pages from the pool, beside what its
        running requests need next (their decode tokens' pages; the slots and pages of their choices still to
        fork), releasing kept sequences (never `keep`) until it can; `takes_over`: the first of them takes `keep`
        over (its slot and pages count). No kept sequence is released when the running requests alone leave too
        few slots (max_running)."""
        reserved_slots, reserved_pages = self._reserved(rank)
        running = sum(1 for r in self.running if self._rank(r) == rank)
        if running + reserved_slots + slots > self.max_running // self.engine.ranks:
            return False
        need_slots = reserved_slots + slots - takes_over
        need_pages = reserved_pages + pages - (len(keep.pages) if takes_over else 0)
        while len(self.engine.free_slots_by_rank[rank]) < need_slots or self._spare_pages(rank) < need_pages:
            if not self._evict(rank, keep=keep):
                return False
        return True

    def _started_from_kept(self, request: Request) -> bool:
        """Admit `request` on the kept sequence its feed continues (taken over) or on a copy of the snapshot it
        starts with, where its rank has room; False when none fits (it is then admitted as any other)."""
        hit = self._continued(request)
        if hit is None:
            return False
        rank = self.engine.rank_of(hit.seq)
        if hit.shared:  # a copy: a slot, and the request's pages past the snapshot's whole ones (shared)
            shared = hit.seq.length // self.engine.page_size
            if not self._make_room(rank, *self._group(request, shared), keep=hit.seq):
                return False
            request.seq = self.engine.fork(hit.seq)
            hit.hits += 1
            self.prefix_cache.remove(hit)
            self.prefix_cache.append(hit)  # most recently used
        else:  # taken over: its slot and pages are the request's now
            if not self._make_room(rank, *self._group(request), keep=hit.seq, takes_over=True):
                return False
            self.prefix_cache.remove(hit)
            request.seq = hit.seq
        self.waiting.remove(request)
        request.prefilled = len(hit.tokens)
        self.running.append(request)
        self.prefix_hits += 1
        self.prefix_hit_tokens += len(hit.tokens)
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
                pages, rank = self._child_pages(parent), self._rank(parent)
                while (pages > self._spare_pages(rank) or not self.engine.free_slots_by_rank[rank]) and \
                        self._evict(rank):
                    pass
                running = sum(1 for r in self.running if self._rank(r) == rank)
                fits = pages <= self._spare_pages(rank) and running < self.max_running // self.engine.ranks
                seq = self.engine.fork(parent.seq) if fits else None
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
            stops = [at for at in (request.snapshot_at, request.prompt_end_at)
                     if at is not None and at > request.prefilled]
            if stops:  # and at a snapshot
                rest = min(rest, min(stops) - request.prefilled)
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
        counters, targets, starts, histories = [], [], [], []
        for request, tokens, _ in plan:
            if request.sampling.uses_history and request.history is None:
                request.history = History.of(request.prompt, request.tokens, request.sampling)
            histories.append(request.history)
            targets.append(self._prompt_targets(request, len(tokens)))
            starts.append(request.prefilled)
            if request.prefilled < len(request.feed):
                request.prefilled += len(tokens)
            counters.append(len(request.tokens) + isinstance(tokens[0], PendingToken))
        launched = self.engine.launch_tokens([(request.seq, tokens) for request, tokens, _ in plan],
                                             [request.sampling for request, _, _ in plan], counters,
                                             [request.logprobs and emits for request, _, emits in plan],
                                             targets if any(targets) else None, histories)
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

    # -- the prefix cache: finished sequences a later prompt may continue, snapshots of shared prefixes ----------

    def _retire(self, request: Request) -> None:
        """A finished request's sequence: kept (prefix cache) with the tokens its cache holds — its prompt and
        tokens up to its length, which counts a token a step launched ahead fed it — or released: without the
        prefix cache, where its prompt's end is kept instead (the conversation's next turn leaves this reply out),
        or where most later turns leave their replies out (no turn would continue it; unless it is a turn that
        rendered one as made). What it holds is remembered after its prompt's last page either way (_turn_end: a
        next turn that continues it renders the reply as made)."""
        seq = request.seq
        if self.prefix_cache is None or request.prompt_logprobs or seq.length < 2:
            self.engine.release(seq)
            return
        tokens = (list(request.prompt) + list(request.tokens))[:seq.length]
        if request.last_page in self._seen_pages:
            past = tokens[(len(request.prompt) - 1) // self.engine.page_size * self.engine.page_size:]
            self._mark(request.last_page, finished=(len(past), hash(tuple(past)),
                                                    tuple(request.tokens[-REPLY_END - 2:]), len(request.tokens)))
        if request.prompt_end_kept or (self._replies_left_out() and request.later_turn != "rendered"):
            self.engine.release(seq)  # (where replies are left out, no later turn can continue it)
            return
        self.prefix_cache.append(Kept(tokens, seq))

    def _continued(self, request: Request) -> Kept | None:
        """The kept sequence whose tokens the request's feed starts with (the longest, a finished one before a
        snapshot of the same length; at least one token left to feed, which makes its next token), or None. Not
        for a request scoring its prompt."""
        if not self.prefix_cache or request.prompt_logprobs:
            return None
        feed = request.feed
        hits = [kept for kept in self.prefix_cache  # (the last token first: most mismatches cost no slice)
                if len(kept.tokens) < len(feed) and feed[len(kept.tokens) - 1] == kept.tokens[-1] and
                feed[:len(kept.tokens)] == kept.tokens]
        return max(hits, key=lambda kept: (len(kept.tokens), not kept.shared), default=None)

    def _page_digests(self, prompt: list[int]) -> list[int]:
        """Chained hashes of a prompt's whole pages before its last token (which is fed after a snapshot): each
        chains the ones before it, so equal hashes mean equal prefixes (as vLLM's block hashes; a collision costs a
        useless snapshot, never a wrong token: a hit compares the tokens)."""
        page, digest, digests = self.engine.page_size, 0, []
        for start in range(0, len(prompt) - page, page):
            digest = hash((digest, *prompt[start:start + page]))
            digests.append(digest)
        return digests

    def _mark(self, digest: int, tail: tuple[tuple[int, ...], int] | None = None, finished: tuple | None = None):
        """Remember that a prompt ended after page `digest` with `tail` (its tokens past the page, its request's
        order), or that its request finished with `finished` (PageEnds; the latest ENDS_PER_PAGE of each)."""
        ends = self._seen_pages[digest] or PageEnds()
        if tail is not None:
            kept = (*(t for t in ends.tails if t[0] != tail[0]), tail)
            ends = attrs.evolve(ends, tails=kept[-ENDS_PER_PAGE:])
        if finished is not None:
            kept = (*(f for f in ends.finished if f != finished), finished)
            ends = attrs.evolve(ends, finished=kept[-ENDS_PER_PAGE:])
        self._seen_pages[digest] = ends

    def _shared_prefix(self, request: Request) -> tuple[int, int | None, str | None]:
        """For a newly admitted prompt: where it stops for a snapshot of a prefix it shares — the end of the longest
        run of whole pages before its last token (fed after a snapshot) that it starts with and an earlier prompt
        did too; 0: not one page, or it is a later turn of a conversation (that point is about the last prompt's end,
        which no later turn starts from) —, its prompt-end snapshot point and whether it is a later turn (_turn_end).
        Its pages, and where it ends, are remembered for later prompts."""
        if self.prefix_cache is None or request.prompt_logprobs:
            return 0, None, None
        prompt, page, seen = request.prompt, self.engine.page_size, self._seen_pages
        digests = self._page_digests(prompt)
        # the chain: every page before a seen one was seen
        matched = next((index + 1 for index in range(len(digests) - 1, -1, -1) if digests[index] in seen), 0)
        end_at, turn = self._turn_end(prompt, digests[:matched])
        for digest in digests:
            if digest in seen:
                seen.move_to_end(digest)
            else:
                seen[digest] = None
        while len(seen) > SEEN_PAGES:
            seen.popitem(last=False)
        if digests:
            request.last_page = digests[-1]  # (its tail is remembered there when it is admitted: _admitted)
        return (0 if turn else matched * page), end_at, turn

    def _turn_end(self, prompt: list[int], agreeing: list[int]) -> tuple[int | None, str | None]:
        """Where a prompt that continues a conversation whose template leaves the last reply out should stop for a
        snapshot of its own end, which its next turn will start with (None: it does not), and whether it is a later
        turn of a conversation that left the last reply out or rendered it as made (None: no later turn). A GDN
        state is only reusable at the end of what it summarised; a thinking model's template renders earlier replies
        without their reasoning, so the next turn's prompt leaves the reply (and the finished sequence) right at the
        last prompt's end — there, and only there, is a state it can start from. A later turn is recognised by the
        longest earlier prompt it starts with (`agreeing`: the hashes of the pages it shares with earlier prompts):
        all of it but at most MAX_DROPPED final tokens, and then, within the reply's length, REPLY_END of that
        prompt's reply's last tokens (another prompt sharing all but a short last message does not hold a reply the
        model made). If it holds the whole finished sequence, the template
        renders the reply as made (the finished sequence is the one to continue: no point). The point leaves out as
        many final tokens as this prompt left out of the last one, rounded down to a page. The requests admitted
        since the last turn are remembered either way, and a turn that left the reply out is simulated
        (_protecting)."""
        page = self.engine.page_size
        for index in range(len(agreeing) - 1, -1, -1):
            ends = self._seen_pages[agreeing[index]]
            if ends is None or not ends.tails:
                continue
            start = (index + 1) * page
            agreeing_tails = sorted(((_agreement(tail, prompt, start), tail, order) for tail, order in ends.tails),
                                    key=lambda candidate: -candidate[0])  # the latest turn ending on this page first
            for agreed, tail, order in agreeing_tails:
                dropped, left = len(tail) - agreed, start + agreed
                if dropped > MAX_DROPPED or left >= len(prompt):
                    continue
                for length, held, reply_end, reply_length in ends.finished:
                    if start + length < len(prompt) and hash(tuple(prompt[start:start + length])) == held:
                        self._turns_left_reply_out.append(False)
                        self._turn_distances.append(self._admissions - order)
                        return None, "rendered"
                    window = prompt[left:left + reply_length + MAX_DROPPED]
                    if _holds(window, reply_end[-REPLY_END:]) or \
                            (len(reply_end) > REPLY_END and _holds(window, reply_end[:REPLY_END])):
                        self._turns_left_reply_out.append(True)
                        self._turn_distances.append(self._admissions - order)
                        self._simulate_turn(order)
                        self._dropped = dropped
                        return (len(prompt) - max(dropped, 1)) // page * page, "left out"
        return None, None

    def _replies_left_out(self) -> bool:
        """Whether most later turns seen lately left their last reply out (the model's template drops reasoning)."""
        return sum(self._turns_left_reply_out) * 2 > len(self._turns_left_reply_out)

    def _first_turn_end(self, request: Request) -> int | None:
        """Where a newly admitted prompt that is no later turn (a conversation's first, as far as the prefix cache
        can tell) stops for a snapshot of its own end, kept in place of its finished sequence: only where most later
        turns seen by then left their last reply out (the model's template drops reasoning, so this prompt's next
        turn will too), leaving out as many final tokens as the last of them did; None otherwise."""
        if self.prefix_cache is None or request.prompt_logprobs or not self._replies_left_out():
            return None
        page = self.engine.page_size
        at = (len(request.prompt) - max(self._dropped, 1)) // page * page
        return at if at > request.prefilled else None

    def _awaits_snapshot(self, request: Request) -> bool:
        """Whether a waiting request starts with the prefix a running request is prefilling toward a snapshot of
        (longer than what the prefix cache holds for it now): it waits the few steps until the snapshot is there,
        and then starts from it, instead of feeding the prefix too (prompts with one system prompt that arrive
        together)."""
        if self.prefix_cache is None or request.prompt_logprobs:
            return False
        feed = request.feed
        making = [other.snapshot_at for other in self.running  # (rarely any: O(1) per waiting request then)
                  if other.snapshot_at is not None and other.prefilled <= other.snapshot_at < len(feed) and
                  feed[:other.snapshot_at] == other.feed[:other.snapshot_at]]
        if not making:
            return False
        hit = self._continued(request)
        return max(making) > (len(hit.tokens) if hit is not None else 0)

    def _snapshot(self) -> None:
        """Copy every running request whose prefill stands at its snapshot point (launched: the copy follows that
        step on the device) into a kept snapshot — of a prefix prompts share (copied by each prompt that starts
        with it), or of its prompt's end (taken over by its next turn; kept in place of its finished sequence) —,
        unless one holds those tokens already; where its rank has no slot or pages even after releasing older kept
        sequences, it is not taken."""
        for request in self.running:
            for end in (False, True):  # a shared prefix's point comes before the prompt's end
                at = request.prompt_end_at if end else request.snapshot_at
                if at is None or request.prefilled < at:
                    continue
                if end:
                    request.prompt_end_at = None
                else:
                    request.snapshot_at = None
                if request.prefilled == at and request.seq.length == at:
                    if end:
                        self._simulate_end(request.order)
                    self._take_snapshot(request, at, end)

    def _take_snapshot(self, request: Request, at: int, end: bool) -> None:
        """Fork `request`'s sequence, which holds its feed up to `at`, into the prefix cache (`end`: its prompt's
        end, else a shared prefix), releasing older kept sequences for the slot and pages."""
        tokens = request.feed[:at]
        if any(kept.tokens == tokens for kept in self.prefix_cache):
            return
        rank, pages = self._rank(request), self.engine.fork_pages(request.seq)  # 0: its pages are whole
        reserved_slots, reserved_pages = self._reserved(rank)
        if end and self._protecting():
            # protected ends stay in the prefix cache's own slots: in one a running request could take, admitting it
            # would release a protected end
            running = sum(1 for r in self.running if self._rank(r) == rank)
            reserved_slots += max(0, self.max_running // self.engine.ranks - running)
        # a prompt's end serves one next turn: it does not release a snapshot prompts have started from, nor another
        # conversation's prompt end that is likely to be used (_protected)
        while (len(self.engine.free_slots_by_rank[rank]) <= reserved_slots or
               self._spare_pages(rank) < reserved_pages + pages) and self._evict(rank, for_prompt_end=end):
            pass
        if len(self.engine.free_slots_by_rank[rank]) > reserved_slots and \
                self._spare_pages(rank) >= reserved_pages + pages:
            self.prefix_cache.append(Kept(tokens, self.engine.fork(request.seq), shared=not end,
                                          made_by=request if end else None))
            request.prompt_end_kept = end
            self.snapshots += 1

    def _evict(self, rank: int, keep: Sequence | None = None, for_prompt_end: bool = False) -> bool:
        """Release a kept sequence on `rank` (but `keep`), least recently used first among: finished sequences and
        snapshots no prompt has started from yet, but protected prompt ends (_protected); then those; then snapshots
        that prompts have started from (a finished sequence serves at most its next turn, a snapshot in use every
        prompt with its prefix). False when it keeps none. `for_prompt_end` (room for a prompt-end snapshot, which
        serves one turn): only the first."""
        candidates = [kept for kept in self.prefix_cache or ()
                      if self.engine.rank_of(kept.seq) == rank and kept.seq is not keep]
        ranked = [(bool(kept.hits), self._protected(kept), index) for index, kept in enumerate(candidates)]
        if for_prompt_end:
            ranked = [rank_ for rank_ in ranked if rank_[:2] == (False, False)]
        if not ranked:
            return False
        victim = candidates[min(ranked)[2]]
        self.prefix_cache.remove(victim)
        self.engine.release(victim.seq)
        return True

    def _protected(self, kept: Kept) -> bool:
        """Whether a prompt end is kept from making room for another's: its request still runs, or — where
        protection serves more turns than least recently used (_protecting) — it was admitted less than
        PROTECT_TURNS cycles ago (its next turn is likely still to come; an abandoned conversation's end ages out)."""
        if kept.made_by is None:
            return False
        if kept.made_by.finish_reason is None:
            return True
        return self._protecting() and self._admissions - kept.made_by.order < PROTECT_TURNS * self._cycle()

    def _cycle(self) -> int:
        """The median distance, in requests admitted, between a conversation's turns seen lately (0: none seen)."""
        distances = sorted(self._turn_distances)
        return distances[len(distances) // 2] if distances else 0

    def _end_slots(self) -> int:
        """The slots only the prefix cache uses (beyond max_running)."""
        return self.engine.cache_cfg.max_seqs - self.max_running

    def _protecting(self) -> bool:
        """Whether prompt ends are protected: where, over the latest later turns that one simulated rule would have
        served and the other not, protection would have served more (a turn both serve, or neither, says nothing:
        with many more conversations than slots, protection serves a few turns a cycle, and a window of all turns
        would lose them within a round and hand the protected ends back). With more conversations than prefix
        slots that come back in a cycle (a client queueing requests in arrival order), least recently used releases
        each end just before its turn and serves none, protection as many as there are slots; where next turns come
        at once (admitted ahead of waiting first turns), least recently used releases abandoned conversations' ends
        first and serves more."""
        return sum(protect for _, protect in self._simulated_hits) > sum(lru for lru, _ in self._simulated_hits)

    def _simulate_end(self, order: int) -> None:
        """A prompt end reached by the request admitted `order`-th, in both simulated caches of the prefix cache's
        slots, as the real one makes room for it (_take_snapshot): neither releases an end whose request still runs
        (the end is not kept where only those hold the slots); least recently used keeps it in any slot no request
        runs in now, releasing the oldest; protection keeps it in the prefix cache's own slots, releasing an end that
        has aged past PROTECT_TURNS cycles."""
        running = {request.order for request in self.running}
        horizon = PROTECT_TURNS * self._cycle()
        for kept, slots, may_release in (
                (self._simulated["lru"], self.engine.cache_cfg.max_seqs - len(running), lambda made: True),
                (self._simulated["protect"], self._end_slots(), lambda made: self._admissions - made >= horizon)):
            while len(kept) >= slots:
                victim = next((made for made in kept if made not in running and may_release(made)), None)
                if victim is None:
                    break
                kept.remove(victim)
            if len(kept) < slots:
                kept.append(order)

    def _simulate_turn(self, order: int) -> None:
        """A later turn that left the reply out of the prompt the request admitted `order`-th made: whether each
        simulated cache held that prompt's end (taken over), remembered where they differ."""
        lru, protect = (order in self._simulated[rule] for rule in ("lru", "protect"))
        if lru != protect:  # (a turn both rules serve, or neither, says nothing about which to run)
            self._simulated_hits.append((lru, protect))
        for kept in self._simulated.values():
            if order in kept:
                kept.remove(order)

    def release_kept(self) -> None:
        """Release every kept sequence (the engine's slots and pages all free again once nothing runs)."""
        while self.prefix_cache:
            self.engine.release(self.prefix_cache.pop().seq)

    def kept(self) -> tuple[int, int]:
        """(sequences, KV pages) the prefix cache holds: the pages only kept sequences hold (a snapshot's pages are
        also those of the requests that started from it, while they run)."""
        entries = self.prefix_cache or ()
        return len(entries), self.engine.pages_held([kept.seq for kept in entries])

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


def _agreement(tail: tuple[int, ...], prompt: list[int], start: int) -> int:
    """How many of an earlier prompt's `tail` (its tokens past a page) a prompt repeats from `start`."""
    return next((i for i, (a, b) in enumerate(zip(tail, prompt[start:])) if a != b), min(len(tail), len(prompt) - start))


def _holds(tokens: list[int], part: tuple[int, ...]) -> bool:
    """Whether `part` occurs in `tokens` (a later turn's prompt holding the last reply's end)."""
    if not part:
        return False
    part = list(part)
    return any(tokens[i:i + len(part)] == part for i in range(len(tokens) - len(part) + 1) if tokens[i] == part[0])
