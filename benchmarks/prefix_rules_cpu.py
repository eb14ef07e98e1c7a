"""Prefix-cache hits of thinking conversations (each later turn leaves the reply's first tokens out) when a client
queues turns in arrival order, as `bench --url` does over HTTP: at most c requests in flight, the rest waiting on the
client's side, so with more conversations than prefix slots each next turn comes after every other conversation's.
Counts hits and steps only (no time), so a tiny checkpoint shows the scheduler's decisions in seconds; the timed
measurement is `qcompile serve` + `qcompile bench --url` (docs/benchmarks.md, "conversations that come back in a
cycle").

Run: python benchmarks/prefix_rules_cpu.py CHECKPOINT [--input-len 256] [--output-len 16] [--reasoning-len 4]
(prints, per case of prefix slots / conversations / turns / concurrency, the hits and the steps; numbers quoted in
docs/benchmarks.md). Run it from an older checkout to compare rules."""

from __future__ import annotations

import argparse
from collections import deque

import numpy as np

from qcompile.compiler.measure import make_prompts, next_turn
from qcompile.ir.abi import CacheConfig
from qcompile.runtime.model import load_model
from qcompile.runtime.scheduler import Request, Scheduler

CASES = [(2, 8, 3, 4), (4, 8, 3, 4), (6, 8, 3, 4), (8, 8, 3, 4), (4, 16, 4, 4), (8, 16, 4, 4), (2, 16, 6, 4),
         (4, 16, 6, 8)]  # (prefix slots, conversations, turns, concurrency)


def conversations(model, vocab: int, slots: int, count: int, turns: int, concurrency: int, input_len: int,
                  output_len: int, reasoning: int) -> tuple[int, int]:
    """(prefix-cache hits, scheduler steps) of `count` conversations served through a client-side queue."""
    context = input_len + turns * (output_len + input_len // 8 + 16)
    engine = model.engine(CacheConfig(max_seqs=concurrency + slots, max_context=context, max_step_tokens=512))
    scheduler = Scheduler(engine, prefix_cache=True, max_running=concurrency)
    prompts = make_prompts(count, input_len, vocab, 0, 0)
    queue = deque((index, 0, list(prompt)) for index, prompt in enumerate(prompts))
    follow = np.random.default_rng(1)
    in_flight = 0
    for _ in range(1_000_000):
        if not (queue or scheduler.running or scheduler.waiting):
            break
        while queue and in_flight < concurrency:
            index, turn, prompt = queue.popleft()
            scheduler.submit(Request(prompt, output_len, id=(index, turn)))
            in_flight += 1
        for request, _ in scheduler.step():
            if request.finish_reason is None:
                continue
            in_flight -= 1
            index, turn = request.id
            if turn + 1 < turns:
                queue.append((index, turn + 1, next_turn(request.prompt, request.tokens, prompts[index], follow,
                                                         reasoning)))
    scheduler.release_kept()
    return scheduler.prefix_hits, scheduler.steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--reasoning-len", type=int, default=4)
    args = ap.parse_args()
    model = load_model(args.checkpoint, None, progress=False)
    vocab = int(model.checkpoint.config.vocab_size)
    print("slots conversations turns concurrency: hits steps")
    for slots, count, turns, concurrency in CASES:
        hits, steps = conversations(model, vocab, slots, count, turns, concurrency, args.input_len, args.output_len,
                                    args.reasoning_len)
        print(f"{slots} {count} {turns} {concurrency}: {hits} {steps}", flush=True)


if __name__ == "__main__":
    main()
