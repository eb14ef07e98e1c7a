"""Importing this package registers every op (catalogue in qcompile.ir.registry)."""

from qcompile.ir.ops import attention, collective, core, expert_parallel, gdn, moe, quant  # noqa: F401
