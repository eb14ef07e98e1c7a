"""Time moe_dispatch and moe_combine per MoE layer on CPU: the reference rules (argsort, bincount, row gather;
zero fill and row scatter) against the native kernels of the cpu rules (kernels/moe_routes.py), at the bench preset's
shape (H 1024, 64 experts, top-8) for 1, 32, 256 and 1024 tokens.

Run: python benchmarks/moe_routes_cpu.py [--repeats 20]   (numbers quoted in docs/cpu_rules.md, "moe_dispatch and
moe_combine"). Each call writes a fresh output buffer, so at 1024 tokens the dispatch's 32 MiB of rows include the
page faults a new buffer costs (inside a compiled step XLA reuses its temporaries)."""

from __future__ import annotations

import argparse

import jax
import numpy as np
from timing import best_ms

import qcompile.ir.importer  # noqa: F401  (registers the op catalogue)
from qcompile.ir.ops.moe import MoeCombine, MoeDispatch
from qcompile.ir.registry import lowering_rule

EXPERTS, HIDDEN, TOP_K = 64, 1024, 8


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    dispatch, combine = MoeDispatch(EXPERTS), MoeCombine()
    print("| tokens (routes) | dispatch reference | dispatch cpu | combine reference | combine cpu |")
    print("|---|---|---|---|---|")
    for tokens in (1, 32, 256, 1024):
        x = rng.standard_normal((tokens, HIDDEN)).astype(np.float32)
        ids = np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(tokens)]).astype(np.int32)
        weights = rng.uniform(0.05, 1.0, (tokens, TOP_K)).astype(np.float32)
        cells = []
        for op_, operands in ((dispatch, (x, ids)), (combine, None)):
            for target in ("reference", "cpu"):
                fn = jax.jit(lambda *a, op_=op_, target=target: lowering_rule(type(op_), target)(op_, *a))
                if operands is None:  # combine reads what dispatch left: rows sorted by expert and their order
                    rows, _, order = jax.jit(lambda x, i: lowering_rule(MoeDispatch, "cpu")(dispatch, x, i))(x, ids)
                    operands = (rows, order, weights)
                cells.append(f"{best_ms(fn, *operands, repeats=args.repeats):.3f} ms")
        print(f"| {tokens} ({tokens * TOP_K}) | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
