"""Measure full-scale compiles: compile time, peak resident memory and artifact size per `--weights` mode and target.

Usage: python benchmarks/full_scale_compile.py [--root DIR] [--targets cpu,tpu] [--modes none,link,copy]
                                               [--layers N --experts E]

Writes a header-only sparse checkpoint (`qcompile init-tiny --sparse`: real safetensors headers, data as file holes
that read as zeros) of Qwen3.5-397B-A17B (60 layers, 512 experts, bf16, 793 GB in 16 shards) — or, with --layers /
--experts, the same widths with fewer layers or experts — and runs `qcompile CKPT --passes all --verify none -o OUT
--weights MODE --target T` in a fresh process for each mode and target, measuring its wall time and peak resident
set (getrusage of the child). Artifact size counts the bytes the artifact adds on disk: hard links to the checkpoint's
files are not counted. Results are printed as a Markdown table (quoted in docs/compile_time.md).
"""

from __future__ import annotations

import argparse
import copy
import shutil
import subprocess
import sys
from pathlib import Path

from qcompile.frontend.tiny import full_config, write_sparse_checkpoint


def peak_of(argv: list[str]) -> tuple[int, float, int, str]:
    """(exit code, wall seconds, peak resident bytes, last stderr line) of argv run in a fresh process."""
    probe = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
             "p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
             "print(p.returncode, time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); "
             "print((p.stderr.strip().splitlines() or [''])[-1])")
    done = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True)
    first, last = (done.stdout.splitlines() + ["", ""])[:2]
    code, seconds, kib = first.split()
    return int(code), float(seconds), int(kib) * 1024, last


def added_bytes(root: Path, checkpoint: Path) -> int:
    if not root.exists():
        return 0
    inodes = {p.stat().st_ino for p in checkpoint.iterdir()}
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and p.stat().st_ino not in inodes)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, default=Path("/tmp/qcompile-full-scale"))
    parser.add_argument("--targets", default="cpu,tpu")
    parser.add_argument("--modes", default="none,link,copy")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--experts", type=int)
    args = parser.parse_args()
    config = copy.deepcopy(full_config("qwen3.5-397b", "qwen3_5_moe", "bf16"))
    text = config["text_config"]
    if args.layers:
        text["num_hidden_layers"] = args.layers
        text["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 or i == args.layers - 1 else "linear_attention"
                               for i in range(args.layers)]
    if args.experts:
        text["num_experts"] = args.experts
    shutil.rmtree(args.root, ignore_errors=True)
    ckpt = write_sparse_checkpoint(args.root / "checkpoint", config)
    size = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    print(f"checkpoint: {text['num_hidden_layers']} layers, {text['num_experts']} experts, {size / 1e9:.1f} GB in "
          f"{len(list(ckpt.glob('*.safetensors')))} shards (sparse)", flush=True)
    print("| target | --weights | exit | wall (s) | peak RSS (MiB) | artifact adds |")
    print("|---|---|---|---|---|---|")
    for target in args.targets.split(","):
        for mode in args.modes.split(","):
            out = args.root / f"{target}-{mode}"
            argv = [sys.executable, "-m", "qcompile.cli", str(ckpt), "--passes", "all", "--verify", "none",
                    "--target", target, "-o", str(out), "--weights", mode, "--max-seqs", "4",
                    "--max-step-tokens", "16"]
            code, seconds, peak, last = peak_of(argv)
            note = f" ({last})" if code else ""
            print(f"| {target} | {mode} | {code} | {seconds:.0f} | {peak / 2**20:.0f} | "
                  f"{added_bytes(out, ckpt) / 1e6:.1f} MB{note} |", flush=True)
            shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(args.root, ignore_errors=True)


if __name__ == "__main__":
    main()
