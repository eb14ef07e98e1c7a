"""Writing compiled artifacts: `jax.export` of the step program per shape bucket, weights, manifest (see
qcompile/runtime/artifact.py for the layout and what loading verifies).

The compiler writes, the runtime reads: the format constants live with the reader so that a serving host needs only
the runtime.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import jax
import jaxlib
import numpy as np
from tqdm import tqdm

import qcompile
from qcompile.errors import UsageError
from qcompile.frontend.safetensors_io import write_safetensors
from qcompile.ir.abi import CacheConfig, batch_specs, bucket_shapes, cache_specs, graph_cache_types
from qcompile.ir.graph import Graph
from qcompile.ir.lowering import step_function

#: --target -> the lowering rules its executables are built with.
TARGET_RULES = {"cpu": "cpu", "tpu": "tpu", "gpu": "gpu"}
from qcompile.ir.printer import print_graph
from qcompile.kernels import native
from qcompile.runtime.artifact import (EXEC_DIR, FORMAT_VERSION, GRAPH_TEXT, MANIFEST, TARGETS, WEIGHTS,
                                       WRITING_MARKER, bucket_file, inside, sha256_file)


def _write_bytes_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _prepare_out_dir(out: Path) -> None:
    """Make `out` ready to receive an artifact without ever clobbering a directory that is not one of ours."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out}: exists and is not a directory; choose another -o")
    if out.is_dir():
        entries = list(out.iterdir())
        ours = (out / MANIFEST).is_file() or (out / WRITING_MARKER).exists()
        if entries and not ours:
            raise UsageError(f"{out}: directory is not empty and is not a qcompile artifact (no {MANIFEST}); "
                             "refusing to overwrite it — choose another -o or empty it")
    out.mkdir(parents=True, exist_ok=True)
    (out / WRITING_MARKER).write_text("qcompile is writing an artifact here\n")
    # Invalidate the old artifact first (no manifest → nothing loads it), then remove what it listed.
    old = out / MANIFEST
    listed: list[str] = []
    if old.is_file():
        try:
            listed = list(json.loads(old.read_text()).get("files", {}))
        except (ValueError, AttributeError):
            listed = []
        old.unlink()
    for rel in [*listed, WEIGHTS, GRAPH_TEXT]:
        target = inside(out, rel)
        if target is not None and target.is_file():
            target.unlink()
    exec_dir = out / EXEC_DIR
    if exec_dir.is_dir():
        for stale in exec_dir.glob("*.jaxexport"):
            stale.unlink()




def write_artifact(out_dir, graph: Graph, params: dict, *, config_json: dict, cache: CacheConfig,
                   target: str = "cpu", extra: dict | None = None, progress: bool | None = None) -> dict:
    """Export `graph` for every shape bucket of `cache`, write weights + manifest to `out_dir`; return the manifest."""
    if target not in TARGETS:
        raise UsageError(f"unknown target {target!r}; choose one of {', '.join(TARGETS)}")
    platform = TARGETS[target]
    out = Path(out_dir)
    page_size = int(graph.meta["page_size"])
    sizes = cache.sizes(page_size)
    cache_types = graph_cache_types(graph)
    shapes = bucket_shapes(cache)
    reserved = {"format_version", "qcompile_version", "jax_version", "jaxlib_version", "target", "platform", "mesh",
                "config", "page_size", "cache", "cache_types", "buckets", "files", "export_seconds", "lowering"}
    clash = sorted(reserved & set(extra or {}))
    if clash:
        raise ValueError(f"extra manifest keys clash with reserved ones: {clash}")

    created = not out.exists()
    _prepare_out_dir(out)
    try:
        return _write(out, graph, params, config_json=config_json, cache=cache, target=target, platform=platform,
                      sizes=sizes, cache_types=cache_types, shapes=shapes, extra=extra, progress=progress)
    except BaseException:
        # An unfinished artifact never looks like a finished one: a directory we created goes away; one that held an
        # older artifact keeps the writing marker (and no manifest), which load_artifact refuses as unfinished.
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise


def _write(out: Path, graph: Graph, params: dict, *, config_json, cache, target, platform, sizes, cache_types, shapes,
           extra, progress) -> dict:
    page_size = int(graph.meta["page_size"])
    (out / EXEC_DIR).mkdir(exist_ok=True)

    param_specs = {name: jax.ShapeDtypeStruct(np.shape(value), value.dtype) for name, value in params.items()}
    caches = cache_specs(cache_types, sizes)
    rules = TARGET_RULES[target]
    jitted = {flag: jax.jit(step_function(graph, rules, flag)) for flag in (True, False)}
    show = sys.stderr.isatty() if progress is None else progress
    # qcompile's own CPU custom calls (kernels/native.py) are not on jax.export's list of stable targets; the
    # manifest names them, and loading the artifact builds and registers them before anything is deserialized.
    allow = [jax.export.DisabledSafetyCheck.custom_call(name) for name in native.KERNELS]
    buckets, started, natives = [], time.perf_counter(), set()
    for tokens, rows in tqdm(shapes, desc=f"exporting for {platform}", unit="bucket", disable=not show,
                             file=sys.stderr):
        with_logits = rows == tokens  # R = T buckets serve prompt logits; R = B buckets return token ids only
        exported = jax.export.export(jitted[with_logits], platforms=[platform], disabled_checks=allow)(
            param_specs, caches, batch_specs(tokens, rows, sizes))
        natives.update(native.used_by(exported.mlir_module()))
        rel = bucket_file(tokens, rows)
        _write_bytes_atomic(out / rel, bytes(exported.serialize()))
        buckets.append({"tokens": tokens, "rows": rows, "logits": with_logits, "file": rel})
    export_seconds = time.perf_counter() - started

    write_safetensors(out / WEIGHTS, {name: np.asarray(value) for name, value in params.items()},
                      metadata={"format": "qcompile-artifact"})
    (out / GRAPH_TEXT).write_text(print_graph(graph))

    files = {}
    for rel in [WEIGHTS, GRAPH_TEXT, *(b["file"] for b in buckets)]:
        path = out / rel
        files[rel] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
    manifest = {
        "format_version": FORMAT_VERSION,
        "qcompile_version": qcompile.__version__,
        "jax_version": jax.__version__,
        "jaxlib_version": jaxlib.__version__,
        "target": target,
        "platform": platform,
        "mesh": None,
        "config": config_json,
        "page_size": page_size,
        "cache": cache.to_json(page_size),
        "lowering": rules,
        "native_kernels": sorted(natives),
        "cache_types": {name: str(t) for name, t in cache_types.items()},
        "buckets": buckets,
        "files": files,
        "export_seconds": round(export_seconds, 3),
        **(extra or {}),
    }
    text = json.dumps(manifest, indent=2) + "\n"
    _write_bytes_atomic(out / MANIFEST, text.encode())
    (out / WRITING_MARKER).unlink(missing_ok=True)
    return json.loads(text)  # exactly what load_artifact will see (tuples become lists)


