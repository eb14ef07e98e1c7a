"""The engine on a thread of its own, for a server: requests come in from any thread (the HTTP event loop), the
continuous-batching scheduler steps on this one, and every token goes to its request's listener as it is made.

Why a thread: an engine step is a blocking JAX call (milliseconds to seconds); meanwhile the HTTP event loop must
keep accepting requests, streaming tokens and noticing clients that went away. Only this thread touches the
scheduler and the engine. Other threads talk to it through a command queue (submit, cancel) that is applied between
steps, so a cancelled request's slot and pages are back in the pool before the next step is planned. Listeners are
called on this thread: they must only hand the event on (e.g. `loop.call_soon_threadsafe`), never block.

If a step fails, every request in flight finishes with reason "error" (its listener is told), the loop stops, and
`error` says why; a server then answers /health with 503.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable

import attrs

from qcompile.errors import UsageError
from qcompile.runtime.scheduler import Request, Scheduler

__all__ = ["EngineLoop", "LoopState"]


@attrs.define(eq=False)
class _Job:
    request: Request
    on_token: Callable[[Request, int], None]
    on_finish: Callable[[Request], None]


@attrs.frozen
class LoopState:
    """What the loop looks like after a step (for metrics): request counts and pages in use."""

    running: int
    waiting: int
    kv_pages_used: int
    kv_pages_total: int
    slots_used: int
    slots_total: int
    tokens_per_s: float  # generated tokens per second over the last `window` seconds
    step_seconds: float | None  # the last step's wall time (None before the first)
    tokens_made: int = 0  # every token the engine has made since the loop started (cancelled requests' too)
    preemptions: int = 0  # requests preempted for pages (and recomputed) since the loop started
    forks: int = 0  # choices forked from their prompt's prefill (a request's n) since the loop started
    shared_prompt_tokens: int = 0  # prompt tokens those forks did not compute again
    prefix_cached: int = 0  # sequences the prefix cache keeps: finished ones, shared prefixes' (not in *_used above)
    prefix_hits: int = 0  # requests that continued a kept sequence or started from a snapshot since the loop started
    prefix_hit_tokens: int = 0  # prompt tokens those did not compute again
    prefix_snapshots: int = 0  # shared prefixes snapshotted since the loop started


class EngineLoop:
    """Runs `scheduler` on a daemon thread; `submit` and `cancel` are safe from any thread.

    `on_state(LoopState)` (optional) is called on the engine thread after every step and after commands change the
    pool, e.g. to set metrics gauges.
    """

    def __init__(self, scheduler: Scheduler, on_state: Callable[[LoopState], None] | None = None,
                 window: float = 10.0):
        self.scheduler = scheduler
        self.on_state = on_state
        self.window = window
        self.error: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._jobs: dict[Request, _Job] = {}
        self._stopping = False
        self._made: deque[tuple[float, int]] = deque()  # (time, tokens made by that step) within the window
        self._last_step: float | None = None
        self._tokens_made = 0
        self._thread = threading.Thread(target=self._main, name="qcompile-engine", daemon=True)

    # -- any thread --------------------------------------------------------------------------------------------------

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Finish the current step, cancel whatever is still in flight and end the thread."""
        self.request_stop()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def request_stop(self) -> None:
        """stop() without waiting (safe from a signal handler): after the current step every request still queued
        or in flight finishes as cancelled, so its client gets a finish_reason before the connections close."""
        self._stopping = True
        self._wake.set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def check(self, request: Request) -> None:
        """Raise UsageError now, in the caller's thread, for a request this engine could never serve."""
        self.scheduler.check(request)

    def submit(self, request: Request, on_token: Callable[[Request, int], None],
               on_finish: Callable[[Request], None]) -> None:
        """Queue `request`; `on_token(request, token)` for every token, then `on_finish(request)` once (its
        finish_reason set: stop, length, cancelled or error)."""
        self.submit_all([(request, on_token, on_finish)])

    def submit_all(self, jobs: list[tuple[Request, Callable, Callable]]) -> None:
        """`submit` each (request, on_token, on_finish), all applied between the same two steps (a request's
        choices: the scheduler forks the later ones from the first's prefill only if it has not run past it)."""
        for request, _, _ in jobs:
            self.check(request)
        if self._stopping or not self._thread.is_alive():
            for request, _, on_finish in jobs:
                request.finish_reason = "error" if self.error is not None else "cancelled"
                on_finish(request)
            return
        self._commands.put(("submit", [_Job(*job) for job in jobs]))
        self._wake.set()

    def cancel(self, request: Request) -> None:
        """Stop `request` (a client that went away); its listener gets on_finish with reason "cancelled" unless it
        finished first. Idempotent."""
        self._commands.put(("cancel", request))
        self._wake.set()

    # -- the engine thread -------------------------------------------------------------------------------------------

    def _apply(self) -> bool:
        changed = False
        while True:
            try:
                kind, item = self._commands.get_nowait()
            except queue.Empty:
                return changed
            changed = True
            if kind == "submit":
                for job in item:
                    self._submit(job)
            elif kind == "cancel" and self.scheduler.cancel(item):
                self._finish(item)

    def _submit(self, job: _Job) -> None:
        if self._stopping:
            job.request.finish_reason = "cancelled"
            job.on_finish(job.request)
            return
        try:
            self.scheduler.submit(job.request)
        except UsageError:  # checked by `submit` already; never let one request stop the loop
            job.request.finish_reason = "cancelled"
            job.on_finish(job.request)
            return
        self._jobs[job.request] = job

    def _finish(self, request: Request) -> None:
        job = self._jobs.pop(request, None)
        if job is not None:
            job.on_finish(request)

    def tokens_per_s(self) -> float:
        """Generated tokens per second over the last `window` seconds, now (0 once the server has been idle that
        long); safe from any thread (it reads a copy of the step record, which only the engine thread trims)."""
        now = time.perf_counter()
        recent = [(at, count) for at, count in list(self._made) if at >= now - self.window]
        span = min(self.window, now - recent[0][0]) if recent else 0.0
        return sum(count for _, count in recent) / span if span > 0 else 0.0

    def state(self) -> LoopState:
        engine, now = self.scheduler.engine, time.perf_counter()
        while self._made and self._made[0][0] < now - self.window:
            self._made.popleft()
        total_pages, total_slots = engine.sizes["P"], engine.cache_cfg.max_seqs
        kept, kept_pages = self.scheduler.kept()  # held, but given back whenever a request needs them
        return LoopState(running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
                         kv_pages_used=total_pages - sum(map(len, engine.free_pages_by_rank)) - kept_pages,
                         kv_pages_total=total_pages,
                         slots_used=total_slots - sum(map(len, engine.free_slots_by_rank)) - kept,
                         slots_total=total_slots,
                         tokens_per_s=self.tokens_per_s(), step_seconds=self._last_step,
                         tokens_made=self._tokens_made, preemptions=self.scheduler.preemptions,
                         forks=self.scheduler.forks, shared_prompt_tokens=self.scheduler.shared_prompt_tokens,
                         prefix_cached=kept, prefix_hits=self.scheduler.prefix_hits,
                         prefix_hit_tokens=self.scheduler.prefix_hit_tokens,
                         prefix_snapshots=self.scheduler.snapshots)

    def _report(self) -> None:
        if self.on_state is not None:
            self.on_state(self.state())

    def _main(self) -> None:
        scheduler = self.scheduler
        try:
            while not self._stopping:
                if self._apply():
                    self._report()
                if not (scheduler.waiting or scheduler.running):
                    self._wake.wait(1.0)
                    self._wake.clear()
                    continue
                started = time.perf_counter()
                made = scheduler.step()
                now = time.perf_counter()
                self._last_step = now - started
                if made:
                    self._made.append((now, len(made)))
                    self._tokens_made += len(made)
                for request, token in made:
                    job = self._jobs.get(request)
                    if job is not None:
                        job.on_token(request, token)
                    if request.finish_reason is not None:
                        self._finish(request)
                self._report()
        except BaseException as err:  # noqa: BLE001 - reported through .error and every listener
            self.error = err
            if not isinstance(err, (KeyboardInterrupt, SystemExit)):  # the operator sees why the server stopped serving
                print(f"qcompile: the engine stopped: {type(err).__name__}: {' '.join(str(err).split())[:300]}; "
                      "requests get 503 until the server is restarted", file=sys.stderr, flush=True)
        finally:
            self._apply_stopped()

    def _apply_stopped(self) -> None:
        """The loop is over: every request still queued or in flight finishes (cancelled, or error after a failure)."""
        self._stopping = True
        reason = "error" if self.error is not None else "cancelled"
        while True:
            try:
                kind, item = self._commands.get_nowait()
            except queue.Empty:
                break
            if kind == "submit":
                self._jobs.update((job.request, job) for job in item)
        for request in list(self._jobs):
            if request.finish_reason is None:
                try:
                    self.scheduler.cancel(request)
                except Exception:  # noqa: BLE001 - the engine may be what failed
                    pass
                request.finish_reason = reason
            self._finish(request)
