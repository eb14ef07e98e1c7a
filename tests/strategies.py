"""Hypothesis strategies: random valid configs of both families, written as real tiny checkpoints.

The configs vary what the passes and the importer must handle — layer patterns (GDN/attention mixes, Qwen3-Next dense
layers), KV heads 1–8 with GQA groups, GDN value/key head ratios, expert counts and top-k, head dims — while staying
small enough that a checkpoint is written and compiled in seconds.
"""

from __future__ import annotations

import copy
import os
import random

from hypothesis import strategies as st

from qcompile.frontend.tiny import full_config

#: Seed of the fresh random configs the pass-property tests draw: new every session, shown in pytest's header and in
#: a failure's report; QCOMPILE_PASS_SEED=N draws the same configs again.
FRESH_SEED = int(os.environ.get("QCOMPILE_PASS_SEED") or random.SystemRandom().getrandbits(32))


@st.composite
def model_configs(draw, max_layers: int = 4, both_kinds: bool = False) -> dict:
    """A random valid config of either family, 1..max_layers layers of random kinds; with both_kinds, 2+ layers of
    which at least one is GDN and one attention, as in every published checkpoint of these families (so every fusion
    and cache pass has work in every example)."""
    family = draw(st.sampled_from(["qwen3_5_moe", "qwen3_next"]))
    config = copy.deepcopy(full_config("tiny", family, "f32"))
    text = config["text_config"] if family == "qwen3_5_moe" else config
    layers = draw(st.integers(2 if both_kinds else 1, max_layers))
    kinds = draw(st.lists(st.sampled_from(["linear_attention", "full_attention"]), min_size=layers, max_size=layers))
    if both_kinds and len(set(kinds)) == 1:
        flip = draw(st.integers(0, layers - 1))
        kinds[flip] = "full_attention" if kinds[flip] == "linear_attention" else "linear_attention"
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


# ------------------------------------------------------------------------------------------------------------------
# Random transformers-made checkpoints in random Hub layouts (the fidelity fuzz, tests/test_fidelity_fuzz.py)

FULL, LINEAR = "full_attention", "linear_attention"
# Prompt lengths around the GDN chunk (64) and the engine's token buckets, plus anything in 1..130.
EDGE_PROMPT_LENGTHS = [1, 2, 63, 64, 65, 127, 128, 129, 130]


@st.composite
def hf_cases(draw) -> dict:
    """One fuzz case: a family, text-config overrides for hf_oracle, a Hub layout and a prompt length.

    Covers layer patterns (full_attention_interval 1–4 or an explicit list), KV heads 1–4 with GQA groups 1–3, GDN
    value/key head ratios 1–3, conv kernels 2–4, experts 2–16 with top-k 1–4, Qwen3-Next dense layers
    (mlp_only_layers, decoder_sparse_step) and norm_topk_prob, RMSNorm eps, rope theta and partial rotary factor, tied
    and untied heads (a Qwen3.5 wrapper's top-level flag drawn apart from text_config's), vocab and hidden sizes;
    layouts wrapper / flat, stacked / per-expert, one file / 2–3 shards with an index, legacy config keys.
    """
    family = draw(st.sampled_from(["qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text"]))
    layers = draw(st.sampled_from([1, 2, 3, 4, 5]))
    if draw(st.booleans()):
        interval = draw(st.integers(1, 4))
        pattern = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(layers)]
    else:
        pattern = draw(st.lists(st.sampled_from([LINEAR, FULL]), min_size=layers, max_size=layers))
    kv_heads = draw(st.integers(1, 4))
    head_dim = draw(st.sampled_from([16, 32, 64]))
    rotary = draw(st.sampled_from([0.25, 0.5, 1.0]))
    key_heads = draw(st.integers(1, 3))
    experts = draw(st.sampled_from(range(2, 17)))  # sampled_from draws evenly; integers() favours the small end
    overrides = dict(
        vocab_size=draw(st.sampled_from([96, 160, 512, 600])),
        hidden_size=draw(st.sampled_from([32, 48, 64, 96])),
        num_hidden_layers=layers,
        layer_types=pattern,
        num_key_value_heads=kv_heads,
        num_attention_heads=kv_heads * draw(st.integers(1, 3)),
        head_dim=head_dim,
        partial_rotary_factor=rotary,
        rope_theta=draw(st.sampled_from([1e4, 1e6, 1e7])),
        linear_num_key_heads=key_heads,
        linear_num_value_heads=key_heads * draw(st.integers(1, 3)),
        linear_key_head_dim=draw(st.sampled_from([8, 16])),
        linear_value_head_dim=draw(st.sampled_from([8, 16, 24])),
        linear_conv_kernel_dim=draw(st.sampled_from([2, 3, 4])),
        num_experts=experts,
        num_experts_per_tok=draw(st.integers(1, min(experts, 4))),
        moe_intermediate_size=draw(st.sampled_from([8, 24, 40])),
        shared_expert_intermediate_size=draw(st.sampled_from([16, 40])),
        rms_norm_eps=draw(st.sampled_from([1e-6, 1e-5])),
        tie_word_embeddings=draw(st.booleans()),
    )
    if family == "qwen3_next":
        overrides.update(
            decoder_sparse_step=draw(st.sampled_from([1, 1, 2])),
            mlp_only_layers=draw(st.lists(st.integers(0, layers - 1), max_size=2, unique=True)),
            norm_topk_prob=draw(st.booleans()),
            intermediate_size=draw(st.sampled_from([24, 40])),
        )
    shards = draw(st.sampled_from([1, 1, 2, 3]))
    return dict(
        family=family,
        overrides=overrides,
        wrapper_tie=draw(st.booleans()) if family == "qwen3_5_moe" else None,
        stacked_experts=draw(st.booleans()),
        shards=shards,
        legacy_config=shards > 1 and draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
        prompt_len=draw(st.sampled_from(EDGE_PROMPT_LENGTHS + list(range(1, 131)))),
    )


def transformers_cannot_run(case: dict) -> str | None:
    """Why transformers 5.24 itself cannot run this config (it is filtered out, not counted as a pass), or None."""
    if FULL not in case["overrides"]["layer_types"]:
        return "no full-attention layer (transformers' hybrid cache asks an attention layer for the sequence length)"
    return None
