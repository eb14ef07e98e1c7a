"""Importing this package registers every op (catalogue in qcompile.ir.registry)."""

from qcompile.ir.ops import attention, core, gdn, moe  # noqa: F401
