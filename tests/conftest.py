"""Shared test setup: tests/ on sys.path (for hf_oracle), JAX on CPU, and session-wide checkpoints and models.

Building and compiling a model costs seconds, so each (family, variant) checkpoint is written once per session and
each loaded model is shared; the engines of one model share its jitted step function, so a shape bucket compiles once.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402

_MODELS: dict = {}


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
