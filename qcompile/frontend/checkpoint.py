"""Checkpoint: a config plus lazily read tensors, presented under one canonical, family-independent naming.

Why: the two families store the same weights in different layouts (spec/model.md §2): Qwen3-Next fuses
`in_proj_qkvz` / `in_proj_ba` grouped per key head and stores experts one tensor each; Qwen3.5 splits the GDN
projections flat and stacks experts as `gate_up_proj` [E, 2I, H]. The graph names *canonical* parameters (Qwen3.5's
flat GDN layout, experts as separate stacked gate / up / down). Each canonical parameter is a `TensorRef`: a recipe
(which checkpoint tensors, which rows, stacked or not) that is validated against the config when the checkpoint is
opened and executed only when the weight is needed. Opening a 400 GB checkpoint reads headers only.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import attrs
import numpy as np

from qcompile.errors import CheckpointError
from qcompile.frontend.config import FULL, ModelConfig, load_config
from qcompile.frontend.quantization import FP8, SCALE_SUFFIX
from qcompile.frontend.safetensors_io import TensorStore

# Checkpoint tensor prefixes that are not part of the text forward pass and are skipped silently (spec §2.6).
IGNORABLE_PREFIXES = ("mtp.", "model.visual.", "model.language_model.mtp.", "visual.")
FLOAT_DTYPES = {"F32": "f32", "BF16": "bf16", "F16": "f16"}
#: a source tensor's dtype as `source_dtypes` names it (FP8 ones are read through their scales, quantization.py)
SOURCE_DTYPES = {**FLOAT_DTYPES, "F8_E4M3": "fp8"}


@attrs.frozen
class TensorRef:
    """How to build one canonical parameter from checkpoint tensors.

    kind: "tensor" (one tensor, reshaped to `shape`), "rows" (one tensor, `rows` taken along `axis`),
    "stack" (several tensors stacked on a new axis 0). `leading`: only the source's first `leading` entries along
    axis 0 are used (a checkpoint restricted to some of its experts, `Checkpoint.with_experts`).
    """

    kind: str
    sources: tuple[str, ...]
    shape: tuple[int, ...]
    source_shape: tuple[int, ...]
    axis: int = 0
    rows: tuple[int, ...] | None = None
    leading: int | None = None


def _direct(name: str, shape, source_shape=None) -> TensorRef:
    return TensorRef("tensor", (name,), tuple(shape), tuple(source_shape or shape))


def _rows(name: str, source_shape, rows, axis=0) -> TensorRef:
    shape = list(source_shape)
    shape[axis] = len(rows)
    return TensorRef("rows", (name,), tuple(shape), tuple(source_shape), axis, tuple(int(r) for r in rows))


def _stack(names, shape_each) -> TensorRef:
    return TensorRef("stack", tuple(names), (len(names), *shape_each), tuple(shape_each))


def _next_gdn_rows(cfg: ModelConfig):
    """Row indices that turn Qwen3-Next's per-key-head groups into Qwen3.5's flat qkv / z / b / a layout (§2.4)."""
    hk, dk, dv, r = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.gva_ratio
    group = 2 * dk + 2 * r * dv
    q = [g * group + i for g in range(hk) for i in range(dk)]
    k = [g * group + dk + i for g in range(hk) for i in range(dk)]
    v = [g * group + 2 * dk + i for g in range(hk) for i in range(r * dv)]
    z = [g * group + 2 * dk + r * dv + i for g in range(hk) for i in range(r * dv)]
    b = [g * 2 * r + j for g in range(hk) for j in range(r)]
    a = [g * 2 * r + r + j for g in range(hk) for j in range(r)]
    return q + k + v, z, b, a


def canonical_params(cfg: ModelConfig, names: set[str], prefix: str) -> dict[str, TensorRef]:
    """The canonical parameter table for this config, mapped onto the checkpoint's tensor names."""
    h = cfg.hidden_size
    out: dict[str, TensorRef] = {
        "embed_tokens": _direct(f"{prefix}embed_tokens.weight", (cfg.vocab_size, h)),
        "norm": _direct(f"{prefix}norm.weight", (h,)),
    }
    # transformers ties only when the flag says so and no separate head is stored (a stored head wins, tied or not)
    lm_head = "lm_head.weight" if "lm_head.weight" in names or not cfg.tie_word_embeddings \
        else f"{prefix}embed_tokens.weight"
    out["lm_head"] = _direct(lm_head, (cfg.vocab_size, h))
    for layer, kind in enumerate(cfg.layer_types):
        src, dst = f"{prefix}layers.{layer}.", f"layers.{layer}."
        out[dst + "input_layernorm"] = _direct(src + "input_layernorm.weight", (h,))
        out[dst + "post_attention_layernorm"] = _direct(src + "post_attention_layernorm.weight", (h,))
        if kind == FULL:
            _attention_params(cfg, out, src + "self_attn.", dst + "self_attn.")
        else:
            _gdn_params(cfg, out, src + "linear_attn.", dst + "linear_attn.")
        if cfg.moe_layers[layer]:
            _moe_params(cfg, out, names, src + "mlp.", dst + "mlp.")
        else:
            for proj, shape in (("gate_proj", (cfg.intermediate_size, h)), ("up_proj", (cfg.intermediate_size, h)),
                                ("down_proj", (h, cfg.intermediate_size))):
                out[dst + f"mlp.{proj}"] = _direct(src + f"mlp.{proj}.weight", shape)
    return out


def _attention_params(cfg: ModelConfig, out: dict, src: str, dst: str) -> None:
    h, hd = cfg.hidden_size, cfg.head_dim
    out[dst + "q_proj"] = _direct(src + "q_proj.weight", (2 * cfg.num_heads * hd, h))
    out[dst + "k_proj"] = _direct(src + "k_proj.weight", (cfg.num_kv_heads * hd, h))
    out[dst + "v_proj"] = _direct(src + "v_proj.weight", (cfg.num_kv_heads * hd, h))
    out[dst + "o_proj"] = _direct(src + "o_proj.weight", (h, cfg.num_heads * hd))
    out[dst + "q_norm"] = _direct(src + "q_norm.weight", (hd,))
    out[dst + "k_norm"] = _direct(src + "k_norm.weight", (hd,))


def _gdn_params(cfg: ModelConfig, out: dict, src: str, dst: str) -> None:
    h, hv = cfg.hidden_size, cfg.linear_num_value_heads
    if cfg.family == "qwen3_next":
        qkv, z, b, a = _next_gdn_rows(cfg)
        qkvz_shape = (2 * cfg.key_dim + 2 * cfg.value_dim, h)
        out[dst + "in_proj_qkv"] = _rows(src + "in_proj_qkvz.weight", qkvz_shape, qkv)
        out[dst + "in_proj_z"] = _rows(src + "in_proj_qkvz.weight", qkvz_shape, z)
        out[dst + "in_proj_b"] = _rows(src + "in_proj_ba.weight", (2 * hv, h), b)
        out[dst + "in_proj_a"] = _rows(src + "in_proj_ba.weight", (2 * hv, h), a)
    else:
        out[dst + "in_proj_qkv"] = _direct(src + "in_proj_qkv.weight", (cfg.conv_dim, h))
        out[dst + "in_proj_z"] = _direct(src + "in_proj_z.weight", (cfg.value_dim, h))
        out[dst + "in_proj_b"] = _direct(src + "in_proj_b.weight", (hv, h))
        out[dst + "in_proj_a"] = _direct(src + "in_proj_a.weight", (hv, h))
    out[dst + "conv1d"] = _direct(src + "conv1d.weight", (cfg.conv_dim, cfg.conv_kernel),
                                  (cfg.conv_dim, 1, cfg.conv_kernel))
    out[dst + "dt_bias"] = _direct(src + "dt_bias", (hv,))
    out[dst + "A_log"] = _direct(src + "A_log", (hv,))
    out[dst + "norm"] = _direct(src + "norm.weight", (cfg.linear_value_head_dim,))
    out[dst + "out_proj"] = _direct(src + "out_proj.weight", (h, cfg.value_dim))


def _moe_params(cfg: ModelConfig, out: dict, names: set[str], src: str, dst: str) -> None:
    h, e, i, i_s = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    out[dst + "gate"] = _direct(src + "gate.weight", (e, h))
    if src + "experts.gate_up_proj" in names:  # stacked (Qwen3.5 Hub form, or save_original_format=False)
        out[dst + "experts.gate_proj"] = _rows(src + "experts.gate_up_proj", (e, 2 * i, h), range(i), axis=1)
        out[dst + "experts.up_proj"] = _rows(src + "experts.gate_up_proj", (e, 2 * i, h), range(i, 2 * i), axis=1)
        out[dst + "experts.down_proj"] = _direct(src + "experts.down_proj", (e, h, i))
    else:  # one tensor per expert (Qwen3-Next Hub form, and what save_pretrained writes for a fresh model)
        for proj, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            out[dst + f"experts.{proj}"] = _stack([f"{src}experts.{x}.{proj}.weight" for x in range(e)], shape)
    out[dst + "shared_expert.gate_proj"] = _direct(src + "shared_expert.gate_proj.weight", (i_s, h))
    out[dst + "shared_expert.up_proj"] = _direct(src + "shared_expert.up_proj.weight", (i_s, h))
    out[dst + "shared_expert.down_proj"] = _direct(src + "shared_expert.down_proj.weight", (h, i_s))
    out[dst + "shared_expert_gate"] = _direct(src + "shared_expert_gate.weight", (1, h))


def resolve_paths(path: str | Path) -> tuple[Path, Path]:
    """(config.json, weights location) for a checkpoint dir, a .safetensors file or an .index.json file."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    if path.is_dir():
        return path / "config.json", path
    if path.name.endswith(".safetensors") or path.name.endswith(".index.json"):
        return path.parent / "config.json", path
    raise CheckpointError(
        f"{path}: not a checkpoint; give a directory, a .safetensors file or a model.safetensors.index.json"
    )


@attrs.define
class Checkpoint:
    """A validated checkpoint: config, tensor store, canonical parameter table, and what was skipped."""

    path: Path
    config: ModelConfig
    store: TensorStore
    params: dict[str, TensorRef]
    ignored: list[str]
    unknown: list[str]

    @classmethod
    def open(cls, path: str | Path) -> "Checkpoint":
        config_path, weights = resolve_paths(path)
        config = load_config(config_path)
        store = TensorStore.open(weights)
        names = set(store.names())
        # the wrapper's naming when any tensor uses it (so a missing tensor is named as that checkpoint names it)
        wrapped = "model.language_model.embed_tokens.weight" in names or any(
            n.startswith("model.language_model.layers.") for n in names)
        prefix = "model.language_model." if wrapped else "model."
        params = canonical_params(config, names, prefix)
        used = {s for ref in params.values() for s in ref.sources}
        _validate(store, params, config)
        if config.quantization is not None:  # FP8 tensors' scales are read with them
            used |= {config.quantization.scale_name(s) for s in used if store.info(s).dtype == "F8_E4M3"}
        leftover = sorted(names - used)
        ignored = [n for n in leftover if n.startswith(IGNORABLE_PREFIXES)]
        unknown = [n for n in leftover if not n.startswith(IGNORABLE_PREFIXES)]
        return cls(Path(path), config, store, params, ignored, unknown)

    #: Files beside config.json that a linked artifact keeps with the weights (tokenizer for text prompts).
    COMPANIONS = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

    def files(self) -> dict[str, Path]:
        """Every file this checkpoint is read from — config.json, the index if any, each shard — plus the
        tokenizer and generation config when present, by path relative to config.json's directory."""
        config_path, _ = resolve_paths(self.path)
        base = config_path.parent
        paths = [config_path, *(f.path for f in self.store.files)]
        if self.store.source.name.endswith(".index.json"):
            paths.append(self.store.source)
        paths += [base / name for name in self.COMPANIONS if (base / name).is_file()]
        return {str(Path(os.path.relpath(p, base))): Path(p) for p in dict.fromkeys(paths)}

    def entry(self) -> str:
        """What to open, relative to config.json's directory: "." for a directory, else the file given."""
        config_path, _ = resolve_paths(self.path)
        return "." if Path(self.path).is_dir() else os.path.relpath(self.path, config_path.parent)

    def source_dtypes(self, name: str) -> set[str]:
        return {SOURCE_DTYPES[self.store.info(s).dtype] for s in self.params[name].sources}

    def _read(self, source: str, start: int | None = None, stop: int | None = None, raw: bool = False) -> np.ndarray:
        """One checkpoint tensor (rows [start, stop) along axis 0 when given), FP8 ones multiplied out to f32 with
        their scales (frontend/quantization.py) — only the rows asked for — unless `raw`."""
        values = np.asarray(self.store.read(source))
        if start is not None:
            values = values[start:stop]
        if values.dtype != FP8 or raw:
            return values
        quant = self.config.quantization
        scale = np.asarray(self.store.read(quant.scale_name(source)))
        offset = 0
        if start is not None and values.ndim >= 3 or quant.strategy == "channel" and start is not None:
            scale = scale[start:stop]  # whole blocks of experts, or per-row scales
        elif start is not None and quant.strategy == "block":  # rows of a 2-D tensor: their row blocks
            bn = quant.block[0]
            scale = scale[start // bn:-(-stop // bn) if stop is not None else None]
            offset = start % bn
        return quant.dequantize(values, scale, offset)

    def _source(self, ref: TensorRef, raw: bool = False) -> np.ndarray:
        return self._read(ref.sources[0], None if ref.leading is None else 0, ref.leading, raw)

    def load(self, name: str, raw: bool = False) -> np.ndarray:
        """Materialise one canonical parameter (reads only the tensors it is made of). `raw`: a kept FP8 weight's
        FP8 values (`fp8_block`); a name ending in SCALE_SUFFIX is that weight's block scale."""
        if name.endswith(SCALE_SUFFIX):
            return self.load_fp8_scale(name[:-len(SCALE_SUFFIX)])
        ref = self.params[name]
        if ref.kind == "tensor":
            return self._source(ref, raw).reshape(ref.shape)
        if ref.kind == "rows":
            return np.take(self._source(ref, raw), np.asarray(ref.rows), axis=ref.axis)
        return np.stack([self._read(s, raw=raw) for s in ref.sources])

    def load_rows(self, name: str, start: int, stop: int, raw: bool = False) -> np.ndarray:
        """Rows [start, stop) along axis 0 of one canonical parameter, reading only the source bytes they need (a
        zero-copy view where the source layout allows)."""
        if name.endswith(SCALE_SUFFIX):
            return self.load(name)[start:stop]
        ref = self.params[name]
        if ref.kind == "tensor":
            if ref.shape[:1] == ref.source_shape[:1] and self.store.info(ref.sources[0]).dtype == "F8_E4M3":
                stop = ref.shape[0] if stop is None else min(stop, ref.shape[0])
                return self._read(ref.sources[0], start, stop, raw).reshape((stop - start, *ref.shape[1:]))
            return self._source(ref, raw).reshape(ref.shape)[start:stop]
        if ref.kind == "rows":
            source = self._source(ref, raw)
            if ref.axis == 0:
                return np.take(source, np.asarray(ref.rows[start:stop], dtype=np.int64), axis=0)
            return np.take(source[start:stop], np.asarray(ref.rows), axis=ref.axis)
        return np.stack([self._read(s, raw=raw) for s in ref.sources[start:stop]])

    def _is_fp8(self, source: str) -> bool:
        return self.store.info(source).dtype == "F8_E4M3"

    def fp8_block(self, name: str) -> tuple[int, ...] | None:
        """The block layout a canonical weight keeps its FP8 values in (each axis's block extent; its scale from
        `load_fp8_scale`), or None: not FP8, or a reshape of its tensor (multiplied out when read instead). Read
        off the headers: nothing is loaded."""
        return canonical_fp8(self.config.quantization, self.params[name], self._is_fp8)[0]

    def load_fp8_scale(self, name: str) -> np.ndarray:
        """The f32 block scale of kept FP8 weight `name`, one entry per block of `fp8_block(name)`."""
        quant = self.config.quantization
        block, scale = canonical_fp8(quant, self.params[name], self._is_fp8,
                                     lambda source: self.store.read(quant.scale_name(source)))
        if block is None:
            raise KeyError(f"{name} is not kept in FP8")
        return scale

    def release_rows(self, name: str, start: int, stop: int) -> None:
        """Drop this process's mapped pages behind rows [start, stop) of a canonical parameter (load_rows' bytes);
        see TensorStore.release. Streaming a checkpoint larger than memory keeps the resident set bounded this way."""
        if name.endswith(SCALE_SUFFIX):
            return  # scales are small and read whole
        ref = self.params[name]
        if ref.kind == "stack":
            for source in ref.sources[start:stop]:
                self.store.release(source)
            return
        info = self.store.info(ref.sources[0])
        if ref.kind == "rows" and ref.axis == 0 or not ref.source_shape:
            self.store.release(ref.sources[0])
            return
        row_bytes = info.nbytes // max(1, ref.source_shape[0])
        self.store.release(ref.sources[0], start * row_bytes, stop * row_bytes)

    def with_experts(self, count: int) -> "Checkpoint":
        """This checkpoint restricted to its first `count` routed experts in every MoE layer, the router's rows
        restricted to them (so it routes top-k among those `count`): a smaller model of the same layers and widths,
        for numerics checks of a slice that would not fit in memory with every expert. Nothing is read."""
        cfg = self.config
        if not 0 < count <= cfg.num_experts:
            raise ValueError(f"expert count {count} outside 1..{cfg.num_experts}")
        params = {}
        for name, ref in self.params.items():
            routed = ".mlp.experts." in f".{name}" or name.endswith("mlp.gate")
            if not routed or count == cfg.num_experts:
                params[name] = ref
            elif ref.kind == "stack":
                params[name] = attrs.evolve(ref, sources=ref.sources[:count], shape=(count, *ref.shape[1:]))
            else:
                params[name] = attrs.evolve(ref, shape=(count, *ref.shape[1:]), leading=count)
        config = attrs.evolve(cfg, num_experts=count, top_k=min(cfg.top_k, count))
        return attrs.evolve(self, config=config, params=params)

    def bytes_by_dtype(self) -> dict[str, int]:
        totals: dict[str, int] = {}
        for name in {s for ref in self.params.values() for s in ref.sources}:
            info = self.store.info(name)
            totals[info.dtype] = totals.get(info.dtype, 0) + info.nbytes
        return totals

    def warn_context(self, tokens: int, what: str, stream=None) -> None:
        """Warn on stderr when a context of `tokens` tokens (set by `what`) is past max_position_embeddings."""
        warning = self.config.context_warning(tokens, what)
        if warning:
            print(warning, file=sys.stderr if stream is None else stream)

    def warn_unknown(self, stream=None) -> None:
        stream = sys.stderr if stream is None else stream  # looked up now: honour a redirected sys.stderr
        if self.unknown:
            shown = ", ".join(self.unknown[:3]) + (" ..." if len(self.unknown) > 3 else "")
            print(f"qcompile: warning: {len(self.unknown)} checkpoint tensors are not used by the model: {shown}",
                  file=stream)


def canonical_fp8(quant, ref: TensorRef, is_fp8, read_scale=None) -> tuple[tuple[int, ...] | None, np.ndarray | None]:
    """(block, scale) of a canonical weight kept in FP8 (the scale only with `read_scale(source)`, which reads a
    source's stored scale), or (None, None) when its sources are not all FP8 (`is_fp8(source)`) or it is a reshape.
    The sources' block layouts (quantization.py `source_block`) carry over: stacked tensors gain a block of 1 along
    the stacking axis; rows taken along an axis keep whole blocks when they are one range starting and ending on
    block edges, and otherwise make the scale per-row along that axis (blocks of 1) before taking them."""
    if quant is None or not all(is_fp8(source) for source in ref.sources):
        return None, None
    if ref.kind == "tensor" and ref.shape[1:] != ref.source_shape[1:]:
        return None, None  # a reshape (the conv weight): multiplied out when read
    block = list(quant.source_block(ref.source_shape))
    scale = None
    if read_scale is not None:
        scales = [quant.block_scale(read_scale(s), ref.source_shape) for s in ref.sources]
        scale = np.stack(scales) if ref.kind == "stack" else scales[0]
    if ref.kind == "stack":
        return (1, *block), scale
    if ref.leading is not None:  # the first `leading` entries along axis 0 (Checkpoint.with_experts)
        scale = None if scale is None else scale[:math.ceil(ref.leading / block[0])]
    if ref.kind == "rows":
        axis, rows, size = ref.axis, list(ref.rows), ref.source_shape[ref.axis]
        b = block[axis]
        whole = rows == list(range(rows[0], rows[0] + len(rows))) and rows[0] % b == 0 and (
            (rows[-1] + 1) % b == 0 or rows[-1] + 1 == size)
        if whole and scale is not None:
            scale = np.take(scale, np.arange(rows[0] // b, math.ceil((rows[-1] + 1) / b)), axis=axis)
        elif not whole:
            if scale is not None:
                scale = np.take(np.repeat(scale, b, axis=axis), np.asarray(rows), axis=axis)
            block[axis] = 1
    return tuple(block), None if scale is None else np.ascontiguousarray(scale, np.float32)


def _validate(store: TensorStore, params: dict[str, TensorRef], config: ModelConfig) -> None:
    """Every tensor the config needs is present, with the right shape and a float dtype."""
    # Name the file a missing tensor should be in: the single weights file, else the index (or directory).
    weights = store.files[0].path if len(store.files) == 1 else store.source
    for canonical, ref in params.items():
        for source in ref.sources:
            if source not in store:
                raise CheckpointError(
                    f"{weights}: tensor '{source}' is missing; config.json ({config.model_type}, "
                    f"{config.num_layers} layers) needs it for '{canonical}'"
                )
            info = store.info(source)
            if tuple(info.shape) != ref.source_shape:
                raise CheckpointError(
                    f"{info.path}: tensor '{source}' has shape {list(info.shape)} but config.json implies "
                    f"{list(ref.source_shape)}"
                )
            if info.dtype == "F8_E4M3" and config.quantization is not None:
                _validate_scale(store, source, info, config.quantization)
            elif info.dtype not in FLOAT_DTYPES:
                fp8 = " (an FP8 tensor needs a config.json whose quantization_config declares FP8)" \
                    if info.dtype.startswith("F8") else ""
                raise CheckpointError(
                    f"{info.path}: tensor '{source}' has dtype {info.dtype}; weights must be F32, BF16 or F16{fp8}"
                )


def _validate_scale(store: TensorStore, source: str, info, quant) -> None:
    """An FP8 tensor's scale is present, float, and exactly the shape its format implies."""
    name = quant.scale_name(source)
    if name not in store:
        raise CheckpointError(f"{info.path}: FP8 tensor '{source}' has no scale '{name}' ({quant.method} checkpoints "
                              "store one per quantized weight)")
    scale = store.info(name)
    expected = quant.scale_shape(tuple(info.shape))
    if scale.dtype not in FLOAT_DTYPES:
        raise CheckpointError(f"{scale.path}: scale '{name}' has dtype {scale.dtype}; scales must be F32, BF16 or F16")
    if tuple(scale.shape) != expected and not (quant.strategy != "block" and math.prod(scale.shape) == math.prod(
            expected) and len(scale.shape) <= len(expected)):
        what = f"blocks of {list(quant.block)}" if quant.strategy == "block" else f"{quant.strategy} scales"
        raise CheckpointError(f"{scale.path}: scale '{name}' has shape {list(scale.shape)} but {list(info.shape)} in "
                              f"{what} needs {list(expected)}")
