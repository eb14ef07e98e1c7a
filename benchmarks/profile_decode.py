"""Profile decode steps (or prefill chunks) of the bench preset with jax.profiler and print the HLO ops that take the
most time per step.

Run: python benchmarks/profile_decode.py CONCURRENCY [prefill]  (the `all` build, as `qcompile bench` measures it;
QCOMPILE_PROFILE_PASSES=none profiles the unoptimized graph, QCOMPILE_PROFILE_CHECKPOINT=DIR another checkpoint,
QCOMPILE_PROFILE_PROMPT_LEN=N decode steps after N-token prompts (default 128); prefill: profile prefilling CONCURRENCY fresh
128-token prompts in one chunk, as `bench` does up to its 512-token chunks; needs /tmp/bench from `qcompile init-tiny /tmp/bench --preset bench`;
results quoted in docs/benchmarks.md)."""
import sys, time, glob, gzip, json, collections, os
import jax, numpy as np
from qcompile.runtime.model import load_model
from qcompile.ir.abi import CacheConfig
c = int(sys.argv[1]) if len(sys.argv) > 1 else 1
from qcompile.passes.base import PassContext
from qcompile.passes.manager import run_pipeline
from qcompile.passes.registry import parse_spec
spec = os.environ.get("QCOMPILE_PROFILE_PASSES", "all")
m = load_model(os.environ.get("QCOMPILE_PROFILE_CHECKPOINT", "/tmp/bench"), progress=False,
               rewrite=lambda g: run_pipeline(g, parse_spec(spec), PassContext(), verify_mode="none").graph)
prompt_len = int(os.environ.get("QCOMPILE_PROFILE_PROMPT_LEN", "128"))  # decode after prompts this long
eng = m.engine(CacheConfig(max_seqs=c, max_context=prompt_len + 32, max_step_tokens=512))
seqs = [eng.add_sequence() for _ in range(c)]
rng = np.random.default_rng(0)
first = eng.prefill([(s, rng.integers(3, 32000, prompt_len).tolist()) for s in seqs], with_logits=False)
last = list(first)
for _ in range(3):
    last = eng.step_tokens([(s, [t]) for s, t in zip(seqs, last)])
if len(sys.argv) > 2 and sys.argv[2] == "prefill":
    def run_step():
        fresh = [eng.add_sequence() for _ in range(c)]
        eng.prefill([(s, rng.integers(3, 32000, 128).tolist()) for s in fresh], with_logits=False)
        for s in fresh:
            eng.release(s)
    eng = m.engine(CacheConfig(max_seqs=2 * c, max_context=160, max_step_tokens=128 * c))
    run_step()
    t = time.perf_counter()
    for _ in range(3):
        run_step()
    print(f"prefill of {c}x128 tokens, ms", (time.perf_counter() - t) / 3 * 1e3)
    os.system("rm -rf /tmp/trace")
    jax.profiler.start_trace("/tmp/trace", create_perfetto_trace=True)
    for _ in range(5):
        run_step()
    jax.profiler.stop_trace()
    last = None
t = time.perf_counter()
for _ in range(10 if last is not None else 0):
    last = eng.step_tokens([(s, [t]) for s, t in zip(seqs, last)])
if last is not None:
    print("decode step ms", (time.perf_counter() - t) / 10 * 1e3)
    os.system("rm -rf /tmp/trace")
    jax.profiler.start_trace("/tmp/trace", create_perfetto_trace=True)
    for _ in range(5):
        last = eng.step_tokens([(s, [t]) for s, t in zip(seqs, last)])
    jax.profiler.stop_trace()
f = glob.glob("/tmp/trace/**/*.trace.json.gz", recursive=True)[0]
ev = json.load(gzip.open(f))
evs = ev["traceEvents"] if isinstance(ev, dict) else ev
agg = collections.Counter(); cnt = collections.Counter()
for e in evs:
    if e.get("ph") == "X" and "dur" in e:
        agg[e["name"]] += e["dur"]; cnt[e["name"]] += 1
tot = 0
for name, d in agg.most_common(40):
    print(f"{d/5/1e3:8.2f} ms/step  x{cnt[name]//5:4d}  {name[:100]}")
# Which custom call is which: map ffi_call.N in the trace to its target through the compiled step's HLO.
import re as _re
if True:
    fn = eng.program._jitted[False]
    hlo = fn.lower(eng.params, eng.caches, eng.last_batch).compile().as_text()
    targets = dict(_re.findall(r"(ffi_call(?:\.\d+)?) = .*?custom_call_target=\"(\w+)\"", hlo))
    per = collections.Counter(); n = collections.Counter()
    for name, d in agg.items():
        if name in targets:
            per[targets[name]] += d; n[targets[name]] += 1
    for name, d in per.most_common():
        print(f"{d/5/1e3:8.2f} ms/step  x{n[name]//5:4d}  {name}")
    rest = collections.Counter()
    for name, d in agg.items():
        if name not in targets and not name.startswith(("$", "Thunk")):
            rest[_re.sub(r"[.\d]+$", "", name)] += d
    for name, d in rest.most_common(15):
        print(f"{d/5/1e3:8.2f} ms/step  (other)  {name}")
