"""The pass table and the `--passes` SPEC syntax: `all`, `none`, `a,b`, `all,-a` (left to right, last mention wins).

The table is the only place the default pipeline order is written. It is empty until the optimization passes land;
`all` then selects nothing and every command says so rather than pretending to optimise.
"""

from __future__ import annotations

from qcompile.errors import UsageError

PASSES: dict[str, object] = {}


def parse_spec(spec: str) -> list[str]:
    """Selected pass names in pipeline order."""
    selected: dict[str, bool] = {name: False for name in PASSES}
    for raw in (part.strip() for part in spec.split(",")):
        if not raw:
            continue
        if raw in ("all", "none"):
            selected = {name: raw == "all" for name in PASSES}
            continue
        name, on = (raw[1:], False) if raw.startswith("-") else (raw.lstrip("+"), True)
        if name not in PASSES:
            valid = ", ".join(PASSES) or "(no passes are registered yet)"
            raise UsageError(f"unknown pass {name!r} in --passes {spec!r}; valid names: {valid}")
        selected[name] = on
    return [name for name, on in selected.items() if on]
