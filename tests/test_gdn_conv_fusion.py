"""The gdn-conv-fusion pass: what it rewrites and leaves, that the checker holds it to the reassociating bound and
catches a wrong fusion, and that its kernels (native CPU, Pallas interpreted with TPU semantics, jnp reference) match
a float64 oracle written here from spec/model.md §3.5."""

from __future__ import annotations

import attrs
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from qcompile.errors import NumericsError
from qcompile.frontend.checkpoint import Checkpoint
from qcompile.ir.builder import Builder
from qcompile.ir.importer import build_graph
from qcompile.ir.ops.core import Reshape, Slice
from qcompile.ir.ops.gdn import CausalConv1d, GatedDeltaNet, GdnGates, GdnRecurrence
from qcompile.ir.printer import print_graph
from qcompile.ir.types import TensorType
from qcompile.ir.verifier import verify
from qcompile.ir.weights import load_params
from qcompile.kernels import gdn_fused, native
from qcompile.kernels import pallas_gdn
from qcompile.passes.base import PassContext, PassResult
from qcompile.passes.equivalence import EquivalenceChecker, structural_hash
from qcompile.passes.gdn_conv_fusion import GDN_CONV_FUSION
from qcompile.passes.manager import run_pipeline
from qcompile.passes.registry import PASSES
from qcompile.passes.rewrite import rewrite


@pytest.fixture(scope="module", params=["qwen3_5_moe", "qwen3_next"])
def model(request, tmp_path_factory):
    from conftest import write_small

    layers = ("linear_attention", "linear_attention", "full_attention")
    path = write_small(tmp_path_factory.mktemp(request.param) / "m", family=request.param, seed=7, layer_types=layers)
    ckpt = Checkpoint.open(path)
    graph = build_graph(ckpt)
    return graph, EquivalenceChecker(graph, load_params(ckpt, graph, progress=False), seed=0, target="cpu")


def test_it_is_in_the_pipeline():
    assert PASSES["gdn-conv-fusion"] is GDN_CONV_FUSION and GDN_CONV_FUSION.tolerance == "reassociating"
    assert list(PASSES).index("gdn-conv-fusion") > list(PASSES).index("swiglu-fusion")


def test_every_gdn_layer_is_fused(model):
    """One gated_delta_net per GDN layer; no conv, gates or recurrence left, no slice of a conv output; the conv
    state and recurrent state outputs come from the fused op."""
    graph, _ = model
    layers = len(graph.find(GdnRecurrence))
    result = GDN_CONV_FUSION.run(graph, PassContext())
    new = result.graph
    verify(new)
    assert result.changed and result.stats == {"gdn_layer": layers, "gdn_layer_grouped": 0} and layers == 2
    fused = new.find(GatedDeltaNet)
    assert len(fused) == layers
    assert not new.find(CausalConv1d) and not new.find(GdnGates) and not new.find(GdnRecurrence)
    assert len(new.find(Slice)) == len(graph.find(Slice)) - 3 * layers
    producers = {name: new.node(value.node).op for name, value in new.outputs.items() if name.endswith("_state")}
    assert len(producers) == 2 * layers and all(isinstance(op, GatedDeltaNet) for op in producers.values())


def test_pure_and_idempotent(model):
    graph, _ = model
    before = structural_hash(graph)
    once = GDN_CONV_FUSION.run(graph, PassContext())
    assert structural_hash(graph) == before
    twice = GDN_CONV_FUSION.run(once.graph, PassContext())
    assert not twice.changed and twice.graph is once.graph and "no Gated DeltaNet" in twice.skipped


def test_checked_within_the_reassociating_bound(model):
    """Against the unoptimized graph on reference rules, the fused op on cpu rules (the native kernel): logits and
    both states of every layer, on a batch mixing decode, a continuation and a fresh prefill."""
    graph, checker = model
    result = run_pipeline(graph, [GDN_CONV_FUSION], PassContext(), checker=checker)
    (record,) = result.records
    assert record.status == "applied" and record.check["max_error"] <= 1e-5
    assert result.final_check.ok


def _swap_gates(graph, ctx):
    """BROKEN on purpose: the fused op given b for a and a for b (decay and β gates swapped)."""
    fused = GDN_CONV_FUSION.run(graph, ctx).graph

    def rule(b, node, ops):
        if isinstance(node.op, GatedDeltaNet):
            ops = list(ops)
            ops[1], ops[2] = ops[2], ops[1]
            return b.add(node.op, *ops)
        return None

    new, count = rewrite(fused, rule)
    return PassResult(new, count > 0, {"swapped": count})


def test_a_wrong_fusion_is_caught(model):
    graph, checker = model
    broken = attrs.evolve(GDN_CONV_FUSION, name="swapped-gates", run=_swap_gates)
    with pytest.raises(NumericsError, match="after pass swapped-gates"):
        run_pipeline(graph, [broken], PassContext(), checker=checker)


# -- rewrite on a small graph ------------------------------------------------------------------------------------


def _gdn_graph(swap_qk=False, conv_used_elsewhere=False, gates_used_elsewhere=False,
               states=("conv_state", "state")):
    """One GDN core: Hk=1, Hv=2, dk=2, dv=3 (C = 10), K = 4, S slots, B sequences, T tokens; `states` names the
    two state inputs (and outputs), which the graph's meta lists as caches."""
    b = Builder()
    f32 = lambda *shape: TensorType("f32", shape)  # noqa: E731
    x = b.input("x", f32("T", 10))
    a_in, b_in = b.input("a", f32("T", 2)), b.input("b", f32("T", 2))
    query_start = b.input("query_start", TensorType("i32", ("B+1",)))
    slots = b.input("state_slots", TensorType("i32", ("B",)))
    conv_state = b.input(states[0], f32("S", 10, 3))
    state = b.input(states[1], f32("S", 2, 2, 3))
    y, new_conv = b.add(CausalConv1d("silu"), x, conv_state, b.param("conv1d", f32(10, 4)), query_start, slots)
    bounds = {"q": (2, 4), "k": (0, 2)} if swap_qk else {"q": (0, 2), "k": (2, 4)}
    cols = {name: b.add(Slice(1, *bounds[name]), y) for name in ("q", "k")}
    cols["v"] = b.add(Slice(1, 4, 10), y)
    q = b.add(Reshape(("T", 1, 2)), cols["q"])
    k = b.add(Reshape(("T", 1, 2)), cols["k"])
    v = b.add(Reshape(("T", 2, 3)), cols["v"])
    g, beta = b.add(GdnGates(), a_in, b_in, b.param("A_log", f32(2)), b.param("dt_bias", f32(2)))
    o, new_state = b.add(GdnRecurrence(), q, k, v, g, beta, state, query_start, slots)
    b.output("o", o)
    b.output(states[0], new_conv)
    b.output(states[1], new_state)
    if conv_used_elsewhere:
        b.output("conv_out", y)
    if gates_used_elsewhere:
        b.output("decay", g)
    return b.build({"name": "gdn", "caches": list(states)})


GOLDEN_AFTER = """graph @gdn {
  %0 = input "x" : f32[T,10]
  %1 = input "a" : f32[T,2]
  %2 = input "b" : f32[T,2]
  %3 = input "query_start" : i32[B+1]
  %4 = input "state_slots" : i32[B]
  %5 = input "conv_state" : f32[S,10,3]
  %6 = input "state" : f32[S,2,2,3]
  %7 = param "conv1d" : f32[10,4]
  %8 = param "A_log" : f32[2]
  %9 = param "dt_bias" : f32[2]
  %10, %11, %12 = gated_delta_net(%0, %1, %2, %5, %7, %8, %9, %6, %3, %4) {mode="auto", chunk_size=64, groups=1} : f32[T,2,3], f32[S,10,3], f32[S,2,2,3]
  return o=%10, conv_state=%11, state=%12
}"""


def test_golden_before_and_after():
    before = _gdn_graph()
    result = GDN_CONV_FUSION.run(before, PassContext())
    assert print_graph(result.graph).strip() == GOLDEN_AFTER
    text = print_graph(before)
    assert "causal_conv1d" in text and "gdn_gates" in text and "gdn_recurrence" in text


@pytest.mark.parametrize("variant", [dict(swap_qk=True), dict(conv_used_elsewhere=True),
                                     dict(gates_used_elsewhere=True)],
                         ids=["q-k-swapped", "conv-out-used", "gates-used"])
def test_not_transformed(variant):
    """Slices that do not cut [q | k | v] in order are not this layer (the recurrence would read k as q); a conv output
    or a gate that something else reads must stay computed."""
    graph = _gdn_graph(**variant)
    result = GDN_CONV_FUSION.run(graph, PassContext())
    assert not result.changed and result.graph is graph and result.skipped


# -- kernels against a float64 oracle -----------------------------------------------------------------------------


def _bf16(v):
    """v rounded to the nearest bf16 value (even on ties), back in float64."""
    return np.asarray(np.asarray(v, np.float32).astype(ml_dtypes.bfloat16), np.float64)


def _sigmoid_bf16(v, last_rounded=True):
    """sigmoid of bf16 values as a bf16 graph computes it: e^-v, 1 + that, 1 / that, each rounded to bf16 — but the
    last where the graph converts the result to f32 at once (β: XLA drops that rounding)."""
    with np.errstate(over="ignore"):
        q = 1.0 / _bf16(_bf16(np.exp(-np.asarray(v, np.float32))) + 1.0)
    return _bf16(q) if last_rounded else np.asarray(np.float32(q), np.float64)


def gdn_oracle(x, a, b, conv_state, conv_w, a_log, dt_bias, state, query_start, slots, bf16_graph=False):
    """spec/model.md §3.5 b–g in float64, token by token, from scratch (not the jnp reference). bf16_graph: the ops a
    bf16 graph computes in bf16 rounded as it rounds them on CPU — the conv's sum, then SiLU (e^-y, 1 + that,
    1 / that, y · that) op by op, β's sigmoid op by op but its quotient (converted to f32 at once); the rest in
    float64."""
    x, a, b, w = (np.asarray(t, np.float64) for t in (x, a, b, conv_w))
    conv_state, state = np.asarray(conv_state, np.float64).copy(), np.asarray(state, np.float64).copy()
    stored = conv_state.copy()  # every sequence's conv history is its slot's as stored before the step
    num_tokens, channels = x.shape
    num_slots, hv, dk, dv = state.shape
    hk = (channels - hv * dv) // (2 * dk)
    out = np.zeros((num_tokens, hv, dv))
    qs = np.asarray(query_start)
    for seq, slot in enumerate(np.asarray(slots)):
        t0, t1 = int(qs[seq]), int(qs[seq + 1])
        if t1 <= t0:
            continue
        real = 0 <= slot < num_slots
        history = stored[min(max(slot, 0), num_slots - 1)].T.copy()  # [K-1, C] oldest first
        s = state[slot].copy() if real else np.zeros((hv, dk, dv))
        for t in range(t0, t1):
            window = np.concatenate([history, x[t:t + 1]])  # [K, C]
            y = np.einsum("kc,ck->c", window, w)
            if bf16_graph:
                y = _bf16(y)
                y = _bf16(y * _sigmoid_bf16(y))
            else:
                y = y / (1 + np.exp(-y))
            history = window[1:]
            q, k = y[:hk * dk].reshape(hk, dk), y[hk * dk:2 * hk * dk].reshape(hk, dk)
            v = y[2 * hk * dk:].reshape(hv, dv)
            q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / np.sqrt(dk)
            k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
            for h in range(hv):
                kh = h // (hv // hk)
                g = -np.exp(float(a_log[h])) * np.logaddexp(a[t, h] + float(dt_bias[h]), 0.0)
                beta = _sigmoid_bf16(b[t, h], last_rounded=False) if bf16_graph else 1 / (1 + np.exp(-b[t, h]))
                s[h] = np.exp(g) * s[h]
                s[h] += np.outer(k[kh], beta * (v[h] - s[h].T @ k[kh]))
                out[t, h] = s[h].T @ q[kh]
        if real:
            conv_state[slot] = history.T
            state[slot] = s
    return out, conv_state, state


def _draw(rng, lengths, num_slots, slots, hk, hv, dk, dv, taps, state_dtype=np.float32, pad=0):
    channels = 2 * hk * dk + hv * dv
    num_tokens = int(sum(lengths)) + pad
    qs = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return (rng.standard_normal((num_tokens, channels)).astype(np.float32),
            rng.standard_normal((num_tokens, hv)).astype(np.float32),
            rng.standard_normal((num_tokens, hv)).astype(np.float32),
            jnp.asarray(rng.standard_normal((num_slots, channels, taps - 1)), state_dtype),
            (0.5 * rng.standard_normal((channels, taps))).astype(np.float32),
            (0.5 * rng.standard_normal(hv)).astype(np.float32),
            rng.standard_normal(hv).astype(np.float32),
            jnp.asarray(0.3 * rng.standard_normal((num_slots, hv, dk, dv)), state_dtype),
            qs, np.asarray(slots, np.int32))


CASES = [  # lengths, slots (S = 5; 7 is out of range), hk, hv, dk, dv, taps, padding rows
    ((1, 5, 9, 0), (3, 0, 2, 4), 2, 4, 8, 6, 4, 1),  # mixed: decode, continuation, prefill, an empty sequence
    ((1, 1, 1), (2, 7, 3), 1, 3, 4, 5, 4, 5),  # decode with an out-of-range slot and padding rows
    ((2, 1), (1, 0), 2, 2, 16, 8, 2, 0),  # K = 2, ratio 1, a sequence shorter than the window
    ((12,), (4,), 1, 2, 8, 8, 3, 4),  # one prefill, K = 3
    # Slot 5 is out of range and clamps onto slot 4, which the first sequence updates in the same call: it must start
    # from slot 4's conv history as stored before the call (found by the random shapes below: the native kernel
    # read it while another thread rewrote it).
    ((9, 3, 3, 0), (4, 0, 5, 2), 2, 4, 8, 8, 2, 2),
]
# dv = 20, for the native kernel: bf16 state rows of a decode token widened and rounded 16 values at a time in
# registers, then the last 4 singly
WIDE_ROWS_CASE = ((1, 1, 3), (2, 0, 4), 1, 2, 8, 20, 4, 1)
# dv = 128 (every Qwen size), for the native kernel's unrolled delta rule (delta_rule_token_fixed): prefill sequences,
# a decode token and an empty sequence
DV128_CASE = ((1, 6, 0, 3), (2, 0, 4, 1), 1, 2, 16, 128, 4, 1)


def _check(fn, rng, case, state_dtype, what, tol):
    lengths, slots, hk, hv, dk, dv, taps, pad = case
    args = _draw(rng, lengths, 5, slots, hk, hv, dk, dv, taps, state_dtype, pad)
    # The oracle starts from the states as stored (bf16 values up-cast), rounds nothing in between.
    want = gdn_oracle(*[np.asarray(jnp.asarray(t, jnp.float32)) if i in (3, 7) else t for i, t in enumerate(args)])
    got = jax.jit(fn)(*(jnp.asarray(t) for t in args))
    for name, w, g in zip(("o", "conv state", "state"), want, got):
        g = np.asarray(jnp.asarray(g, jnp.float32), np.float64)
        assert np.isfinite(g).all(), f"{what} {name}: non-finite values (an element left unwritten?)"
        err = np.abs(g - w).max() / np.abs(w).max()
        assert err <= tol, f"{what} {case} {name}: {err:.2e}"
    total = int(sum(lengths))
    assert not np.asarray(got[0])[total:].any(), f"{what}: padding rows must be 0"
    untouched = [s for s in range(5) if s not in [sl for sl, n in zip(slots, lengths) if n]]
    for s in untouched:  # slots no sequence with tokens owns are bit-identical
        assert np.array_equal(np.asarray(got[2])[s], np.asarray(args[7])[s]), f"{what}: slot {s} changed"


@pytest.mark.parametrize("state_dtype", [np.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_reference_and_native_kernel_match_the_oracle(state_dtype):
    """f32 states within f32 rounding; bf16 states (rounded once when stored) within bf16's half ulp, 4e-3."""
    rng = np.random.default_rng(11)
    tol = 2e-6 if state_dtype == np.float32 else 8e-3
    fns = [("reference", gdn_fused.gdn_fused_reference)]
    variant = "f32" if state_dtype == np.float32 else "bf16"
    if native.ensure(gdn_fused.NATIVE[variant]):
        fns.append(("native", gdn_fused.gdn_fused_native))
    for case in CASES + [WIDE_ROWS_CASE, DV128_CASE]:
        for what, fn in fns:
            _check(fn, rng, case, state_dtype, what, tol)


@pytest.mark.parametrize("states", ["bf16_conv", "bf16"])
def test_native_kernel_rounds_a_bf16_graph_as_its_ops_round(states):
    """A bf16 graph's operands (x, a, b, the conv weights, A_log, dt_bias in bf16): the kernel rounds the conv's sum
    and each of SiLU's ops, and β's sigmoid ops but its quotient, to bf16 as the compiled reference rounds them.
    Against a float64 oracle rounding at the same places: within f32 rounding (2e-6) with the recurrent state in f32
    and the conv state in bf16 (a bf16 checkpoint's caches; the same kernel without those roundings is 2e-3-1.4e-2
    off), within bf16's half ulp with both states bf16 (the bf16-state pass). And the jnp reference as XLA compiles it
    on the same operands: the recurrent state within 1e-6 (the delta rule's f32 sums in another order; rounding β's
    quotient too puts it 1e-3-3e-3 off), the output within its rounding to bf16."""
    variant = gdn_fused.NATIVE[states]
    if not native.ensure(variant):
        pytest.skip(f"the native kernel {variant} cannot be built here")
    rng = np.random.default_rng(15)
    for case in CASES + [WIDE_ROWS_CASE, DV128_CASE]:
        lengths, slots, hk, hv, dk, dv, taps, pad = case
        args = list(_draw(rng, lengths, 5, slots, hk, hv, dk, dv, taps, np.float32, pad))
        for i in range(8):  # the activations, weights and conv state in bf16; the recurrent state per `states`
            if i != 7 or states == "bf16":
                args[i] = jnp.asarray(np.asarray(args[i], np.float32) * (2 if i == 0 else 1), jnp.bfloat16)
        want = gdn_oracle(*[np.asarray(jnp.asarray(t, jnp.float32)) for t in args[:8]], *args[8:], bf16_graph=True)
        got = jax.jit(gdn_fused.gdn_fused_native)(*(jnp.asarray(t) for t in args))
        tol = 2e-6 if states == "bf16_conv" else 8e-3
        for name, w, g in zip(("o", "conv state", "state"), want, got):
            g = np.asarray(jnp.asarray(g, jnp.float32), np.float64)
            err = np.abs(g - w).max() / np.abs(w).max()
            assert err <= tol, f"{case} {name}: {err:.2e}"
        if states == "bf16_conv":  # the compiled jnp reference: what the checker compares the fused graph with
            ref = jax.jit(gdn_fused.gdn_fused_reference)(*(jnp.asarray(t) for t in args))
            for name, r, g, bound in zip(("o", "conv state", "state"), ref, got, (4e-3, 0.0, 1e-6)):
                r, g = (np.asarray(jnp.asarray(t, jnp.float32), np.float64) for t in (r, g))
                err = np.abs(g - r).max() / np.abs(r).max()
                assert err <= bound, f"{case} {name} against the compiled reference: {err:.2e}"


@pytest.mark.parametrize("states", ["bf16_conv", "bf16"])
def test_native_kernel_takes_bf16_x_and_gives_bf16_output(states):
    """A bf16 graph's x goes into the kernel as bf16 (widened per token inside, not converted to an f32 copy first)
    and its output can come out in bf16: the same bits as the kernel on x's values in f32 with the f32 output
    rounded to bf16 afterwards — padding rows 0, both states identical."""
    variant = gdn_fused.NATIVE[states]
    if not native.ensure(variant):
        pytest.skip(f"the native kernel {variant} cannot be built here")
    rng = np.random.default_rng(16)
    for case in (CASES[0], CASES[1], DV128_CASE):
        lengths, slots, hk, hv, dk, dv, taps, pad = case
        args = list(_draw(rng, lengths, 5, slots, hk, hv, dk, dv, taps, np.float32, pad))
        for i in (0, 3) + ((7,) if states == "bf16" else ()):
            args[i] = jnp.asarray(np.asarray(args[i], np.float32) * (2 if i == 0 else 1), jnp.bfloat16)
        widened = [jnp.asarray(t) for t in args]
        widened[0] = widened[0].astype(jnp.float32)
        # bf16_graph follows x's dtype; on f32 x of bf16 values, ask for it as a bf16 graph would
        call = jax.ffi.ffi_call(gdn_fused.NATIVE[states], (
            jax.ShapeDtypeStruct((widened[0].shape[0], hv, dv), jnp.float32),
            jax.ShapeDtypeStruct(widened[3].shape, widened[3].dtype),
            jax.ShapeDtypeStruct(widened[7].shape, widened[7].dtype)))
        f32 = jnp.float32
        want = jax.jit(lambda *t: call(*t[:4], t[4].astype(f32), t[5].astype(f32), t[6].astype(f32), *t[7:],
                                       bf16_graph=1))(*widened)
        native_bf16 = jax.jit(lambda *t: gdn_fused.gdn_fused_native(*t, out_dtype=jnp.bfloat16))
        got = native_bf16(*(jnp.asarray(t) for t in args))
        assert got[0].dtype == jnp.bfloat16
        rounded = np.asarray(want[0].astype(jnp.bfloat16), np.float32)
        assert np.array_equal(rounded, np.asarray(got[0], np.float32)), case
        assert np.asarray(want[0]).any() and not np.asarray(got[0], np.float32)[int(sum(lengths)):].any()
        for w, g in zip(want[1:], got[1:]):
            assert np.array_equal(np.asarray(w, np.float32), np.asarray(g, np.float32)), case


@pytest.mark.parametrize("interpret", [pytest.param("plain", marks=pytest.mark.slow), "tpu"])
def test_pallas_kernel_matches_the_oracle(interpret):
    """Interpreted plainly and with TPU semantics (pltpu.InterpretParams: uninitialised memory is NaN, so an element
    the kernel forgets to write fails; two cores with race detection over the parallel head axis). Chunks of 8: the
    9- and 12-token prefills run one whole chunk in closed form and the rest token by token, the decodes token by
    token, all in one call; chunk 0: every token recurrent."""
    from jax.experimental.pallas import tpu as pltpu

    mode = True if interpret == "plain" else pltpu.InterpretParams(num_cores_or_threads=2, detect_races=True)
    rng = np.random.default_rng(12)
    runs = [(case, 8, np.float32) for case in CASES] + [(CASES[0], 8, jnp.bfloat16), (CASES[1], 0, np.float32)]
    for case, chunk, state_dtype in runs:
        tol = 2e-6 if state_dtype == np.float32 else 8e-3
        fn = lambda *a: pallas_gdn.gdn_fused_pallas(*a, interpret=mode, chunk=chunk)  # noqa: E731
        _check(fn, rng, case, state_dtype, f"pallas-{interpret} chunk {chunk}", tol)


def test_the_closed_form_chunks_are_what_runs(monkeypatch):
    """A chunk step that forgets the intra-chunk term fails the oracle comparison: the closed form really runs."""
    real = pallas_gdn._chunk_step

    def broken(s, q, k, v, g, beta, chunk):
        out, new = real(s, q, k, v, g, beta, chunk)
        return jnp.dot(q, s), new

    monkeypatch.setattr(pallas_gdn, "_chunk_step", broken)
    fn = lambda *a: pallas_gdn.gdn_fused_pallas(*a, interpret=True, chunk=8)  # noqa: E731
    with pytest.raises(AssertionError, match=" o: "):
        _check(fn, np.random.default_rng(14), CASES[3], np.float32, "broken chunk", 2e-6)


def test_kernels_on_random_shapes_and_ragged_batches():
    """Shapes and batches drawn fresh each run (the seed is in the failure message): key heads, the value/key head
    ratio, dk, dv, conv taps, sequence lengths (empty ones included), slots (out of range included), padding rows;
    the native kernel and the Pallas kernel (chunks of 8) against the oracle."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    for _ in range(3):
        num_seqs = int(rng.integers(1, 5))
        lengths = tuple(int(n) for n in rng.choice([0, 1, 1, 3, 9, 17], num_seqs))
        if not sum(lengths):
            lengths = (1, *lengths[1:])
        slots = tuple(int(s) for s in rng.permutation(6)[:num_seqs])  # slot 5 of S = 5 is out of range
        hk, ratio = int(rng.integers(1, 3)), int(rng.integers(1, 4))
        case = (lengths, slots, hk, hk * ratio, int(rng.choice([4, 8, 16])), int(rng.choice([3, 8, 12])),
                int(rng.integers(2, 5)), int(rng.integers(0, 4)))
        what = f"seed {seed}"
        if native.ensure(gdn_fused.NATIVE["f32"]):
            _check(gdn_fused.gdn_fused_native, rng, case, np.float32, f"native {what}", 2e-6)
        pallas = lambda *a: pallas_gdn.gdn_fused_pallas(*a, interpret=True, chunk=8)  # noqa: E731
        _check(pallas, rng, case, np.float32, f"pallas {what}", 2e-6)


def test_tpu_rule_exports_the_kernel_for_tpu():
    """Lowered for platform tpu on this host, the tpu rule holds the compiled Pallas kernel (one tpu_custom_call)."""
    from jax import export

    rng = np.random.default_rng(13)
    args = tuple(jnp.asarray(t) for t in _draw(rng, (1, 3), 4, (0, 2), 2, 4, 16, 16, 4))
    exported = export.export(jax.jit(pallas_gdn.gdn_fused_tpu), platforms=["tpu"])(*args)
    assert exported.mlir_module().count("@tpu_custom_call") == 1
