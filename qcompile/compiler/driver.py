"""The compile driver: checkpoint → unoptimized graph → checked pass pipeline → report and artifact.

This is what `qcompile compile` runs, as a function of one frozen options object so tests and scripts can call it
without the command line. Numerics are checked on the whole model, or — with `verify_layers` N, or automatically
when the weights would not fit comfortably in memory — on a slice of N real layers of each type (real weights): the
pipeline then runs twice, checked on the slice and structurally verified on the whole graph.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import attrs
from tqdm import tqdm

from qcompile import __version__
from qcompile.errors import UsageError
from qcompile.frontend.checkpoint import Checkpoint
from qcompile.compiler.summary import summarize
from qcompile.ir.abi import CacheConfig
from qcompile.compiler.export import TARGET_RULES
from qcompile.ir.importer import DEFAULT_PAGE_SIZE, build_graph, select_layers
from qcompile.ir.mesh import Mesh
from qcompile.ir.lowering import target_rules_used
from qcompile.ir.weights import fold_weight_preparation, load_params, prepared_names
from qcompile.passes.base import PassContext
from qcompile.passes.equivalence import EquivalenceChecker, describe_check
from qcompile.passes.manager import Instruments, Reproducer, run_pipeline
from qcompile.passes.registry import parse_spec, spec_of

TARGETS = ("cpu", "gpu", "tpu")


@attrs.frozen
class CompileOptions:
    checkpoint: Path
    passes: str = "all"
    output: Path | None = None
    report: Path | None = None
    dtype: str | None = None
    page_size: int | None = None  # --page-size: fixed by the user (kv-page-resize keeps it); None: the pass picks
    memory_budget: int | None = None  # --memory-budget: kv-page-resize reports the capacity it holds
    target: str = "cpu"
    verify: str = "each"  # each | final | none
    verify_layers: int | None = None
    seed: int = 0
    print_ir_after: tuple[str, ...] = ()
    print_ir_after_change: bool = False
    dump_dir: Path | None = None
    repro_dir: Path | None = None
    cache: CacheConfig = CacheConfig()
    weights: str = "copy"  # copy | link | none (qcompile/runtime/artifact.py)
    mesh: Mesh | None = None  # --mesh: the devices the model is laid out on (ir/mesh.py)
    concurrency: int | None = None  # --concurrency: expected concurrent sequences (gqa-sharding; default max_seqs)
    layout: str | None = None  # --layout: gqa-sharding's plan (dp4xtp2, ...) instead of its choice
    fp8: str = "keep"  # --fp8: an FP8 checkpoint's weights kept FP8 or multiplied out (ir/importer.py build_graph)

    @property
    def import_page_size(self) -> int:
        """The page size the step graph is built with: the user's --page-size, else the importer's default (the
        kv-page-resize pass then picks the target's)."""
        return self.page_size if self.page_size is not None else DEFAULT_PAGE_SIZE


def memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 16 << 30


def compile_checkpoint(opts: CompileOptions, emit: Callable[[str], None] = print,
                       warn: Callable[[str], None] = lambda text: print(text, file=sys.stderr)) -> dict:
    """Run the whole compile; returns the report (also written to report.json / the artifact)."""
    started = time.perf_counter()
    if opts.mesh is not None and opts.cache.max_seqs % opts.mesh.size:
        # Documented padding: each data-parallel rank gets whole sequence slots (and its share of the pages).
        padded = -(-opts.cache.max_seqs // opts.mesh.size) * opts.mesh.size
        warn(f"qcompile: note: --max-seqs {opts.cache.max_seqs} rounded up to {padded}, a multiple of the "
             f"{opts.mesh.size} devices, so every data-parallel rank gets whole sequence slots")
        num_pages = opts.cache.num_pages and -(-opts.cache.num_pages // opts.mesh.size) * opts.mesh.size
        opts = attrs.evolve(opts, cache=attrs.evolve(opts.cache, max_seqs=padded, num_pages=num_pages))
    if opts.target not in TARGETS:
        raise UsageError(f"unknown target {opts.target!r}; choose one of {', '.join(TARGETS)}")
    selected = parse_spec(opts.passes)
    if opts.output is not None and opts.mesh is not None and opts.mesh.size > 1 and opts.target != "cpu" \
            and any(p.name == "gqa-sharding" for p in selected):
        raise UsageError(f"-o with --mesh for --target {opts.target}: laid-out artifacts are exported for the cpu "
                         "target only so far (the export needs the target's devices in this process)")
    if opts.layout and not any(p.name == "gqa-sharding" for p in selected):
        raise UsageError(f"--layout {opts.layout}: the passes ({opts.passes}) do not include gqa-sharding, which "
                         "lays the model out")
    known = {p.name for p in parse_spec("all")} | {"all"}
    unknown_print = [name for name in opts.print_ir_after if name not in known]
    if unknown_print:
        raise UsageError(f"--print-ir-after {unknown_print[0]!r} is not a pass; valid: all, "
                         f"{', '.join(sorted(known - {'all'})) or '(no passes are registered yet)'}")
    ckpt = Checkpoint.open(opts.checkpoint)
    ckpt.warn_unknown()
    ckpt.warn_context(opts.cache.max_context, "--max-context")
    graph = build_graph(ckpt, opts.dtype, opts.import_page_size, fp8=opts.fp8)
    emit(_model_line(ckpt, graph))
    if opts.output is not None:  # before minutes of passes and checks: the pipeline keeps the weights' bytes
        from qcompile.compiler.export import check_free_space, weight_bytes

        check_free_space(opts.output, weight_bytes(graph) if opts.weights == "copy" else 0, opts.weights)
    if opts.mesh is not None:
        check_mesh_fits(ckpt, opts.mesh)
        graph.meta["mesh"] = opts.mesh
    ctx = PassContext(target=opts.target, num_devices=opts.mesh.size if opts.mesh else 1,
                      options=(("concurrency", opts.concurrency or opts.cache.max_seqs),
                               ("max_context", opts.cache.max_context),
                               *((("page_size", opts.page_size),) if opts.page_size is not None else ()),
                               *((("layout", opts.layout),) if opts.layout else ()),
                               *((("memory_budget", opts.memory_budget),) if opts.memory_budget else ())))
    instruments = Instruments(opts.print_ir_after, opts.print_ir_after_change, opts.dump_dir,
                              emit=lambda text: print(text, file=sys.stderr))
    rules = TARGET_RULES[opts.target]
    # Checked when passes are selected, or when the target lowers any op of this graph with a rule of its own.
    lowering_checked = bool(target_rules_used(graph, rules))
    checked = opts.verify != "none" and (bool(selected) or lowering_checked)
    layers, experts = _check_scope(ckpt, graph, opts, warn) if checked else (None, None)
    check_ckpt = ckpt if experts is None else ckpt.with_experts(experts)
    check_graph = graph if layers is None else build_graph(check_ckpt, opts.dtype, opts.import_page_size, layers=layers,
                                                                fp8=opts.fp8)
    if opts.mesh is not None:
        check_graph.meta["mesh"] = opts.mesh
    checker = None
    params = None
    if checked:
        params = load_params(check_ckpt, check_graph)
        if sys.stderr.isatty():
            print("qcompile: preparing numerics check inputs (warm-up step of the unoptimized graph)...",
                  file=sys.stderr, flush=True)
        checker = EquivalenceChecker(check_graph, params, seed=opts.seed,
                                     target=rules if lowering_checked else "reference")
    settings = {"dtype": graph.meta["dtype"], "page_size": opts.import_page_size, "verify_layers": layers,
                "verify_experts": experts, "meta": {k: v for k, v in check_graph.meta.items() if k != "mesh"}}
    # the checkpoint absolute: `qcompile reproduce DIR` is run from anywhere
    reproducer = Reproducer(opts.repro_dir or Path("qcompile-repro"), str(Path(opts.checkpoint).absolute()), settings)
    emit(f"passes ({spec_of(selected)}):" if selected else "passes: none selected"
         + ("" if parse_spec("all") else " (no passes are registered yet)"))
    bar = tqdm(total=len(selected), desc="passes", unit="pass", file=sys.stderr, leave=False,
               disable=not (selected and sys.stderr.isatty()))

    def on_record(record):
        bar.update(1)
        bar.set_postfix_str(record.name)
        emit(record.line())

    with bar:
        result = run_pipeline(check_graph, selected, ctx, verify_mode=opts.verify if checked else "none",
                              checker=checker, instruments=instruments, reproducer=reproducer, on_record=on_record)
    final_graph = result.graph
    if layers is not None:  # the slice was checked; now rewrite the whole graph with structural verification
        final_graph = run_pipeline(graph, selected, ctx, verify_mode="none").graph
    final_graph = fold_weight_preparation(final_graph, rules)
    if result.final_check is not None:
        fc = result.final_check
        what = (f"{'optimized' if selected else 'unoptimized'} ({rules} rules) vs reference" if lowering_checked
                else "optimized vs unoptimized")
        emit(f"  {what:<26} {'ok' if fc.ok else 'FAILED':<9} {describe_check(fc.to_json())}"
             + (f" on layers {list(layers)}" if layers is not None else "")
             + (f" with experts 0..{experts - 1}" if experts is not None else ""))
    report = {
        "qcompile_version": __version__, "checkpoint": str(opts.checkpoint), "target": opts.target,
        "mesh": final_graph.meta["mesh"].attributes() if final_graph.meta.get("mesh") else None,
        "passes": {"spec": opts.passes, "selected": [p.name for p in selected], "verify": opts.verify,
                   "verify_layers": list(layers) if layers is not None else None, "verify_experts": experts,
                   "seed": opts.seed,
                   **result.to_json()},
        **summarize(ckpt, final_graph),
        "prepared_weights": prepared_names(final_graph),
    }
    report["compile_seconds"] = round(time.perf_counter() - started, 3)
    if opts.output is not None:
        _write_output(opts, ckpt, final_graph, params if layers is None and experts is None else None, report, emit)
        report["compile_seconds"] = round(time.perf_counter() - started, 3)
    text = _json(report)
    if opts.output is not None:
        (opts.output / "report.json").write_text(text)
    if opts.report is not None:
        opts.report.write_text(text)
    return report


def check_mesh_fits(ckpt: Checkpoint, mesh) -> None:
    """A mesh the model cannot be laid out on is a usage error (exit 2) before any work: the routed experts must split
    evenly over the devices (compile, run, bench and serve alike)."""
    devices, cfg = mesh.size, ckpt.config
    if any(cfg.moe_layers) and cfg.num_experts % devices:
        fits = [d for d in range(2, min(cfg.num_experts, 64) + 1) if cfg.num_experts % d == 0]
        raise UsageError(f"--mesh {'x'.join(map(str, mesh.shape))}: the {cfg.num_experts} routed experts do not "
                         f"split over {devices} devices; use a device count that divides them "
                         f"({', '.join(map(str, fits[:8])) or 'none above 1'})")



def _model_line(ckpt: Checkpoint, graph) -> str:
    cfg = ckpt.config
    summary = summarize(ckpt, graph)
    params = summary["parameters"]
    return (f"{cfg.family}: {cfg.num_layers} layers ({summary['layers']['linear_attention']} GDN, "
            f"{summary['layers']['full_attention']} attention), {params['total'] / 1e6:.2f}M parameters "
            f"({params['active_per_token'] / 1e6:.2f}M active per token), {graph.meta['dtype']}, "
            f"graph of {len(graph)} ops verified")


def _check_scope(ckpt: Checkpoint, graph, opts: CompileOptions, warn) -> tuple[tuple[int, ...] | None, int | None]:
    """What the numerics checks run on: (layers, routed experts), None meaning all of them.

    The whole model when its weights fit in a third of memory (the checker holds the weights, the reference's and
    the candidates' outputs and XLA's temporaries); else a slice of `--verify-layers` (default 1) real layers of each
    type; and when even that slice does not fit (one Qwen3.5-397B MoE layer is ~13 GB in bf16), the slice restricted
    to the first N routed experts of each MoE layer with the router restricted to them (Checkpoint.with_experts: the
    same layers and widths, N chosen to fit, at least top-k). When not even top-k experts fit: exit 2, saying what
    memory it needs, before anything is read."""
    from qcompile.compiler.export import weight_bytes

    budget = memory_bytes() // 3
    if opts.verify_layers is None and weight_bytes(graph) <= budget:
        return None, None
    if opts.verify_layers is not None and opts.verify_layers < 1:
        raise UsageError("--verify-layers must be at least 1")
    layers = select_layers(ckpt.config, opts.verify_layers or 1)

    def slice_bytes(experts: int) -> int:
        restricted = ckpt if experts == ckpt.config.num_experts else ckpt.with_experts(experts)
        return weight_bytes(build_graph(restricted, opts.dtype, opts.import_page_size, layers=layers, fp8=opts.fp8))

    whole = weight_bytes(graph)
    cfg = ckpt.config
    full_slice = slice_bytes(cfg.num_experts)
    if full_slice <= budget:
        if opts.verify_layers is None:
            warn(f"qcompile: note: the weights ({whole / 2**30:.1f} GiB) are too large to check whole on this "
                 f"machine; checking numerics on layers {list(layers)} (set --verify-layers N to choose)")
        return layers, None
    experts = None
    if any(cfg.moe_layers):
        fixed = slice_bytes(cfg.top_k)
        per_expert = (full_slice - fixed) / max(1, cfg.num_experts - cfg.top_k)
        if fixed <= budget:
            experts = min(cfg.num_experts - 1, cfg.top_k + int((budget - fixed) // max(per_expert, 1)))
    if experts is None:
        least = slice_bytes(cfg.top_k) if any(cfg.moe_layers) else full_slice
        raise UsageError(f"checking numerics needs about {3 * least / 2**30:.1f} GiB of memory even on layers "
                         f"{list(layers)} with {cfg.top_k} experts; this machine has {memory_bytes() / 2**30:.1f} GiB "
                         "— compile with --verify none, or on a machine with more memory")
    warn(f"qcompile: note: even layers {list(layers)} ({full_slice / 2**30:.1f} GiB) are too large to check on this "
         f"machine; checking numerics on them with routed experts 0..{experts - 1} of {cfg.num_experts} (the router "
         f"restricted to them, {slice_bytes(experts) / 2**30:.1f} GiB)")
    return layers, experts


def _write_output(opts: CompileOptions, ckpt: Checkpoint, graph, params, report: dict, emit) -> None:
    from qcompile.compiler.export import CheckpointWeights, write_artifact

    # The weights stream from the checkpoint one slab at a time (prepared ones computed per slab); arrays already
    # made for the numerics check are reused. Nothing holds the whole model in memory.
    prepared = graph.meta.get("prepared", {})
    extra = {"pipeline": report["passes"]["spec"], "passes": report["passes"],
             "equivalence": report["passes"]["final_check"], "compute_dtype": graph.meta["dtype"],
             "model": {k: report[k] for k in ("family", "layers", "parameters")}, "prepared_weights": prepared}
    manifest = write_artifact(opts.output, graph, CheckpointWeights(ckpt, graph, params),
                              config_json=ckpt.config.to_json(), cache=opts.cache, target=opts.target, extra=extra,
                              mode=opts.weights)
    weights = manifest["weights"]
    report["artifact"] = {"weights": weights["mode"], "weights_source": weights["source"],
                          "bytes": sum(f["bytes"] for f in manifest["files"].values()),
                          "export_seconds": manifest["export_seconds"], "weights_seconds": manifest["weights_seconds"]}
    where = {"artifact": "weights copied", "linked": "weights hard-linked from the checkpoint",
             "checkpoint": f"weights read at load from {ckpt.path}"}[weights["source"]]
    emit(f"wrote artifact {opts.output} (target {opts.target}, {where}): executables, manifest.json, graph.qir, "
         "report.json")


def _json(report: dict) -> str:
    import json

    return json.dumps(report, indent=2, default=str) + "\n"
