"""Measure XLA CPU settings on the bench preset: decode step time at several concurrencies and one prefill chunk.

Each setting runs in a fresh process (XLA reads XLA_FLAGS once, at start-up) with the same seeded prompts; the
step functions are compiled and warmed before timing; the median of several steps is reported. Also checks that a
setting leaves the logits within the fp32 reassociation noise of the default (fast-math flags may not).

Run: python benchmarks/xla_cpu_flags.py [CHECKPOINT]  (default /tmp/bench, from `qcompile init-tiny /tmp/bench
--preset bench`). Results are quoted in docs/benchmarks.md ("XLA CPU settings").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

SETTINGS = {
    "default": "",
    "xnn-dot": "--xla_cpu_experimental_xnn_fusion_type=dot",
    "xnn-individual-dot": "--xla_cpu_experimental_xnn_fusion_type=individual_dot",
    "xnn-graph-greedy": "--xla_cpu_experimental_xnn_graph_fusion_mode=XNN_GRAPH_FUSION_MODE_GREEDY",
    "ynn-dot": "--xla_cpu_experimental_ynn_fusion_type=dot",
    "ynn-individual-dot": "--xla_cpu_experimental_ynn_fusion_type=individual_dot",
    "onednn-dot": "--xla_cpu_use_onednn=true --xla_cpu_experimental_onednn_fusion_type=dot",
    "no-multi-thread-eigen": "--xla_cpu_multi_thread_eigen=false",
    "concurrency-scheduler": "--xla_cpu_enable_concurrency_optimized_scheduler=true",
    "fast-math": "--xla_cpu_enable_fast_math=true",
    "prefer-vector-512": "--xla_cpu_prefer_vector_width=512",
}

CHILD = r"""
import json, sys, time
import numpy as np
from qcompile.ir.abi import CacheConfig
from qcompile.runtime.model import load_model

path, concurrencies = sys.argv[1], [int(c) for c in sys.argv[2].split(",")]
model = load_model(path, progress=False)
result = {}
rng = np.random.default_rng(0)
for c in concurrencies:
    engine = model.engine(CacheConfig(max_seqs=c, max_context=160, max_step_tokens=512))
    seqs = [engine.add_sequence() for _ in range(c)]
    prompts = [rng.integers(3, model.checkpoint.config.vocab_size, 128).tolist() for _ in seqs]
    t = time.perf_counter()
    first = engine.prefill(list(zip(seqs, prompts)), with_logits=c == 1)
    if c == 1:
        result["logits_c1"] = np.asarray(first[0], np.float64)[:64].tolist()
        first = [int(np.argmax(first[0]))]
    last = list(first)
    for _ in range(3):  # compile and warm the decode bucket
        last = engine.step_tokens([(s, [x]) for s, x in zip(seqs, last)])
    times = []
    for _ in range(9):
        t = time.perf_counter()
        last = engine.step_tokens([(s, [x]) for s, x in zip(seqs, last)])
        times.append(time.perf_counter() - t)
    result[f"decode_ms_c{c}"] = 1e3 * float(np.median(times))
    if c == 1:  # one 128-token prefill chunk, warm
        again = model.engine(CacheConfig(max_seqs=2, max_context=160, max_step_tokens=512))
        times = []
        for _ in range(3):
            s = again.add_sequence()
            t = time.perf_counter()
            again.prefill([(s, prompts[0])], with_logits=False)
            times.append(time.perf_counter() - t)
            again.release(s)
        result["prefill128_ms"] = 1e3 * float(np.median(times[1:]))
print("RESULT " + json.dumps(result))
"""


def measure(flags: str, path: str, concurrencies: str) -> dict:
    env = dict(os.environ, XLA_FLAGS=flags, QCOMPILE_CACHE_DIR="off")
    proc = subprocess.run([sys.executable, "-c", CHILD, path, concurrencies], env=env, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]}


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else "/tmp/bench"
    names = sys.argv[2].split(",") if len(sys.argv) > 2 else list(SETTINGS)
    base = None
    print(f"{'setting':24s} {'decode c1':>10s} {'decode c8':>10s} {'decode c32':>11s} {'prefill128':>11s}  logit diff")
    for name in names:
        r = measure(SETTINGS[name], path, "1,8,32")
        if "error" in r:
            print(f"{name:24s} failed: {r['error']}")
            continue
        if base is None:
            base = r
        import numpy as np

        diff = float(np.abs(np.asarray(r["logits_c1"]) - np.asarray(base["logits_c1"])).max())
        print(f"{name:24s} {r['decode_ms_c1']:8.1f}ms {r['decode_ms_c8']:8.1f}ms {r['decode_ms_c32']:9.1f}ms "
              f"{r['prefill128_ms']:9.1f}ms  {diff:.2g}", flush=True)


if __name__ == "__main__":
    main()
