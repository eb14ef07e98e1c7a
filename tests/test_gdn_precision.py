"""fp32 precision of the Gated DeltaNet against float64 (issue 11, item 2).

The chunked form used to compute each pairwise decay Γ_ij = exp(γ_i − γ_j) from the chunk's prefix sums γ of the
log-decays g. With gates down to g ≈ −30 per token, γ reaches −10³ within one 64-token chunk, and its f32 rounding
(|γ|·2⁻²⁴ ≈ 5e-5) turned into a relative error of every Γ_ij: 10x the recurrent form's error at the kernel, and 5.5e-4
on the logits of tests/fixtures/precision_gdn_qwen3_next, where the recurrent form was at 7e-5. The decays are now
summed over each segment (kernels/gdn.py, _solve_chunk).

The fixture's `logits_f64` are not a float64 computation: transformers' Qwen3-Next casts to float32 inside its
RMSNorm, its gated RMSNorm and its GDN core (torch_chunk_gated_delta_rule, which has the same prefix-difference
decays) even for a float64 model; they lie 3.0e-4 from a genuine float64 forward, on the very logit where the error
shows. `reference_true_f64.npz` holds that genuine float64 forward (transformers with those casts removed; made by
benchmarks/gdn_precision.py --write-true-f64), and the end-to-end test measures against it.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qcompile.ir.abi import CacheConfig
from qcompile.kernels.gdn import gdn_chunked_reference, gdn_recurrent_reference

FIXTURE = Path(__file__).parent / "fixtures" / "precision_gdn_qwen3_next"


@pytest.fixture(scope="module")
def refs():
    ref = np.load(FIXTURE / "reference.npz")
    true = np.load(FIXTURE / "reference_true_f64.npz")
    assert np.array_equal(true["prompt"], ref["prompt"])
    return {"prompt": [int(x) for x in ref["prompt"]], "hf_f32": ref["logits_hf_f32"], "true_f64": true["logits_f64"]}


@pytest.mark.parametrize("target", ["reference", "cpu"])
@pytest.mark.parametrize("mode", ["chunked", "recurrent"])
def test_prompt_logits_as_close_to_float64_as_transformers_fp32(mode, target, refs, qc_model):
    engine = qc_model(FIXTURE, None, gdn_mode=mode).engine(CacheConfig(max_seqs=2, max_context=64), target)
    seq = engine.add_sequence()
    ours = engine.step([(seq, refs["prompt"])], all_logits=True)[0]
    hf_err = float(np.abs(refs["hf_f32"] - refs["true_f64"]).max())  # 2.4e-4 (its chunked GDN core: same defect)
    err = float(np.abs(ours - refs["true_f64"]).max())  # after the fix 6e-5 .. 1.2e-4; the chunked form was 5.5e-4
    assert err <= 1.5 * hf_err, f"{mode}/{target}: max |logit - float64| {err:.3g} > 1.5 x transformers fp32 {hf_err:.3g}"
    # Issue 11's target is the 1.5x above; measured 0.26-0.51x, so hold it at 0.75x: a regression to half the old
    # decay error (2.7e-4 chunked) would still pass 1.5x but not this.
    assert err <= 0.75 * hf_err, f"{mode}/{target}: {err:.3g} from float64, above 0.75 x transformers fp32 {hf_err:.3g}"


def _exact_delta_rule(q, k, v, g, beta, state):
    """The recurrence token by token in float64 (numpy keeps subnormals). state [H,dk,dv] -> (out [T,H,dv], state)."""
    q, k, v, g, beta, s = (np.asarray(x, np.float64) for x in (q, k, v, g, beta, state))
    out = np.zeros_like(v)
    for t in range(q.shape[0]):
        s = s * np.exp(g[t])[:, None, None]
        s = s + k[t][:, :, None] * (beta[t][:, None] * (v[t] - np.einsum("hkv,hk->hv", s, k[t])))[:, None, :]
        out[t] = np.einsum("hkv,hk->hv", s, q[t])
    return out, s


def test_chunked_decays_keep_f32_precision_under_strongly_negative_gates():
    """Gates of −1 .. −30 per token (γ down to −10³ per 64-token chunk), ragged sequences, several chunks, carried
    states: both forms within a few f32 roundings of float64. The prefix-difference decays gave 6-9e-7 here (the
    recurrent form 3-5e-8)."""
    rng = np.random.default_rng(11)
    lengths, heads, dk, dv, slots = (150, 37), 4, 16, 16, 3
    num_tokens = sum(lengths)

    def unit(shape):
        x = rng.standard_normal(shape)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    q = (unit((num_tokens, heads, dk)) * dk**-0.5).astype(np.float32)
    k = unit((num_tokens, heads, dk)).astype(np.float32)
    v = rng.standard_normal((num_tokens, heads, dv)).astype(np.float32)
    g = (-rng.uniform(1.0, 30.0, (num_tokens, heads))).astype(np.float32)
    beta = rng.uniform(0.1, 0.9, (num_tokens, heads)).astype(np.float32)
    state = (0.3 * rng.standard_normal((slots, heads, dk, dv))).astype(np.float32)
    query_start = np.array([0, lengths[0], num_tokens], np.int32)
    state_slots = np.array([2, 0], np.int32)

    want_out = np.zeros((num_tokens, heads, dv))
    want_state = state.astype(np.float64)
    for b in range(2):
        rows = slice(query_start[b], query_start[b + 1])
        want_out[rows], want_state[state_slots[b]] = _exact_delta_rule(q[rows], k[rows], v[rows], g[rows], beta[rows],
                                                                       state[state_slots[b]])
    args = [jnp.asarray(x) for x in (q, k, v, g, beta, state, query_start, state_slots)]
    forms = {"recurrent": jax.jit(gdn_recurrent_reference)}
    for chunk in (64, 32):
        forms[f"chunked/{chunk}"] = jax.jit(lambda *a, chunk=chunk: gdn_chunked_reference(*a, chunk=chunk))
    for name, fn in forms.items():
        out, new_state = fn(*args)
        out_err = float(np.abs(np.asarray(out, np.float64) - want_out).max())
        state_err = float(np.abs(np.asarray(new_state, np.float64) - want_state).max())
        assert out_err <= 1.5e-7 and state_err <= 1.5e-7, f"{name}: out error {out_err:.3g}, state error {state_err:.3g}"
