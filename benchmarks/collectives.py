"""Collective bytes per step of a laid-out model, read from the compiled program, and step time on the simulated mesh.

    python benchmarks/collectives.py CHECKPOINT [--mesh 8] [--layout dp4xtp2] [--tokens 32] [--json FILE]

For one decode-shaped step (T tokens, one per sequence, R = T rows) of CHECKPOINT's unoptimized graph and of the
graph laid out on the mesh by gqa-sharding alone (MoE layers as all-to-all dispatch), by gqa-sharding +
moe-allgather-rs (all-gather → local experts → reduce-scatter) and, on a two-axis mesh (`--mesh 2x4`), with
hierarchical-collectives too (each collective as a local and an across stage), this compiles the step with XLA (cpu rules) and lists
every collective in the optimized HLO with the bytes of its result on one device and the bytes one device sends;
it then times the step (median of repeats) on one device and on the simulated mesh. The simulated devices share this host's cores, so the times are cost structure
(what the layout adds: collectives, per-rank padding), not speed. It also prints gqa-sharding's prediction of the
collective bytes per decode step for the same shape, and for Qwen3.5-397B-A17B on 8 devices at concurrency 64.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--mesh", default="8")
    parser.add_argument("--layout", help="gqa-sharding's plan (e.g. dp4xtp2 on --mesh 4x2) instead of its choice")
    parser.add_argument("--tokens", type=int, default=32, help="decode tokens (sequences) in the step")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--flagship", type=Path, metavar="CHECKPOINT",
                        help="also predict for this full-size checkpoint (e.g. a sparse qwen3.5-397b from init-tiny "
                             "--sparse; only its config and tensor shapes are read) at concurrency 64, context 8192")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    from qcompile.ir.mesh import parse_mesh_spec

    mesh = parse_mesh_spec(args.mesh)
    jax.config.update("jax_num_cpu_devices", mesh.size)

    from qcompile.compiler.distribute import lay_out
    from qcompile.compiler.hlo import collective_stats
    from qcompile.frontend.checkpoint import Checkpoint
    from qcompile.ir.abi import CacheConfig
    from qcompile.ir.importer import build_graph
    from qcompile.ir.weights import fold_weight_preparation, load_params
    from qcompile.passes.gqa_sharding import model_facts, plans
    from qcompile.runtime.engine import Engine

    ckpt = Checkpoint.open(args.checkpoint)
    graph = fold_weight_preparation(build_graph(ckpt, None, 16))
    params = load_params(ckpt, graph, progress=False)
    context = 64
    a2a = lay_out(graph, mesh, concurrency=args.tokens, max_context=context, gather_moe=False, layout=args.layout)
    gathered = lay_out(graph, mesh, concurrency=args.tokens, max_context=context, hierarchical=False,
                       layout=args.layout)
    builds = [("single device", graph), (f"gqa-sharding on {args.mesh}", a2a),
              (f"+ moe-allgather-rs on {args.mesh}", gathered)]
    if len(mesh.shape) > 1:
        builds.append((f"+ hierarchical-collectives on {args.mesh}",
                       lay_out(graph, mesh, concurrency=args.tokens, max_context=context, layout=args.layout)))
    report = {"checkpoint": str(args.checkpoint), "mesh": list(mesh.shape), "tokens": args.tokens, "builds": {},
              "plan": a2a.meta["mesh"].rules and dict(a2a.meta["mesh"].rules)}
    for label, g in builds:
        slots = -(-args.tokens // mesh.size) * mesh.size
        engine = Engine(g, params, CacheConfig(max_seqs=slots, max_context=context, max_step_tokens=args.tokens))
        seqs = [engine.add_sequence() for _ in range(args.tokens)]
        work = [(s, [3 + i]) for i, s in enumerate(seqs)]
        engine.step_tokens(work)  # compile + warm-up
        batch = engine.last_batch
        hlo = engine.program.executable(engine.params, engine.caches, batch, False).as_text()
        times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            engine.step_tokens(work)
            times.append(time.perf_counter() - started)
        found = collective_stats(hlo)
        report["builds"][label] = {"collectives": found, "step_ms_median": 1e3 * statistics.median(times)}
        print(f"{label:<28} step {1e3 * statistics.median(times):7.2f} ms (median of {args.repeats}); collectives: "
              + (", ".join(f"{k} x{s['count']} (groups of {n}) results {s['result_bytes'] / 1024:.1f} KiB, sent "
                        f"{s['sent_bytes'] / 1024:.1f} KiB" for k, v in found.items()
                        for n, s in v["by_group"].items()) or "none"))
        del engine
    facts = model_facts(graph)
    predicted = {p.name: {"moe_collective_bytes": p.moe_bytes, "moe_all_to_all_bytes": p.moe_a2a_bytes,
                          "tp_allreduce_bytes": p.tp_allreduce_bytes}
                 for p in plans(facts, mesh.size, args.tokens, context)}
    report["predicted_bytes_per_device_per_step"] = predicted
    print(f"predicted per device per decode step at concurrency {args.tokens}: "
          + ", ".join(f"{k}: MoE all-gather/reduce-scatter {v['moe_collective_bytes'] / 1024:.1f} KiB (all-to-all "
                      f"{v['moe_all_to_all_bytes'] / 1024:.1f} KiB) + TP all-reduce "
                      f"{v['tp_allreduce_bytes'] / 1024:.1f} KiB" for k, v in predicted.items()))
    if args.flagship:
        flagship = model_facts(build_graph(Checkpoint.open(args.flagship), None, 16))
        report["flagship_predicted"] = {p.name: p.to_json() for p in plans(flagship, 8, 64, 8192)}
        for p in plans(flagship, 8, 64, 8192):
            print(f"flagship {p.name:<12} per device: weights {p.weight_bytes / 2**30:.1f} GiB, KV "
                  f"{p.kv_bytes / 2**30:.2f} GiB, state {p.state_bytes / 2**30:.2f} GiB; per decode step: MoE "
                  f"all-gather/reduce-scatter {p.moe_bytes / 2**20:.2f} MiB (all-to-all {p.moe_a2a_bytes / 2**20:.2f} "
                  f"MiB), TP all-reduce {p.tp_allreduce_bytes / 2**20:.2f} MiB")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
