"""The unoptimized graph against Hugging Face transformers (the oracle), on tiny random checkpoints it builds.

fp32 bound: max |ours − HF| ≤ 1e-4 · max(1, max |HF|) (spec/model.md §5: the fp32 noise floor is 3–8e-5 on logits
of magnitude ~4). Greedy tokens must be identical. bf16 is judged by top-1 agreement and KL (see test_bf16).
"""

from __future__ import annotations

import numpy as np
import pytest

import hf_oracle
from qcompile.ir.abi import CacheConfig

FAMILIES = ["qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text"]
PROMPT = [int(x) for x in np.random.default_rng(7).integers(3, 500, size=37)]


def assert_close(ours, ref, what: str, rel: float = 1e-4):
    ours, ref = np.asarray(ours, np.float32), np.asarray(ref, np.float32)
    assert ours.shape == ref.shape, f"{what}: shape {ours.shape} vs {ref.shape}"
    bound = rel * max(1.0, float(np.abs(ref).max()))
    err = float(np.abs(ours - ref).max())
    assert err <= bound, f"{what}: max abs error {err:.3g} > {bound:.3g}"
    return err


def prompt_logits(model, ids, **cache):
    engine = model.engine(CacheConfig(**{"max_seqs": 4, "max_context": 128, **cache}))
    seq = engine.add_sequence()
    return engine.step([(seq, list(ids))], all_logits=True)[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_logits_match_transformers(family, hf_checkpoint, qc_model):
    path = hf_checkpoint(family)
    ref = hf_oracle.hf_logits(path, PROMPT)
    assert np.abs(ref).max() > 1.0  # a well-scaled model, not a near-zero one
    assert_close(prompt_logits(qc_model(path), PROMPT), ref, f"{family} prompt logits")


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_decode_matches_transformers(family, hf_checkpoint, qc_model):
    path = hf_checkpoint(family)
    steps = 17  # the prefill's token, then 16 single-token decode steps
    ref_tokens, ref_logits = hf_oracle.hf_greedy(path, PROMPT[:20], steps)
    engine = qc_model(path).engine(CacheConfig(max_seqs=4, max_context=64))
    out = engine.generate([PROMPT[:20]], steps, step_logits=True)
    assert out["tokens"][0] == ref_tokens
    for i, (ours, ref) in enumerate(zip(out["step_logits"][0], ref_logits)):
        assert_close(ours, ref, f"{family} decode step {i}")
    assert len(set(ref_tokens)) > 3  # the decode actually moves


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_prompt_split_in_two_chunks_matches_unsplit(family, hf_checkpoint, qc_model):
    path = hf_checkpoint(family)
    model = qc_model(path)
    whole = prompt_logits(model, PROMPT)
    engine = model.engine(CacheConfig(max_seqs=4, max_context=128))
    seq = engine.add_sequence()
    split = 23  # crosses a KV page (16) and leaves a partial conv window
    first = engine.step([(seq, PROMPT[:split])], all_logits=True)[0]
    second = engine.step([(seq, PROMPT[split:])], all_logits=True)[0]
    assert_close(np.concatenate([first, second]), whole, f"{family} split vs whole")
    assert_close(second, hf_oracle.hf_chunked_logits(path, PROMPT, split), f"{family} continuation vs HF")


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_ragged_and_mixed_batches_match_each_sequence_alone(family, hf_checkpoint, qc_model):
    path = hf_checkpoint(family)
    model = qc_model(path)
    prompts = [PROMPT[:5], PROMPT[3:30], PROMPT[10:21]]
    engine = model.engine(CacheConfig(max_seqs=4, max_context=64))
    seqs = [engine.add_sequence() for _ in prompts]
    together = engine.step(list(zip(seqs, prompts)), all_logits=True)
    for prompt, got in zip(prompts, together):
        assert_close(got, hf_oracle.hf_logits(path, prompt), f"{family} ragged sequence of {len(prompt)}")
    # A mixed step: two sequences decode one token each while a new one prefills.
    fresh = engine.add_sequence()
    nxt = [int(np.argmax(x[-1])) for x in together[:2]]
    mixed = engine.step([(seqs[0], [nxt[0]]), (fresh, PROMPT[:9]), (seqs[1], [nxt[1]])], all_logits=True)
    assert_close(mixed[0][-1], hf_oracle.hf_logits(path, prompts[0] + [nxt[0]])[-1], f"{family} mixed decode 0")
    assert_close(mixed[1], hf_oracle.hf_logits(path, PROMPT[:9]), f"{family} mixed prefill")
    assert_close(mixed[2][-1], hf_oracle.hf_logits(path, prompts[1] + [nxt[1]])[-1], f"{family} mixed decode 1")


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_hub_style_sharded_checkpoint_loads_and_matches(family, hf_checkpoint, qc_model, tmp_path):
    from qcompile.frontend.checkpoint import Checkpoint

    src = hf_checkpoint(family)
    hub = hf_oracle.reshard_hub_style(src, tmp_path / "hub", n_shards=3, legacy_config=True)
    ckpt = Checkpoint.open(hub / "model.safetensors.index.json")
    assert ckpt.unknown == [] and any(n.startswith("mtp.") for n in ckpt.ignored)
    assert len({info.path for info in map(ckpt.store.info, ckpt.store.names())}) == 3
    ours = prompt_logits(qc_model(hub), PROMPT)
    assert np.array_equal(ours, prompt_logits(qc_model(src), PROMPT))  # same weights, same graph: bitwise
    assert_close(ours, hf_oracle.hf_logits(hub, PROMPT), f"{family} hub-style vs HF")


VARIANTS = {
    # name: (family, make_hf_checkpoint kwargs)
    "next-dense-layers": ("qwen3_next", dict(overrides={"num_hidden_layers": 4, "mlp_only_layers": [0],
                                                        "decoder_sparse_step": 2, "intermediate_size": 112})),
    "next-no-renorm-stacked": ("qwen3_next", dict(overrides={"norm_topk_prob": False}, stacked_experts=True)),
    "next-tied-mqa-gva1": ("qwen3_next", dict(overrides={"tie_word_embeddings": True, "num_key_value_heads": 1,
                                                         "linear_num_value_heads": 2})),
    "qwen35-per-expert-interval2": ("qwen3_5_moe", dict(overrides={"full_attention_interval": 2},
                                                        stacked_experts=False)),
    "qwen35-f16": ("qwen3_5_moe", dict(dtype="float16")),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_config_and_layout_variants_match_transformers(variant, hf_checkpoint, qc_model):
    family, kwargs = VARIANTS[variant]
    path = hf_checkpoint(family, variant, **kwargs)
    model = qc_model(path, "f32")
    ref = hf_oracle.hf_logits(path, PROMPT, dtype="float32")
    assert_close(prompt_logits(model, PROMPT), ref, f"{variant} prompt logits")


def test_variant_structure_is_what_the_config_says(hf_checkpoint, qc_model):
    """The variants above really exercise what they claim (dense layers, tied head, stacked experts)."""
    dense = qc_model(hf_checkpoint("qwen3_next", "next-dense-layers", **VARIANTS["next-dense-layers"][1]))
    assert dense.checkpoint.config.moe_layers == (False, True, False, True)
    assert "layers.0.mlp.gate_proj" in dense.params and "layers.0.mlp.gate" not in dense.params
    tied = qc_model(hf_checkpoint("qwen3_next", "next-tied-mqa-gva1", **VARIANTS["next-tied-mqa-gva1"][1]))
    assert tied.checkpoint.params["lm_head"].sources == tied.checkpoint.params["embed_tokens"].sources
    stacked = qc_model(hf_checkpoint("qwen3_next", "next-no-renorm-stacked", **VARIANTS["next-no-renorm-stacked"][1]))
    assert stacked.checkpoint.params["layers.0.mlp.experts.gate_proj"].kind == "rows"
    assert not stacked.checkpoint.config.norm_topk_prob


def test_chunked_prefill_under_a_token_budget_gives_the_same_result(hf_checkpoint, qc_model):
    model = qc_model(hf_checkpoint("qwen3_5_moe"))
    prompts = [PROMPT[:30], PROMPT[5:12], PROMPT[2:25]]
    whole = model.engine(CacheConfig(max_seqs=4, max_context=64)).generate(prompts, 3, prompt_logits=True)
    small = model.engine(CacheConfig(max_seqs=4, max_context=64, max_step_tokens=8)).generate(prompts, 3, prompt_logits=True)
    assert small["tokens"] == whole["tokens"]
    # The 8-token steps run the native few-row linear kernel, the whole prefill XLA's dot: the same products summed
    # in another order (1.3e-5 relative measured). Chunking mistakes (a state or KV not carried over) are O(1e-1).
    for a, b in zip(small["prompt_logits"], whole["prompt_logits"]):
        assert_close(a, b, "budgeted prefill", rel=5e-5)
