"""Hardware descriptions as data: what a deployment target can hold and move, each figure with its source.

Why: `plan` (will) answer "does this model fit, how many sequences, at what speed" for a machine the user does not
have, and the sharding and page-size passes size caches per device; all of them need the same few published figures —
memory and memory bandwidth, peak matmul rate per dtype, interconnect bandwidth, how many logical devices a chip is —
and must say where each came from. Figures are per chip as published; `per_device` divides by the logical devices a
chip exposes to JAX (a TPU7x chip is two TensorCores, two JAX devices). The CPU has no published figures: its
ceilings are measured in the run that uses them (compiler/measure.py), never stored here.

Peak rates are dense (no structured sparsity). Sources are the vendors' own pages, fetched 2026-12-04.
"""

from __future__ import annotations

import attrs

_TPU7X = "https://docs.cloud.google.com/tpu/docs/tpu7x"
_H200 = "https://www.nvidia.com/en-us/data-center/h200/"


@attrs.frozen
class Hardware:
    name: str
    lowering_target: str  # the lowering table its executables use (ir/registry.py)
    devices_per_chip: int  # logical JAX devices per chip
    chips_per_host: int
    memory_bytes: int  # per chip
    memory_bytes_per_s: float  # per chip
    peak_flops_per_s: dict  # dtype -> dense FLOP/s per chip
    interconnect_bytes_per_s: float  # per chip, both directions, to the other chips of its slice or node
    sources: dict  # field -> where the figure is published, with any derivation

    def per_device(self) -> dict:
        """Memory, bandwidth and peak rates of one logical device (the chip's split evenly)."""
        n = self.devices_per_chip
        return {"memory_bytes": self.memory_bytes // n, "memory_bytes_per_s": self.memory_bytes_per_s / n,
                "peak_flops_per_s": {k: v / n for k, v in self.peak_flops_per_s.items()},
                "interconnect_bytes_per_s": self.interconnect_bytes_per_s / n}

    @property
    def devices_per_host(self) -> int:
        return self.devices_per_chip * self.chips_per_host

    def to_json(self) -> dict:
        return {**attrs.asdict(self), "per_device": self.per_device(), "devices_per_host": self.devices_per_host}


HARDWARE: dict[str, Hardware] = {
    "tpu7x": Hardware(
        name="TPU7x (Ironwood)", lowering_target="tpu", devices_per_chip=2, chips_per_host=4,
        memory_bytes=192 * 2**30, memory_bytes_per_s=7380e9,
        peak_flops_per_s={"bf16": 2307e12, "fp8": 4614e12}, interconnect_bytes_per_s=1200e9,
        sources={"memory_bytes": f"{_TPU7X}: HBM capacity per chip 192 GiB",
                 "memory_bytes_per_s": f"{_TPU7X}: HBM bandwidth per chip 7,380 GBps",
                 "peak_flops_per_s": f"{_TPU7X}: peak compute per chip 2,307 TFLOPs BF16, 4,614 TFLOPs FP8",
                 "interconnect_bytes_per_s": f"{_TPU7X}: bidirectional ICI bandwidth per chip 1,200 GBps",
                 "devices_per_chip": f"{_TPU7X}: two TensorCores per chip, each a JAX device",
                 "chips_per_host": f"{_TPU7X}: a TPU7x VM (host) has four chips"}),
    "h200": Hardware(
        name="NVIDIA H200 (SXM)", lowering_target="gpu", devices_per_chip=1, chips_per_host=8,
        memory_bytes=141 * 10**9, memory_bytes_per_s=4.8e12,
        peak_flops_per_s={"bf16": 989.5e12, "fp8": 1979e12}, interconnect_bytes_per_s=900e9,
        sources={"memory_bytes": f"{_H200}: 141 GB HBM3e",
                 "memory_bytes_per_s": f"{_H200}: 4.8 TB/s",
                 "peak_flops_per_s": f"{_H200}: BF16 Tensor Core 1,979 TFLOPS and FP8 3,958 TFLOPS with sparsity; "
                                     "dense is half",
                 "interconnect_bytes_per_s": f"{_H200}: NVLink 900 GB/s",
                 "devices_per_chip": "one GPU is one JAX device",
                 "chips_per_host": f"{_H200}: HGX H200 boards carry 8 GPUs"}),
}


def hardware(name: str) -> Hardware:
    """The description of `name` (`tpu7x`, `h200`); ValueError naming the known ones otherwise."""
    try:
        return HARDWARE[name]
    except KeyError:
        raise ValueError(f"unknown hardware {name!r}; known: {', '.join(HARDWARE)} (the CPU is measured, not "
                         "described)") from None
