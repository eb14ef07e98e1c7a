"""config.json → ModelConfig: one frozen description of the text model, whatever the family or key vintage.

Why: Qwen3-Next and Qwen3.5-MoE checkpoints spell the same architecture several ways (a multimodal wrapper with
`text_config`, a flat text-only save, legacy top-level `rope_theta` / `partial_rotary_factor` /
`full_attention_interval` next to transformers-5 `rope_parameters` / `layer_types`). Everything downstream reads
only `ModelConfig`, so these spellings are resolved here, once, with the defaults transformers 5.24 applies
(spec/model.md §1).
"""

from __future__ import annotations

import json
import math
import stat
from pathlib import Path
from typing import Any

import attrs

from qcompile.errors import CheckpointError, one_line
from qcompile.frontend.quantization import Quantization, parse_quantization

FAMILIES = ("qwen3_next", "qwen3_5_moe")
LINEAR, FULL = "linear_attention", "full_attention"
_WRAPPER_TYPES = {"qwen3_5_moe": "qwen3_5_moe"}
_FLAT_TYPES = {"qwen3_next": "qwen3_next", "qwen3_5_moe_text": "qwen3_5_moe"}
_DTYPE_NAMES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


@attrs.frozen
class ModelConfig:
    """The text model's architecture. Names follow spec/model.md's notation in comments."""

    family: str  # "qwen3_next" | "qwen3_5_moe"
    model_type: str  # as written in config.json (qwen3_next, qwen3_5_moe, qwen3_5_moe_text)
    vocab_size: int
    hidden_size: int  # H
    num_layers: int  # L
    layer_types: tuple[str, ...]
    num_heads: int  # Hq
    num_kv_heads: int  # Hkv
    head_dim: int  # hd
    rope_theta: float
    partial_rotary_factor: float
    linear_num_key_heads: int  # Hk
    linear_num_value_heads: int  # Hv
    linear_key_head_dim: int  # dk
    linear_value_head_dim: int  # dv
    conv_kernel: int  # K
    num_experts: int  # E
    top_k: int  # k
    moe_intermediate_size: int  # I
    shared_expert_intermediate_size: int  # Is
    intermediate_size: int  # dense-MLP width (Qwen3-Next mlp_only layers)
    moe_layers: tuple[bool, ...]  # per layer: routed MoE (True) or dense SwiGLU MLP (False)
    norm_topk_prob: bool
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    dtype: str  # checkpoint's declared dtype: f32 | bf16 | f16
    eos_token_ids: tuple[int, ...] = ()  # generation stops after one of these (config, else generation_config.json)
    quantization: Quantization | None = None  # FP8 checkpoints (frontend/quantization.py)
    max_position_embeddings: int | None = None  # the context the model was trained for (None: not stated)
    # generation_config.json's sampling fields that differ from transformers' defaults (`generation_defaults`)
    generation_defaults: tuple[tuple[str, float], ...] = ()

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def gva_ratio(self) -> int:  # r = Hv / Hk
        return self.linear_num_value_heads // self.linear_num_key_heads

    def context_warning(self, tokens: int, what: str) -> str | None:
        """A warning when `what` (a context of `tokens` tokens) reaches past max_position_embeddings: positions the
        model was not trained on. transformers runs them too (RoPE has no hard limit), so it is not an error."""
        limit = self.max_position_embeddings
        if not limit or tokens <= limit:
            return None
        return (f"qcompile: warning: {what} allows {tokens} tokens, past the checkpoint's max_position_embeddings "
                f"({limit}); positions beyond it were not trained and output quality may fall there")

    def layer_counts(self) -> dict[str, int]:
        return {t: self.layer_types.count(t) for t in (LINEAR, FULL)}

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


def _need(cfg: dict, key: str, where: str) -> Any:
    if key not in cfg:
        raise CheckpointError(f"{where}: missing required key '{key}'")
    return cfg[key]


def _int(cfg: dict, key: str, where: str, default: int | None = None) -> int:
    value = cfg.get(key, default) if default is not None else _need(cfg, key, where)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(f"{where}: '{key}' must be a non-negative integer, got {value!r}")
    return value


def _float(cfg: dict, key: str, where: str, default: float) -> float:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CheckpointError(f"{where}: '{key}' must be a number, got {value!r}")
    return float(value)


def _object(cfg: dict, key: str, where: str) -> dict:
    value = cfg.get(key) or {}
    if not isinstance(value, dict):
        raise CheckpointError(f"{where}: '{key}' must be a JSON object, got {value!r}")
    return value


def _rope(text: dict, where: str) -> tuple[float, float]:
    """theta and partial rotary factor from rope_parameters, legacy top-level keys, or rope_scaling; default prf 0.25."""
    params = _object(text, "rope_parameters", where)
    theta = _float(params if "rope_theta" in params else text, "rope_theta", where, 10000.0)
    prf_from = params if "partial_rotary_factor" in params else text
    prf = _float(prf_from, "partial_rotary_factor", where, 0.25)
    rope_type = params.get("rope_type", _object(text, "rope_scaling", where).get("rope_type", "default"))
    if rope_type != "default":
        raise CheckpointError(f"{where}: rope_type {rope_type!r} is not supported (only 'default')")
    return theta, prf


def _is_index(value: Any) -> bool:
    return type(value) is int and value >= 0


def _layer_types(text: dict, num_layers: int, where: str) -> tuple[str, ...]:
    if "layer_types" in text and text["layer_types"] is not None:
        types = text["layer_types"]
        if not isinstance(types, list) or len(types) != num_layers or any(t not in (LINEAR, FULL) for t in types):
            raise CheckpointError(
                f"{where}: layer_types must list {num_layers} entries of '{LINEAR}' / '{FULL}', got {types!r}"
            )
        return tuple(types)
    interval = _int(text, "full_attention_interval", where, default=4)
    if interval == 0:
        raise CheckpointError(f"{where}: full_attention_interval must be positive")
    return tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers))


def parse_config(raw: dict, where: str = "config.json") -> ModelConfig:
    """Resolve a config.json dict (either family, wrapper or flat, legacy or transformers-5 keys)."""
    model_type = raw.get("model_type")
    if not isinstance(model_type, str):  # not a name (absent, null, a list...): unsupported, and unhashable-safe
        model_type = None if model_type is None else repr(model_type)
    if model_type in _WRAPPER_TYPES:
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise CheckpointError(f"{where}: model_type '{model_type}' needs a 'text_config' object")
        family = _WRAPPER_TYPES[model_type]
        dtype_name = text.get("dtype") or text.get("torch_dtype") or raw.get("dtype") or raw.get("torch_dtype")
    elif model_type in _FLAT_TYPES:
        text, family = raw, _FLAT_TYPES[model_type]
        dtype_name = raw.get("dtype") or raw.get("torch_dtype")
    else:
        known = ", ".join(sorted({**_WRAPPER_TYPES, **_FLAT_TYPES}))
        raise CheckpointError(f"{where}: unsupported model_type {model_type!r}; qcompile reads {known}")

    num_layers = _int(text, "num_hidden_layers", where)
    hidden = _int(text, "hidden_size", where)
    num_heads = _int(text, "num_attention_heads", where)
    num_experts = _int(text, "num_experts", where)
    layer_types = _layer_types(text, num_layers, where)
    if family == "qwen3_next":
        step = _int(text, "decoder_sparse_step", where, default=1)
        mlp_only = text.get("mlp_only_layers") or []
        if not isinstance(mlp_only, list) or not all(_is_index(i) for i in mlp_only):
            raise CheckpointError(f"{where}: 'mlp_only_layers' must be a list of layer indices, got {mlp_only!r}")
        mlp_only = set(mlp_only)
        moe_layers = tuple(
            i not in mlp_only and num_experts > 0 and step > 0 and (i + 1) % step == 0 for i in range(num_layers)
        )
        norm_topk = bool(text.get("norm_topk_prob", True))
    else:  # Qwen3.5-MoE: every layer is MoE and the router always renormalises (spec §1.2)
        moe_layers = (True,) * num_layers
        norm_topk = True
    theta, prf = _rope(text, where)
    act = text.get("hidden_act", "silu")
    if act not in ("silu", "swish"):  # every MLP and the GDN gate of both families are SiLU (spec/model.md)
        raise CheckpointError(f"{where}: hidden_act {act!r} is not supported; Qwen3.5-MoE and Qwen3-Next use 'silu'")
    cfg = ModelConfig(
        family=family,
        model_type=model_type,
        vocab_size=_int(text, "vocab_size", where),
        hidden_size=hidden,
        num_layers=num_layers,
        layer_types=layer_types,
        num_heads=num_heads,
        num_kv_heads=_int(text, "num_key_value_heads", where),
        head_dim=_int(text, "head_dim", where, default=hidden // max(num_heads, 1)),
        rope_theta=theta,
        partial_rotary_factor=prf,
        linear_num_key_heads=_int(text, "linear_num_key_heads", where),
        linear_num_value_heads=_int(text, "linear_num_value_heads", where),
        linear_key_head_dim=_int(text, "linear_key_head_dim", where),
        linear_value_head_dim=_int(text, "linear_value_head_dim", where),
        conv_kernel=_int(text, "linear_conv_kernel_dim", where, default=4),
        num_experts=num_experts,
        top_k=_int(text, "num_experts_per_tok", where),
        moe_intermediate_size=_int(text, "moe_intermediate_size", where),
        shared_expert_intermediate_size=_int(text, "shared_expert_intermediate_size", where),
        intermediate_size=_int(text, "intermediate_size", where, default=0),
        moe_layers=moe_layers,
        norm_topk_prob=norm_topk,
        rms_norm_eps=_float(text, "rms_norm_eps", where, 1e-6),
        tie_word_embeddings=_tied(raw, model_type in _WRAPPER_TYPES, where),
        attention_bias=bool(text.get("attention_bias", False)),
        dtype=_DTYPE_NAMES.get(str(dtype_name), "bf16" if dtype_name is None else str(dtype_name)),
        eos_token_ids=eos_ids(text.get("eos_token_id", raw.get("eos_token_id")), where) or (),
        quantization=parse_quantization(raw, where),
        max_position_embeddings=None if text.get("max_position_embeddings") is None
        else _int(text, "max_position_embeddings", where),
    )
    _check_consistency(cfg, where)
    return cfg


def _tied(raw: dict, wrapper: bool, where: str) -> bool:
    """Whether the head is tied to the embeddings, by transformers' rule for each config vintage.

    The flag is read from the config of the class that owns `lm_head`: for a multimodal wrapper
    (`Qwen3_5MoeForConditionalGeneration`) that is the wrapper's top-level `tie_word_embeddings`, whatever
    `text_config` says (transformers saves `text_config.tie_word_embeddings = false` beside a tied wrapper and writes no
    `lm_head.weight`); for a flat config it is the config's own flag. A wrapper config without the top-level key
    (written before the wrapper carried it) falls back to `text_config`'s flag; absent everywhere means false (every
    class's default). A `lm_head.weight` present in the checkpoint is used even when the flag says tied, as
    transformers does (`canonical_params`), so the fallback only decides between tying and refusing.
    """
    holder = raw if not wrapper or "tie_word_embeddings" in raw else raw["text_config"]
    value = holder.get("tie_word_embeddings") or False  # null reads as false, as transformers' truth test does
    if not isinstance(value, bool):
        scope = "top-level " if holder is raw and wrapper else "text_config." if wrapper else ""
        raise CheckpointError(f"{where}: {scope}'tie_word_embeddings' must be true or false, got {value!r}")
    return value


def _check_consistency(cfg: ModelConfig, where: str) -> None:
    problems = []
    if cfg.num_kv_heads == 0 or cfg.num_heads % cfg.num_kv_heads:
        problems.append(f"num_attention_heads {cfg.num_heads} is not a multiple of num_key_value_heads {cfg.num_kv_heads}")
    if cfg.linear_num_key_heads == 0 or cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        problems.append(
            f"linear_num_value_heads {cfg.linear_num_value_heads} is not a multiple of "
            f"linear_num_key_heads {cfg.linear_num_key_heads}"
        )
    if any(cfg.moe_layers) and not (0 < cfg.top_k <= cfg.num_experts):
        problems.append(f"num_experts_per_tok {cfg.top_k} must be in 1..num_experts ({cfg.num_experts})")
    if not (math.isfinite(cfg.rms_norm_eps) and cfg.rms_norm_eps > 0):
        problems.append(f"rms_norm_eps must be a positive number, got {cfg.rms_norm_eps}")
    if not 0 < cfg.partial_rotary_factor <= 1:
        problems.append(f"partial_rotary_factor must be in (0, 1], got {cfg.partial_rotary_factor}")
    if not math.isfinite(cfg.rope_theta) or cfg.rope_theta <= 0:
        problems.append(f"rope_theta must be a positive number, got {cfg.rope_theta}")
    outside = [i for i in cfg.eos_token_ids if not 0 <= i < cfg.vocab_size]
    if outside:
        problems.append(f"eos_token_id {outside[0]} is outside the vocabulary (0..{cfg.vocab_size - 1})")
    if cfg.rotary_dim % 2:
        problems.append(f"rotary dims head_dim x partial_rotary_factor = {cfg.rotary_dim} must be even")
    if not all(cfg.moe_layers) and cfg.intermediate_size == 0:
        problems.append("dense MLP layers need intermediate_size > 0")
    if cfg.attention_bias:
        problems.append("attention_bias = true is not supported (no released checkpoint uses it)")
    if cfg.dtype not in ("f32", "bf16", "f16"):
        problems.append(f"dtype {cfg.dtype!r} is not one of float32, bfloat16, float16")
    if problems:
        raise CheckpointError(one_line(f"{where}: " + "; ".join(problems)))


def eos_ids(value, where) -> tuple[int, ...] | None:
    """An `eos_token_id` entry (int, list of ints, or null) as a tuple of ids; None when it is absent or null."""
    if value is None:
        return None
    values = value if isinstance(value, list) else [value]
    if not all(type(v) is int and v >= 0 for v in values):
        raise CheckpointError(f"{where}: 'eos_token_id' must be a token id or a list of token ids, got {value!r}")
    return tuple(values)


#: generation_config.json's sampling fields a server takes as its requests' defaults, as vLLM's `--generation-config
#: auto` does, with transformers' GenerationConfig defaults: a field at that value is not taken (vLLM reads the file's
#: difference from them), nor one that is not a finite number (top_k: an integer).
SAMPLING_FIELDS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None, "repetition_penalty": 1.0}


def generation_defaults(generation: dict) -> tuple[tuple[str, float], ...]:
    """The sampling defaults a generation_config.json sets (SAMPLING_FIELDS), in that order."""
    taken = []
    for field, transformers_default in SAMPLING_FIELDS.items():
        value = generation.get(field)
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if number and (field != "top_k" or float(value).is_integer()) and value != transformers_default:
            taken.append((field, int(value) if field == "top_k" else float(value)))
    return tuple(taken)


MAX_CONFIG_BYTES = 16 << 20  # a Hugging Face config.json is a few KB


def load_config(path: str | Path) -> ModelConfig:
    """Read and resolve a config.json file."""
    path = Path(path)
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):  # a FIFO would block, /dev/zero would never end
            raise CheckpointError(f"{path}: cannot read config.json: not a regular file")
        if info.st_size > MAX_CONFIG_BYTES:
            raise CheckpointError(f"{path}: {info.st_size} bytes is not a config.json (at most {MAX_CONFIG_BYTES})")
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        if (path.parent / "manifest.json").is_file():  # an artifact where a checkpoint is wanted
            raise CheckpointError(f"{path.parent}: is a qcompile artifact; this needs the Hugging Face checkpoint "
                                  "(config.json and safetensors) it was compiled from") from None
        if (path.parent / "graph.qir").is_file() or (path.parent / "exec").is_dir():
            raise CheckpointError(f"{path.parent}: looks like a qcompile artifact without its manifest.json (an "
                                  "incomplete copy?); compile it again") from None
        raise CheckpointError(f"{path}: config.json not found; a checkpoint needs its config.json beside the weights")
    except OSError as err:  # a directory, no permission, an I/O error
        raise CheckpointError(one_line(f"{path}: cannot read config.json ({err.strerror or err})"))
    except (ValueError, RecursionError) as err:  # bad UTF-8 or JSON, an over-long integer, absurd nesting
        raise CheckpointError(one_line(f"{path}: not valid JSON ({type(err).__name__}: {err})"))
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    cfg = parse_config(raw, where=str(path))
    generation = path.with_name("generation_config.json")
    if generation.is_file():
        try:
            gen = json.loads(generation.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):
            gen = None
        if isinstance(gen, dict):
            if not cfg.eos_token_ids:
                cfg = attrs.evolve(cfg, eos_token_ids=eos_ids(gen.get("eos_token_id"), str(generation)) or ())
            cfg = attrs.evolve(cfg, generation_defaults=generation_defaults(gen))
    return cfg
