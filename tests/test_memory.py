"""Memory: the runtime holds the weights once — used in place from the mapped artifact (or checkpoint) where they lie
aligned, copied once with their mapped pages dropped where not — and reports where its memory goes: peak resident
set, weights, KV pages and GDN state, XLA's temporaries per compiled bucket. `--memory-budget` refuses a cache
configuration that would not fit; a step's temporaries follow the batch, not the number of experts; and the peak
resident set of `qcompile run` stays within 1.3 × (weights + caches) + the fixed overhead of JAX and XLA
(docs/benchmarks.md, "Memory"), measured with getrusage on a moderately sized checkpoint.
"""

from __future__ import annotations

import attrs

import copy
import json
import mmap
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from qcompile.frontend.safetensors_io import DATA_ALIGN, SafetensorsFile, aligned_order, write_safetensors
from qcompile.frontend.tiny import full_config, write_checkpoint
from qcompile.ir.abi import CacheConfig
from qcompile.ir.weights import to_device
from qcompile.runtime.artifact import load_artifact
from qcompile.runtime.memory import cache_bytes, parse_size, resident, weight_bytes
from qcompile.runtime.model import load_model
from test_cli import cli

#: The fixed overhead of a qcompile process beside its weights and caches: the Python interpreter, JAX, XLA, the
#: compiled executables. Measured: 0.39-0.41 GiB for the 3 MB tiny model (run --json, peak resident set).
FIXED_OVERHEAD = 512 << 20
ARTIFACT_SIZES = ("--max-seqs", "2", "--max-context", "64", "--max-step-tokens", "16")
PROMPT = "5,17,300,42,7,9,11,13"


def _mid_config() -> dict:
    """The bench preset's widths (H 1024, 8/2 heads of 128, GDN 4/8 heads of 128, I 256) with 4 layers, 16 experts
    and a vocabulary of 8000: 0.3 GB of f32 weights, large enough beside the fixed overhead that holding them twice
    breaks the bound."""
    config = copy.deepcopy(full_config("bench", "qwen3_5_moe", "f32"))
    config["text_config"].update(num_hidden_layers=4, num_experts=16, vocab_size=8000,
                                 layer_types=["linear_attention"] * 3 + ["full_attention"])
    return config


@pytest.fixture(scope="module")
def mid(tmp_path_factory) -> tuple[Path, Path]:
    """(checkpoint, artifact compiled from it with --passes all)."""
    root = tmp_path_factory.mktemp("memory")
    checkpoint = write_checkpoint(root / "ckpt", _mid_config(), seed=3)
    artifact = root / "art"
    done = subprocess.run([sys.executable, "-m", "qcompile.cli", str(checkpoint), "--passes", "all", "--verify", "none",
                           "-o", str(artifact), *ARTIFACT_SIZES], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return checkpoint, artifact


def _run_measured(source: Path, *extra: str) -> tuple[dict, int]:
    """(the JSON of `qcompile run SOURCE --json`, the peak resident bytes of that process by getrusage), from a
    wrapper process so that no other child of the test process counts."""
    probe = ("import resource, subprocess, sys; p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
             "sys.stderr.write(p.stderr); sys.stdout.write(p.stdout); "
             "print(p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    argv = [sys.executable, "-m", "qcompile.cli", "run", str(source), "--prompt-ids", PROMPT, "--max-new-tokens", "4",
            "--ignore-eos", "--json", *extra]
    done = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=600)
    *lines, last = done.stdout.strip().splitlines()
    code, kib = last.split()
    assert int(code) == 0, done.stderr[-2000:]
    return json.loads(lines[-1]), int(kib) * 1024


# -- weights held once ---------------------------------------------------------------------------------------------


def test_to_device_uses_an_aligned_mapped_buffer_in_place_and_copies_a_misaligned_one(tmp_path):
    path = tmp_path / "blob"
    values = np.arange(4096, dtype=np.float32)
    path.write_bytes(b"\0" * 64 + values.tobytes() + b"\0" * 8)
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    aligned = np.frombuffer(mapped, np.float32, count=4096, offset=64)
    misaligned = np.frombuffer(mapped, np.float32, count=4096, offset=8)
    array, aliased = to_device(aligned)
    assert aliased and array.unsafe_buffer_pointer() == aligned.ctypes.data
    np.testing.assert_array_equal(np.asarray(array), values)
    copied, aliased = to_device(misaligned)
    assert not aliased and copied.unsafe_buffer_pointer() != misaligned.ctypes.data
    np.testing.assert_array_equal(np.asarray(copied)[14:], values[:-14])  # 56 bytes before the values
    assert weight_bytes({"a": array, "b": copied}) == {"bytes": 2 * values.nbytes, "mapped_bytes": values.nbytes}


def test_written_files_start_their_data_on_a_64_byte_boundary_and_aligned_order_keeps_sized_tensors_aligned(tmp_path):
    specs = {"odd": (np.dtype(np.float32), (3,)), "big": (np.dtype(np.float32), (64, 16)),
             "bias": (np.dtype(np.float32), (5,)), "w": (np.dtype(np.float32), (16, 16))}
    ordered = aligned_order(specs)
    assert list(ordered) == ["big", "w", "odd", "bias"]
    path = tmp_path / "x.safetensors"
    write_safetensors(path, {name: np.ones(shape, dtype) for name, (dtype, shape) in ordered.items()})
    file = SafetensorsFile(path)
    assert [file.tensors[name].begin % DATA_ALIGN for name in ("big", "w", "odd")] == [0, 0, 0]


def test_an_artifact_is_used_in_place_and_a_checkpoint_copy_drops_its_pages(mid):
    checkpoint, artifact = mid
    weights = SafetensorsFile(artifact / "weights.safetensors")
    sized = [info for info in weights.tensors.values() if info.nbytes % DATA_ALIGN == 0]
    assert sized and all(info.begin % DATA_ALIGN == 0 for info in sized)
    art = load_artifact(artifact)
    held = weight_bytes(art.params)
    assert held["bytes"] == sum(info.nbytes for info in weights.tensors.values())
    assert held["mapped_bytes"] >= 0.999 * held["bytes"]  # all but a few odd-sized vectors
    # A bf16 model of an f32 checkpoint casts every tensor: nothing is used in place, everything is a copy, and the
    # checkpoint pages each copy was read from are dropped — the file-backed resident set does not grow by the
    # checkpoint's size: measured +36 MB here (code pages of the first bf16 compile; +1.5 MB on a second load), and
    # +341 MB with the page release disabled.
    size = (checkpoint / "model.safetensors").stat().st_size
    before = resident()["file"]
    model = load_model(checkpoint, "bf16", progress=False)
    assert weight_bytes(model.params)["mapped_bytes"] == 0
    assert resident()["file"] - before < 0.25 * size


# -- the report ----------------------------------------------------------------------------------------------------


def _expected_cache_bytes(config: dict, cache: CacheConfig, page_size: int) -> dict:
    text = config["text_config"]
    full = text["layer_types"].count("full_attention")
    gdn = len(text["layer_types"]) - full
    pages = cache.pool_pages(page_size)
    kv = 2 * full * pages * page_size * text["num_key_value_heads"] * text["head_dim"] * 4
    conv_dim = 2 * text["linear_num_key_heads"] * text["linear_key_head_dim"] + \
        text["linear_num_value_heads"] * text["linear_value_head_dim"]
    state = gdn * cache.max_seqs * text["linear_num_value_heads"] * text["linear_key_head_dim"] * \
        text["linear_value_head_dim"]
    conv = gdn * cache.max_seqs * conv_dim * (text["linear_conv_kernel_dim"] - 1)
    return {"kv_pages": kv, "gdn_state_elements": state + conv}


def test_run_json_reports_the_split_and_the_peak_stays_within_the_bound(mid):
    checkpoint, artifact = mid
    config = json.loads((checkpoint / "config.json").read_text())
    manifest = json.loads((artifact / "manifest.json").read_text())
    reports = {}
    for source, extra in ((artifact, ("--memory-budget", "64GiB")), (checkpoint, ())):
        report, peak = _run_measured(source, *extra)
        memory = reports[source.name] = report["memory"]
        weights, caches = memory["weights"]["bytes"], sum(memory["caches"].values())
        bound = 1.3 * (weights + caches) + FIXED_OVERHEAD
        assert peak <= bound, f"{source.name}: peak {peak / 2**30:.2f} GiB over {bound / 2**30:.2f} GiB"
        assert abs(memory["peak_rss_bytes"] - peak) <= 0.05 * peak  # the report's peak is the process's
        assert memory["temporaries"]["largest_bytes"] > 0
        assert memory["temporaries"]["largest_bucket"] in memory["temporaries"]["buckets"]
        assert memory["temporaries"]["largest_values"][0]["bytes"] > 0
        assert 0.3e9 < weights < 0.4e9
    # The artifact's caches: exactly its cache configuration's KV pages, and its GDN states (conv and recurrent) in
    # bf16 (--passes all): two bytes per element.
    art = reports[artifact.name]
    expected = _expected_cache_bytes(config, CacheConfig.from_json(manifest["cache"]), manifest["page_size"])
    assert art["caches"]["kv_pages"] == expected["kv_pages"]
    assert art["caches"]["gdn_state"] == 2 * expected["gdn_state_elements"]
    assert art["weights"]["mapped_bytes"] >= 0.999 * art["weights"]["bytes"]


def test_cache_bytes_are_split_by_kind():
    shapes = {"layers.0.k_pages": ((4, 16, 2, 8), np.float32), "layers.0.v_pages": ((4, 16, 2, 8), np.float32),
              "layers.1.conv_state": ((2, 10, 3), jax.numpy.bfloat16),
              "layers.1.recurrent_state": ((2, 4, 8, 8), np.float32)}
    assert cache_bytes(shapes) == {"kv_pages": 2 * 4 * 16 * 2 * 8 * 4, "gdn_state": 2 * 10 * 3 * 2 + 2 * 4 * 8 * 8 * 4}


# -- budget --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, value", [("16GiB", 16 << 30), ("800MB", 800_000_000), ("1.5 GiB", 3 << 29),
                                         ("512M", 512_000_000), ("1048576", 1 << 20)])
def test_sizes_parse(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["lots", "-1GiB", "0", "12 parsecs", ""])
def test_bad_sizes_are_refused(text):
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)


def test_a_budget_too_small_is_refused_before_the_caches_exist(mid, capsys):
    _, artifact = mid
    code, out, err = cli(capsys, "run", artifact, "--prompt-ids", PROMPT, "--max-new-tokens", 2,
                         "--memory-budget", "200MB")
    assert code == 2 and not out
    assert len(err.strip().splitlines()) == 1
    assert "over --memory-budget 0.19 GiB" in err and "weights 0.33 GiB" in err and "KV pages" in err
    assert "the weights and the runtime alone need" in err
    code, _, err = cli(capsys, "run", artifact, "--prompt-ids", PROMPT, "--memory-budget", "lots")
    assert code == 2 and "not a size" in err


def test_a_budget_that_fits_the_weights_but_not_the_caches_fits_the_pool_or_says_to_serve_fewer(tmp_path, monkeypatch):
    from conftest import write_small
    from qcompile.errors import UsageError
    from qcompile.runtime import engine as engine_module

    # The process's own memory, measured at the check, is held still so the arithmetic is exact.
    monkeypatch.setattr(engine_module, "resident", lambda: {"total": 300 << 20, "anonymous": 0, "file": 0})
    model = load_model(write_small(tmp_path / "small"), progress=False)
    large = CacheConfig(max_seqs=8, max_context=16384, max_step_tokens=16)  # 128 MiB of KV pages
    estimate = model.engine(large, memory_budget=1 << 40).check_memory_budget(1 << 40)
    assert estimate["kv_pages"] == 128 << 20
    assert estimate["needed_bytes"] == sum(estimate[k] for k in ("weights_bytes", "kv_pages", "gdn_state",
                                                                 "temporaries_bytes", "runtime_bytes"))
    exact = model.engine(large, memory_budget=estimate["needed_bytes"])  # exactly enough is enough
    assert exact.caches and exact.sizes["P"] == 8 * 1024 and exact.pool_note is None
    # with the pool size given (--num-pages), a budget 64 MiB short is refused ...
    with pytest.raises(UsageError, match="serve fewer or shorter sequences"):
        model.engine(attrs.evolve(large, num_pages=8 * 1024), memory_budget=estimate["needed_bytes"] - (64 << 20))
    # ... without it the pool is fitted to the budget: the 64 MiB short are 4096 of the 8192 16 KiB pages, so 4
    # sequences fit at full length, more when shorter (the scheduler preempts when pages run out)
    fitted = model.engine(large, memory_budget=estimate["needed_bytes"] - (64 << 20))
    assert fitted.sizes["P"] == 4096 and len(fitted.free_pages) == 4096 and fitted.cache_cfg.max_seqs == 8
    assert "4096 KV pages" in fitted.pool_note and "4 sequences at full length" in fitted.pool_note
    # less than one full-length sequence's pages is still refused
    with pytest.raises(UsageError, match="serve fewer or shorter sequences"):
        model.engine(large, memory_budget=estimate["needed_bytes"] - (128 << 20) + (8 << 20))


# -- temporaries ---------------------------------------------------------------------------------------------------


def _temporaries(experts: int, token_counts: tuple[int, ...], tmp_path: Path) -> list[int]:
    """XLA's temporaries of the largest step of a one-layer tiny MoE model with `experts` experts, per step size."""
    config = copy.deepcopy(full_config("tiny", "qwen3_5_moe", "f32"))
    config["text_config"].update(num_experts=experts, num_hidden_layers=1, layer_types=["full_attention"])
    model = load_model(write_checkpoint(tmp_path / f"e{experts}", config, seed=1), progress=False)
    return [model.engine(CacheConfig(max_seqs=2, max_context=64, max_step_tokens=tokens))
            .check_memory_budget(1 << 40)["temporaries_bytes"] for tokens in token_counts]


def test_a_steps_temporaries_follow_the_batch_not_the_number_of_experts(tmp_path):
    """Eight times the experts leaves a step's temporaries within 25%, while sixteen times the tokens grows them.
    Measured with the cpu rules: 573,080 → 573,272 bytes; with the reference rules, whose `jax.lax.ragged_dot`
    expands its operand per expert on CPU: 4.9 → 7.5 MB, which this bound refuses."""
    small, few = _temporaries(8, (4, 64), tmp_path)
    (many,) = _temporaries(64, (64,), tmp_path)
    assert many <= 1.25 * few, (few, many)
    assert small < few


def test_serving_runs_with_the_loaded_heap_frozen_and_collects_what_it_makes(monkeypatch):
    """frozen_heap: the objects alive on entry are out of the collector's walks (a full collection over a loaded,
    checked model's millions of objects cost 2-3 ms of a 21 ms decode step), cyclic garbage made inside is still
    collected, and leaving unfreezes. bench times qcompile's waves and transformers' inside it, after their untimed
    warm-ups, so both are measured under the same conditions (the rate mode, `run` and `serve` use the same context
    manager; not exercised here)."""
    import gc
    import weakref

    from qcompile.compiler import measure
    from qcompile.runtime.memory import frozen_heap

    class Node:
        pass

    assert gc.get_freeze_count() == 0
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        cycle = Node()
        cycle.self = cycle
        alive = weakref.ref(cycle)
        del cycle
        gc.collect()
        assert alive() is None  # made inside: collected
    assert gc.get_freeze_count() == 0

    frozen_during: list[tuple[bool, int]] = []
    monkeypatch.setattr(measure, "_serve_wave", lambda engine, prompts, output_len, m, *rest:
                        frozen_during.append((m is not None, gc.get_freeze_count())))
    measure.bench_engine(None, "qcompile", "all", [[1, 2]] * 4, 3, 2, None, None, "cpu", lambda: None)
    assert frozen_during[0] == (False, 0)  # the warm-up compiles: not frozen
    assert len(frozen_during) == 3 and all(timed and count > 0 for timed, count in frozen_during[1:])
    assert gc.get_freeze_count() == 0

    import torch

    class Model:  # transformers' call signature: logits for the last position, a cache object passed back
        def __call__(self, input_ids, use_cache, cache=None):
            calls.append(gc.get_freeze_count())
            return type("Out", (), {"logits": torch.zeros(input_ids.shape[0], 1, 8), "past_key_values": None})()

    calls: list[int] = []
    measure.bench_transformers(None, "f32", [[1, 2]] * 4, 3, 2, None, {}, lambda: None, model=Model())
    warm = 3  # the warm-up wave: its prefill and two decode steps (min(output_len, 3) tokens)
    assert calls[:warm] == [0] * warm and len(calls) == warm + 2 * 3 and all(c > 0 for c in calls[warm:])
    assert gc.get_freeze_count() == 0
