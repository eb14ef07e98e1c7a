"""Measure peak resident memory of `qcompile run` (checkpoint and artifact), `qcompile bench` at concurrency 32,
Hugging Face transformers eager and, when given, llama.cpp — each in its own process, on the same checkpoint, prompt
length and number of new tokens — next to the weight and cache bytes qcompile reports.

Usage: python benchmarks/memory.py CHECKPOINT [--artifact DIR] [--concurrency 32]
                                  [--llama-cli PATH --gguf FILE [--llama-prompt TEXT]]

llama.cpp is not a dependency: build its `llama-completion` yourself and convert the checkpoint with its
convert_hf_to_gguf.py (--outtype f32); a checkpoint without a tokenizer needs one made for the conversion.

The artifact, when not given, is compiled into a temporary directory with `--passes all --max-seqs C --max-context
64`. Each command runs under a wrapper process whose getrusage(RUSAGE_CHILDREN) is that command's peak resident set.
Also measures `jax.device_put` of a 1 GiB memory-mapped file: 64-byte aligned (used in place) and 8-byte aligned
(copied). Prints a Markdown table (quoted in docs/benchmarks.md, "Memory").
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "5,17,300,42,7,9,11,13"  # 8 tokens in, 4 out: the measurement
NEW_TOKENS = 4


def peak_of(argv: list[str]) -> tuple[int, int, str, str]:
    """(exit code, peak resident bytes, stdout, stderr tail) of argv in a fresh process."""
    probe = ("import resource, subprocess, sys; p = subprocess.run(sys.argv[1:], capture_output=True, text=True, errors=\"replace\"); "
             "sys.stderr.write(p.stderr[-3000:]); sys.stdout.write(p.stdout); "
             "print(p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    done = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, errors="replace")
    *lines, last = done.stdout.strip().splitlines()
    code, kib = last.split()
    return int(code), int(kib) * 1024, "\n".join(lines), done.stderr


TRANSFORMERS = """
import sys, torch
from transformers import AutoModelForCausalLM
torch.set_num_threads(2)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
ids = torch.tensor([[int(t) for t in sys.argv[2].split(",")]])
with torch.no_grad():
    out = model.generate(ids, max_new_tokens=int(sys.argv[3]), do_sample=False)
print(",".join(str(t) for t in out[0, ids.shape[1]:].tolist()))
"""


def device_put_costs(scratch: Path) -> dict:
    """Seconds and resident growth of device_put of a 1 GiB mapped file, aligned (in place) and misaligned (copy)."""
    import jax
    import numpy as np

    from qcompile.runtime.memory import resident

    path = scratch / "blob"
    with open(path, "wb") as f:
        f.write(os.urandom(1 << 20) * 1025)
    out = {}
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    for label, offset in (("aligned", 64), ("misaligned", 8)):
        view = np.frombuffer(mapped, np.float32, count=(1 << 30) // 4, offset=offset)
        before = resident()["total"]
        started = time.perf_counter()
        array = jax.block_until_ready(jax.device_put(view, may_alias=True))
        seconds = time.perf_counter() - started
        out[label] = {"seconds": seconds, "resident_growth": resident()["total"] - before,
                      "in_place": array.unsafe_buffer_pointer() == view.ctypes.data}
        del array
        mapped.madvise(mmap.MADV_DONTNEED)
    path.unlink()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--artifact", type=Path)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--llama-cli", type=Path, help="llama.cpp's llama-cli / llama-completion binary")
    parser.add_argument("--gguf", type=Path, help="the checkpoint converted to GGUF (f32) for llama.cpp")
    parser.add_argument("--llama-prompt", default="Hello big world",
                        help="a text prompt of 8 tokens in the GGUF's tokenizer (it has no token-id input)")
    args = parser.parse_args()
    qcompile = [sys.executable, "-m", "qcompile.cli"]
    scratch = Path(tempfile.mkdtemp())
    artifact = args.artifact
    if artifact is None:
        artifact = scratch / "art"
        subprocess.run([*qcompile, str(args.checkpoint), "--passes", "all", "--verify", "none", "-o", str(artifact),
                        "--max-seqs", str(args.concurrency), "--max-context", "64"], check=True)
    rows = []
    for label, source in (("qcompile run CHECKPOINT", args.checkpoint), ("qcompile run ARTIFACT", artifact)):
        code, peak, out, err = peak_of([*qcompile, "run", str(source), "--prompt-ids", PROMPT, "--max-new-tokens",
                                        str(NEW_TOKENS), "--ignore-eos", "--json"])
        assert code == 0, err
        memory = json.loads(out.splitlines()[-1])["memory"]
        rows.append((label, peak, memory))
    code, peak, out, err = peak_of([*qcompile, "bench", str(artifact), "--concurrency", str(args.concurrency),
                                    "--input-len", "16", "--output-len", "16", "--json", str(scratch / "b.json")])
    assert code == 0, err
    run = json.loads((scratch / "b.json").read_text())["runs"][0]
    rows.append((f"qcompile bench ARTIFACT c={args.concurrency} (16 in / 16 out)", peak, run["memory"]))
    code, peak, out, err = peak_of([sys.executable, "-c", TRANSFORMERS, str(args.checkpoint), PROMPT,
                                    str(NEW_TOKENS)])
    assert code == 0, err
    rows.append(("transformers eager (f32)", peak, None))
    if args.llama_cli and args.gguf:
        code, peak, out, err = peak_of([str(args.llama_cli), "-m", str(args.gguf), "-p", args.llama_prompt,
                                        "-n", str(NEW_TOKENS), "-t", "2", "-no-cnv", "--no-warmup", "--ignore-eos",
                                        "--temp", "0", "-c", "256"])
        rows.append(("llama.cpp (f32 GGUF, mmap)", peak, None) if code == 0 else
                    ("llama.cpp: failed " + err.strip().splitlines()[-1][:80], 0, None))
    weights = rows[1][2]["weights"]["bytes"]
    print("| process | peak RSS | weights | KV pages + GDN state | largest step temporaries | peak / weights |")
    print("|---|---|---|---|---|---|")
    for label, peak, memory in rows:
        if memory:
            caches = sum(memory["caches"].values())
            temps = memory["temporaries"]["largest_bytes"] or 0
            print(f"| {label} | {peak / 2**30:.2f} GiB | {memory['weights']['bytes'] / 2**30:.2f} GiB "
                  f"({memory['weights']['mapped_bytes'] / max(1, memory['weights']['bytes']):.0%} in place) | "
                  f"{caches / 2**20:.1f} MiB | {temps / 2**20:.1f} MiB "
                  f"({memory['temporaries']['largest_bucket']}) | {peak / memory['weights']['bytes']:.2f}× |")
        else:
            print(f"| {label} | {peak / 2**30:.2f} GiB | {weights / 2**30:.2f} GiB | | | {peak / weights:.2f}× |")
    for label, cost in device_put_costs(scratch).items():
        print(f"device_put of a 1 GiB mapped file, {label}: {cost['seconds'] * 1e3:.2f} ms, resident +"
              f"{cost['resident_growth'] / 2**20:.0f} MiB, in place: {cost['in_place']}")


if __name__ == "__main__":
    main()
