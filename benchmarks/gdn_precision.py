"""fp32 precision of the Gated DeltaNet against float64 on tests/fixtures/precision_gdn_qwen3_next (issue 11, item 2).

    python benchmarks/gdn_precision.py [--fixture DIR] [--hf] [--before] [--write-true-f64]

Prints max |logit − float64| of qcompile's prompt logits for each GDN form (chunked, recurrent, auto) and lowering
target (reference, cpu), against the fixture's `logits_f64` and against a genuine float64 forward
(`reference_true_f64.npz`); then a kernel-level table: each form in f32 against a float64 recurrence on inputs with
strongly negative gates, including the former prefix-difference decays of the chunked form.

The fixture's `logits_f64` come from transformers with dtype float64, whose Qwen3-Next still computes its RMSNorm,
gated RMSNorm and GDN core (torch_chunk_gated_delta_rule) in float32. --write-true-f64 runs transformers with those
three patched to stay in float64 and writes `reference_true_f64.npz` (prompt, logits_f64); --hf also prints
transformers' own fp32 logits, with its chunked GDN as is and with segment-summed decays. Both need transformers.
--before also runs qcompile's chunked forms with the former prefix-difference decays.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("QCOMPILE_CACHE_DIR", "off")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from qcompile.kernels import gdn  # noqa: E402

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "precision_gdn_qwen3_next"


# -- qcompile end to end --------------------------------------------------------------------------------------------

def qc_logits(path: Path, prompt: list[int], mode: str, target: str, _models: dict = {}) -> np.ndarray:
    from qcompile.ir.abi import CacheConfig
    from qcompile.runtime.model import load_model

    if mode not in _models:
        _models[mode] = load_model(path, None, gdn_mode=mode, progress=False)
    engine = _models[mode].engine(CacheConfig(max_seqs=2, max_context=len(prompt)), target)
    seq = engine.add_sequence()
    return engine.step([(seq, prompt)], all_logits=True)[0]


# -- transformers in genuine float64 --------------------------------------------------------------------------------

def _oracle():
    """tests/hf_oracle.py: the suite's transformers loader (fresh parameter memory, genuine float64)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import hf_oracle

    return hf_oracle


def true_float64_logits(path: Path, prompt: list[int]) -> np.ndarray:
    """transformers in genuine float64: the test oracle's float64 mode (tests/hf_oracle.py, _install_genuine_float64:
    RMSNorm, gated RMSNorm and GDN core kept in float64, the GDN core as the token-by-token recurrence)."""
    return _oracle().hf_logits(path, prompt, dtype="float64")


def hf_f32_logits(path: Path, prompt: list[int], segment_sums: bool) -> np.ndarray:
    """transformers' fp32 logits; segment_sums: its chunked GDN with the decays summed per segment (our fix)."""
    import inspect

    import torch
    import transformers.models.qwen3_next.modeling_qwen3_next as hf

    saved = hf.torch_chunk_gated_delta_rule
    if segment_sums:
        src = inspect.getsource(saved)
        edits = [("pairwise_decay = cum_decay.unsqueeze(4) - cum_decay.unsqueeze(3)",
                  "pairwise_decay = torch.where(torch.ones(chunk_size, chunk_size, dtype=torch.bool).tril(-1), "
                  "decay.unsqueeze(-1), 0.0).cumsum(dim=-2)"),
                 ("pairwise_decay = pairwise_decay.exp()",
                  "log_decay_to_end = pairwise_decay[..., -1, :]\n    pairwise_decay = pairwise_decay.exp()"),
                 ("(cum_decay[..., -1:] - cum_decay).exp()", "log_decay_to_end.exp()")]
        for old, new in edits:
            assert old in src, f"transformers' torch_chunk_gated_delta_rule changed: {old!r} not found"
            src = src.replace(old, new)
        namespace = dict(vars(hf))
        exec(src, namespace)
        hf.torch_chunk_gated_delta_rule = namespace[saved.__name__]
    try:
        model = _oracle().hf_load(path, "float32")
        with torch.no_grad():
            return model(input_ids=torch.tensor([prompt]), use_cache=False).logits[0].double().numpy()
    finally:
        hf.torch_chunk_gated_delta_rule = saved


# -- kernel level ---------------------------------------------------------------------------------------------------

def _prefix_difference_chunk(s, q, k, v, g, beta):
    """The chunked solve as it was: Γ_ij = exp(γ_i − γ_j) from the prefix sums γ (for comparison only)."""
    mm = gdn._mm
    size = q.shape[0]
    gamma = jnp.cumsum(g, axis=0)
    diff = gamma[:, None, :] - gamma[None, :, :]
    causal = jnp.tril(jnp.ones((size, size), bool))[:, :, None]
    decay = jnp.where(causal, jnp.exp(jnp.where(causal, diff, 0.0)), 0.0)
    strict = jnp.tril(jnp.ones((size, size), bool), -1)[:, :, None]
    a = jnp.where(strict, beta[:, None, :] * mm("ihd,jhd->ijh", k, k) * decay, 0.0)
    system = jnp.moveaxis(jnp.eye(size, dtype=jnp.float32)[:, :, None] + a, 2, 0)
    rhs = jnp.concatenate([beta[..., None] * v, (beta * jnp.exp(gamma))[..., None] * k], axis=-1)
    sol = jax.scipy.linalg.solve_triangular(system, jnp.moveaxis(rhs, 1, 0), lower=True, unit_diagonal=True)
    dv = v.shape[-1]
    u, w = jnp.moveaxis(sol[..., :dv], 0, 1), jnp.moveaxis(sol[..., dv:], 0, 1)
    v_new = u - mm("chk,hkv->chv", w, s)
    out = mm("chk,hkv->chv", q * jnp.exp(gamma)[..., None], s) + mm("ijh,jhv->ihv", mm("ihk,jhk->ijh", q, k) * decay, v_new)
    last = gamma[-1]
    s_new = s * jnp.exp(last)[:, None, None] + mm("chk,chv->hkv", k * jnp.exp(last[None, :] - gamma)[..., None], v_new)
    return out, s_new


def _prefix_difference_chunked(*args, chunk=64):
    current = gdn._solve_chunk
    gdn._solve_chunk = _prefix_difference_chunk
    try:
        return gdn.gdn_chunked_reference(*args, chunk=chunk)
    finally:
        gdn._solve_chunk = current


def kernel_table(seeds: int = 3) -> None:
    print("\nkernel level: one 64-token sequence, 4 heads, dk = dv = 16, g ~ U(-30, -1), beta ~ U(0.1, 0.9);"
          "\nmax |o - float64 recurrence| (|o| ≤ ~0.4)")
    forms = {"chunked, prefix-difference decays (before)": lambda *a: _prefix_difference_chunked(*a),
             "chunked, segment-sum decays (now)": gdn.gdn_chunked_reference,
             "recurrent": gdn.gdn_recurrent_reference}
    errors = {name: [] for name in forms}
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        length, heads, d = 64, 4, 16
        q = rng.standard_normal((length, heads, d))
        q = q / np.linalg.norm(q, axis=-1, keepdims=True) * d**-0.5
        k = rng.standard_normal((length, heads, d))
        k = k / np.linalg.norm(k, axis=-1, keepdims=True)
        v = rng.standard_normal((length, heads, d))
        g, beta = -rng.uniform(1.0, 30.0, (length, heads)), rng.uniform(0.1, 0.9, (length, heads))
        q, k, v, g, beta = (x.astype(np.float32) for x in (q, k, v, g, beta))
        s = np.zeros((heads, d, d))
        exact = np.zeros(v.shape)
        for t in range(length):  # float64, numpy (keeps subnormals)
            s = s * np.exp(np.float64(g[t]))[:, None, None]
            s = s + k[t][:, :, None] * (beta[t][:, None] * (v[t] - np.einsum("hkv,hk->hv", s, k[t])))[:, None, :]
            exact[t] = np.einsum("hkv,hk->hv", s, q[t])
        args = [jnp.asarray(x) for x in (q, k, v, g, beta)] + [
            jnp.zeros((1, heads, d, d), jnp.float32), jnp.array([0, length], jnp.int32), jnp.array([0], jnp.int32)]
        for name, fn in forms.items():
            errors[name].append(float(np.abs(np.asarray(jax.jit(fn)(*args)[0], np.float64) - exact).max()))
    for name, errs in errors.items():
        print(f"  {name:44s} " + "  ".join(f"{e:.3g}" for e in errs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fixture", type=Path, default=FIXTURE)
    parser.add_argument("--hf", action="store_true", help="also run transformers (fp32 as is / with segment sums)")
    parser.add_argument("--before", action="store_true",
                        help="also qcompile with the chunked form's former prefix-difference decays")
    parser.add_argument("--write-true-f64", action="store_true",
                        help="compute the genuine float64 logits with transformers and write reference_true_f64.npz")
    args = parser.parse_args()
    ref = np.load(args.fixture / "reference.npz")
    prompt = [int(x) for x in ref["prompt"]]
    true_path = args.fixture / "reference_true_f64.npz"
    if args.write_true_f64:
        logits = true_float64_logits(args.fixture, prompt)
        np.savez(true_path, prompt=ref["prompt"], logits_f64=logits)
        print(f"wrote {true_path}")
    true = np.load(true_path)["logits_f64"]

    def dist(x, y):
        return float(np.abs(np.asarray(x, np.float64) - y).max())

    f64, hf32 = ref["logits_f64"], ref["logits_hf_f32"]
    print(f"max |logit - float64| on {args.fixture.name} (max |logit| {np.abs(true).max():.2f}); "
          "columns: vs the fixture's logits_f64 | vs genuine float64")
    print(f"  {'fixture logits_f64 (transformers, float32 norms + GDN core)':62s} {0.0:9.3g} | {dist(f64, true):9.3g}")
    print(f"  {'fixture logits_hf_f32 (transformers fp32)':62s} {dist(hf32, f64):9.3g} | {dist(hf32, true):9.3g}")
    if args.hf:
        for segment_sums in (False, True):
            lg = hf_f32_logits(args.fixture, prompt, segment_sums)
            what = "segment-sum decays" if segment_sums else "as is"
            print(f"  {'transformers fp32 here, chunked GDN ' + what:62s} {dist(lg, f64):9.3g} | {dist(lg, true):9.3g}")
    for mode in ("chunked", "recurrent", "auto"):
        for target in ("reference", "cpu"):
            lg = qc_logits(args.fixture, prompt, mode, target)
            print(f"  {f'qcompile gdn_mode={mode}, target={target}':62s} {dist(lg, f64):9.3g} | {dist(lg, true):9.3g}")
    if args.before:
        current, gdn._solve_chunk = gdn._solve_chunk, _prefix_difference_chunk
        try:
            for mode, target in (("chunked", "reference"), ("chunked", "cpu"), ("auto", "reference")):
                jax.clear_caches()
                lg = qc_logits(args.fixture, prompt, mode, target, {})
                name = f"qcompile gdn_mode={mode}, target={target}, before"
                print(f"  {name:62s} {dist(lg, f64):9.3g} | {dist(lg, true):9.3g}")
        finally:
            gdn._solve_chunk = current
    kernel_table()


if __name__ == "__main__":
    sys.exit(main())
