"""Compiled artifacts: a directory that `qcompile run` serves from alone, with no checkpoint and no recompilation.

What: `write_artifact` (qcompile/compiler/export.py) exports the step graph with `jax.export` once per shape bucket, writes the weights in the
layout the (optimized) graph uses, and records everything needed to run and to audit the result in
`manifest.json`. `load_artifact` verifies the directory and returns an `ArtifactModel` whose `engine()` is a normal
`Engine` backed by the exported executables (`ExportedProgram`, a step program like `GraphProgram`).

Why: compiling (import, passes, equivalence checks, tracing) is done once, on any machine, for a fixed target
platform and fixed cache shapes; serving only deserializes StableHLO and lets XLA compile it for the device. The
executables are exported from the weights' shapes alone (no weight is read to export), so a 400 GB checkpoint
compiles on a host that could never hold it.

Layout of OUT/:

    manifest.json                    written last, atomically; the artifact exists once this file does
    weights.safetensors              --weights copy: every graph parameter under its graph name, in the graph's dtype
                                     and layout (prepared weights included), streamed one slab at a time and hashed
                                     as it is written; laid out 64-byte aligned (safetensors_io.aligned_order), so
                                     `run` uses each tensor in place from the mapped file (ir/weights.py::to_device)
    tokenizer.json                   --weights copy: the checkpoint's tokenizer (and tokenizer_config.json,
                                     chat_template.jinja), when it has one
    checkpoint/...                   --weights link: the checkpoint's files (config.json, index, shards), hard links
    graph.qir                        the step graph in IR text form (read to make the weights in link/none modes)
    exec/step_T{T}_R{R}.jaxexport    jax.export serialization of the step (qcompile/ir/abi.py) for T tokens, R rows

Weights (`--weights`, manifest `weights`: mode, source, params = name -> IR type, and for link/none the prepared
weights' recipes):
  copy — the default: the weights are in the artifact; the checkpoint may be deleted; `run` prepares nothing.
  link — nothing is copied: the checkpoint's files are hard-linked into OUT/checkpoint/ (so the artifact survives the
         checkpoint's deletion and takes no extra space), and `run` makes the weights from them as `run CHECKPOINT`
         does (casts, layout recipes). Where the file system refuses hard links (another device), the manifest
         references the checkpoint by path, size and hash instead (source "checkpoint"), as for none.
  none — executables and manifest only, for deployments that load the checkpoint directly: `run` reads the checkpoint
         at its recorded path, says so in one line, and refuses (exit 65) a checkpoint that is missing or whose files
         differ in size or sha256 from compile time.

Shape buckets are fixed at compile time from the CacheConfig: B = max_seqs sequence slots, M = pages per sequence,
P = pool pages, S = B state slots; T runs over the powers of two 1 .. max(max_step_tokens, max_seqs) (rounded up to
a power of two: chunked prefill never packs more than max_step_tokens, a decode step packs one token per sequence).
Each T is exported with R = B rows (last token of each sequence: decode and prefill; returns the greedy next_tokens
and the caches, no logits) and R = T (every token's logits: `--save-logits` / prompt logits); when T = B the two
coincide and are exported once, with logits. The executables are lowered with the target's rules (manifest
`lowering`).

manifest.json keys: format_version, qcompile_version, jax_version, jaxlib_version, target (cpu | tpu | gpu),
platform (the jax.export platform: cpu | tpu | cuda), mesh (null: single device; else the `mesh {...}` attributes of a
graph laid out by gqa-sharding: its executables carry each input's and output's sharding, and loading needs that many
devices — `artifact_devices` reads it before JAX starts), config (the model config),
page_size, cache (max_seqs, max_context, num_pages, max_step_tokens and the bound sizes B/M/P/S), cache_types
(name -> IR type text), buckets ([{tokens, rows, logits, file}]), lowering (the rule table the executables use),
native_kernels (qcompile's native CPU custom calls the executables call, kernels/native.py; [] elsewhere), weights
(above), files ({relative path: {sha256, bytes}} for every file but the manifest), export_seconds, weights_seconds,
plus the caller's `extra` keys (the CLI adds pipeline, passes, equivalence).

What `load_artifact` verifies, refusing with a one-line CheckpointError (exit 65) naming the file:
  * manifest.json exists, is a JSON object, and its format_version is one this qcompile reads;
  * the target matches the platform this process runs (`jax.default_backend()`);
  * every listed file exists, has the recorded size (truncation) and the recorded sha256 (tampering; streamed in
    chunks, never read whole); listed paths must stay inside the artifact; the same for a referenced checkpoint's
    files;
  * the native CPU kernels it names can be built and registered here (else: what is missing, and how to compile
    without them);
  * every bucket's executable deserializes with the installed jax (else: the exporting vs installed versions),
    was exported for the manifest's platform, and takes exactly the shapes the manifest describes (token bucket,
    logit rows, caches, weights), and the weights made have exactly those names, shapes and dtypes.

GPU: `--target gpu` exports for platform `cuda` (lowering needs no GPU, so it works from this machine); running it
needs a CUDA host with `pip install 'qcompile[gpu]'` (jax[cuda13] of the same jax minor version), where
`jax.default_backend()` is `gpu`. ROCm is not wired up.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path, PurePosixPath

import attrs
import jax
import jaxlib
import numpy as np

import qcompile
from qcompile.errors import CheckpointError, UsageError, one_line
from qcompile.frontend.safetensors_io import SafetensorsFile
from qcompile.ir.abi import CacheConfig, batch_specs, cache_specs, mesh_ranks
from qcompile.ir.importer import DTYPE_CHOICES
from qcompile.ir.types import TensorType, np_dtype, parse_type
from qcompile.kernels import native
from qcompile.runtime.engine import Engine, MeshPlacement
from qcompile.runtime.memory import CompiledBuckets

FORMAT_VERSION = 3  # 2: buckets carry `logits`; 3: `weights` (mode, source, parameter types)
READABLE_FORMAT_VERSIONS = (2, 3)
MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"
GRAPH_TEXT = "graph.qir"
EXEC_DIR = "exec"
#: --weights link: the checkpoint's files, hard-linked here.
CHECKPOINT_DIR = "checkpoint"
#: --weights: copy (prepared weights in weights.safetensors), link (hard links to the checkpoint's files, weights
#: made from them at load), none (executables and manifest only; weights made at load from the checkpoint's path).
WEIGHT_MODES = ("copy", "link", "none")
#: Present while write_artifact is running; lets a rerun overwrite a directory an interrupted write left behind.
WRITING_MARKER = ".qcompile-writing"
#: --target name -> jax.export platform name.
TARGETS = {"cpu": "cpu", "tpu": "tpu", "gpu": "cuda"}
_CHUNK = 1 << 20


# -- shapes --------------------------------------------------------------------------------------------------------


def bucket_file(tokens: int, rows: int) -> str:
    return f"{EXEC_DIR}/step_T{tokens}_R{rows}.jaxexport"


# -- files and hashes ----------------------------------------------------------------------------------------------


def sha256_file(path: Path, on_bytes=None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            if on_bytes is not None:
                on_bytes(len(chunk))
    return digest.hexdigest()




def is_artifact(path) -> bool:
    """A directory holding a manifest.json, or one an artifact write left unfinished (load_artifact refuses it)."""
    p = Path(path)
    return p.is_dir() and ((p / MANIFEST).is_file() or (p / WRITING_MARKER).exists())




def inside(root: Path, rel: str) -> Path | None:
    """root/rel if rel is a plain relative path that stays inside root, else None."""
    if not isinstance(rel, str) or not rel:
        return None
    parts = PurePosixPath(rel).parts
    if PurePosixPath(rel).is_absolute() or any(p in ("..", "") for p in parts) or "\\" in rel:
        return None
    return root.joinpath(*parts)


# -- loading -------------------------------------------------------------------------------------------------------


def _refuse(where, problem: str) -> CheckpointError:
    return CheckpointError(one_line(f"{where}: {problem}"))


def _version_line(manifest: dict) -> str:
    exported_with = f"jax {manifest.get('jax_version', '?')} / jaxlib {manifest.get('jaxlib_version', '?')}"
    return (f"it was exported with {exported_with}, "
            f"this machine has jax {jax.__version__} / jaxlib {jaxlib.__version__}")


DIGEST_KEY = "manifest_sha256"


def manifest_digest(manifest: dict) -> str:
    """sha256 of the manifest's own fields (all but this digest), as JSON with sorted keys: an edit to the sizes,
    the mesh or the passes is refused at load instead of failing inside a step (exit 1) or being trusted."""
    body = {key: value for key, value in manifest.items() if key != DIGEST_KEY}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _read_manifest(root: Path) -> dict:
    path = root / MANIFEST
    if not root.is_dir():
        raise _refuse(root, "not an artifact directory")
    if not path.is_file():
        if (root / WRITING_MARKER).exists():
            raise _refuse(path, "missing: the artifact write was interrupted; compile it again")
        raise _refuse(path, "missing: not a qcompile artifact")
    try:
        manifest = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise _refuse(path, f"not valid JSON ({err})") from None
    if not isinstance(manifest, dict):
        raise _refuse(path, "not a JSON object")
    digest = manifest.get(DIGEST_KEY)  # absent in artifacts written before it existed
    if digest is not None and digest != manifest_digest(manifest):
        raise _refuse(path, "edited after it was written (its fields no longer match its digest); compile the "
                            "artifact again")
    version = manifest.get("format_version")
    if version not in READABLE_FORMAT_VERSIONS:
        readable = ", ".join(str(v) for v in READABLE_FORMAT_VERSIONS)
        raise _refuse(path, f"format_version {version!r} is not supported; qcompile {qcompile.__version__} reads "
                            f"format_version {readable} — recompile the artifact with this qcompile")
    return manifest


def _need(manifest: dict, path: Path, key: str, kind):
    value = manifest.get(key)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise _refuse(path, f"'{key}' is missing or malformed")
    return value


def _check_files(root: Path, files: dict, verify_hashes: bool) -> None:
    manifest_path = root / MANIFEST
    for rel, entry in files.items():
        path = inside(root, rel)
        if path is None or not isinstance(entry, dict):
            raise _refuse(manifest_path, f"bad file entry {rel!r}")
        if not path.is_file():
            raise _refuse(path, "missing from the artifact")
        size = path.stat().st_size
        if size != entry.get("bytes"):
            how = "truncated" if isinstance(entry.get("bytes"), int) and size < entry["bytes"] else "wrong size"
            raise _refuse(path, f"{how}: {size} bytes, the manifest says {entry.get('bytes')}")
        if verify_hashes and sha256_file(path) != entry.get("sha256"):
            raise _refuse(path, "sha256 does not match the manifest: the file was modified or corrupted")


def _deserialize(path: Path, manifest: dict):
    try:
        exported = jax.export.deserialize(bytearray(path.read_bytes()))
    except Exception as err:  # noqa: BLE001 - any failure here means this jax cannot read the file
        raise _refuse(path, f"cannot deserialize the exported executable ({type(err).__name__}: {err}); "
                            f"{_version_line(manifest)} — recompile the artifact with this jax") from None
    version = exported.calling_convention_version
    low = jax.export.minimum_supported_calling_convention_version
    high = jax.export.maximum_supported_calling_convention_version
    if not low <= version <= high:
        raise _refuse(path, f"calling convention version {version} is outside the {low}..{high} this jax supports; "
                            f"{_version_line(manifest)} — recompile the artifact with this jax")
    return exported


def _shape_text(aval) -> str:
    return f"{aval.dtype}{list(aval.shape)}"


def _check_exported(path: Path, exported, manifest: dict, expected) -> None:
    if tuple(exported.platforms) != (manifest["platform"],):
        raise _refuse(path, f"exported for {', '.join(exported.platforms)} but the manifest says "
                            f"{manifest['platform']}: mismatched artifact")
    try:
        (args, kwargs) = jax.tree_util.tree_unflatten(exported.in_tree, exported.in_avals)
    except Exception as err:  # noqa: BLE001
        raise _refuse(path, f"unexpected calling structure ({err})") from None
    got = jax.tree_util.tree_structure((args, kwargs))
    want = jax.tree_util.tree_structure((expected, {}))
    if got != want:
        raise _refuse(path, "its inputs (weights, caches or batch fields) do not match the manifest and "
                            "weights.safetensors: mismatched artifact")
    for (keypath, aval), spec in zip(jax.tree_util.tree_leaves_with_path(args), jax.tree_util.tree_leaves(expected)):
        if tuple(aval.shape) != tuple(spec.shape) or np.dtype(aval.dtype) != np.dtype(spec.dtype):
            name = jax.tree_util.keystr(keypath)
            raise _refuse(path, f"input {name} is {_shape_text(aval)} but the manifest/weights give "
                                f"{_shape_text(spec)}: mismatched artifact")


#: Where compiled executables of artifacts are cached across processes (override with QCOMPILE_CACHE_DIR; "off"
#: disables the cache).
CACHE_ENV = "QCOMPILE_CACHE_DIR"


def _ensure_native_kernels(manifest: dict, manifest_path: Path) -> None:
    """Build (once) and register the native CPU kernels the executables call (kernels/native.py)."""
    names = manifest.get("native_kernels", [])
    if not isinstance(names, list) or any(name not in native.KERNELS for name in names):
        raise _refuse(manifest_path, f"native_kernels {names!r} names a kernel this qcompile does not have")
    for name in names:
        if not native.ensure(name):
            raise _refuse(manifest_path, f"its executables call qcompile's native CPU kernel {name}, which is "
                                         f"unavailable here ({native.status(name)}); install a C++ compiler, or "
                                         "compile the artifact again with QCOMPILE_NATIVE=off")


def use_compilation_cache(manifest: dict) -> Path | None:
    """Point JAX's persistent compilation cache at a directory keyed by the artifact's file hashes, so a second
    `run`/`bench`/`serve` of the same artifact loads the XLA executables instead of compiling them again.

    The cache is per process (JAX holds one directory); entries are keyed by XLA by the computation and platform, and
    the directory by the artifact, so deleting one artifact's cache never touches another's.
    """
    import os

    root = os.environ.get(CACHE_ENV) or str(Path.home() / ".cache" / "qcompile")
    if root.lower() in ("off", "0", "none", ""):
        return None
    key = hashlib.sha256(json.dumps(manifest.get("files", {}), sort_keys=True).encode()).hexdigest()[:16]
    path = Path(root) / "xla" / key
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None  # an unwritable cache only costs compile time
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


class ExportedProgram:
    """A step program backed by deserialized jax.export executables, one per (tokens, rows) bucket.

    Each executable is wrapped in a jit that donates the caches (as GraphProgram does) and compiled by XLA on its
    first call. Buckets with R = T return logits; the others return next_tokens and the caches only.
    """

    def __init__(self, page_size: int, cache_types: dict[str, TensorType],
                 exported: dict[tuple[int, int], tuple[object, bool]], mesh=None, param_types=None):
        self.page_size = page_size
        self.cache_types = cache_types
        self._exported = exported
        self.placement = MeshPlacement(mesh, cache_types, param_types or {})
        self.ranks = self.placement.ranks
        # exported for several devices: data-parallel ranks, or one rank split tensor-parallel (ranks 1)
        self.multi_device = mesh is not None and mesh.size > 1
        self._tokens = sorted({t // self.ranks for t, _ in exported})  # per rank
        self._callables: dict[tuple[int, int], object] = {}
        self.compiled_buckets = CompiledBuckets()

    def place_params(self, params: dict) -> dict:
        return self.placement.place_params(params)

    def place_caches(self, caches: dict) -> dict:
        return self.placement.place_caches(caches)

    @property
    def buckets(self) -> list[tuple[int, int]]:
        return sorted(self._exported)

    @property
    def samples(self) -> bool:
        """Whether every exported bucket returns logits (what an on-device sampler draws from); otherwise the
        decode buckets return greedy token ids only."""
        return all(has_logits for _, has_logits in self._exported.values())

    def token_bucket(self, n: int) -> int:
        for tokens in self._tokens:
            if tokens >= max(n, 1):
                return tokens
        raise UsageError(f"a step of {n} tokens exceeds the largest exported bucket ({self._tokens[-1]} tokens); "
                         "recompile the artifact with a larger --max-step-tokens")

    def _jitted(self, params, caches, batch, with_logits: bool):
        key = (int(np.shape(batch["token_ids"])[0]), int(np.shape(batch["logits_indices"])[0]))
        if key not in self._exported:
            have = ", ".join(f"T{t}/R{r}" for t, r in self.buckets)
            raise UsageError(f"no exported executable for {key[0]} tokens and {key[1]} logit rows "
                             f"(the artifact has {have})")
        exported, has_logits = self._exported[key]
        if with_logits and not has_logits:
            raise UsageError(f"the artifact's T{key[0]}/R{key[1]} executable returns token ids only; logits are "
                             "exported for all-token (prompt logits) steps")
        fn = self._callables.get(key)
        if fn is None and self.multi_device:  # the exported module carries its shardings on the mesh
            fn = self._callables[key] = jax.jit(exported.call, donate_argnums=(1,))
        elif fn is None:
            # Single device: pin in/out shardings so that committed outputs fed back as inputs (the caches) hit
            # the same compiled executable instead of compiling the bucket a second time.
            device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            fn = self._callables[key] = jax.jit(exported.call, donate_argnums=(1,),
                                                in_shardings=device, out_shardings=device)
        return fn, has_logits

    def executable(self, params, caches, batch, with_logits: bool = True):
        """The compiled executable of this bucket (see GraphProgram.executable); whether it returns logits is fixed
        by the export."""
        fn, has_logits = self._jitted(params, caches, batch, with_logits)
        return self.compiled_buckets.compiled(fn, params, caches, batch, has_logits)

    def __call__(self, params, caches, batch, with_logits: bool = True):
        return self.executable(params, caches, batch, with_logits)(params, caches, batch)


@attrs.define
class ArtifactModel:
    path: Path
    manifest: dict
    params: dict
    program: ExportedProgram
    weights_note: str | None = None  # where the weights came from when not from the artifact itself

    @property
    def config_json(self) -> dict:
        return self.manifest["config"]

    @property
    def cache_config(self) -> CacheConfig:
        return CacheConfig.from_json(self.manifest["cache"])

    def engine(self, memory_budget: int | None = None) -> Engine:
        return Engine(self.program, self.params, self.cache_config, memory_budget=memory_budget)

    def graph(self):
        """The step graph the executables were exported from, parsed from graph.qir (for costs and probes)."""
        return _parse_artifact_graph(self.path, self.manifest, list(self.program.cache_types))


def _parse_artifact_graph(root: Path, manifest: dict, caches: list[str]):
    from qcompile.ir.parser import parse_graph

    meta = {"page_size": manifest["page_size"], "caches": caches, "vocab_size": int(manifest["config"]["vocab_size"]),
            "dtype": manifest.get("compute_dtype", "f32"),
            "prepared": dict((manifest.get("weights") or {}).get("prepared") or {})}
    return parse_graph((root / GRAPH_TEXT).read_text(), str(root / GRAPH_TEXT), meta=meta)


def _weights_entry(manifest: dict, manifest_path: Path) -> dict:
    """The manifest's `weights` section (format 3), or what a format-2 artifact implies (everything copied)."""
    entry = manifest.get("weights", {"mode": "copy", "source": "artifact"})
    ok = (isinstance(entry, dict) and entry.get("mode") in WEIGHT_MODES
          and entry.get("source") in ("artifact", "linked", "checkpoint")
          and isinstance(entry.get("params", {}), dict))
    if not ok:
        raise _refuse(manifest_path, "'weights' is missing or malformed")
    return entry


def _referenced_checkpoint(entry: dict, manifest_path: Path, verify_hashes: bool) -> Path:
    """The checkpoint a --weights none artifact (or a link that fell back to references) reads its weights from,
    checked file by file against the sizes and hashes recorded at compile time."""
    ref = entry.get("checkpoint")
    if not isinstance(ref, dict) or not isinstance(ref.get("path"), str) or not isinstance(ref.get("files"), dict):
        raise _refuse(manifest_path, "'weights.checkpoint' is missing or malformed")
    root = Path(ref["path"])
    how = f"this artifact holds no weights (compiled with --weights {entry['mode']}); it reads them from {root}"
    for rel, info in ref["files"].items():
        path = inside(root, rel)
        if path is None or not isinstance(info, dict):
            raise _refuse(manifest_path, f"bad checkpoint file entry {rel!r}")
        if not path.is_file():
            raise _refuse(path, f"missing: {how}; restore the checkpoint there or compile with --weights copy")
        if path.stat().st_size != info.get("bytes"):
            raise _refuse(path, f"{path.stat().st_size} bytes, {info.get('bytes')} when the artifact was compiled: "
                                f"{how}, and the checkpoint changed; compile the artifact again")
        if verify_hashes and sha256_file(path) != info.get("sha256"):
            raise _refuse(path, f"sha256 differs from when the artifact was compiled: {how}, and the checkpoint "
                                "was modified; compile the artifact again")
    return root / str(ref.get("entry", "."))


def _load_weights(root: Path, manifest: dict, entry: dict, cache_types: dict, verify_hashes: bool,
                  progress: bool | None) -> tuple[dict, str | None]:
    """(parameters on the device, a line saying where they came from when not from the artifact itself)."""
    from qcompile.ir.weights import load_params, to_device

    if entry["source"] == "artifact":
        # The artifact lays its tensors out 64-byte aligned (safetensors_io.aligned_order), so each is used in place
        # from the mapped file; one that is not (an older artifact, an odd-sized vector) is copied and its pages
        # dropped.
        weights = SafetensorsFile(root / WEIGHTS)
        params = {}
        for name in weights.tensors:
            params[name], aliased = to_device(weights.read(name))
            if not aliased:
                weights.release(name)
        return params, None
    from qcompile.frontend.checkpoint import Checkpoint

    if entry["source"] == "linked":
        opened = root / CHECKPOINT_DIR / str(entry.get("checkpoint_entry", "."))
        note = f"qcompile: weights made from the checkpoint hard-linked into {root / CHECKPOINT_DIR} (--weights link)"
    else:
        opened = _referenced_checkpoint(entry, root / MANIFEST, verify_hashes)
        note = (f"qcompile: this artifact needs the checkpoint at {opened} and reads its weights from there "
                f"(--weights {entry['mode']})")
    graph = _parse_artifact_graph(root, manifest, list(cache_types))
    return load_params(Checkpoint.open(opened), graph, progress), note


def artifact_devices(path) -> int:
    """How many devices an artifact's mesh needs (1 without one); read before JAX starts, so the command line can
    give this host that many CPU devices. Errors are left to load_artifact."""
    from qcompile.ir.mesh import Mesh

    try:
        mesh = json.loads((Path(path) / MANIFEST).read_text()).get("mesh")
        return Mesh.from_attributes(mesh).size if mesh else 1
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return 1


def tokenizer_dir(path) -> Path:
    """Where an artifact's tokenizer.json is: the artifact itself (a copied-weights artifact keeps it), its linked
    checkpoint/, or the checkpoint it references by path; the artifact when none has one (the caller then says
    that a tokenizer is needed). Read without loading the artifact."""
    root = Path(path)
    candidates = [root, root / "checkpoint"]
    try:
        weights = json.loads((root / MANIFEST).read_text()).get("weights", {})
        if weights.get("checkpoint", {}).get("path"):
            source = Path(weights["checkpoint"]["path"])
            candidates.append(source if source.is_dir() else source.parent)
    except (OSError, ValueError, AttributeError):
        pass
    return next((c for c in candidates if (c / "tokenizer.json").is_file()), root)


def _mesh(manifest: dict, manifest_path: Path):
    """The manifest's mesh (None: one device); refused when malformed or when this process has too few devices."""
    from qcompile.ir.mesh import Mesh

    entry = manifest.get("mesh")
    if entry is None:
        return None
    try:
        mesh = Mesh.from_attributes(entry)
    except (TypeError, ValueError, KeyError) as err:
        raise _refuse(manifest_path, f"malformed mesh ({err})") from None
    have = len(jax.devices())
    if have < mesh.size:
        raise _refuse(manifest_path.parent, f"laid out on {mesh.size} devices; this process has {have} (qcompile run "
                                            f"and bench set them up; from Python call jax.config.update("
                                            f"'jax_num_cpu_devices', {mesh.size}) before JAX starts)")
    return mesh


def load_artifact(path, verify_hashes: bool = True, progress: bool | None = False) -> ArtifactModel:
    """Verify an artifact directory (see the module docstring) and load its weights and executables."""
    root = Path(path)
    manifest = _read_manifest(root)
    manifest_path = root / MANIFEST
    target = _need(manifest, manifest_path, "target", str)
    if target not in TARGETS or manifest.get("platform") != TARGETS[target]:
        raise _refuse(manifest_path, f"unknown target {target!r} / platform {manifest.get('platform')!r}")
    here = jax.default_backend()
    if target != here:
        raise _refuse(root, f"artifact was compiled for {target}; this machine runs {here} — run it on a {target} "
                            f"host (or compile again with --target {here})")
    files = _need(manifest, manifest_path, "files", dict)
    buckets = _need(manifest, manifest_path, "buckets", list)
    cache_json = _need(manifest, manifest_path, "cache", dict)
    page_size = _need(manifest, manifest_path, "page_size", int)
    entry = _weights_entry(manifest, manifest_path)
    try:
        cache_types = {name: parse_type(text) for name, text in _need(manifest, manifest_path, "cache_types",
                                                                         dict).items()}
        sizes = {k: int(cache_json["sizes"][k]) for k in ("B", "M", "P", "S")}
        keys = [(int(b["tokens"]), int(b["rows"]), str(b["file"]), bool(b["logits"])) for b in buckets]
        CacheConfig.from_json(cache_json)
        declared = {name: parse_type(text) for name, text in entry.get("params", {}).items()}
    except (KeyError, TypeError, ValueError, UsageError) as err:
        raise _refuse(manifest_path, f"malformed cache, bucket or weight description ({err})") from None
    needed = [WEIGHTS] if entry["source"] == "artifact" else []
    for rel in [*needed, *(f for _, _, f, _ in keys)]:
        if rel not in files:
            raise _refuse(manifest_path, f"{rel} is not listed under 'files' (no hash to check it against)")
    if not keys:
        raise _refuse(manifest_path, "lists no exported buckets")
    config = manifest.get("config")
    if not isinstance(config, dict):
        raise _refuse(manifest_path, "malformed config (not an object)")
    vocab = config.get("vocab_size", 1)  # (an artifact written from Python may carry no model config)
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise _refuse(manifest_path, f"malformed config (vocab_size {vocab!r})")
    dtype = manifest.get("compute_dtype", "f32")  # (a forged, re-sealed manifest: `check` builds its reference in it)
    if dtype not in DTYPE_CHOICES:
        raise _refuse(manifest_path, f"malformed compute_dtype {dtype!r} (one of {', '.join(DTYPE_CHOICES)})")
    _check_files(root, files, verify_hashes)

    _ensure_native_kernels(manifest, manifest_path)
    mesh = _mesh(manifest, manifest_path)
    ranks = 1
    if mesh is not None:
        ranks = mesh_ranks(mesh)
    if declared:
        param_specs = {name: jax.ShapeDtypeStruct(tuple(t.shape), np_dtype(t.dtype)) for name, t in declared.items()}
    else:  # format 2: the weights file is the only description
        weights = SafetensorsFile(root / WEIGHTS)  # validates the header and layout; data is read lazily
        param_specs = {name: jax.ShapeDtypeStruct(info.shape, info.np_dtype) for name, info in weights.tensors.items()}
    caches = cache_specs(cache_types, sizes)
    exported = {}
    for tokens, rows, rel, with_logits in keys:
        file = root / rel
        exp = _deserialize(file, manifest)
        _check_exported(file, exp, manifest, (param_specs, caches, batch_specs(tokens, rows, sizes, ranks)))
        if exp.nr_devices != (mesh.size if mesh is not None else 1):
            raise _refuse(file, f"exported for {exp.nr_devices} devices but the manifest's mesh has "
                                f"{mesh.size if mesh is not None else 1}: mismatched artifact")
        exported[(tokens, rows)] = (exp, with_logits)
    params, note = _load_weights(root, manifest, entry, cache_types, verify_hashes, progress)
    got = {name: jax.ShapeDtypeStruct(np.shape(a), a.dtype) for name, a in params.items()}
    if got != param_specs:
        raise _refuse(root / (WEIGHTS if entry["source"] == "artifact" else MANIFEST),
                      "the weights do not match what the executables take (names, shapes or dtypes): "
                      "mismatched artifact")
    program = ExportedProgram(page_size, cache_types, exported, mesh, declared)
    use_compilation_cache(manifest)
    return ArtifactModel(root, manifest, params, program, note)
