"""Check qcompile against reference logits stored next to checkpoints (e.g. ../shared/fixtures/*).

Usage: python examples/check_fixtures.py DIR [DIR ...]   (a DIR holding checkpoint sub-directories, or checkpoints)

For each checkpoint with a reference_fp32.safetensors (input_ids [1,T], logits [1,T,V]) it runs the prompt through the
unoptimized graph in f32 and prints the max abs error and the bound 1e-4 × max(1, max |reference|); with a
reference_bf16.safetensors it also reports bf16 top-1 agreement. Exit status 1 if any fp32 check is out of bound.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from qcompile.ir.abi import CacheConfig
from qcompile.runtime.model import load_model


def logits_for(path: Path, ids: list[int], dtype: str) -> np.ndarray:
    model = load_model(path, dtype, progress=False)
    engine = model.engine(CacheConfig(max_seqs=1, max_context=len(ids)))
    return engine.step([(engine.add_sequence(), ids)], all_logits=True)[0]


def check(path: Path) -> bool:
    ref = load_file(str(path / "reference_fp32.safetensors"))
    ids = [int(i) for i in ref["input_ids"][0]]
    expected = ref["logits"][0]
    err = float(np.abs(logits_for(path, ids, "f32") - expected).max())
    bound = 1e-4 * max(1.0, float(np.abs(expected).max()))
    line = f"{path.name}: fp32 max |error| {err:.3g} (bound {bound:.3g}, |logits| ≤ {np.abs(expected).max():.3g})"
    bf16 = path / "reference_bf16.safetensors"
    if bf16.exists():
        ref16 = load_file(str(bf16))["logits_bf16_model"][0].astype(np.float32)
        top1 = float((logits_for(path, ids, "bf16").argmax(-1) == ref16.argmax(-1)).mean())
        line += f"; bf16 top-1 agreement with transformers bf16 {top1:.3f}"
    print(line, flush=True)
    return err <= bound


def main(argv: list[str]) -> int:
    dirs = []
    for arg in argv:
        root = Path(arg)
        dirs += [root] if (root / "reference_fp32.safetensors").exists() else sorted(
            p for p in root.iterdir() if (p / "reference_fp32.safetensors").exists())
    if not dirs:
        print("no checkpoints with reference_fp32.safetensors found", file=sys.stderr)
        return 2
    return 0 if all([check(d) for d in dirs]) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
