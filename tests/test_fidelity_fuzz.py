"""Random-config fidelity: random tiny models of both families, built by transformers and saved in random Hub layouts.

Each example (strategies.hf_cases) is a config transformers builds and saves, optionally re-packaged like the Hub
(shards, index, dummy mtp.* tensors, legacy config keys), and a prompt of 1–130 tokens (across the GDN chunk of 64
and the engine's token buckets). qcompile's prompt logits must be within the fp32 bound of transformers' (1e-4 of the
largest logit, as in test_fidelity), and its greedy tokens and their logits must be transformers'. Where the fp32
results disagree, a genuine float64 forward decides (hf_oracle's float64: experts_implementation="eager" and
transformers' internal float32 casts removed): qcompile passes when it is within the bound of float64, or no further
from float64 than 1.5x transformers' own fp32 (a model that amplifies rounding beyond the bound); a greedy token may
differ only where float64's top-2 margin is within twice the bound (a tie fp32 cannot resolve), and nothing is
compared after such a tie. When one sample each cannot decide (qcompile further from float64 than 1.5x transformers'
fp32 on a model that amplifies rounding ~10³-fold), `spread_test` compares the two over 24 one-ulp perturbations of the
embedding table: about 1 case in 200 needs it (tests/test_fuzz_regressions.py pins the one found).

The oracle is the class that wrote the checkpoint (config.json's `architectures`), so tied Qwen3.5 wrappers are
judged by the class that ties them. Configs transformers itself cannot run are filtered out (Hypothesis `assume`),
never counted as passes.

Example counts: QCOMPILE_FUZZ_EXAMPLES (default 3 in the default suite); the slow tier runs
QCOMPILE_FUZZ_SLOW_EXAMPLES (default 200). Hypothesis prints the failing case, its seed and a reproduction blob.
QCOMPILE_FUZZ_LOG=FILE appends one JSON line per example (case and result) for the record in docs/fidelity.md.
"""

from __future__ import annotations

import gc
import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, note, settings

import hf_oracle
from strategies import hf_cases, transformers_cannot_run
from qcompile.ir.abi import CacheConfig
from qcompile.ir.weights import load_params
from qcompile.runtime.model import load_model

REL_BOUND = 1e-4
DECODE_STEPS = 4
DEFAULT_EXAMPLES = int(os.environ.get("QCOMPILE_FUZZ_EXAMPLES", "3"))
SLOW_EXAMPLES = int(os.environ.get("QCOMPILE_FUZZ_SLOW_EXAMPLES", "200"))
SUPPRESS = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large,
            HealthCheck.filter_too_much]


def write_case(case: dict, root) -> "os.PathLike":
    """The case's checkpoint: saved by transformers, then re-packaged Hub-style when it asks for shards."""
    made = hf_oracle.make_hf_checkpoint(root / "saved", case["family"], seed=case["seed"],
                                        overrides=case["overrides"], stacked_experts=case["stacked_experts"],
                                        wrapper_tie=case["wrapper_tie"])
    if case["shards"] == 1:
        return made
    return hf_oracle.reshard_hub_style(made, root / "hub", n_shards=case["shards"], legacy_config=case["legacy_config"])


ENSEMBLE = 24  # one-ulp embedding perturbations for the spread test


def within_float64(ours, fp32, f64, bound: float, what: str) -> tuple[float, float]:
    """Where fp32 results disagree: ours must be within the bound of float64, or at least about as close to it as
    transformers' own fp32 (1.5x: issue 11's criterion) on a model that amplifies rounding beyond the bound. Returns
    (ours, transformers) distances to float64; raises Sensitive when only the spread test can decide."""
    ours64, hf64 = float(np.abs(ours - f64).max()), float(np.abs(fp32 - f64).max())
    if ours64 > max(bound, 1.5 * hf64):
        raise Sensitive(ours64, hf64, what)
    return ours64, hf64


def with_table(model, table) -> dict:
    """`model`'s parameters with the embedding table replaced — and the head, where the checkpoint ties it (the
    head's checkpoint name reads the table's tensor) — and every prepared array remade from them (the plain parameters
    reused, the prepared ones computed again: a tied head laid out in panels is one)."""
    refs = model.checkpoint.params
    tied = refs["lm_head"].sources == refs["embed_tokens"].sources
    recipes = model.graph.meta.get("prepared", {})
    plain = {name: array for name, array in model.params.items() if name not in recipes}
    return load_params(model.checkpoint, model.graph, progress=False,
                       loaded={**plain, "embed_tokens": table, **({"lm_head": table} if tied else {})})


class Sensitive(Exception):
    """One fp32 sample each cannot decide: the model amplifies rounding, and whose error lands closer is luck."""

    def __init__(self, ours64: float, hf64: float, what: str):
        super().__init__(what)
        self.ours64, self.hf64, self.what = ours64, hf64, what


def spread_test(path, model, engine, ids: list[int], rows: slice, failed: Sensitive, bound: float) -> dict:
    """Judge qcompile against transformers fp32's spread instead of one sample (tests/test_fuzz_regressions.py has
    the analysis of the case that needed it): ENSEMBLE runs with the embedding table changed by ~1 ulp
    (hf_oracle.perturbed_table; `with_table` remakes a tied head with it, prepared or not), each against its own
    genuine float64 forward, on the logits of `rows` of `ids`. Pass when ours unperturbed is within 1.5x the largest transformers distance seen and
    the root mean square of ours over the ensemble is at most 2x transformers'. A precision defect shifts the whole
    distribution; luck does not."""
    import torch

    m32 = hf_oracle.hf_load(path, "float32", by_architecture=True)
    m64 = hf_oracle.hf_load(path, "float64", by_architecture=True)
    emb32, emb64 = m32.get_input_embeddings().weight, m64.get_input_embeddings().weight
    table = emb32.detach().numpy().copy()
    params = model.params
    tokens = torch.tensor([ids])
    ours_runs, hf_runs = [], []
    try:
        with torch.no_grad():
            for k in range(1, ENSEMBLE + 1):
                t = hf_oracle.perturbed_table(table, k)
                emb32.copy_(torch.from_numpy(t))
                emb64.copy_(torch.from_numpy(t).double())
                f64 = m64(input_ids=tokens, use_cache=False).logits[0, rows].double().numpy()
                hf32 = m32(input_ids=tokens, use_cache=False).logits[0, rows].double().numpy()
                engine.params = with_table(model, jnp.asarray(t))
                seq = engine.add_sequence()
                ours = np.asarray(engine.step([(seq, ids)], all_logits=True)[0], np.float64)[rows]
                engine.release(seq)
                ours_runs.append(float(np.abs(ours - f64).max()))
                hf_runs.append(float(np.abs(hf32 - f64).max()))
    finally:
        engine.params = params
        with torch.no_grad():
            emb32.copy_(torch.from_numpy(table))
            emb64.copy_(torch.from_numpy(table).double())
    ours_runs, hf_runs = np.array(ours_runs), np.array(hf_runs)
    widest = max(failed.hf64, float(hf_runs.max()))
    rms_ratio = float(np.sqrt(np.mean(ours_runs**2) / max(np.mean(hf_runs**2), 1e-300)))
    assert failed.ours64 <= max(bound, 1.5 * widest) and rms_ratio <= 2.0, (
        f"{failed.what}: {failed.ours64:.3g} from float64 where transformers fp32 is {failed.hf64:.3g} (widest over "
        f"{ENSEMBLE} one-ulp embedding perturbations {widest:.3g}); RMS over them ours/transformers {rms_ratio:.2f} "
        f"(limit 2)")
    return {"what": failed.what, "ours64": failed.ours64, "hf64": failed.hf64, "widest_hf64": widest,
            "rms_ratio": rms_ratio}


def check_case(case: dict, root) -> dict:
    """Compare one case with transformers; returns what was compared (for the caller's note and the fuzz log)."""
    path = write_case(case, root)
    vocab = case["overrides"]["vocab_size"]
    prompt = [int(x) for x in np.random.default_rng(case["seed"]).integers(3, vocab, case["prompt_len"])]
    model = load_model(path, progress=False)
    engine = model.engine(CacheConfig(max_seqs=2, max_context=256))
    out = engine.generate([prompt], DECODE_STEPS, prompt_logits=True, step_logits=True)
    ours_prompt, ours_tokens, ours_steps = out["prompt_logits"][0], out["tokens"][0], out["step_logits"][0]

    ref = hf_oracle.hf_logits(path, prompt, by_architecture=True)
    bound = REL_BOUND * max(1.0, float(np.abs(ref).max()))
    err = float(np.abs(ours_prompt - ref).max())
    report = {"prompt_err": err, "bound": bound, "judged_by_f64": [], "tie_at": None}
    if err > bound:  # in doubt: a genuine float64 forward decides whose fp32 error this is
        f64 = hf_oracle.hf_logits(path, prompt, dtype="float64", by_architecture=True)
        try:
            report["judged_by_f64"].append(("prompt", *within_float64(ours_prompt, ref, f64, bound, "prompt logits")))
        except Sensitive as failed:
            report["spread"] = spread_test(path, model, engine, prompt, slice(None), failed, bound)

    ref_tokens, ref_steps = hf_oracle.hf_greedy(path, prompt, DECODE_STEPS, by_architecture=True)
    f64_tokens = f64_steps = None
    for i, (mine, theirs) in enumerate(zip(ours_tokens, ref_tokens)):
        step_err = float(np.abs(ours_steps[i] - ref_steps[i]).max())
        if mine == theirs and step_err <= bound:
            continue
        if f64_steps is None:
            f64_tokens, f64_steps = hf_oracle.hf_greedy(path, prompt, DECODE_STEPS, dtype="float64",
                                                        by_architecture=True)
        if f64_tokens[:i] != ours_tokens[:i]:
            report["float64_diverged_at"] = i  # a tie both fp32 runs resolved alike: nothing comparable left
            break
        if mine == theirs:
            try:
                report["judged_by_f64"].append((f"step {i}", *within_float64(ours_steps[i], ref_steps[i],
                                                                             f64_steps[i], bound, f"decode step {i}")))
            except Sensitive as failed:  # decode step i's logits = the last row of prompt + tokens[:i], teacher-forced
                ids = prompt + ours_tokens[:i]
                report["spread"] = spread_test(path, model, engine, ids, slice(len(ids) - 1, len(ids)), failed,
                                               bound)
            continue
        top2 = np.sort(np.asarray(f64_steps[i], np.float64))[-2:]
        margin = float(top2[1] - top2[0])
        assert margin <= 2 * bound, (f"greedy token {i}: ours {mine}, transformers {theirs}, float64 {f64_tokens[i]}, "
                                     f"whose top-2 margin {margin:.3g} is no tie (bound {bound:.3g})")
        report["tie_at"] = i
        break  # after a tie the two continue from different tokens: nothing left to compare
    del model, engine
    return report


def run_case(case: dict, tmp_path_factory) -> None:
    why_not = transformers_cannot_run(case)
    note(f"case: {case}")
    assume(why_not is None)
    root = tmp_path_factory.mktemp("fuzz")
    result = {"error": "failed"}
    try:
        result = check_case(case, root)
        note(f"result: {result}")
    finally:
        if os.environ.get("QCOMPILE_FUZZ_LOG"):
            with open(os.environ["QCOMPILE_FUZZ_LOG"], "a") as log:
                log.write(json.dumps({"case": case, "result": result}) + "\n")
        shutil.rmtree(root, ignore_errors=True)
        hf_oracle.clear_cache()
        import jax

        from qcompile.runtime.memory import clear_compiled

        jax.clear_caches()  # every example compiles new shapes: keep the process's executable mappings bounded
        clear_compiled()
        gc.collect()


@settings(max_examples=DEFAULT_EXAMPLES, deadline=None, derandomize=True, print_blob=True,
          suppress_health_check=SUPPRESS)
@given(case=hf_cases())
def test_random_configs_and_layouts_match_transformers(case, tmp_path_factory):
    run_case(case, tmp_path_factory)


@pytest.mark.slow
@settings(max_examples=SLOW_EXAMPLES, deadline=None, print_blob=True, suppress_health_check=SUPPRESS)
@given(case=hf_cases())
def test_many_random_configs_and_layouts_match_transformers(case, tmp_path_factory):
    run_case(case, tmp_path_factory)


def test_the_spread_test_changes_a_tied_head_laid_out_in_panels(tmp_path):
    """spread_test changes the embedding table and must change a tied head with it — also where the cpu layout made
    the head a prepared panel array (vocab a multiple of 64), which it once missed: it set a `lm_head` parameter the
    graph no longer has, and the slow fuzz crashed on the first such Sensitive case (Qwen3-Next, vocab 512, tied,
    seed 764; that case passes the spread test: 2.0e-3 from float64 where transformers fp32 spans up to 5.2e-3, RMS
    ratio 0.73). Here: the weight preparation remakes exactly the table and the prepared head, and the spread test
    runs end to end on that model."""
    case = {"family": "qwen3_next", "overrides": {
        "vocab_size": 512, "hidden_size": 32, "num_hidden_layers": 2, "layer_types": ["linear_attention",
                                                                                      "full_attention"],
        "num_key_value_heads": 1, "num_attention_heads": 1, "head_dim": 16, "linear_num_key_heads": 2,
        "linear_num_value_heads": 2, "linear_key_head_dim": 8, "linear_value_head_dim": 24, "num_experts": 2,
        "num_experts_per_tok": 1, "moe_intermediate_size": 8, "shared_expert_intermediate_size": 16,
        "tie_word_embeddings": True}, "wrapper_tie": None, "stacked_experts": False, "shards": 1,
        "legacy_config": False, "seed": 764, "prompt_len": 12}
    path = write_case(case, tmp_path)
    model = load_model(path, progress=False)
    assert "lm_head" not in model.params  # the tied head is prepared from the table (panels)
    table = np.asarray(model.params["embed_tokens"])
    remade = with_table(model, jnp.asarray(hf_oracle.perturbed_table(table, 1)))
    changed = {k for k in remade if not np.array_equal(np.asarray(remade[k]), np.asarray(model.params[k]))}
    assert "embed_tokens" in changed and len(changed) == 2, changed  # the table and the head made from it
    prompt = [int(x) for x in np.random.default_rng(764).integers(3, 512, case["prompt_len"])]
    engine = model.engine(CacheConfig(max_seqs=2, max_context=64))
    report = spread_test(path, model, engine, prompt, slice(None), Sensitive(0.0, 0.0, "prompt logits"), 1e-4)
    assert report["rms_ratio"] <= 2.0
