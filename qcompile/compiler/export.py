"""Writing compiled artifacts: `jax.export` of the step program per shape bucket, weights, manifest (see
qcompile/runtime/artifact.py for the layout and what loading verifies).

The compiler writes, the runtime reads: the format constants live with the reader so that a serving host needs only
the runtime.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import attrs
import jax
import jaxlib
import numpy as np
from tqdm import tqdm

import qcompile
from qcompile.errors import UsageError
from qcompile.frontend.checkpoint import Checkpoint
from qcompile.frontend.safetensors_io import aligned_order, stream_safetensors
from qcompile.frontend.tokenizer import TOKENIZER_FILES
from qcompile.ir.abi import (BATCH_INPUTS, LOGITS, CacheConfig, batch_specs, bucket_shapes, cache_specs,
                             data_parallel_ranks, graph_cache_types)
from qcompile.ir.graph import Graph
from qcompile.ir.lowering import is_sharded, step_function
from qcompile.ir.printer import print_graph
from qcompile.ir.types import np_dtype
from qcompile.ir.weights import param_types, weight_pieces
from qcompile.kernels import native
from qcompile.runtime.artifact import (CHECKPOINT_DIR, DIGEST_KEY, EXEC_DIR, FORMAT_VERSION, GRAPH_TEXT, MANIFEST,
                                       TARGETS, WEIGHT_MODES, WEIGHTS, WRITING_MARKER, bucket_file, inside,
                                       manifest_digest, sha256_file)

#: --target -> the lowering rules its executables are built with.
TARGET_RULES = {"cpu": "cpu", "tpu": "tpu", "gpu": "gpu"}
#: Room left for the executables, manifest and graph text when checking free disk space.
SPACE_MARGIN = 256 << 20


@attrs.frozen
class CheckpointWeights:
    """The graph's weights, to be made from a checkpoint one slab at a time (ir/weights.py::weight_pieces); arrays
    already made for the numerics check (`loaded`, same names, shapes and dtypes) are reused instead of re-read."""

    checkpoint: Checkpoint
    graph: Graph
    loaded: dict | None = None

    def pieces(self, name: str) -> Iterable[np.ndarray]:
        have = (self.loaded or {}).get(name)
        type_ = param_types(self.graph)[name]
        if have is not None and tuple(have.shape) == tuple(type_.shape) and have.dtype == np_dtype(type_.dtype):
            return (np.asarray(have),)
        return weight_pieces(self.checkpoint, self.graph, name)


@attrs.frozen
class ArrayWeights:
    """Weights already in memory (name -> array): what tests and in-process callers hand over."""

    params: dict
    checkpoint = None

    def pieces(self, name: str) -> Iterable[np.ndarray]:
        return (np.asarray(self.params[name]),)


def weight_bytes(graph: Graph) -> int:
    return sum(math.prod(t.shape) * np.dtype(np_dtype(t.dtype)).itemsize for t in param_types(graph).values())


def check_free_space(out: Path, needed: int, mode: str) -> None:
    """Refuse (exit 2, before anything is written) an output whose file system cannot hold `needed` bytes plus a
    margin; the bytes an old artifact in `out` would free count as available."""
    probe = Path(out).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    manifest = Path(out) / MANIFEST
    if manifest.is_file():
        try:
            free += sum(int(e.get("bytes", 0)) for e in json.loads(manifest.read_text()).get("files", {}).values()
                        if isinstance(e, dict))
        except (ValueError, AttributeError, TypeError):
            pass
    if needed + SPACE_MARGIN > free:
        raise UsageError(f"{out}: the artifact needs {(needed + SPACE_MARGIN) / 1e9:.1f} GB (--weights {mode}) but "
                         f"its file system has {free / 1e9:.1f} GB free; free space, choose another -o, or use "
                         f"--weights link (hard links to the checkpoint) or --weights none")


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
    linked = out / CHECKPOINT_DIR
    if linked.is_dir():  # hard links only: removing them never touches the checkpoint's own files
        shutil.rmtree(linked)




def write_artifact(out_dir, graph: Graph, weights, *, config_json: dict, cache: CacheConfig, target: str = "cpu",
                   extra: dict | None = None, progress: bool | None = None, mode: str = "copy") -> dict:
    """Export `graph` for every shape bucket of `cache` from the weights' shapes alone, then write the weights
    (`mode`: copy | link | none, see qcompile/runtime/artifact.py) and the manifest to `out_dir`; return the manifest.

    `weights` is a CheckpointWeights (streamed one slab at a time; needed for link and none) or a dict of arrays.
    """
    if target not in TARGETS:
        raise UsageError(f"unknown target {target!r}; choose one of {', '.join(TARGETS)}")
    if mode not in WEIGHT_MODES:
        raise UsageError(f"unknown --weights {mode!r}; choose one of {', '.join(WEIGHT_MODES)}")
    if isinstance(weights, dict):
        weights = ArrayWeights(weights)
    if mode != "copy" and weights.checkpoint is None:
        raise UsageError(f"--weights {mode} needs a checkpoint to link to or read from")
    platform = TARGETS[target]
    out = Path(out_dir)
    reserved = {"format_version", "qcompile_version", "jax_version", "jaxlib_version", "target", "platform", "mesh",
                "config", "page_size", "cache", "cache_types", "buckets", "files", "export_seconds", "lowering",
                "weights"}
    clash = sorted(reserved & set(extra or {}))
    if clash:
        raise ValueError(f"extra manifest keys clash with reserved ones: {clash}")
    check_free_space(out, weight_bytes(graph) if mode == "copy" else 0, mode)

    created = not out.exists()
    _prepare_out_dir(out)
    try:
        return _write(out, graph, weights, config_json=config_json, cache=cache, target=target, platform=platform,
                      extra=extra, progress=progress, mode=mode)
    except BaseException:
        # An unfinished artifact never looks like a finished one: a directory we created goes away; one that held an
        # older artifact keeps the writing marker (and no manifest), which load_artifact refuses as unfinished.
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise


def _export(out: Path, graph: Graph, *, cache, target, platform, show) -> tuple[list, set, float]:
    """jax.export of every shape bucket, from ShapeDtypeStructs: no weight is read to export."""
    sizes = cache.sizes(int(graph.meta["page_size"]))
    param_specs = {name: jax.ShapeDtypeStruct(tuple(t.shape), np_dtype(t.dtype))
                   for name, t in param_types(graph).items()}
    caches = cache_specs(graph_cache_types(graph), sizes)
    rules = TARGET_RULES[target]
    ranks = data_parallel_ranks(graph)
    jitted = {flag: jax.jit(step_function(graph, rules, flag), **mesh_shardings(graph, flag))
              for flag in (True, False)}
    # qcompile's own CPU custom calls (kernels/native.py) are not on jax.export's list of stable targets; the
    # manifest names them, and loading the artifact builds and registers them before anything is deserialized.
    allow = [jax.export.DisabledSafetyCheck.custom_call(name) for name in native.KERNELS]
    buckets, started, natives = [], time.perf_counter(), set()
    for tokens, rows in tqdm(bucket_shapes(cache, ranks), desc=f"exporting for {platform}", unit="bucket",
                             disable=not show, file=sys.stderr):
        with_logits = rows == tokens  # R = T buckets serve prompt logits; R = B buckets return token ids only
        exported = jax.export.export(jitted[with_logits], platforms=[platform], disabled_checks=allow)(
            param_specs, caches, batch_specs(tokens, rows, sizes, ranks))
        natives.update(native.used_by(exported.mlir_module()))
        rel = bucket_file(tokens, rows)
        _write_bytes_atomic(out / rel, bytes(exported.serialize()))
        buckets.append({"tokens": tokens, "rows": rows, "logits": with_logits, "file": rel})
    return buckets, natives, time.perf_counter() - started


def mesh_shardings(graph: Graph, with_logits: bool) -> dict:
    """in_shardings / out_shardings of a laid-out graph's step (each input, weight, cache and output with its
    NamedSharding on the graph's mesh), so the exported module carries them; none for a single-device graph."""
    if not is_sharded(graph):
        return {}
    from qcompile.ir.ops.core import Input

    mesh = graph.meta["mesh"]
    devices = mesh.jax_mesh()
    named = lambda t: mesh.named_sharding(t, devices)  # noqa: E731
    inputs = {node.op.name: named(node.op.type) for node in graph.find(Input)}
    caches = {name: inputs[name] for name in graph_cache_types(graph)}
    batch = {name: inputs[name] for name in BATCH_INPUTS}
    params = {name: named(t) for name, t in param_types(graph).items()}
    outputs = {name: named(graph.type_of(value)) for name, value in graph.outputs.items()
               if with_logits or name != LOGITS}
    return {"in_shardings": (params, caches, batch), "out_shardings": outputs}


def _copy_tokenizer(out: Path, checkpoint) -> dict[str, dict]:
    """The checkpoint's tokenizer files copied beside the copied weights (so `run --prompt` works on the artifact
    alone), with their hashes for the manifest; none when the checkpoint has none."""
    if checkpoint is None:
        return {}
    copied = {}
    for rel, path in checkpoint.files().items():
        if Path(rel).name in TOKENIZER_FILES and Path(rel).parent == Path("."):
            shutil.copyfile(path, out / rel)
            copied[rel] = {"sha256": sha256_file(out / rel), "bytes": (out / rel).stat().st_size}
    return copied


def _hash_files(paths: dict[str, Path], show: bool) -> dict[str, dict]:
    """{key: {bytes, sha256}} for each file, hashed in parallel (hashing and reading release the GIL)."""
    total = sum(p.stat().st_size for p in paths.values())
    with tqdm(total=total, desc="hashing checkpoint", unit="B", unit_scale=True, unit_divisor=1024,
              disable=not show, file=sys.stderr) as bar:
        def one(item):
            key, path = item
            digest = sha256_file(path, on_bytes=bar.update)
            return key, {"sha256": digest, "bytes": path.stat().st_size}

        with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
            return dict(pool.map(one, paths.items()))


def _link_checkpoint(out: Path, checkpoint: Checkpoint) -> bool:
    """Hard-link the checkpoint's files into OUT/checkpoint/ (same relative names); False when the file system
    refuses (another device, no hard links), after removing any partial links."""
    target = out / CHECKPOINT_DIR
    target.mkdir(exist_ok=True)
    try:
        for rel, path in checkpoint.files().items():
            dest = target / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.unlink(missing_ok=True)
            os.link(path, dest)
    except OSError:
        shutil.rmtree(target, ignore_errors=True)
        return False
    return True


def _write(out: Path, graph: Graph, weights, *, config_json, cache, target, platform, extra, progress,
           mode) -> dict:
    page_size = int(graph.meta["page_size"])
    (out / EXEC_DIR).mkdir(exist_ok=True)
    show = sys.stderr.isatty() if progress is None else progress
    buckets, natives, export_seconds = _export(out, graph, cache=cache, target=target, platform=platform, show=show)
    (out / GRAPH_TEXT).write_text(print_graph(graph))
    files = {rel: {"sha256": sha256_file(out / rel), "bytes": (out / rel).stat().st_size}
             for rel in [GRAPH_TEXT, *(b["file"] for b in buckets)]}
    types = param_types(graph)
    weights_entry: dict = {"mode": mode, "params": {name: str(t) for name, t in types.items()}}
    started = time.perf_counter()
    if mode == "copy":
        specs = aligned_order({name: (np_dtype(t.dtype), tuple(t.shape)) for name, t in types.items()})
        with tqdm(total=weight_bytes(graph), desc="writing weights", unit="B", unit_scale=True, unit_divisor=1024,
                  disable=not show, file=sys.stderr) as bar:
            written = stream_safetensors(out / WEIGHTS, specs, weights.pieces, {"format": "qcompile-artifact"},
                                         on_bytes=bar.update)
        files[WEIGHTS] = {"sha256": written.sha256, "bytes": written.bytes}
        weights_entry["source"] = "artifact"
        files.update(_copy_tokenizer(out, weights.checkpoint))
    else:
        # The weights are made at load time from the checkpoint's own files, exactly as `run CHECKPOINT` makes them
        # (canonical names, casts, the recipes below); the files' hashes make tampering with them an exit-65 error.
        weights_entry["prepared"] = dict(graph.meta.get("prepared", {}))
        checkpoint = weights.checkpoint
        if mode == "link" and _link_checkpoint(out, checkpoint):
            linked = {f"{CHECKPOINT_DIR}/{rel}": out / CHECKPOINT_DIR / rel for rel in checkpoint.files()}
            files.update(_hash_files(linked, show))
            weights_entry["source"] = "linked"
            weights_entry["checkpoint_entry"] = checkpoint.entry()
        else:
            weights_entry["source"] = "checkpoint"
            weights_entry["checkpoint"] = {"path": str(Path(checkpoint.path).absolute()),
                                           "entry": checkpoint.entry(),
                                           "files": _hash_files(checkpoint.files(), show)}
    weights_seconds = time.perf_counter() - started
    manifest = {
        "format_version": FORMAT_VERSION,
        "qcompile_version": qcompile.__version__,
        "jax_version": jax.__version__,
        "jaxlib_version": jaxlib.__version__,
        "target": target,
        "platform": platform,
        "mesh": graph.meta["mesh"].attributes() if is_sharded(graph) else None,
        "config": config_json,
        "page_size": page_size,
        "cache": cache.to_json(page_size),
        "lowering": TARGET_RULES[target],
        "native_kernels": sorted(natives),
        "cache_types": {name: str(t) for name, t in graph_cache_types(graph).items()},
        "buckets": buckets,
        "weights": weights_entry,
        "files": files,
        "export_seconds": round(export_seconds, 3),
        "weights_seconds": round(weights_seconds, 3),
        **(extra or {}),
    }
    manifest = json.loads(json.dumps(manifest))  # as load_artifact reads it (tuples become lists) ...
    manifest[DIGEST_KEY] = manifest_digest(manifest)  # ... then sealed: see runtime/artifact.py manifest_digest
    text = json.dumps(manifest, indent=2) + "\n"
    _write_bytes_atomic(out / MANIFEST, text.encode())
    (out / WRITING_MARKER).unlink(missing_ok=True)
    return json.loads(text)  # exactly what load_artifact will see (tuples become lists)
