"""Cases the random-config fidelity fuzz (tests/test_fidelity_fuzz.py) flagged, pinned with stored references.

fuzz_case198 (tests/fixtures/fuzz_case198/README.md): a Qwen3.5-MoE checkpoint whose GDN layers amplify float32
rounding ~10³-fold at single positions. Neither side has a precision defect. At (layer 4, position 91, value head 1)
the state has decayed by exp(−9.4) and q̂·k̂ = 0.0016, so the core output o ≈ β·(q̂·k̂)/√dk·v is a cancellation
(rms 3e-4; the error of q, k at positions 90–91 reaches it through a rank-1 Jacobian of norm 0.52). The gated RMSNorm
then multiplies the absolute error by 1/√(mean(o²)+eps) ≈ 960. Layer 2 does the same at position 90
(gain 840). Whose fp32 error lands in those directions is luck. On the unperturbed checkpoint transformers fp32 is
1.0e-3 from a genuine float64 forward and qcompile 3.6e-3, which fails the fuzz's single-sample rule (≤ 1.5×
transformers' distance). Over fp32 runs made by changing the embedding table by ~1 ulp (the float64 reference
recomputed for each table), transformers fp32 spans 1.5e-4 .. 9.6e-3 and qcompile 1.9e-4 .. 1.1e-2.

So the test judges qcompile against transformers' spread, not against one sample:
  * the unperturbed prompt's distance to float64 is within 1.5× the largest distance transformers fp32 shows over the
    stored ensemble (its unperturbed run included);
  * over the K perturbed tables, the root mean square of qcompile's distances is at most 2× transformers'. The errors
    at one sensitive position are roughly |Gaussian|, so the RMS estimates their scale (resampling 48 runs: at
    K = 24 a true ratio of 1.1 exceeds 2 with probability ~5e-4). A precision defect shifts the whole distribution;
    luck does not. Dropping 6–8 mantissa bits of the conv output is caught, 2–3 bits are not: this model's own
    amplification dominates.
No transformers run is needed: the float64 and transformers-fp32 results are stored
(tests/fixtures/fuzz_case198/make_reference.py).
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from hf_oracle import perturbed_table
from qcompile.ir.abi import CacheConfig

CASE198 = Path(__file__).parent / "fixtures" / "fuzz_case198"


@pytest.fixture(scope="module")
def case198():
    ref = np.load(CASE198 / "reference.npz")
    return {key: ref[key] for key in ref.files}


def _prompt_logits(engine, prompt) -> np.ndarray:
    seq = engine.add_sequence()
    try:
        return np.asarray(engine.step([(seq, prompt)], all_logits=True)[0], np.float64)
    finally:
        engine.release(seq)


@pytest.mark.parametrize("target", ["reference", "cpu"])
def test_case198_within_transformers_fp32_spread_of_float64(target, case198, qc_model):
    prompt = [int(x) for x in case198["prompt"]]
    model = qc_model(CASE198, None)
    engine = model.engine(CacheConfig(max_seqs=2, max_context=128), target)
    table = np.asarray(model.params["embed_tokens"])
    tied = np.array_equal(np.asarray(model.params["lm_head"]), table)
    assert tied and bool(case198["tied"])

    ours = _prompt_logits(engine, prompt)
    err = float(np.abs(ours - case198["logits_f64"]).max())  # 3.6e-3 (both rule sets)
    hf_err = float(np.abs(case198["logits_hf_f32"].astype(np.float64) - case198["logits_f64"]).max())  # 1.0e-3
    rows = slice(int(case198["ensemble_first_row"]), None)
    hf_ens = case198["ensemble_hf_f32_err"]  # [K] transformers fp32 vs float64 of each perturbed table (rows above)
    spread = max(hf_err, float(hf_ens.max()))
    assert err <= 1.5 * spread, (
        f"{target}: {err:.3g} from float64, beyond 1.5x the largest distance of transformers fp32 ({spread:.3g}; "
        f"unperturbed {hf_err:.3g})")

    params = dict(engine.params)
    mine = []
    try:
        for k in range(1, len(hf_ens) + 1):
            t = jnp.asarray(perturbed_table(table, k))
            engine.params = {**params, "embed_tokens": t, "lm_head": t}
            out = _prompt_logits(engine, prompt)[rows]
            mine.append(float(np.abs(out - case198["ensemble_f64"][k - 1].astype(np.float64)).max()))
    finally:
        engine.params = params
    mine = np.array(mine)
    ratio = float(np.sqrt(np.mean(mine**2) / np.mean(hf_ens**2)))
    # measured: RMS ratio 0.79 (cpu), 1.13 (reference)
    assert ratio <= 2.0, (f"{target}: over {len(mine)} one-ulp embedding perturbations qcompile's distance to "
                          f"float64 is {ratio:.2f}x transformers fp32's (root mean squares; median {np.median(mine):.3g} "
                          f"vs {np.median(hf_ens):.3g})")
