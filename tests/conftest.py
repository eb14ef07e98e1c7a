"""Shared test setup: tests/ on sys.path (for hf_oracle), JAX on CPU, and session-wide checkpoints and models.

Building and compiling a model costs seconds, so each (family, variant) checkpoint is written once per session and
each loaded model is shared; the engines of one model share its jitted step function, so a shape bucket compiles once.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Artifacts turn on JAX's persistent compilation cache; the suite keeps it off (tests/test_artifact.py turns it on in
# subprocesses of its own) so that no test writes under the user's home.
os.environ.setdefault("QCOMPILE_CACHE_DIR", "off")
# One XLA compilation cache for the session instead: a fresh temporary directory (removed at exit) that subprocesses
# share through the environment. The suite compiles the same tiny step programs in many tests; a hit loads the
# executable XLA compiled before (keyed by the program, the compile options and the platform) — about a third of the
# suite's time — and changes nothing that runs.
_XLA_CACHE = tempfile.mkdtemp(prefix="qcompile-test-xla-")
atexit.register(shutil.rmtree, _XLA_CACHE, True)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _XLA_CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# XLA's backend (LLVM) optimisation off for the suite's programs, which are tiny and run a few times each: compiling
# is most of the suite's time, and LLVM's optimisation a quarter of it (measured: tests/test_gqa_sharding.py,
# test_swiglu_fusion.py and test_sampling.py 146 s -> 110 s). The optimised HLO — fusion, layouts, buffer assignment,
# what the HLO-reading tests inspect — is the same text at either level (checked on the tiny step); only the machine
# code of each fusion is less optimised. QCOMPILE_TEST_XLA_OPT=default compiles as users do (the slow tier's command
# in the README sets it), and subprocesses inherit the choice through the environment.
if os.environ.get("QCOMPILE_TEST_XLA_OPT", "0") != "default":
    os.environ["XLA_FLAGS"] = " ".join(
        filter(None, [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0"]))
sys.path.insert(0, str(Path(__file__).parent))

import jax  # noqa: E402
import pytest  # noqa: E402
from strategies import FRESH_SEED  # noqa: E402

# pytest-xdist's workers start after this module ran in the controller and inherit its environment: they draw the
# fresh random configs from the seed the header shows.
os.environ.setdefault("QCOMPILE_PASS_SEED", str(FRESH_SEED))

# 8 CPU devices for the whole suite, fixed before JAX starts: the distribution tests lay models out on meshes of up
# to 8 devices in-process; everything else runs on device 0 as before.
jax.config.update("jax_num_cpu_devices", 8)

_MODELS: dict = {}


def pytest_report_header(config):
    return f"fresh random configs (pass properties) from QCOMPILE_PASS_SEED={FRESH_SEED}"


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """hf_checkpoint(family, variant="default", **kwargs) -> path of a transformers-made tiny checkpoint (cached)."""
    import hf_oracle

    made: dict = {}

    def make(family: str, variant: str = "default", **kwargs) -> Path:
        key = (family, variant)
        if key not in made:
            out = tmp_path_factory.mktemp(f"{family}-{variant}")
            made[key] = hf_oracle.make_hf_checkpoint(out, family, **kwargs)
        return made[key]

    return make


@pytest.fixture(scope="session")
def qc_model():
    """qc_model(path, dtype=None) -> LoadedModel, cached per (path, dtype) for the whole session."""
    from qcompile.runtime.model import load_model

    def load(path, dtype=None, **kwargs):
        key = (str(path), dtype, tuple(sorted(kwargs.items())))
        if key not in _MODELS:
            _MODELS[key] = load_model(path, dtype, progress=False, **kwargs)
        return _MODELS[key]

    return load


def write_small(path, family: str = "qwen3_5_moe", seed: int = 0, layer_types=("linear_attention", "full_attention")):
    """A tiny checkpoint with fewer layers (default: one GDN, one attention): half the compile time of the 4-layer one,
    for tests of the pass machinery rather than of the model."""
    import copy

    from qcompile.frontend.tiny import full_config, write_checkpoint

    config = copy.deepcopy(full_config("tiny", family, "f32"))
    text = config["text_config"] if family == "qwen3_5_moe" else config
    text["num_hidden_layers"] = len(layer_types)
    text["layer_types"] = list(layer_types)
    return write_checkpoint(path, config, seed=seed)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A small qwen3_5_moe checkpoint (8 experts: they split over the suite's 8 devices), its step graph and
    parameters, made once per module (the distribution tests)."""
    from qcompile.frontend.checkpoint import Checkpoint
    from qcompile.ir.importer import build_graph
    from qcompile.ir.weights import load_params

    checkpoint = Checkpoint.open(write_small(tmp_path_factory.mktemp("small") / "ckpt"))
    graph = build_graph(checkpoint, None, 16)
    return checkpoint, graph, load_params(checkpoint, graph, progress=False)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_executables():
    """Drop JAX's compiled executables after each test module.

    Every XLA CPU executable maps memory for its code; one process running the whole suite compiles thousands and
    reached Linux's default limit of 65,530 mappings (vm.max_map_count), after which XLA crashed inside a compile
    (SIGSEGV / SIGABRT). Clearing the caches unmaps them; later modules recompile what they use.
    """
    yield
    import gc

    import jax

    from qcompile.runtime.memory import clear_compiled

    jax.clear_caches()
    clear_compiled()
    gc.collect()


#: The longest test file (its fresh random configs per pass take ~3 minutes): run first, so that in the README's two
#: pytest-xdist workers (a file per worker at a time, in collection order) the other worker takes the rest meanwhile
#: instead of both waiting on it at the end (14:23 with it last).
LONGEST_FIRST = ("test_pass_properties.py",)


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=lambda item: item.path.name not in LONGEST_FIRST)  # stable: the rest keep their order
