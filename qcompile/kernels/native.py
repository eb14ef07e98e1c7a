"""qcompile's native CPU kernels: C++ XLA FFI custom calls, built on first use and registered with JAX.

What: `ensure(name)` makes the custom-call target `name` (a key of `KERNELS`) callable from jitted code on the CPU
platform — compiling its source under qcompile/kernels/native/ with the system C++ compiler into a cache directory
the first time, loading it and calling `jax.ffi.register_ffi_target` once per process — and returns whether it is
available. `status()` says why not. The CPU lowering rules call `ensure` when they are traced, and fall back to their
jnp strategies when it returns False; a CPU artifact that holds a custom call records its name in the manifest, and
loading the artifact calls `ensure` before anything is deserialized.

Why native code: the MoE grouped matmul is most of a decode step, and XLA's CPU emitter cannot read a dynamically
indexed expert slice where it lies (it copies it) or run a few-row dot near the memory bandwidth
(kernels/grouped_matmul.py and docs/cpu_rules.md have the measurements). JAX's own extension mechanism for that is
an FFI custom call; TPU and GPU get Pallas kernels instead.

Build: `$CXX` (default c++, then g++, then clang++) with -O3 -march=native, against jaxlib's FFI headers
(`jax.ffi.include_dir()`) and the shared headers in native/, one library per source file (all its entry points). The
library is cached as `<cache>/<source stem>-<key>.so`, the key hashing the source and those headers, the compiler's
version, the jaxlib version and this CPU's model and instruction-set flags (a -march=native library is never loaded on
another CPU); it is written to a temporary name and renamed, so concurrent builds are safe. Cache directory: `$QCOMPILE_NATIVE_DIR`, else `$XDG_CACHE_HOME/qcompile/native`, else `~/.cache/qcompile/native`.

`QCOMPILE_NATIVE=off` disables every native kernel (the jnp rules run instead; the same compile then exports an
artifact without custom calls, which any CPU can run).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jaxlib

SOURCE_DIR = Path(__file__).with_name("native")

#: custom-call target name -> (source file under native/, exported handler symbol)
KERNELS = {
    "qcompile_grouped_matmul_f32": ("grouped_matmul_f32.cc", "QcompileGroupedMatmulF32"),
    "qcompile_grouped_matmul_swiglu_f32": ("grouped_matmul_f32.cc", "QcompileGroupedMatmulSwigluF32"),
    "qcompile_grouped_matmul_panels_f32": ("grouped_matmul_f32.cc", "QcompileGroupedMatmulPanelsF32"),
    "qcompile_grouped_matmul_swiglu_panels_f32": ("grouped_matmul_f32.cc", "QcompileGroupedMatmulSwigluPanelsF32"),
    "qcompile_grouped_matmul_panels_bf16": ("grouped_matmul_f32.cc", "QcompileGroupedMatmulPanelsBf16"),
    "qcompile_grouped_matmul_panels_bf16_pairs": ("grouped_matmul_f32.cc", "QcompileGroupedMatmulPanelsBf16Pairs"),
    "qcompile_grouped_matmul_swiglu_panels_bf16_pairs": ("grouped_matmul_f32.cc",
                                                         "QcompileGroupedMatmulSwigluPanelsBf16Pairs"),
    "qcompile_grouped_matmul_fp8": ("grouped_matmul_f32.cc", "QcompileGroupedMatmulFp8"),
    "qcompile_grouped_matmul_swiglu_fp8": ("grouped_matmul_f32.cc", "QcompileGroupedMatmulSwigluFp8"),
    "qcompile_grouped_matmul_panels_fp8": ("grouped_matmul_f32.cc", "QcompileGroupedMatmulPanelsFp8"),
    "qcompile_grouped_matmul_swiglu_panels_fp8": ("grouped_matmul_f32.cc", "QcompileGroupedMatmulSwigluPanelsFp8"),
    "qcompile_grouped_matmul_bf16": ("grouped_matmul_f32.cc", "QcompileGroupedMatmulBf16"),
    "qcompile_linear_f32": ("linear_f32.cc", "QcompileLinearF32"),
    "qcompile_linear_fp8": ("linear_f32.cc", "QcompileLinearFp8"),
    "qcompile_linear_panels_f32": ("linear_panels_f32.cc", "QcompileLinearPanelsF32"),
    "qcompile_linear_panels_bf16": ("linear_panels_f32.cc", "QcompileLinearPanelsBf16"),
    "qcompile_linear_panels_fp8": ("linear_panels_f32.cc", "QcompileLinearPanelsFp8"),
    "qcompile_linear_panels_amx": ("amx_bf16.cc", "QcompileLinearPanelsAmx"),
    "qcompile_linear_panels_bf16_pairs": ("linear_panels_f32.cc", "QcompileLinearPanelsBf16Pairs"),
    "qcompile_grouped_matmul_amx": ("amx_bf16.cc", "QcompileGroupedMatmulAmx"),
    "qcompile_grouped_matmul_panels_amx": ("amx_bf16.cc", "QcompileGroupedMatmulPanelsAmx"),
    "qcompile_grouped_matmul_pair_panels_amx": ("amx_bf16.cc", "QcompileGroupedMatmulPairPanelsAmx"),
    "qcompile_grouped_matmul_pair_panels_bf16": ("grouped_matmul_f32.cc", "QcompileGroupedMatmulPairPanelsBf16"),
    "qcompile_grouped_matmul_swiglu_pair_panels_bf16": ("grouped_matmul_f32.cc",
                                                        "QcompileGroupedMatmulSwigluPairPanelsBf16"),
    "qcompile_linear_pair_panels_bf16": ("linear_panels_f32.cc", "QcompileLinearPairPanelsBf16"),
    "qcompile_linear_pair_panels_amx": ("amx_bf16.cc", "QcompileLinearPairPanelsAmx"),
    "qcompile_gdn_recurrent_f32": ("gdn_recurrent_f32.cc", "QcompileGdnRecurrentF32"),
    "qcompile_gdn_recurrent_bf16_state": ("gdn_recurrent_f32.cc", "QcompileGdnRecurrentBf16State"),
    "qcompile_gdn_fused_f32": ("gdn_fused_f32.cc", "QcompileGdnFusedF32"),
    "qcompile_gdn_fused_bf16_state": ("gdn_fused_f32.cc", "QcompileGdnFusedBf16State"),
    "qcompile_gdn_fused_bf16_conv": ("gdn_fused_f32.cc", "QcompileGdnFusedBf16Conv"),
    "qcompile_zero_slot": ("zero_slot.cc", "QcompileZeroSlot"),
    "qcompile_scatter_rows": ("cache_rows.cc", "QcompileScatterRows"),
    "qcompile_kv_gather_f32": ("cache_rows.cc", "QcompileKvGatherF32"),
    "qcompile_paged_decode_attention": ("paged_attention_f32.cc", "QcompilePagedDecodeAttention"),
    "qcompile_moe_dispatch": ("moe_routes.cc", "QcompileMoeDispatch"),
    "qcompile_moe_combine_f32": ("moe_routes.cc", "QcompileMoeCombineF32"),
    "qcompile_moe_combine_bf16": ("moe_routes.cc", "QcompileMoeCombineBf16"),
    "qcompile_token_logprobs_f32": ("token_logprobs.cc", "QcompileTokenLogprobsF32"),
    "qcompile_token_logprobs_bf16": ("token_logprobs.cc", "QcompileTokenLogprobsBf16"),
}

_registered: dict[str, bool] = {}
_why_not: dict[str, str] = {}
_said: set[str] = set()
_libraries: dict[str, ctypes.CDLL] = {}  # source file -> its loaded library
_build_errors: dict[str, Exception] = {}  # source file -> why it could not be built or loaded


def disabled() -> bool:
    return os.environ.get("QCOMPILE_NATIVE", "").strip().lower() in ("off", "0", "no", "false")


def cache_dir() -> Path:
    if os.environ.get("QCOMPILE_NATIVE_DIR"):
        return Path(os.environ["QCOMPILE_NATIVE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "qcompile" / "native"


def _compiler() -> str | None:
    for cand in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if cand and shutil.which(cand):
            return shutil.which(cand)
    return None


def _cpu_identity() -> str:
    """Model name and instruction-set flags: what -march=native compiled for."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        keep = [ln for ln in lines if ln.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part")]
        return "\n".join(sorted(set(keep)))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


def _library_path(source: str, compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    headers = [path.read_text() for path in sorted(SOURCE_DIR.glob("*.h"))]  # shared by every kernel's source
    key = hashlib.sha256("\0".join([(SOURCE_DIR / source).read_text(), *headers, version, jaxlib.__version__,
                                    _cpu_identity()]).encode()).hexdigest()[:16]
    return cache_dir() / f"{Path(source).stem}-{key}.so"


def _build(source: str, compiler: str, lib: Path) -> None:
    lib.parent.mkdir(parents=True, exist_ok=True)
    print(f"qcompile: building the native CPU kernels of {source} (once; cached in {lib.parent})", file=sys.stderr)
    fd, tmp = tempfile.mkstemp(prefix=f".{Path(source).stem}-", suffix=".so", dir=lib.parent)
    os.close(fd)
    try:
        cmd = [compiler, "-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w",
               f"-I{jax.ffi.include_dir()}", f"-I{SOURCE_DIR}", str(SOURCE_DIR / source), "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            lines = done.stderr.strip().splitlines() or ["no output"]
            first_error = next((line for line in lines if "error" in line), lines[-1])
            raise RuntimeError(f"{Path(compiler).name} failed: {first_error.strip()}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _library(source: str, compiler: str):
    """The loaded library of one source file, built first if the cache has none: every entry point in a source comes
    from one build (a source holds up to 14 of them; each took its own ~9 s compile before)."""
    if source in _build_errors:
        raise _build_errors[source]
    if source not in _libraries:
        try:
            lib = _library_path(source, compiler)
            if not lib.is_file():
                _build(source, compiler, lib)
            _libraries[source] = ctypes.cdll.LoadLibrary(str(lib))
        except (OSError, RuntimeError, subprocess.SubprocessError) as err:
            _build_errors[source] = err  # one failed build a process, not one per entry point
            raise
    return _libraries[source]


def ensure(name: str) -> bool:
    """Build (once, cached), load and register the custom call `name` for the CPU platform; False if it cannot be."""
    if name not in KERNELS:
        raise KeyError(f"unknown native kernel {name!r}")
    if disabled():
        _why_not[name] = "disabled by QCOMPILE_NATIVE=off"
        return False
    if name in _registered:
        return _registered[name]
    ok = False
    try:
        compiler = _compiler()
        if compiler is None:
            raise RuntimeError("no C++ compiler found (set CXX, or install g++ or clang++)")
        handle = _library(KERNELS[name][0], compiler)
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(handle, KERNELS[name][1])), platform="cpu")
        ok = True
    except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as err:
        _why_not[name] = str(err) or type(err).__name__
        if _why_not[name] not in _said:  # one line per cause: no compiler is one line, not one per kernel
            _said.add(_why_not[name])
            print(f"qcompile: native CPU kernel {name} unavailable ({_why_not[name]}); using the slower jnp rules",
                  file=sys.stderr)
    _registered[name] = ok
    return ok


def _cpu_flags() -> set[str]:
    """The instruction-set flags /proc/cpuinfo lists (empty where it cannot be read)."""
    try:
        return set(" ".join(ln for ln in Path("/proc/cpuinfo").read_text().splitlines()
                            if ln.startswith("flags")).split())
    except OSError:
        return set()


_amx: list[bool] = []


def amx_bf16() -> bool:
    """Whether this CPU has AMX bf16 tiles and the OS lets this process use them (Linux: arch_prctl
    ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, process-wide, asked once). The AMX kernels are used only then."""
    if not _amx:
        ok = False
        try:
            if {"amx_tile", "amx_bf16"} <= _cpu_flags() and platform.machine() == "x86_64":
                libc = ctypes.CDLL(None, use_errno=True)
                ok = libc.syscall(158, 0x1023, 18) == 0  # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
        except (OSError, AttributeError):
            ok = False
        _amx.append(ok)
    return _amx[0]


_pairs: list[bool] = []


def avx512_bf16() -> bool:
    """Whether this CPU multiplies bf16 pairs into f32 (VDPBF16PS, AVX512_BF16) and the C++ compiler enables it under
    -march=native (it defines __AVX512BF16__; an older compiler may not know the instruction, and the pair kernels
    are then built without it): the bf16 pair kernels are used only then. Asked once."""
    if not _pairs:
        ok = platform.machine() == "x86_64" and "avx512_bf16" in _cpu_flags() and not disabled()
        compiler = _compiler() if ok else None
        if compiler is not None:
            try:
                done = subprocess.run([compiler, "-march=native", "-dM", "-E", "-x", "c++", os.devnull],
                                      capture_output=True, text=True, timeout=60)
                ok = done.returncode == 0 and "__AVX512BF16__" in done.stdout
            except (OSError, subprocess.SubprocessError):
                ok = False
        _pairs.append(bool(ok and compiler is not None))
    return _pairs[0]


def status(name: str) -> str:
    """'available' or why the kernel is not (after `ensure`)."""
    if ensure(name):
        return "available"
    return _why_not.get(name, "unavailable")


def used_by(module_text: str) -> list[str]:
    """The native kernels a lowered/exported module calls (by custom-call target name)."""
    return sorted(name for name in KERNELS if name in module_text)
