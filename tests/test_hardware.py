"""Hardware descriptions: every figure has a source that states it, per-device figures split the chip's, and an
unknown name is refused with the known ones."""

from __future__ import annotations

import re

import pytest

from qcompile.ir.hardware import HARDWARE, hardware
from qcompile.ir.registry import LOWERING_TARGETS

FIGURES = ("memory_bytes", "memory_bytes_per_s", "peak_flops_per_s", "interconnect_bytes_per_s", "devices_per_chip",
           "chips_per_host")


def _numbers(text: str) -> set[float]:
    return {float(n.replace(",", "")) for n in re.findall(r"\d[\d,]*(?:\.\d+)?", text)}


@pytest.mark.parametrize("name", sorted(HARDWARE))
def test_every_figure_has_a_source_that_states_it(name):
    hw = HARDWARE[name]
    assert hw.lowering_target in LOWERING_TARGETS
    assert set(hw.sources) == set(FIGURES)
    for field in FIGURES:
        assert hw.sources[field].strip(), f"{name}.{field} has no source"
    stated = {field: _numbers(hw.sources[field]) for field in FIGURES}
    # The stored value, in the unit the source uses, appears in the source's text (dense = sparse / 2 for the GPU).
    assert hw.memory_bytes / 2**30 in stated["memory_bytes"] or hw.memory_bytes / 1e9 in stated["memory_bytes"]
    assert (hw.memory_bytes_per_s / 1e9 in stated["memory_bytes_per_s"]
            or hw.memory_bytes_per_s / 1e12 in stated["memory_bytes_per_s"])
    assert hw.interconnect_bytes_per_s / 1e9 in stated["interconnect_bytes_per_s"]
    for dtype, rate in hw.peak_flops_per_s.items():
        tflops = rate / 1e12
        assert tflops in stated["peak_flops_per_s"] or 2 * tflops in stated["peak_flops_per_s"], (dtype, tflops)


def test_per_device_figures_split_the_chip():
    tpu = hardware("tpu7x")
    device = tpu.per_device()
    assert tpu.devices_per_host == 8  # one TPU7x host: 4 chips x 2 TensorCores, the flagship's 8 logical devices
    assert device["memory_bytes"] == 96 * 2**30
    assert device["peak_flops_per_s"]["fp8"] == 2 * device["peak_flops_per_s"]["bf16"] == 2307e12
    assert hardware("h200").per_device()["memory_bytes"] == 141 * 10**9
    assert tpu.to_json()["per_device"] == device


def test_an_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown hardware 'v4'; known: tpu7x, h200"):
        hardware("v4")
