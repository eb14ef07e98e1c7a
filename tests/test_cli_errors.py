"""Command-line failure modes: each bad flag or path is refused up front with one line and the right exit code.

Exit codes (qcompile/errors.py): 1 internal, 2 usage, 4 IR verification / lowering, 65 bad input.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from qcompile.cli import main
from qcompile.errors import QCompileError, UsageError


def cli(capsys, *argv) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def one_line(err: str) -> bool:
    return err.count("\n") == 1 and err.startswith("qcompile: ") and "Traceback" not in err


def boom(*args, **kwargs):
    raise AssertionError("the command did work before refusing a bad flag")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from qcompile.frontend.tiny import write_tiny

    return write_tiny(tmp_path_factory.mktemp("errors") / "tiny", family="qwen3_5_moe", seed=3)


@pytest.fixture(scope="module")
def eos_case(tmp_path_factory, tiny):
    """A copy of the tiny checkpoint whose eos_token_id is a token X of a prompt's greedy continuation.

    Returns (checkpoint, prompt, continuation without EOS, index k of X in it): with X as EOS, generation must stop
    right after continuation[k].
    """
    from qcompile.ir.abi import CacheConfig
    from qcompile.runtime.model import load_model

    prompt, new = [5, 17, 300, 42], 8
    model = load_model(tiny)
    full = model.engine(CacheConfig(max_seqs=1, max_context=len(prompt) + new)).generate([prompt], new)["tokens"][0]
    k = next((i for i in range(1, len(full)) if full[i] not in full[:i]), None)
    assert k is not None, f"no token of {full} is new after the first; pick another prompt"
    path = tmp_path_factory.mktemp("eos") / "ckpt"
    shutil.copytree(tiny, path)
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["eos_token_id"] = [full[k]]  # the list form; Qwen3.5 keeps it in text_config
    (path / "config.json").write_text(json.dumps(config))
    return path, prompt, full, k


# -- 1, 2, 9: sizes are validated before any work -----------------------------------------------------------------


@pytest.mark.parametrize("flag, value", [
    ("--max-step-tokens", 0), ("--max-step-tokens", -1), ("--max-seqs", 0), ("--max-seqs", -3),
    ("--max-context", 0), ("--num-pages", 0), ("--num-pages", -2), ("--page-size", 0), ("--page-size", 3),
    ("--verify-layers", 0),
])
def test_bad_sizes_exit_2_naming_the_flag_before_any_work(flag, value, tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("qcompile.compiler.driver.compile_checkpoint", boom)
    code, out, err = cli(capsys, tiny, "-o", tmp_path / "out", flag, value)
    assert code == 2 and one_line(err), err
    assert flag in err and str(value) in err
    assert "warning" not in err.lower() and out == ""
    assert not (tmp_path / "out").exists()


def test_bad_size_is_refused_before_the_checkpoint_is_read(tmp_path, capsys):
    code, _, err = cli(capsys, "compile", tmp_path / "no-such-checkpoint", "--max-seqs", 0)
    assert code == 2 and one_line(err) and "--max-seqs" in err  # not 65 (checkpoint not found)


def test_help_and_readme_list_the_new_flags(capsys):
    code, out, _ = cli(capsys, "compile", "--help")
    assert code == 0 and "--num-pages" in out and "--fp8 [keep|dequantize]" in out
    code, out, _ = cli(capsys, "run", "--help")
    assert code == 0 and "--ignore-eos" in out
    readme = (__import__("pathlib").Path(__file__).parents[1] / "README.md").read_text()
    assert "[--num-pages N]" in readme and "[--ignore-eos]" in readme and "[--fp8 keep|dequantize]" in readme


# -- 3: a failed export leaves nothing that looks like an artifact ------------------------------------------------


def test_failed_export_removes_the_fresh_output_directory(tiny, tmp_path, capsys, monkeypatch):
    import jax

    def fail(*args, **kwargs):
        raise RuntimeError("export exploded")

    monkeypatch.setattr(jax.export, "export", fail)
    out_dir = tmp_path / "fresh" / "out"
    code, _, err = cli(capsys, tiny, "--passes", "none", "--verify", "none", "-o", out_dir, "--max-seqs", 1,
                       "--max-context", 16, "--max-step-tokens", 2)
    assert code == 1 and one_line(err) and "export exploded" in err
    assert not out_dir.exists()


def test_run_refuses_an_interrupted_artifact_write(tmp_path, capsys, monkeypatch):
    from qcompile.runtime.artifact import WRITING_MARKER

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / WRITING_MARKER).write_text("qcompile is writing an artifact here\n")
    monkeypatch.setattr("qcompile.runtime.model.load_model", boom)
    code, _, err = cli(capsys, "run", tmp_path / "out", "--prompt-ids", "1,2")
    assert code == 65 and one_line(err)
    assert "interrupted" in err and "config.json not found" not in err


# -- 4: run stops at EOS -------------------------------------------------------------------------------------------


def test_run_stops_right_after_the_configs_eos_and_ignore_eos_goes_on(eos_case, capsys):
    path, prompt, full, k = eos_case
    ids = ",".join(map(str, prompt))
    code, out, err = cli(capsys, "run", path, "--prompt-ids", ids, "--max-new-tokens", len(full), "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["tokens"] == full[:k + 1]  # the EOS token is printed
    assert result["finish_reason"] == "eos" and result["eos_token_ids"] == [full[k]]
    code, out, err = cli(capsys, "run", path, "--prompt-ids", ids, "--max-new-tokens", len(full), "--ignore-eos",
                         "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["tokens"] == full and result["finish_reason"] == "length" and result["eos_token_ids"] == []


def test_artifact_run_stops_at_eos_and_num_pages_sizes_the_pool(eos_case, tmp_path, capsys):
    path, prompt, full, k = eos_case
    out_dir = tmp_path / "out"
    code, _, err = cli(capsys, path, "--passes", "none", "--verify", "none", "-o", out_dir, "--max-seqs", 1,
                       "--max-context", 64, "--max-step-tokens", 32, "--num-pages", 1)
    assert code == 0, err
    manifest = json.loads((out_dir / "manifest.json").read_text())
    assert manifest["cache"]["num_pages"] == 1 and manifest["cache"]["sizes"]["P"] == 1
    assert manifest["config"]["eos_token_ids"] == [full[k]]
    code, out, err = cli(capsys, "run", out_dir, "--prompt-ids", ",".join(map(str, prompt)),
                         "--max-new-tokens", len(full))
    assert code == 0, err
    assert [int(t) for t in out.strip().split(",")] == full[:k + 1]
    # 17 tokens need 2 pages of 16; the pool has 1: a usage error naming the flag that sizes it.
    code, _, err = cli(capsys, "run", out_dir, "--prompt-ids", ",".join(["7"] * 17), "--max-new-tokens", 1)
    assert code == 2 and one_line(err) and "--num-pages" in err and "exhausted" in err


# -- 5: output paths are checked before the model is loaded --------------------------------------------------------


@pytest.mark.parametrize("where, needle", [("missing/logits.npy", "does not exist"), (".", "is a directory")])
def test_save_logits_path_is_checked_before_loading(where, needle, tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("qcompile.runtime.model.load_model", boom)
    code, out, err = cli(capsys, "run", tiny, "--prompt-ids", "1,2", "--save-logits", tmp_path / where)
    assert code == 2 and one_line(err) and "--save-logits" in err and needle in err and out == ""


def test_compile_output_paths_are_checked_before_compiling(tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("qcompile.compiler.driver.compile_checkpoint", boom)
    code, _, err = cli(capsys, tiny, "--report", tmp_path / "missing" / "report.json")
    assert code == 2 and one_line(err) and "--report" in err and "does not exist" in err
    (tmp_path / "file").write_text("x")
    code, _, err = cli(capsys, tiny, "-o", tmp_path / "file")
    assert code == 2 and one_line(err) and "not a directory" in err
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    code, _, err = cli(capsys, tiny, "-o", tmp_path / "busy")
    assert code == 2 and one_line(err) and "not a qcompile artifact" in err
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"


# -- 6: init-tiny onto a bad path -----------------------------------------------------------------------------------


def test_init_tiny_onto_a_regular_file_exits_2(tmp_path, capsys):
    (tmp_path / "file").write_text("keep me")
    code, _, err = cli(capsys, "init-tiny", tmp_path / "file")
    assert code == 2 and one_line(err) and "not a directory" in err
    assert (tmp_path / "file").read_text() == "keep me"
    code, _, err = cli(capsys, "init-tiny", tmp_path / "file" / "sub")
    assert code == 2 and one_line(err) and "cannot create" in err


def test_init_tiny_write_failure_exits_2(tmp_path, capsys):
    (tmp_path / "ckpt" / "model.safetensors").mkdir(parents=True)  # a directory where the weights file goes
    code, _, err = cli(capsys, "init-tiny", tmp_path / "ckpt", "--force")
    assert code == 2 and one_line(err) and "cannot write" in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_init_tiny_into_a_read_only_directory_exits_2(tmp_path, capsys):
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro").chmod(0o500)
    try:
        code, _, err = cli(capsys, "init-tiny", tmp_path / "ro" / "ckpt")
    finally:
        (tmp_path / "ro").chmod(0o700)
    assert code == 2 and one_line(err)


# -- 7: empty SPEC elements and empty ids ---------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["", " ", "all,,none", "all,", ",all", "-"])
def test_empty_passes_spec_or_element_exits_2(spec, tiny, capsys, monkeypatch):
    monkeypatch.setattr("qcompile.frontend.checkpoint.Checkpoint.open", boom)
    code, _, err = cli(capsys, tiny, "--passes", spec)
    assert code == 2 and one_line(err) and "--passes" in err and "empty" in err


def test_parse_spec_still_reads_the_valid_forms():
    import toy_passes
    from qcompile.passes.registry import parse_spec

    table = toy_passes.GOOD
    every = [p.name for p in parse_spec("all", table)]
    assert every and [p.name for p in parse_spec("none", table)] == []
    assert [p.name for p in parse_spec(f"all,-{every[0]}", table)] == every[1:]
    assert [p.name for p in parse_spec(f" {every[-1]} , {every[0]} ", table)] == [every[0], every[-1]]
    with pytest.raises(UsageError, match="empty"):
        parse_spec(f"{every[0]},,{every[-1]}", table)


@pytest.mark.parametrize("ids", ["1,,2", "1,2,", ",1", ",", " "])
def test_empty_prompt_id_exits_2(ids, tiny, capsys, monkeypatch):
    monkeypatch.setattr("qcompile.runtime.model.load_model", boom)
    code, _, err = cli(capsys, "run", tiny, "--prompt-ids", ids)
    assert code == 2 and one_line(err) and "--prompt-ids" in err and "empty" in err


# -- 8: LoweringError is exit 4 and says what to do ---------------------------------------------------------------


def lowering_error():
    from qcompile.ir.builder import Builder
    from qcompile.ir.lowering import lower
    from qcompile.ir.ops.core import Linear
    from qcompile.ir.types import TensorType

    b = Builder()
    x = b.input("x", TensorType("f32", ("T", 8)))
    w = b.param("w", TensorType("f32", (4, 8)))
    b.output("y", b.add(Linear(), x, w))
    fn = lower(b.build())
    bad_weight = np.zeros((4, 9), np.float32)  # the operand does not fit linear's rule (K = 8)
    with pytest.raises(QCompileError) as exc:
        fn({"w": bad_weight}, {"x": np.zeros((2, 8), np.float32)})
    return exc.value


def test_lowering_error_is_exit_4_and_names_the_op_and_the_remedy():
    from qcompile.ir.lowering import LoweringError

    err = lowering_error()
    assert isinstance(err, LoweringError) and err.exit_code == 4
    assert "linear" in str(err) and "--verify each" in str(err) and "report" in str(err)


def test_lowering_error_reaches_the_command_line_as_exit_4(tiny, capsys, monkeypatch):
    err = lowering_error()

    def raise_it(*args, **kwargs):
        raise err

    monkeypatch.setattr("qcompile.runtime.model.load_model", raise_it)
    code, _, text = cli(capsys, "run", tiny, "--prompt-ids", "1,2")
    assert code == 4 and one_line(text) and "--verify each" in text


# -- outputs that would destroy inputs, outputs that cannot be written, sizes no machine has -----------------------


def _digests(root):
    import hashlib

    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def test_an_output_onto_an_input_is_refused_and_the_input_kept(tiny, tmp_path, capsys, monkeypatch):
    """--report onto the checkpoint's config.json, --save-logits onto its weights, check's --json onto the prompts
    file, plan's --json onto the config, -o around the checkpoint: each replaced what the user gave (exit 0 before)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny, ckpt)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [1, 2]}\n')
    before = {**_digests(ckpt), prompts: prompts.read_text()}
    from qcompile.compiler import driver

    monkeypatch.setattr(driver, "compile_checkpoint", boom)
    for argv in (["compile", ckpt, "--report", ckpt / "config.json"],
                 ["compile", ckpt, "--dump-dir", ckpt],
                 ["run", ckpt, "--prompt-ids", "1,2", "--save-logits", ckpt / "model.safetensors"],
                 ["check", ckpt, "--prompts", prompts, "--json", prompts],
                 ["plan", ckpt, "--no-lower", "--no-ablate", "--json", ckpt / "config.json"]):
        code, _, err = cli(capsys, *argv)
        assert code == 2 and one_line(err) and "would overwrite the input" in err, (argv, err)
    (tmp_path / "art").mkdir()
    (tmp_path / "art" / "manifest.json").write_text("{}")  # an artifact (written with --weights link)
    inner = tmp_path / "art" / "checkpoint"
    shutil.copytree(tiny, inner)
    code, _, err = cli(capsys, "compile", inner, "-o", tmp_path / "art")
    assert code == 2 and one_line(err) and "lies inside it" in err, err
    assert {**_digests(ckpt), prompts: prompts.read_text()} == before and (inner / "model.safetensors").is_file()


def test_init_tiny_refuses_a_directory_that_is_not_empty(tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "tokenizer.json").write_text('{"mine": 1}')
    code, _, err = cli(capsys, "init-tiny", mine)
    assert code == 2 and one_line(err) and "is not empty" in err and "--force" in err
    assert (mine / "tokenizer.json").read_text() == '{"mine": 1}' and sorted(mine.iterdir()) == [mine / "tokenizer.json"]


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc (a directory nothing can be created in)")
def test_outputs_that_cannot_be_created_are_refused_before_any_work(tiny, tmp_path, capsys, monkeypatch):
    """Permission bits say yes for root or for /proc; the file is tried (then removed) before the work starts."""
    from qcompile.compiler import bench, check, driver

    for module, name in ((driver, "compile_checkpoint"), (check, "run_check"), (bench, "run_bench")):
        monkeypatch.setattr(module, name, boom)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [1, 2]}\n')
    for argv in (["compile", tiny, "--report", "/proc/qcompile-report.json"],
                 ["compile", tiny, "--dump-dir", "/proc/qcompile-dumps"],
                 ["check", tiny, "--prompts", prompts, "--json", "/proc/qcompile-check.json"],
                 ["bench", tiny, "--json", "/proc/qcompile-bench.json"],
                 ["check", tiny, "--prompts", prompts, "--json", tmp_path]):
        code, _, err = cli(capsys, *argv)
        assert code == 2 and one_line(err), (argv, err)
    # a writable place passes, and the probes leave nothing behind: no probe directory, no output created early
    from qcompile.cli import _check_output_dir, _check_output_file

    _check_output_dir(tmp_path / "new" / "dumps", "--dump-dir")
    _check_output_file(tmp_path / "r.json", "--report")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.jsonl"]


@pytest.mark.parametrize("argv, needle", [
    (["bench", "{ckpt}", "--concurrency", "100000000"], "--concurrency values must be in 1..65536"),
    (["bench", "{ckpt}", "--seed", "-1"], "--seed"),
    (["init-tiny", "{tmp}/new", "--seed", "-1"], "--seed"),
    (["compile", "{ckpt}", "--max-seqs", "1000000000"], "--max-seqs 1000000000 is more than qcompile supports"),
    (["compile", "{ckpt}", "--max-context", "99999999999"], "--max-context"),
    (["compile", "{ckpt}", "--page-size", "2147483648"], "--page-size must be a power of two from 1 to 65536"),
    (["compile", "{ckpt}", "--max-seqs", "1.5"], "--max-seqs"),  # click's own errors: one line too
    (["run", "{ckpt}", "--no-such-flag"], "No such option"),
    (["frobnicate"], "'frobnicate' is neither a command nor a checkpoint path"),
    (["bench", "{ckpt}", "--passes", ""], "--passes SPEC is empty"),
])
def test_absurd_values_and_misspellings_are_one_line_usage_errors(argv, needle, tiny, tmp_path, capsys,
                                                                  monkeypatch):
    from qcompile.compiler import bench, driver

    monkeypatch.setattr(driver, "compile_checkpoint", boom)
    monkeypatch.setattr(bench, "measure_ceilings", boom)
    code, _, err = cli(capsys, *[str(a).replace("{ckpt}", str(tiny)).replace("{tmp}", str(tmp_path)) for a in argv])
    assert code == 2 and one_line(err) and needle in err, err


def test_running_out_of_memory_is_a_usage_line(tiny, capsys, monkeypatch):
    """An allocation the machine cannot make (sizes asked for without --memory-budget) is one line, exit 2, saying
    which sizes to lower — not an internal error."""
    from qcompile.runtime import model

    class JaxRuntimeError(RuntimeError):  # what XLA raises, by name
        pass

    def exhausted(*args, **kwargs):
        raise JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 800000000000 bytes.")

    monkeypatch.setattr(model, "load_model", exhausted)
    code, _, err = cli(capsys, "run", tiny, "--prompt-ids", "1,2")
    assert code == 2 and one_line(err) and "out of memory" in err and "--max-context" in err, err


def test_an_artifact_without_its_manifest_is_named_so(tmp_path, capsys):
    (tmp_path / "art" / "exec").mkdir(parents=True)
    (tmp_path / "art" / "graph.qir").write_text("")
    code, _, err = cli(capsys, "run", tmp_path / "art", "--prompt-ids", "1")
    assert code == 65 and one_line(err) and "artifact without its manifest.json" in err, err
