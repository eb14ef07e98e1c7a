"""Text in and out (frontend/tokenizer.py): init-tiny writes a real byte-level BPE tokenizer (deterministic, the
special tokens at the config's pad/bos/eos ids, text round-trips), `run --prompt` encodes with it and prints the
generated text — the same tokens as `run --prompt-ids` with the encoded ids — and a checkpoint without a tokenizer,
or both or neither prompt form, is a one-line exit 2.
"""

from __future__ import annotations

import json

import pytest

from qcompile.cli import main
from qcompile.frontend.tiny import write_tiny
from qcompile.frontend.tokenizer import CORPUS, decode, train_tiny_tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("tok") / "tiny")


def _run(capsys, *argv):
    with pytest.raises(SystemExit) as done:
        main(["run", *map(str, argv)])
    captured = capsys.readouterr()
    return done.value.code, captured.out, captured.err


def test_init_tiny_writes_a_real_deterministic_tokenizer(tiny):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    config = json.loads((tiny / "generation_config.json").read_text())
    assert tokenizer.get_vocab_size() == 512
    assert [tokenizer.token_to_id(t) for t in ("<pad>", "<s>", "</s>")] == [config["pad_token_id"],
                                                                           config["bos_token_id"],
                                                                           config["eos_token_id"]]
    sentence = "The weights stay where they were mapped, and only token ids come back to the host."
    ids = tokenizer.encode(sentence).ids
    assert len(ids) < len(sentence) / 2 and tokenizer.decode(ids) == sentence  # merges learned, lossless
    assert decode(tokenizer, ids + [600]) == sentence + "<id 600>"  # an id past the tokenizer's vocabulary
    assert train_tiny_tokenizer(512).to_str(pretty=True) == (tiny / "tokenizer.json").read_text()  # deterministic
    assert "\n" in CORPUS and tokenizer.decode(tokenizer.encode("héllo wörld").ids) == "héllo wörld"  # bytes


def test_run_prompt_text_prints_the_generated_text(tiny, capsys):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    prompts = ["A compiler reads a program", "Serving such a model"]
    code, out, err = _run(capsys, tiny, "--prompt", prompts[0], "--prompt", prompts[1], "--max-new-tokens", "6",
                          "--ignore-eos", "--json")
    assert code == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt_ids"] for r in records] == [tokenizer.encode(p).ids for p in prompts]
    assert all(r["text"] == decode(tokenizer, r["tokens"]) and len(r["tokens"]) == 6 for r in records)
    ids = ",".join(map(str, records[0]["prompt_ids"]))
    code, out, _ = _run(capsys, tiny, "--prompt-ids", ids, "--max-new-tokens", "6", "--ignore-eos")
    assert out.splitlines()[0] == ",".join(map(str, records[0]["tokens"]))  # the same tokens as by ids


def test_run_chat_renders_the_conversation_with_the_chat_template(tiny, tmp_path, capsys):
    """`run --chat TEXT [--system TEXT]`: the prompt is the template's rendering of the conversation (the ids serve's
    chat API would run), the reply the same tokens as those ids by --prompt-ids, its text without the eos."""
    from qcompile.frontend.chat import encode_chat, load_chat_template
    from qcompile.frontend.tokenizer import load_tokenizer

    tokenizer, template = load_tokenizer(tiny, "test"), load_chat_template(tiny)
    code, out, err = _run(capsys, tiny, "--chat", "What is a compiler?", "--chat", "Hi", "--system", "Be brief.",
                          "--max-new-tokens", "5", "--json")
    assert code == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    want = [encode_chat(tokenizer, template, [{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": text}]) for text in ("What is a compiler?", "Hi")]
    assert [r["prompt_ids"] for r in records] == want
    assert all(r["text"] == decode(tokenizer, r["tokens"], skip_special=True) for r in records)
    code, out, _ = _run(capsys, tiny, "--prompt-ids", ",".join(map(str, want[0])), "--max-new-tokens", "5")
    assert out.splitlines()[0] == ",".join(map(str, records[0]["tokens"]))
    mine = tmp_path / "mine.jinja"
    mine.write_text("{{ messages[-1].content }} =")
    code, out, err = _run(capsys, tiny, "--chat", "A compiler", "--chat-template", mine, "--max-new-tokens", "2",
                          "--json")
    assert code == 0 and json.loads(out)["prompt_ids"] == tokenizer.encode("A compiler =").ids, err


def test_prompt_errors_are_one_line_exit_2(tiny, tmp_path, capsys):
    from conftest import write_small

    bare = write_small(tmp_path / "bare")
    untemplated = tmp_path / "untemplated"
    untemplated.mkdir()
    (untemplated / "tokenizer.json").write_text((tiny / "tokenizer.json").read_text())
    for name in ("config.json", "model.safetensors"):
        (untemplated / name).symlink_to(tiny / name)
    for argv, message in (([bare, "--prompt", "hello"], "needs the checkpoint's tokenizer.json"),
                          ([tiny, "--prompt", "hello", "--prompt-ids", "1,2"], "one of the three"),
                          ([tiny, "--chat", "hello", "--prompt", "hi"], "one of the three"),
                          ([tiny], "one of the three"),
                          ([tiny, "--prompt", ""], "encodes to no tokens"),
                          ([tiny, "--prompt", "hi", "--system", "x"], "go with --chat"),
                          ([bare, "--chat", "hello"], "needs the checkpoint's tokenizer.json"),
                          ([untemplated, "--chat", "hello"], "--chat needs a chat template"),
                          ([tiny, "--chat", "hello", "--chat-template", tmp_path / "absent"], "cannot read")):
        code, _, err = _run(capsys, *argv)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_an_artifact_keeps_the_tokenizer_and_runs_text_alone(tiny, tmp_path, capsys):
    """`-o` with copied weights copies tokenizer.json, its config and the chat template (hashed in the manifest) so
    `run --prompt` and `serve`'s chat need no checkpoint; the text equals the checkpoint's run."""
    import shutil

    source = tmp_path / "src"
    shutil.copytree(tiny, source)
    with pytest.raises(SystemExit) as done:
        main([str(source), "-o", str(tmp_path / "art"), "--verify", "none", "--max-seqs", "2", "--max-context", "32",
              "--max-step-tokens", "8"])
    assert done.value.code == 0
    capsys.readouterr()
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= set(manifest["files"])
    assert (tmp_path / "art" / "chat_template.jinja").read_text() == (source / "chat_template.jinja").read_text()
    want = _run(capsys, source, "--prompt", "A compiler", "--max-new-tokens", "5", "--ignore-eos")[1]
    shutil.rmtree(source)
    code, out, err = _run(capsys, tmp_path / "art", "--prompt", "A compiler", "--max-new-tokens", "5", "--ignore-eos")
    assert code == 0 and out == want, err


def test_text_stream_pieces_add_up_and_stop_strings_cut_before_themselves():
    """Streaming text (TextStream): the pieces of any id sequence add up to its whole text — multi-byte characters
    split over byte-level tokens come out whole, never as U+FFFD — and a stop string that spans several tokens ends
    the text just before it; text that could still begin a stop string is held back, then released when it does not."""
    from qcompile.frontend.tokenizer import TextStream

    tokenizer = train_tiny_tokenizer(400)
    text = "Serving café ünïcode 😀 tokens, then a stop marker END and more."
    ids = tokenizer.encode(text).ids
    stream = TextStream(tokenizer)
    pieces = [stream.push(t) for t in ids]
    assert "".join(pieces) + stream.finish() == text == decode(tokenizer, ids)
    assert not any("\ufffd" in piece for piece in pieces)
    assert len([p for p in pieces if p]) > len(ids) // 2  # pieces come as tokens do, not all at the end
    stop = TextStream(tokenizer, ("marker END",))
    streamed = "".join(stop.push(t) for t in ids) + stop.finish()
    assert stop.stopped and streamed == "Serving café ünïcode 😀 tokens, then a stop "
    held = TextStream(tokenizer, ("stop marker X",))
    out = [held.push(t) for t in ids]
    assert not held.stopped and "".join(out) + held.finish() == text
    # while "stop marker " could still grow into the stop string, it was not sent
    sent = ""
    for t, piece in zip(ids, out):
        sent += piece
        assert not sent.endswith("stop marker")
    # special tokens (eos) show no text in a stream
    eos = TextStream(tokenizer)
    assert eos.push(2) == "" and eos.finish() == ""
