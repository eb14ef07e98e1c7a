"""Per-op lowering rules against an independent float64 NumPy oracle (spec/model.md §3), at bounds that the plausible
mistakes exceed.

Each test computes the op with its lowering rule (f32), the correct result with a float64 NumPy oracle written here
from the spec (no jax), and one or more *mistaken* variants with the same oracle (wrong eps, plain vs (1+w) norm
weight, RoPE theta off, interleaved RoPE, ...). It asserts that the rule is within the bound of the oracle AND that
every mistaken variant is at least MARGIN × the bound away from the correct result, so the bound is shown to be able to
fail for each of those mistakes (a bound that every mistake also meets would test nothing).

Errors are measured relative to the largest magnitude of the correct result: max |got − want| / max |want|.
Inputs are chosen so that the mistakes matter: norm rows with mean squares 1e-5…1e-3 (where eps is not negligible),
RoPE positions up to 200 (so that theta changes the low frequencies), routers with well separated probabilities, GDN
gate inputs spanning softplus' linear and exponential ranges.

Every test runs for target "reference" and "cpu": `lowering_rule(cls, "cpu")` is the CPU rule when one is registered
and the reference rule otherwise, so a CPU rule is checked against the same oracle as soon as it lands.
"""

from __future__ import annotations

import numpy as np
import pytest

from qcompile.ir.ops.attention import Rope
from qcompile.ir.ops.core import Activation, Linear, Mul, RmsNorm
from qcompile.ir.ops.gdn import GatedRmsNorm, GdnGates
from qcompile.ir.ops.moe import GroupedMatmul, MoeCombine, MoeDispatch, RouterTopK
from qcompile.ir.registry import lowering_rule

TARGETS = ("reference", "cpu")
MARGIN = 20.0  # every mistaken variant must differ from the oracle by at least MARGIN × the bound


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"shape {got.shape} vs {want.shape}"
    return float(np.abs(got - want).max() / np.abs(want).max())


def check(got, want, bound: float, mistakes: dict, what: str) -> None:
    """The rule is within `bound` of the oracle, and each mistaken oracle variant is ≥ MARGIN × bound away."""
    err = rel_err(got, want)
    assert err <= bound, f"{what}: relative error {err:.3g} > bound {bound:.3g}"
    for name, wrong in mistakes.items():
        dist = rel_err(wrong, want)
        assert dist >= MARGIN * bound, f"{what}: mistake {name!r} is only {dist:.3g} from the oracle (bound {bound:.3g})"


def run(cls, target, op, *arrays):
    out = lowering_rule(cls, target)(op, *arrays)
    if isinstance(out, tuple):
        return tuple(np.asarray(o) for o in out)
    return np.asarray(out)


def f32(x):
    return np.asarray(x, np.float32)


# ------------------------------------------------------------------------------------------------------------------
# float64 oracle (spec/model.md §3)

def o_rmsnorm(x, w, eps, zero_centered):
    x = x.astype(np.float64)
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    w = w.astype(np.float64)
    return y * (1.0 + w if zero_centered else w)


def o_silu(x):
    return x / (1.0 + np.exp(-x))


def o_sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def o_softplus(x):
    return np.logaddexp(0.0, x)


def o_rope(x, pos, theta, rd, inv_freq_dim=None, interleaved=False):
    """rotate_half RoPE on the first rd dims; inv_freq[i] = theta^(-2i/inv_freq_dim) (inv_freq_dim = rd correctly)."""
    x = x.astype(np.float64)
    den = rd if inv_freq_dim is None else inv_freq_dim
    inv = theta ** (-np.arange(0, rd, 2, dtype=np.float64) / den)
    ang = pos.astype(np.float64)[:, None] * inv[None, :]  # [T, rd/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    out = x.copy()
    if interleaved:  # pairs (2i, 2i+1): the GPT-J layout, not this model's
        a, b = x[..., 0:rd:2], x[..., 1:rd:2]
        out[..., 0:rd:2], out[..., 1:rd:2] = a * cos - b * sin, b * cos + a * sin
    else:  # pairs (i, i + rd/2)
        h = rd // 2
        a, b = x[..., :h], x[..., h:rd]
        out[..., :h], out[..., h:rd] = a * cos - b * sin, b * cos + a * sin
    return out


def o_router(logits, k, renormalize, softmax_over_topk=False):
    logits = logits.astype(np.float64)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(p, ids, -1)
    if softmax_over_topk:
        top = np.take_along_axis(logits, ids, -1)
        w = np.exp(top - top.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
    elif renormalize:
        w = w / w.sum(-1, keepdims=True)
    return w, ids


def o_moe(x, weights, ids, gate, up, down, swap_gate_up=False, weighted=True):
    """Routed experts by a per-token loop: Σ_s w_s · down_e(silu(gate_e x) · up_e x)."""
    x, gate, up, down = (a.astype(np.float64) for a in (x, gate, up, down))
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e = ids[t, s]
            g, u = gate[e] @ x[t], up[e] @ x[t]
            if swap_gate_up:
                g, u = u, g
            y = down[e] @ (o_silu(g) * u)
            out[t] += (float(weights[t, s]) if weighted else 1.0) * y
    return out


# ------------------------------------------------------------------------------------------------------------------
# norms


def norm_input(rng, rows=12, dim=64):
    """Rows whose mean squares span 1e-5 … 1e-3 (eps 1e-6 vs 1e-5 then matters at the 0.5 %–30 % level)."""
    ms = np.logspace(-5, -3, rows)
    x = rng.standard_normal((rows, dim))
    x *= np.sqrt(ms / np.mean(x * x, axis=-1))[:, None]
    return f32(x)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("zero_centered", [True, False])
def test_rmsnorm(target, zero_centered):
    rng = np.random.default_rng(0)
    x = norm_input(rng)
    w = f32(rng.normal(0.0, 0.2, 64) + (0.0 if zero_centered else 1.0))
    got = run(RmsNorm, target, RmsNorm(1e-6, zero_centered), x, w)
    assert got.dtype == np.float32
    want = o_rmsnorm(x, w, 1e-6, zero_centered)
    check(got, want, 2e-6, {
        "eps 1e-5": o_rmsnorm(x, w, 1e-5, zero_centered),
        "other weight kind": o_rmsnorm(x, w, 1e-6, not zero_centered),
        "eps outside the sqrt": x / (np.sqrt(np.mean(np.float64(x) ** 2, -1, keepdims=True)) + 1e-6)
        * (1.0 + w if zero_centered else w),
    }, f"rmsnorm zero_centered={zero_centered} [{target}]")


@pytest.mark.parametrize("target", TARGETS)
def test_rmsnorm_bf16_casts_once(target):
    """bf16 in, bf16 out: computed in f32 and rounded once, so within one bf16 rounding (2^-8 relative) of f64."""
    import ml_dtypes

    rng = np.random.default_rng(1)
    x = norm_input(rng).astype(ml_dtypes.bfloat16)
    w = rng.normal(0.0, 0.2, 64).astype(ml_dtypes.bfloat16)
    got = run(RmsNorm, target, RmsNorm(1e-6, True), x, w)
    assert got.dtype == ml_dtypes.bfloat16
    want = o_rmsnorm(x.astype(np.float64), w.astype(np.float64), 1e-6, True)
    check(got, want, 2.0**-8, {"plain weight": o_rmsnorm(x.astype(np.float64), w.astype(np.float64), 1e-6, False)},
          f"rmsnorm bf16 [{target}]")


@pytest.mark.parametrize("target", TARGETS)
def test_gated_rmsnorm(target):
    rng = np.random.default_rng(2)
    t, hv, dv = 6, 4, 32
    x = norm_input(rng, rows=t * hv, dim=dv).reshape(t, hv, dv)
    z = f32(rng.normal(0.0, 1.5, (t, hv, dv)))
    w = f32(rng.normal(1.0, 0.2, dv))
    got = run(GatedRmsNorm, target, GatedRmsNorm(1e-6), x, z, w)

    def oracle(eps=1e-6, weight=w, gate_first=False):
        xx = x.astype(np.float64) * (o_silu(z.astype(np.float64)) if gate_first else 1.0)
        n = xx / np.sqrt(np.mean(xx * xx, -1, keepdims=True) + eps)
        return weight.astype(np.float64) * n * (1.0 if gate_first else o_silu(z.astype(np.float64)))

    check(got, oracle(), 2e-6, {
        "eps 1e-5": oracle(eps=1e-5),
        "(1+w) weight": oracle(weight=1.0 + w),
        "gate before the norm": oracle(gate_first=True),
    }, f"gated_rmsnorm [{target}]")


# ------------------------------------------------------------------------------------------------------------------
# RoPE


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("theta", [1e4, 1e7])
def test_rope(target, theta):
    rng = np.random.default_rng(3)
    pos = np.concatenate([np.arange(40), [63, 64, 100, 127, 150, 200]]).astype(np.int32)
    t, heads, hd, rd = len(pos), 3, 64, 16  # partial rotary: prf 0.25 like the models
    x = f32(rng.standard_normal((t, heads, hd)))
    got = run(Rope, target, Rope(theta, rd), x, pos)
    want = o_rope(x, pos, theta, rd)
    assert np.array_equal(got[..., rd:], x[..., rd:])  # the dims past rotary_dim are left alone, bit for bit
    check(got, want, 3e-6, {  # f32 angles (as HF): measured 7e-7 at positions ≤ 200
        "theta x2": o_rope(x, pos, 2 * theta, rd),
        "theta 1e4 <-> 1e7": o_rope(x, pos, 1e7 if theta == 1e4 else 1e4, rd),
        "interleaved pairs": o_rope(x, pos, theta, rd, interleaved=True),
        "all head dims rotated": o_rope(x, pos, theta, hd),
        "inv_freq over head_dim": o_rope(x, pos, theta, rd, inv_freq_dim=hd),
    }, f"rope theta={theta:g} [{target}]")


# ------------------------------------------------------------------------------------------------------------------
# MoE


def router_logits(rng, t, e):
    """Each row a permutation of well separated values (gaps ≥ 0.3): no near-ties for f32 to order differently."""
    base = np.linspace(-2.0, 2.0, e)
    logits = np.stack([rng.permutation(base) for _ in range(t)]) + rng.uniform(-0.1, 0.1, (t, e))
    return f32(logits)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("renormalize", [True, False])
def test_router_topk(target, renormalize):
    rng = np.random.default_rng(4)
    k, logits = 2, router_logits(rng, 32, 8)
    weights, ids = run(RouterTopK, target, RouterTopK(k, renormalize), logits)
    want_w, want_ids = o_router(logits, k, renormalize)
    assert ids.dtype == np.int32 and np.array_equal(ids, want_ids)  # top-k ids, in descending order
    mistakes = {"renormalisation flipped": o_router(logits, k, not renormalize)[0]}
    if not renormalize:  # softmax over the k chosen logits == renormalised top-k: a mistake only without renorm
        mistakes["softmax over the top-k only"] = o_router(logits, k, False, softmax_over_topk=True)[0]
    check(weights, want_w, 1e-6, mistakes, f"router_topk renormalize={renormalize} [{target}]")


@pytest.mark.parametrize("target", TARGETS)
def test_routed_mlp(target):
    """router_topk → moe_dispatch → grouped_matmul (gate, up) → silu·mul → grouped_matmul (down) → moe_combine against
    a per-token loop; one expert gets no token (an empty group)."""
    rng = np.random.default_rng(5)
    t, h, e, inter, k = 24, 16, 6, 12, 2
    x = f32(rng.standard_normal((t, h)))
    logits = router_logits(rng, t, e)
    logits[:, 5] = -10.0  # expert 5 is never chosen
    gate, up = (f32(rng.normal(0, h**-0.5, (e, inter, h))) for _ in range(2))
    down = f32(rng.normal(0, inter**-0.5, (e, h, inter)))

    weights, ids = run(RouterTopK, target, RouterTopK(k, True), logits)
    rows, groups, order = run(MoeDispatch, target, MoeDispatch(e), x, ids)
    assert groups.tolist() == np.bincount(ids.ravel(), minlength=e).tolist() and groups[5] == 0
    def in_out(w):  # checkpoint [E, Nout, K] -> the op's [E, K, Nout] (what the importer's prepared transpose gives)
        return np.ascontiguousarray(np.swapaxes(w, 1, 2))

    g = run(GroupedMatmul, target, GroupedMatmul(), rows, in_out(gate), groups)
    u = run(GroupedMatmul, target, GroupedMatmul(), rows, in_out(up), groups)
    act = run(Mul, target, Mul(), run(Activation, target, Activation("silu"), g), u)
    d = run(GroupedMatmul, target, GroupedMatmul(), act, in_out(down), groups)
    got = run(MoeCombine, target, MoeCombine(), d, order, weights)
    assert got.dtype == np.float32

    w64, ids64 = o_router(logits, k, True)
    assert np.array_equal(ids, ids64)
    want = o_moe(x, w64, ids64, gate, up, down)
    check(got, want, 5e-6, {
        "gate/up swapped": o_moe(x, w64, ids64, gate, up, down, swap_gate_up=True),
        "combine weights not applied": o_moe(x, w64, ids64, gate, up, down, weighted=False),
        "not renormalised": o_moe(x, o_router(logits, k, False)[0], ids64, gate, up, down),
    }, f"routed MLP [{target}]")


@pytest.mark.parametrize("target", TARGETS)
def test_grouped_matmul_alone(target):
    """Row groups (including empty ones) times their own expert's weight, against a loop over rows."""
    rng = np.random.default_rng(6)
    sizes = np.array([3, 0, 5, 1, 0, 7], np.int32)
    rows = f32(rng.standard_normal((int(sizes.sum()), 20)))
    w = f32(rng.normal(0, 20**-0.5, (len(sizes), 20, 9)))  # [E, K, Nout]
    got = run(GroupedMatmul, target, GroupedMatmul(), rows, w, sizes)
    owner = np.repeat(np.arange(len(sizes)), sizes)
    want = np.stack([rows[r].astype(np.float64) @ w[owner[r]].astype(np.float64) for r in range(len(rows))])
    shifted = np.stack([rows[r].astype(np.float64) @ w[(owner[r] + 1) % len(sizes)] for r in range(len(rows))])
    transposed = np.stack([w[owner[r]].reshape(9, 20).astype(np.float64) @ rows[r] for r in range(len(rows))])
    check(got, want, 2e-6, {"rows paired with the wrong expert": shifted, "weights read as [E, Nout, K]": transposed},
          f"grouped_matmul [{target}]")


# ------------------------------------------------------------------------------------------------------------------
# GDN gates


@pytest.mark.parametrize("target", TARGETS)
def test_gdn_gates(target):
    rng = np.random.default_rng(7)
    t, hv = 40, 4
    a = f32(np.concatenate([np.linspace(-30, 30, t // 2)[:, None] + rng.normal(0, 0.5, (t // 2, hv)),
                            rng.normal(0, 1.5, (t - t // 2, hv))]))  # softplus' linear, curved and ~0 ranges
    b = f32(rng.normal(0, 2.0, (t, hv)))
    a_log = f32(np.log(rng.uniform(1.0, 16.0, hv)))
    dt_bias = f32(rng.normal(0, 0.5, hv))
    g, beta = run(GdnGates, target, GdnGates(), a, b, a_log, dt_bias)
    assert g.dtype == np.float32 and beta.dtype == np.float32
    A = np.exp(a_log.astype(np.float64))
    want_g = -A * o_softplus(a.astype(np.float64) + dt_bias)
    want_beta = o_sigmoid(b.astype(np.float64))
    assert (g <= 0).all()
    check(g, want_g, 2e-6, {
        "sign flipped": -want_g,
        "softplus(a), dt_bias dropped": -A * o_softplus(a.astype(np.float64)),
        "exp(A_log) factor missing": -o_softplus(a.astype(np.float64) + dt_bias),
    }, f"gdn_gates g [{target}]")
    check(beta, want_beta, 2e-6, {
        "beta without sigmoid": b.astype(np.float64),
        "beta = sigmoid(-b)": o_sigmoid(-b.astype(np.float64)),
    }, f"gdn_gates beta [{target}]")


# ------------------------------------------------------------------------------------------------------------------
# linear


@pytest.mark.parametrize("target", TARGETS)
def test_linear(target):
    rng = np.random.default_rng(8)
    x = f32(rng.standard_normal((5, 7, 48)))
    w = f32(rng.normal(0, 48**-0.5, (48, 48)))  # square, so that the transposed-weight mistake has the same shape
    got = run(Linear, target, Linear(), x, w)
    want = x.astype(np.float64) @ w.astype(np.float64).T
    check(got, want, 2e-6, {"weight used as [in, out]": x.astype(np.float64) @ w.astype(np.float64)},
          f"linear [{target}]")
