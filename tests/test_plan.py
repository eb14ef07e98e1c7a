"""`qcompile plan`: the example configs plan; per-device bytes equal what JAX actually places on a device; step
times follow the bytes a device must read; bad input is a one-line exit 2."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from conftest import write_small
from qcompile.compiler.plan import PlanOptions, abstract_graph, build_specs, evaluate, run_plan, run_structurally, \
    target_of, touched
from qcompile.ir.mesh import parse_mesh_spec
from qcompile.passes.base import PassContext

EXAMPLES = Path(__file__).parent.parent / "examples" / "configs"
GIB = 2**30


def _plan(source, **kwargs) -> dict:
    kwargs.setdefault("lower", False)  # the export of the planned step: its own test below
    return run_plan(PlanOptions(source=Path(source), **kwargs), emit=lambda text: None, progress=lambda text: None)


def _build(report: dict, passes: str, workload: str, concurrency: int) -> dict:
    """The build planned for `passes` at `concurrency` for `workload` (decode-heavy also matches a custom 1K/8K)."""
    return next(b for b in report["builds"] if b["passes"] == passes and b["concurrency"] == concurrency and (
        b["workload"] == workload or workload == "decode-heavy" and (b["input_len"], b["output_len"]) == (1024, 8192)))


def test_the_flagship_on_a_tpu7x_host():
    """Qwen3.5-397B-A17B (bf16) on 4 TPU7x chips: dp4×tp2 (the KV heads split 2 ways; tp4 is not the size of the
    mesh's inner axis), 101 GiB of weights per device — more than a device's 96 GiB, which is why it is served in
    FP8; on 8 chips it fits."""
    report = _plan(EXAMPLES / "qwen3.5-397b-a17b.json", concurrency=(64,), ablate=False, input_len=1024,
                   output_len=8192)
    assert report["target"]["devices"] == 8 and report["target"]["mesh_spec"] == "4x2"
    full = _build(report, "all", "decode-heavy", 64)
    assert full["plan"] == "dp4xtp2+ep" and not full["memory_per_device"]["fits"]
    weights = full["memory_per_device"]["weights"]
    assert 100 * GIB < full["memory_per_device"]["weights_total"] < 102 * GIB
    assert weights["routed experts"] == 512 * 3 * 1024 * 4096 * 2 * 60 // 8  # bf16 gate, up, down over 8 devices
    assert full["page_size"] == 256 and full["state_slots_per_device"] == 16  # kv-page-resize for tpu; 64 / dp4
    assert full["decode_step"]["collective_bytes"].keys() == {"all-gather", "reduce-scatter", "all-reduce"}
    assert _build(report, "none", "decode-heavy", 64)["plan"] == "single device"
    eight = _plan(EXAMPLES / "qwen3.5-397b-a17b.json", concurrency=(64,), chips=8, ablate=False, input_len=1024,
                  output_len=8192)
    fits = _build(eight, "all", "decode-heavy", 64)
    assert fits["plan"] == "dp8xtp2+ep" and fits["memory_per_device"]["fits"] and fits["max_concurrency_at_context"] > 64


def test_every_single_pass_ablation_is_planned(tmp_path):
    """`all`, `none` and `all` minus each pass, on Qwen3.5-35B-A3B cut to 8 of its 40 layers (planning time is per
    layer); the JSON holds the schema docs/plan.md gives."""
    config = json.loads((EXAMPLES / "qwen3.5-35b-a3b.json").read_text())
    config["text_config"]["num_hidden_layers"] = 8
    config["text_config"]["layer_types"] = config["text_config"]["layer_types"][:8]
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "plan.json"
    report = _plan(tmp_path / "config.json", concurrency=(64,), json=out, input_len=1024, output_len=8192)
    assert json.loads(out.read_text())["builds"][0].keys() == report["builds"][0].keys()
    assert [b["passes"] for b in report["builds"]] == ["none", "all", *(f"all,-{p}" for p in (
        "gqa-sharding", "moe-allgather-rs", "hierarchical-collectives", "swiglu-fusion", "gdn-conv-fusion",
        "bf16-state", "kv-page-resize"))]
    full = _build(report, "all", "decode-heavy", 64)
    # bf16-state halves the state; without gqa-sharding nothing is split; without moe-allgather-rs: all-to-alls
    f32_state = _build(report, "all,-bf16-state", "decode-heavy", 64)["memory_per_device"]["gdn_state"]
    assert 0.48 < full["memory_per_device"]["gdn_state"] / f32_state < 0.52
    assert _build(report, "all,-gqa-sharding", "decode-heavy", 64)["plan"] == "single device"
    a2a = _build(report, "all,-moe-allgather-rs", "decode-heavy", 64)["decode_step"]["collective_bytes"]
    assert set(a2a) == {"all-to-all", "all-reduce"}
    assert _build(report, "all,-kv-page-resize", "decode-heavy", 64)["page_size"] == 16


@pytest.mark.parametrize("name, levels", [("qwen3.5-35b-a3b.json", (64, 512)), ("qwen3-next-80b-a3b.json", (512,))])
def test_the_other_example_configs_plan_and_fit(name, levels):
    report = _plan(EXAMPLES / name, concurrency=levels, ablate=False, input_len=1024, output_len=8192)
    for concurrency in levels:
        build = _build(report, "all", "decode-heavy", concurrency)
        assert build["plan"] == "dp4xtp2+ep" and build["memory_per_device"]["fits"]
        assert build["max_concurrency_at_context"] >= concurrency
    if len(levels) > 1:  # more sequences: more KV per device, more throughput per chip (the weights are shared)
        low, high = (_build(report, "all", "decode-heavy", c) for c in levels)
        assert high["memory_per_device"]["kv_cache"] == 8 * low["memory_per_device"]["kv_cache"]
        assert high["output_tok_s_per_chip"] > 2 * low["output_tok_s_per_chip"]


def test_the_fp8_flagship_fits_a_tpu7x_host():
    """Qwen3.5-397B-A17B in FP8 (weights kept FP8: one byte a weight plus a scale per 128 x 128 block) on 4 TPU7x
    chips: it fits where the bf16 config does not, as dp4xtp2 — tensor parallelism splits the FP8 attention and GDN
    projections (values and block scales; the GDN q|k|v regrouped in FP8), 3.6 GiB per device under dp8."""
    report = _plan(EXAMPLES / "qwen3.5-397b-a17b-fp8.json", concurrency=(64,), ablate=False, input_len=1024,
                   output_len=8192)
    full = _build(report, "all", "decode-heavy", 64)
    assert full["plan"] == "dp4xtp2+ep" and full["memory_per_device"]["fits"]
    assert full["max_concurrency_at_context"] > 64
    weights = full["memory_per_device"]["weights"]
    experts = 512 * 3 * 1024 * 4096 * 60 // 8
    assert experts < weights["routed experts"] < experts * 1.001  # the FP8 values, and scales 1/4096 of them
    assert full["memory_per_device"]["weights_total"] < 55 * GIB  # dp8 (no FP8 tensor parallelism): 56.2 GiB
    assert weights["GDN"] < 2.6 * GIB  # half the FP8 GDN projections; a regrouped q|k|v held in bf16 adds 1.05 GiB
    # the decode step reads the FP8 weights at one byte (the bf16 config's step reads 76.4 GiB per device)
    assert 40 * GIB < full["decode_step"]["bytes"] < 50 * GIB


def test_per_device_bytes_equal_what_jax_places_on_a_device(tmp_path):
    """The plan's weights and KV page bytes per device, computed from the laid-out graph's types, equal the bytes of
    device 0's shards of the arrays an engine actually holds for the same layout (dp4xtp2 on 4x2)."""
    from qcompile.frontend.checkpoint import Checkpoint
    from qcompile.ir.weights import fold_weight_preparation, load_params
    from qcompile.runtime.engine import CacheConfig, Engine

    path = write_small(tmp_path / "ckpt")
    tgt = target_of("tpu7x", 4)
    graph, _, _ = abstract_graph(path)
    graph.meta["mesh"] = parse_mesh_spec(tgt.mesh_spec)
    ctx = PassContext(target="cpu", num_devices=8, options=(("concurrency", 8), ("max_context", 64),
                                                            ("layout", "dp4xtp2")))
    laid_out, _ = run_structurally(graph, "gqa-sharding,swiglu-fusion", ctx)
    planned = evaluate(laid_out, tgt, concurrency=8, input_len=32, output_len=32)
    folded = fold_weight_preparation(laid_out)
    checkpoint = Checkpoint.open(path)
    engine = Engine(folded, load_params(checkpoint, folded, progress=False),
                    CacheConfig(max_seqs=8, max_context=64, max_step_tokens=8))
    device = engine.params[next(iter(engine.params))].sharding.mesh.devices.flat[0]

    def on_device(array) -> int:
        return sum(s.data.nbytes for s in array.addressable_shards if s.device == device)

    assert planned["memory_per_device"]["weights_total"] == sum(on_device(a) for a in engine.params.values())
    pages = {name: a for name, a in engine.caches.items() if name.endswith(("k_pages", "v_pages"))}
    local_pages = engine.sizes["P"] // 4  # the pool split over the 4 data-parallel ranks
    page_bytes = sum(on_device(a) for a in pages.values()) // local_pages
    assert planned["kv_pages_per_device"] * page_bytes == planned["memory_per_device"]["kv_cache"]


def test_the_decode_step_time_follows_the_bytes_a_device_reads():
    """397B decode at 64 on a TPU7x host (dp4xtp2): the step's memory time is what one device must read — the
    experts its tokens touch (uniform routing over its 64 of 512), its share of the other weights, its sequences' KV
    and GDN state — at 3,690 GB/s per device; a device that forgot its shard (×8 experts) or read every expert would
    be far off."""
    report = _plan(EXAMPLES / "qwen3.5-397b-a17b.json", concurrency=(64,), ablate=False, input_len=1024,
                   output_len=8192)
    build = _build(report, "all", "decode-heavy", 64)
    memory = build["memory_per_device"]
    expert = 3 * 1024 * 4096 * 2 * 60  # one expert index over every layer, bf16
    held = 512 // 8
    reached = touched(512, held, 64 * 10)
    embed = 248320 * 4096 * 2  # embedding rows are gathered, not read whole
    expected = (memory["weights_total"] - held * expert + reached * expert - embed
                + memory["kv_cache"] * (1024 + 4096) / (1024 + 8192) + 2 * memory["gdn_state"])
    assert build["decode_step"]["bytes"] == pytest.approx(expected, rel=0.05)
    seconds = build["decode_step"]["bytes"] / report["target"]["memory_bytes_per_s"]
    collectives = sum(build["decode_step"]["collective_bytes"].values()) / report["target"]["interconnect_bytes_per_s"]
    assert build["decode_step"]["seconds"] == pytest.approx(seconds + collectives, rel=1e-6)
    assert 40 < reached < 50 and math.isclose(touched(512, 512, 1e9), 512)


def test_build_specs_and_bad_input(tmp_path, capsys):
    from qcompile.cli import main

    assert build_specs("all", True)[:3] == ["none", "all", "all,-gqa-sharding"]
    assert build_specs("swiglu-fusion", True) == ["none", "swiglu-fusion", "swiglu-fusion,-swiglu-fusion"]
    assert build_specs("all", False) == ["none", "all"]
    config = EXAMPLES / "qwen3.5-35b-a3b.json"
    for argv, message in ((["--target", "gpu"], "Invalid value for '--target'"),
                          (["--concurrency", "0"], "--concurrency levels must be positive"),
                          (["--concurrency", "a"], "comma-separated integers"),
                          (["--concurrency", "1000000000000"], "more than qcompile plans (1048576)"),
                          (["--input-len", "100000000"], "--input-len must be in 1..16777216"),
                          (["--passes", "nope"], "unknown pass"),
                          (["--mesh", "3"], "--mesh 3 has 3 devices"),
                          (["--json", str(tmp_path / "missing" / "p.json")], "--json")):
        with pytest.raises(SystemExit) as done:
            main(["plan", str(config), "--no-ablate", *argv])
        assert done.value.code == 2, argv
        assert message in capsys.readouterr().err, argv
    for source, message in ((tmp_path / "nothing", "no such file"),):  # bad input, as for every command: 65
        with pytest.raises(SystemExit) as done:
            main(["plan", str(source)])
        assert done.value.code == 65 and message in capsys.readouterr().err
    with pytest.raises(SystemExit) as done:
        main(["plan", str(config), "--no-ablate", "--no-lower", "--concurrency", "8", "--input-len", "100",
              "--output-len", "20"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and "| all | custom | 8 | dp4xtp2+ep |" in out and "planned in" in out
    assert "lowered for" not in out


def test_staged_collectives_count_once_per_stage_and_a_cpu_mesh_lowers(tmp_path):
    """hierarchical-collectives runs an all-gather / reduce-scatter over two mesh levels as two collectives: the
    graph's count beside the lowered program's counts each stage (it counted the op, and the lowered program showed
    twice the graph's); and `plan --target cpu --chips 2` asks JAX for its devices before measuring the machine
    (which started JAX with one, so the cpu plan never lowered)."""
    import subprocess
    import sys

    path = write_small(tmp_path / "ckpt")
    staged = _plan(path, target="h200", mesh="2x4", concurrency=(8,), ablate=False, input_len=16, output_len=8,
                   lower=True)["lowered"]
    assert staged["collectives"] == staged["graph_collectives"], staged
    unstaged = _plan(path, target="h200", mesh="2x4", passes="all,-hierarchical-collectives", concurrency=(8,),
                     ablate=False, input_len=16, output_len=8, lower=True)["lowered"]
    assert staged["graph_collectives"]["all-gather"] == 2 * unstaged["graph_collectives"]["all-gather"]
    done = subprocess.run([sys.executable, "-m", "qcompile.cli", "plan", str(path), "--target", "cpu", "--chips", "2",
                           "--concurrency", "4", "--input-len", "8", "--output-len", "4", "--no-ablate"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    line = next(text for text in done.stdout.splitlines() if text.startswith("lowered for cpu"))
    assert "not lowered" not in line and "(the graph's)" in line, line


def test_a_cpu_plan_uses_xla_memory_analysis_where_this_host_can_compile(tmp_path):
    """On the cpu target (one device) the decode step is compiled from abstract arguments and XLA's temporaries
    stand beside the liveness scan; the activation peak is the larger. Other targets have no compiler here."""
    path = write_small(tmp_path / "ckpt")
    report = _plan(path, target="cpu", concurrency=(4,), ablate=False, input_len=16, output_len=8)
    build = _build(report, "all", "custom", 4)
    xla = build["xla_decode_memory"]
    assert xla["tokens"] == 4 and xla["temp_bytes"] > 0 and xla["argument_bytes"] > build["memory_per_device"][
        "weights_total"]  # the arguments are the weights and the caches
    assert build["memory_per_device"]["activation_peak"] >= xla["temp_bytes"]
    tpu = _plan(path, concurrency=(4,), ablate=False, input_len=16, output_len=8)
    assert _build(tpu, "all", "custom", 4)["xla_decode_memory"] is None


def test_the_planned_step_is_lowered_for_the_target(tmp_path):
    """The planned decode step exported for the target's platform from abstract shapes on its mesh (jax.export; no
    compiler for TPU here): for tpu7x every MoE layer's grouped matmul, the GDN layer and the attention layer are
    Mosaic kernels (2 + 1 + 1 on the two-layer checkpoint), and the program's collectives are the graph's, kind by
    kind (what the cost model charged); h200 lowers for cuda without Mosaic kernels; --no-lower skips it."""
    path = write_small(tmp_path / "ckpt")
    said: list[str] = []
    lowered = run_plan(PlanOptions(source=path, concurrency=(4,), ablate=False, input_len=16, output_len=8),
                       emit=said.append, progress=lambda text: None)["lowered"]
    line = next(text for text in said if text.startswith("lowered for tpu"))
    assert "4 Mosaic kernels" in line and "(the graph's)" in line, line
    assert lowered["platform"] == "tpu" and lowered["passes"] == "all" and lowered["tokens"] == 4, lowered
    assert lowered["mosaic_kernels"] == 4
    assert lowered["collectives"] == lowered["graph_collectives"] == {"all-gather": 4, "all-reduce": 6,
                                                                      "reduce-scatter": 2}
    gpu = _plan(path, target="h200", concurrency=(4,), ablate=False, input_len=16, output_len=8, lower=True)
    assert gpu["lowered"]["platform"] == "cuda" and gpu["lowered"]["mosaic_kernels"] == 0
    assert gpu["lowered"]["collectives"] == gpu["lowered"]["graph_collectives"]
    assert "lowered" not in _plan(path, concurrency=(4,), ablate=False, input_len=16, output_len=8)
