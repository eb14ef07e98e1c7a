"""`qcompile plan`: whether a model fits a deployment, how many sequences fit at what context, what each pass is
worth and what throughput to expect — from the config alone, before renting the hardware.

What: the full-size step graph is built from shapes only (config.json alone: the tensor table is derived from it;
a checkpoint: its index or safetensors headers are read, no weight), given the target's mesh (`--target tpu7x
--chips 4`: 4 chips × 2 TensorCores = `4x2`), and run through the pass pipeline structurally — each pass applied
and the IR verifier run after it, no numerics (there are no weights) — for `none`, the selected passes and each
single-pass ablation, at each concurrency (gqa-sharding's plan depends on it). Each build is then measured on paper,
per device, on its own laid-out graph:

- memory: weights by kind (what each device holds after the layout: routed experts split over the devices,
  attention / GDN / MLP matrices over the tensor-parallel group), the KV pages and GDN state slots the concurrency
  needs at `input + output` tokens of context, and an activation peak (a liveness scan of the step's intermediates at
  the prefill and decode shapes, local shapes, caches excluded since they are updated in place); whether that fits
  the device's memory, and the largest concurrency at that context and the longest context at that concurrency.
  Where this host can compile the plan's program (a one-device cpu plan), XLA's own memory analysis of the decode
  step beside it (`xla_decode_memory`: compiled from abstract arguments, nothing allocated).
- time: each op's cost rule (ir/cost.py: the bytes that must move and the FLOPs) on one device's shapes and work —
  its rank's sequences, the experts it holds, uniform routing — at the target's published ceilings
  (ir/hardware.py), plus each collective's bytes (ring algorithms, as compiler/hlo.py counts compiled ones) at the
  interconnect bandwidth, not overlapped. Decode steps at the workload's mean context, prefill one prompt per rank per
  step; a workload's time is its prefill plus `output` decode steps at the concurrency (one wave of continuous
  batching), and the prediction is total (input + output) and output tokens per second per chip.

These are roofline predictions — what the cost model says the hardware allows — not measurements; docs/plan.md sets
them beside the published measurements for the flagship.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import attrs

from qcompile.compiler.hlo import SENT_PER_RESULT_BYTE
from qcompile.compiler.lowered import lowered_step
from qcompile.errors import CheckpointError, UsageError
from qcompile.frontend.checkpoint import Checkpoint, canonical_fp8, canonical_params, resolve_paths
from qcompile.frontend.config import parse_config
from qcompile.frontend.tiny import hub_tensors
from qcompile.ir.abi import graph_cache_types
from qcompile.ir.cost import COSTS, Cost, StepShape, dequantized_reads
from qcompile.ir.graph import Graph
from qcompile.ir.hardware import HARDWARE, hardware
from qcompile.ir.importer import DEFAULT_PAGE_SIZE, ImportOptions, import_graph
from qcompile.ir.mesh import parse_mesh_spec, request_host_devices
from qcompile.ir.ops.collective import COLLECTIVE_KINDS
from qcompile.ir.ops.core import Input, Param
from qcompile.ir.ops.moe import GroupedMatmul, GroupedMatmulSwiglu
from qcompile.ir.types import np_dtype
from qcompile.ir.verifier import verify
from qcompile.ir.weights import fold_weight_preparation
from qcompile.passes.base import PassContext
from qcompile.passes.registry import parse_spec

#: The field's two workload shapes (input, output tokens per request).
WORKLOADS = {"prefill-heavy": (8192, 1024), "decode-heavy": (1024, 8192)}
TARGETS = (*HARDWARE, "cpu")


@attrs.frozen
class PlanOptions:
    source: Path
    target: str = "tpu7x"
    chips: int | None = None  # default: one host's chips
    concurrency: tuple[int, ...] = (64,)
    input_len: int | None = None
    output_len: int | None = None
    passes: str = "all"
    ablate: bool = True
    json: Path | None = None
    mesh: str | None = None  # another arrangement of the same devices (e.g. 4x2 for 8 H200s: TP over pairs)
    lower: bool = True  # export the planned decode step for the target's platform (compiler/lowered.py)


@attrs.frozen
class Target:
    """Where the plan runs: per-device ceilings, devices, chips and the mesh they form."""

    name: str
    lowering: str
    chips: int
    devices: int
    memory_bytes: int
    memory_bytes_per_s: float
    flops_per_s: dict
    interconnect_bytes_per_s: float
    mesh_spec: str
    source: str


def target_of(name: str, chips: int | None) -> Target:
    if name == "cpu":
        from qcompile.compiler.measure import measure_ceilings

        chips = chips or 1
        request_host_devices(chips)  # before measuring starts JAX: the lowering lays the step out on `chips` devices
        ceilings = measure_ceilings()
        rates = ceilings["matmul_flops_per_s"]
        return Target("cpu (this machine, measured)", "cpu", chips, chips, _host_memory() // chips,
                      ceilings["bandwidth_bytes_per_s"] / chips, {k: v / chips for k, v in rates.items()},
                      ceilings["bandwidth_bytes_per_s"] / chips, str(chips), "measured in this run")
    try:
        hw = hardware(name)
    except ValueError as err:
        raise UsageError(f"--target: {err}") from None
    chips = chips or hw.chips_per_host
    per = hw.per_device()
    n = hw.devices_per_chip
    spec = f"{chips}x{n}" if n > 1 else str(chips)
    return Target(hw.name, hw.lowering_target, chips, chips * n, per["memory_bytes"], per["memory_bytes_per_s"],
                  per["peak_flops_per_s"], per["interconnect_bytes_per_s"], spec, "ir/hardware.py (published)")


def _host_memory() -> int:
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def abstract_graph(source: Path) -> tuple[Graph, dict, str]:
    """The unoptimized step graph of `source` from shapes only: (graph, raw config, where the shapes came from).
    A config.json (or a directory holding only one) gives the Hub tensor table its config implies; a checkpoint
    gives its own, read from the index or the safetensors headers."""
    source = Path(source)
    config_path = source if source.is_file() and source.suffix == ".json" and not source.name.endswith(
        ".index.json") else source / "config.json" if source.is_dir() else None
    has_weights = source.is_dir() and (any(source.glob("*.safetensors")) or any(source.glob("*.index.json"))) or (
        source.is_file() and (source.suffix == ".safetensors" or source.name.endswith(".index.json")))
    if config_path is None and not has_weights:
        raise UsageError(f"{source}: give a config.json, a checkpoint directory or a safetensors file/index")
    if has_weights:
        config_path, _ = resolve_paths(source)
    try:
        raw = json.loads(Path(config_path).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{config_path}: no such file") from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{config_path}: cannot read it as JSON ({err})") from None
    if has_weights:
        ckpt = Checkpoint.open(source)
        cfg, shapes, where = ckpt.config, {n: ref.shape for n, ref in ckpt.params.items()}, "checkpoint headers"
        fp8 = tuple((n, block) for n in ckpt.params if (block := ckpt.fp8_block(n)) is not None)
    else:
        cfg = parse_config(raw, str(config_path))
        sources = hub_tensors(raw)
        prefix = "model.language_model." if raw.get("model_type") == "qwen3_5_moe" else "model."
        refs = canonical_params(cfg, set(sources), prefix)
        shapes = {n: ref.shape for n, ref in refs.items()}
        quant = cfg.quantization
        fp8 = () if quant is None else tuple(
            (n, block) for n, ref in refs.items()
            if (block := canonical_fp8(quant, ref, lambda s: quant.stores_fp8(s, sources[s]))[0]) is not None)
        where = "config.json (tensor shapes derived from it)"
    dtype = cfg.dtype if cfg.dtype in ("f32", "bf16") else "bf16"
    graph = import_graph(cfg, shapes, ImportOptions(dtype=dtype, page_size=DEFAULT_PAGE_SIZE, fp8_blocks=fp8))
    verify(graph)
    return graph, raw, where


def run_structurally(graph: Graph, spec: str, ctx: PassContext) -> tuple[Graph, list[dict]]:
    """The passes of `spec` applied in pipeline order, the verifier after each; no numerics (no weights)."""
    report = []
    for pass_ in parse_spec(spec):
        result = pass_.run(graph, ctx)
        entry = {"pass": pass_.name, "applied": bool(result.changed)}
        if result.skipped:
            entry["skipped"] = result.skipped
        else:
            entry["stats"] = {k: v for k, v in result.stats.items() if k != "plans"}
        if result.changed:
            verify(result.graph)
            graph = result.graph
        report.append(entry)
    return graph, report


def _ways(mesh, sharding, index: int) -> int:
    if mesh is None or sharding is None or not mesh.rules:
        return 1
    axis = sharding.dims[index]
    return mesh.ways(axis) if axis is not None else 1


def local_shape(graph: Graph, t, shape: tuple[int, ...]) -> tuple[int, ...]:
    """One device's block of a value of type `t` bound to `shape`."""
    mesh = graph.meta.get("mesh")
    return tuple(d // _ways(mesh, t.sharding, i) for i, d in enumerate(shape))


def _nbytes(t, shape) -> int:
    return math.prod(shape) * np_dtype(t.dtype)(0).itemsize


def weight_kind(name: str) -> str:
    if ".experts." in name:
        return "routed experts"
    if "shared_expert" in name or ".mlp." in name and not name.endswith("mlp.gate"):
        return "shared expert / MLP"
    if "self_attn" in name:
        return "attention"
    if "linear_attn" in name:
        return "GDN"
    if name.endswith(("embed_tokens", "lm_head")):
        return "embedding / head"
    return "norms / router"


def weights_per_device(folded: Graph) -> dict[str, int]:
    """Bytes one device holds per kind of weight (prepared weights under the kind of the weights they are made of)."""
    recipes = folded.meta.get("prepared", {})
    kinds: dict[str, int] = {}
    for node in folded.find(Param):
        t = node.op.type
        shape = tuple(int(d) for d in t.shape)
        name = node.op.name
        if name in recipes:  # the first parameter the recipe names
            start = recipes[name].find('param "')
            name = recipes[name][start + 7:recipes[name].find('"', start + 7)] if start >= 0 else name
        kind = weight_kind(name)
        kinds[kind] = kinds.get(kind, 0) + _nbytes(t, local_shape(folded, t, shape))
    return kinds


def cache_bytes(graph: Graph) -> tuple[int, int, int]:
    """(bytes of one KV page on one device over every attention layer, bytes of one GDN state slot on one device
    over every GDN layer, page size)."""
    mesh = graph.meta.get("mesh")
    page = slot = 0
    for name, t in graph_cache_types(graph).items():
        first = _ways(mesh, t.sharding, 0)  # a page or slot: one of the pool's first dim on one device
        size = _nbytes(t, local_shape(graph, t, (first, *(int(d) for d in t.shape[1:]))))
        if name.endswith((".k_pages", ".v_pages")):
            page += size
        else:
            slot += size
    return page, slot, int(graph.meta["page_size"])


def _ranks(graph: Graph) -> int:
    mesh = graph.meta.get("mesh")
    return mesh.ways("batch") if mesh is not None and mesh.rules and "batch" in dict(mesh.rules) else 1


def _devices(graph: Graph) -> int:
    mesh = graph.meta.get("mesh")
    return mesh.size if mesh is not None and mesh.rules else 1


def _experts(graph: Graph) -> tuple[int, int]:
    """(routed experts, top-k) of the graph (0, 0 without MoE)."""
    for node in graph.nodes():
        if node.op.op_name == "router_topk":
            return int(graph.type_of(node.operands[0]).shape[1]), node.op.k
    return 0, 0


def device_step(graph: Graph, sizes: dict[str, int], step: StepShape, ranks: int) -> tuple[Cost, dict[str, float]]:
    """One device's cost of a step in which each of `ranks` data-parallel ranks runs `step` (so T = ranks × its
    tokens), and the bytes it sends per collective kind. Routed rows: a device multiplies only the routes to its own
    experts (1/D of them under uniform routing)."""
    mesh = graph.meta.get("mesh")
    bound = {**sizes, "T": step.tokens * ranks, "R": step.rows * ranks}
    read_as = dequantized_reads(graph)
    total, sent = Cost(), {}
    for node in graph.nodes():
        op = node.op
        if isinstance(op, (Input, Param)):
            continue
        types = [read_as.get(v) or graph.type_of(v) for v in node.operands]
        operands = [(t, local_shape(graph, t, t.bind(bound))) for t in types]
        results = [(t, local_shape(graph, t, t.bind(bound))) for t in node.types]
        if type(op) in COLLECTIVE_KINDS:
            (t, shape), = results
            n = math.prod(mesh.axis_size(a) for a in op.mesh_axes)
            kind = COLLECTIVE_KINDS[type(op)]
            sent[kind] = sent.get(kind, 0.0) + _nbytes(t, shape) * SENT_PER_RESULT_BYTE[kind](n)
            continue
        rule = COSTS.get(type(op))
        if rule is None:
            continue
        cost = rule(op, operands, results, step)
        if isinstance(op, (GroupedMatmul, GroupedMatmulSwiglu)):
            w_type = operands[1][0]
            cost = Cost(cost.flops / _ways(mesh, w_type.sharding, 0), cost.bytes)
        total = total + cost
    return total, sent


def touched(num_experts: int, held: int, routes: float) -> float:
    """Expected distinct experts among the `held` a device holds that `routes` uniformly routed routes reach."""
    if not num_experts:
        return 0.0
    return held * (1.0 - (1.0 - 1.0 / num_experts) ** routes)


def activation_peak(graph: Graph, sizes: dict[str, int]) -> int:
    """The largest sum of live intermediates over the step, on one device's shapes (a liveness scan in program
    order). Cache-shaped values (with a page-pool or state-slot dim) are updated in place and not counted."""
    # a dequantized FP8 weight is not materialized: the matmul that reads it dequantizes a slab at a time
    order = [n for n in graph.nodes() if not isinstance(n.op, (Input, Param)) and n.op.op_name != "dequantize"]
    last: dict = {}
    for i, node in enumerate(order):
        for v in node.operands:
            last[v] = i
    outputs = set(graph.outputs.values())
    live: dict = {}
    peak = current = 0
    for i, node in enumerate(order):
        for v, t in zip(node.results, node.types):
            if any(isinstance(d, str) and ("P" in d or "S" in d) for d in t.shape):
                continue
            size = _nbytes(t, local_shape(graph, t, t.bind(sizes)))
            live[v] = size
            current += size
        peak = max(peak, current)
        for v in set(node.operands):
            if last.get(v) == i and v in live and v not in outputs:
                current -= live.pop(v)
    return peak


def xla_memory(folded: Graph, sizes: dict[str, int], tokens: int, lowering: str) -> dict | None:
    """XLA's own memory analysis of one step at `tokens` tokens (all rows): the step compiled for this host from
    abstract arguments (shapes only: nothing is allocated). Only where this host can compile the plan's program — a
    cpu plan of one device; None otherwise (another platform's compiler, or a mesh whose devices are not here)."""
    import jax

    from qcompile.compiler.lowered import abstract_arguments
    from qcompile.ir.lowering import is_sharded, step_function

    if lowering != "cpu" or is_sharded(folded) or jax.default_backend() != "cpu":
        return None
    params, caches, batch = abstract_arguments(folded, {**sizes, "T": tokens, "R": tokens})
    compiled = jax.jit(step_function(folded, lowering, with_logits=False)).lower(params, caches, batch).compile()
    analysis = compiled.memory_analysis()
    if analysis is None:
        return None
    return {"tokens": tokens, "temp_bytes": int(analysis.temp_size_in_bytes),
            "argument_bytes": int(analysis.argument_size_in_bytes), "output_bytes": int(analysis.output_size_in_bytes)}


def evaluate(graph: Graph, tgt: Target, concurrency: int, input_len: int, output_len: int,
             with_xla: bool = True, lower: bool = False) -> dict:
    """One laid-out build at one concurrency and workload: memory per device, capacity, step times, throughput;
    with `lower`, its decode step exported for the target's platform (compiler/lowered.py)."""
    folded = fold_weight_preparation(graph)
    ranks, devices = _ranks(folded), _devices(folded)
    seqs = -(-concurrency // ranks)
    context = input_len + output_len
    weights = weights_per_device(folded)
    page, slot, page_size = cache_bytes(folded)
    pages_per_seq = -(-context // page_size)
    kv = seqs * pages_per_seq * page
    state = seqs * slot
    sizes = {"B": seqs * ranks, "M": pages_per_seq, "P": seqs * pages_per_seq * ranks + ranks, "S": seqs * ranks}
    decode_sizes = {**sizes, "T": seqs * ranks, "R": seqs * ranks}
    prefill_sizes = {**sizes, "T": input_len * ranks, "R": ranks}
    activations = max(activation_peak(folded, decode_sizes), activation_peak(folded, prefill_sizes))
    xla = xla_memory(folded, sizes, seqs * ranks, tgt.lowering) if with_xla else None
    if xla is not None:  # XLA's buffer assignment where we have it (it also counts sort buffers, padding, copies)
        activations = max(activations, xla["temp_bytes"])
    weight_total = sum(weights.values())
    used = weight_total + kv + state + activations
    free = tgt.memory_bytes - weight_total - activations
    per_seq = pages_per_seq * page + slot
    max_concurrency = max(0, free // per_seq) * ranks if per_seq else None
    max_context = (max(0, (free - seqs * slot) // (seqs * page)) * page_size) if page else None

    num_experts, top_k = _experts(folded)
    held = num_experts // devices if num_experts else 0
    dtype = "bf16" if any(t.dtype == "bf16" for n in folded.find(Param) for t in [n.op.type]) else "f32"
    peak = tgt.flops_per_s.get(dtype, max(tgt.flops_per_s.values()))

    def seconds(step: StepShape) -> tuple[float, Cost, dict]:
        cost, sent = device_step(folded, sizes, step, ranks)
        return cost.seconds(tgt.memory_bytes_per_s, peak) + sum(sent.values()) / tgt.interconnect_bytes_per_s, cost, sent

    decode_shape = StepShape((1,) * seqs, (input_len + output_len // 2,) * seqs, seqs,
                             touched(num_experts, held, seqs * ranks * top_k))
    prefill_shape = StepShape((input_len,), (input_len,), 1, touched(num_experts, held, input_len * ranks * top_k))
    t_decode, decode_cost, decode_sent = seconds(decode_shape)
    t_prefill, prefill_cost, prefill_sent = seconds(prefill_shape)
    wave = seqs * t_prefill + output_len * t_decode
    per_chip = concurrency / wave / tgt.chips
    return {
        "plan": _plan_name(folded), "concurrency": concurrency, "input_len": input_len, "output_len": output_len,
        "memory_per_device": {"weights": weights, "weights_total": weight_total, "kv_cache": kv, "gdn_state": state,
                              "activation_peak": activations, "total": used, "capacity": tgt.memory_bytes,
                              "fits": used <= tgt.memory_bytes},
        "kv_pages_per_device": seqs * pages_per_seq, "page_size": page_size, "state_slots_per_device": seqs,
        "max_concurrency_at_context": max_concurrency, "max_context_at_concurrency": max_context,
        "decode_step": {"seconds": t_decode, "bytes": decode_cost.bytes, "flops": decode_cost.flops,
                        "collective_bytes": decode_sent},
        "prefill_step": {"seconds": t_prefill, "tokens": input_len, "bytes": prefill_cost.bytes,
                         "flops": prefill_cost.flops, "collective_bytes": prefill_sent},
        "total_tok_s_per_chip": per_chip * (input_len + output_len), "output_tok_s_per_chip": per_chip * output_len,
        "xla_decode_memory": xla,
        **({"lowered": lowered_step(folded, decode_sizes, tgt.lowering)} if lower else {}),
    }


def _plan_name(graph: Graph) -> str:
    mesh = graph.meta.get("mesh")
    if mesh is None or not mesh.rules:
        return "single device"
    rules = dict(mesh.rules)
    dp = mesh.ways("batch") if "batch" in rules else 1
    tp = mesh.ways("tensor") if "tensor" in rules else 1
    return "x".join(p for p in (f"dp{dp}" if dp > 1 else "", f"tp{tp}" if tp > 1 else "") if p) + "+ep"


def build_specs(passes: str, ablate: bool) -> list[str]:
    """`none`, the selected passes, and (ablate) the selection without each of its passes."""
    selected = [p.name for p in parse_spec(passes)]
    specs = ["none", passes.strip()]
    if ablate:
        specs += [f"{passes.strip()},-{name}" for name in selected]
    return list(dict.fromkeys(specs))


def run_plan(opts: PlanOptions, emit=print, progress=None) -> dict:
    progress = progress or (lambda text: print(f"qcompile: {text}", file=sys.stderr, flush=True))
    started = time.perf_counter()
    tgt = target_of(opts.target, opts.chips)
    if opts.mesh is not None:
        try:
            mesh = parse_mesh_spec(opts.mesh)
        except ValueError as err:
            raise UsageError(str(err)) from None
        if mesh.size != tgt.devices:
            raise UsageError(f"--mesh {opts.mesh} has {mesh.size} devices; {tgt.chips} chips of {tgt.name} are "
                             f"{tgt.devices}")
        tgt = attrs.evolve(tgt, mesh_spec=opts.mesh)
    if opts.lower:  # the lowering lays the step out on the target's mesh of host devices (it says when short)
        request_host_devices(tgt.devices)
    graph, raw, where = abstract_graph(opts.source)
    built = time.perf_counter() - started
    graph.meta["mesh"] = parse_mesh_spec(tgt.mesh_spec)
    if opts.input_len is not None or opts.output_len is not None:
        workloads = {"custom": (opts.input_len or 1024, opts.output_len or 1024)}
    else:
        workloads = dict(WORKLOADS)
    specs = build_specs(opts.passes, opts.ablate)
    report = {"source": str(opts.source), "shapes_from": where, "target": attrs.asdict(tgt), "builds": [],
              "workloads": {k: list(v) for k, v in workloads.items()}, "graph_ops": len(graph)}
    emit(f"{opts.source}: {len(graph)} ops ({where}); target {tgt.name}, {tgt.chips} chips = {tgt.devices} devices "
         f"(mesh {tgt.mesh_spec}), {tgt.memory_bytes / 2**30:.1f} GiB and {tgt.memory_bytes_per_s / 1e9:.0f} GB/s "
         "per device")
    for spec in specs:
        for concurrency in opts.concurrency:
            for workload, (input_len, output_len) in workloads.items():
                progress(f"planning {spec} at concurrency {concurrency}, {workload} ({input_len}/{output_len})")
                ctx = PassContext(target=tgt.lowering, num_devices=tgt.devices,
                                  options=(("concurrency", concurrency), ("max_context", input_len + output_len)))
                laid_out, passes = run_structurally(graph, spec, ctx)
                # XLA's memory analysis (a compile) for the planned build only, not for every ablation
                planned = spec == opts.passes.strip()
                lower = planned and opts.lower and "lowered" not in report  # once: the first planned build
                result = evaluate(laid_out, tgt, concurrency, input_len, output_len, with_xla=planned, lower=lower)
                if lower:
                    report["lowered"] = {"passes": spec, "concurrency": concurrency, "workload": workload,
                                         **result.pop("lowered")}
                report["builds"].append({"passes": spec, "workload": workload, "pass_report": passes, **result})
    report["seconds"] = {"build_graph": built, "total": time.perf_counter() - started}
    emit(table(report))
    emit(details(report, opts.passes.strip()))
    if "lowered" in report:
        emit(lowered_line(report["lowered"]))
    emit(f"planned in {report['seconds']['total']:.1f}s; these are predictions at the target's ceilings (a roofline "
         "of qcompile's cost rules), not measurements")
    if opts.json is not None:
        try:
            opts.json.write_text(json.dumps(report, indent=2, default=_plain) + "\n")
        except OSError as err:
            raise UsageError(f"--json {opts.json}: cannot write it ({err.strerror or err})") from None
    return report


def lowered_line(lowered: dict) -> str:
    head = (f"lowered for {lowered['platform']} ({lowered['passes']}, decode step at concurrency "
            f"{lowered['concurrency']}; jax.export from abstract shapes)")
    if "skipped" in lowered or "error" in lowered:
        return f"{head}: not lowered — {lowered.get('skipped') or lowered['error']}"
    found = ", ".join(f"{k} {v}" for k, v in lowered["collectives"].items()) or "none"
    same = "the graph's" if lowered["collectives"] == lowered["graph_collectives"] else \
        f"the graph has {lowered['graph_collectives']}"
    return (f"{head}: {lowered['mosaic_kernels']} Mosaic kernels; collectives {found} ({same}); "
            f"{lowered['module_bytes'] / 2**20:.1f} MiB of StableHLO in {lowered['seconds']:.1f}s")


def _plain(value):
    return str(value)


def table(report: dict) -> str:
    gib = 2**30
    lines = ["| passes | workload | conc | plan | weights GiB | KV GiB | state GiB | act. GiB | fits | max conc. | "
             "decode ms | prefill ms | total tok/s/chip | output tok/s/chip |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for b in report["builds"]:
        m = b["memory_per_device"]
        lines.append(
            f"| {b['passes']} | {b['workload']} | {b['concurrency']} | {b['plan']} | {m['weights_total'] / gib:.1f} | "
            f"{m['kv_cache'] / gib:.2f} | {m['gdn_state'] / gib:.2f} | {m['activation_peak'] / gib:.2f} | "
            f"{'yes' if m['fits'] else 'NO'} | {b['max_concurrency_at_context']} | "
            f"{b['decode_step']['seconds'] * 1e3:.2f} | {b['prefill_step']['seconds'] * 1e3:.1f} | "
            f"{b['total_tok_s_per_chip']:.0f} | {b['output_tok_s_per_chip']:.0f} |")
    return "\n".join(lines)


def details(report: dict, spec: str) -> str:
    """For the planned build at each concurrency: the layout and why, weights by kind, collectives per step."""
    lines, seen = [], set()
    for b in report["builds"]:
        if b["passes"] != spec or b["concurrency"] in seen:
            continue
        seen.add(b["concurrency"])
        gqa = next((p for p in b["pass_report"] if p["pass"] == "gqa-sharding"), None)
        why = gqa["stats"]["why"] if gqa and gqa.get("stats") else (gqa or {}).get("skipped", "no layout")
        kinds = ", ".join(f"{k} {v / 2**30:.2f}" for k, v in sorted(b["memory_per_device"]["weights"].items()))
        sent = ", ".join(f"{k} {v / 2**20:.2f}" for k, v in sorted(b["decode_step"]["collective_bytes"].items()))
        lines += [f"{spec} at concurrency {b['concurrency']}: {b['plan']} — {why}",
                  f"  weights per device (GiB): {kinds}",
                  f"  KV: {b['kv_pages_per_device']} pages of {b['page_size']} tokens per device; GDN state: "
                  f"{b['state_slots_per_device']} slots per device; longest context at this concurrency: "
                  f"{b['max_context_at_concurrency']}",
                  f"  collectives per decode step per device (MiB sent): {sent or 'none'}"]
    return "\n".join(lines)
