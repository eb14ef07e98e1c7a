"""What a compiled step's collectives move: each all-gather / reduce-scatter / all-reduce / all-to-all in the
optimized HLO of an XLA executable, with the bytes of its result on one device and the bytes one device sends for it
(a ring algorithm over its replica group). benchmarks/collectives.py reports them; the distribution tests count them.
"""

from __future__ import annotations

import re

_BYTES = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s64": 8, "s32": 4, "u32": 4, "s16": 2, "s8": 1, "u8": 1,
          "pred": 1, "f8e4m3fn": 1, "f8e5m2": 1}
_COLLECTIVE = re.compile(r"=\s*(\(?[a-z0-9]+\[[^\n]*?)\s(all-gather|reduce-scatter|all-reduce|all-to-all)(?:-start)?\("
                         r"([^\n]*)")
_GROUPS = re.compile(r"replica_groups=(?:\[\d+,(\d+)\]|\{\{([0-9,]*)\})")
_SHAPE = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")
#: bytes one device sends per byte of the collective's result, in a group of n (ring algorithms)
SENT_PER_RESULT_BYTE = {"all-gather": lambda n: (n - 1) / n, "reduce-scatter": lambda n: n - 1,
         "all-reduce": lambda n: 2 * (n - 1) / n, "all-to-all": lambda n: (n - 1) / n}


def collective_stats(hlo_text: str) -> dict[str, dict]:
    """kind -> {count, result_bytes, sent_bytes, group, by_group}: the collectives of an optimized HLO module's text
    (an async start/done pair counted once; a tuple-shaped all-to-all, as XLA's CPU backend writes one, counted by
    the bytes of all its elements), per device; `by_group` splits them by replica-group size (a hierarchical
    collective's local and across stages)."""
    found: dict[str, dict] = {}
    for match in _COLLECTIVE.finditer(hlo_text):
        shapes, kind, rest = match.groups()
        groups = _GROUPS.search(rest)
        n = 1
        if groups:
            n = int(groups.group(1)) if groups.group(1) else len(groups.group(2).split(","))
        size = 0
        for dtype, dims in _SHAPE.findall(shapes):
            count = 1
            for d in filter(None, dims.split(",")):
                count *= int(d)
            size += count * _BYTES.get(dtype, 4)
        entry = found.setdefault(kind, {"count": 0, "result_bytes": 0, "sent_bytes": 0, "group": n, "by_group": {}})
        sent = int(size * SENT_PER_RESULT_BYTE[kind](n))
        entry["count"] += 1
        entry["result_bytes"] += size
        entry["sent_bytes"] += sent
        stage = entry["by_group"].setdefault(n, {"count": 0, "result_bytes": 0, "sent_bytes": 0})
        stage["count"] += 1
        stage["result_bytes"] += size
        stage["sent_bytes"] += sent
    return found
