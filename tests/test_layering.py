"""The package layering (docs/architecture.md): frontend, kernels ← ir ← passes, runtime ← compiler ← cli.

Every `import qcompile.X` / `from qcompile.X import` in the package, at module level or inside a function, must point
to the same layer or one below. `qcompile.errors` and the package root are usable from every layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import qcompile

ROOT = Path(qcompile.__file__).parent
#: package -> the packages it may import (besides itself and the shared leaves).
ALLOWED = {
    "frontend": set(),
    "kernels": set(),
    "ir": {"frontend", "kernels"},
    "passes": {"frontend", "kernels", "ir"},
    "runtime": {"frontend", "kernels", "ir"},
    "compiler": {"frontend", "kernels", "ir", "passes", "runtime"},
    "cli": {"frontend", "kernels", "ir", "passes", "runtime", "compiler"},
}
SHARED = {"errors", ""}


def layer_of(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def imported_layers(path: Path) -> set[tuple[str, int]]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "qcompile":
                found.add((parts[1] if len(parts) > 1 else "", node.lineno))
    return found


def violations() -> list[str]:
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        layer = layer_of(path)
        if layer in SHARED or layer == "__init__":
            continue
        assert layer in ALLOWED, f"{path}: module outside the known layers; add it to ALLOWED and the docs"
        for target, line in imported_layers(path):
            if target in SHARED or target == layer or target == "__init__":
                continue
            if target not in ALLOWED[layer]:
                bad.append(f"{path.relative_to(ROOT.parent)}:{line} ({layer}) imports qcompile.{target}")
    return bad


def test_no_import_points_back_up():
    assert violations() == []


def test_the_check_sees_a_back_edge(tmp_path, monkeypatch):
    """The test can fail: an ir module importing the runtime is reported with its file and line."""
    fake = tmp_path / "qcompile"
    (fake / "ir").mkdir(parents=True)
    (fake / "ir" / "bad.py").write_text("import json\n\ndef f():\n    from qcompile.runtime.engine import Engine\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", fake)
    assert violations() == ["qcompile/ir/bad.py:4 (ir) imports qcompile.runtime"]
