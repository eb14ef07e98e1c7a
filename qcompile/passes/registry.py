"""The pass table and the `--passes` SPEC syntax: `all`, `none`, `a,b`, `all,-a` (left to right, last mention wins).

PASSES is the only place the default pipeline order is written: sharding first, then collective rewrites, then
fusions, then dtype changes, then cache layout (design.md §4). Passes land one by one (see `qcompile passes`); while
the table was empty, `all` selected nothing and every command said so. Tests also exercise the machinery with passes
of their own through the `table` arguments.
"""

from __future__ import annotations

from qcompile.errors import UsageError
from qcompile.passes.base import Pass
from qcompile.passes.bf16_state import BF16_STATE
from qcompile.passes.gdn_conv_fusion import GDN_CONV_FUSION
from qcompile.passes.gqa_sharding import GQA_SHARDING
from qcompile.passes.hierarchical_collectives import HIERARCHICAL_COLLECTIVES
from qcompile.passes.kv_page_resize import KV_PAGE_RESIZE
from qcompile.passes.moe_allgather_rs import MOE_ALLGATHER_RS
from qcompile.passes.swiglu_fusion import SWIGLU_FUSION

PASSES: dict[str, Pass] = {p.name: p for p in (GQA_SHARDING, MOE_ALLGATHER_RS, HIERARCHICAL_COLLECTIVES, SWIGLU_FUSION,
                                               GDN_CONV_FUSION, BF16_STATE, KV_PAGE_RESIZE)}


def parse_spec(spec: str, table: dict[str, Pass] | None = None) -> list[Pass]:
    """Selected passes, in pipeline (table) order."""
    table = PASSES if table is None else table
    selected = {name: False for name in table}
    if not spec.strip():
        raise UsageError("--passes SPEC is empty; give all, none, a,b or all,-a (see `qcompile passes`)")
    for raw in (part.strip() for part in spec.split(",")):
        if raw in ("", "-", "+"):
            raise UsageError(f"--passes {spec!r} has an empty element; separate pass names with single commas")
        if raw in ("all", "none"):
            selected = {name: raw == "all" and table[name].in_all for name in table}
            continue
        name, on = (raw[1:], False) if raw.startswith("-") else (raw.lstrip("+"), True)
        if name not in table:
            valid = ", ".join(table) or "(no passes are registered yet)"
            raise UsageError(f"unknown pass {name!r} in --passes {spec!r}; valid names: {valid}")
        selected[name] = on
    return [table[name] for name, on in selected.items() if on]


def spec_of(passes: list[Pass]) -> str:
    """The canonical SPEC text that selects exactly these passes."""
    return ",".join(p.name for p in passes) or "none"
