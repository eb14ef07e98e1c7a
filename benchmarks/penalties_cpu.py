"""What penalties cost a served decode on CPU: the same requests through the scheduler with and without Qwen3.5's
card's presence penalty (1.5), greedy and with the card's sampling (temperature 0.7, top-k 20, top-p 0.8), in one
process on one build. A penalised step's sampler adds its (request, token) pairs (benchmarks/sampler_cpu.py times
those alone) and counts the token of the step before, still on the device, by a lookup among them; a penalised
greedy request takes the logits path, which a plain greedy step skips. Run it from an older checkout to compare (at
6b38fa2 a penalised step was not launched ahead of the step before it).

Run: python benchmarks/penalties_cpu.py CHECKPOINT [--input-len 128] [--output-len 64] [--concurrency 1,8,32]
[--dtype bf16] [--repeats 2]
prints decode tok/s (tokens after each request's first / the time from the last first token to the last finish)
per setting and concurrency, the best of --repeats alternated runs, each setting warmed up once first (its
sampler programs compiled). Numbers quoted in docs/serving.md."""

from __future__ import annotations

import argparse

import attrs

from qcompile.compiler.measure import make_prompts
from qcompile.ir.abi import CacheConfig
from qcompile.runtime.model import load_model
from qcompile.runtime.sampling import GREEDY, Sampling
from qcompile.runtime.scheduler import Request, Scheduler

SETTINGS = (("greedy", GREEDY), ("greedy + presence 1.5", Sampling(presence_penalty=1.5)),
            ("card sampling", Sampling(0.7, 20, 0.8)),
            ("card + presence 1.5", Sampling(0.7, 20, 0.8, presence_penalty=1.5)))


def decode_rate(engine, prompts, output_len: int, param: Sampling) -> float:
    requests = [Request(list(p), output_len, id=i, sampling=attrs.evolve(param, seed=i))
                for i, p in enumerate(prompts)]
    Scheduler(engine).run(requests)
    start = max(r.first_token_at for r in requests)
    end = max(r.finished_at for r in requests)
    return sum(len(r.tokens) - 1 for r in requests) / (end - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    model = load_model(args.checkpoint, args.dtype, progress=False)
    vocab = model.checkpoint.config.vocab_size
    print("| concurrency | " + " | ".join(name for name, _ in SETTINGS) + " |")
    print("|---|" + "---|" * len(SETTINGS))
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        engine = model.engine(CacheConfig(max_seqs=concurrency, max_context=args.input_len + args.output_len,
                                          max_step_tokens=512))
        prompts = make_prompts(concurrency, args.input_len, vocab, 0, 0)
        best = {name: 0.0 for name, _ in SETTINGS}
        for name, param in SETTINGS:
            decode_rate(engine, prompts, args.output_len, param)  # warm-up: compiles
        for _ in range(args.repeats):
            for name, param in SETTINGS:
                best[name] = max(best[name], decode_rate(engine, prompts, args.output_len, param))
        print(f"| {concurrency} | " + " | ".join(f"{best[name]:.1f}" for name, _ in SETTINGS) + " |", flush=True)
        del engine


if __name__ == "__main__":
    main()
