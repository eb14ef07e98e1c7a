"""Measure compile time: `--passes none` (load + import + verify) and the numerics-checking machinery, vs layers.

Usage: python benchmarks/compile_time.py [--layers 4,8,12] [--preset bench] [--out docs/compile_time.md]

For each layer count it writes a bench-width checkpoint (qwen3_5_moe, 3 GDN : 1 attention) with that many layers,
then times, in this process:
  graph      Checkpoint.open + import + verify (what `qcompile --passes none CKPT` does without -o)
  weights    reading every parameter onto the device
  checker    EquivalenceChecker: warm-up step + reference run (jit compile + run)
  check      one per-pass check of a rewritten graph (the toy exact pass swap-add: compile + run + compare)
  export     jax.export of every artifact bucket (max_seqs 4, max_step_tokens 64) + weights + manifest
Results go to stdout as a Markdown table (and to --out when given).
"""

from __future__ import annotations

import argparse
import copy
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import jax  # noqa: E402

from qcompile.frontend.checkpoint import Checkpoint  # noqa: E402
from qcompile.frontend.tiny import full_config, write_checkpoint  # noqa: E402
from qcompile.passes.base import PassContext  # noqa: E402
from qcompile.passes.equivalence import EquivalenceChecker  # noqa: E402
from qcompile.compiler.export import write_artifact  # noqa: E402
from qcompile.ir.abi import CacheConfig  # noqa: E402
from qcompile.ir.importer import build_graph  # noqa: E402
from qcompile.ir.weights import load_params  # noqa: E402


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def measure(layers: int, preset: str, root: Path) -> dict:
    import toy_passes

    config = copy.deepcopy(full_config(preset, "qwen3_5_moe", "f32"))
    text = config["text_config"]
    text["num_hidden_layers"] = layers
    text["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    path = write_checkpoint(root / f"L{layers}", config)
    row = {"layers": layers}
    (ckpt, graph), row["graph"] = timed(lambda: (lambda c: (c, build_graph(c)))(Checkpoint.open(path)))
    row["params_M"] = sum(ref_size(ckpt, n) for n in ckpt.params) / 1e6
    params, row["weights"] = timed(lambda: jax.block_until_ready(load_params(ckpt, graph, progress=False)))
    checker, row["checker"] = timed(lambda: EquivalenceChecker(graph, params, seed=0))
    candidate = toy_passes.SWAP_ADD.run(graph, PassContext()).graph
    result, row["check"] = timed(lambda: checker.check(candidate, 0.0, against=graph))
    assert result.ok, result.reason
    out = root / f"art{layers}"
    _, row["export"] = timed(lambda: write_artifact(out, graph, params, config_json=ckpt.config.to_json(),
                                                   cache=CacheConfig(max_seqs=4, max_context=512, max_step_tokens=64),
                                                   progress=False))
    shutil.rmtree(path)
    shutil.rmtree(out)
    return row


def ref_size(ckpt, name):
    size = 1
    for d in ckpt.params[name].shape:
        size *= d
    return size


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", default="4,8,12")
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for layers in [int(x) for x in args.layers.split(",")]:
            rows.append(measure(layers, args.preset, Path(tmp)))
            print(rows[-1], file=sys.stderr, flush=True)
    head = "| layers | parameters (M) | graph (s) | weights (s) | checker (s) | one check (s) | export (s) |"
    lines = [head, "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layers']} | {r['params_M']:.0f} | {r['graph']:.2f} | {r['weights']:.2f} | "
                     f"{r['checker']:.1f} | {r['check']:.1f} | {r['export']:.1f} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
