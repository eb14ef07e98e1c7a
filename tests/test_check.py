"""`qcompile check`: the optimized model against its unoptimized reference on the user's prompts."""

from __future__ import annotations

import json

import numpy as np
import pytest

from qcompile.compiler.check import compare_steps
from test_cli import cli


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from conftest import write_small

    root = tmp_path_factory.mktemp("check")
    return (write_small(root / "a", family="qwen3_5_moe", seed=7),
            write_small(root / "b", family="qwen3_5_moe", seed=8))


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt_ids": [5, 6, 7, 8]}\n\n{"prompt_ids": [9, 10, 11]}\n{"prompt_ids": [12]}\n')
    return path


def test_compare_steps_measures_agreement_kl_and_the_first_divergence():
    ref = [np.array([0.0, 3.0, 1.0]), np.array([2.0, 0.0, 1.0]), np.array([0.0, 0.0, 5.0])]
    same = compare_steps(ref, ref)
    assert same["top1_agreement"] == 1.0 and same["kl_max"] == pytest.approx(0.0, abs=1e-12)
    assert same["first_divergence"] is None
    other = compare_steps(ref, [ref[0], np.array([0.0, 2.0, 1.0]), ref[2]])
    assert other["top1_agreement"] == pytest.approx(2 / 3) and other["first_divergence"] == 1
    p = np.exp(ref[1]) / np.exp(ref[1]).sum()
    q = np.exp([0.0, 2.0, 1.0]) / np.exp([0.0, 2.0, 1.0]).sum()
    assert other["kl_max"] == pytest.approx(float(np.sum(p * np.log(p / q))), rel=1e-9)


def test_checkpoint_with_all_passes_agrees_with_its_reference(ckpts, prompts, tmp_path, capsys):
    """The reassociating passes agree to f32 rounding (KL < 1e-8); `all` adds bf16-state, whose loss is measured,
    not zero, and small."""
    out = tmp_path / "check.json"
    code, text, err = cli(capsys, "check", ckpts[0], "--passes", "all,-bf16-state", "--prompts", prompts,
                          "--max-new-tokens", "6", "--json", out)
    assert code == 0, err
    report = json.loads(out.read_text())
    assert report["ok"] and report["overall"]["steps"] == 18 and report["overall"]["top1_agreement"] == 1.0
    assert report["overall"]["kl_max"] < 1e-8 and report["overall"]["prompts_diverged"] == 0
    assert [p["prompt_tokens"] for p in report["prompts"]] == [4, 3, 1]
    assert all(p["first_divergence"] is None for p in report["prompts"])
    assert "overall: 18 steps, top-1 agreement 1.0000" in text
    code, text, err = cli(capsys, "check", ckpts[0], "--prompts", prompts, "--max-new-tokens", "6", "--json", out)
    assert code == 0, err
    lossy = json.loads(out.read_text())["overall"]
    assert 1e-8 < lossy["kl_max"] < 1e-3 and lossy["top1_agreement"] >= 0.99


def test_a_different_model_fails_with_exit_3(ckpts, prompts, capsys):
    code, text, err = cli(capsys, "check", ckpts[0], "--reference", ckpts[1], "--prompts", prompts,
                          "--max-new-tokens", "4")
    assert code == 3 and "under --min-agreement 0.99" in err
    assert "step 0" in text  # the first divergence is reported per prompt


def test_an_artifact_against_its_checkpoint(ckpts, prompts, tmp_path, capsys):
    art = tmp_path / "art"
    code, _, err = cli(capsys, "--passes", "all", ckpts[0], "-o", art, "--max-seqs", "2", "--max-context", "32",
                       "--max-step-tokens", "8", "--verify", "none")
    assert code == 0, err
    code, text, err = cli(capsys, "check", art, "--reference", ckpts[0], "--prompts", prompts,
                          "--max-new-tokens", "5")
    assert code == 0, err
    assert "top-1 agreement 1.0000" in text and "passes swiglu-fusion" in text
    code, _, err = cli(capsys, "check", art, "--prompts", prompts)
    assert code == 2 and "needs --reference CHECKPOINT" in err
    code, _, err = cli(capsys, "check", art, "--reference", ckpts[0], "--prompts", prompts, "--max-new-tokens", "40")
    assert code == 2 and "needs a context of 44; the artifact holds 32" in err
    # --passes is a checkpoint's choice: an artifact carries its own (a misspelled pass passed silently)
    code, _, err = cli(capsys, "check", art, "--reference", ckpts[0], "--prompts", prompts, "--passes", "bogus")
    assert code == 2 and "--passes bogus: " in err and "is an artifact" in err
    # a reference of another architecture is named as such (exit 2), not measured into a 0% agreement (exit 3)
    from conftest import write_small

    other = write_small(tmp_path / "other", seed=7, layer_types=("linear_attention", "full_attention") * 2)
    code, _, err = cli(capsys, "check", art, "--reference", other, "--prompts", prompts, "--max-new-tokens", "2")
    assert code == 2 and "is not the model the artifact was compiled from: its num_layers is 4" in err, err


def test_conversations_are_checked_as_their_rendered_ids(ckpts, tmp_path, capsys):
    """{"messages": [...]} lines are the chat template's rendering of the conversation (the assistant's turn
    opened), exactly the ids serve's chat API would run; a checkpoint without a template, or a conversation the
    template refuses, is a one-line exit 2 naming the line."""
    import shutil

    from qcompile.frontend.chat import CHAT_TEMPLATE_FILE, TINY_CHAT_TEMPLATE, encode_chat, load_chat_template
    from qcompile.frontend.tokenizer import TINY_TOKENIZER_CONFIG, TOKENIZER_FILE, load_tokenizer, train_tiny_tokenizer

    chat = tmp_path / "chat"
    shutil.copytree(ckpts[0], chat)
    train_tiny_tokenizer(512).save(str(chat / TOKENIZER_FILE))
    (chat / "tokenizer_config.json").write_text(json.dumps(TINY_TOKENIZER_CONFIG))
    conversations = [[{"role": "user", "content": "Hi"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "A compiler?"}]]
    by_messages, by_ids = tmp_path / "messages.jsonl", tmp_path / "ids.jsonl"
    by_messages.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))
    code, _, err = cli(capsys, "check", chat, "--prompts", by_messages, "--passes", "none", "--max-new-tokens", "2")
    assert code == 2 and "messages.jsonl:1: messages need the checkpoint's chat template" in err
    (chat / CHAT_TEMPLATE_FILE).write_text(TINY_CHAT_TEMPLATE)
    template, tokenizer = load_chat_template(chat), load_tokenizer(chat, "test")
    by_ids.write_text("".join(json.dumps({"prompt_ids": encode_chat(tokenizer, template, m)}) + "\n"
                              for m in conversations))
    reports = []
    for prompts in (by_messages, by_ids):
        out = tmp_path / f"{prompts.stem}.json"
        code, _, err = cli(capsys, "check", chat, "--prompts", prompts, "--passes", "all", "--max-new-tokens", "3",
                           "--min-agreement", "0",
                           "--json", out)
        assert code == 0, err
        reports.append(json.loads(out.read_text()))
    assert reports[0]["prompts"] == reports[1]["prompts"] and reports[0]["overall"] == reports[1]["overall"]
    assert [p["prompt_tokens"] for p in reports[0]["prompts"]] == [len(encode_chat(tokenizer, template, m))
                                                                   for m in conversations]
    by_messages.write_text(json.dumps({"messages": conversations[0]}) + "\n"
                           + json.dumps({"messages": [{"role": "tool", "content": "42"}]}) + "\n")
    code, _, err = cli(capsys, "check", chat, "--prompts", by_messages, "--passes", "none")
    assert code == 2 and "messages.jsonl:2: the chat template" in err and "not tool" in err
    assert len(err.strip().splitlines()) == 1


def test_prompts_from_a_pipe_and_absurd_sizes(ckpts, tmp_path, capsys):
    """--prompts /dev/stdin or a FIFO is read (it was "file not found"), with a cap (/dev/zero never ends); a
    --max-new-tokens past what qcompile supports names that flag (it named --max-context, which check lacks)."""
    import os
    import threading

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text('{"prompt_ids": [5, 6, 7]}\n'), daemon=True)
    writer.start()
    code, text, err = cli(capsys, "check", ckpts[0], "--prompts", fifo, "--passes", "none", "--max-new-tokens", "2")
    writer.join(10)
    assert code == 0 and "1 prompts" in text, err
    code, _, err = cli(capsys, "check", ckpts[0], "--prompts", "/dev/zero")
    assert code == 2 and "more than 256 MiB of prompts" in err
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [5, 6, 7]}\n')
    code, _, err = cli(capsys, "check", ckpts[0], "--prompts", prompts, "--max-new-tokens", "100000000")
    assert code == 2 and "--max-new-tokens 100000000: " in err and "--max-context" not in err


@pytest.mark.parametrize("content, message", [
    (None, "file not found"),
    ("", "no prompts"),
    ('{"prompt_ids": [1, 2]}\nnot json\n', "prompts.jsonl:2: not JSON"),
    ('{"ids": [1]}\n', "expected an object with one of prompt_ids, prompt or messages"),
    ('{"prompt_ids": [1], "messages": []}\n', "expected an object with one of prompt_ids, prompt or messages"),
    ('{"messages": [{"role": "user", "content": "hi"}]}\n', "needs the checkpoint's tokenizer.json"),
    ('{"prompt_ids": []}\n', "non-empty list of integers"),
    ('{"prompt_ids": [1, 99999]}\n', "token id 99999 is outside the vocabulary"),
    ('{"prompt": "hello"}\n', "needs the checkpoint's tokenizer.json"),
    (b'{"prompt_ids": [1]}\n\xff\xfe\n', "prompts.jsonl:2: not UTF-8"),
])
def test_bad_prompts_are_one_line_exit_2(ckpts, tmp_path, capsys, content, message):
    path = tmp_path / "prompts.jsonl"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    code, _, err = cli(capsys, "check", ckpts[0], "--prompts", path)
    assert code == 2 and message in err and "Traceback" not in err
