"""The command line end to end: init-tiny → compile → run, outputs, and usage errors (exit 2)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

import hf_oracle
from qcompile.cli import main
from qcompile.frontend.safetensors_io import SafetensorsFile


def cli(capsys, *argv) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return exc.value.code, out, err


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    from qcompile.frontend.tiny import write_tiny

    root = tmp_path_factory.mktemp("cli")
    return {family: write_tiny(root / family, family=family, seed=3) for family in ("qwen3_5_moe", "qwen3_next")}


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_init_tiny_is_loadable_by_transformers_and_run_matches_it(family, tiny_dirs, capsys, tmp_path):
    path = tiny_dirs[family]
    prompt = [5, 17, 300, 42, 7, 99, 250, 3, 18, 411, 64]
    code, out, err = cli(capsys, "run", path, "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", 6,
                         "--save-logits", tmp_path / "logits.npy")
    assert code == 0, err
    tokens = [int(t) for t in out.strip().split(",")]
    ref_tokens, _ = hf_oracle.hf_greedy(path, prompt, 6)
    assert tokens == ref_tokens
    logits = np.load(tmp_path / "logits.npy")
    assert logits.dtype == np.float32 and logits.shape == (len(prompt), 512)
    ref = hf_oracle.hf_logits(path, prompt)
    assert np.abs(logits - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max())


def test_compile_writes_graph_and_report(tiny_dirs, capsys, tmp_path):
    path = tiny_dirs["qwen3_next"]
    code, out, err = cli(capsys, "--passes", "none", path, "-o", tmp_path / "out")
    assert code == 0, err
    assert "4 layers (3 GDN, 1 attention)" in out
    text = (tmp_path / "out" / "graph.qir").read_text()
    assert text.startswith("graph @qwen3_next {") and text.count("gdn_recurrence(") == 3
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["family"] == "qwen3_next" and report["layers"]["pattern"] == "LLLA"
    assert report["layers"]["linear_attention"] == 3 and report["layers"]["full_attention"] == 1
    st = SafetensorsFile(path / "model.safetensors")
    total = sum(math.prod(info.shape) for info in st.tensors.values())
    assert report["parameters"]["total"] == total
    expert = sum(math.prod(i.shape) for n, i in st.tensors.items() if ".mlp.experts." in n)
    assert report["parameters"]["routed_experts"] == expert
    assert report["parameters"]["active_per_token"] == total - expert + expert * 2 // 8  # top-2 of 8 experts
    assert report["bytes_by_dtype"] == {"F32": 4 * total}
    assert report["passes"]["selected"] == []


def test_run_json_is_machine_readable(tiny_dirs, capsys):
    code, out, _ = cli(capsys, "run", tiny_dirs["qwen3_5_moe"], "--prompt-ids", "1,2,3", "--max-new-tokens", 4, "--json")
    assert code == 0
    result = json.loads(out)
    assert result["prompt_ids"] == [1, 2, 3] and len(result["tokens"]) == 4 and result["family"] == "qwen3_5_moe"
    code, plain, _ = cli(capsys, "run", tiny_dirs["qwen3_5_moe"], "--prompt-ids", "1,2,3", "--max-new-tokens", 4)
    assert [int(t) for t in plain.strip().split(",")] == result["tokens"]


def test_a_context_past_max_position_embeddings_is_warned_about_not_refused(tiny_dirs, capsys, tmp_path):
    """transformers runs positions past max_position_embeddings (RoPE has no hard limit), so qcompile does too, but
    says so on stderr: the model was not trained there."""
    import shutil

    path = shutil.copytree(tiny_dirs["qwen3_5_moe"], tmp_path / "short")
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["max_position_embeddings"] = 8
    (path / "config.json").write_text(json.dumps(config))
    code, within, err = cli(capsys, "run", path, "--prompt-ids", "1,2,3", "--max-new-tokens", 5)
    assert code == 0 and "max_position_embeddings" not in err
    code, past, err = cli(capsys, "run", path, "--prompt-ids", "1,2,3", "--max-new-tokens", 6)
    assert code == 0 and past.startswith(within.strip())
    assert "the longest prompt + --max-new-tokens allows 9 tokens, past the checkpoint's max_position_embeddings " \
           "(8)" in err
    config["text_config"]["max_position_embeddings"] = "long"
    (path / "config.json").write_text(json.dumps(config))
    code, _, err = cli(capsys, "run", path, "--prompt-ids", "1,2,3", "--max-new-tokens", 5)
    assert code == 65 and "'max_position_embeddings' must be a non-negative integer" in err


@pytest.mark.slow
def test_several_prompts_are_served_together_and_each_matches_its_own_run(tiny_dirs, capsys, tmp_path):
    """Two --prompt-ids of different lengths in one batch (shared prefill and decode steps, ragged) give, line by
    line, the tokens each gives alone; on an artifact too, which refuses more prompts than its sequence slots."""
    ckpt = tiny_dirs["qwen3_5_moe"]
    prompts = ["1,2,3", "5,6,7,8,9,10,11"]
    alone = []
    for ids in prompts:
        code, out, err = cli(capsys, "run", ckpt, "--prompt-ids", ids, "--max-new-tokens", 5, "--ignore-eos")
        assert code == 0, err
        alone.append(out.strip())
    args = [a for ids in prompts for a in ("--prompt-ids", ids)]
    code, out, err = cli(capsys, "run", ckpt, *args, "--max-new-tokens", 5, "--ignore-eos")
    assert code == 0, err
    assert out.strip().splitlines() == alone and alone[0] != alone[1]
    code, out, _ = cli(capsys, "run", ckpt, *args, "--max-new-tokens", 5, "--ignore-eos", "--json")
    lines = [json.loads(line) for line in out.strip().splitlines()]
    assert [r["prompt_ids"] for r in lines] == [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11]]
    assert [",".join(map(str, r["tokens"])) for r in lines] == alone
    art = tmp_path / "art"
    code, _, err = cli(capsys, ckpt, "--passes", "none", "--verify", "none", "-o", art, "--max-seqs", 2,
                       "--max-context", 32)
    assert code == 0, err
    code, out, err = cli(capsys, "run", art, *args, "--max-new-tokens", 5, "--ignore-eos")
    assert code == 0, err
    assert out.strip().splitlines() == alone
    code, _, err = cli(capsys, "run", art, *args, "--prompt-ids", "4", "--max-new-tokens", 5)
    assert code == 2 and "3 prompts, but the artifact serves at most 2 sequences" in err
    code, _, err = cli(capsys, "run", ckpt, *args, "--save-logits", tmp_path / "x.npy")
    assert code == 2 and "--save-logits saves one prompt's logits" in err


@pytest.mark.parametrize("argv, needle", [
    (["--passes", "no-such-pass", "{ckpt}"], "unknown pass 'no-such-pass'"),
    (["run", "{ckpt}", "--prompt-ids", "1,x"], "comma-separated integers"),
    (["run", "{ckpt}", "--prompt-ids", "1,99999"], "outside the vocabulary"),
    (["init-tiny", "{ckpt}"], "--force"),
    (["run", "{ckpt}"], "--prompt-ids"),
    (["compile", "{ckpt}", "--dtype", "f64"], "f64"),
])
def test_usage_errors_exit_2_with_one_line(argv, needle, tiny_dirs, capsys):
    ckpt = tiny_dirs["qwen3_5_moe"]
    before = (ckpt / "model.safetensors").stat().st_mtime_ns
    code, _, err = cli(capsys, *[a.replace("{ckpt}", str(ckpt)) for a in argv])
    assert code == 2 and needle in err
    assert (ckpt / "model.safetensors").stat().st_mtime_ns == before


def test_help_lists_commands_and_exit_codes(capsys):
    code, out, _ = cli(capsys, "--help")
    assert code == 0
    for word in ("compile", "run", "init-tiny", "65 bad input"):
        assert word in out


def test_console_script_reports_bad_input_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    proc = subprocess.run([sys.executable, "-m", "qcompile.cli", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 65
    assert proc.stderr.count("\n") == 1 and "unsupported model_type 'llama'" in proc.stderr


def test_init_tiny_bf16(tmp_path, capsys):
    code, _, err = cli(capsys, "init-tiny", tmp_path / "b", "--family", "qwen3_next", "--dtype", "bf16", "--seed", 5)
    assert code == 0, err
    st = SafetensorsFile(tmp_path / "b" / "model.safetensors")
    assert {info.dtype for info in st.tensors.values()} == {"BF16"}
    assert json.loads((tmp_path / "b" / "config.json").read_text())["dtype"] == "bfloat16"
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in st.tensors  # Qwen3-Next Hub layout
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in st.tensors


@pytest.mark.slow
def test_bench_preset_compiles_and_runs(tmp_path, capsys):
    code, _, err = cli(capsys, "init-tiny", tmp_path / "bench", "--preset", "bench")
    assert code == 0, err
    code, out, err = cli(capsys, "--passes", "none", tmp_path / "bench", "-o", tmp_path / "out")
    assert code == 0, err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert 3e8 < report["parameters"]["total"] < 7e8 and report["layers"]["pattern"] == "LLLALLLA"
    assert report["config"]["num_kv_heads"] == 2 and report["config"]["top_k"] >= 8
    code, out, err = cli(capsys, "run", tmp_path / "bench", "--prompt-ids", "1,2,3,4,5,6,7,8", "--max-new-tokens", 4)
    assert code == 0 and len(out.strip().split(",")) == 4
