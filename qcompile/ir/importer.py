"""Importer: ModelConfig + canonical parameter shapes → the unoptimized step graph (the reference for every pass).

One graph serves prefill, decode and mixed batches: a ragged batch of T token slots with per-sequence metadata
(query_start, page_table, state_slots) and the caches as explicit inputs and outputs — paged K/V for full-attention
layers, conv and recurrent state slots for GDN layers. Weights are `param` ops naming canonical checkpoint
parameters (frontend.checkpoint); the graph holds no data.

Graph inputs (symbolic dims bound per shape bucket):
    token_ids i32[T], positions i32[T], query_start i32[B+1], page_table i32[B,M], state_slots i32[B],
    logits_indices i32[R], layers.{i}.k_pages / v_pages  dtype[P,page_size,Hkv,hd]   (full-attention layers),
    layers.{i}.conv_state dtype[S,conv_dim,K-1], layers.{i}.recurrent_state f32[S,Hv,dk,dv]   (GDN layers).
Outputs: logits f32[R,V], next_tokens i32[R] (greedy) and every cache under its input name.
"""

from __future__ import annotations

import attrs

from qcompile.errors import UsageError
from qcompile.frontend.checkpoint import Checkpoint
from qcompile.frontend.config import FULL, ModelConfig
from qcompile.ir.builder import Builder
from qcompile.ir.graph import Graph, Value
from qcompile.ir.ops.attention import KvCacheWrite, PagedAttention, Rope
from qcompile.ir.ops.core import (Activation, Add, Cast, Embed, Greedy, Linear, Mul, Reshape, RmsNorm, Slice, TakeRows,
                                  Transpose)
from qcompile.ir.ops.gdn import CausalConv1d, GatedRmsNorm, GdnGates, GdnRecurrence
from qcompile.ir.ops.moe import GroupedMatmul, MoeCombine, MoeDispatch, RouterTopK
from qcompile.ir.ops.quant import SCALE_SUFFIX, Dequantize, blocks
from qcompile.ir.types import TensorType

T, B, R, P, M, S = "T", "B", "R", "P", "M", "S"
DTYPE_CHOICES = ("f32", "bf16")
#: what an FP8 checkpoint's quantized weights become: kept FP8 (dequantized inside the matmul rules), or multiplied out
FP8_CHOICES = ("keep", "dequantize")


#: The KV page length a graph is built with when nobody chose one; the kv-page-resize pass picks the target's.
DEFAULT_PAGE_SIZE = 16


@attrs.frozen
class ImportOptions:
    dtype: str = "f32"  # compute / weight dtype of the graph
    page_size: int = DEFAULT_PAGE_SIZE  # KV cache page length in tokens
    gdn_mode: str = "auto"  # gdn_recurrence mode: auto | chunked | recurrent
    layers: tuple[int, ...] | None = None  # import only these layers (a checking slice); None = all
    #: weights kept in FP8, name -> block (frontend Checkpoint.fp8_block): f8e4m3 values, a block scale, a dequantize
    fp8_blocks: tuple[tuple[str, tuple[int, ...]], ...] = ()


def select_layers(cfg: ModelConfig, per_type: int) -> tuple[int, ...]:
    """The first `per_type` layers of each type (GDN and attention), in model order: a slice for numerics checks."""
    chosen = []
    for kind in sorted(set(cfg.layer_types)):
        chosen += [i for i, t in enumerate(cfg.layer_types) if t == kind][:per_type]
    return tuple(sorted(chosen))


def cache_names(cfg: ModelConfig, layers: tuple[int, ...] | None = None) -> list[str]:
    names = []
    for layer, kind in enumerate(cfg.layer_types):
        if layers is not None and layer not in layers:
            continue
        if kind == FULL:
            names += [f"layers.{layer}.k_pages", f"layers.{layer}.v_pages"]
        else:
            names += [f"layers.{layer}.conv_state", f"layers.{layer}.recurrent_state"]
    return names


class _Importer:
    def __init__(self, cfg: ModelConfig, param_shapes: dict[str, tuple[int, ...]], opts: ImportOptions):
        self.cfg, self.shapes, self.opts = cfg, param_shapes, opts
        self.fp8 = dict(opts.fp8_blocks)
        self.b = Builder()
        dt = opts.dtype
        self.dt = dt
        self.token_ids = self.b.input("token_ids", TensorType("i32", (T,)))
        self.positions = self.b.input("positions", TensorType("i32", (T,)))
        self.query_start = self.b.input("query_start", TensorType("i32", ("B+1",)))
        self.page_table = self.b.input("page_table", TensorType("i32", (B, M)))
        self.state_slots = self.b.input("state_slots", TensorType("i32", (B,)))
        self.logits_indices = self.b.input("logits_indices", TensorType("i32", (R,)))

    def param(self, name: str) -> Value:
        shape = self.shapes[name]
        block = self.fp8.get(name)
        if block is None:
            return self.b.param(name, TensorType(self.dt, shape))
        values = self.b.param(name, TensorType("f8e4m3", shape))
        scale = self.b.param(name + SCALE_SUFFIX, TensorType("f32", blocks(shape, block)))
        return self.b.add(Dequantize(block, self.dt), values, scale)

    def linear(self, x: Value, name: str) -> Value:
        return self.b.add(Linear(), x, self.param(name))

    def reshape(self, x: Value, *shape) -> Value:
        return self.b.add(Reshape(shape), x)

    def zc_norm(self, x: Value, name: str) -> Value:
        return self.b.add(RmsNorm(self.cfg.rms_norm_eps, True), x, self.param(name))

    def build(self) -> Graph:
        cfg, b = self.cfg, self.b
        x = b.add(Embed(), self.param("embed_tokens"), self.token_ids)
        for layer, kind in enumerate(cfg.layer_types):
            if self.opts.layers is not None and layer not in self.opts.layers:
                continue
            pre = f"layers.{layer}."
            h = self.zc_norm(x, pre + "input_layernorm")
            mixed = self.attention(layer, h) if kind == FULL else self.gdn(layer, h)
            x = b.add(Add(), x, mixed)
            h = self.zc_norm(x, pre + "post_attention_layernorm")
            mlp = self.moe(pre + "mlp.", h) if cfg.moe_layers[layer] else self.dense_mlp(pre + "mlp.", h)
            x = b.add(Add(), x, mlp)
        x = b.add(TakeRows(), x, self.logits_indices)
        x = self.zc_norm(x, "norm")
        logits = self.linear(x, "lm_head")
        if self.dt != "f32":
            logits = b.add(Cast("f32"), logits)
        b.output("logits", logits)
        b.output("next_tokens", b.add(Greedy(), logits))
        meta = {"name": cfg.family, "family": cfg.family, "dtype": self.dt, "page_size": self.opts.page_size,
                "vocab_size": cfg.vocab_size, "caches": cache_names(cfg, self.opts.layers),
                "layers": list(self.opts.layers) if self.opts.layers is not None else list(range(cfg.num_layers))}
        return b.build(meta)

    def attention(self, layer: int, h: Value) -> Value:
        cfg, b, pre = self.cfg, self.b, f"layers.{layer}.self_attn."
        hq, hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        both = self.reshape(self.linear(h, pre + "q_proj"), T, hq, 2 * hd)  # per head: [query ‖ gate]
        q = b.add(Slice(2, 0, hd), both)
        gate = b.add(Slice(2, hd, 2 * hd), both)
        q = self.zc_norm(q, pre + "q_norm")
        k = self.zc_norm(self.reshape(self.linear(h, pre + "k_proj"), T, hkv, hd), pre + "k_norm")
        v = self.reshape(self.linear(h, pre + "v_proj"), T, hkv, hd)
        rope = Rope(cfg.rope_theta, cfg.rotary_dim)
        q, k = b.add(rope, q, self.positions), b.add(rope, k, self.positions)
        pages = TensorType(self.dt, (P, self.opts.page_size, hkv, hd))
        meta = (self.positions, self.query_start, self.page_table)
        k_pages = b.add(KvCacheWrite(), b.input(f"layers.{layer}.k_pages", pages), k, *meta)
        v_pages = b.add(KvCacheWrite(), b.input(f"layers.{layer}.v_pages", pages), v, *meta)
        b.output(f"layers.{layer}.k_pages", k_pages)
        b.output(f"layers.{layer}.v_pages", v_pages)
        o = b.add(PagedAttention(hd**-0.5, self.opts.page_size), q, k_pages, v_pages, *meta)
        o = b.add(Mul(), o, b.add(Activation("sigmoid"), gate))
        return self.linear(self.reshape(o, T, hq * hd), pre + "o_proj")

    def gdn(self, layer: int, h: Value) -> Value:
        cfg, b, pre = self.cfg, self.b, f"layers.{layer}.linear_attn."
        hk, hv, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        mixed = self.linear(h, pre + "in_proj_qkv")
        z = self.reshape(self.linear(h, pre + "in_proj_z"), T, hv, dv)
        beta_in = self.linear(h, pre + "in_proj_b")
        decay_in = self.linear(h, pre + "in_proj_a")
        conv_state = b.input(f"layers.{layer}.conv_state", TensorType(self.dt, (S, cfg.conv_dim, cfg.conv_kernel - 1)))
        seq = (self.query_start, self.state_slots)
        y, conv_state = b.add(CausalConv1d("silu"), mixed, conv_state, self.param(pre + "conv1d"), *seq)
        b.output(f"layers.{layer}.conv_state", conv_state)
        kd = cfg.key_dim
        q = self.reshape(b.add(Slice(1, 0, kd), y), T, hk, dk)
        k = self.reshape(b.add(Slice(1, kd, 2 * kd), y), T, hk, dk)
        v = self.reshape(b.add(Slice(1, 2 * kd, cfg.conv_dim), y), T, hv, dv)
        g, beta = b.add(GdnGates(), decay_in, beta_in, self.param(pre + "A_log"), self.param(pre + "dt_bias"))
        state = b.input(f"layers.{layer}.recurrent_state", TensorType("f32", (S, hv, dk, dv)))
        o, state = b.add(GdnRecurrence(self.opts.gdn_mode), q, k, v, g, beta, state, *seq)
        b.output(f"layers.{layer}.recurrent_state", state)
        o = b.add(GatedRmsNorm(cfg.rms_norm_eps), o, z, self.param(pre + "norm"))
        return self.linear(self.reshape(o, T, cfg.value_dim), pre + "out_proj")

    def expert_weights(self, name: str) -> Value:
        """Stacked expert weights [E, Nout, K] as grouped_matmul takes them, [E, K, Nout]: a params-only transpose
        that weight preparation folds into a prepared parameter (computed once, not per step)."""
        return self.b.add(Transpose((0, 2, 1)), self.param(name))

    def swiglu(self, pre: str, h: Value) -> Value:
        act = self.b.add(Mul(), self.b.add(Activation("silu"), self.linear(h, pre + "gate_proj")),
                         self.linear(h, pre + "up_proj"))
        return self.linear(act, pre + "down_proj")

    def dense_mlp(self, pre: str, h: Value) -> Value:
        return self.swiglu(pre, h)

    def moe(self, pre: str, h: Value) -> Value:
        cfg, b = self.cfg, self.b
        weights, ids = b.add(RouterTopK(cfg.top_k, cfg.norm_topk_prob), self.linear(h, pre + "gate"))
        rows, groups, order = b.add(MoeDispatch(cfg.num_experts), h, ids)
        gate = b.add(GroupedMatmul(), rows, self.expert_weights(pre + "experts.gate_proj"), groups)
        up = b.add(GroupedMatmul(), rows, self.expert_weights(pre + "experts.up_proj"), groups)
        act = b.add(Mul(), b.add(Activation("silu"), gate), up)
        down = b.add(GroupedMatmul(), act, self.expert_weights(pre + "experts.down_proj"), groups)
        routed = b.add(MoeCombine(), down, order, weights)
        shared = self.swiglu(pre + "shared_expert.", h)
        shared_gate = b.add(Activation("sigmoid"), self.linear(h, pre + "shared_expert_gate"))
        return b.add(Add(), routed, b.add(Mul(), shared, shared_gate))


def import_graph(cfg: ModelConfig, param_shapes: dict[str, tuple[int, ...]],
                 opts: ImportOptions = ImportOptions()) -> Graph:
    """Build the unoptimized step graph for `cfg`, whose parameters have the given canonical shapes."""
    return _Importer(cfg, param_shapes, opts).build()


def build_graph(checkpoint: Checkpoint, dtype: str | None = None, page_size: int = DEFAULT_PAGE_SIZE,
                gdn_mode: str = "auto", layers: tuple[int, ...] | None = None, fp8: str = "keep") -> Graph:
    """The verified, unoptimized step graph of a checkpoint (dtype defaults to the checkpoint's own). `fp8`: "keep"
    holds an FP8 checkpoint's quantized weights in FP8 with a dequantize where they are used (ir/ops/quant.py);
    "dequantize" multiplies them out when read, holding them in the compute dtype."""
    from qcompile.ir.verifier import verify

    dtype = dtype or checkpoint.config.dtype
    if dtype == "f16":
        dtype = "f32"  # f16 checkpoints compute in f32: f16 overflows in these models' MLPs
    if dtype not in DTYPE_CHOICES:
        raise UsageError(f"unsupported compute dtype {dtype!r}; choose one of {', '.join(DTYPE_CHOICES)}")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0 or page_size & (page_size - 1):
        raise UsageError(f"--page-size must be a positive power of two, got {page_size}")
    if fp8 not in FP8_CHOICES:
        raise UsageError(f"--fp8 must be one of {', '.join(FP8_CHOICES)}, got {fp8!r}")
    shapes = {name: ref.shape for name, ref in checkpoint.params.items()}
    kept = () if fp8 != "keep" or checkpoint.config.quantization is None else tuple(
        (name, block) for name in checkpoint.params if (block := checkpoint.fp8_block(name)) is not None)
    graph = import_graph(checkpoint.config, shapes, ImportOptions(dtype=dtype, page_size=page_size, gdn_mode=gdn_mode,
                                                                    layers=layers, fp8_blocks=kept))
    verify(graph)
    return graph
