"""`qcompile init-tiny`: write a random Hugging Face-format checkpoint (config.json + model.safetensors), no torch.

Why: nothing can be downloaded here, and tests, examples and benchmarks need real checkpoints of the real
architecture. The files use the Hub's layouts — Qwen3.5-MoE as the multimodal wrapper config with
`model.language_model.` names and stacked experts, Qwen3-Next flat with per-expert tensors and the grouped
`in_proj_qkvz` / `in_proj_ba` — so transformers loads them and the loader is exercised on what users have.

Every parameter is drawn at a well-conditioned scale (spec/model.md §4.3): zero-centred norm offsets ~ N(0, 0.2),
the GDN gated-norm weight 1 + N(0, 0.2), A_log = log U(1, 16), dt_bias ~ N(0, 0.5), linear weights ~ N(0, 1/fan_in),
so a (1+w)-versus-w bug or a dropped gate changes the logits.

Presets:
  tiny  — vocab 512, H 96, 4 layers (3 GDN + 1 attention), Hq 4, Hkv 2, hd 64, Hk 2, Hv 4, dk 16, dv 32, E 8, top-2,
          I 40, Is 56: about 0.8 M parameters, distinct dims so a transposed layout cannot hide.
  bench — vocab 32000, H 1024, 8 layers (GDN,GDN,GDN,attn ×2), Hq 8, Hkv 2, hd 128, Hk 4, Hv 8, dk = dv = 128,
          E 64, top-8, I 256, Is 512: 514 M parameters, 162 M active per token (2.06 GB in f32), the Qwen3.5 pattern at a size that
          runs on a 24 GiB CPU machine.
  qwen3.5-397b, qwen3-next-80b — the published full-size shapes (spec/model.md §1.3), written only with --sparse
          (`write_sparse_checkpoint`: real headers, data as file holes that read as zeros).
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np

from qcompile.errors import UsageError, one_line
from qcompile.frontend.chat import CHAT_TEMPLATE_FILE, TINY_CHAT_TEMPLATE, TOKENIZER_CONFIG_FILE
from qcompile.frontend.checkpoint import canonical_params
from qcompile.frontend.config import parse_config
from qcompile.frontend.quantization import parse_quantization, quantize
from qcompile.frontend.safetensors_io import write_safetensors
from qcompile.frontend.tokenizer import TINY_TOKENIZER_CONFIG, TOKENIZER_FILE, train_tiny_tokenizer

PRESETS = {
    "tiny": dict(vocab_size=512, hidden_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                 linear_value_head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=40,
                 shared_expert_intermediate_size=56, rope_theta=10000.0),
    "bench": dict(vocab_size=32000, hidden_size=1024, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                  head_dim=128, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=128,
                  linear_value_head_dim=128, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256,
                  shared_expert_intermediate_size=512, rope_theta=10000000.0),
}
#: Full-size shapes (spec/model.md §1.3), for header-only sparse checkpoints (`init-tiny --sparse`): structure,
#: compile and memory tests at the real widths without 800 GB of data.
FULL_SIZE = {
    "qwen3.5-397b": dict(vocab_size=248320, hidden_size=4096, num_hidden_layers=60, num_attention_heads=32,
                         num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=64,
                         linear_key_head_dim=128, linear_value_head_dim=128, num_experts=512, num_experts_per_tok=10,
                         moe_intermediate_size=1024, shared_expert_intermediate_size=1024, rope_theta=10000000.0),
    "qwen3-next-80b": dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=16,
                           num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                           linear_key_head_dim=128, linear_value_head_dim=128, num_experts=512, num_experts_per_tok=10,
                           moe_intermediate_size=512, shared_expert_intermediate_size=512, rope_theta=5000000.0),
}
PRESETS.update(FULL_SIZE)
TORCH_DTYPE = {"f32": "float32", "bf16": "bfloat16", "fp8": "bfloat16"}
#: Qwen's FP8 releases: e4m3 weights in 128 x 128 blocks; what they keep in bf16 (besides norms and 1-D tensors)
FP8_BLOCK = (128, 128)
FP8_KEEP = ("lm_head", "embed_tokens", "mlp.gate", "mlp.shared_expert_gate", "linear_attn.in_proj_a",
            "linear_attn.in_proj_b", "linear_attn.in_proj_ba", "linear_attn.conv1d")
#: the projections an FP8 checkpoint stores in FP8 (their weight tensors, or the stacked expert tensors)
FP8_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkvz", "in_proj_qkv", "in_proj_z", "out_proj",
                   "gate_proj", "up_proj", "down_proj", "gate_up_proj")
#: Largest checkpoint `init-tiny` fills with random weights; larger presets need --sparse.
MAX_DENSE_BYTES = 8 << 30


def text_config(preset: str, family: str, dtype: str) -> dict:
    if preset not in PRESETS:
        raise UsageError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    base = dict(PRESETS[preset])
    layers = base["num_hidden_layers"]
    base.update(
        hidden_act="silu", rms_norm_eps=1e-6, linear_conv_kernel_dim=4, attention_bias=False, attention_dropout=0.0,
        max_position_embeddings=4096, tie_word_embeddings=False, initializer_range=0.02, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, router_aux_loss_coef=0.001, output_router_logits=False, use_cache=True,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        dtype=TORCH_DTYPE[dtype],
    )
    theta = base.pop("rope_theta")
    rope = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 0.25}
    if family == "qwen3_5_moe":
        rotary_half = int(base["head_dim"] * 0.25) // 2
        third = rotary_half // 3
        rope.update(mrope_interleaved=True, mrope_section=[rotary_half - 2 * third, third, third])
        base["model_type"] = "qwen3_5_moe_text"
    else:
        base.update(model_type="qwen3_next", decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                    intermediate_size=2 * base["moe_intermediate_size"] + 32)
    base["rope_parameters"] = rope
    return base


def full_config(preset: str, family: str, dtype: str) -> dict:
    text = text_config(preset, family, dtype)
    if family == "qwen3_next":
        config = {"architectures": ["Qwen3NextForCausalLM"], **text}
    elif family == "qwen3_5_moe":
        config = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
                  "text_config": text, "tie_word_embeddings": False, "dtype": TORCH_DTYPE[dtype]}
    else:
        raise UsageError(f"unknown family {family!r}; choose qwen3_5_moe or qwen3_next")
    return with_fp8(config) if dtype == "fp8" else config


def with_fp8(config: dict, method: str = "fp8", block: tuple[int, int] = FP8_BLOCK, strategy: str = "channel") -> dict:
    """`config` with a quantization_config: Qwen's block-scaled FP8 (`method` fp8, `block`), or compressed-tensors FP8
    with per-channel or per-tensor scales (`strategy`)."""
    if method == "fp8":
        quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                 "weight_block_size": list(block), "modules_to_not_convert": list(FP8_KEEP)}
    else:
        quant = {"quant_method": "compressed-tensors", "format": "float-quantized",
                 "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                     "num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False},
                     "input_activations": None}},
                 "ignore": list(FP8_KEEP)}
    return {**config, "quantization_config": quant}


def fp8_stored(name: str) -> bool:
    """Whether an FP8 checkpoint of ours stores this Hub tensor in FP8 (a projection's weight, not a kept module)."""
    stem = name[:-len(".weight")] if name.endswith(".weight") else name
    return stem.endswith(FP8_PROJECTIONS) and not any(f".{keep}" in f".{stem}" for keep in FP8_KEEP)


def _init(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if name.endswith("linear_attn.norm.weight"):
        return 1.0 + rng.normal(0.0, 0.2, shape)
    if name.endswith("norm.weight"):  # zero-centred RMSNorms: input/post/final, q_norm, k_norm
        return rng.normal(0.0, 0.2, shape)
    if name.endswith("A_log"):
        return np.log(rng.uniform(1.0, 16.0, shape))
    if name.endswith("dt_bias"):
        return rng.normal(0.0, 0.5, shape)
    if name.endswith("conv1d.weight"):
        return rng.normal(0.0, shape[-1] ** -0.5, shape)
    if name.endswith("embed_tokens.weight"):
        return rng.normal(0.0, 1.0, shape)
    return rng.normal(0.0, shape[-1] ** -0.5, shape)


def write_tiny(out_dir: str | Path, family: str = "qwen3_5_moe", preset: str = "tiny", seed: int = 0,
               dtype: str = "f32") -> Path:
    """Write a preset checkpoint: config.json, generation_config.json, model.safetensors, a small real
    tokenizer.json (frontend/tokenizer.py: byte-level BPE, at most 512 ids), its tokenizer_config.json (the special
    tokens; transformers' AutoTokenizer loads the pair) and chat_template.jinja (frontend/chat.py); return the
    directory."""
    if dtype not in TORCH_DTYPE:
        raise UsageError(f"unknown dtype {dtype!r}; choose f32, bf16 or fp8")
    config = full_config(preset, family, dtype)
    out = write_checkpoint(out_dir, config, seed=seed, dtype=dtype)
    try:
        vocab = int(config.get("text_config", config)["vocab_size"])
        train_tiny_tokenizer(min(vocab, 512)).save(str(out / TOKENIZER_FILE))
        (out / TOKENIZER_CONFIG_FILE).write_text(json.dumps(TINY_TOKENIZER_CONFIG, indent=2) + "\n")
        (out / CHAT_TEMPLATE_FILE).write_text(TINY_CHAT_TEMPLATE)
    except OSError as err:
        raise UsageError(one_line(f"{out}: cannot write the tokenizer ({err.strerror or err})")) from None
    return out


def hub_tensors(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor name and shape a Hub checkpoint of `config` holds (the text model's)."""
    cfg = parse_config(config)
    wrapped = config.get("model_type") == "qwen3_5_moe"
    prefix = "model.language_model." if wrapped else "model."
    stacked = {f"{prefix}layers.{i}.mlp.experts.gate_up_proj" for i in range(cfg.num_layers)} if cfg.family == "qwen3_5_moe" else set()
    sources: dict[str, tuple[int, ...]] = {}
    for ref in canonical_params(cfg, stacked, prefix).values():
        for source in ref.sources:
            sources[source] = ref.source_shape
    return sources


def write_checkpoint(out_dir: str | Path, config: dict, seed: int = 0, dtype: str = "f32") -> Path:
    """Write random weights in the Hub layout of `config` (a config.json dict of either family)."""
    out = Path(out_dir)
    sources = hub_tensors(config)
    np_dtype = np.float32 if dtype == "f32" else ml_dtypes.bfloat16
    total = sum(int(np.prod(shape)) for shape in sources.values()) * np.dtype(np_dtype).itemsize
    if total > MAX_DENSE_BYTES:
        raise UsageError(f"this checkpoint would hold {total / 1e9:.0f} GB of random weights; pass --sparse for a "
                         "header-only one (zeros, no disk blocks) to test compiling at that size")
    quant = parse_quantization(config, "config.json")
    _prepare_dir(out)  # before drawing the weights: a bad DIR fails at once, not after minutes (bench preset)
    tensors = {}
    for name in sorted(sources):
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        values = _init(name, sources[name], rng).astype(np.float32)
        if quant is not None and fp8_stored(name):
            tensors[name], tensors[quant.scale_name(name)] = quantize(values, quant)
        else:
            tensors[name] = values.astype(np_dtype)
    generation = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "do_sample": False}
    try:
        write_safetensors(out / "model.safetensors", tensors, metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    except OSError as err:
        where = err.filename or out
        raise UsageError(one_line(f"{where}: cannot write the checkpoint ({err.strerror or err})")) from None
    return out


def write_sparse_checkpoint(out_dir: str | Path, config: dict, dtype: str = "bf16", shard_bytes: int = 50 * 10**9,
                            ) -> Path:
    """Write a sharded checkpoint of `config` whose data are holes: each shard is a real safetensors header followed
    by `truncate` to its data size, so every tensor reads as zeros and takes no disk blocks (an 800 GB model in
    a few MB). For compile, memory and structure tests at full size; the weights are all zero, so not for numerics.
    Shards of about `shard_bytes`, `model.safetensors.index.json`, config.json and generation_config.json."""
    from qcompile.frontend.safetensors_io import INDEX_FILE_NAME, DTYPES, _header

    out = Path(out_dir)
    _prepare_dir(out)
    np_dtype = DTYPES["F32" if dtype == "f32" else "BF16"]
    shards: list[dict[str, tuple[int, ...]]] = [{}]
    size = 0
    for name, shape in sorted(hub_tensors(config).items()):
        nbytes = int(np.prod(shape)) * np_dtype.itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = shape
        size += nbytes
    weight_map, total = {}, 0
    try:
        for index, tensors in enumerate(shards, start=1):
            file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
            header = _header({n: (np_dtype, shape) for n, shape in tensors.items()}, {"format": "pt"})
            data = sum(int(np.prod(shape)) * np_dtype.itemsize for shape in tensors.values())
            with open(out / file, "wb") as f:
                f.write(len(header).to_bytes(8, "little") + header)
                f.truncate(8 + len(header) + data)
            weight_map.update({n: file for n in tensors})
            total += data
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE_NAME).write_text(json.dumps(index, indent=2) + "\n")
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        generation = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "do_sample": False}
        (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    except OSError as err:
        raise UsageError(one_line(f"{err.filename or out}: cannot write the checkpoint ({err.strerror or err})")) from None
    return out


def _prepare_dir(out: Path) -> None:
    """Create `out` (and its parents), or refuse with a usage error that names the path and why."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out}: exists and is not a directory; choose another DIR")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(one_line(f"{out}: cannot create the directory ({err.strerror or err})")) from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise UsageError(f"{out}: directory is not writable")
