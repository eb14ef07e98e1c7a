"""HF transformers oracle for the tiny Qwen3-Next / Qwen3.5-MoE test checkpoints.

Test-support module (imported as ``hf_oracle`` from tests).  It builds tiny random checkpoints with transformers,
re-randomises every parameter at well-scaled values (spec section 4.3) and runs the HF reference forward pass
(full sequence, greedy decode with the cache, chunked continuation).  It also re-packages a checkpoint the way the
Hub does (shards + index + dummy ``mtp.*`` tensors + legacy config keys).

Written against transformers 5.24 (torch CPU).  Notes on that version:
  * the cache kwarg / output field is ``cache`` (``past_key_values`` is deprecated);
  * ``AutoModelForCausalLM`` on a ``qwen3_5_moe`` wrapper dir gives the text-only ``Qwen3_5MoeForCausalLM``
    (``model.language_model.*`` is mapped to ``model.*``; ``model.visual.*`` and ``mtp.*`` are skipped);
  * in memory both families hold stacked experts; ``save_pretrained`` writes per-expert tensors for a model built from
    a config (``save_original_format=True``, the default) and the stacked form with ``save_original_format=False``.
"""

from __future__ import annotations

import json
import math
import pathlib
import shutil
import zlib

import numpy as np
import torch

torch.set_num_threads(2)

FAMILIES = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}

# Default tiny dims (distinct on purpose so that shapes reveal a transposed layout).
DEFAULT_TEXT_KWARGS = dict(
    vocab_size=512,
    hidden_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=40,
    shared_expert_intermediate_size=56,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    max_position_embeddings=256,
    hidden_act="silu",
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
DEFAULT_ROPE_THETA = 1e4
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.25
DEFAULT_FULL_ATTENTION_INTERVAL = 4
# Qwen3-Next only (unused by the default all-MoE layout, but used by mlp_only_layers / decoder_sparse_step overrides).
DEFAULT_NEXT_EXTRA = dict(intermediate_size=112, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)

TINY_VISION_KWARGS = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    in_channels=3,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=64,
    hidden_act="gelu_pytorch_tanh",
)


def _dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype)]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {sorted(_DTYPES)}") from None


def mrope_section_for(rotary_dim: int) -> list[int]:
    """Split rd/2 frequency slots over (T, H, W) like the Hub ([11, 11, 10] for rd 64, [3, 3, 2] for rd 16)."""
    n = rotary_dim // 2
    base, rem = divmod(n, 3)
    return [base + (1 if i < rem else 0) for i in range(3)]


def _text_kwargs(family: str, overrides: dict | None) -> dict:
    kw = dict(DEFAULT_TEXT_KWARGS)
    if family == "qwen3_next":
        kw.update({k: (list(v) if isinstance(v, list) else v) for k, v in DEFAULT_NEXT_EXTRA.items()})
    ov = dict(overrides or {})
    rope = dict(ov.pop("rope_parameters", None) or {})
    rope_theta = ov.pop("rope_theta", rope.get("rope_theta", DEFAULT_ROPE_THETA))
    prf = ov.pop("partial_rotary_factor", rope.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY_FACTOR))
    mrope_section = ov.pop("mrope_section", rope.get("mrope_section"))
    mrope_interleaved = ov.pop("mrope_interleaved", rope.get("mrope_interleaved", True))
    interval = ov.pop("full_attention_interval", DEFAULT_FULL_ATTENTION_INTERVAL)
    kw.update(ov)
    rope.update(rope_type=rope.get("rope_type", "default"), rope_theta=float(rope_theta),
                partial_rotary_factor=float(prf))
    if family != "qwen3_next":
        if mrope_section is None:
            mrope_section = mrope_section_for(int(kw["head_dim"] * prf))
        rope.update(mrope_section=list(mrope_section), mrope_interleaved=bool(mrope_interleaved))
    kw["rope_parameters"] = rope
    if kw.get("layer_types") is None:
        n = kw["num_hidden_layers"]
        kw["layer_types"] = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    return kw


def _build_model(family: str, kw: dict, wrapper_tie: bool | None = None):
    import transformers as tf

    if family == "qwen3_next":
        return tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(**kw))
    if family == "qwen3_5_moe_text":
        return tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**kw))
    if family == "qwen3_5_moe":
        vocab = kw["vocab_size"]
        vision = dict(TINY_VISION_KWARGS, out_hidden_size=kw["hidden_size"])
        cfg = tf.Qwen3_5MoeConfig(
            text_config=kw,
            vision_config=vision,
            tie_word_embeddings=kw["tie_word_embeddings"] if wrapper_tie is None else wrapper_tie,
            image_token_id=vocab - 4,
            video_token_id=vocab - 3,
            vision_start_token_id=vocab - 2,
            vision_end_token_id=vocab - 1,
        )
        return tf.Qwen3_5MoeForConditionalGeneration(cfg)
    raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")


def _canonical_name(name: str) -> str:
    # Same random stream for the text weights of qwen3_5_moe (wrapper) and qwen3_5_moe_text (flat).
    return name.replace("model.language_model.", "model.", 1)


def _init_values(name: str, shape: tuple[int, ...], gen: torch.Generator, tied: bool) -> torch.Tensor:
    def normal(std, mean=0.0):
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std + mean

    leaf = name.split(".")[-1]
    if "visual" in name:  # not used by the text forward; just make it non-default and finite
        if leaf == "bias":
            return normal(0.02)
        if len(shape) == 1:
            return normal(0.1, 1.0)
        return normal(1.0 / math.sqrt(max(1, int(np.prod(shape[1:])))))
    if leaf == "A_log":
        return torch.log(torch.rand(shape, generator=gen, dtype=torch.float32) * 15.0 + 1.0)
    if leaf == "dt_bias":
        return normal(0.5)
    if name.endswith("linear_attn.norm.weight"):
        return normal(0.2, 1.0)  # plain-weight gated RMSNorm
    if leaf == "weight" and (
        name.endswith("layernorm.weight") or name.endswith("q_norm.weight") or name.endswith("k_norm.weight")
        or name.endswith("model.norm.weight") or name.endswith("language_model.norm.weight")
    ):
        return normal(0.2)  # zero-centred RMSNorm: y = x_hat * (1 + w)
    if name.endswith("conv1d.weight"):
        return normal(1.0 / math.sqrt(shape[-1]))
    if name.endswith("embed_tokens.weight"):
        # untied: std 1 (the input is RMS-normed anyway); tied: it is also the lm_head, so keep logits ~ N(0, 4)
        return normal(2.0 / math.sqrt(shape[-1]) if tied else 1.0)
    if leaf == "bias":
        return normal(0.1)
    if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
        return normal(1.0 / math.sqrt(shape[-1]))  # [E, 2I, H] / [E, H, I]: fan_in is the last dim
    if len(shape) >= 2:
        return normal(1.0 / math.sqrt(int(np.prod(shape[1:]))))
    raise ValueError(f"no initialisation rule for parameter {name} {shape}")


@torch.no_grad()
def randomize_(model, seed: int = 0) -> None:
    """Re-randomise every parameter of ``model`` in place (deterministic per seed and parameter name)."""
    out_emb, in_emb = model.get_output_embeddings(), model.get_input_embeddings()
    tied = out_emb is not None and out_emb.weight is in_emb.weight
    for name, p in model.named_parameters():
        canon = _canonical_name(name)
        gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(canon.encode())) % (2**63))
        p.copy_(_init_values(canon, tuple(p.shape), gen, tied).to(p.dtype))


def make_hf_checkpoint(out_dir, family, *, seed=0, overrides: dict | None = None, stacked_experts: bool | None = None,
                       dtype: str = "float32", embed_scale: float = 1.0,
                       wrapper_tie: bool | None = None) -> pathlib.Path:
    """Build a tiny random HF checkpoint of ``family`` in ``out_dir`` (see module docstring / spec section 4.3).

    stacked_experts None -> family default (qwen3_5_* stacked like the Hub, qwen3_next per-expert).
    The text weights of qwen3_5_moe and qwen3_5_moe_text built with the same seed/overrides are identical.
    embed_scale multiplies the input embedding table (untied checkpoints only). With e.g. 0.01 the first layer's
    input has a mean square of ~1e-4, like real Qwen embeddings (entries ~±0.01–0.03), where RMSNorm's eps is no
    longer negligible: the checkpoint on which an eps mistake (1e-5 for 1e-6) shows in the logits.
    wrapper_tie (qwen3_5_moe only): the wrapper's top-level tie_word_embeddings when it differs from the text config's
    (transformers ties the wrapper's head by the top-level flag alone).
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    tdtype = _dtype(dtype)
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if stacked_experts is None:
        stacked_experts = family != "qwen3_next"
    kw = _text_kwargs(family, overrides)
    with torch.random.fork_rng(devices=[]):  # HF's default init draws from the global RNG: leave the caller's alone
        torch.manual_seed(seed)
        model = _build_model(family, kw, wrapper_tie).eval()
    randomize_(model, seed)
    if embed_scale != 1.0:
        if model.get_output_embeddings().weight is model.get_input_embeddings().weight:
            raise ValueError("embed_scale needs untied embeddings (it would also scale the lm_head)")
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(float(embed_scale))
    model.to(tdtype)
    model.config.dtype = tdtype
    if family == "qwen3_5_moe":
        model.config.text_config.dtype = tdtype
        model.config.vision_config.dtype = tdtype
    # save_original_format=True (default) writes per-expert tensors for a model built from a config.
    model.save_pretrained(out_dir, save_original_format=not stacked_experts)
    _check_expert_format(out_dir, stacked_experts)
    return out_dir


def _read_weight_names(ckpt_dir) -> dict[str, str]:
    """name -> file name, for single-file or sharded checkpoints."""
    ckpt_dir = pathlib.Path(ckpt_dir)
    index = ckpt_dir / "model.safetensors.index.json"
    if index.exists():
        return dict(json.loads(index.read_text())["weight_map"])
    from safetensors import safe_open

    with safe_open(str(ckpt_dir / "model.safetensors"), framework="pt") as f:
        return {k: "model.safetensors" for k in f.keys()}


def _check_expert_format(ckpt_dir, stacked: bool) -> None:
    names = _read_weight_names(ckpt_dir)
    has_stacked = any(n.endswith("mlp.experts.gate_up_proj") for n in names)
    has_per = any(".mlp.experts.0.gate_proj.weight" in n and not n.startswith("mtp.") for n in names)
    if not (has_stacked or has_per):
        return  # no MoE layer at all (e.g. every layer dense): nothing to check
    if stacked and (not has_stacked or has_per):
        raise RuntimeError(f"{ckpt_dir}: expected stacked experts on disk, got per-expert tensors")
    if not stacked and (has_stacked or not has_per):
        raise RuntimeError(f"{ckpt_dir}: expected per-expert tensors on disk, got stacked experts")


# ------------------------------------------------------------------------------------------------------------------
# Running the oracle

_MODEL_CACHE: dict = {}


def _dir_signature(ckpt_dir: pathlib.Path):
    sig = []
    for p in sorted(ckpt_dir.iterdir()):
        if p.is_file() and (p.suffix in (".json", ".safetensors")):
            st = p.stat()
            sig.append((p.name, st.st_mtime_ns, st.st_size))
    return tuple(sig)


def clear_cache() -> None:
    _MODEL_CACHE.clear()


_GENUINE_F64_INSTALLED = False


def _install_genuine_float64() -> None:
    """Make transformers' float64 models compute in float64 throughout (idempotent; other dtypes are untouched).

    transformers 5.24 casts to float32 inside RMSNorm (`x.float()`), the gated RMSNorm and both GDN cores even for a
    float64 model, so its "float64" logits carry float32 errors (3e-4 on tests/fixtures/precision_gdn_qwen3_next,
    where its fp32 logits sit 6e-5 from them: the two share the same errors). These wrappers keep float64 inputs in
    float64 — the GDN core becomes the token-by-token recurrence in float64 — and call transformers' own code for
    every other dtype. Left in float32: the attention and router softmaxes (relative rounding ~6e-8).
    """
    global _GENUINE_F64_INSTALLED
    if _GENUINE_F64_INSTALLED:
        return
    import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as q35
    import transformers.models.qwen3_next.modeling_qwen3_next as qnext

    f64 = torch.float64

    def rms_norm(original):
        def forward(self, x):
            if x.dtype != f64:
                return original(self, x)
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.to(f64))
        return forward

    def gated_rms_norm(original):
        def forward(self, x, gate):
            if x.dtype != f64:
                return original(self, x, gate)
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return self.weight.to(f64) * x * torch.nn.functional.silu(gate.to(f64))
        return forward

    def delta_rule(module, original):
        def rule(query, key, value, g, beta, *args, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, **kwargs):
            if query.dtype != f64:
                return original(query, key, value, g, beta, *args, initial_state=initial_state,
                                output_final_state=output_final_state,
                                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)
            q, k, v, g, beta = (x.to(f64) for x in (query, key, value, g, beta))
            if use_qk_l2norm_in_kernel:
                q, k = module.l2norm(q), module.l2norm(k)
            ratio = v.shape[2] // q.shape[2]
            q, k = q.repeat_interleave(ratio, dim=2) * q.shape[-1] ** -0.5, k.repeat_interleave(ratio, dim=2)
            batch, length, heads, dv = v.shape
            s = (torch.zeros(batch, heads, q.shape[-1], dv, dtype=f64) if initial_state is None
                 else initial_state.to(f64))
            out = torch.zeros_like(v)
            for t in range(length):
                s = s * g[:, t].exp()[..., None, None]
                err = v[:, t] - torch.einsum("bhkv,bhk->bhv", s, k[:, t])
                s = s + k[:, t][..., None] * (beta[:, t][..., None] * err)[..., None, :]
                out[:, t] = torch.einsum("bhkv,bhk->bhv", s, q[:, t])
            return out.to(query.dtype), (s if output_final_state else None)
        return rule

    for module, norm, gated in ((qnext, qnext.Qwen3NextRMSNorm, qnext.Qwen3NextRMSNormGated),
                                (q35, q35.Qwen3_5MoeRMSNorm, q35.Qwen3_5MoeRMSNormGated)):
        norm.forward = rms_norm(norm.forward)
        gated.forward = gated_rms_norm(gated.forward)
        for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
            setattr(module, name, delta_rule(module, getattr(module, name)))
    _GENUINE_F64_INSTALLED = True


def hf_load(ckpt_dir, dtype="float32", by_architecture: bool = False):
    """AutoModelForCausalLM.from_pretrained(ckpt_dir, dtype=...).eval(), cached by (path, dtype, class, file stamps).

    by_architecture: load the class named in config.json's `architectures` instead, the class that wrote the
    checkpoint. For a Qwen3.5 wrapper that is Qwen3_5MoeForConditionalGeneration, which ties the head by the wrapper's
    top-level flag; AutoModelForCausalLM reads text_config's flag and, where the two differ, initialises a random head.
    float64 runs the experts with experts_implementation="eager" (the grouped kernels are float32-only) and is a
    genuine float64 forward (see _install_genuine_float64).
    """
    import transformers

    ckpt_dir = pathlib.Path(ckpt_dir).resolve()
    key = (str(ckpt_dir), str(dtype), by_architecture, _dir_signature(ckpt_dir))
    model = _MODEL_CACHE.get(key)
    if model is None:
        for k in [k for k in _MODEL_CACHE if k[:3] == key[:3]]:
            del _MODEL_CACHE[k]  # stale entry for a rewritten dir
        cls = transformers.AutoModelForCausalLM
        if by_architecture:
            cls = getattr(transformers, json.loads((ckpt_dir / "config.json").read_text())["architectures"][0])
        extra = {}
        if str(dtype) == "float64":
            _install_genuine_float64()
            extra = {"experts_implementation": "eager"}
        model = cls.from_pretrained(str(ckpt_dir), dtype=_dtype(dtype), **extra).eval()
        # from_pretrained leaves the parameters as views of the mmapped safetensors files.  Copy them into fresh
        # memory: CPU GEMM results depend (~1e-6) on the data alignment, which would make logits depend on the file
        # layout (sharding), and a cached model must not keep a mapping of files that a test may rewrite.
        with torch.no_grad():
            for p in model.parameters():
                p.data = p.data.clone()
            for b in model.buffers():
                b.data = b.data.clone()
        _MODEL_CACHE[key] = model
    return model


def _ids_tensor(ids) -> torch.Tensor:
    t = torch.as_tensor(np.asarray(ids, dtype=np.int64))
    if t.ndim != 1:
        raise ValueError(f"expected a 1-D sequence of token ids, got shape {tuple(t.shape)}")
    return t[None, :]


def _np(logits: torch.Tensor) -> np.ndarray:
    keep = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return logits.detach().to(keep).cpu().numpy()


@torch.no_grad()
def hf_logits(ckpt_dir, input_ids, dtype="float32", by_architecture: bool = False) -> np.ndarray:
    """[T, vocab] float32 logits of one sequence (full forward, no cache); float64 ones for dtype float64."""
    model = hf_load(ckpt_dir, dtype, by_architecture)
    out = model(input_ids=_ids_tensor(input_ids), use_cache=False)
    return _np(out.logits[0])


@torch.no_grad()
def hf_greedy(ckpt_dir, prompt_ids, max_new_tokens, dtype="float32",
              by_architecture: bool = False) -> tuple[list[int], list[np.ndarray]]:
    """Greedy decode: prefill with the cache, then single-token steps. Returns (tokens, logits that produced each)."""
    model = hf_load(ckpt_dir, dtype, by_architecture)
    out = model(input_ids=_ids_tensor(prompt_ids), use_cache=True)
    cache = out.cache
    step_logits = _np(out.logits[0, -1])
    tokens: list[int] = []
    all_logits: list[np.ndarray] = []
    for i in range(max_new_tokens):
        tok = int(np.argmax(step_logits))
        tokens.append(tok)
        all_logits.append(step_logits)
        if i == max_new_tokens - 1:
            break
        out = model(input_ids=torch.tensor([[tok]], dtype=torch.long), cache=cache, use_cache=True)
        cache = out.cache
        step_logits = _np(out.logits[0, -1])
    return tokens, all_logits


@torch.no_grad()
def hf_chunked_logits(ckpt_dir, input_ids, split, dtype="float32") -> np.ndarray:
    """Run ids[:split] with the cache, then ids[split:] as one multi-token continuation; return its [T-split, V] logits."""
    ids = _ids_tensor(input_ids)
    if not 0 < split < ids.shape[1]:
        raise ValueError(f"split must be in (0, {ids.shape[1]}), got {split}")
    model = hf_load(ckpt_dir, dtype)
    out = model(input_ids=ids[:, :split], use_cache=True)
    out2 = model(input_ids=ids[:, split:], cache=out.cache, use_cache=True)
    return _np(out2.logits[0])


def perturbed_table(table: np.ndarray, sample: int) -> np.ndarray:
    """`table` with each entry scaled by (1 + s·2⁻²³), s ∈ {−1, 0, 1} from a fixed integer hash of (sample, entry):
    ~1 ulp changes that give a run with different rounding. No RNG, so the stored references stay valid whatever
    NumPy's generators do. Sample 0 is the table itself."""
    if sample == 0:
        return table
    with np.errstate(over="ignore"):
        h = (np.arange(table.size, dtype=np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
        h ^= np.uint64(sample) * np.uint64(0xBF58476D1CE4E5B9)
        h ^= h >> np.uint64(31)
        h *= np.uint64(0x94D049BB133111EB)
        h ^= h >> np.uint64(29)
    s = (h % np.uint64(3)).astype(np.float64).reshape(table.shape) - 1.0
    return (table.astype(np.float64) * (1.0 + s * 2.0**-23)).astype(np.float32)


# ------------------------------------------------------------------------------------------------------------------
# Hub-style re-packaging

def _load_all_tensors(src_dir: pathlib.Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    files = sorted(set(_read_weight_names(src_dir).values()))
    tensors: dict[str, torch.Tensor] = {}
    for fn in files:
        with safe_open(str(src_dir / fn), framework="pt") as f:
            for k in f.keys():
                tensors[k] = f.get_tensor(k)
    return tensors


def _text_cfg_dict(cfg: dict) -> dict:
    return cfg["text_config"] if "text_config" in cfg else cfg


def _dummy_mtp_tensors(cfg: dict, dtype: torch.dtype, seed: int = 1234) -> dict[str, torch.Tensor]:
    t = _text_cfg_dict(cfg)
    H = t["hidden_size"]
    hd = t.get("head_dim") or H // t["num_attention_heads"]
    Hq = t["num_attention_heads"]
    E = t.get("num_experts", 0) or 0
    I = t.get("moe_intermediate_size", 8)
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return (torch.randn(shape, generator=gen) * 0.05).to(dtype)

    out = {
        "mtp.fc.weight": rnd(H, 2 * H),
        "mtp.norm.weight": rnd(H),
        "mtp.pre_fc_norm_embedding.weight": rnd(H),
        "mtp.pre_fc_norm_hidden.weight": rnd(H),
        "mtp.layers.0.input_layernorm.weight": rnd(H),
        "mtp.layers.0.post_attention_layernorm.weight": rnd(H),
        "mtp.layers.0.self_attn.q_proj.weight": rnd(2 * Hq * hd, H),
    }
    if E:
        # The Hub's Qwen3.5 files reportedly keep MTP experts per-expert even where the main experts are stacked.
        out["mtp.layers.0.mlp.gate.weight"] = rnd(E, H)
        for e in range(min(E, 2)):
            out[f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight"] = rnd(I, H)
            out[f"mtp.layers.0.mlp.experts.{e}.up_proj.weight"] = rnd(I, H)
            out[f"mtp.layers.0.mlp.experts.{e}.down_proj.weight"] = rnd(H, I)
    return out


def _legacy_config(cfg: dict) -> dict:
    cfg = json.loads(json.dumps(cfg))
    model_type = cfg.get("model_type")

    def interval_of(layer_types):
        if not layer_types or "full_attention" not in layer_types:
            return None
        n = layer_types.index("full_attention") + 1
        expect = ["full_attention" if (i + 1) % n == 0 else "linear_attention" for i in range(len(layer_types))]
        return n if expect == list(layer_types) else None

    if model_type == "qwen3_next":
        rope = cfg.pop("rope_parameters", None) or {}
        cfg["rope_theta"] = rope.get("rope_theta", DEFAULT_ROPE_THETA)
        cfg["partial_rotary_factor"] = rope.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY_FACTOR)
        cfg["rope_scaling"] = None
        n = interval_of(cfg.get("layer_types"))
        if n is not None:  # an irregular pattern cannot be expressed with the legacy key: keep layer_types then
            cfg.pop("layer_types")
            cfg["full_attention_interval"] = n
        if "dtype" in cfg:
            cfg["torch_dtype"] = cfg.pop("dtype")
        cfg["use_sliding_window"] = False
        cfg["sliding_window"] = None
        return cfg
    t = _text_cfg_dict(cfg)
    t["attn_output_gate"] = True
    t["mamba_ssm_dtype"] = "float32"
    t["mtp_num_hidden_layers"] = 1
    t["mtp_use_dedicated_embeddings"] = False
    n = interval_of(t.get("layer_types"))
    if n is not None:
        t["full_attention_interval"] = n
    t["partial_rotary_factor"] = (t.get("rope_parameters") or {}).get(
        "partial_rotary_factor", DEFAULT_PARTIAL_ROTARY_FACTOR)
    return cfg


def reshard_hub_style(src_dir, dst_dir, n_shards=3, *, legacy_config=True) -> pathlib.Path:
    """Re-package ``src_dir`` like a Hub checkpoint in ``dst_dir`` (n shards + index, dummy mtp.*, legacy config)."""
    from safetensors.torch import save_file

    src_dir, dst_dir = pathlib.Path(src_dir), pathlib.Path(dst_dir)
    dst_dir.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src_dir / "config.json").read_text())
    tensors = _load_all_tensors(src_dir)
    main_dtype = tensors.get("lm_head.weight", next(iter(tensors.values()))).dtype
    mtp = _dummy_mtp_tensors(cfg, main_dtype)

    names = sorted(tensors)
    n_shards = max(1, min(int(n_shards), len(names)))
    # Greedy split of the main tensors by bytes into n_shards non-empty shards; mtp.* go into the last one (as on the Hub).
    nbytes = [tensors[k].numel() * tensors[k].element_size() for k in names]
    total_main = sum(nbytes)
    shards: list[list[str]] = [[] for _ in range(n_shards)]
    acc, s = 0, 0
    for i, (k, nb) in enumerate(zip(names, nbytes)):
        remaining_names = len(names) - i
        remaining_shards = n_shards - s - 1
        if shards[s] and s < n_shards - 1 and (acc >= total_main * (s + 1) / n_shards
                                               or remaining_names <= remaining_shards):
            s += 1
        shards[s].append(k)
        acc += nb
    shards[-1].extend(sorted(mtp))
    all_tensors = dict(tensors, **mtp)

    for old in dst_dir.glob("model*.safetensors*"):
        old.unlink()
    weight_map = {}
    total_size = 0
    for i, keys in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        save_file({k: all_tensors[k].contiguous() for k in keys}, str(dst_dir / fn), metadata={"format": "pt"})
        for k in keys:
            weight_map[k] = fn
            total_size += all_tensors[k].numel() * all_tensors[k].element_size()
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (dst_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

    out_cfg = _legacy_config(cfg) if legacy_config else cfg
    (dst_dir / "config.json").write_text(json.dumps(out_cfg, indent=2) + "\n")
    gen_cfg = src_dir / "generation_config.json"
    if gen_cfg.exists():
        shutil.copyfile(gen_cfg, dst_dir / "generation_config.json")
    return dst_dir


__all__ = [
    "FAMILIES", "make_hf_checkpoint", "randomize_", "hf_load", "hf_logits", "hf_greedy", "hf_chunked_logits",
    "reshard_hub_style", "clear_cache", "mrope_section_for", "perturbed_table",
]
