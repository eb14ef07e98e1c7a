"""Hypothesis strategies: random valid configs of both families, written as real tiny checkpoints.

The configs vary what the passes and the importer must handle — layer patterns (GDN/attention mixes, Qwen3-Next dense
layers), KV heads 1–8 with GQA groups, GDN value/key head ratios, expert counts and top-k, head dims — while staying
small enough that a checkpoint is written and compiled in seconds.
"""

from __future__ import annotations

import copy

from hypothesis import strategies as st

from qcompile.frontend.tiny import full_config


@st.composite
def model_configs(draw) -> dict:
    family = draw(st.sampled_from(["qwen3_5_moe", "qwen3_next"]))
    config = copy.deepcopy(full_config("tiny", family, "f32"))
    text = config["text_config"] if family == "qwen3_5_moe" else config
    layers = draw(st.integers(1, 4))
    kinds = draw(st.lists(st.sampled_from(["linear_attention", "full_attention"]), min_size=layers, max_size=layers))
    kv_heads = draw(st.integers(1, 8))
    experts = draw(st.integers(2, 8))
    key_heads = draw(st.integers(1, 3))
    text.update(
        vocab_size=draw(st.sampled_from([128, 160])),
        hidden_size=draw(st.sampled_from([32, 48, 64])),
        num_hidden_layers=layers,
        layer_types=kinds,
        num_key_value_heads=kv_heads,
        num_attention_heads=kv_heads * draw(st.integers(1, 2)),
        head_dim=draw(st.sampled_from([16, 32])),
        linear_num_key_heads=key_heads,
        linear_num_value_heads=key_heads * draw(st.integers(1, 3)),
        linear_key_head_dim=draw(st.sampled_from([8, 16])),
        linear_value_head_dim=draw(st.sampled_from([8, 24])),
        num_experts=experts,
        num_experts_per_tok=draw(st.integers(1, min(experts, 4))),
        moe_intermediate_size=draw(st.sampled_from([8, 24])),
        shared_expert_intermediate_size=draw(st.sampled_from([16, 40])),
    )
    if family == "qwen3_5_moe":
        half = int(text["head_dim"] * 0.25) // 2
        text["rope_parameters"]["mrope_section"] = [half - 2 * (half // 3), half // 3, half // 3]
    else:
        text.update(
            decoder_sparse_step=draw(st.sampled_from([1, 2])),
            mlp_only_layers=draw(st.lists(st.integers(0, layers - 1), max_size=2, unique=True)),
            norm_topk_prob=draw(st.booleans()),
            intermediate_size=draw(st.sampled_from([24, 40])),
        )
    return config
