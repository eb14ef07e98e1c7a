"""qcompile: a staged, numerically checked optimization-pipeline compiler for Qwen3.5-MoE / Qwen3-Next models."""

__version__ = "0.1.0"
