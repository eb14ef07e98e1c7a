"""Where the memory of a running model goes: weights, caches, XLA's temporaries, and the process's peak resident set.

Why: on a CPU host, and in the HBM of an accelerator, every byte that is not weights is KV pages and GDN state slots,
so concurrency. A user sizing a deployment needs the split, not one number: `run --json` and `bench` print it, the
engine checks a cache configuration against `--memory-budget` with it before allocating anything, and the memory test
holds the peak to weights + caches + temporaries + a fixed overhead.

    weights       bytes of every parameter array, and how many of them are used in place from a memory-mapped file
                  (ir/weights.py::to_device; those pages are shared with the page cache and counted once)
    caches        KV pages (full-attention layers) and GDN state slots (conv + recurrent), from the cache arrays
    temporaries   XLA's own memory analysis (`compiled.memory_analysis()`) of each compiled bucket: the scratch one
                  step needs beyond its arguments and outputs; the largest over the buckets compiled so far
    peak          the process's high-water resident set (VmHWM; resettable per phase through /proc/self/clear_refs)
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import resource
import sys
import weakref

import numpy as np

from qcompile.ir.types import np_dtype

#: The figures XLA reports for a compiled executable, under the names the reports use.
_ANALYSIS_FIELDS = {"temp_size_in_bytes": "temporaries", "argument_size_in_bytes": "arguments",
                    "output_size_in_bytes": "outputs", "alias_size_in_bytes": "aliased",
                    "generated_code_size_in_bytes": "code"}


def compiled_memory(compiled) -> dict[str, int] | None:
    """XLA's memory analysis of one compiled executable, or None where the backend gives none."""
    try:
        stats = compiled.memory_analysis()
    except (AttributeError, NotImplementedError, RuntimeError):
        return None
    if stats is None:
        return None
    return {name: int(getattr(stats, field, 0) or 0) for field, name in _ANALYSIS_FIELDS.items()}


class CompiledBuckets:
    """Step executables compiled ahead of time, one per bucket (the shapes of the caches and the batch, and whether
    logits are returned), so that XLA's memory analysis of each is known — a `jax.jit` called directly compiles the
    same executable but does not expose it. Calling the compiled executable costs no more than calling the jit."""

    def __init__(self) -> None:
        self._compiled: dict = {}
        self._analysis: dict = {}
        self._labels: dict = {}
        _LIVE.add(self)

    def clear(self) -> None:
        """Drop the compiled executables (each is compiled again on its next use); the analyses stay."""
        self._compiled.clear()

    @staticmethod
    def key(caches, batch, with_logits: bool) -> tuple:
        # np.dtype, not str(dtype): the key is made every step, and the string form cost 46 µs of it (now 6)
        shapes = tuple((name, tuple(a.shape), np.dtype(a.dtype))
                       for part in (caches, batch) for name, a in part.items())
        return with_logits, shapes

    def compiled(self, jitted, params, caches, batch, with_logits: bool):
        """The executable of this bucket, compiled on first use (caches and batch may be ShapeDtypeStructs)."""
        key = self.key(caches, batch, with_logits)
        fn = self._compiled.get(key)
        if fn is None:
            fn = self._compiled[key] = jitted.lower(params, caches, batch).compile()
            self._analysis[key] = compiled_memory(fn)
            self._labels[key] = (f"T{batch['token_ids'].shape[0]}/R{batch['logits_indices'].shape[0]}"
                                 + ("/logits" if with_logits else ""))
        return fn

    def labelled(self) -> dict[str, dict | None]:
        """Bucket label (T tokens / R rows [/logits]) -> memory analysis, for every bucket compiled so far."""
        return {self._labels[key]: stats for key, stats in self._analysis.items()}


_LIVE: "weakref.WeakSet[CompiledBuckets]" = weakref.WeakSet()


@contextlib.contextmanager
def frozen_heap():
    """Serve with every object alive now out of the cyclic garbage collector's reach (`gc.collect` then `gc.freeze`;
    `gc.unfreeze` on leaving). Loading, checking and compiling a model leave millions of long-lived Python objects
    (traced programs, lowered modules, the checker's graphs), and each of Python's full collections, triggered by the
    few thousand objects a step allocates, walks all of them again: measured 2-3 ms of a 21 ms c=1 decode step on the
    bench preset (23.5 → 20.4 ms median after the checked build; tests/test_memory.py holds the mechanism). Objects
    made inside are collected as usual; garbage among the frozen ones waits until the block ends."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def clear_compiled() -> None:
    """Drop every step executable compiled ahead of time, in every program of this process — what `jax.clear_caches`
    does for JAX's own caches. Each XLA CPU executable maps memory for its code; a process that compiles thousands
    (a test suite, a fuzzer) reaches Linux's vm.max_map_count, after which XLA crashes inside a compile."""
    for buckets in list(_LIVE):
        buckets.clear()


def step_intermediates(graph, sizes: dict[str, int], top: int = 3) -> list[dict]:
    """The `top` largest values one step of `graph` computes (not parameters, inputs or caches) at the bound sizes,
    as op and type with how many times the step makes one (once per layer, typically): the IR's own account of
    where a step's temporaries come from, beside XLA's total."""
    from qcompile.ir.ops.core import Input, Param

    cache_values = {value for name, value in graph.outputs.items() if name in graph.meta.get("caches", ())}
    counts: dict[tuple[str, str], list[int]] = {}
    for node in graph.nodes():
        if isinstance(node.op, (Param, Input)):
            continue
        for value, type_ in zip(node.results, node.types):
            if value in cache_values:  # updated in place (donated), not a temporary
                continue
            try:
                shape = type_.bind(sizes)
            except KeyError:
                continue
            nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(np_dtype(type_.dtype)).itemsize
            entry = counts.setdefault((node.op.op_name, str(type_)), [nbytes, 0])
            entry[1] += 1
    ranked = sorted(counts.items(), key=lambda item: (-item[1][0], item[0]))
    return [{"op": op, "type": type_, "bytes": nbytes, "count": count}
            for (op, type_), (nbytes, count) in ranked[:top]]


def _status() -> dict[str, int]:
    """The VmHWM / VmRSS / RssAnon / RssFile / RssShmem lines of /proc/self/status, in bytes (empty off Linux)."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def peak_rss() -> int:
    """The process's peak resident set in bytes since it started or since `reset_peak`."""
    status = _status()
    if "VmHWM" in status:
        return status["VmHWM"]
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def reset_peak() -> bool:
    """Start a new peak (Linux: `5` into /proc/self/clear_refs); False where the system cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def resident() -> dict[str, int]:
    """The resident set now: total, anonymous (heap, copies) and file-backed (mapped weights, code; files on a
    tmpfs such as /dev/shm count as shared memory, added here)."""
    status = _status()
    return {"total": status.get("VmRSS", 0), "anonymous": status.get("RssAnon", 0),
            "file": status.get("RssFile", 0) + status.get("RssShmem", 0)}


def _file_ranges() -> tuple[list[int], list[int]]:
    """Sorted (starts, ends) of this process's file-backed mappings."""
    starts, ends = [], []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith("/"):
                    low, high = fields[0].split("-")
                    starts.append(int(low, 16))
                    ends.append(int(high, 16))
    except OSError:
        pass
    order = sorted(range(len(starts)), key=starts.__getitem__)
    return [starts[i] for i in order], [ends[i] for i in order]


def weight_bytes(params: dict) -> dict[str, int]:
    """Bytes of the parameter arrays, and how many of them are read in place from a memory-mapped file."""
    starts, ends = _file_ranges()
    total = mapped = 0
    for array in params.values():
        nbytes = int(array.nbytes)
        total += nbytes
        try:
            pointer = array.unsafe_buffer_pointer()
        except (AttributeError, NotImplementedError, RuntimeError, ValueError):
            continue
        index = bisect.bisect_right(starts, pointer) - 1
        if index >= 0 and pointer + nbytes <= ends[index]:
            mapped += nbytes
    return {"bytes": total, "mapped_bytes": mapped}


def cache_kind(name: str) -> str:
    """'kv_pages' or 'gdn_state' for a cache input of the step ABI (ir/abi.py)."""
    return "gdn_state" if name.endswith("_state") else "kv_pages"


def cache_bytes(shapes: dict[str, tuple[tuple[int, ...], object]]) -> dict[str, int]:
    """KV-page and GDN-state bytes of caches given as name -> (shape, dtype)."""
    out = {"kv_pages": 0, "gdn_state": 0}
    for name, (shape, dtype) in shapes.items():
        out[cache_kind(name)] += int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    return out


def gib(n: int | float) -> str:
    return f"{n / 2**30:.2f} GiB"


def parse_size(text: str) -> int:
    """A byte count from `24GiB`, `1.5 GB`, `800MiB`, `512M` or a plain number of bytes; ValueError otherwise."""
    units = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
             "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}
    raw = text.strip().lower().replace(" ", "")
    number = raw.rstrip("kmgtib")
    unit = raw[len(number):]
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (e.g. 16GiB, 800MB)") from None
    if unit not in units or value <= 0:
        raise ValueError(f"not a size: {text!r} (e.g. 16GiB, 800MB)")
    return int(value * units[unit])
