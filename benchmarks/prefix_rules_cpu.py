"""Prefix-cache hits of thinking conversations (each later turn leaves the reply's first tokens out), and how well
the scheduler's simulation of its two release rules (runtime/scheduler.py, `_simulate_end`) counts them.

Two ways next turns come: `--mode client` (default) queues turns in arrival order on the client's side, as `bench
--url` does over HTTP — at most c requests in flight, the rest waiting, so with more conversations than prefix slots
each next turn comes after every other conversation's; `--mode in-process` submits a next turn as soon as its last
finishes, as the in-process `bench --turns` does. Counts hits and steps only (no time), so a tiny checkpoint shows
the scheduler's decisions in minutes; the timed measurement is `qcompile serve` + `qcompile bench --url`
(docs/benchmarks.md).

Run: python benchmarks/prefix_rules_cpu.py CHECKPOINT [--mode client|in-process] [--rules] [--input-len 256]
[--output-len 16] [--reasoning-len 4]
prints, per case of prefix slots / conversations / turns / concurrency, the hits and the steps; `--rules` runs each
case three times — least recently used forced, protection forced, the scheduler's choice — and prints beside each
run's hits the later turns simulated and how many of them each simulated rule would have served. Numbers quoted in
docs/benchmarks.md. Run it from an older checkout to compare rules."""

from __future__ import annotations

import argparse
from collections import deque

import numpy as np

from qcompile.compiler.measure import make_prompts, next_turn
from qcompile.ir.abi import CacheConfig
from qcompile.runtime.model import load_model
from qcompile.runtime.scheduler import Request, Scheduler

CASES = [(2, 8, 3, 4), (4, 8, 3, 4), (6, 8, 3, 4), (8, 8, 3, 4), (4, 16, 4, 4), (8, 16, 4, 4), (2, 16, 6, 4),
         (4, 16, 6, 8), (2, 32, 5, 2)]  # (prefix slots, conversations, turns, concurrency)


def conversations(model, vocab: int, slots: int, count: int, turns: int, concurrency: int, input_len: int,
                  output_len: int, reasoning: int, in_process: bool = False, rule: str | None = None
                  ) -> tuple[int, int, tuple[int, int, int]]:
    """(prefix-cache hits, scheduler steps, (later turns simulated, of them least recently used's and protection's
    simulated hits)) of `count` conversations; `rule` ("lru", "protect"): that rule forced for the whole run."""
    context = input_len + turns * (output_len + input_len // 8 + 16)
    engine = model.engine(CacheConfig(max_seqs=concurrency + slots, max_context=context, max_step_tokens=512))
    scheduler = Scheduler(engine, prefix_cache=True, max_running=concurrency)
    simulated = [0, 0, 0]
    simulate_turn = scheduler._simulate_turn

    def counted(order: int) -> None:  # what each simulated cache holds when a later turn comes
        simulated[0] += 1
        simulated[1] += order in scheduler._simulated["lru"]
        simulated[2] += order in scheduler._simulated["protect"]
        simulate_turn(order)

    scheduler._simulate_turn = counted
    if rule is not None:
        scheduler._protecting = lambda: rule == "protect"
    prompts = make_prompts(count, input_len, vocab, 0, 0)
    queue = deque((index, 0, list(prompt)) for index, prompt in enumerate(prompts))
    follow = np.random.default_rng(1)
    in_flight, limit = 0, count if in_process else concurrency
    for _ in range(1_000_000):
        if not (queue or scheduler.running or scheduler.waiting):
            break
        while queue and in_flight < limit:
            index, turn, prompt = queue.popleft()
            scheduler.submit(Request(prompt, output_len, id=(index, turn)))
            in_flight += 1
        for request, _ in scheduler.step():
            if request.finish_reason is None:
                continue
            index, turn = request.id
            in_flight -= 1
            if turn + 1 < turns:
                prompt = next_turn(request.prompt, request.tokens, prompts[index], follow, reasoning)
                if in_process:  # submitted at once, beside the waiting first turns
                    scheduler.submit(Request(prompt, output_len, id=(index, turn + 1)))
                    in_flight += 1
                else:
                    queue.append((index, turn + 1, prompt))
    scheduler.release_kept()
    return scheduler.prefix_hits, scheduler.steps, tuple(simulated)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--mode", choices=["client", "in-process"], default="client")
    ap.add_argument("--rules", action="store_true", help="each rule forced, with the simulation's counts")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--reasoning-len", type=int, default=4)
    args = ap.parse_args()
    model = load_model(args.checkpoint, None, progress=False)
    vocab = int(model.checkpoint.config.vocab_size)
    print("slots conversations turns concurrency: hits steps" +
          (" [simulated later turns, LRU's hits, protection's] for LRU forced | protection forced | chosen"
           if args.rules else ""))
    for slots, count, turns, concurrency in CASES:
        runs = []
        for rule in ("lru", "protect", None) if args.rules else (None,):
            hits, steps, simulated = conversations(model, vocab, slots, count, turns, concurrency, args.input_len,
                                                   args.output_len, args.reasoning_len, args.mode == "in-process",
                                                   rule)
            runs.append(f"{hits} {steps}" + (f" {list(simulated)}" if args.rules else ""))
        print(f"{slots} {count} {turns} {concurrency}: " + " | ".join(runs), flush=True)


if __name__ == "__main__":
    main()
