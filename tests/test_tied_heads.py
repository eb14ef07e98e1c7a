"""Tied and untied heads, wrapper and flat: the head qcompile uses is the one transformers uses.

transformers' rule (5.24): the class that owns `lm_head` decides by its own config. A Qwen3.5 wrapper
(`Qwen3_5MoeForConditionalGeneration`) ties by the wrapper's top-level `tie_word_embeddings`, whatever `text_config`
says, and then saves no `lm_head.weight`; a flat config ties by its own flag; a stored `lm_head.weight` is used even
where the flag says tied. The oracle here is the class named in config.json's `architectures` (the class that wrote the
checkpoint): `AutoModelForCausalLM` on a wrapper reads `text_config`'s flag and, where the two differ, gives a randomly
initialised head, so it cannot judge these cases.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import hf_oracle
from qcompile.frontend.safetensors_io import TensorStore
from test_fidelity import assert_close, prompt_logits

SMALL = {"num_hidden_layers": 2, "full_attention_interval": 2}
PROMPT = [int(x) for x in np.random.default_rng(11).integers(3, 500, size=23)]


def _stored(path) -> set[str]:
    return set(TensorStore.open(path / "model.safetensors").names())


@pytest.mark.parametrize("top, text", [(True, False), (False, True), (True, True)])
def test_wrapper_head_follows_the_top_level_flag(top, text, hf_checkpoint, qc_model):
    path = hf_checkpoint("qwen3_5_moe", f"tie-top{top:d}-text{text:d}",
                         overrides={**SMALL, "tie_word_embeddings": text}, wrapper_tie=top)
    assert ("lm_head.weight" in _stored(path)) == (not top)  # transformers saved the head iff the wrapper is untied
    model = qc_model(path)
    params = model.checkpoint.params
    assert (params["lm_head"].sources == params["embed_tokens"].sources) == top
    ref = hf_oracle.hf_logits(path, PROMPT, by_architecture=True)
    assert_close(prompt_logits(model, PROMPT), ref, f"wrapper top={top} text={text}")


def test_wrapper_config_without_the_top_level_key_falls_back_to_text_config(hf_checkpoint, qc_model, tmp_path):
    """An older wrapper config.json with the flag only in text_config and no stored head: tied, not refused."""
    src = hf_checkpoint("qwen3_5_moe", "tie-top1-text1", overrides={**SMALL, "tie_word_embeddings": True},
                        wrapper_tie=True)
    old = shutil.copytree(src, tmp_path / "old")
    config = json.loads((old / "config.json").read_text())
    del config["tie_word_embeddings"]
    (old / "config.json").write_text(json.dumps(config))
    assert np.array_equal(prompt_logits(qc_model(old), PROMPT), prompt_logits(qc_model(src), PROMPT))


@pytest.mark.parametrize("family", ["qwen3_5_moe_text", "qwen3_next"])
def test_flat_config_ties_by_its_own_flag(family, hf_checkpoint, qc_model):
    path = hf_checkpoint(family, "tied-small", overrides={**SMALL, "tie_word_embeddings": True})
    assert "lm_head.weight" not in _stored(path)
    model = qc_model(path)
    assert model.checkpoint.params["lm_head"].sources == model.checkpoint.params["embed_tokens"].sources
    assert_close(prompt_logits(model, PROMPT), hf_oracle.hf_logits(path, PROMPT), f"{family} tied")


def test_untied_wrapper_without_a_head_is_refused_with_exit_65(hf_checkpoint, tmp_path):
    """Untied by every flag and no head stored: transformers would initialise a random head; qcompile refuses."""
    from qcompile.cli import main

    src = hf_checkpoint("qwen3_5_moe", "tie-top1-text1", overrides={**SMALL, "tie_word_embeddings": True},
                        wrapper_tie=True)
    bad = shutil.copytree(src, tmp_path / "bad")
    config = json.loads((bad / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit) as exc:
        main(["run", str(bad), "--prompt-ids", "5,6,7", "--max-new-tokens", "1"])
    assert exc.value.code == 65
