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
from qcompile.ir.importer import build_graph, select_layers
from qcompile.ir.lowering import target_rules_used
from qcompile.ir.weights import fold_weight_preparation, load_params, prepared_names
from qcompile.passes.base import PassContext
from qcompile.passes.equivalence import EquivalenceChecker
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
    page_size: int = 16
    target: str = "cpu"
    verify: str = "each"  # each | final | none
    verify_layers: int | None = None
    seed: int = 0
    print_ir_after: tuple[str, ...] = ()
    print_ir_after_change: bool = False
    dump_dir: Path | None = None
    repro_dir: Path | None = None
    cache: CacheConfig = CacheConfig()


def memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 16 << 30


def compile_checkpoint(opts: CompileOptions, emit: Callable[[str], None] = print,
                       warn: Callable[[str], None] = lambda text: print(text, file=sys.stderr)) -> dict:
    """Run the whole compile; returns the report (also written to report.json / the artifact)."""
    started = time.perf_counter()
    if opts.target not in TARGETS:
        raise UsageError(f"unknown target {opts.target!r}; choose one of {', '.join(TARGETS)}")
    selected = parse_spec(opts.passes)
    known = {p.name for p in parse_spec("all")} | {"all"}
    unknown_print = [name for name in opts.print_ir_after if name not in known]
    if unknown_print:
        raise UsageError(f"--print-ir-after {unknown_print[0]!r} is not a pass; valid: all, "
                         f"{', '.join(sorted(known - {'all'})) or '(no passes are registered yet)'}")
    ckpt = Checkpoint.open(opts.checkpoint)
    ckpt.warn_unknown()
    graph = build_graph(ckpt, opts.dtype, opts.page_size)
    emit(_model_line(ckpt, graph))
    ctx = PassContext(target=opts.target, num_devices=1)
    instruments = Instruments(opts.print_ir_after, opts.print_ir_after_change, opts.dump_dir,
                              emit=lambda text: print(text, file=sys.stderr))
    rules = TARGET_RULES[opts.target]
    # Checked when passes are selected, or when the target lowers any op of this graph with a rule of its own.
    lowering_checked = bool(target_rules_used(graph, rules))
    checked = opts.verify != "none" and (bool(selected) or lowering_checked)
    layers = _check_slice(ckpt, opts, warn) if checked else None
    check_graph = graph if layers is None else build_graph(ckpt, opts.dtype, opts.page_size, layers=layers)
    checker = None
    params = None
    if checked:
        params = load_params(ckpt, check_graph)
        if sys.stderr.isatty():
            print("qcompile: preparing numerics check inputs (warm-up step of the unoptimized graph)...",
                  file=sys.stderr, flush=True)
        checker = EquivalenceChecker(check_graph, params, seed=opts.seed,
                                     target=rules if lowering_checked else "reference")
    settings = {"dtype": graph.meta["dtype"], "page_size": opts.page_size, "verify_layers": layers,
                "meta": check_graph.meta}
    reproducer = Reproducer(opts.repro_dir or Path("qcompile-repro"), str(opts.checkpoint), settings)
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
    final_graph = fold_weight_preparation(final_graph)
    if result.final_check is not None:
        fc = result.final_check
        what = (f"{'optimized' if selected else 'unoptimized'} ({rules} rules) vs reference" if lowering_checked
                else "optimized vs unoptimized")
        emit(f"  {what:<26} {'ok' if fc.ok else 'FAILED':<9} max error {fc.max_error:.2e} "
             f"(bound {fc.bound:.0e})" + (f" on layers {list(layers)}" if layers is not None else ""))
    report = {
        "qcompile_version": __version__, "checkpoint": str(opts.checkpoint), "target": opts.target, "mesh": None,
        "passes": {"spec": opts.passes, "selected": [p.name for p in selected], "verify": opts.verify,
                   "verify_layers": list(layers) if layers is not None else None, "seed": opts.seed,
                   **result.to_json()},
        **summarize(ckpt, final_graph),
        "prepared_weights": prepared_names(final_graph),
    }
    report["compile_seconds"] = round(time.perf_counter() - started, 3)
    if opts.output is not None:
        _write_output(opts, ckpt, final_graph, params if layers is None else None, report, emit)
        report["compile_seconds"] = round(time.perf_counter() - started, 3)
    text = _json(report)
    if opts.output is not None:
        (opts.output / "report.json").write_text(text)
    if opts.report is not None:
        opts.report.write_text(text)
    return report


def _model_line(ckpt: Checkpoint, graph) -> str:
    cfg = ckpt.config
    summary = summarize(ckpt, graph)
    params = summary["parameters"]
    return (f"{cfg.family}: {cfg.num_layers} layers ({summary['layers']['linear_attention']} GDN, "
            f"{summary['layers']['full_attention']} attention), {params['total'] / 1e6:.2f}M parameters "
            f"({params['active_per_token'] / 1e6:.2f}M active per token), {graph.meta['dtype']}, "
            f"graph of {len(graph)} ops verified")


def _check_slice(ckpt: Checkpoint, opts: CompileOptions, warn) -> tuple[int, ...] | None:
    if opts.verify == "none":
        return None
    if opts.verify_layers is not None:
        if opts.verify_layers < 1:
            raise UsageError("--verify-layers must be at least 1")
        return select_layers(ckpt.config, opts.verify_layers)
    weight_bytes = sum(ckpt.bytes_by_dtype().values())
    if weight_bytes * (2 if (opts.dtype or ckpt.config.dtype) == "f32" else 1) > memory_bytes() // 3:
        layers = select_layers(ckpt.config, 1)
        warn(f"qcompile: note: the weights ({weight_bytes / 2**30:.1f} GiB) are too large to check whole on this "
             f"machine; checking numerics on layers {list(layers)} (set --verify-layers N to choose)")
        return layers
    return None


def _write_output(opts: CompileOptions, ckpt: Checkpoint, graph, params, report: dict, emit) -> None:
    from qcompile.compiler.export import write_artifact

    # Prepared weights are computed here, once; plain ones already read for the check are reused.
    params = load_params(ckpt, graph, loaded=params)
    prepared = graph.meta.get("prepared", {})
    extra = {"pipeline": report["passes"]["spec"], "passes": report["passes"],
             "equivalence": report["passes"]["final_check"], "compute_dtype": graph.meta["dtype"],
             "model": {k: report[k] for k in ("family", "layers", "parameters")}, "prepared_weights": prepared}
    write_artifact(opts.output, graph, params, config_json=ckpt.config.to_json(), cache=opts.cache,
                   target=opts.target, extra=extra)
    emit(f"wrote artifact {opts.output} (target {opts.target}): executables, weights, manifest.json, graph.qir, report.json")


def _json(report: dict) -> str:
    import json

    return json.dumps(report, indent=2, default=str) + "\n"
