"""How long `qcompile plan` takes and how it grows with layers and experts.

    python benchmarks/plan_scaling.py [--json FILE]

Plans Qwen3.5-397B-A17B's config (examples/configs) and copies of it with fewer layers (15, 30, 60) and fewer
experts (128, 256, 512) on a TPU7x host at concurrency 64, `all` only and with every single-pass ablation, and
prints the wall time of each. Nothing is read but the config.
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from pathlib import Path

from qcompile.compiler.plan import PlanOptions, run_plan

CONFIG = Path(__file__).parent.parent / "examples" / "configs" / "qwen3.5-397b-a17b.json"


def timed(config: dict, ablate: bool) -> tuple[float, int]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps(config))
        started = time.perf_counter()
        report = run_plan(PlanOptions(source=path, concurrency=(64,), ablate=ablate, input_len=1024, output_len=8192),
                          emit=lambda text: None, progress=lambda text: None)
        return time.perf_counter() - started, report["graph_ops"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    base = json.loads(CONFIG.read_text())
    rows = []
    for layers, experts in ((15, 512), (30, 512), (60, 512), (60, 128), (60, 256)):
        config = copy.deepcopy(base)
        text = config["text_config"]
        text["num_hidden_layers"] = layers
        text["layer_types"] = text["layer_types"][:layers]
        text["num_experts"] = experts
        for ablate in (False, True):
            seconds, ops = timed(config, ablate)
            rows.append({"layers": layers, "experts": experts, "builds": 9 if ablate else 2, "graph_ops": ops,
                         "seconds": round(seconds, 2)})
            print(f"layers {layers:3d} experts {experts:4d} builds {rows[-1]['builds']}: {ops} ops, {seconds:.1f} s",
                  flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
