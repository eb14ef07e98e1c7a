"""The pass pipeline through the command line, with the toy passes registered in place of the real table."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import toy_passes
from qcompile.passes import registry
from test_cli import cli

TABLE = {**toy_passes.GOOD, **toy_passes.BROKEN}


@pytest.fixture()
def toy_registry(monkeypatch):
    monkeypatch.setattr(registry, "PASSES", dict(TABLE))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from conftest import write_small

    return write_small(tmp_path_factory.mktemp("pipe") / "m", family="qwen3_next", seed=6,
                       layer_types=("linear_attention", "full_attention", "linear_attention"))


def test_passes_command_lists_the_table(toy_registry, capsys):
    code, out, _ = cli(capsys, "passes")
    assert code == 0
    lines = out.strip().splitlines()
    assert lines[0].split()[:4] == ["pass", "in", "all", "tolerance"]
    swap = next(line for line in lines if line.startswith("swap-add"))
    assert "yes" in swap and "exact" in swap and "Swap add operands" in swap
    assert "2+ devices" in next(line for line in lines if line.startswith("needs-devices"))


def test_passes_command_lists_the_real_passes(capsys):
    code, out, _ = cli(capsys, "passes")
    line = next(line for line in out.splitlines() if line.startswith("swiglu-fusion"))
    assert code == 0 and "yes" in line and "reassociating" in line and "SwiGLU MLPs" in line


def test_passes_command_with_no_registered_passes(capsys, monkeypatch):
    monkeypatch.setattr(registry, "PASSES", {})
    code, out, _ = cli(capsys, "passes")
    assert code == 0 and "no passes are registered yet" in out


def test_compile_prints_one_line_per_pass_and_reports_them(toy_registry, ckpt, capsys, tmp_path):
    code, out, err = cli(capsys, "--passes", "swap-add,split-linear,needs-devices", ckpt, "--report",
                         tmp_path / "r.json")
    assert code == 0, err
    lines = out.splitlines()
    swap = next(line for line in lines if line.strip().startswith("swap-add"))
    assert "applied" in swap and "swapped=" in swap and "max error 0.00e+00" in swap and swap.endswith("s")
    assert "skipped   needs 2+ devices, have 1" in out
    assert "optimized (cpu rules) vs reference" in out and " ok " in out
    report = json.loads((tmp_path / "r.json").read_text())
    records = {r["name"]: r for r in report["passes"]["passes"]}
    assert records["swap-add"]["status"] == "applied" and records["swap-add"]["check"]["max_error"] == 0.0
    assert records["split-linear"]["check"]["max_error"] <= 1e-5
    assert records["needs-devices"]["status"] == "skipped"
    assert report["passes"]["final_check"]["ok"] and report["passes"]["verify"] == "each"


def test_spec_subtraction_and_verify_modes(toy_registry, ckpt, capsys, tmp_path):
    code, out, _ = cli(capsys, "--passes", "all,-split-linear,-crash,-liar,-wrong-types,-loosen-eps", ckpt,
                       "--verify", "final", "--report", tmp_path / "r.json")
    assert code == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["passes"]["selected"] == ["swap-add", "needs-devices"]
    assert all(r["check"] is None for r in report["passes"]["passes"]) and report["passes"]["final_check"]["ok"]
    code, _, _ = cli(capsys, "--passes", "swap-add", ckpt, "--verify", "none", "--report", tmp_path / "n.json")
    assert code == 0 and json.loads((tmp_path / "n.json").read_text())["passes"]["final_check"] is None


def test_verify_layers_checks_a_slice_of_each_type(toy_registry, ckpt, capsys, tmp_path):
    code, out, err = cli(capsys, "--passes", "swap-add", ckpt, "--verify-layers", "1", "--report", tmp_path / "r.json")
    assert code == 0, err
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["passes"]["verify_layers"] == [0, 1]  # first GDN layer, first attention layer of L A L
    assert "on layers [0, 1]" in out
    assert report["graph"]["ops"]["gdn_recurrence"] == 2  # the emitted graph is still the whole model


def test_numerics_failure_exits_3_and_reproduces(toy_registry, ckpt, capsys, tmp_path):
    code, out, err = cli(capsys, "--passes", "swap-add,loosen-eps", ckpt, "--repro-dir", tmp_path / "repro")
    assert code == 3
    assert err.count("\n") == 1 and "numerics check failed after pass loosen-eps (after: swap-add)" in err
    assert "FAILED" in out
    (repro,) = list((tmp_path / "repro").iterdir())
    assert "qcompile reproduce " + str(repro) in err
    code, out, err = cli(capsys, "reproduce", repro)
    assert code == 3 and "loosen-eps" in out and "relative error" in out
    info = json.loads((repro / "repro.json").read_text())
    assert Path(info["checkpoint"]).is_absolute()  # `qcompile reproduce` works from any directory
    art = tmp_path / "art"
    art.mkdir()
    (art / "manifest.json").write_text("{}")
    # each malformed field is one line and exit 65 (internal errors before; a NaN bound reported the failure fixed)
    for broken, why in (("[]", "not a qcompile reproducer"),
                        (json.dumps({k: v for k, v in info.items() if k != "seed"}), "'seed' must be an integer"),
                        (json.dumps({**info, "seed": "x"}), "'seed' must be an integer"),
                        (json.dumps({**info, "seed": -3}), "'seed' must be an integer"),
                        (json.dumps({**info, "bound": float("nan")}), "'bound' must be a positive number"),
                        (json.dumps({**info, "verify_experts": "abc"}), "'verify_experts' must be an integer"),
                        (json.dumps({**info, "verify_experts": 1000}), "expert count 1000 outside"),
                        (json.dumps({**info, "meta": {}}), "its 'meta' lacks 'vocab_size'"),
                        (json.dumps({**info, "checkpoint": 5}), "names no checkpoint"),
                        (json.dumps({**info, "checkpoint": str(art)}), "is a qcompile artifact; this needs the "),
                        (json.dumps({**info, "target": "bogus"}), "'target' must be one of")):
        (repro / "repro.json").write_text(broken)
        code, _, err = cli(capsys, "reproduce", repro)
        assert code == 65 and why in err and len(err.splitlines()) == 1, (why, err)


def test_reproduce_reports_when_a_failure_is_gone(toy_registry, ckpt, capsys, tmp_path, monkeypatch):
    cli(capsys, "--passes", "loosen-eps", ckpt, "--repro-dir", tmp_path / "repro")
    (repro,) = list((tmp_path / "repro").iterdir())
    fixed = dict(TABLE)
    fixed["loosen-eps"] = toy_passes.Pass("loosen-eps", "now a no-op", lambda g, c: toy_passes.PassResult(g, False))
    monkeypatch.setattr(registry, "PASSES", fixed)
    code, out, _ = cli(capsys, "reproduce", repro)
    assert code == 0 and "no longer fails" in out


def test_verifier_and_audit_failures_exit_4(toy_registry, ckpt, capsys):
    code, _, err = cli(capsys, "--passes", "wrong-types", ckpt, "--verify", "none")
    assert code == 4 and "after pass wrong-types" in err
    code, _, err = cli(capsys, "--passes", "liar", ckpt, "--verify", "none")
    assert code == 4 and "reported no change" in err
    code, _, err = cli(capsys, "--passes", "crash", ckpt, "--verify", "none")
    assert code == 1 and "pass crash raised RuntimeError: boom" in err


def test_print_ir_and_dump_dir(toy_registry, ckpt, capsys, tmp_path):
    code, _, err = cli(capsys, "--passes", "swap-add,split-linear", ckpt, "--verify", "none",
                       "--print-ir-after", "swap-add", "--dump-dir", tmp_path / "dump")
    assert code == 0
    assert err.count("// ----- IR after") == 1 and "IR after swap-add" in err
    assert sorted(p.name for p in (tmp_path / "dump").iterdir()) == [
        "000_input.qir", "001_swap-add.qir", "002_split-linear.qir"]
    code, _, err = cli(capsys, "--passes", "swap-add,needs-devices", ckpt, "--verify", "none", "--print-ir-after-change")
    assert err.count("// ----- IR after") == 1  # needs-devices was skipped: no change, nothing printed
    code, _, err = cli(capsys, "--passes", "swap-add", ckpt, "--print-ir-after", "nope")
    assert code == 2 and "not a pass" in err


def test_artifact_runs_without_the_checkpoint(toy_registry, ckpt, capsys, tmp_path):
    own = tmp_path / "ckpt"
    shutil.copytree(ckpt, own)
    prompt = "5,17,300,42,7,99,250,3,18,411,64,9,1,2,3,4,5,6,7,8"
    code, expected, err = cli(capsys, "run", own, "--prompt-ids", prompt, "--max-new-tokens", 5)
    assert code == 0, err
    code, out, err = cli(capsys, "--passes", "swap-add,split-linear", own, "-o", tmp_path / "art",
                         "--max-seqs", 2, "--max-context", 64, "--max-step-tokens", 16)
    assert code == 0, err
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    assert manifest["target"] == "cpu" and manifest["pipeline"] == "swap-add,split-linear"
    assert [r["name"] for r in manifest["passes"]["passes"]] == ["swap-add", "split-linear"]
    assert manifest["equivalence"]["ok"]
    shutil.rmtree(own)
    code, out, err = cli(capsys, "run", tmp_path / "art", "--prompt-ids", prompt, "--max-new-tokens", 5)
    assert code == 0, err
    assert out == expected  # same tokens as running the checkpoint


def test_tpu_artifact_is_built_here_and_refused_here(ckpt, capsys, tmp_path):
    code, _, err = cli(capsys, "--passes", "none", ckpt, "--target", "tpu", "-o", tmp_path / "tpu",
                       "--max-seqs", 1, "--max-context", 32, "--max-step-tokens", 4)
    assert code == 0, err
    assert json.loads((tmp_path / "tpu" / "manifest.json").read_text())["target"] == "tpu"
    code, _, err = cli(capsys, "run", tmp_path / "tpu", "--prompt-ids", "1,2,3")
    assert code == 65 and err.count("\n") == 1 and "tpu" in err
